//! The serving entry points called from many threads at once give the bits of the same calls
//! made one at a time: every thread reads the same packed batch and the same dense and paged
//! caches (read-only, shared), and appends to a cache of its own (writable, distinct), with
//! `cpu_threads` 1, 2 and 4 inside each call and forced and heuristic split counts.


use flash_attn::serving::{
    forward_kvcache, forward_kvcache_append, forward_varlen, forward_varlen_kvcache, BlockTable, KvCache, KvCacheMut,
    Varlen,
};
use flash_attn::{DType, ForwardOptions, Mask, Output, Tensor, TensorView};
use half::bf16;
use crate::support::serving::{slopes, values, Rng};
use std::sync::Barrier;

const THREADS: usize = 8;
const ROUNDS: usize = 3;
const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 64;

/// The read-only inputs every thread shares.
struct Shared {
    /// Packed batch: q `[1, 30, HQ, D]`, k and v `[1, 921, HKV, D]` (f32).
    q_packed: Tensor,
    k_packed: Tensor,
    v_packed: Tensor,
    cu_q: Vec<i32>,
    cu_k: Vec<i32>,
    /// Dense cache `[2, 1100, HKV, D]` and paged cache `[blocks, 16, HKV, D]` (bf16), their
    /// lengths and the paged one's table (shuffled, the first pages shared by all sequences).
    dense_k: Vec<bf16>,
    dense_v: Vec<bf16>,
    dense_lens: Vec<i32>,
    paged_k: Vec<bf16>,
    paged_v: Vec<bf16>,
    paged_shape: [usize; 4],
    paged_lens: Vec<i32>,
    table: Vec<i32>,
    max_blocks: usize,
    /// Decode and chunk queries over the caches (bf16), a packed chunk over the paged cache.
    q_decode: Tensor,
    q_chunk: Tensor,
    q_paged_packed: Tensor,
    cu_q_paged: Vec<i32>,
    /// Each thread's own writable cache starts as this (dense, bf16), with these new rows.
    append_k: Vec<bf16>,
    append_v: Vec<bf16>,
    append_lens: Vec<i32>,
    k_new: Tensor,
    v_new: Tensor,
}

fn bf16s(rng: &mut Rng, n: usize) -> Vec<bf16> {
    values(rng, n, DType::BF16).into_iter().map(bf16::from_f32).collect()
}

fn shared() -> Shared {
    let mut rng = Rng::new(2026);
    let (row, page) = (HKV * D, 16);
    let cu_q = vec![0, 1, 6, 26, 26, 30];
    let cu_k = vec![0, 300, 317, 917, 917, 921];
    let f32s = |rng: &mut Rng, shape: [usize; 4]| {
        Tensor::from_f32(&values(rng, shape.iter().product(), DType::F32), DType::F32, shape).unwrap()
    };
    let bf16_t = |rng: &mut Rng, shape: [usize; 4]| {
        Tensor::from_f32(&values(rng, shape.iter().product(), DType::BF16), DType::BF16, shape).unwrap()
    };
    let paged_lens = vec![700, 1300, 45];
    let pages: Vec<usize> = paged_lens.iter().map(|&l| (l as usize).div_ceil(page)).collect();
    let max_blocks = pages.iter().copied().max().unwrap();
    let (shared_pages, batch) = (20, paged_lens.len());
    let num_blocks = shared_pages + pages.iter().map(|p| p - shared_pages.min(*p)).sum::<usize>();
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    rng.shuffle(&mut ids);
    let mut next = ids.into_iter();
    let prefix: Vec<i32> = (0..shared_pages).map(|_| next.next().unwrap()).collect();
    let mut table = vec![-1; batch * max_blocks];
    for b in 0..batch {
        for p in 0..pages[b] {
            table[b * max_blocks + p] = if p < shared_pages {
                prefix[p]
            } else {
                next.next().unwrap()
            };
        }
    }
    Shared {
        q_packed: f32s(&mut rng, [1, 30, HQ, D]),
        k_packed: f32s(&mut rng, [1, 921, HKV, D]),
        v_packed: f32s(&mut rng, [1, 921, HKV, D]),
        cu_q,
        cu_k,
        dense_k: bf16s(&mut rng, 2 * 1100 * row),
        dense_v: bf16s(&mut rng, 2 * 1100 * row),
        dense_lens: vec![1100, 37],
        paged_k: bf16s(&mut rng, num_blocks * page * row),
        paged_v: bf16s(&mut rng, num_blocks * page * row),
        paged_shape: [num_blocks, page, HKV, D],
        paged_lens,
        table,
        max_blocks,
        q_decode: bf16_t(&mut rng, [3, 1, HQ, D]),
        q_chunk: bf16_t(&mut rng, [2, 5, HQ, D]),
        q_paged_packed: bf16_t(&mut rng, [1, 24, HQ, D]),
        cu_q_paged: vec![0, 1, 21, 24],
        append_k: bf16s(&mut rng, 2 * 600 * row),
        append_v: bf16s(&mut rng, 2 * 600 * row),
        append_lens: vec![590, 3],
        k_new: bf16_t(&mut rng, [2, 3, HKV, D]),
        v_new: bf16_t(&mut rng, [2, 3, HKV, D]),
    }
}

/// One call's result: output and LSE bits, and the appended cache (for an append).
#[derive(Debug, PartialEq)]
struct Bits {
    o: Vec<u32>,
    lse: Option<Vec<u32>>,
    cache: Option<(Vec<u16>, Vec<u16>)>,
}

fn bits(out: Output, cache: Option<(&[bf16], &[bf16])>) -> Bits {
    let u16s = |x: &[bf16]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
    Bits {
        o: out.o.to_f32_vec().iter().map(|x| x.to_bits()).collect(),
        lse: out.lse.map(|l| l.iter().map(|x| x.to_bits()).collect()),
        cache: cache.map(|(k, v)| (u16s(k), u16s(v))),
    }
}

/// The calls thread `t` makes, in order: every entry point, with options that vary by thread.
fn calls(s: &Shared, t: usize) -> Vec<Bits> {
    let threads = [1, 2, 4][t % 3];
    let mut opts = ForwardOptions::default().return_lse(true).cpu_threads(threads);
    if t % 2 == 1 {
        opts = opts.num_splits(1 + t);
    }
    let masked = opts.clone().mask(Mask::Causal).alibi_slopes(slopes(HQ));
    let dense = |k, v| {
        KvCache::dense(
            TensorView::new(k, [2, 1100, HKV, D]),
            TensorView::new(v, [2, 1100, HKV, D]),
            &s.dense_lens,
        )
    };
    let paged = KvCache::paged(
        TensorView::new(&s.paged_k, s.paged_shape),
        TensorView::new(&s.paged_v, s.paged_shape),
        &s.paged_lens,
        BlockTable {
            ids: &s.table,
            max_blocks_per_seq: s.max_blocks,
        },
    );
    let seqs = Varlen {
        cu_seqlens_q: &s.cu_q,
        cu_seqlens_k: &s.cu_k,
        max_seqlen_q: 20,
        max_seqlen_k: 600,
    };
    let mut out = vec![
        forward_varlen(&s.q_packed, &s.k_packed, &s.v_packed, &seqs, &masked).unwrap(),
        forward_kvcache(&s.q_decode, &paged, &opts).unwrap(),
        forward_kvcache(&s.q_chunk, &dense(&s.dense_k, &s.dense_v), &masked).unwrap(),
        forward_varlen_kvcache(
            &s.q_paged_packed,
            &s.cu_q_paged,
            20,
            &paged,
            &masked.clone().softcap(30.0),
        )
        .unwrap(),
    ]
    .into_iter()
    .map(|o| bits(o, None))
    .collect::<Vec<_>>();
    // This thread's own cache: two appends in a row, each then attended.
    let (mut k, mut v) = (s.append_k.clone(), s.append_v.clone());
    let q = s.q_chunk.clone();
    for step in 0..2 {
        let lens: Vec<i32> = s.append_lens.iter().map(|&l| l + 3 * step).collect();
        let mut cache = KvCacheMut {
            k: &mut k,
            v: &mut v,
            shape: [2, 600, HKV, D],
            seqlens: &lens,
            block_table: None,
            batch_idx: None,
            leftpad: None,
        };
        let r = forward_kvcache_append(&q, &mut cache, &s.k_new, &s.v_new, &masked).unwrap();
        out.push(bits(r, Some((&k, &v))));
    }
    out
}

#[test]
fn concurrent_calls_match_sequential_ones() {
    let s = shared();
    let alone: Vec<Vec<Bits>> = (0..THREADS).map(|t| calls(&s, t)).collect();
    let start = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (s, start, want) = (&s, &start, &alone[t]);
                scope.spawn(move || {
                    start.wait();
                    for round in 0..ROUNDS {
                        let got = calls(s, t);
                        for (i, (g, w)) in got.iter().zip(want).enumerate() {
                            assert!(
                                g == w,
                                "thread {t}, round {round}: call {i} differs from the same call made alone"
                            );
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
}

//! Property tests of the serving paths against the float64 reference, sequence by sequence:
//! variable-length batches (lengths 0 and 1 included), dense and paged KV caches (page sizes 1,
//! 3, 16, 256 and random ones, shuffled and shared block tables, unused cache slots poisoned
//! with NaN so a stray read shows), KV append, forced and heuristic split counts, GQA ratios,
//! every mask, softcap, ALiBi, LSE, all three dtypes, 1-3 threads.
//!
//! `cargo test --test cpu serving_props -- --nocapture` prints the largest error margin per run.

use crate::support::props;
use crate::support::cu_seqlens;
use flash_attn::serving::{
    forward_kvcache, forward_kvcache_append, forward_varlen, forward_varlen_kvcache, BlockTable, KvCache, KvCacheMut,
    Varlen,
};
use flash_attn::{DType, Element, ForwardOptions, Mask, Output, Tensor};
use proptest::prelude::*;
use crate::support::serving::{check_seq, len_strategy, opts_strategy, paged_table, rows, values, Opts, Rng, SeqCheck};

/// Runs `cases` cases of `f` and prints the worst observed margin (see [`ratio`]).
fn run<S: Strategy>(name: &str, cases: u32, strategy: S, f: impl Fn(&S::Value) -> Result<f64, TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    let config = props::config(name, file!(), cases);
    let cases = config.cases;
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let worst = std::cell::Cell::new(0.0f64);
    let result = runner.run(&strategy, |c| {
        worst.set(worst.get().max(f(&c)?));
        Ok(())
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    println!(
        "{name}: {cases} cases passed; max err / (2·naive_err + floor) {:.3}",
        worst.get()
    );
}

/// The margin used: err / (2·naive_err + floor), at most 1 for a passing sequence.
fn ratio(c: &SeqCheck, dtype: DType) -> f64 {
    c.err / (2.0 * c.naive_err + crate::support::floor_for(dtype))
}

// ---------------------------------------------------------------- variable-length batches

fn varlen_case(o: &Opts, lens_q: &[usize], lens_k: &[usize], dtype: DType) -> Result<f64, TestCaseError> {
    let (hq, hkv, d) = (o.hq(), o.heads_kv, o.d);
    let (cu_q, cu_k) = (cu_seqlens(lens_q), cu_seqlens(lens_k));
    let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
    let mut rng = Rng::new(o.seed | 1);
    let (qv, kv, vv) = (
        values(&mut rng, tq * hq * d, dtype),
        values(&mut rng, tk * hkv * d, dtype),
        values(&mut rng, tk * hkv * d, dtype),
    );
    let q = Tensor::from_f32(&qv, dtype, [1, tq, hq, d]).unwrap();
    let k = Tensor::from_f32(&kv, dtype, [1, tk, hkv, d]).unwrap();
    let v = Tensor::from_f32(&vv, dtype, [1, tk, hkv, d]).unwrap();
    // max_seqlen may exceed the longest sequence (an upper bound, as in FlashAttention).
    let seqs = Varlen {
        cu_seqlens_q: &cu_q,
        cu_seqlens_k: &cu_k,
        max_seqlen_q: lens_q.iter().copied().max().unwrap_or(0) + (o.seed % 3) as usize,
        max_seqlen_k: lens_k.iter().copied().max().unwrap_or(0),
    };
    let opts = o.forward();
    let out = forward_varlen(&q, &k, &v, &seqs, &opts).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(out.o.shape(), [1, tq, hq, d]);
    // Sequences of more than 16 query rows (with keys) take the tiled path, the rest run in place.
    let tiled = lens_q.iter().zip(lens_k).any(|(&q, &k)| q > 16 && k > 0);
    prop_assert_eq!(out.dispatch.kernel.contains(" + "), tiled, "{:?}", out.dispatch);
    prop_assert_eq!(out.lse.as_ref().map(|l| l.len()), o.lse.then_some(hq * tq));
    let ov = out.o.to_f32_vec();
    let mut worst = 0.0f64;
    for b in 0..lens_q.len() {
        let (q0, q1) = (cu_q[b] as usize, cu_q[b + 1] as usize);
        let (k0, k1) = (cu_k[b] as usize, cu_k[b + 1] as usize);
        let lse_fn = |h: usize, i: usize| out.lse.as_ref().unwrap()[h * tq + q0 + i];
        let c = check_seq(
            dtype,
            (q1 - q0, k1 - k0, hq, hkv, d),
            &rows(&qv, q0, q1, hq, d),
            &rows(&kv, k0, k1, hkv, d),
            &rows(&vv, k0, k1, hkv, d),
            &opts,
            &rows(&ov, q0, q1, hq, d),
            if o.lse { Some(&lse_fn) } else { None },
        )
        .map_err(|e| TestCaseError::fail(format!("sequence {b}: {e}")))?;
        worst = worst.max(ratio(&c, dtype));
    }
    Ok(worst)
}

fn varlen_strategy() -> impl Strategy<Value = (Opts, Vec<usize>, Vec<usize>)> {
    (opts_strategy(prop::option::weighted(0.3, 1usize..=6)), 1usize..=4).prop_flat_map(|(o, batch)| {
        (
            Just(o),
            prop::collection::vec(len_strategy(48), batch),
            prop::collection::vec(len_strategy(70), batch),
        )
    })
}

#[test]
fn varlen_matches_reference_per_sequence() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        run(&format!("varlen {dtype:?}"), 40, varlen_strategy(), |(o, lq, lk)| {
            varlen_case(o, lq, lk, dtype)
        });
    }
}

/// Fewer, longer sequences: several row blocks and key chunks per item, prefill-sized.
#[test]
fn varlen_long_sequences() {
    let long = (opts_strategy(prop::option::weighted(0.3, 1usize..=6)), 1usize..=2).prop_flat_map(|(o, batch)| {
        (
            Just(o),
            prop::collection::vec(0usize..=300, batch),
            prop::collection::vec(0usize..=400, batch),
        )
    });
    run("varlen long F32", 12, long, |(o, lq, lk)| {
        varlen_case(o, lq, lk, DType::F32)
    });
}

// ---------------------------------------------------------------- KV caches (dense and paged)

#[derive(Debug, Clone)]
struct CacheCase {
    opts: Opts,
    /// Keys already cached per sequence.
    lens: Vec<usize>,
    /// Rows appended by this call (0: read only).
    new: usize,
    /// Query rows per sequence (dense q), or `None` for a packed q with these lengths.
    sq: usize,
    varlen_q: Option<Vec<usize>>,
    /// `None`: a dense cache.
    page_size: Option<usize>,
    share: bool,
    spare_blocks: usize,
    extra_table: usize,
}

fn cache_strategy() -> impl Strategy<Value = CacheCase> {
    let page = prop_oneof![
        1 => Just(None),
        4 => prop::sample::select(vec![1usize, 3, 16, 256]).prop_map(Some),
        2 => (1usize..=40).prop_map(Some),
    ];
    (
        opts_strategy(prop::option::weighted(0.3, 1usize..=6)),
        1usize..=4,
        page,
        (
            0usize..=3,
            1usize..=4,
            any::<bool>(),
            0usize..=3,
            0usize..=2,
            any::<bool>(),
        ),
    )
        .prop_flat_map(
            |(opts, batch, page_size, (new, sq, share, spare_blocks, extra_table, packed))| {
                let lens = prop::collection::vec(len_strategy(300), batch);
                let vq = if packed && new == 0 {
                    prop::collection::vec(len_strategy(20), batch).prop_map(Some).boxed()
                } else {
                    Just(None).boxed()
                };
                (Just(opts), lens, vq).prop_map(move |(opts, lens, varlen_q)| CacheCase {
                    opts,
                    lens,
                    new,
                    sq,
                    varlen_q,
                    page_size,
                    share,
                    spare_blocks,
                    extra_table,
                })
            },
        )
}

/// A cache filled with NaN, its logical contents per sequence, and the table.
struct Built<T> {
    k: Vec<T>,
    v: Vec<T>,
    shape: [usize; 4],
    table: Vec<i32>,
    max_blocks: usize,
    /// Logical K, V per sequence `[len + new][hkv][d]` (what attention must see).
    logical_k: Vec<Vec<f32>>,
    logical_v: Vec<Vec<f32>>,
    k_new: Vec<f32>,
    v_new: Vec<f32>,
}

fn build_cache<T: Element>(c: &CacheCase, rng: &mut Rng, dtype: DType) -> Built<T> {
    let (hkv, d) = (c.opts.heads_kv, c.opts.d);
    let row = hkv * d;
    let batch = c.lens.len();
    let mut logical_k: Vec<Vec<f32>> = c.lens.iter().map(|&l| values(rng, (l + c.new) * row, dtype)).collect();
    let mut logical_v: Vec<Vec<f32>> = c.lens.iter().map(|&l| values(rng, (l + c.new) * row, dtype)).collect();
    let nan = T::from_f32(f32::NAN);
    let (shape, table, max_blocks) = match c.page_size {
        None => {
            let cap = c.lens.iter().map(|l| l + c.new).max().unwrap_or(0) + c.extra_table;
            ([batch, cap, hkv, d], Vec::new(), 0)
        }
        Some(ps) => {
            let t = paged_table(&c.lens, c.new, ps, c.share, (c.spare_blocks, c.extra_table), rng);
            for b in 0..batch {
                let n = t.shared[b] * ps * row;
                let (src_k, src_v) = (logical_k[0][..n].to_vec(), logical_v[0][..n].to_vec());
                logical_k[b][..n].copy_from_slice(&src_k);
                logical_v[b][..n].copy_from_slice(&src_v);
            }
            ([t.num_blocks.max(1), ps, hkv, d], t.ids, t.width)
        }
    };
    let n: usize = shape.iter().product();
    let (mut k, mut v) = (vec![nan; n], vec![nan; n]);
    let slot = |b: usize, j: usize| -> usize {
        match c.page_size {
            None => (b * shape[1] + j) * row,
            Some(ps) => (table[b * max_blocks + j / ps] as usize * ps + j % ps) * row,
        }
    };
    for b in 0..batch {
        for j in 0..c.lens[b] {
            for x in 0..row {
                k[slot(b, j) + x] = T::from_f32(logical_k[b][j * row + x]);
                v[slot(b, j) + x] = T::from_f32(logical_v[b][j * row + x]);
            }
        }
    }
    let mut k_new = Vec::with_capacity(batch * c.new * row);
    let mut v_new = Vec::with_capacity(batch * c.new * row);
    for b in 0..batch {
        let r = c.lens[b] * row..(c.lens[b] + c.new) * row;
        k_new.extend_from_slice(&logical_k[b][r.clone()]);
        v_new.extend_from_slice(&logical_v[b][r]);
    }
    Built {
        k,
        v,
        shape,
        table,
        max_blocks,
        logical_k,
        logical_v,
        k_new,
        v_new,
    }
}

fn cache_case_typed<T: Element>(c: &CacheCase, dtype: DType) -> Result<f64, TestCaseError> {
    let o = &c.opts;
    let (hq, hkv, d) = (o.hq(), o.heads_kv, o.d);
    let batch = c.lens.len();
    let mut rng = Rng::new(o.seed | 1);
    let mut built = build_cache::<T>(c, &mut rng, dtype);
    let seqlens: Vec<i32> = c.lens.iter().map(|&l| l as i32).collect();
    let table_ids = built.table.clone();
    let table = c.page_size.map(|_| BlockTable {
        ids: &table_ids,
        max_blocks_per_seq: built.max_blocks,
    });
    let opts = o.forward();
    let fail = |e: flash_attn::Error| TestCaseError::fail(e.to_string());

    // Queries: dense [batch, sq, hq, d], or packed with per-sequence lengths.
    let q_lens: Vec<usize> = c.varlen_q.clone().unwrap_or_else(|| vec![c.sq; batch]);
    let tq: usize = q_lens.iter().sum();
    let qv = values(&mut rng, tq * hq * d, dtype);
    let cu_q: Vec<i32> = std::iter::once(0)
        .chain(q_lens.iter().scan(0i32, |a, &l| {
            *a += l as i32;
            Some(*a)
        }))
        .collect();

    let out: Output = if c.new > 0 {
        let q = Tensor::from_f32(&qv, dtype, [batch, c.sq, hq, d]).unwrap();
        let kn = Tensor::from_f32(&built.k_new, dtype, [batch, c.new, hkv, d]).unwrap();
        let vn = Tensor::from_f32(&built.v_new, dtype, [batch, c.new, hkv, d]).unwrap();
        let mut cache = KvCacheMut {
            k: &mut built.k,
            v: &mut built.v,
            shape: built.shape,
            seqlens: &seqlens,
            block_table: table,
            batch_idx: None,
            leftpad: None,
        };
        forward_kvcache_append(&q, &mut cache, &kn, &vn, &opts).map_err(fail)?
    } else {
        let kc = flash_attn::TensorView::new(&built.k, built.shape);
        let vc = flash_attn::TensorView::new(&built.v, built.shape);
        let cache = KvCache {
            k: kc,
            v: vc,
            seqlens: &seqlens,
            block_table: table,
            batch_idx: None,
            leftpad: None,
        };
        match &c.varlen_q {
            None => {
                let q = Tensor::from_f32(&qv, dtype, [batch, c.sq, hq, d]).unwrap();
                forward_kvcache(&q, &cache, &opts).map_err(fail)?
            }
            Some(l) => {
                let q = Tensor::from_f32(&qv, dtype, [1, tq, hq, d]).unwrap();
                let max = l.iter().copied().max().unwrap_or(0);
                forward_varlen_kvcache(&q, &cu_q, max, &cache, &opts).map_err(fail)?
            }
        }
    };
    // After an append the cache holds the new rows where the table says.
    if c.new > 0 {
        let row = hkv * d;
        for b in 0..batch {
            for j in c.lens[b]..c.lens[b] + c.new {
                let at = match c.page_size {
                    None => (b * built.shape[1] + j) * row,
                    Some(ps) => (built.table[b * built.max_blocks + j / ps] as usize * ps + j % ps) * row,
                };
                for x in 0..row {
                    prop_assert_eq!(
                        built.k[at + x].to_f32().to_bits(),
                        built.logical_k[b][j * row + x].to_bits()
                    );
                    prop_assert_eq!(
                        built.v[at + x].to_f32().to_bits(),
                        built.logical_v[b][j * row + x].to_bits()
                    );
                }
            }
        }
    }
    let ov = out.o.to_f32_vec();
    let mut worst = 0.0f64;
    for b in 0..batch {
        let sk = c.lens[b] + c.new;
        let (q0, q1) = (cu_q[b] as usize, cu_q[b + 1] as usize);
        let lse_fn = |h: usize, i: usize| {
            let l = out.lse.as_ref().unwrap();
            match c.varlen_q {
                None => l[(b * hq + h) * c.sq + i],
                Some(_) => l[h * tq + q0 + i],
            }
        };
        let chk = check_seq(
            dtype,
            (q1 - q0, sk, hq, hkv, d),
            &rows(&qv, q0, q1, hq, d),
            &built.logical_k[b],
            &built.logical_v[b],
            &opts,
            &rows(&ov, q0, q1, hq, d),
            if o.lse { Some(&lse_fn) } else { None },
        )
        .map_err(|e| TestCaseError::fail(format!("sequence {b}: {e} ({})", out.dispatch.reason)))?;
        worst = worst.max(ratio(&chk, dtype));
    }
    Ok(worst)
}

fn cache_case(c: &CacheCase, dtype: DType) -> Result<f64, TestCaseError> {
    match dtype {
        DType::F32 => cache_case_typed::<f32>(c, dtype),
        DType::F16 => cache_case_typed::<half::f16>(c, dtype),
        _ => cache_case_typed::<half::bf16>(c, dtype),
    }
}

#[test]
fn kv_cache_matches_reference_per_sequence() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        run(&format!("kv cache {dtype:?}"), 48, cache_strategy(), |c| {
            cache_case(c, dtype)
        });
    }
}

// ---------------------------------------------------------------- split-KV decode

/// Dense decode (seqlen_q 1, the in-place path) over long caches: every forced split count and
/// the heuristic agree with each other and with the reference.
#[test]
fn split_counts_agree_on_decode() {
    let mut rng = Rng::new(99);
    for (batch, sk, hkv, ratio, d, mask) in [
        (1, 4096, 1, 8, 128, Mask::None),
        (2, 1500, 2, 4, 64, Mask::Causal),
        (1, 2100, 1, 1, 80, Mask::causal_window(700)),
        (3, 777, 1, 3, 36, Mask::window(300, -1)),
    ] {
        let hq = hkv * ratio;
        let dtype = DType::F32;
        let qv = values(&mut rng, batch * hq * d, dtype);
        let kv = values(&mut rng, batch * sk * hkv * d, dtype);
        let vv = values(&mut rng, batch * sk * hkv * d, dtype);
        let q = Tensor::from_f32(&qv, dtype, [batch, 1, hq, d]).unwrap();
        let k = Tensor::from_f32(&kv, dtype, [batch, sk, hkv, d]).unwrap();
        let v = Tensor::from_f32(&vv, dtype, [batch, sk, hkv, d]).unwrap();
        let base = ForwardOptions::default().mask(mask).return_lse(true).cpu_threads(2);
        let one = flash_attn::forward(&q, &k, &v, &base.clone().num_splits(1)).unwrap();
        assert!(one.dispatch.kernel.starts_with("cpu-inplace"), "{:?}", one.dispatch);
        for splits in [None, Some(2), Some(3), Some(8), Some(128)] {
            let opts = match splits {
                Some(s) => base.clone().num_splits(s),
                None => base.clone(),
            };
            let out = flash_attn::forward(&q, &k, &v, &opts).unwrap();
            let (a, b) = (one.o.to_f32_vec(), out.o.to_f32_vec());
            let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(diff <= 2e-6, "splits {splits:?}: max diff {diff} against 1 split");
            let dl = one
                .lse
                .as_ref()
                .unwrap()
                .iter()
                .zip(out.lse.as_ref().unwrap())
                .map(|(x, y)| (x - y).abs());
            assert!(dl.fold(0.0f32, f32::max) <= 2e-6);
            for bi in 0..batch {
                let lse_fn = |h: usize, _i: usize| out.lse.as_ref().unwrap()[bi * hq + h];
                check_seq(
                    dtype,
                    (1, sk, hq, hkv, d),
                    &rows(&qv, bi, bi + 1, hq, d),
                    &rows(&kv, bi * sk, (bi + 1) * sk, hkv, d),
                    &rows(&vv, bi * sk, (bi + 1) * sk, hkv, d),
                    &opts,
                    &rows(&b, bi, bi + 1, hq, d),
                    Some(&lse_fn),
                )
                .unwrap();
            }
        }
        // The heuristic splits one kv head with 4096 visible keys over the two workers.
        let out = flash_attn::forward(&q, &k, &v, &base).unwrap();
        if (batch, sk, hkv) == (1, 4096, 1) {
            assert!(out.dispatch.reason.contains("2 key split"), "{}", out.dispatch.reason);
        }
    }
}

/// The dense forward with few query rows takes the in-place path; its result equals the same
/// problem through the paged API with any page size.
#[test]
fn dense_decode_equals_paged_decode() {
    let mut rng = Rng::new(5);
    let (batch, sk, hkv, hq, d) = (2, 333, 2, 8, 64);
    let dtype = DType::BF16;
    let q = Tensor::from_f32(&values(&mut rng, batch * 2 * hq * d, dtype), dtype, [batch, 2, hq, d]).unwrap();
    let kv = values(&mut rng, batch * sk * hkv * d, dtype);
    let vv = values(&mut rng, batch * sk * hkv * d, dtype);
    let k = Tensor::from_f32(&kv, dtype, [batch, sk, hkv, d]).unwrap();
    let v = Tensor::from_f32(&vv, dtype, [batch, sk, hkv, d]).unwrap();
    let opts = ForwardOptions::default().causal(true).return_lse(true);
    let dense = flash_attn::forward(&q, &k, &v, &opts).unwrap();
    assert!(dense.dispatch.kernel.starts_with("cpu-inplace"), "{:?}", dense.dispatch);
    for ps in [1usize, 3, 16, 256] {
        let pages = sk.div_ceil(ps);
        // Blocks in reverse order: sequence b's page p is block (batch·pages − 1 − (b·pages + p)).
        let nb = batch * pages;
        let mut kc = vec![half::bf16::ZERO; nb * ps * hkv * d];
        let mut vc = kc.clone();
        let mut table = vec![0i32; batch * pages];
        for b in 0..batch {
            for p in 0..pages {
                table[b * pages + p] = (nb - 1 - (b * pages + p)) as i32;
            }
            for j in 0..sk {
                let at = (table[b * pages + j / ps] as usize * ps + j % ps) * hkv * d;
                for x in 0..hkv * d {
                    kc[at + x] = half::bf16::from_f32(kv[(b * sk + j) * hkv * d + x]);
                    vc[at + x] = half::bf16::from_f32(vv[(b * sk + j) * hkv * d + x]);
                }
            }
        }
        let shape = [nb, ps, hkv, d];
        let seqlens = vec![sk as i32; batch];
        let cache = KvCache::paged(
            flash_attn::TensorView::new(&kc, shape),
            flash_attn::TensorView::new(&vc, shape),
            &seqlens,
            BlockTable {
                ids: &table,
                max_blocks_per_seq: pages,
            },
        );
        let paged = forward_kvcache(&q, &cache, &opts).unwrap();
        assert_eq!(paged.o, dense.o, "page size {ps}");
        assert_eq!(paged.lse, dense.lse, "page size {ps}");
    }
}

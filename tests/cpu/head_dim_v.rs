//! A V head_dim different from Q/K's (DeepSeek's MLA: 192/128 for prefill, 576/512 for the
//! absorbed decode; FA3's `head_dim_v`) on every CPU path against the float64 reference with
//! FlashAttention's rule: the dense forward (tiled and in-place decode paths), `forward_into`,
//! varlen, dense and paged KV caches with forced split counts, the fused append, `merge_states`
//! over v's head_dim, the backward (dense and varlen); the default softmax scale 1/sqrt(q/k's
//! head_dim); and every refusal (typed, naming what was given and expected).

use crate::support::props;
use crate::support::cu_seqlens;
use crate::support::serving::{mask_strategy, paged_table, slopes, values};
use crate::support::{check_forward, floor_for, randn, Rng};
use flash_attn::reference::{
    attention_backward_f64, attention_backward_naive, attention_f64, attention_naive, max_abs_diff,
};
use flash_attn::serving::{
    backward_varlen, forward_kvcache, forward_kvcache_append, forward_varlen, merge_states, BlockTable, KvCache,
    KvCacheMut, Varlen,
};
use flash_attn::{
    backward, backward_into, forward, forward_into, Backend, DType, Error, ForwardOptions, Mask, Operand, Problem, Tensor,
    Variant,
};
use proptest::prelude::*;

/// (q/k head_dim, v head_dim) pairs: MLA's prefill pair and its absorbed decode pair (576, 512:
/// q/k at the CPU's limit), both orders of small and large, v of one column, unaligned widths
/// (not multiples of the 6-column strips or 32-wide lanes), and the CPU's limit on v's side.
const PAIRS: [(usize, usize); 11] =
    [(192, 128), (576, 512), (64, 32), (32, 64), (40, 1), (1, 24), (72, 40), (24, 96), (128, 64), (512, 64), (16, 576)];

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![DType::F32, DType::F16, DType::BF16])
}

fn options(mask: Mask, softcap: Option<f32>, alibi: bool, hq: usize, splits: Option<usize>) -> ForwardOptions {
    let mut o = ForwardOptions::default().mask(mask).return_lse(true).cpu_threads(2).backend(Backend::Cpu);
    if let Some(c) = softcap {
        o = o.softcap(c);
    }
    if alibi {
        o = o.alibi_slopes(slopes(hq));
    }
    if let Some(s) = splits {
        o = o.num_splits(s);
    }
    o
}

#[derive(Debug, Clone)]
struct Dense {
    batch: usize,
    heads_kv: usize,
    ratio: usize,
    sq: usize,
    sk: usize,
    dims: (usize, usize),
    mask: Mask,
    softcap: Option<f32>,
    alibi: bool,
    splits: Option<usize>,
    dtype: DType,
    seed: u64,
}

fn dense_strategy() -> impl Strategy<Value = Dense> {
    (
        (1usize..=2, 1usize..=2, prop::sample::select(vec![1usize, 2, 4])),
        // Up to 16 query rows take the in-place decode path, more the tiled path.
        (prop_oneof![1usize..=16, 17usize..=60], 1usize..=130, prop::sample::select(PAIRS.to_vec())),
        mask_strategy(),
        (prop::option::weighted(0.25, 5.0f32..50.0), prop::bool::weighted(0.25)),
        (prop::option::of(prop::sample::select(vec![1usize, 2, 3, 7])), dtype_strategy(), any::<u64>()),
    )
        .prop_map(|((batch, heads_kv, ratio), (sq, sk, dims), mask, (softcap, alibi), (splits, dtype, seed))| Dense {
            batch,
            heads_kv,
            ratio,
            sq,
            sk,
            dims,
            mask,
            softcap,
            alibi,
            splits,
            dtype,
            seed,
        })
}

/// Dense calls on both CPU paths: o is `[batch, seqlen_q, heads_q, head_dim_v]`, within
/// FlashAttention's rule of float64, the LSE within 1e-4; both paths ran.
#[test]
fn dense_matches_the_reference() {
    let config = props::config("head_dim_v dense", file!(), 64);
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let paths = std::cell::RefCell::new(std::collections::BTreeSet::new());
    runner
        .run(&dense_strategy(), |c| {
            let mut rng = Rng::new(c.seed | 1);
            let (hq, (d, dv)) = (c.heads_kv * c.ratio, c.dims);
            let q = randn(&mut rng, c.dtype, [c.batch, c.sq, hq, d]);
            let k = randn(&mut rng, c.dtype, [c.batch, c.sk, c.heads_kv, d]);
            let v = randn(&mut rng, c.dtype, [c.batch, c.sk, c.heads_kv, dv]);
            let opts = options(c.mask, c.softcap, c.alibi, hq, c.splits);
            let (out, chk) = check_forward(&q, &k, &v, &opts);
            paths.borrow_mut().insert(out.dispatch.kernel.clone());
            prop_assert_eq!(out.o.shape(), [c.batch, c.sq, hq, dv]);
            prop_assert!(chk.err <= chk.bound, "{c:?}: {chk:?}");
            prop_assert!(chk.lse_err <= 1e-4, "{c:?}: lse {chk:?}");
            Ok(())
        })
        .unwrap();
    let paths = paths.into_inner();
    assert!(paths.len() >= 2, "both CPU paths ran: {paths:?}");
}

/// The softmax scale defaults to 1/sqrt of q/k's head_dim (the dot products' length), not v's.
#[test]
fn default_scale_is_that_of_the_qk_head_dim() {
    for (d, dv) in [(192, 128), (32, 64), (576, 512)] {
        let (q, v) = (Tensor::zeros(DType::F32, [1, 2, 1, d]).unwrap(), Tensor::zeros(DType::F32, [1, 2, 1, dv]).unwrap());
        let p = Problem::new(&q.view(), &q.view(), &v.view(), &ForwardOptions::default()).unwrap();
        assert_eq!((p.head_dim, p.head_dim_v, p.scale), (d, dv, 1.0 / (d as f32).sqrt()));
    }
    // And the output uses it: one key of score s = q·k/sqrt(192) against a second of score 0.
    let (d, dv) = (192, 128);
    let mut q = vec![0.0f32; d];
    q[0] = 2.0;
    let k: Vec<f32> = (0..2 * d).map(|i| if i == 0 { 3.0 } else { 0.0 }).collect();
    let v: Vec<f32> = (0..2 * dv).map(|i| if i < dv { 1.0 } else { 0.0 }).collect();
    let q = Tensor::from_vec(q, [1, 1, 1, d]).unwrap();
    let k = Tensor::from_vec(k, [1, 2, 1, d]).unwrap();
    let v = Tensor::from_vec(v, [1, 2, 1, dv]).unwrap();
    let out = forward(&q, &k, &v, &ForwardOptions::default()).unwrap();
    let w = 1.0 / (1.0 + (-6.0f64 / (d as f64).sqrt()).exp());
    assert!(out.o.to_f32_vec().iter().all(|&x| (x as f64 - w).abs() < 1e-6), "{:?}", &out.o.to_f32_vec()[..4]);
}

/// `forward_into` writes a `[batch, seqlen_q, heads_q, head_dim_v]` buffer (both paths), equal to
/// `forward`'s output bit for bit.
#[test]
fn forward_into_writes_head_dim_v_rows() {
    for sq in [3, 40] {
        let mut rng = Rng::new(7 + sq as u64);
        let (d, dv) = (192, 128);
        let q = randn(&mut rng, DType::BF16, [2, sq, 4, d]);
        let k = randn(&mut rng, DType::BF16, [2, 50, 2, d]);
        let v = randn(&mut rng, DType::BF16, [2, 50, 2, dv]);
        let opts = ForwardOptions::default().causal(true);
        let want = forward(&q, &k, &v, &opts).unwrap();
        let mut out = vec![half::bf16::ZERO; 2 * sq * 4 * dv];
        let mut lse = vec![0.0f32; 2 * 4 * sq];
        forward_into(&q, &k, &v, &mut out, Some(&mut lse), &opts).unwrap();
        let got: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
        assert_eq!(got, want.o.to_f32_vec(), "sq {sq}");
    }
}

#[derive(Debug, Clone)]
struct Serving {
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
    heads_kv: usize,
    ratio: usize,
    dims: (usize, usize),
    mask: Mask,
    softcap: Option<f32>,
    alibi: bool,
    splits: Option<usize>,
    dtype: DType,
    /// KV cache cases: paged with this page size (else dense).
    page: Option<usize>,
    seed: u64,
}

fn serving_strategy() -> impl Strategy<Value = Serving> {
    (
        prop::collection::vec(
            (crate::support::serving::len_strategy(24), crate::support::serving::len_strategy(90)),
            1..=3,
        ),
        (1usize..=2, prop::sample::select(vec![1usize, 2, 4]), prop::sample::select(PAIRS.to_vec())),
        (mask_strategy(), prop::option::weighted(0.25, 5.0f32..50.0), prop::bool::weighted(0.25)),
        (prop::option::of(prop::sample::select(vec![1usize, 2, 5])), dtype_strategy()),
        (prop::option::of(prop::sample::select(vec![1usize, 7, 16])), any::<u64>()),
    )
        .prop_map(|(lens, (heads_kv, ratio, dims), (mask, softcap, alibi), (splits, dtype), (page, seed))| {
            let (lens_q, lens_k) = lens.into_iter().unzip();
            Serving { lens_q, lens_k, heads_kv, ratio, dims, mask, softcap, alibi, splits, dtype, page, seed }
        })
}

/// One sequence (`q` `[sq][hq][d]`, `k` `[sk][hkv][d]`, `v` `[sk][hkv][dv]`) against our rows `o`
/// `[sq][hq][dv]` and LSE `lse(h, i)`: FlashAttention's rule of float64, the LSE within 1e-4; a
/// sequence with no key gives 0 and LSE −inf.
#[allow(clippy::too_many_arguments)]
fn check_seq(
    c: &Serving,
    (sq, sk): (usize, usize),
    (q, k, v): (&[f32], &[f32], &[f32]),
    o: &[f32],
    lse: &dyn Fn(usize, usize) -> f32,
    opts: &ForwardOptions,
) -> Result<(), String> {
    let (hq, hkv, (d, dv)) = (c.heads_kv * c.ratio, c.heads_kv, c.dims);
    if sq == 0 {
        return Ok(());
    }
    if sk == 0 {
        let lse_ok = (0..hq).all(|h| (0..sq).all(|i| lse(h, i) == f32::NEG_INFINITY));
        return if o.iter().all(|&x| x == 0.0) && lse_ok { Ok(()) } else { Err("no key: must give 0, LSE -inf".into()) };
    }
    let qt = Tensor::from_f32(q, c.dtype, [1, sq, hq, d]).unwrap();
    let kt = Tensor::from_f32(k, c.dtype, [1, sk, hkv, d]).unwrap();
    let vt = Tensor::from_f32(v, c.dtype, [1, sk, hkv, dv]).unwrap();
    let p = Problem::new(&qt.view(), &kt.view(), &vt.view(), opts).map_err(|e| e.to_string())?;
    let r = attention_f64(&p, &qt.view(), &kt.view(), &vt.view()).unwrap();
    let naive = attention_naive(&p, &qt.view(), &kt.view(), &vt.view(), c.dtype).unwrap();
    let ours: Vec<f64> = o.iter().map(|&x| x as f64).collect();
    let (err, naive_err) = (max_abs_diff(&ours, &r.o), max_abs_diff(&naive, &r.o));
    let bound = 2.0 * naive_err + floor_for(c.dtype);
    if err > bound {
        return Err(format!("err {err:e} > bound {bound:e} (naive {naive_err:e})"));
    }
    let lse_err = (0..hq)
        .flat_map(|h| (0..sq).map(move |i| (h, i)))
        .map(|(h, i)| {
            let (a, b) = (lse(h, i) as f64, r.lse[h * sq + i]);
            if a == b { 0.0 } else { (a - b).abs() }
        })
        .fold(0.0f64, f64::max);
    if lse_err > 1e-4 {
        return Err(format!("lse err {lse_err:e}"));
    }
    Ok(())
}

/// Varlen batches and KV caches (dense and paged, split-KV forced or not), each sequence against
/// the float64 reference; then the fused append against the same cache filled by hand.
#[test]
fn varlen_caches_and_append_match_the_reference() {
    let config = props::config("head_dim_v serving", file!(), 48);
    let mut runner = proptest::test_runner::TestRunner::new(config);
    runner.run(&serving_strategy(), serving_case).unwrap();
}

/// MLA's absorbed decode pair (576, 512) on every path the decode takes, whatever the draws of
/// the property above: decode rows over paged caches (page sizes 1, 7, 16) and a dense cache,
/// split-KV forced (merged over v's 512 columns) and not, varlen, the fused append (f32 dense
/// caches), GQA; each sequence against the float64 reference.
#[test]
fn mla_decode_pair_on_every_decode_path() {
    let case = |lens_q: Vec<usize>, lens_k: Vec<usize>, (heads_kv, ratio), splits, dtype, page, seed| Serving {
        lens_q,
        lens_k,
        heads_kv,
        ratio,
        dims: (576, 512),
        mask: Mask::Causal,
        softcap: None,
        alibi: false,
        splits,
        dtype,
        page,
        seed,
    };
    let cases = [
        case(vec![1, 1, 1], vec![70, 1, 33], (1, 4), Some(3), DType::BF16, Some(16), 1),
        case(vec![1, 1], vec![45, 90], (2, 2), Some(5), DType::F16, Some(7), 2),
        case(vec![2, 1], vec![60, 9], (1, 2), Some(2), DType::F32, None, 3),
        case(vec![1, 3], vec![40, 3], (1, 1), None, DType::F32, None, 4),
        case(vec![1], vec![25], (1, 2), Some(2), DType::F32, Some(1), 5),
    ];
    for c in cases {
        let name = format!("{c:?}");
        serving_case(c).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// One serving draw: varlen, the dense or paged KV cache, then (f32 dense caches) the fused
/// append, each sequence against the float64 reference.
fn serving_case(c: Serving) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(c.seed | 1);
    let (hq, hkv, (d, dv)) = (c.heads_kv * c.ratio, c.heads_kv, c.dims);
    let opts = options(c.mask, c.softcap, c.alibi, hq, c.splits);
    let batch = c.lens_q.len();
    let qs: Vec<Vec<f32>> = c.lens_q.iter().map(|&n| values(&mut rng, n * hq * d, c.dtype)).collect();
    let ks: Vec<Vec<f32>> = c.lens_k.iter().map(|&n| values(&mut rng, n * hkv * d, c.dtype)).collect();
    let vs: Vec<Vec<f32>> = c.lens_k.iter().map(|&n| values(&mut rng, n * hkv * dv, c.dtype)).collect();
    let fail = |what: &str, b: usize, e: String| TestCaseError::fail(format!("{what} {c:?} seq {b}: {e}"));

    // Varlen.
    let (cu_q, cu_k) = (cu_seqlens(&c.lens_q), cu_seqlens(&c.lens_k));
    let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
    let q = Tensor::from_f32(&qs.concat(), c.dtype, [1, tq, hq, d]).unwrap();
    let k = Tensor::from_f32(&ks.concat(), c.dtype, [1, tk, hkv, d]).unwrap();
    let v = Tensor::from_f32(&vs.concat(), c.dtype, [1, tk, hkv, dv]).unwrap();
    let seqs = Varlen {
        cu_seqlens_q: &cu_q,
        cu_seqlens_k: &cu_k,
        max_seqlen_q: c.lens_q.iter().copied().max().unwrap_or(0),
        max_seqlen_k: c.lens_k.iter().copied().max().unwrap_or(0),
    };
    let out = forward_varlen(&q, &k, &v, &seqs, &opts).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(out.o.shape(), [1, tq, hq, dv]);
    let (o, lse) = (out.o.to_f32_vec(), out.lse.unwrap());
    for b in 0..batch {
        let (q0, sq, sk) = (cu_q[b] as usize, c.lens_q[b], c.lens_k[b]);
        let rows = &o[q0 * hq * dv..(q0 + sq) * hq * dv];
        let l = |h: usize, i: usize| lse[h * tq + q0 + i];
        check_seq(&c, (sq, sk), (&qs[b], &ks[b], &vs[b]), rows, &l, &opts).map_err(|e| fail("varlen", b, e))?;
    }

    // KV cache: q padded to the longest sequence (padding rows checked too), the cache
    // dense or paged; k and v rows of their own widths.
    let sq_max = c.lens_q.iter().copied().max().unwrap_or(0).max(1);
    let mut qd = vec![0.0f32; batch * sq_max * hq * d];
    for b in 0..batch {
        qd[b * sq_max * hq * d..][..qs[b].len()].copy_from_slice(&qs[b]);
    }
    let q = Tensor::from_f32(&qd, c.dtype, [batch, sq_max, hq, d]).unwrap();
    let seqlens: Vec<i32> = c.lens_k.iter().map(|&n| n as i32).collect();
    let cap = c.lens_k.iter().copied().max().unwrap_or(0).max(1);
    let (krow, vrow) = (hkv * d, hkv * dv);
    let (slots, table) = match c.page {
        None => (batch * cap, None),
        Some(ps) => {
            let t = paged_table(&c.lens_k, 0, ps, false, (1, 1), &mut rng);
            (t.num_blocks * ps, Some((t, ps)))
        }
    };
    let slot = |b: usize, j: usize| match &table {
        None => b * cap + j,
        Some((t, ps)) => t.ids[b * t.width + j / ps] as usize * ps + j % ps,
    };
    let (mut kc, mut vc) = (vec![0.0f32; slots * krow], vec![0.0f32; slots * vrow]);
    for b in 0..batch {
        for j in 0..c.lens_k[b] {
            kc[slot(b, j) * krow..][..krow].copy_from_slice(&ks[b][j * krow..(j + 1) * krow]);
            vc[slot(b, j) * vrow..][..vrow].copy_from_slice(&vs[b][j * vrow..(j + 1) * vrow]);
        }
    }
    let (outer, inner) = match &table {
        None => (batch, cap),
        Some((t, ps)) => (t.num_blocks, *ps),
    };
    let kt = Tensor::from_f32(&kc, c.dtype, [outer, inner, hkv, d]).unwrap();
    let vt = Tensor::from_f32(&vc, c.dtype, [outer, inner, hkv, dv]).unwrap();
    let cache = match &table {
        Some((t, _)) => KvCache::paged(
            kt.view(),
            vt.view(),
            &seqlens,
            BlockTable { ids: &t.ids, max_blocks_per_seq: t.width },
        ),
        None => KvCache::dense(kt.view(), vt.view(), &seqlens),
    };
    let out = forward_kvcache(&q, &cache, &opts).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(out.o.shape(), [batch, sq_max, hq, dv]);
    let (o, lse) = (out.o.to_f32_vec(), out.lse.unwrap());
    for b in 0..batch {
        let rows = &o[b * sq_max * hq * dv..(b + 1) * sq_max * hq * dv];
        let qb = &qd[b * sq_max * hq * d..(b + 1) * sq_max * hq * d];
        let l = |h: usize, i: usize| lse[(b * hq + h) * sq_max + i];
        check_seq(&c, (sq_max, c.lens_k[b]), (qb, &ks[b], &vs[b]), rows, &l, &opts)
            .map_err(|e| fail("kvcache", b, e))?;
    }

    // The fused append (dense caches only, f32: the cache's element type): the last
    // `new` keys of every sequence appended to a cache holding the rest, then attended;
    // equal to the call on the filled cache, and the cache holds exactly those rows.
    if c.page.is_none() && c.dtype == DType::F32 {
        let new = c.lens_k.iter().copied().min().unwrap_or(0).min(3);
        let before: Vec<i32> = seqlens.iter().map(|&n| n - new as i32).collect();
        let (mut ka, mut va) = (kc.clone(), vc.clone());
        let (mut knew, mut vnew) = (Vec::new(), Vec::new());
        for b in 0..batch {
            for j in before[b] as usize..c.lens_k[b] {
                knew.extend_from_slice(&ka[slot(b, j) * krow..][..krow]);
                vnew.extend_from_slice(&va[slot(b, j) * vrow..][..vrow]);
                ka[slot(b, j) * krow..][..krow].fill(f32::NAN);
                va[slot(b, j) * vrow..][..vrow].fill(f32::NAN);
            }
        }
        let knew = Tensor::from_vec(knew, [batch, new, hkv, d]).unwrap();
        let vnew = Tensor::from_vec(vnew, [batch, new, hkv, dv]).unwrap();
        let mut cm = KvCacheMut { k: &mut ka, v: &mut va, shape: [batch, cap, hkv, d], seqlens: &before, block_table: None, batch_idx: None, leftpad: None };
        prop_assert_eq!(cm.head_dim_v(), Some(dv));
        let fused = forward_kvcache_append(&q, &mut cm, &knew, &vnew, &opts)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        prop_assert!(same(&ka, &kc) && same(&va, &vc), "{c:?}: the append wrote other rows");
        prop_assert_eq!(fused.o.to_f32_vec(), o, "{:?}: fused append differs", c);
    }
    Ok(())
}

/// Split-KV in the open: `merge_states` of two calls over disjoint halves of the keys (outputs
/// of v's head_dim) is the call over all of them, at MLA's prefill and decode pairs.
#[test]
fn merge_states_over_v_head_dim() {
    for (d, dv) in [(192, 128), (576, 512)] {
        merge_states_case(d, dv);
    }
}

fn merge_states_case(d: usize, dv: usize) {
    let mut rng = Rng::new(11);
    let sk = 70;
    let q = randn(&mut rng, DType::F32, [1, 5, 4, d]);
    let k = randn(&mut rng, DType::F32, [1, sk, 2, d]);
    let v = randn(&mut rng, DType::F32, [1, sk, 2, dv]);
    let half = |t: &Tensor, lo: usize, hi: usize| {
        let [_, _, h, w] = t.shape();
        let x = t.to_f32_vec();
        Tensor::from_vec(x[lo * h * w..hi * h * w].to_vec(), [1, hi - lo, h, w]).unwrap()
    };
    let opts = ForwardOptions::default().return_lse(true);
    let all = forward(&q, &k, &v, &opts).unwrap();
    let a = forward(&q, &half(&k, 0, 30), &half(&v, 0, 30), &opts).unwrap();
    let b = forward(&q, &half(&k, 30, sk), &half(&v, 30, sk), &opts).unwrap();
    let m = merge_states(&a.o, a.lse.as_deref().unwrap(), &b.o, b.lse.as_deref().unwrap()).unwrap();
    assert_eq!(m.o.shape(), [1, 5, 4, dv]);
    let diff = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(diff(&m.o.to_f32_vec(), &all.o.to_f32_vec()) < 1e-5);
    assert!(diff(&m.lse, all.lse.as_deref().unwrap()) < 1e-5);
}

#[derive(Debug, Clone)]
struct Bwd {
    batch: usize,
    heads_kv: usize,
    ratio: usize,
    sq: usize,
    sk: usize,
    dims: (usize, usize),
    mask: Mask,
    softcap: Option<f32>,
    alibi: bool,
    dtype: DType,
    seed: u64,
}

fn bwd_strategy() -> impl Strategy<Value = Bwd> {
    (
        (1usize..=2, 1usize..=2, prop::sample::select(vec![1usize, 2, 3])),
        // The backward takes head dims up to 512 (MLA's 576 is a decode shape).
        (1usize..=70, 1usize..=110, prop::sample::select(PAIRS.into_iter().filter(|&(d, dv)| d.max(dv) <= 512).collect::<Vec<_>>())),
        mask_strategy(),
        (prop::option::weighted(0.3, 2.0f32..50.0), prop::bool::weighted(0.3)),
        (dtype_strategy(), any::<u64>()),
    )
        .prop_map(|((batch, heads_kv, ratio), (sq, sk, dims), mask, (softcap, alibi), (dtype, seed))| Bwd {
            batch: if sq * sk * dims.0.max(dims.1) > 400_000 { 1 } else { batch },
            heads_kv,
            ratio,
            sq,
            sk,
            dims,
            mask,
            softcap,
            alibi,
            dtype,
            seed,
        })
}

/// The backward: dq and dk of q/k's head_dim, dv of v's, each within FlashAttention's rule for
/// gradients of the float64 gradient (`2 · naive + floor · max(1, max|ref|)`, as
/// `backward_props`); `backward_into` writes the same bits into buffers of those shapes.
#[test]
fn backward_matches_the_reference() {
    let config = props::config("head_dim_v backward", file!(), 40);
    let mut runner = proptest::test_runner::TestRunner::new(config);
    runner
        .run(&bwd_strategy(), |c| {
            let mut rng = Rng::new(c.seed | 1);
            let (hq, (d, dv)) = (c.heads_kv * c.ratio, c.dims);
            let q = randn(&mut rng, c.dtype, [c.batch, c.sq, hq, d]);
            let k = randn(&mut rng, c.dtype, [c.batch, c.sk, c.heads_kv, d]);
            let v = randn(&mut rng, c.dtype, [c.batch, c.sk, c.heads_kv, dv]);
            let d_o = randn(&mut rng, c.dtype, [c.batch, c.sq, hq, dv]);
            let opts = options(c.mask, c.softcap, c.alibi, hq, None);
            let out = forward(&q, &k, &v, &opts).unwrap();
            let lse = out.lse.clone().unwrap();
            let g = backward(&q, &k, &v, &out.o, &d_o, &lse, &opts).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!((g.dq.shape(), g.dk.shape(), g.dv.shape()), (q.shape(), k.shape(), v.shape()));
            let p = Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
            let r = attention_backward_f64(&p, &q.view(), &k.view(), &v.view(), &d_o.view()).unwrap();
            let n = attention_backward_naive(&p, &q.view(), &k.view(), &v.view(), &d_o.view(), c.dtype).unwrap();
            for (name, ours, want, naive) in [("dq", &g.dq, &r.dq, &n.dq), ("dk", &g.dk, &r.dk, &n.dk), ("dv", &g.dv, &r.dv, &n.dv)] {
                let ours: Vec<f64> = ours.to_f32_vec().iter().map(|&x| x as f64).collect();
                prop_assert_eq!(ours.len(), want.len());
                let err = max_abs_diff(&ours, want);
                let naive_err = max_abs_diff(naive, want);
                let bound = 2.0 * naive_err + floor_for(c.dtype) * want.iter().fold(1.0f64, |m, x| m.max(x.abs()));
                prop_assert!(err <= bound, "{c:?}: {name} err {err:e} > bound {bound:e} (naive {naive_err:e})");
            }
            if c.dtype == DType::F32 {
                let (mut dq, mut dk, mut dvb) =
                    (vec![0.0f32; q.numel()], vec![0.0f32; k.numel()], vec![0.0f32; v.numel()]);
                backward_into(&q, &k, &v, &out.o, &d_o, &lse, (&mut dq, &mut dk, &mut dvb), &opts).unwrap();
                prop_assert!(dq == g.dq.to_f32_vec() && dk == g.dk.to_f32_vec() && dvb == g.dv.to_f32_vec());
            }
            Ok(())
        })
        .unwrap();
}

/// `backward_varlen` with v's own head_dim: each sequence equal, bit for bit, to the dense
/// backward of its own rows.
#[test]
fn backward_varlen_is_the_dense_backward_per_sequence() {
    let (hq, hkv, d, dv) = (4, 2, 72, 40);
    let (lens_q, lens_k) = ([5usize, 0, 23], [17usize, 9, 30]);
    let mut rng = Rng::new(5);
    let (tq, tk) = (lens_q.iter().sum::<usize>(), lens_k.iter().sum::<usize>());
    let q = randn(&mut rng, DType::F32, [1, tq, hq, d]);
    let k = randn(&mut rng, DType::F32, [1, tk, hkv, d]);
    let v = randn(&mut rng, DType::F32, [1, tk, hkv, dv]);
    let d_o = randn(&mut rng, DType::F32, [1, tq, hq, dv]);
    let (cu_q, cu_k) = (cu_seqlens(&lens_q), cu_seqlens(&lens_k));
    let seqs = Varlen { cu_seqlens_q: &cu_q, cu_seqlens_k: &cu_k, max_seqlen_q: 23, max_seqlen_k: 30 };
    let opts = ForwardOptions::default().causal(true).return_lse(true);
    let out = forward_varlen(&q, &k, &v, &seqs, &opts).unwrap();
    let g = backward_varlen(&q, &k, &v, &out.o, &d_o, out.lse.as_deref().unwrap(), &seqs, &opts).unwrap();
    assert_eq!((g.dq.shape(), g.dk.shape(), g.dv.shape()), (q.shape(), k.shape(), v.shape()));
    let rows = |t: &Tensor, r0: usize, n: usize| {
        let [_, _, h, w] = t.shape();
        Tensor::from_vec(t.to_f32_vec()[r0 * h * w..(r0 + n) * h * w].to_vec(), [1, n, h, w]).unwrap()
    };
    for b in [0, 2] {
        let (q0, sq, k0, sk) = (cu_q[b] as usize, lens_q[b], cu_k[b] as usize, lens_k[b]);
        let (qs, ks, vs, dos) = (rows(&q, q0, sq), rows(&k, k0, sk), rows(&v, k0, sk), rows(&d_o, q0, sq));
        let o1 = forward(&qs, &ks, &vs, &opts).unwrap();
        let g1 = backward(&qs, &ks, &vs, &o1.o, &dos, o1.lse.as_deref().unwrap(), &opts).unwrap();
        assert_eq!(rows(&g.dq, q0, sq).to_f32_vec(), g1.dq.to_f32_vec(), "seq {b} dq");
        assert_eq!(rows(&g.dk, k0, sk).to_f32_vec(), g1.dk.to_f32_vec(), "seq {b} dk");
        assert_eq!(rows(&g.dv, k0, sk).to_f32_vec(), g1.dv.to_f32_vec(), "seq {b} dv");
    }
}

fn t(shape: [usize; 4]) -> Tensor {
    Tensor::zeros(DType::F32, shape).unwrap()
}

fn shape_err(e: &Error, what_is: &str, says: &[&str]) {
    let msg = e.to_string();
    assert!(matches!(e, Error::ShapeMismatch { what, .. } if what == what_is), "{e:?}");
    for s in says {
        assert!(msg.contains(s), "{msg:?} does not say {s:?}");
    }
}

/// Every other mismatch is still refused, with a typed error naming what was given and expected;
/// past the CPU's head_dim limit on either side is `UnsupportedHeadDim` naming that side.
#[test]
fn every_other_mismatch_is_a_typed_error() {
    let o = ForwardOptions::default();
    let q = t([2, 8, 4, 192]);
    // q vs k head_dim must match.
    let e = forward(&q, &t([2, 8, 2, 128]), &t([2, 8, 2, 128]), &o).unwrap_err();
    shape_err(&e, "k", &["[2, 8, 2, 128]", "192"]);
    // v's batch, seqlen and heads are k's.
    for v in [[1, 8, 2, 128], [2, 9, 2, 128], [2, 8, 1, 128]] {
        let e = forward(&q, &t([2, 8, 2, 192]), &t(v), &o).unwrap_err();
        shape_err(&e, "v", &[&format!("{v:?}"), "[2, 8, 2, 192]", "head_dim_v"]);
    }
    // Past the CPU's limit (576, MLA's absorbed decode q/k), on either side.
    for ((d, dv), bad, side) in [((577, 512), 577, "q and k"), ((128, 640), 640, "v")] {
        let e = forward(&t([1, 2, 1, d]), &t([1, 2, 1, d]), &t([1, 2, 1, dv]), &o.clone().backend(Backend::Cpu)).unwrap_err();
        assert!(matches!(&e, Error::UnsupportedHeadDim { head_dim, supported, .. } if *head_dim == bad && supported.contains(side) && supported.contains("1..=576")), "{e:?}");
    }
    // The backward's limit is 512 on either side: MLA's decode pair is forward-only.
    let (q5, v5) = (t([1, 2, 1, 576]), t([1, 2, 1, 512]));
    let lse = vec![0.0f32; 2];
    let e = backward(&q5, &q5, &v5, &v5, &v5, &lse, &o).unwrap_err();
    assert!(matches!(&e, Error::UnsupportedHeadDim { head_dim: 576, supported, .. } if supported.contains("1..=512")), "{e:?}");
    // forward_into: the output buffer has v's head_dim.
    let (k, v) = (t([2, 8, 2, 192]), t([2, 8, 2, 128]));
    let mut of_qk = vec![0.0f32; 2 * 8 * 4 * 192];
    let e = forward_into(&q, &k, &v, &mut of_qk, None, &o).unwrap_err();
    shape_err(&e, "forward_into output buffer", &["[2, 8, 4, 128]", &format!("{} elements", 2 * 8 * 4 * 128)]);
    // The backward: o and d_o have v's head_dim; so has the dv buffer of backward_into.
    let lse = vec![0.0f32; 2 * 4 * 8];
    let good_o = t([2, 8, 4, 128]);
    for (o_t, do_t, op) in [(&q, &good_o, "o"), (&good_o, &q, "d_o")] {
        let e = backward(&q, &k, &v, o_t, do_t, &lse, &o).unwrap_err();
        shape_err(&e, op, &["[2, 8, 4, 192]", "[2, 8, 4, 128]", "v's head_dim"]);
    }
    let (mut dq, mut dk, mut dv_wrong) = (vec![0.0f32; q.numel()], vec![0.0f32; k.numel()], vec![0.0f32; k.numel()]);
    let e = backward_into(&q, &k, &v, &good_o, &good_o, &lse, (&mut dq, &mut dk, &mut dv_wrong), &o).unwrap_err();
    shape_err(&e, "backward_into dv buffer", &["[2, 8, 2, 128]"]);
    // Serving: a varlen v whose rows are not k's.
    let cu = [0i32, 8];
    let seqs = Varlen { cu_seqlens_q: &cu, cu_seqlens_k: &cu, max_seqlen_q: 8, max_seqlen_k: 8 };
    let e = forward_varlen(&t([1, 8, 4, 64]), &t([1, 8, 2, 64]), &t([1, 7, 2, 32]), &seqs, &o).unwrap_err();
    shape_err(&e, "v", &["[1, 7, 2, 32]", "head_dim_v"]);
    let e = forward_varlen(&t([1, 8, 4, 64]), &t([1, 8, 2, 32]), &t([1, 8, 2, 32]), &seqs, &o).unwrap_err();
    shape_err(&e, "k", &["head_dim 64"]);
}

/// A writable cache's v buffer gives v's head_dim; one that is no whole number of rows is an
/// `InvalidLayout` of v, and a `v_new` of another head_dim a `ShapeMismatch`, both before any
/// write.
#[test]
fn writable_cache_v_head_dim_is_checked() {
    let (shape, dv) = ([2, 6, 2, 16], 8);
    let mut kc = vec![1.0f32; 2 * 6 * 2 * 16];
    let mut vc = vec![1.0f32; 2 * 6 * 2 * dv + 1];
    let seqlens = [2, 3];
    let (knew, vnew) = (t([2, 1, 2, 16]), t([2, 1, 2, dv]));
    let mut cm = KvCacheMut { k: &mut kc, v: &mut vc, shape, seqlens: &seqlens, block_table: None, batch_idx: None, leftpad: None };
    assert_eq!(cm.head_dim_v(), None);
    let e = flash_attn::serving::append_kv(&mut cm, &knew, &vnew).unwrap_err();
    assert!(matches!(&e, Error::InvalidLayout { operand: Operand::V, reason } if reason.contains("head_dim_v")), "{e:?}");
    let mut vc = vec![1.0f32; 2 * 6 * 2 * dv];
    let mut cm = KvCacheMut { k: &mut kc, v: &mut vc, shape, seqlens: &seqlens, block_table: None, batch_idx: None, leftpad: None };
    assert_eq!(cm.head_dim_v(), Some(dv));
    let e = flash_attn::serving::append_kv(&mut cm, &knew, &t([2, 1, 2, 16])).unwrap_err();
    shape_err(&e, "v_new", &["[2, 1, 2, 16]", "[2, 1, 2, 8]"]);
    assert!(kc.iter().chain(&vc).all(|&x| x == 1.0), "a refused append wrote the cache");
    // A good append writes k rows of 16 and v rows of 8 at the same slots.
    let mut cm = KvCacheMut { k: &mut kc, v: &mut vc, shape, seqlens: &seqlens, block_table: None, batch_idx: None, leftpad: None };
    let knew = Tensor::from_vec(vec![2.0f32; 2 * 2 * 16], [2, 1, 2, 16]).unwrap();
    let vnew = Tensor::from_vec(vec![3.0f32; 2 * 2 * dv], [2, 1, 2, dv]).unwrap();
    flash_attn::serving::append_kv(&mut cm, &knew, &vnew).unwrap();
    // Slots (batch · capacity + position): sequence 0 at 2, sequence 1 at 6 + 3.
    let written = [2, 6 + 3];
    for (j, row) in kc.chunks(2 * 16).enumerate() {
        assert!(row.iter().all(|&x| x == if written.contains(&j) { 2.0 } else { 1.0 }), "k slot {j}");
    }
    for (j, row) in vc.chunks(2 * dv).enumerate() {
        assert!(row.iter().all(|&x| x == if written.contains(&j) { 3.0 } else { 1.0 }), "v slot {j}");
    }
}

/// FA1, FA3 and FA4 refuse a V head_dim unlike Q/K's (FA2's fa2v row runs (192, 128) and
/// (576, 512) on a GPU: src/cuda/fa2.rs, tests/emulator/head_dim_v.rs): an explicit variant is
/// `VariantUnavailable`; `Variant::Auto` under `Backend::Auto` runs the call on the CPU here.
#[test]
fn other_gpu_families_refuse_and_auto_runs_on_the_cpu() {
    let mut rng = Rng::new(3);
    let q = randn(&mut rng, DType::BF16, [1, 20, 2, 192]);
    let k = randn(&mut rng, DType::BF16, [1, 20, 2, 192]);
    let v = randn(&mut rng, DType::BF16, [1, 20, 2, 128]);
    for variant in [Variant::Fa1, Variant::Fa3, Variant::Fa4] {
        let e = forward(&q, &k, &v, &ForwardOptions::default().variant(variant)).unwrap_err();
        assert!(matches!(e, Error::VariantUnavailable { .. }), "{variant:?}: {e:?}");
    }
    let (out, chk) = check_forward(&q, &k, &v, &ForwardOptions::default().backend(Backend::Auto));
    assert_eq!(out.dispatch.backend, "cpu", "{:?}", out.dispatch);
    assert!(chk.err <= chk.bound, "{chk:?}");
}

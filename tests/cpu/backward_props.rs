//! Property tests of the CPU backward against the float64 reference gradient over random shapes
//! and options, with FlashAttention's rule for gradients: for each of dq, dk, dv,
//! `max|ours − ref64| <= 2 · max|naive_in_dtype − ref64| + floor · max(1, max|ref64|)`, where
//! the naive backward is the straightforward one in the inputs' dtype
//! (`reference::attention_backward_naive`) and `floor` is the forward's (tests/support), taken at
//! the gradient's own scale. The largest observed ratio err / naive_err is printed
//! (`cargo test --test cpu backward_props:: -- --nocapture`). Also: determinism across runs and thread
//! counts, zero gradients for rows that see no key, varlen against per-sequence calls, and the
//! domain edges (typed errors, no panic).

use crate::support::props;
use crate::support::cu_seqlens;
use crate::support::*;
use crate::support::Rng;
use flash_attn::reference::{attention_backward_f64, attention_backward_naive, max_abs_diff};
use flash_attn::serving::{backward_varlen, forward_varlen, Varlen};
use flash_attn::{backward, backward_into, forward, Backend, DType, Error, ForwardOptions, Gradients, Mask, Problem, Tensor};
use proptest::prelude::*;

/// Upper bound on batch·heads_q·seqlen_q·seqlen_k·head_dim per case, so the float64 and naive
/// reference backwards stay fast; the batch is reduced to fit.
const WORK_LIMIT: usize = 2_000_000;

#[derive(Debug, Clone)]
struct Case {
    batch: usize,
    heads_kv: usize,
    ratio: usize,
    sq: usize,
    sk: usize,
    d: usize,
    mask: Mask,
    softcap: Option<f32>,
    alibi: bool,
    seed: u64,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        (1usize..=2, 1usize..=2, prop::sample::select(vec![1usize, 2, 3, 4])),
        (1usize..=150, 1usize..=150, prop::sample::select(vec![8usize, 13, 32, 64, 80, 128])),
        props::mask_strategy(40),
        (prop::option::weighted(0.3, 2.0f32..50.0), prop::bool::weighted(0.3), any::<u64>()),
    )
        .prop_map(|((batch, heads_kv, ratio), (sq, sk, d), mask, (softcap, alibi, seed))| {
            let per_batch = heads_kv * ratio * sq * sk * d;
            let batch = batch.min((WORK_LIMIT / per_batch).max(1));
            Case { batch, heads_kv, ratio, sq, sk, d, mask, softcap, alibi, seed }
        })
}

fn options(c: &Case) -> ForwardOptions {
    let hq = c.heads_kv * c.ratio;
    let mut opts = ForwardOptions::default().mask(c.mask).return_lse(true);
    if let Some(cap) = c.softcap {
        opts = opts.softcap(cap);
    }
    if c.alibi {
        let slopes: Vec<f32> = (0..hq).map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / hq as f32)).collect();
        opts = opts.alibi_slopes(slopes);
    }
    opts
}

/// q, k, v and d_o of a case, in `dtype`.
fn inputs(c: &Case, dtype: DType) -> [Tensor; 4] {
    let mut rng = Rng::new(c.seed | 1);
    let hq = c.heads_kv * c.ratio;
    let q = randn(&mut rng, dtype, [c.batch, c.sq, hq, c.d]);
    let k = randn(&mut rng, dtype, [c.batch, c.sk, c.heads_kv, c.d]);
    let v = randn(&mut rng, dtype, [c.batch, c.sk, c.heads_kv, c.d]);
    let d_o = randn(&mut rng, dtype, [c.batch, c.sq, hq, c.d]);
    [q, k, v, d_o]
}

/// The forward, then the backward, of a case.
fn grads(q: &Tensor, k: &Tensor, v: &Tensor, d_o: &Tensor, opts: &ForwardOptions) -> Gradients {
    let out = forward(q, k, v, opts).expect("forward");
    let lse = out.lse.expect("lse requested");
    backward(q, k, v, &out.o, d_o, &lse, opts).expect("backward")
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_f32_vec().iter().map(|&x| x as f64).collect()
}

/// Returns (err, naive_err, bound) of the gradient of one case closest to its bound.
fn run_case(c: &Case, dtype: DType) -> Result<(f64, f64, f64), TestCaseError> {
    let opts = options(c);
    let [q, k, v, d_o] = inputs(c, dtype);
    let g = grads(&q, &k, &v, &d_o, &opts);
    let p = Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
    let r = attention_backward_f64(&p, &q.view(), &k.view(), &v.view(), &d_o.view()).unwrap();
    let n = attention_backward_naive(&p, &q.view(), &k.view(), &v.view(), &d_o.view(), dtype).unwrap();
    let mut worst = (0.0f64, 0.0f64, 1.0f64);
    for (name, ours, want, naive) in [("dq", &g.dq, &r.dq, &n.dq), ("dk", &g.dk, &r.dk, &n.dk), ("dv", &g.dv, &r.dv, &n.dv)] {
        let ours = f64s(ours);
        prop_assert!(ours.iter().all(|x| x.is_finite()), "{c:?} {dtype:?}: {name} not finite");
        let err = max_abs_diff(&ours, want);
        let naive_err = max_abs_diff(naive, want);
        let scale = want.iter().fold(1.0f64, |m, x| m.max(x.abs()));
        let bound = 2.0 * naive_err + floor_for(dtype) * scale;
        prop_assert!(err <= bound, "{c:?} {dtype:?}: {name} err {err:e} > bound {bound:e} (naive {naive_err:e})");
        if err / bound > worst.0 / worst.2 {
            worst = (err, naive_err, bound);
        }
    }
    // Rows that see no key: zero dq.
    let dq = g.dq.to_f32_vec();
    let hq = p.heads_q;
    for i in (0..c.sq).filter(|&i| p.key_range(i).0 >= p.key_range(i).1) {
        for b in 0..c.batch {
            let row = &dq[(b * c.sq + i) * hq * c.d..][..hq * c.d];
            prop_assert!(row.iter().all(|&x| x == 0.0), "{c:?}: row {i} sees no key but has dq != 0");
        }
    }
    Ok(worst)
}

fn run_dtype(dtype: DType, cases: u32) {
    let config = props::config(&format!("backward_props {dtype:?}"), file!(), cases);
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let margins = std::cell::RefCell::new(Vec::new());
    let result = runner.run(&case_strategy(), |c| {
        margins.borrow_mut().push(run_case(&c, dtype)?);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{dtype:?}: {e}");
    }
    let m = margins.into_inner();
    let of_bound = m.iter().map(|(e, _, b)| e / b).fold(0.0, f64::max);
    let vs_naive = m.iter().filter(|x| x.1 > 0.0).map(|(e, n, _)| e / n).fold(0.0, f64::max);
    let max_err = m.iter().map(|x| x.0).fold(0.0, f64::max);
    println!(
        "{dtype:?}: {} cases passed; max err {max_err:.3e}; max err/bound {of_bound:.3}; max err/naive_err {vs_naive:.3} \
         (cases with naive_err > 0)",
        m.len()
    );
}

#[test]
fn backward_matches_reference_f32() {
    run_dtype(DType::F32, 32);
}

#[test]
fn backward_matches_reference_f16() {
    run_dtype(DType::F16, 24);
}

#[test]
fn backward_matches_reference_bf16() {
    run_dtype(DType::BF16, 24);
}

fn bits(g: &Gradients) -> Vec<u32> {
    [&g.dq, &g.dk, &g.dv].iter().flat_map(|t| t.to_f32_vec()).map(f32::to_bits).collect()
}

/// Bit-identical gradients across runs and thread counts, with and without
/// `deterministic(true)`, over several key chunks (sk > 8 key blocks) and GQA.
#[test]
fn gradients_are_bit_identical_across_runs_and_thread_counts() {
    let c = Case { batch: 1, heads_kv: 2, ratio: 2, sq: 300, sk: 1000, d: 32, mask: Mask::Causal, softcap: None, alibi: false, seed: 7 };
    let [q, k, v, d_o] = inputs(&c, DType::BF16);
    let base = options(&c);
    let out = forward(&q, &k, &v, &base).unwrap();
    let lse = out.lse.unwrap();
    let want = bits(&backward(&q, &k, &v, &out.o, &d_o, &lse, &base.clone().cpu_threads(1)).unwrap());
    for threads in [1, 2, 3, 8] {
        for det in [false, true] {
            for _ in 0..2 {
                let opts = base.clone().cpu_threads(threads).deterministic(det);
                let g = backward(&q, &k, &v, &out.o, &d_o, &lse, &opts).unwrap();
                assert!(bits(&g) == want, "threads {threads}, deterministic {det}: gradients differ");
                assert!(g.dispatch.reason.contains("deterministic"), "{:?}", g.dispatch);
            }
        }
    }
}

/// Rows whose window holds no key (causal with seqlen_q > seqlen_k, a window past the keys) get
/// zero dq and contribute nothing to dk, dv: never NaN.
#[test]
fn rows_that_see_no_key_get_zero_gradients() {
    for mask in [Mask::Causal, Mask::window(0, 0), Mask::causal_window(1)] {
        let c = Case { batch: 2, heads_kv: 1, ratio: 2, sq: 40, sk: 9, d: 16, mask, softcap: None, alibi: false, seed: 3 };
        let opts = options(&c);
        let [q, k, v, d_o] = inputs(&c, DType::F32);
        let g = grads(&q, &k, &v, &d_o, &opts);
        let p = Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
        let dq = g.dq.to_f32_vec();
        let empty: Vec<usize> = (0..c.sq).filter(|&i| p.key_range(i).0 >= p.key_range(i).1).collect();
        assert!(!empty.is_empty(), "{mask:?}: the case has rows with no key");
        for b in 0..c.batch {
            for &i in &empty {
                assert!(dq[(b * c.sq + i) * 2 * c.d..][..2 * c.d].iter().all(|&x| x == 0.0));
            }
        }
        for t in [&g.dq, &g.dk, &g.dv] {
            assert!(t.to_f32_vec().iter().all(|x| x.is_finite()), "{mask:?}");
        }
        let r = attention_backward_f64(&p, &q.view(), &k.view(), &v.view(), &d_o.view()).unwrap();
        assert!(max_abs_diff(&f64s(&g.dk), &r.dk) < 1e-4, "{mask:?}");
    }
}

/// `backward_into` writes what `backward` returns, into buffers holding garbage.
#[test]
fn backward_into_matches_backward() {
    let c = Case { batch: 2, heads_kv: 2, ratio: 3, sq: 70, sk: 130, d: 40, mask: Mask::window(20, 5), softcap: Some(10.0), alibi: true, seed: 11 };
    let opts = options(&c);
    let [q, k, v, d_o] = inputs(&c, DType::F16);
    let out = forward(&q, &k, &v, &opts).unwrap();
    let lse = out.lse.clone().unwrap();
    let g = backward(&q, &k, &v, &out.o, &d_o, &lse, &opts).unwrap();
    let nan = half::f16::from_f32(f32::NAN);
    let (mut dq, mut dk, mut dv) = (vec![nan; g.dq.numel()], vec![nan; g.dk.numel()], vec![nan; g.dv.numel()]);
    let disp = backward_into(&q, &k, &v, &out.o, &d_o, &lse, (&mut dq, &mut dk, &mut dv), &opts).unwrap();
    assert_eq!(disp, g.dispatch);
    assert_eq!(dq, g.dq.into_vec::<half::f16>().unwrap());
    assert_eq!(dk, g.dk.into_vec::<half::f16>().unwrap());
    assert_eq!(dv, g.dv.into_vec::<half::f16>().unwrap());
}

/// A varlen batch gives, bit for bit, the gradients of each sequence on its own (empty
/// sequences included), and its dk/dv rows of empty query sequences are zero.
#[test]
fn varlen_matches_per_sequence_calls() {
    let (hkv, ratio, d) = (2, 2, 24);
    let hq = hkv * ratio;
    let seqs_q = [37usize, 0, 120, 5];
    let seqs_k = [50usize, 17, 120, 0];
    let (cu_q, cu_k) = (cu_seqlens(&seqs_q), cu_seqlens(&seqs_k));
    let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
    let mut rng = Rng::new(5);
    let q = randn(&mut rng, DType::F32, [1, tq, hq, d]);
    let k = randn(&mut rng, DType::F32, [1, tk, hkv, d]);
    let v = randn(&mut rng, DType::F32, [1, tk, hkv, d]);
    let d_o = randn(&mut rng, DType::F32, [1, tq, hq, d]);
    let opts = ForwardOptions::default().mask(Mask::Causal).return_lse(true).alibi_slopes(vec![0.1f32, 0.2, 0.3, 0.4]);
    let seqs = Varlen { cu_seqlens_q: &cu_q, cu_seqlens_k: &cu_k, max_seqlen_q: 120, max_seqlen_k: 120 };
    let out = forward_varlen(&q, &k, &v, &seqs, &opts).unwrap();
    let lse = out.lse.unwrap();
    let g = backward_varlen(&q, &k, &v, &out.o, &d_o, &lse, &seqs, &opts).unwrap();
    let (gq, gk, gv) = (g.dq.to_f32_vec(), g.dk.to_f32_vec(), g.dv.to_f32_vec());
    let slice = |t: &Tensor, r0: usize, n: usize, h: usize| -> Vec<f32> { t.to_f32_vec()[r0 * h * d..][..n * h * d].to_vec() };
    for b in 0..seqs_q.len() {
        let (q0, k0, sq, sk) = (cu_q[b] as usize, cu_k[b] as usize, seqs_q[b], seqs_k[b]);
        if sq == 0 || sk == 0 {
            // dk, dv of keys no query sees: zero; dq of queries with no key: zero.
            assert!(gk[k0 * hkv * d..][..sk * hkv * d].iter().all(|&x| x == 0.0));
            assert!(gq[q0 * hq * d..][..sq * hq * d].iter().all(|&x| x == 0.0));
            continue;
        }
        let t = |x: &Tensor, r0: usize, n: usize, h: usize| Tensor::from_vec(slice(x, r0, n, h), [1, n, h, d]).unwrap();
        let (qs, ks, vs, ds) = (t(&q, q0, sq, hq), t(&k, k0, sk, hkv), t(&v, k0, sk, hkv), t(&d_o, q0, sq, hq));
        let one = grads(&qs, &ks, &vs, &ds, &opts);
        assert!(one.dq.to_f32_vec() == gq[q0 * hq * d..][..sq * hq * d], "sequence {b}: dq");
        assert!(one.dk.to_f32_vec() == gk[k0 * hkv * d..][..sk * hkv * d], "sequence {b}: dk");
        assert!(one.dv.to_f32_vec() == gv[k0 * hkv * d..][..sk * hkv * d], "sequence {b}: dv");
    }
}

/// Domain edges: every malformed call is a typed error, none panics.
#[test]
fn malformed_calls_are_typed_errors() {
    let c = Case { batch: 1, heads_kv: 1, ratio: 2, sq: 8, sk: 6, d: 16, mask: Mask::None, softcap: None, alibi: false, seed: 1 };
    let opts = options(&c);
    let [q, k, v, d_o] = inputs(&c, DType::F32);
    let out = forward(&q, &k, &v, &opts).unwrap();
    let lse = out.lse.clone().unwrap();
    let bad_shape = Tensor::zeros(DType::F32, [1, 7, 2, 16]).unwrap();
    let bad_dtype = Tensor::zeros(DType::BF16, [1, 8, 2, 16]).unwrap();
    let call = |o: &Tensor, d_o: &Tensor, lse: &[f32], opts: &ForwardOptions| backward(&q, &k, &v, o, d_o, lse, opts).map(|_| ());
    assert!(matches!(call(&out.o, &bad_shape, &lse, &opts), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(call(&bad_shape, &d_o, &lse, &opts), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(call(&out.o, &bad_dtype, &lse, &opts), Err(Error::DTypeMismatch { .. })));
    assert!(matches!(call(&out.o, &d_o, &lse[1..], &opts), Err(Error::ShapeMismatch { .. })));
    let mut nan_lse = lse.clone();
    nan_lse[3] = f32::NAN;
    assert!(matches!(call(&out.o, &d_o, &nan_lse, &opts), Err(Error::InvalidOption { option: "lse", .. })));
    nan_lse[3] = f32::INFINITY;
    assert!(matches!(call(&out.o, &d_o, &nan_lse, &opts), Err(Error::InvalidOption { option: "lse", .. })));
    let cuda = opts.clone().backend(Backend::Cuda(0));
    assert!(matches!(call(&out.o, &d_o, &lse, &cuda), Err(Error::BackendUnavailable { .. })));
    let fa2 = opts.clone().variant(flash_attn::Variant::Fa2);
    assert!(matches!(call(&out.o, &d_o, &lse, &fa2), Err(Error::VariantUnavailable { .. })));
    let fp8 = opts.clone().precision(flash_attn::Precision::Fp8 { scaling: flash_attn::Fp8Scaling::PerTensor, hadamard: None });
    assert!(matches!(call(&out.o, &d_o, &lse, &fp8), Err(Error::InvalidOption { option: "precision", .. })));
    assert!(matches!(call(&out.o, &d_o, &lse, &opts.clone().softcap(-1.0)), Err(Error::InvalidSoftcap(_))));
    // A view past its buffer.
    let short = flash_attn::TensorView::new(&[0.0f32; 10], [1, 8, 2, 16]);
    assert!(matches!(backward(&q, &k, &v, &out.o, &short, &lse, &opts), Err(Error::InvalidLayout { .. })));
    // A head_dim beyond the CPU backend's.
    let big = Tensor::zeros(DType::F32, [1, 2, 1, 520]).unwrap();
    let lse2 = vec![0.0f32; 2];
    assert!(matches!(backward(&big, &big, &big, &big, &big, &lse2, &ForwardOptions::default()), Err(Error::UnsupportedHeadDim { .. })));
    // backward_into: wrong element type, wrong lengths.
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; 8 * 2 * 16], vec![0.0f32; 6 * 16], vec![0.0f32; 6 * 16]);
    let mut short_dk = vec![0.0f32; 5];
    let r = backward_into(&q, &k, &v, &out.o, &d_o, &lse, (&mut dq, &mut short_dk, &mut dv), &opts);
    assert!(matches!(r, Err(Error::ShapeMismatch { .. })));
    let mut h = vec![half::f16::ZERO; 8 * 2 * 16];
    let (mut hk, mut hv) = (vec![half::f16::ZERO; 96], vec![half::f16::ZERO; 96]);
    let r = backward_into(&q, &k, &v, &out.o, &d_o, &lse, (&mut h, &mut hk, &mut hv), &opts);
    assert!(matches!(r, Err(Error::DTypeMismatch { .. })));
    assert!(backward_into(&q, &k, &v, &out.o, &d_o, &lse, (&mut dq, &mut dk, &mut dv), &opts).is_ok());
    // Non-finite inputs: an answer (NaN allowed), no panic.
    let mut x = q.to_f32_vec();
    x[5] = f32::INFINITY;
    x[9] = f32::NAN;
    let qi = Tensor::from_vec(x, q.shape()).unwrap();
    assert!(backward(&qi, &k, &v, &out.o, &d_o, &lse, &opts).is_ok());
    // The varlen form refuses an LSE of the dense layout's length when it differs, and bad offsets.
    let seqs = Varlen { cu_seqlens_q: &[0, 9], cu_seqlens_k: &[0, 6], max_seqlen_q: 9, max_seqlen_k: 6 };
    let r = backward_varlen(&q, &k, &v, &out.o, &d_o, &lse, &seqs, &opts);
    assert!(matches!(r, Err(Error::InvalidSeqLayout { .. })), "{r:?}");
}

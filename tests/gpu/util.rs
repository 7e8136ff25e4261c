//! What the GPU tests share: the engine, launches into NaN-poisoned buffers, the reference check.

use super::support::*;
use super::support::Rng;
use cudarc::driver::{CudaStream, DeviceRepr};
use flash_attn::cuda::{table::FAMILIES, DeviceLse, DeviceTensor, DeviceTensorMut, Engine};
use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff};
use flash_attn::{DType, Element, Error, ForwardOptions, Mask, Problem, Tensor, TensorView, Variant};
use half::{bf16, f16};
use std::sync::Arc;

/// LSE is f32 softmax statistics of inputs the reference sees exactly: only f32 rounding.
pub const LSE_TOL: f64 = 2e-3;

/// Upper bound on batch·heads_q·seqlen_q·seqlen_k·head_dim per random case, so the float64
/// reference stays fast.
pub const WORK_LIMIT: usize = 12_000_000;

/// The head dims the FA2 family is instantiated for (it has no tail masking).
pub fn fa2_dims() -> Vec<usize> {
    FAMILIES.iter().filter(|f| f.name == "fa2").flat_map(|f| f.tiles.iter().map(|t| t.head_dim as usize)).collect()
}

pub fn engine() -> Engine {
    Engine::new(0).expect("these tests need CUDA device 0 (run them with --ignored on a GPU)")
}

/// The variants to test on this GPU: Auto and every family whose minimum SM it meets. A family it
/// does not meet must be refused with VariantUnavailable (checked, not skipped).
pub fn variants(engine: &Engine) -> Vec<Variant> {
    let (major, minor) = engine.device().compute_capability();
    let sm = (major * 10 + minor) as u32;
    let mut out = vec![Variant::Auto];
    // The FA3 and FA4 stage ladders have their own matrices (fa3_stage1..5, fa4_stage1..3 in
    // main.rs): they refuse ALiBi and inexact head dims, which this generic matrix draws, and FA4
    // runs only with `fa4_stage`; so do FA4's softmax rows on the FA2 / FA3 pipelines
    // (fa4_softmax_pipelines).
    for fam in FAMILIES.iter().filter(|f| f.stage.is_none() && Variant::from(f.variant) != Variant::Fa4) {
        let var = Variant::from(fam.variant);
        if sm >= fam.min_sm {
            // fa2 and fa2v are one variant.
            if !out.contains(&var) {
                out.push(var);
            }
        } else {
            let e = engine.dispatch([1, 8, 1, 64], [1, 8, 1, 64], DType::BF16, &ForwardOptions::default().variant(var));
            assert!(matches!(e, Err(Error::VariantUnavailable { .. })), "{} on sm_{sm}: {e:?}", fam.name);
        }
    }
    out
}

/// What one launch produced.
pub struct GpuOut {
    pub o: Vec<f64>,
    pub lse: Option<Vec<f64>>,
    pub kernel: String,
}

/// Runs q, k, v (with the given element strides of b/s/h) through the engine on a stream of its
/// own, into NaN-poisoned output buffers.
pub fn run_typed<T: Element + DeviceRepr>(
    engine: &Engine,
    stream: &Arc<CudaStream>,
    inputs: [(&[T], [usize; 4], [usize; 3]); 3],
    opts: &ForwardOptions,
) -> flash_attn::Result<GpuOut> {
    let [(q, qs, qst), (k, ks, kst), (v, vs, vst)] = inputs;
    let up = |x: &[T]| stream.clone_htod(x).unwrap();
    let (dq, dk, dv) = (up(q), up(k), up(v));
    let os = [qs[0], qs[1], qs[2], vs[3]]; // q's shape with v's head_dim
    let n_o: usize = os.iter().product();
    let n_lse = qs[0] * qs[2] * qs[1];
    let mut d_o = stream.clone_htod(&vec![T::from_f32(f32::NAN); n_o]).unwrap();
    let mut d_lse = stream.clone_htod(&vec![f32::NAN; n_lse]).unwrap();
    let dispatch = {
        let tq = DeviceTensor::new(&dq, stream, qs).with_strides(qst);
        let tk = DeviceTensor::new(&dk, stream, ks).with_strides(kst);
        let tv = DeviceTensor::new(&dv, stream, vs).with_strides(vst);
        let mut to = DeviceTensorMut::new(&mut d_o, stream, os);
        let mut tl = DeviceLse::new(&mut d_lse, stream);
        engine.forward(stream, &tq, &tk, &tv, &mut to, opts.return_lse.then_some(&mut tl), opts)?
    };
    let o: Vec<T> = stream.clone_dtoh(&d_o).unwrap();
    let lse: Vec<f32> = stream.clone_dtoh(&d_lse).unwrap();
    stream.synchronize().expect("kernel execution");
    Ok(GpuOut {
        o: o.iter().map(|x| x.to_f32() as f64).collect(),
        lse: opts.return_lse.then(|| lse.iter().map(|&x| x as f64).collect()),
        kernel: dispatch.kernel,
    })
}

/// Runs host views (f16 or bf16) through the engine into NaN-poisoned buffers.
pub fn run_views(engine: &Engine, stream: &Arc<CudaStream>, views: [TensorView; 3], opts: &ForwardOptions) -> flash_attn::Result<GpuOut> {
    let [q, k, v] = views;
    let input = |t: &TensorView| (t.shape(), t.strides());
    let ((qs, qst), (ks, kst), (vs, vst)) = (input(&q), input(&k), input(&v));
    match (q.data(), k.data(), v.data()) {
        (flash_attn::Data::F16(a), flash_attn::Data::F16(b), flash_attn::Data::F16(c)) => {
            run_typed::<f16>(engine, stream, [(a, qs, qst), (b, ks, kst), (c, vs, vst)], opts)
        }
        (flash_attn::Data::BF16(a), flash_attn::Data::BF16(b), flash_attn::Data::BF16(c)) => {
            run_typed::<bf16>(engine, stream, [(a, qs, qst), (b, ks, kst), (c, vs, vst)], opts)
        }
        _ => panic!("GPU tests use f16/bf16"),
    }
}

/// The softmax scale that makes the largest |q·k| of the inputs equal `target` (e.g. scores near
/// f32::MAX, where log2-unit scores overflow).
pub fn scale_for_max_score(q: &Tensor, k: &Tensor, target: f64) -> f32 {
    let [b, sq, hq, d] = q.shape();
    let [_, sk, hk, _] = k.shape();
    let (qv, kv) = (q.to_f32_vec(), k.to_f32_vec());
    let mut max_dot = 0.0f64;
    for bi in 0..b {
        for h in 0..hq {
            for i in 0..sq {
                for j in 0..sk {
                    let qr = &qv[((bi * sq + i) * hq + h) * d..][..d];
                    let kr = &kv[((bi * sk + j) * hk + h / (hq / hk)) * d..][..d];
                    max_dot = max_dot.max(qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>().abs());
                }
            }
        }
    }
    (target / max_dot) as f32
}

/// Runs `views` (q, k, v host views over `bufs`) on the GPU and checks against the reference.
/// Returns err / bound.
pub fn check(engine: &Engine, stream: &Arc<CudaStream>, views: [TensorView; 3], opts: &ForwardOptions, what: &str) -> f64 {
    let [q, k, v] = views;
    let p = Problem::new(&q, &k, &v, opts).unwrap();
    // FA2 runs only its exact head dims: forced on another one it must be refused (checked).
    if opts.variant == Variant::Fa2 && !fa2_dims().contains(&p.head_dim) {
        let e = engine.dispatch(q.shape(), k.shape(), p.dtype, opts);
        assert!(matches!(&e, Err(Error::VariantUnavailable { reason, .. }) if reason.contains("exact head dims")), "{what}: {e:?}");
        return 0.0;
    }
    let input = |t: &TensorView| (t.shape(), t.strides());
    let out = match (q.data(), k.data(), v.data()) {
        (flash_attn::Data::F16(a), flash_attn::Data::F16(b), flash_attn::Data::F16(c)) => {
            let ((qs, qst), (ks, kst), (vs, vst)) = (input(&q), input(&k), input(&v));
            run_typed::<f16>(engine, stream, [(a, qs, qst), (b, ks, kst), (c, vs, vst)], opts)
        }
        (flash_attn::Data::BF16(a), flash_attn::Data::BF16(b), flash_attn::Data::BF16(c)) => {
            let ((qs, qst), (ks, kst), (vs, vst)) = (input(&q), input(&k), input(&v));
            run_typed::<bf16>(engine, stream, [(a, qs, qst), (b, ks, kst), (c, vs, vst)], opts)
        }
        _ => panic!("GPU tests use f16/bf16"),
    }
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let r = attention_f64(&p, &q, &k, &v).unwrap();
    let naive = attention_naive(&p, &q, &k, &v, p.dtype).unwrap();
    let err = max_abs_diff(&out.o, &r.o);
    let bound = 2.0 * max_abs_diff(&naive, &r.o) + floor_for(p.dtype);
    assert!(err <= bound, "{what} [{}]: max err {err:.3e} > bound {bound:.3e}", out.kernel);
    if let Some(lse) = &out.lse {
        let lse_err = max_abs_diff(lse, &r.lse);
        assert!(lse_err <= LSE_TOL, "{what} [{}]: LSE err {lse_err:.3e}", out.kernel);
    }
    err / bound
}

/// The edges of the input domain (README) on the GPU: huge window bounds, scores up to near
/// f32::MAX (against the naive f32 softmax, which is finite there; a 16-bit naive would overflow),
/// and infinite V: rows that see no key are exactly 0 with LSE -inf, rows that see an infinite V
/// are not finite. (A row that sees finite keys only, next to a masked key with an infinite V in
/// the same tile, is finite on FA1; on FA2/FA3, whose tensor cores multiply whole tiles, the README
/// contract lets it be NaN, so it is not asserted here.)
pub fn check_edges(engine: &Engine, stream: &Arc<CudaStream>, tensors: [&Tensor; 3], opts: &ForwardOptions, what: &str) {
    let [q, k, v] = tensors;
    let (qv, kv, vv) = (q.view(), k.view(), v.view());
    let out = run_views(engine, stream, [qv, kv, vv], opts).unwrap_or_else(|e| panic!("{what}: {e}"));
    let p = Problem::new(&qv, &kv, &vv, opts).unwrap();
    let r = attention_f64(&p, &qv, &kv, &vv).unwrap();
    let naive = attention_naive(&p, &qv, &kv, &vv, DType::F32).unwrap();
    let d = p.head_dim;
    for (idx, (&got, &want)) in out.o.iter().zip(&r.o).enumerate() {
        let (b, i, h) = (idx / d / p.heads_q / p.seqlen_q, (idx / d / p.heads_q) % p.seqlen_q, (idx / d) % p.heads_q);
        let (lo, hi) = p.key_range(i);
        if lo >= hi {
            assert_eq!(got, 0.0, "{what} [{}]: row {i} (batch {b}, head {h}) sees no key", out.kernel);
        } else if !want.is_finite() {
            assert!(!got.is_finite(), "{what} [{}]: row {i} sees an infinite V but is finite", out.kernel);
        }
    }
    if let Some(lse) = &out.lse {
        for (&got, &want) in lse.iter().zip(&r.lse) {
            if want == f64::NEG_INFINITY {
                assert_eq!(got, f64::NEG_INFINITY, "{what} [{}]: LSE of a row that sees no key", out.kernel);
            } else if want.is_finite() {
                assert!((got - want).abs() <= 1e-6 * want.abs().max(1e3), "{what} [{}]: LSE {got} vs {want}", out.kernel);
            }
        }
    }
    if v.to_f32_vec().iter().all(|x| x.is_finite()) {
        assert!(naive.iter().all(|x| x.is_finite()), "{what}: the case must keep the naive f32 softmax finite");
        assert!(out.o.iter().all(|x| x.is_finite()), "{what} [{}]: naive f32 is finite, the kernel is not", out.kernel);
        let err = max_abs_diff(&out.o, &r.o);
        let bound = 2.0 * max_abs_diff(&naive, &r.o) + floor_for(p.dtype);
        assert!(err <= bound, "{what} [{}]: max err {err:.3e} > bound {bound:.3e}", out.kernel);
    }
}

/// The inputs and options of the edge cases, for `variant` (FA3: no ALiBi, head dims 64/128/256).
pub fn edge_inputs(rng: &mut Rng, dtype: DType, d: usize, fa3: bool) -> Vec<([Tensor; 3], ForwardOptions, String)> {
    let mut out = Vec::new();
    let qkv = |rng: &mut Rng, b, sq, sk, hq, hk| {
        (randn(rng, dtype, [b, sq, hq, d]), randn(rng, dtype, [b, sk, hk, d]), randn(rng, dtype, [b, sk, hk, d]))
    };
    let huge = [i64::MAX, 1 << 40, i32::MAX as i64, i32::MAX as i64 + 1];
    for (n, &h) in huge.iter().enumerate() {
        let (q, k, v) = qkv(rng, 1, 150, 90, 2, 1);
        for mask in [Mask::window(h, h), Mask::window(h, 0), Mask::window(0, h), Mask::causal_window(h)] {
            out.push(([q.clone(), k.clone(), v.clone()], ForwardOptions::default().mask(mask).return_lse(true), format!("huge {n} {mask:?}")));
        }
    }
    // Scores near f32::MAX (log2-unit scores overflow) and at |score · log2 e| ~ 2^33.
    for (target, mask) in [(3.0e38, Mask::Causal), (2.5e38, Mask::window(40, 8)), (1e10, Mask::None), (6e9, Mask::Causal)] {
        let (q, k, v) = qkv(rng, 1, 130, 170, 2, 2);
        let scale = scale_for_max_score(&q, &k, target);
        let opts = ForwardOptions::default().mask(mask).softmax_scale(scale).return_lse(true);
        out.push(([q, k, v], opts, format!("max |score| {target:e} {mask:?}")));
    }
    // Softcap near f32::MAX; ALiBi slopes whose bias reaches 1e36 (not FA3: no ALiBi).
    let (q, k, v) = qkv(rng, 1, 100, 120, 2, 1);
    out.push(([q.clone(), k.clone(), v.clone()], ForwardOptions::default().causal(true).softcap(f32::MAX).return_lse(true), "softcap f32::MAX".into()));
    if !fa3 {
        let opts = ForwardOptions::default().causal(true).alibi_slopes(vec![1e30f32, 1e34]).return_lse(true);
        out.push(([q, k, v], opts, "ALiBi slopes 1e30, 1e34".into()));
    }
    // Every V infinite, then NaN: causal with sq > sk leaves rows that see no key.
    for (val, name) in [(f32::INFINITY, "V = +inf"), (f32::NAN, "V = NaN")] {
        let (q, k, _) = qkv(rng, 1, 200, 70, 2, 1);
        let v = Tensor::from_f32(&vec![val; 70 * d], dtype, [1, 70, 1, d]).unwrap();
        out.push(([q, k, v], ForwardOptions::default().causal(true).return_lse(true), name.into()));
    }
    out
}

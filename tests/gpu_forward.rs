//! GPU tests: every kernel family in build/instances.rs against the float64 reference, with
//! FlashAttention's tolerance `max|out - ref| <= 2 * max|naive_same_dtype - ref| + floor`.
//! The output and LSE buffers are poisoned with NaN before each launch, so an element the kernel
//! does not write fails the comparison.
//!
//! All `#[ignore]`d: a CPU run lists them as ignored. On a GPU:
//! `cargo test --release --test gpu_forward -- --ignored` (scripts/gpu-check.sh runs them).
#![cfg(feature = "cuda")]

mod common;
use common::*;
use cudarc::driver::{CudaStream, DeviceRepr};
use flash_attn::cuda::{kernels::fa3_stage, kernels::fa4_stage, kernels::FAMILIES, DeviceLse, DeviceTensor, DeviceTensorMut, Engine};
use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff};
use flash_attn::{Backend, DType, Element, Error, ForwardOptions, Mask, Problem, Tensor, TensorView, Variant};
use half::{bf16, f16};
use std::sync::Arc;

/// LSE is f32 softmax statistics of inputs the reference sees exactly: only f32 rounding.
const LSE_TOL: f64 = 2e-3;

/// Upper bound on batch·heads_q·seqlen_q·seqlen_k·head_dim per random case, so the float64
/// reference stays fast.
const WORK_LIMIT: usize = 12_000_000;

fn variant_of(name: &str) -> Variant {
    match name {
        "Fa1" => Variant::Fa1,
        "Fa2" => Variant::Fa2,
        "Fa3" => Variant::Fa3,
        "Fa4" => Variant::Fa4,
        other => panic!("build/instances.rs names an unknown variant {other:?}"),
    }
}

/// The head dims the FA2 family is instantiated for (it has no tail masking).
fn fa2_dims() -> Vec<usize> {
    FAMILIES.iter().filter(|f| f.name == "fa2").flat_map(|f| f.tiles.iter().map(|t| t.head_dim as usize)).collect()
}

fn engine() -> Engine {
    Engine::new(0).expect("these tests need CUDA device 0 (run them with --ignored on a GPU)")
}

/// The variants to test on this GPU: Auto and every family whose minimum SM it meets. A family it
/// does not meet must be refused with VariantUnavailable (checked, not skipped).
fn variants(engine: &Engine) -> Vec<Variant> {
    let (major, minor) = engine.device().compute_capability();
    let sm = (major * 10 + minor) as u32;
    let mut out = vec![Variant::Auto];
    // The FA3 and FA4 stage ladders have their own matrices (fa3_stage1..5, fa4_stage1..3 below):
    // they refuse ALiBi and inexact head dims, which this generic matrix draws, and FA4 runs only
    // with `fa4_stage`.
    for fam in FAMILIES.iter().filter(|f| fa3_stage(f.name).is_none() && fa4_stage(f.name).is_none()) {
        let var = variant_of(fam.variant);
        if sm >= fam.min_sm {
            out.push(var);
        } else {
            let e = engine.dispatch([1, 8, 1, 64], [1, 8, 1, 64], DType::BF16, &ForwardOptions::default().variant(var));
            assert!(matches!(e, Err(Error::VariantUnavailable { .. })), "{} on sm_{sm}: {e:?}", fam.name);
        }
    }
    out
}

/// What one launch produced.
struct GpuOut {
    o: Vec<f64>,
    lse: Option<Vec<f64>>,
    kernel: String,
}

/// Runs q, k, v (with the given element strides of b/s/h) through the engine on a stream of its
/// own, into NaN-poisoned output buffers.
fn run_typed<T: Element + DeviceRepr>(
    engine: &Engine,
    stream: &Arc<CudaStream>,
    inputs: [(&[T], [usize; 4], [usize; 3]); 3],
    opts: &ForwardOptions,
) -> flash_attn::Result<GpuOut> {
    let [(q, qs, qst), (k, ks, kst), (v, vs, vst)] = inputs;
    let up = |x: &[T]| stream.clone_htod(x).unwrap();
    let (dq, dk, dv) = (up(q), up(k), up(v));
    let n_o: usize = qs.iter().product();
    let n_lse = qs[0] * qs[2] * qs[1];
    let mut d_o = stream.clone_htod(&vec![T::from_f32(f32::NAN); n_o]).unwrap();
    let mut d_lse = stream.clone_htod(&vec![f32::NAN; n_lse]).unwrap();
    let dispatch = {
        let tq = DeviceTensor::new(&dq, stream, qs).with_strides(qst);
        let tk = DeviceTensor::new(&dk, stream, ks).with_strides(kst);
        let tv = DeviceTensor::new(&dv, stream, vs).with_strides(vst);
        let mut to = DeviceTensorMut::new(&mut d_o, stream, qs);
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
fn run_views(engine: &Engine, stream: &Arc<CudaStream>, views: [TensorView; 3], opts: &ForwardOptions) -> flash_attn::Result<GpuOut> {
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
fn scale_for_max_score(q: &Tensor, k: &Tensor, target: f64) -> f32 {
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

/// The edges of the input domain (issue 10) on the GPU: huge window bounds, scores up to near
/// f32::MAX (against the naive f32 softmax, which is finite there; a 16-bit naive would overflow),
/// and infinite V: rows that see no key are exactly 0 with LSE -inf, rows that see an infinite V
/// are not finite. (A row that sees finite keys only, next to a masked key with an infinite V in
/// the same tile, is finite on FA1; on FA2/FA3, whose tensor cores multiply whole tiles, the README
/// contract lets it be NaN, so it is not asserted here.)
fn check_edges(engine: &Engine, stream: &Arc<CudaStream>, tensors: [&Tensor; 3], opts: &ForwardOptions, what: &str) {
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
fn edge_inputs(rng: &mut Rng, dtype: DType, d: usize, fa3: bool) -> Vec<([Tensor; 3], ForwardOptions, String)> {
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

#[test]
#[ignore = "needs a CUDA GPU"]
fn domain_edges() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng(0xed9e);
    for dtype in [DType::F16, DType::BF16] {
        for var in variants(&engine) {
            for d in [64usize, 128] {
                if var == Variant::Fa2 && !fa2_dims().contains(&d) {
                    continue;
                }
                for ([q, k, v], opts, what) in edge_inputs(&mut rng, dtype, d, false) {
                    let what = format!("{dtype:?} {var:?} d{d} {what}");
                    check_edges(&engine, &stream, [&q, &k, &v], &opts.variant(var), &what);
                }
            }
        }
    }
}

/// Runs `views` (q, k, v host views over `bufs`) on the GPU and checks against the reference.
/// Returns err / bound.
fn check(engine: &Engine, stream: &Arc<CudaStream>, views: [TensorView; 3], opts: &ForwardOptions, what: &str) -> f64 {
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

/// One random case drawn like tests/cpu_props.rs: shapes, GQA ratio, mask, softcap, ALiBi, LSE.
fn random_case(rng: &mut Rng, dtype: DType) -> ([Tensor; 3], ForwardOptions, String) {
    let pick = |rng: &mut Rng, xs: &[usize]| xs[(rng.next_u64() % xs.len() as u64) as usize];
    let heads_kv = 1 + (rng.next_u64() % 2) as usize;
    let ratio = pick(rng, &[1, 2, 4, 7]);
    let sq = 1 + (rng.next_u64() % 300) as usize;
    let sk = 1 + (rng.next_u64() % 300) as usize;
    // The instantiated dims, and dims between them (run on the next instance, tail masked).
    let d = pick(rng, &[8, 17, 32, 40, 64, 80, 96, 128, 160, 192, 200, 256]);
    let hq = heads_kv * ratio;
    let batch = (1 + (rng.next_u64() % 3) as usize).min((WORK_LIMIT / (hq * sq * sk * d)).max(1));
    let bound = |rng: &mut Rng| (rng.next_u64() % 41) as i64 - 1; // -1 (unbounded) ..= 39
    let mask = match rng.next_u64() % 4 {
        0 => Mask::None,
        1 => Mask::Causal,
        2 => Mask::window(bound(rng), bound(rng)),
        _ => Mask::causal_window(bound(rng)),
    };
    let mut opts = ForwardOptions::default().mask(mask).return_lse(rng.next_u64() % 2 == 0);
    if rng.next_u64() % 10 < 3 {
        opts = opts.softcap(5.0 + (rng.uniform() * 45.0) as f32);
    }
    if rng.next_u64() % 10 < 3 {
        let slopes: Vec<f32> = (0..hq).map(|h| 0.5f32.powi(h as i32 % 8 + 1)).collect();
        opts = opts.alibi_slopes(slopes);
    }
    let q = randn(rng, dtype, [batch, sq, hq, d]);
    let k = randn(rng, dtype, [batch, sk, heads_kv, d]);
    let v = randn(rng, dtype, [batch, sk, heads_kv, d]);
    let what = format!("b{batch} sq{sq} sk{sk} hq{hq} hkv{heads_kv} d{d} {mask:?} softcap {:?} alibi {}", opts.softcap, opts.alibi_slopes.is_some());
    ([q, k, v], opts, what)
}

fn random_matrix(dtype: DType, cases: usize, seed: u64) {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let vars = variants(&engine);
    let mut rng = Rng(seed);
    let mut worst = 0.0f64;
    for i in 0..cases {
        let ([q, k, v], opts, what) = random_case(&mut rng, dtype);
        for &var in &vars {
            let opts = opts.clone().variant(var);
            let r = check(&engine, &stream, [q.view(), k.view(), v.view()], &opts, &format!("case {i} {var:?} {what}"));
            worst = worst.max(r);
        }
    }
    println!("{dtype:?}: {cases} cases x {vars:?} passed; worst err/bound {worst:.3}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn random_f16() {
    random_matrix(DType::F16, 120, 0x05ee_df16);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn random_bf16() {
    random_matrix(DType::BF16, 120, 0x5eed_bf16);
}

/// Edge cases: one query/key, seqlens that are not multiples of any tile, sq > sk causal (rows
/// that see no key: output 0, LSE -inf), windows that empty whole blocks, MQA, every instance.
#[test]
#[ignore = "needs a CUDA GPU"]
fn edge_cases() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng(7);
    let cases: &[(usize, usize, usize, usize, usize, Mask)] = &[
        // (sq, sk, hq, hkv, d, mask)
        (1, 1, 1, 1, 32, Mask::None),
        (1, 1, 1, 1, 256, Mask::Causal),
        (203, 100, 4, 2, 128, Mask::Causal), // first 103 rows see nothing
        (100, 203, 4, 4, 64, Mask::Causal),
        (65, 65, 8, 1, 96, Mask::window(0, 0)), // only the diagonal
        (300, 300, 2, 1, 192, Mask::window(3, 5)),
        (129, 257, 3, 3, 256, Mask::causal_window(16)),
        (64, 64, 2, 2, 64, Mask::window(-1, -1)),
        (33, 1000, 2, 2, 128, Mask::None),
        (1000, 33, 2, 1, 32, Mask::Causal),
    ];
    for dtype in [DType::F16, DType::BF16] {
        for &(sq, sk, hq, hkv, d, mask) in cases {
            let q = randn(&mut rng, dtype, [2, sq, hq, d]);
            let k = randn(&mut rng, dtype, [2, sk, hkv, d]);
            let v = randn(&mut rng, dtype, [2, sk, hkv, d]);
            for var in variants(&engine) {
                let opts = ForwardOptions::default().mask(mask).return_lse(true).variant(var);
                let what = format!("{dtype:?} sq{sq} sk{sk} hq{hq} hkv{hkv} d{d} {mask:?} {var:?}");
                check(&engine, &stream, [q.view(), k.view(), v.view()], &opts, &what);
            }
        }
    }
}

/// Strided inputs: q, k, v as views into one packed `[b, s, 3, h, d]` buffer (no copies), and
/// large score magnitudes (softcap and a big scale).
#[test]
#[ignore = "needs a CUDA GPU"]
fn packed_qkv_and_softcap() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng(11);
    let (b, s, h, d) = (2, 150, 4, 128);
    for dtype in [DType::F16, DType::BF16] {
        let packed = randn(&mut rng, dtype, [b, s, 3 * h, d]);
        let all = packed.view();
        let strides = [s * 3 * h * d, 3 * h * d, d];
        let part = |i: usize| -> TensorView {
            let off = i * h * d;
            match all.data() {
                flash_attn::Data::F16(x) => TensorView::with_strides(&x[off..], [b, s, h, d], strides),
                flash_attn::Data::BF16(x) => TensorView::with_strides(&x[off..], [b, s, h, d], strides),
                flash_attn::Data::F32(x) => TensorView::with_strides(&x[off..], [b, s, h, d], strides),
            }
        };
        for var in variants(&engine) {
            let opts = ForwardOptions::default().causal(true).softcap(30.0).softmax_scale(0.5).return_lse(true).variant(var);
            check(&engine, &stream, [part(0), part(1), part(2)], &opts, &format!("packed {dtype:?} {var:?}"));
        }
    }
}

/// The host-memory path: `forward` with Backend::Cuda(0) uploads, runs and downloads; f32 on the
/// GPU is refused with UnsupportedDType; Auto runs f32 on the CPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn host_forward_on_gpu() {
    let mut rng = Rng(3);
    let q = randn(&mut rng, DType::BF16, [1, 77, 4, 64]);
    let k = randn(&mut rng, DType::BF16, [1, 91, 2, 64]);
    let v = randn(&mut rng, DType::BF16, [1, 91, 2, 64]);
    let opts = ForwardOptions::default().causal(true).return_lse(true).backend(Backend::Cuda(0));
    let (out, c) = check_forward(&q, &k, &v, &opts);
    assert_eq!(out.dispatch.backend, "cuda:0");
    assert!(c.err <= c.bound && c.lse_err <= LSE_TOL, "{c:?}");
    println!("{:?}", out.dispatch);

    let q32 = randn(&mut rng, DType::F32, [1, 8, 1, 64]);
    let e = flash_attn::forward(&q32, &q32, &q32, &ForwardOptions::default().backend(Backend::Cuda(0)));
    assert!(matches!(e, Err(Error::UnsupportedDType { .. })), "{e:?}");
    let auto = flash_attn::forward(&q32, &q32, &q32, &ForwardOptions::default()).unwrap();
    assert_eq!(auto.dispatch.backend, "cpu");
}

/// Auto's choice is recorded; a head_dim past every instance is a typed error.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dispatch_record_and_errors() {
    let engine = engine();
    let d = engine.dispatch([1, 128, 8, 128], [1, 128, 8, 128], DType::BF16, &ForwardOptions::default()).unwrap();
    println!("{d:?}");
    assert!(d.backend == "cuda:0" && !d.kernel.is_empty() && d.reason.starts_with("Auto"));
    let e = engine.dispatch([1, 8, 1, 512], [1, 8, 1, 512], DType::BF16, &ForwardOptions::default());
    assert!(matches!(e, Err(Error::UnsupportedHeadDim { .. })), "{e:?}");
}

/// FA2 on sm_80+: Auto picks it for its head dims (FA3 stays out of Auto until verified); a q
/// that is not 16-byte aligned makes Auto fall back to FA1 with the reason recorded, and is an
/// error when Fa2 is forced. The fallback's output is still checked against the reference.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa2_dispatch_and_layout_fallback() {
    let engine = engine();
    let (major, minor) = engine.device().compute_capability();
    assert!(major * 10 + minor >= 80, "FA2 needs sm_80+; the crate's kernels all do");
    for d in fa2_dims() {
        let r = engine.dispatch([1, 128, 8, d], [1, 128, 2, d], DType::BF16, &ForwardOptions::default()).unwrap();
        assert!(r.kernel.starts_with("fa2_"), "Auto on sm_{major}{minor} hd{d}: {r:?}");
    }
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng(17);
    let shape = [1, 70, 2, 64];
    let n: usize = shape.iter().product();
    let q = randn(&mut rng, DType::F16, shape);
    let flash_attn::Data::F16(host) = q.view().data() else { unreachable!() };
    // One leading element: the view at offset 1 is 2-byte, not 16-byte, aligned.
    let mut shifted = vec![f16::ZERO];
    shifted.extend_from_slice(&host[..n]);
    let dq = stream.clone_htod(&shifted).unwrap();
    let dkv = stream.clone_htod(&host[..n]).unwrap();
    let mut d_o = stream.clone_htod(&vec![f16::from_f32(f32::NAN); n]).unwrap();
    let run = |variant: Variant, d_o: &mut cudarc::driver::CudaSlice<f16>| {
        let qv = dq.slice(1..);
        let tq = DeviceTensor::new(&qv, &stream, shape);
        let tkv = DeviceTensor::new(&dkv, &stream, shape);
        let mut to = DeviceTensorMut::new(d_o, &stream, shape);
        engine.forward(&stream, &tq, &tkv, &tkv, &mut to, None, &ForwardOptions::default().variant(variant))
    };
    let e = run(Variant::Fa2, &mut d_o);
    assert!(matches!(&e, Err(Error::VariantUnavailable { reason, .. }) if reason.contains("aligned")), "{e:?}");
    let r = run(Variant::Auto, &mut d_o).unwrap();
    assert!(r.kernel.starts_with("fa1_") && r.reason.contains("fa2 passed over"), "{r:?}");
    let o: Vec<f16> = stream.clone_dtoh(&d_o).unwrap();
    stream.synchronize().expect("kernel execution");
    let p = Problem::new(&q.view(), &q.view(), &q.view(), &ForwardOptions::default()).unwrap();
    let reference = attention_f64(&p, &q.view(), &q.view(), &q.view()).unwrap();
    let naive = attention_naive(&p, &q.view(), &q.view(), &q.view(), DType::F16).unwrap();
    let got: Vec<f64> = o.iter().map(|x| x.to_f64()).collect();
    let (err, bound) = (max_abs_diff(&got, &reference.o), 2.0 * max_abs_diff(&naive, &reference.o) + floor_for(DType::F16));
    assert!(err <= bound, "fallback output: err {err:.3e} > bound {bound:.3e}");
}

/// Without a GPU, Backend::Cuda is a typed error (never a panic); with one it runs. Not
/// ignored: each machine checks the half it can.
#[test]
fn cuda_backend_is_an_error_or_runs() {
    let mut rng = Rng(5);
    let q = randn(&mut rng, DType::BF16, [1, 16, 2, 64]);
    let r = flash_attn::forward(&q, &q, &q, &ForwardOptions::default().backend(Backend::Cuda(0)));
    if flash_attn::cuda::device_count() == 0 {
        assert!(matches!(&r, Err(Error::BackendUnavailable { backend, .. }) if backend == "cuda:0"), "{r:?}");
    } else {
        assert_eq!(r.expect("forward on cuda:0").dispatch.backend, "cuda:0");
    }
}

/// The short subset scripts/gpu-check.sh runs under `compute-sanitizer --tool memcheck`: every
/// instantiated head dim and one tail dim, seqlens off every tile size, causal and window, GQA,
/// LSE, both dtypes, every variant. Small, so memcheck's slowdown stays affordable.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitizer_subset() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng(13);
    let mut dims: Vec<usize> = FAMILIES.iter().flat_map(|f| f.tiles.iter().map(|t| t.head_dim as usize)).collect();
    dims.push(40);
    dims.sort_unstable();
    dims.dedup();
    for dtype in [DType::F16, DType::BF16] {
        for &d in &dims {
            for mask in [Mask::Causal, Mask::window(7, 2)] {
                let q = randn(&mut rng, dtype, [1, 37, 4, d]);
                let k = randn(&mut rng, dtype, [1, 45, 2, d]);
                let v = randn(&mut rng, dtype, [1, 45, 2, d]);
                for var in variants(&engine) {
                    let opts = ForwardOptions::default().mask(mask).return_lse(true).alibi_slopes(vec![0.25f32; 4]).variant(var);
                    check(&engine, &stream, [q.view(), k.view(), v.view()], &opts, &format!("{dtype:?} d{d} {mask:?} {var:?}"));
                }
            }
        }
    }
}

// ---------------------------------------------------------------- FA3 stage ladder
// One test per stage (scripts/gpu-check-run.sh runs them in ascending order, each under its
// own timeout, so a hang in stage N names its rung and leaves the window to the others).

/// Whether this GPU runs the FA3 kernels (sm_90a SASS: compute capability 9.0 only). Elsewhere
/// the stage must be refused with VariantUnavailable, which is checked.
fn fa3_runs_here(engine: &Engine, stage: u8) -> bool {
    let opts = ForwardOptions::default().variant(Variant::Fa3).fa3_stage(stage);
    let d = engine.dispatch([1, 64, 1, 64], [1, 64, 1, 64], DType::BF16, &opts);
    if engine.device().compute_capability() == (9, 0) {
        let d = d.unwrap_or_else(|e| panic!("fa3 stage {stage} on sm_90: {e}"));
        assert_eq!(d.kernel, format!("fa3s{stage}_fwd_hd64_bf16"));
        true
    } else {
        assert!(matches!(d, Err(Error::VariantUnavailable { .. })), "fa3 stage {stage} off sm_90: {d:?}");
        false
    }
}

/// The FA3 matrix of one stage: bf16/f16 × head_dim 64/128/256 × (plain; GQA + causal with
/// sq < sk; a sliding window; sq > sk causal: rows with no key give O = 0, LSE = -inf; softcap;
/// several K/V tiles (ring wrap); odd seqlens with GQA 7:1 and a causal window), each against
/// the float64 reference with FlashAttention's tolerance, outputs NaN-poisoned; then more
/// query tiles than SMs (stage 5: many tiles per CTA), and the typed refusals (ALiBi, head_dim
/// 96, strides off the 16-byte rule).
fn fa3_matrix(stage: u8) {
    let engine = engine();
    if !fa3_runs_here(&engine, stage) {
        return;
    }
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng(0xfa3 + stage as u64);
    let fa3 = ForwardOptions::default().variant(Variant::Fa3).fa3_stage(stage);
    // (batch, sq, sk, hq, hkv, mask, softcap, lse)
    type Case = (usize, usize, usize, usize, usize, Mask, Option<f32>, bool);
    let cases: &[Case] = &[
        (1, 128, 128, 1, 1, Mask::None, None, false),
        (2, 100, 300, 4, 2, Mask::Causal, None, true),
        (1, 257, 257, 2, 2, Mask::window(64, 16), None, true),
        (1, 300, 100, 2, 1, Mask::Causal, None, true),
        (1, 150, 200, 2, 2, Mask::None, Some(30.0), true),
        (1, 70, 520, 1, 1, Mask::None, None, true),
        (2, 77, 333, 7, 1, Mask::causal_window(40), None, true),
    ];
    let mut worst = 0.0f64;
    for dtype in [DType::BF16, DType::F16] {
        for d in [64usize, 128, 256] {
            for &(b, sq, sk, hq, hkv, mask, softcap, lse) in cases {
                let q = randn(&mut rng, dtype, [b, sq, hq, d]);
                let k = randn(&mut rng, dtype, [b, sk, hkv, d]);
                let v = randn(&mut rng, dtype, [b, sk, hkv, d]);
                let mut opts = fa3.clone().mask(mask).return_lse(lse);
                if let Some(c) = softcap {
                    opts = opts.softcap(c);
                }
                let dt = if dtype == DType::BF16 { "bf16" } else { "f16" };
                let chosen = engine.dispatch([b, sq, hq, d], [b, sk, hkv, d], dtype, &opts).unwrap();
                assert_eq!(chosen.kernel, format!("fa3s{stage}_fwd_hd{d}_{dt}"), "{}", chosen.reason);
                let what = format!("fa3 stage {stage} {dtype:?} b{b} sq{sq} sk{sk} hq{hq} hkv{hkv} d{d} {mask:?} softcap {softcap:?}");
                worst = worst.max(check(&engine, &stream, [q.view(), k.view(), v.view()], &opts, &what));
            }
        }
    }
    // More (query tile, head, batch) tiles than any GPU has SMs: stage 5's CTAs take many each.
    for dtype in [DType::BF16, DType::F16] {
        let q = randn(&mut rng, dtype, [4, 520, 16, 64]);
        let k = randn(&mut rng, dtype, [4, 64, 4, 64]);
        let v = randn(&mut rng, dtype, [4, 64, 4, 64]);
        let opts = fa3.clone().causal(true).return_lse(true);
        let what = format!("fa3 stage {stage} {dtype:?} many tiles");
        worst = worst.max(check(&engine, &stream, [q.view(), k.view(), v.view()], &opts, &what));
    }
    // The edges of the input domain (issue 10): huge windows, scores up to near f32::MAX,
    // softcap f32::MAX, infinite and NaN V with rows that see no key.
    for dtype in [DType::BF16, DType::F16] {
        for d in [64usize, 128, 256] {
            for ([q, k, v], opts, what) in edge_inputs(&mut rng, dtype, d, true) {
                let mut o = fa3.clone().mask(opts.mask).return_lse(true);
                o.softmax_scale = opts.softmax_scale;
                o.softcap = opts.softcap;
                check_edges(&engine, &stream, [&q, &k, &v], &o, &format!("fa3 stage {stage} {dtype:?} d{d} {what}"));
            }
        }
    }
    // Refusals are typed errors.
    let alibi = fa3.clone().alibi_slopes(vec![0.25f32; 2]);
    let e = engine.dispatch([1, 64, 2, 64], [1, 64, 2, 64], DType::BF16, &alibi);
    assert!(matches!(&e, Err(Error::VariantUnavailable { reason, .. }) if reason.contains("ALiBi")), "{e:?}");
    let e = engine.dispatch([1, 64, 2, 96], [1, 64, 2, 96], DType::BF16, &fa3);
    assert!(matches!(e, Err(Error::VariantUnavailable { .. })), "{e:?}");
    let padded = randn(&mut rng, DType::BF16, [1, 64, 1, 68]);
    let data = match padded.view().data() {
        flash_attn::Data::BF16(x) => x.to_vec(),
        _ => unreachable!(),
    };
    let strided = [64 * 68, 68, 64]; // rows 68 elements apart: 136 bytes, not a multiple of 16
    let shape = [1, 64, 1, 64];
    let r = run_typed::<bf16>(&engine, &stream, [(&data, shape, strided), (&data, shape, strided), (&data, shape, strided)], &fa3);
    assert!(matches!(r, Err(Error::InvalidLayout { .. })), "stride 68: {:?}", r.err());
    println!("fa3 stage {stage}: passed; worst err/bound {worst:.3}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_stage1() {
    fa3_matrix(1);
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_stage2() {
    fa3_matrix(2);
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_stage3() {
    fa3_matrix(3);
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_stage4() {
    fa3_matrix(4);
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_stage5() {
    fa3_matrix(5);
}

/// Whether this GPU runs the FA4 kernels (sm_100a SASS: compute capability 10.0 only); elsewhere
/// the stage must be refused with VariantUnavailable (checked).
fn fa4_runs_here(engine: &Engine, stage: u8) -> bool {
    let opts = ForwardOptions::default().variant(Variant::Fa4).fa4_stage(stage);
    let d = engine.dispatch([1, 64, 1, 64], [1, 64, 1, 64], DType::BF16, &opts);
    if engine.device().compute_capability() == (10, 0) {
        let d = d.unwrap_or_else(|e| panic!("fa4 stage {stage} on sm_100: {e}"));
        assert_eq!(d.kernel, format!("fa4s{stage}_fwd_hd64_bf16"));
        true
    } else {
        assert!(matches!(d, Err(Error::VariantUnavailable { .. })), "fa4 stage {stage} off sm_100: {d:?}");
        false
    }
}

/// The FA4 (tcgen05) matrix of one stage, as FA3's: bf16/f16 x head_dim 64/128 x the FA3 cases
/// against the float64 reference, the domain edges, and the refusals (ALiBi, head_dim 96, no
/// stage). Written where no Blackwell GPU was available: never run.
fn fa4_matrix(stage: u8) {
    let engine = engine();
    if !fa4_runs_here(&engine, stage) {
        return;
    }
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng(0xfa4 + stage as u64);
    let fa4 = ForwardOptions::default().variant(Variant::Fa4).fa4_stage(stage);
    type Case = (usize, usize, usize, usize, usize, Mask, Option<f32>, bool);
    let cases: &[Case] = &[
        (1, 128, 128, 1, 1, Mask::None, None, false),
        (2, 100, 300, 4, 2, Mask::Causal, None, true),
        (1, 257, 257, 2, 2, Mask::window(64, 16), None, true),
        (1, 300, 100, 2, 1, Mask::Causal, None, true),
        (1, 150, 200, 2, 2, Mask::None, Some(30.0), true),
        (1, 70, 520, 1, 1, Mask::None, None, true),
        (2, 77, 333, 7, 1, Mask::causal_window(40), None, true),
    ];
    let mut worst = 0.0f64;
    for dtype in [DType::BF16, DType::F16] {
        for d in [64usize, 128] {
            for &(b, sq, sk, hq, hkv, mask, softcap, lse) in cases {
                let q = randn(&mut rng, dtype, [b, sq, hq, d]);
                let k = randn(&mut rng, dtype, [b, sk, hkv, d]);
                let v = randn(&mut rng, dtype, [b, sk, hkv, d]);
                let mut opts = fa4.clone().mask(mask).return_lse(lse);
                if let Some(c) = softcap {
                    opts = opts.softcap(c);
                }
                let dt = if dtype == DType::BF16 { "bf16" } else { "f16" };
                let chosen = engine.dispatch([b, sq, hq, d], [b, sk, hkv, d], dtype, &opts).unwrap();
                assert_eq!(chosen.kernel, format!("fa4s{stage}_fwd_hd{d}_{dt}"), "{}", chosen.reason);
                let what = format!("fa4 stage {stage} {dtype:?} b{b} sq{sq} sk{sk} hq{hq} hkv{hkv} d{d} {mask:?} softcap {softcap:?}");
                worst = worst.max(check(&engine, &stream, [q.view(), k.view(), v.view()], &opts, &what));
            }
            for ([q, k, v], opts, what) in edge_inputs(&mut rng, dtype, d, true) {
                let mut o = fa4.clone().mask(opts.mask).return_lse(true);
                o.softmax_scale = opts.softmax_scale;
                o.softcap = opts.softcap;
                check_edges(&engine, &stream, [&q, &k, &v], &o, &format!("fa4 stage {stage} {dtype:?} d{d} {what}"));
            }
        }
    }
    let alibi = fa4.clone().alibi_slopes(vec![0.25f32; 2]);
    let e = engine.dispatch([1, 64, 2, 64], [1, 64, 2, 64], DType::BF16, &alibi);
    assert!(matches!(&e, Err(Error::VariantUnavailable { reason, .. }) if reason.contains("ALiBi")), "{e:?}");
    let e = engine.dispatch([1, 64, 2, 96], [1, 64, 2, 96], DType::BF16, &fa4);
    assert!(matches!(e, Err(Error::VariantUnavailable { .. })), "{e:?}");
    let no_stage = ForwardOptions::default().variant(Variant::Fa4);
    let e = engine.dispatch([1, 64, 2, 64], [1, 64, 2, 64], DType::BF16, &no_stage);
    assert!(matches!(&e, Err(Error::VariantUnavailable { reason, .. }) if reason.contains("fa4_stage")), "{e:?}");
    println!("fa4 stage {stage}: passed; worst err/bound {worst:.3}");
}

#[test]
#[ignore = "needs a CUDA GPU (a Blackwell sm_100 one to run; elsewhere the refusal is checked)"]
fn fa4_stage1() {
    fa4_matrix(1);
}
#[test]
#[ignore = "needs a CUDA GPU (a Blackwell sm_100 one to run; elsewhere the refusal is checked)"]
fn fa4_stage2() {
    fa4_matrix(2);
}
#[test]
#[ignore = "needs a CUDA GPU (a Blackwell sm_100 one to run; elsewhere the refusal is checked)"]
fn fa4_stage3() {
    fa4_matrix(3);
}

/// The short FA3 subset scripts/gpu-check-run.sh runs under compute-sanitizer (memcheck,
/// racecheck, synccheck), one stage at a time (`FA3_SANITIZE_STAGE`, default all): every head
/// dim, seqlens off the tiles, causal, GQA, LSE, both dtypes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_sanitizer_subset() {
    let engine = engine();
    let stages: Vec<u8> = match std::env::var("FA3_SANITIZE_STAGE") {
        Ok(s) => vec![s.parse().expect("FA3_SANITIZE_STAGE: 1..=5")],
        Err(_) => (1..=5).collect(),
    };
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng(17);
    for stage in stages {
        if !fa3_runs_here(&engine, stage) {
            continue;
        }
        for dtype in [DType::F16, DType::BF16] {
            for d in [64usize, 128, 256] {
                let q = randn(&mut rng, dtype, [1, 100, 4, d]);
                let k = randn(&mut rng, dtype, [1, 300, 2, d]);
                let v = randn(&mut rng, dtype, [1, 300, 2, d]);
                let opts = ForwardOptions::default().variant(Variant::Fa3).fa3_stage(stage).causal(true).return_lse(true);
                check(&engine, &stream, [q.view(), k.view(), v.view()], &opts, &format!("fa3 stage {stage} {dtype:?} d{d}"));
            }
        }
    }
}

// ---------------------------------------------------------------- engines' own streams

/// The host output of `o` (f16) checked against the float64 reference of (q, q, q) with `opts`.
fn assert_matches_reference(o: &[f16], q: &Tensor, opts: &ForwardOptions, what: &str) {
    let p = Problem::new(&q.view(), &q.view(), &q.view(), opts).unwrap();
    let reference = attention_f64(&p, &q.view(), &q.view(), &q.view()).unwrap();
    let naive = attention_naive(&p, &q.view(), &q.view(), &q.view(), DType::F16).unwrap();
    let got: Vec<f64> = o.iter().map(|x| x.to_f64()).collect();
    let (err, bound) = (max_abs_diff(&got, &reference.o), 2.0 * max_abs_diff(&naive, &reference.o) + floor_for(DType::F16));
    assert!(err <= bound, "{what}: err {err:.3e} > bound {bound:.3e}");
}

/// A stream of the same device reached through another `Arc<CudaContext>` (as candle holds its
/// own: cudarc hands out a fresh Arc for the primary context on every `CudaContext::new`) is
/// accepted; `Engine::from_context` on it shares the primary device; a raw `CUstream` launch
/// with raw-pointer tensors runs; a tensor bound to another stream is `StreamMismatch`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn foreign_context_and_raw_stream_are_accepted() {
    use cudarc::driver::{CudaContext, DevicePtr};
    let engine = engine();
    let theirs = CudaContext::new(0).unwrap();
    assert!(!Arc::ptr_eq(&theirs, engine.device().context()), "cudarc gives a fresh Arc per CudaContext::new");
    let stream = theirs.new_stream().unwrap();
    let from_ctx = Engine::from_context(theirs.clone()).unwrap();
    assert!(Arc::ptr_eq(from_ctx.device(), engine.device()), "same primary context, same module cache");

    let mut rng = Rng(23);
    let shape = [1, 77, 4, 64];
    let q = randn(&mut rng, DType::F16, shape);
    let flash_attn::Data::F16(host) = q.view().data() else { unreachable!() };
    let n = host.len();
    let dq = stream.clone_htod(host).unwrap();
    let mut d_o = stream.clone_htod(&vec![f16::from_f32(f32::NAN); n]).unwrap();
    let opts = ForwardOptions::default().causal(true).alibi_slopes(vec![0.125f32, 0.25, 0.5, 1.0]);
    for e in [&engine, &from_ctx] {
        let t = DeviceTensor::new(&dq, &stream, shape);
        let mut to = DeviceTensorMut::new(&mut d_o, &stream, shape);
        e.forward(&stream, &t, &t, &t, &mut to, None, &opts).expect("a stream of the same context");
    }
    let o: Vec<f16> = stream.clone_dtoh(&d_o).unwrap();
    stream.synchronize().expect("kernel execution");
    assert_matches_reference(&o, &q, &opts, "foreign Arc stream");

    // Raw addresses and the raw CUstream, as an engine without cudarc has them.
    let d_o2 = stream.clone_htod(&vec![f16::from_f32(f32::NAN); n]).unwrap();
    let (qp, op) = (dq.device_ptr(&stream).0, d_o2.device_ptr(&stream).0);
    // SAFETY: both are live allocations of n f16 in this context, written before on `stream`.
    unsafe {
        let t = DeviceTensor::from_raw(qp, n, DType::F16, shape);
        let mut to = DeviceTensorMut::from_raw(op, n, DType::F16, shape);
        engine.launch_raw(stream.cu_stream(), &t, &t, &t, &mut to, None, &opts).expect("raw stream launch");
    }
    let o2: Vec<f16> = stream.clone_dtoh(&d_o2).unwrap();
    stream.synchronize().expect("kernel execution");
    assert_matches_reference(&o2, &q, &opts, "raw stream");

    // A tensor bound to another stream than the launch's.
    let other = theirs.new_stream().unwrap();
    let t = DeviceTensor::new(&dq, &other, shape);
    let mut d_o3 = stream.alloc_zeros::<f16>(n).unwrap();
    let mut to = DeviceTensorMut::new(&mut d_o3, &stream, shape);
    let e = engine.forward(&stream, &t, &t, &t, &mut to, None, &opts);
    assert!(matches!(&e, Err(Error::StreamMismatch { .. })), "{e:?}");
}

/// A forward launch (with ALiBi: its slopes uploaded before the capture) captured into a CUDA
/// graph and replayed: nothing in the launch synchronizes or uploads, so the capture succeeds,
/// and each replay reads the inputs' current contents. A slope set first seen during a capture
/// is a typed error, not a broken capture.
#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_capture_replays_a_forward_launch() {
    use cudarc::driver::{sys, DevicePtr};
    let engine = engine();
    let ctx = engine.device().context().clone();
    let stream = ctx.new_stream().unwrap();
    let mut rng = Rng(29);
    let shape = [1, 130, 4, 128];
    let (q1, q2) = (randn(&mut rng, DType::F16, shape), randn(&mut rng, DType::F16, shape));
    let host = |t: &Tensor| match t.view().data() {
        flash_attn::Data::F16(h) => h.to_vec(),
        _ => unreachable!(),
    };
    let n = host(&q1).len();
    let mut dq = stream.clone_htod(&host(&q1)).unwrap();
    let mut d_o = stream.clone_htod(&vec![f16::from_f32(f32::NAN); n]).unwrap();
    let opts = ForwardOptions::default().causal(true).alibi_slopes(vec![0.5f32, 0.25, 0.125, 0.0625]);
    engine.prepare_alibi(&stream, &[0.5, 0.25, 0.125, 0.0625]).unwrap();
    let (qp, op) = (dq.device_ptr(&stream).0, d_o.device_ptr(&stream).0);
    stream.synchronize().unwrap();

    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    // SAFETY: live allocations of n f16 in this context; the graph is replayed while they live.
    let launched = unsafe {
        let t = DeviceTensor::from_raw(qp, n, DType::F16, shape);
        let mut to = DeviceTensorMut::from_raw(op, n, DType::F16, shape);
        engine.launch_raw(stream.cu_stream(), &t, &t, &t, &mut to, None, &opts)
    };
    // SAFETY: as above.
    let unseen = unsafe {
        let t = DeviceTensor::from_raw(qp, n, DType::F16, shape);
        let mut to = DeviceTensorMut::from_raw(op, n, DType::F16, shape);
        let other = opts.clone().alibi_slopes(vec![1.0f32; 4]);
        engine.launch_raw(stream.cu_stream(), &t, &t, &t, &mut to, None, &other)
    };
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("one captured launch");
    launched.expect("launch during capture");
    assert!(matches!(&unseen, Err(Error::InvalidOption { option: "alibi_slopes", .. })), "{unseen:?}");

    for (i, q) in [&q1, &q2].into_iter().enumerate() {
        stream.memcpy_htod(&host(q), &mut dq).unwrap();
        stream.memcpy_htod(&vec![f16::from_f32(f32::NAN); n], &mut d_o).unwrap();
        graph.launch().unwrap();
        let o: Vec<f16> = stream.clone_dtoh(&d_o).unwrap();
        stream.synchronize().expect("graph replay");
        assert_matches_reference(&o, q, &opts, &format!("replay {i}"));
    }
}

/// The device-memory tensors can move to another thread (an engine's worker).
#[test]
fn device_tensors_are_send() {
    fn send<T: Send>() {}
    send::<DeviceTensor<'static>>();
    send::<DeviceTensorMut<'static>>();
    send::<DeviceLse<'static>>();
    send::<Engine>();
}

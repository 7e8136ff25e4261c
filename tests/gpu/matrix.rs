//! FA1/FA2 (and Auto) against the reference: random shapes and options, edge shapes, packed
//! strided inputs, the host-memory path, dispatch records and the FA2 layout fallback.

use super::support::*;
use super::support::Rng;
use super::util::*;
use flash_attn::cuda::{DeviceTensor, DeviceTensorMut};
use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff};
use flash_attn::{Backend, DType, Error, ForwardOptions, Mask, Problem, Tensor, TensorView, Variant};
use half::f16;

/// One random case drawn like tests/cpu/forward_props.rs: shapes, GQA ratio, mask, softcap, ALiBi, LSE.
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
    let mut opts = ForwardOptions::default().mask(mask).return_lse(rng.next_u64().is_multiple_of(2));
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
    let mut rng = Rng::new(seed);
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
    let mut rng = Rng::new(7);
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
    let mut rng = Rng::new(11);
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
    let mut rng = Rng::new(3);
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
    let e = engine.dispatch([1, 8, 1, 1024], [1, 8, 1, 1024], DType::BF16, &ForwardOptions::default());
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
    let mut rng = Rng::new(17);
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
    let misaligned_q = |e: &flash_attn::Result<_>| {
        matches!(e, Err(Error::InvalidLayout { operand: flash_attn::Operand::Q, reason }) if reason.contains("aligned"))
    };
    assert!(misaligned_q(&e), "{e:?}");
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
    let mut rng = Rng::new(5);
    let q = randn(&mut rng, DType::BF16, [1, 16, 2, 64]);
    let r = flash_attn::forward(&q, &q, &q, &ForwardOptions::default().backend(Backend::Cuda(0)));
    if flash_attn::cuda::device_count() == 0 {
        assert!(matches!(&r, Err(Error::BackendUnavailable { backend, .. }) if backend == "cuda:0"), "{r:?}");
    } else {
        assert_eq!(r.expect("forward on cuda:0").dispatch.backend, "cuda:0");
    }
}

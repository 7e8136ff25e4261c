//! The GPU backward (`Engine::backward`: FA2's kernels on sm_80+, the FA3-style main kernel on
//! sm_90a) against the float64 reference gradient, with the rule of tests/cpu/backward_props.rs
//! and tests/emulator/backward.rs: per gradient, `max|g − ref| ≤ 2·max|naive − ref| +
//! floor·max(1, max|ref|)`, `ref` = `reference::attention_backward_f64`, `naive` the
//! straightforward backward in the input dtype. The forward the kernels consume (O in the dtype,
//! the f32 LSE) is `reference::attention_f64`'s, so a forward bug cannot hide a backward one.
//! Gradient buffers are NaN-poisoned before each launch (an element no kernel writes fails);
//! the deterministic mode must give bit-identical gradients on a second run.
//!
//! Matrix: family × head dim × mask (none, causal, window) × deterministic, both dtypes, GQA,
//! odd lengths, seqlen_q > seqlen_k (rows that see no key) and key blocks no row sees. A family
//! this GPU cannot run must be refused with a typed error (checked, not skipped).

use super::support::*;
use super::support::Rng;
use super::util::engine;
use cudarc::driver::{CudaStream, DeviceRepr};
use flash_attn::cuda::{BackwardGrads, BackwardInputs, DeviceLseRef, DeviceTensor, DeviceTensorMut, Engine};
use flash_attn::reference::{attention_backward_f64, attention_backward_naive, attention_f64, max_abs_diff, RefGradients};
use flash_attn::{Backend, DType, Element, Error, ForwardOptions, Mask, Problem, Tensor, Variant};
use half::{bf16, f16};
use std::sync::Arc;

/// Gradients one backward launch produced, as f64, with its dispatch.
struct Grads {
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    dispatch: flash_attn::Dispatch,
}

/// One backward through the engine on `stream`, into NaN-poisoned gradient buffers.
fn run_typed<T: Element + DeviceRepr>(
    engine: &Engine,
    stream: &Arc<CudaStream>,
    (q_shape, k_shape): ([usize; 4], [usize; 4]),
    [q, k, v, o, d_o]: [&[T]; 5],
    lse: &[f32],
    opts: &ForwardOptions,
) -> flash_attn::Result<Grads> {
    let up = |x: &[T]| stream.clone_htod(x).unwrap();
    let (dq_in, dk_in, dv_in, do_in, ddo_in) = (up(q), up(k), up(v), up(o), up(d_o));
    let d_lse = stream.clone_htod(lse).unwrap();
    let nan = |n: usize| stream.clone_htod(&vec![T::from_f32(f32::NAN); n]).unwrap();
    let (nq, nk) = (q_shape.iter().product::<usize>(), k_shape.iter().product::<usize>());
    let (mut gq, mut gk, mut gv) = (nan(nq), nan(nk), nan(nk));
    let dispatch = {
        let t = |d, s| DeviceTensor::new(d, stream, s);
        let (tq, tk, tv, to, tdo) = (t(&dq_in, q_shape), t(&dk_in, k_shape), t(&dv_in, k_shape), t(&do_in, q_shape), t(&ddo_in, q_shape));
        let tl = DeviceLseRef::new(&d_lse, stream);
        let x = BackwardInputs { q: &tq, k: &tk, v: &tv, o: &to, d_o: &tdo, lse: &tl };
        let mut oq = DeviceTensorMut::new(&mut gq, stream, q_shape);
        let mut ok = DeviceTensorMut::new(&mut gk, stream, k_shape);
        let mut ov = DeviceTensorMut::new(&mut gv, stream, k_shape);
        engine.backward(stream, x, BackwardGrads { dq: &mut oq, dk: &mut ok, dv: &mut ov, d_sinks: None }, opts)?
    };
    let down = |d: &cudarc::driver::CudaSlice<T>| -> Vec<f64> {
        stream.clone_dtoh(d).unwrap().iter().map(|x: &T| x.to_f32() as f64).collect()
    };
    let (dq, dk, dv) = (down(&gq), down(&gk), down(&gv));
    stream.synchronize().expect("kernel execution");
    Ok(Grads { dq, dk, dv, dispatch })
}

/// The host tensors of a case: q, k, v, d_o drawn N(0, 1), o and the LSE from the float64 forward.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    d_o: Tensor,
    lse: Vec<f32>,
}

fn inputs(rng: &mut Rng, dtype: DType, q_shape: [usize; 4], k_shape: [usize; 4], opts: &ForwardOptions) -> (Problem, Inputs) {
    let (q, k, v, d_o) = (randn(rng, dtype, q_shape), randn(rng, dtype, k_shape), randn(rng, dtype, k_shape), randn(rng, dtype, q_shape));
    let p = Problem::new(&q.view(), &k.view(), &v.view(), opts).unwrap();
    let fwd = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
    let o: Vec<f32> = fwd.o.iter().map(|&x| x as f32).collect();
    let o = Tensor::from_f32(&o, dtype, q_shape).unwrap();
    let lse = fwd.lse.iter().map(|&x| x as f32).collect();
    (p, Inputs { q, k, v, o, d_o, lse })
}

fn run(engine: &Engine, stream: &Arc<CudaStream>, x: &Inputs, opts: &ForwardOptions) -> flash_attn::Result<Grads> {
    let shapes = (x.q.shape(), x.k.shape());
    let views = [x.q.view(), x.k.view(), x.v.view(), x.o.view(), x.d_o.view()];
    macro_rules! typed {
        ($variant:ident, $t:ty) => {{
            let s: Vec<&[$t]> = views
                .iter()
                .map(|t| match t.data() {
                    flash_attn::Data::$variant(s) => s,
                    _ => unreachable!("one dtype per case"),
                })
                .collect();
            run_typed::<$t>(engine, stream, shapes, [s[0], s[1], s[2], s[3], s[4]], &x.lse, opts)
        }};
    }
    match x.q.dtype() {
        DType::F16 => typed!(F16, f16),
        DType::BF16 => typed!(BF16, bf16),
        _ => unreachable!("GPU tests use f16/bf16"),
    }
}

/// The float64 reference gradient of a case and the naive one in its dtype (the bound's base).
struct Expected {
    reference: RefGradients,
    naive: RefGradients,
}

fn expected(p: &Problem, x: &Inputs) -> Expected {
    let (q, k, v, d_o) = (x.q.view(), x.k.view(), x.v.view(), x.d_o.view());
    Expected {
        reference: attention_backward_f64(p, &q, &k, &v, &d_o).unwrap(),
        naive: attention_backward_naive(p, &q, &k, &v, &d_o, p.dtype).unwrap(),
    }
}

/// Checks `g` against the float64 reference with FlashAttention's rule; returns the worst
/// err / bound over dq, dk, dv.
fn check_grads(dtype: DType, want: &Expected, g: &Grads, what: &str) -> f64 {
    let (r, n) = (&want.reference, &want.naive);
    let mut worst = 0.0f64;
    for (name, got, r, n) in [("dq", &g.dq, &r.dq, &n.dq), ("dk", &g.dk, &r.dk, &n.dk), ("dv", &g.dv, &r.dv, &n.dv)] {
        assert!(got.iter().all(|x| x.is_finite()), "{what}: {name} has NaN/inf (an element no kernel wrote?)");
        let err = max_abs_diff(got, r);
        let scale = r.iter().fold(1.0f64, |m, x| m.max(x.abs()));
        let bound = 2.0 * max_abs_diff(n, r) + floor_for(dtype) * scale;
        assert!(err <= bound, "{what}: max|{name} - ref| {err:.3e} > bound {bound:.3e} ({})", g.dispatch.reason);
        worst = worst.max(err / bound);
    }
    worst
}

/// Whether this GPU runs the family's backward; elsewhere its refusal is checked.
fn runs_here(engine: &Engine, variant: Variant) -> bool {
    let cc = engine.device().compute_capability();
    let runs = match variant {
        Variant::Fa3 => cc == (9, 0),
        _ => cc.0 >= 8,
    };
    let d = engine.backward_dispatch([1, 64, 2, 64], [1, 64, 2, 64], DType::BF16, &ForwardOptions::default().variant(variant));
    if runs {
        let d = d.unwrap_or_else(|e| panic!("{variant:?} backward on sm_{}{}: {e}", cc.0, cc.1));
        assert_eq!(d.kernel, if variant == Variant::Fa3 { "fa3_bwd" } else { "fa2_bwd" }, "{}", d.reason);
    } else {
        assert!(matches!(d, Err(Error::VariantUnavailable { .. })), "{variant:?} on sm_{}{}: {d:?}", cc.0, cc.1);
    }
    runs
}

/// The matrix of one family: its head dims × (none, causal, window) masks × deterministic or
/// not, both dtypes, over shapes with GQA, odd lengths, sq > sk and keys no row sees. Every mask
/// runs on the first two shapes, one mask on each other shape; head dims other than 64 and 128
/// take the last two shapes only (the matrix stays within a short GPU window).
fn matrix(variant: Variant, dims: &[usize]) {
    let engine = engine();
    if !runs_here(&engine, variant) {
        return;
    }
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(if variant == Variant::Fa3 { 0xb0d3 } else { 0xb0d2 });
    // (batch, sq, sk, hq, hkv)
    let shapes = [(1, 128, 128, 2, 2), (2, 100, 300, 4, 2), (1, 300, 100, 3, 1), (1, 10, 260, 2, 2)];
    let masks = [Mask::None, Mask::Causal, Mask::window(40, 7)];
    let mut worst = 0.0f64;
    let mut cases = 0;
    for dtype in [DType::BF16, DType::F16] {
        for &d in dims {
            for (si, &(b, sq, sk, hq, hkv)) in shapes.iter().enumerate() {
                if si < 2 && d != 64 && d != 128 {
                    continue;
                }
                for (mi, &mask) in masks.iter().enumerate() {
                    if si >= 2 && mi != si % masks.len() {
                        continue;
                    }
                    let base = ForwardOptions::default().mask(mask).variant(variant);
                    let (p, x) = inputs(&mut rng, dtype, [b, sq, hq, d], [b, sk, hkv, d], &base);
                    let want = expected(&p, &x);
                    for deterministic in [false, true] {
                        let opts = base.clone().deterministic(deterministic);
                        let what = format!("{variant:?} {dtype:?} d{d} b{b} sq{sq} sk{sk} hq{hq} hkv{hkv} {mask:?} deterministic {deterministic}");
                        let g = run(&engine, &stream, &x, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
                        let dq_mode = if deterministic { "dq deterministic" } else { "f32 atomics" };
                        assert!(g.dispatch.reason.contains(dq_mode), "{what}: {}", g.dispatch.reason);
                        worst = worst.max(check_grads(dtype, &want, &g, &what));
                        if deterministic {
                            let again = run(&engine, &stream, &x, &opts).unwrap();
                            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            let same = bits(&g.dq) == bits(&again.dq) && bits(&g.dk) == bits(&again.dk) && bits(&g.dv) == bits(&again.dv);
                            assert!(same, "{what}: not bit-identical run to run");
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    println!("{variant:?} backward: {cases} cases passed; worst err/bound {worst:.3}");
}

#[test]
#[ignore = "needs a CUDA GPU (sm_80 or newer)"]
fn fa2_backward_matrix() {
    matrix(Variant::Fa2, &[32, 64, 96, 128, 192, 256]);
}

#[test]
#[ignore = "needs a CUDA GPU (an sm_90 one to run; elsewhere the refusal is checked)"]
fn fa3_backward_matrix() {
    matrix(Variant::Fa3, &[64, 128]);
}

/// FA2's options the FA3-style kernel lacks: softcap and ALiBi run on FA2 and are refused (typed)
/// by FA3; `Variant::Auto` and FA1/FA4 are refused on the engine; the host API
/// (`flash_attn::backward` with `Backend::Cuda(0)`) gives the engine's gradients bit for bit in
/// the deterministic mode, and `Variant::Auto` there is refused too.
#[test]
#[ignore = "needs a CUDA GPU (sm_80 or newer)"]
fn backward_options_refusals_and_host_path() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(0xb0a1);
    let shape = ([1, 97, 2, 64], [1, 130, 2, 64]);
    let opts = ForwardOptions::default().mask(Mask::window(20, 5)).softcap(5.0).alibi_slopes(vec![0.25f32, 0.5]);
    let fa2 = opts.clone().variant(Variant::Fa2);
    let (p, x) = inputs(&mut rng, DType::BF16, shape.0, shape.1, &fa2);
    let g = run(&engine, &stream, &x, &fa2).unwrap();
    check_grads(DType::BF16, &expected(&p, &x), &g, "fa2 softcap + ALiBi + window");
    for fa3 in [ForwardOptions::default().softcap(5.0), ForwardOptions::default().alibi_slopes(vec![0.25f32, 0.5])] {
        let e = engine.backward_dispatch(shape.0, shape.1, DType::BF16, &fa3.variant(Variant::Fa3));
        assert!(matches!(e, Err(Error::VariantUnavailable { variant: Variant::Fa3, .. })), "{e:?}");
    }
    for v in [Variant::Auto, Variant::Fa1, Variant::Fa4] {
        let e = engine.backward_dispatch(shape.0, shape.1, DType::BF16, &ForwardOptions::default().variant(v));
        assert!(matches!(e, Err(Error::VariantUnavailable { .. })), "{v:?}: {e:?}");
    }
    let opts = ForwardOptions::default().causal(true).variant(Variant::Fa2).deterministic(true);
    let (_, x) = inputs(&mut rng, DType::F16, shape.0, shape.1, &opts);
    let dev = run(&engine, &stream, &x, &opts).unwrap();
    let host = flash_attn::backward(&x.q, &x.k, &x.v, &x.o, &x.d_o, &x.lse, &opts.clone().backend(Backend::Cuda(0))).unwrap();
    let f64s = |t: &Tensor| t.to_f32_vec().iter().map(|&x| x as f64).collect::<Vec<_>>();
    assert!(f64s(&host.dq) == dev.dq && f64s(&host.dk) == dev.dk && f64s(&host.dv) == dev.dv, "host path differs from the engine's");
    assert_eq!(host.dispatch.kernel, "fa2_bwd");
    let auto = ForwardOptions::default().causal(true).backend(Backend::Cuda(0));
    let e = flash_attn::backward(&x.q, &x.k, &x.v, &x.o, &x.d_o, &x.lse, &auto);
    assert!(matches!(e, Err(Error::VariantUnavailable { variant: Variant::Auto, .. })), "{:?}", e.map(|g| g.dispatch));
}

/// Attention sinks in the GPU backward, through the host path (`flash_attn::backward` with
/// `Backend::Cuda(0)`): dq, dk, dv (the LSE includes the sink) and `Gradients::d_sinks` (one more
/// launch, a fixed-order sum) against the float64 reference with the rule above, on FA2 and, on
/// sm_90, the FA3-style kernel; the sinks of tests/emulator/backward.rs (near the scores, none,
/// far above, below), causal with rows that see no key, both dq modes (bit-identical d_sinks).
#[test]
#[ignore = "needs a CUDA GPU (sm_80 or newer)"]
fn backward_with_sinks() {
    let engine = engine();
    let mut rng = Rng::new(0xb051);
    let sinks = vec![0.7f32, f32::NEG_INFINITY, 100.0, -2.0];
    for variant in [Variant::Fa2, Variant::Fa3] {
        if !runs_here(&engine, variant) {
            continue;
        }
        for (dtype, mask, (q_shape, k_shape)) in [
            (DType::BF16, Mask::Causal, ([1, 130, 4, 64], [1, 63, 2, 64])),
            (DType::F16, Mask::None, ([2, 100, 4, 128], [2, 300, 1, 128])),
        ] {
            let base = ForwardOptions::default().mask(mask).sinks(sinks.clone()).variant(variant).backend(Backend::Cuda(0));
            let (p, x) = inputs(&mut rng, dtype, q_shape, k_shape, &base);
            let want = expected(&p, &x);
            let mut first: Option<Vec<f32>> = None;
            for deterministic in [false, true] {
                let opts = base.clone().deterministic(deterministic);
                let what = format!("{variant:?} {dtype:?} {mask:?} q{q_shape:?} k{k_shape:?} sinks deterministic {deterministic}");
                let g = flash_attn::backward(&x.q, &x.k, &x.v, &x.o, &x.d_o, &x.lse, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
                let f64s = |t: &Tensor| t.to_f32_vec().iter().map(|&x| x as f64).collect::<Vec<_>>();
                let grads = Grads { dq: f64s(&g.dq), dk: f64s(&g.dk), dv: f64s(&g.dv), dispatch: g.dispatch.clone() };
                check_grads(dtype, &want, &grads, &what);
                let got = g.d_sinks.clone().unwrap_or_else(|| panic!("{what}: no d_sinks"));
                let (r, n) = (want.reference.d_sinks.as_ref().unwrap(), want.naive.d_sinks.as_ref().unwrap());
                let got64: Vec<f64> = got.iter().map(|&x| x as f64).collect();
                let err = max_abs_diff(&got64, r);
                let bound = 2.0 * max_abs_diff(n, r) + floor_for(dtype) * r.iter().fold(1.0f64, |m, x| m.max(x.abs()));
                assert!(err <= bound, "{what}: max |d_sinks - ref| {err:.3e} > bound {bound:.3e} (got {got:?}, ref {r:?})");
                assert_eq!(got[1], 0.0, "{what}: a head without a sink has d_sink 0");
                match &first {
                    None => first = Some(got),
                    Some(f) => assert!(f.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: d_sinks differ between the dq modes"),
                }
            }
        }
    }
}

//! Engines' own streams and contexts: foreign `Arc<CudaContext>`s, raw streams, graph capture.

use super::support::*;
use super::support::Rng;
use super::util::*;
use flash_attn::cuda::{DeviceLse, DeviceTensor, DeviceTensorMut, Engine};
use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff};
use flash_attn::{DType, Error, ForwardOptions, Problem, Tensor};
use half::f16;
use std::sync::Arc;

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

    let mut rng = Rng::new(23);
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
    let mut rng = Rng::new(29);
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

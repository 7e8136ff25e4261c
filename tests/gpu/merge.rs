//! The device `merge_states` (`Engine::merge_states`, `merge_states_n`: the combine kernel,
//! cuda/combine.cu) against the host `serving::merge_states_n`, and sharded attention merged on
//! the device against the one-shot forward. Compile-checked only: no GPU has run these (the
//! kernel itself ran in the emulator, tests/emulator/combine.rs).

use super::support::Rng;
use super::support::*;
use super::util::*;
use cudarc::driver::{CudaStream, DeviceRepr};
use flash_attn::cuda::{DeviceLse, DeviceLseRef, DeviceTensor, DeviceTensorMut, Engine};
use flash_attn::serving::merge_states_n;
use flash_attn::{DType, Element, Error, ForwardOptions, Mask, Tensor, TensorView};
use half::{bf16, f16};
use std::sync::Arc;

/// Merges `states` (o values in T, LSEs) on the device; returns (o as f32, lse).
fn device_merge<T: Element + DeviceRepr>(
    engine: &Engine,
    stream: &Arc<CudaStream>,
    shape: [usize; 4],
    states: &[(Vec<T>, Vec<f32>)],
) -> Result<(Vec<f32>, Vec<f32>), Error> {
    let up_o: Vec<_> = states.iter().map(|(o, _)| stream.clone_htod(o).unwrap()).collect();
    let up_l: Vec<_> = states.iter().map(|(_, l)| stream.clone_htod(l).unwrap()).collect();
    let n: usize = shape.iter().product();
    let rows = n / shape[3];
    let mut d_o = stream.clone_htod(&vec![T::from_f32(f32::NAN); n]).unwrap();
    let mut d_l = stream.clone_htod(&vec![f32::NAN; rows]).unwrap();
    {
        let ts: Vec<DeviceTensor> = up_o.iter().map(|o| DeviceTensor::new(o, stream, shape)).collect();
        let ls: Vec<DeviceLseRef> = up_l.iter().map(|l| DeviceLseRef::new(l, stream)).collect();
        let list: Vec<(&DeviceTensor, &DeviceLseRef)> = ts.iter().zip(&ls).collect();
        let mut to = DeviceTensorMut::new(&mut d_o, stream, shape);
        let mut tl = DeviceLse::new(&mut d_l, stream);
        engine.merge_states_n(stream, &list, &mut to, Some(&mut tl))?;
    }
    let o: Vec<T> = stream.clone_dtoh(&d_o).unwrap();
    let l: Vec<f32> = stream.clone_dtoh(&d_l).unwrap();
    stream.synchronize().expect("kernel execution");
    Ok((o.iter().map(|x| x.to_f32()).collect(), l))
}

/// Random states (some rows with LSE −inf in some or all states, NaN o behind them) merged on
/// the device and on the host: within the f32 bound of docs/serving.md, special rows exact.
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_merge_states_matches_the_host() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(41);
    for (n, shape) in
        [(1, [2, 3, 4, 64]), (2, [1, 17, 8, 128]), (3, [3, 1, 8, 256]), (8, [1, 5, 2, 40]), (64, [1, 2, 2, 96])]
    {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let [b, s, h, d] = shape;
            let rows = b * s * h;
            let mut states: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
            for _ in 0..n {
                let mut o: Vec<f32> = (0..rows * d).map(|_| dtype.round(rng.normal() as f32)).collect();
                let mut l: Vec<f32> = (0..rows).map(|_| 3.0 * rng.normal() as f32).collect();
                for (r, lr) in l.iter_mut().enumerate() {
                    // Row r % 5 == 0: every state empty; r % 5 == 1: this state empty half the time.
                    if r % 5 == 0 || (r % 5 == 1 && rng.uniform() < 0.5) {
                        // o is [b, s, h, d], l is [b, h, s]: row r of l is (bi, hi, si).
                        let (bi, hi, si) = (r / (h * s), (r / s) % h, r % s);
                        *lr = f32::NEG_INFINITY;
                        let at = ((bi * s + si) * h + hi) * d;
                        o[at..at + d].iter_mut().for_each(|x| *x = f32::NAN);
                    }
                }
                states.push((o, l));
            }
            let host_views: Vec<Tensor> =
                states.iter().map(|(o, _)| Tensor::from_f32(o, dtype, shape).unwrap()).collect();
            let list: Vec<(TensorView, &[f32])> =
                host_views.iter().zip(&states).map(|(t, (_, l))| (t.view(), l.as_slice())).collect();
            let want = merge_states_n(&list).unwrap();
            let got = match dtype {
                DType::F32 => device_merge::<f32>(&engine, &stream, shape, &states),
                DType::F16 => device_merge::<f16>(
                    &engine,
                    &stream,
                    shape,
                    &states
                        .iter()
                        .map(|(o, l)| (o.iter().map(|x| f16::from_f32(*x)).collect(), l.clone()))
                        .collect::<Vec<_>>(),
                ),
                DType::BF16 => device_merge::<bf16>(
                    &engine,
                    &stream,
                    shape,
                    &states
                        .iter()
                        .map(|(o, l)| (o.iter().map(|x| bf16::from_f32(*x)).collect(), l.clone()))
                        .collect::<Vec<_>>(),
                ),
                other => panic!("no combine dtype {other:?}"),
            }
            .unwrap();
            let want_o = want.o.to_f32_vec();
            let tol_o = (2 * n + 10) as f64 * 2f64.powi(-24) * 5.0 + floor_for(dtype) * 0.1;
            for (i, (g, w)) in got.0.iter().zip(&want_o).enumerate() {
                let ok = if w.is_nan() {
                    g.is_nan()
                } else {
                    ((g - w) as f64).abs() <= tol_o + (w.abs() as f64) * 2f64.powi(-7)
                };
                assert!(ok, "n {n} {dtype:?} {shape:?}: o[{i}] = {g}, host {w}");
            }
            for (i, (g, w)) in got.1.iter().zip(&want.lse).enumerate() {
                let ok = if w.is_infinite() {
                    g == w
                } else {
                    ((g - w) as f64).abs() <= (n + 28) as f64 * 2f64.powi(-24) + 2f64.powi(-23) * w.abs() as f64
                };
                assert!(ok, "n {n} {dtype:?} {shape:?}: lse[{i}] = {g}, host {w}");
            }
        }
    }
}

/// The device form refuses what the host form refuses, with the same errors.
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_merge_states_errors_match_the_host() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let shape = [1, 4, 2, 8];
    let a = stream.clone_htod(&vec![1.0f32; 64]).unwrap();
    let short = stream.clone_htod(&vec![1.0f32; 32]).unwrap();
    let half_o = stream.clone_htod(&vec![f16::ONE; 64]).unwrap();
    let l = stream.clone_htod(&vec![0.0f32; 8]).unwrap();
    let l_short = stream.clone_htod(&vec![0.0f32; 7]).unwrap();
    let mut out = stream.clone_htod(&vec![0.0f32; 64]).unwrap();
    let ta = DeviceTensor::new(&a, &stream, shape);
    let th = DeviceTensor::new(&half_o, &stream, shape);
    let tb = DeviceTensor::new(&a, &stream, [1, 4, 2, 8]);
    let t_other = DeviceTensor::new(&short, &stream, [1, 2, 2, 8]);
    let (la, ls) = (DeviceLseRef::new(&l, &stream), DeviceLseRef::new(&l_short, &stream));
    let mut to = DeviceTensorMut::new(&mut out, &stream, shape);
    let e = engine.merge_states_n(&stream, &[], &mut to, None).unwrap_err();
    assert!(matches!(e, Error::InvalidOption { option: "merge_states_n states", .. }), "{e}");
    let e = engine.merge_states(&stream, &ta, &la, &t_other, &la, &mut to, None).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { ref what, .. } if what == "o of state 1"), "{e}");
    let e = engine.merge_states(&stream, &ta, &la, &th, &la, &mut to, None).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let e = engine.merge_states(&stream, &ta, &la, &tb, &ls, &mut to, None).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { ref what, .. } if what == "lse of state 1"), "{e}");
    let many: Vec<(&DeviceTensor, &DeviceLseRef)> = (0..65).map(|_| (&ta, &la)).collect();
    let e = engine.merge_states_n(&stream, &many, &mut to, None).unwrap_err();
    assert!(matches!(e, Error::InvalidOption { .. }), "{e}");
}

/// One sequence's keys in two unequal shards: forward with LSE on each (the causal mask shifted
/// as in examples/sharded_attention.rs), merged on the device, equals the one-shot forward.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sharded_forward_merged_on_the_device_matches_one_shot() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(43);
    let (sq, sk, h, d, cut) = (64, 1000, 4, 128, 389);
    let q = randn(&mut rng, DType::BF16, [1, sq, h, d]);
    let k = randn(&mut rng, DType::BF16, [1, sk, h, d]);
    let v = randn(&mut rng, DType::BF16, [1, sk, h, d]);
    let host = |t: &Tensor| -> Vec<bf16> {
        let flash_attn::Data::BF16(x) = t.view().data() else { unreachable!() };
        x.to_vec()
    };
    let (qh, kh, vh) = (host(&q), host(&k), host(&v));
    let dq = stream.clone_htod(&qh).unwrap();
    let (dk, dv) = (stream.clone_htod(&kh).unwrap(), stream.clone_htod(&vh).unwrap());
    let row = h * d;
    let mut outs = Vec::new();
    for (s0, s1) in [(0, cut), (cut, sk)] {
        let mut o = stream.clone_htod(&vec![bf16::ZERO; sq * row]).unwrap();
        let mut l = stream.clone_htod(&vec![0.0f32; h * sq]).unwrap();
        let opts = ForwardOptions::default().mask(Mask::window(-1, (sk - s1) as i64)).return_lse(true);
        {
            let kv = [1, s1 - s0, h, d];
            let (ks, vs) = (dk.slice(s0 * row..s1 * row), dv.slice(s0 * row..s1 * row));
            let tq = DeviceTensor::new(&dq, &stream, [1, sq, h, d]);
            let (tk, tv) = (DeviceTensor::new(&ks, &stream, kv), DeviceTensor::new(&vs, &stream, kv));
            let mut to = DeviceTensorMut::new(&mut o, &stream, [1, sq, h, d]);
            let mut tl = DeviceLse::new(&mut l, &stream);
            engine.forward(&stream, &tq, &tk, &tv, &mut to, Some(&mut tl), &opts).unwrap();
        }
        outs.push((o, l));
    }
    let mut merged = stream.clone_htod(&vec![bf16::ZERO; sq * row]).unwrap();
    {
        let ts: Vec<DeviceTensor> = outs.iter().map(|(o, _)| DeviceTensor::new(o, &stream, [1, sq, h, d])).collect();
        let ls: Vec<DeviceLseRef> = outs.iter().map(|(_, l)| DeviceLseRef::new(l, &stream)).collect();
        let mut to = DeviceTensorMut::new(&mut merged, &stream, [1, sq, h, d]);
        engine.merge_states(&stream, &ts[0], &ls[0], &ts[1], &ls[1], &mut to, None).unwrap();
    }
    let got: Vec<bf16> = stream.clone_dtoh(&merged).unwrap();
    stream.synchronize().expect("kernel execution");
    let opts = ForwardOptions::default().causal(true);
    let (_, c) = check_forward(&q, &k, &v, &opts);
    let p = flash_attn::Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
    let r = flash_attn::reference::attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
    let ours: Vec<f64> = got.iter().map(|x| x.to_f64()).collect();
    let err = flash_attn::reference::max_abs_diff(&ours, &r.o);
    // Two bf16 roundings (each shard's output, then the merge) instead of one.
    assert!(err <= 2.0 * c.bound, "sharded + device merge: err {err:.3e} > {:.3e}", 2.0 * c.bound);
}

/// Split-KV decode on the GPU (`Engine::launch_serving_raw` through `Backend::Cuda`: the
/// splits' partial states in scratch, merged by the combine kernel) against the CPU backend's
/// result of the same call, for 1 (forced), 2, 5 and the heuristic's split counts, paged (page
/// 16) and dense caches. Compile-checked only.
#[test]
#[ignore = "needs a CUDA GPU"]
fn split_kv_decode_through_the_combine_matches_the_cpu() {
    use flash_attn::serving::{forward_kvcache, BlockTable, KvCache};
    use flash_attn::Backend;
    let mut rng = Rng::new(47);
    let (hq, hkv, d, page) = (8, 2, 128, 16);
    let lens = [3000usize, 1, 0, 700];
    let max_blocks = 3000usize.div_ceil(page);
    let num_blocks = lens.iter().map(|l| l.div_ceil(page)).sum::<usize>();
    let mut table = vec![-1i32; lens.len() * max_blocks];
    let mut next = 0;
    for (b, &l) in lens.iter().enumerate() {
        for p in 0..l.div_ceil(page) {
            // Blocks handed out in reverse order: a non-trivial table.
            table[b * max_blocks + p] = (num_blocks - 1 - next) as i32;
            next += 1;
        }
    }
    let shape = [num_blocks, page, hkv, d];
    let n = shape.iter().product::<usize>();
    let kc = Tensor::from_f32(&(0..n).map(|_| rng.normal() as f32).collect::<Vec<_>>(), DType::BF16, shape).unwrap();
    let vc = Tensor::from_f32(&(0..n).map(|_| rng.normal() as f32).collect::<Vec<_>>(), DType::BF16, shape).unwrap();
    let seqlens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let cache = KvCache::paged(kc.view(), vc.view(), &seqlens, BlockTable { ids: &table, max_blocks_per_seq: max_blocks });
    let q = randn(&mut rng, DType::BF16, [lens.len(), 1, hq, d]);
    let base = ForwardOptions::default().mask(Mask::Causal).return_lse(true);
    let cpu = forward_kvcache(&q, &cache, &base.clone().backend(Backend::Cpu)).unwrap();
    let (cpu_o, cpu_lse) = (cpu.o.to_f32_vec(), cpu.lse.unwrap());
    for splits in [Some(1), Some(2), Some(5), None] {
        let mut opts = base.clone().backend(Backend::Cuda(0));
        if let Some(s) = splits {
            opts = opts.num_splits(s);
        }
        let out = forward_kvcache(&q, &cache, &opts).unwrap();
        assert!(out.dispatch.backend.starts_with("cuda"), "{:?}", out.dispatch);
        let o = out.o.to_f32_vec();
        let err = o.iter().zip(&cpu_o).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
        // Both round once to bf16 from f32 work: two bf16 ulps at |o| <= 4.
        assert!(err <= 2.0 * floor_for(DType::BF16), "splits {splits:?}: max |gpu - cpu| {err:.3e} ({})", out.dispatch.reason);
        for (g, c) in out.lse.unwrap().iter().zip(&cpu_lse) {
            assert!(if c.is_infinite() { g == c } else { (g - c).abs() <= 2e-3 }, "splits {splits:?}: lse {g} vs cpu {c}");
        }
    }
}

//! The Hopper FP8 forward (table rows fa3fp8s3..fa3fp8s5: the pre-pass, then the FP8 consumer of
//! stage 3, 4 or 5; `Variant::Fa3` alone takes stage 5) through `Engine` and `flash_attn::forward`, against the CPU FP8 path (`Precision::Fp8` on
//! `Backend::Cpu`) and float64, with the acceptance of the emulator test
//! (tests/emulator/fp8.rs, `fp8_consumer_matches_cpu_fp8_path`): the kernel tiles keys by 128 (64
//! at head_dim 256) and the CPU path by 64, so P · 2^8 rounds against other running maxima; both must be equally far
//! from float64 (within 15%), max|kernel − CPU| <= 0.1, LSE within 1e-4.
//! Compile-checked only: it has not run on a GPU (docs/fp8.md).

use super::support::*;
use super::util::*;
use flash_attn::reference::{attention_f64, rmse};
use flash_attn::{forward, Backend, DType, Error, ForwardOptions, Fp8Scaling, Precision, Problem, Variant};

fn fp8(scaling: Fp8Scaling, hadamard: Option<u64>, causal: bool) -> ForwardOptions {
    ForwardOptions::default()
        .precision(Precision::Fp8 { scaling, hadamard })
        .causal(causal)
        .return_lse(true)
        .variant(Variant::Fa3)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_forward_matches_cpu_fp8_path() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(0xF8);
    let block = |rows| Fp8Scaling::PerBlock { rows };
    let cases = [
        (DType::BF16, [2, 130, 4, 128], [2, 257, 2, 128], block(64), Some(0x5EED), false),
        (DType::F16, [1, 200, 2, 128], [1, 300, 2, 128], block(64), Some(7), true),
        (DType::BF16, [1, 190, 2, 128], [1, 70, 1, 128], block(128), Some(1), true),
        (DType::F16, [1, 65, 2, 128], [1, 129, 2, 128], Fp8Scaling::PerTensor, None, false),
        (DType::BF16, [2, 1000, 8, 128], [2, 1000, 8, 128], block(128), Some(3), false),
        // Head dims 64 (SW64 Q/K tiles) and 256 (64-key tiles, SW64 Vᵀ).
        (DType::BF16, [2, 130, 4, 64], [2, 257, 2, 64], block(64), Some(0x5EED), false),
        (DType::F16, [1, 200, 2, 64], [1, 300, 2, 64], block(64), Some(7), true),
        (DType::BF16, [2, 130, 4, 256], [2, 257, 2, 256], block(64), Some(0x5EED), false),
        (DType::F16, [1, 190, 2, 256], [1, 70, 1, 256], block(128), Some(1), true),
    ];
    for ((dtype, qs, ks, scaling, hadamard, causal), stage) in
        cases.into_iter().flat_map(|c| [(c, None), (c, Some(3)), (c, Some(4))])
    {
        let what = format!("{dtype:?} q{qs:?} k{ks:?} {scaling:?} hadamard {hadamard:?} causal {causal} stage {stage:?}");
        let (q, k, v) = (randn(&mut rng, dtype, qs), randn(&mut rng, dtype, ks), randn(&mut rng, dtype, ks));
        let opts = match stage {
            Some(s) => fp8(scaling, hadamard, causal).fa3_stage(s),
            None => fp8(scaling, hadamard, causal),
        };
        if engine.device().sm() != 90 {
            // Not Hopper: the FP8 kernels are sm_90a only; a typed refusal, never a fallback.
            let e = engine.dispatch(qs, ks, dtype, &opts).unwrap_err();
            assert!(matches!(e, Error::VariantUnavailable { variant: Variant::Fa3, .. }), "{what}: {e:?}");
            continue;
        }
        let got = run_views(&engine, &stream, [q.view(), k.view(), v.view()], &opts).unwrap();
        let want = format!("fa3fp8s{}_fwd_hd{}_", stage.unwrap_or(5), qs[3]);
        assert!(got.kernel.starts_with(&want), "{what}: {}", got.kernel);
        // The CPU runs no kernel family: Variant::Auto there.
        let cpu_opts = fp8(scaling, hadamard, causal).variant(Variant::Auto).backend(Backend::Cpu);
        let cpu = forward(&q, &k, &v, &cpu_opts).unwrap();
        let cpu_o: Vec<f64> = cpu.o.to_f32_vec().iter().map(|&x| x as f64).collect();
        let p = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default().causal(causal)).unwrap();
        let exact = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap().o;
        assert!(got.o.iter().all(|x| x.is_finite()), "{what}: non-finite output (unwritten elements are NaN)");
        let max_o = got.o.iter().zip(&cpu_o).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let (e_gpu, e_cpu) = (rmse(&got.o, &exact), rmse(&cpu_o, &exact));
        let lse_gpu = got.lse.as_ref().unwrap();
        let lse_cpu = cpu.lse.as_ref().unwrap();
        let lse_ok =
            lse_gpu.iter().zip(lse_cpu).all(|(a, &b)| (a.is_infinite() && *a == b as f64) || (a - b as f64).abs() <= 1e-4);
        println!("{what}: max|GPU - CPU FP8| {max_o:.2e}; RMSE vs float64: GPU {e_gpu:.3e}, CPU FP8 {e_cpu:.3e}");
        assert!(max_o <= 0.1 && (e_gpu / e_cpu - 1.0).abs() <= 0.15 && lse_ok, "{what}");
        // The host path runs the same kernel: the same numbers.
        let host = forward(&q, &k, &v, &opts.clone().backend(Backend::Cuda(0))).unwrap();
        assert_eq!(host.dispatch.kernel, got.kernel, "{what}");
        let host_o: Vec<f64> = host.o.to_f32_vec().iter().map(|&x| x as f64).collect();
        assert_eq!(host_o, got.o, "{what}: flash_attn::forward and Engine differ");
    }
}

/// What the FP8 kernels do not run is a typed refusal on the GPU too (the CPU tests check the
/// same rules on a faked sm_90 device: src/cuda/select/tests.rs).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_refusals_are_typed() {
    let engine = engine();
    let block = Fp8Scaling::PerBlock { rows: 64 };
    for (d, opts) in [
        (96, fp8(block, None, false)),
        (128, fp8(Fp8Scaling::PerBlock { rows: 32 }, Some(1), false)),
        (128, fp8(block, Some(1), false).alibi_slopes(vec![0.5; 4])),
    ] {
        let e = engine.dispatch([1, 64, 4, d], [1, 64, 4, d], DType::BF16, &opts).unwrap_err();
        assert!(matches!(e, Error::VariantUnavailable { variant: Variant::Fa3, .. }), "hd{d} {opts:?}: {e:?}");
    }
    // Auto leaves the FP8 row alone until it is verified on a GPU: no GPU kernel for FP8.
    let auto = fp8(block, Some(1), false).variant(Variant::Auto);
    assert!(engine.dispatch([1, 64, 4, 128], [1, 64, 4, 128], DType::BF16, &auto).is_err());
}

/// FA3's FP8 input for engines that quantise themselves (`Engine::launch_fp8_codes_raw`): codes
/// and per-(batch, head) descales from the CPU quantiser (the pre-pass's oracle), V transposed
/// here; the output must be the CPU FP8 path's with per-tensor scaling and no rotation, within the
/// same acceptance.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_codes_input_matches_cpu_fp8_path() {
    use flash_attn::cuda::{DeviceTensorMut, Fp8Codes};
    use flash_attn::numerics::quant::quantize_e4m3;
    let engine = engine();
    if engine.device().sm() != 90 {
        let opts = fp8(Fp8Scaling::PerTensor, None, false);
        assert!(engine.dispatch([1, 64, 2, 128], [1, 64, 2, 128], DType::BF16, &opts).is_err());
        return;
    }
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(0xC0DE);
    let (qs, ks) = ([2, 130, 4, 128], [2, 257, 2, 128]);
    let (q, k, v) = (randn(&mut rng, DType::BF16, qs), randn(&mut rng, DType::BF16, ks), randn(&mut rng, DType::BF16, ks));
    let z = |t: &flash_attn::Tensor, s: usize| quantize_e4m3(&t.to_f32_vec(), t.shape(), s).unwrap();
    let (qz, kz, vz) = (z(&q, qs[1]), z(&k, ks[1]), z(&v, ks[1]));
    let [b_n, sk, hk, d] = ks;
    let pad = sk.div_ceil(16) * 16;
    let mut vt = vec![0u8; b_n * hk * d * pad];
    for b in 0..b_n {
        for s in 0..sk {
            for h in 0..hk {
                for j in 0..d {
                    vt[((b * hk + h) * d + j) * pad + s] = vz.codes[((b * sk + s) * hk + h) * d + j];
                }
            }
        }
    }
    let up8 = |x: &[u8]| stream.clone_htod(x).unwrap();
    let up32 = |x: &[f32]| stream.clone_htod(x).unwrap();
    let (dq, dk, dvt) = (up8(&qz.codes), up8(&kz.codes), up8(&vt));
    let (sq, sk_, sv) = (up32(&qz.scales), up32(&kz.scales), up32(&vz.scales));
    use cudarc::driver::DevicePtr;
    let addr8 = |x: &cudarc::driver::CudaSlice<u8>| x.device_ptr(&stream).0;
    let addr32 = |x: &cudarc::driver::CudaSlice<f32>| x.device_ptr(&stream).0;
    let codes = Fp8Codes {
        q: addr8(&dq),
        k: addr8(&dk),
        vt: addr8(&dvt),
        vt_row_stride: pad,
        q_descale: addr32(&sq),
        k_descale: addr32(&sk_),
        v_descale: addr32(&sv),
    };
    let n_o: usize = qs.iter().product();
    let mut d_o = stream.clone_htod(&vec![half::bf16::from_f32(f32::NAN); n_o]).unwrap();
    let opts = fp8(Fp8Scaling::PerTensor, None, false).return_lse(false);
    {
        let mut to = DeviceTensorMut::new(&mut d_o, &stream, qs);
        // SAFETY: a stream of the engine's context; the code and descale buffers live until the
        // synchronize below.
        unsafe { engine.launch_fp8_codes_raw(stream.cu_stream(), qs, ks, &codes, &mut to, None, &opts) }.unwrap();
    }
    let o: Vec<half::bf16> = stream.clone_dtoh(&d_o).unwrap();
    stream.synchronize().expect("kernel execution");
    let got: Vec<f64> = o.iter().map(|x| x.to_f64()).collect();
    let cpu = forward(&q, &k, &v, &opts.clone().variant(Variant::Auto).backend(Backend::Cpu)).unwrap();
    let cpu_o: Vec<f64> = cpu.o.to_f32_vec().iter().map(|&x| x as f64).collect();
    let p = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default()).unwrap();
    let exact = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap().o;
    let max_o = got.iter().zip(&cpu_o).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    let (e_gpu, e_cpu) = (rmse(&got, &exact), rmse(&cpu_o, &exact));
    println!("codes input: max|GPU - CPU FP8| {max_o:.2e}; RMSE vs float64: GPU {e_gpu:.3e}, CPU FP8 {e_cpu:.3e}");
    assert!(got.iter().all(|x| x.is_finite()) && max_o <= 0.1 && (e_gpu / e_cpu - 1.0).abs() <= 0.15);
}

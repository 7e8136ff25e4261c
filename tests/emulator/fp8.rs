//! The FP8 path of the Hopper kernels in the CPU emulator (cuda/test/emu, docs/emulator.md,
//! docs/fp8.md "On Hopper"):
//!
//! * the pre-pass (`cuda/fp8_prepass.cu`): its e4m3 codes and scales must be **bit-identical** to
//!   the CPU oracle (`numerics::hadamard::Rotation` then `numerics::quant::quantize_e4m3`, what
//!   `Precision::Fp8` runs on the CPU) over a matrix of dtypes, head dims, shapes, block sizes,
//!   Hadamard seeds, strided inputs, the transposed V output, and edge values (zeros, huge values
//!   whose rotation overflows, subnormals, blocks whose amax / 448 underflows, inf, NaN);
//! * the emulator's host `cuda_fp8.h` (which the emulated kernels convert through) against the
//!   Rust codec, over a sweep of f32 bit patterns and every code, and the FP8 wgmma path's
//!   self-tests;
//! * the consumer (`cuda/fa3_fp8_fwd_sm90.cu`, stages 1-5): against the CPU FP8 path and a host model
//!   of its algorithm, and FA3's FP8 accuracy table.
//!
//! Only g++ is needed (no nvcc, no GPU): these run in the emulator, nothing here ran on a GPU.
use crate::support::emu::{tmap_directive, tool_exe};
use crate::support::Rng;
use flash_attn::cuda::fp8::{consumer_block_n, consumer_plan, prepass_plan, ConsumerOperands, PrepassInput};
use flash_attn::numerics::fp8::{e4m3_from_f32, e4m3_to_f32};
use flash_attn::numerics::hadamard::Rotation;
use flash_attn::numerics::quant::quantize_e4m3;
use half::{bf16, f16};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;
use flash_attn::bench::fp8_baseline::attention_naive_fp8;
use flash_attn::numerics::quant::block_rows;
use flash_attn::numerics::rng::{fa3_outlier_values, SplitMix64};
use flash_attn::reference::{attention_f64, rmse};
use flash_attn::{forward, Backend, DType, ForwardOptions, Fp8Scaling, Precision, Problem, Tensor};

/// The pre-pass against the CPU oracle, bit for bit.
mod prepass;
/// The consumer against the CPU FP8 path, the host model and FA3's accuracy table.
mod consumer;

fn work_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fp8_emu").join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Whether e4m3 code `c` is a NaN (S.1111.111; the sign is free).
fn is_nan_code(c: u8) -> bool {
    c & 0x7F == 0x7F
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dt {
    F16,
    Bf16,
}

impl Dt {
    fn name(self) -> &'static str {
        match self {
            Dt::F16 => "f16",
            Dt::Bf16 => "bf16",
        }
    }
    fn bits(self, x: f32) -> u16 {
        match self {
            Dt::F16 => f16::from_f32(x).to_bits(),
            Dt::Bf16 => bf16::from_f32(x).to_bits(),
        }
    }
    fn dtype(self) -> DType {
        match self {
            Dt::F16 => DType::F16,
            Dt::Bf16 => DType::BF16,
        }
    }
    fn value(self, b: u16) -> f32 {
        match self {
            Dt::F16 => f16::from_bits(b).to_f32(),
            Dt::Bf16 => bf16::from_bits(b).to_f32(),
        }
    }
}

/// The emulator's host cuda_fp8.h against the Rust codec (float8, equal to CUDA 13.0's host
/// conversion except NaN's sign): every code decodes alike, and a sweep of f32 bit patterns (every
/// 4099th, plus every 61st pattern of e4m3's range and its neighbourhood) encodes alike.
#[test]
fn emulator_fp8_codec_matches_rust() {
    let exe = tool_exe("fp8_codec_main.cpp").unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(&exe).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got = out.stdout;
    let mut want = Vec::new();
    for c in 0..=255u8 {
        want.extend(e4m3_to_f32(c).to_bits().to_le_bytes());
    }
    let mut inputs = Vec::new();
    inputs.extend((0..=u32::MAX).step_by(4099));
    for sign in [0u32, 0x8000_0000] {
        let lo = 2.0f32.powi(-12).to_bits();
        let hi = 1024.0f32.to_bits();
        inputs.extend((lo..hi).step_by(61).map(|x| x | sign));
    }
    for &x in &inputs {
        want.push(e4m3_from_f32(f32::from_bits(x)));
    }
    assert_eq!(got.len(), want.len(), "codec program output length");
    let (dec, enc) = got.split_at(256 * 4);
    for c in 0..256 {
        let g = u32::from_le_bytes(dec[4 * c..4 * c + 4].try_into().unwrap());
        let w = e4m3_to_f32(c as u8);
        assert!(g == w.to_bits() || (f32::from_bits(g).is_nan() && w.is_nan()), "decode {c:#04x}: {g:#x}, Rust {w:e}");
    }
    let mut nan = 0;
    for (i, &x) in inputs.iter().enumerate() {
        let (g, w) = (enc[i], want[256 * 4 + i]);
        if is_nan_code(w) {
            assert!(is_nan_code(g), "encode {:e}: {g:#04x}, Rust {w:#04x}", f32::from_bits(x));
            nan += 1;
        } else {
            assert_eq!(g, w, "encode {:e} ({x:#x})", f32::from_bits(x));
        }
    }
    println!("{} decodes, {} encodes ({nan} NaN) equal", 256, inputs.len());
}

/// The FP8 wgmma path in the emulator (cuda/test/emu/fp8_selftest.cpp): acc_to_a8's routing
/// against the fragment maps (which equal CuTe's), the e4m3 tile placement against the
/// emulator's descriptor decoding, and a Q Kᵀ -> P (e4m3, permuted) -> P V chain through the
/// e4m3 wrappers of sm90/wgmma_fp8.cuh against host arithmetic under three scheduler seeds; P left
/// in the accumulator's order must give a wrong result.
#[test]
fn fp8_wgmma_self_tests() {
    let exe = tool_exe("fp8_selftest.cpp").unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(&exe).output().unwrap();
    let log = String::from_utf8_lossy(&out.stdout);
    println!("{log}");
    assert!(out.status.success(), "fp8 self-tests failed:\n{log}{}", String::from_utf8_lossy(&out.stderr));
    assert!(log.contains("4 of 4 fp8 self-tests as expected"), "{log}");
}

/// The launch plans refuse what the FP8 kernels do not run, with typed errors.
#[test]
fn fp8_plans_refuse_what_the_kernels_do_not_run() {
    use flash_attn::Error;
    let input = |d: usize, rotate: bool| PrepassInput {
        shape: [1, 64, 2, d],
        x: 0x1000,
        x_strides: [128 * d, 2 * d, d],
        codes: 0x2000,
        code_strides: [128 * d, 2 * d, d, 1],
        scales: 0x3000,
        rotate,
    };
    let block = Fp8Scaling::PerBlock { rows: 64 };
    assert!(prepass_plan(DType::BF16, block, Some(1), &[input(128, true)]).is_ok());
    assert!(matches!(prepass_plan(DType::BF16, block, Some(1), &[input(96, true)]), Err(Error::InvalidOption { .. })));
    assert!(matches!(prepass_plan(DType::BF16, block, None, &[input(128, true)]), Err(Error::InvalidOption { .. })));
    assert!(matches!(
        prepass_plan(DType::BF16, block, Some(1), &[input(128, true); 3]),
        Err(Error::InvalidOption { .. })
    ));
    assert!(matches!(prepass_plan(DType::F32, block, None, &[input(128, false)]), Err(Error::UnsupportedDType { .. })));
    assert!(matches!(
        prepass_plan(DType::F16, block, None, &[input(320, false)]),
        Err(Error::UnsupportedHeadDim { .. })
    ));
    let plan = prepass_plan(DType::F16, block, None, &[input(96, false)]).unwrap();
    assert_eq!((plan.kernel.as_str(), plan.grid, plan.blocks.as_slice()), ("fa_fp8_prepass_e4_f16", 1, &[1usize][..]));

    let problem = |d: usize, precision: Precision| {
        let t = Tensor::zeros(DType::BF16, [1, 64, 2, d]).unwrap();
        Problem::new(&t.view(), &t.view(), &t.view(), &ForwardOptions::default().precision(precision)).unwrap()
    };
    let ops = |d: usize| ConsumerOperands {
        q: 0x1000,
        q_strides: [128 * d, 2 * d, d],
        k: 0x2000,
        k_strides: [128 * d, 2 * d, d],
        vt: 0x3000,
        vt_strides: [2 * d * 64, 64, d * 64],
        o: 0x4000,
        o_strides: [128 * d, 2 * d, d],
        lse: 0,
        descales: [0x5000, 0x6000, 0x7000],
    };
    let fp8 = |scaling| Precision::Fp8 { scaling, hadamard: None };
    let ok = consumer_plan(&problem(128, fp8(block)), &ops(128), 1, 1).unwrap();
    assert_eq!((ok.kernel.as_str(), ok.grid, ok.params.descale_block), ("fa3fp8s1_fwd_hd128_bf16", (1, 2, 1), 64));
    assert_eq!(
        consumer_plan(&problem(128, fp8(Fp8Scaling::PerTensor)), &ops(128), 1, 1).unwrap().params.descale_block,
        0
    );
    assert!(matches!(
        consumer_plan(&problem(96, fp8(block)), &ops(96), 2, 1),
        Err(Error::UnsupportedHeadDim { head_dim: 96, .. })
    ));
    // Head dims 64 and 256: operands with 64-byte rows get 64-byte boxes and SWIZZLE_64B maps
    // (cuTensorMapEncodeTiled's value 2; 3 is 128B): Q and K at hd 64, Vᵀ of the 64-key tiles at hd 256.
    let swizzles = |d: usize| {
        let plan = consumer_plan(&problem(d, fp8(block)), &ops(d), 5, 132).unwrap();
        assert_eq!(plan.kernel, format!("fa3fp8s5_fwd_hd{d}_bf16"));
        plan.tensor_maps.iter().map(|m| (m.spec.box_dims, m.spec.swizzle)).collect::<Vec<_>>()
    };
    assert_eq!(swizzles(64), [([64, 1, 64, 1], 2), ([64, 1, 128, 1], 2), ([128, 64, 1, 1], 3)]);
    assert_eq!(swizzles(128), [([128, 1, 64, 1], 3), ([128, 1, 128, 1], 3), ([128, 128, 1, 1], 3)]);
    assert_eq!(swizzles(256), [([128, 1, 64, 1], 3), ([128, 1, 64, 1], 3), ([64, 256, 1, 1], 2)]);
    assert!(matches!(
        consumer_plan(&problem(128, fp8(Fp8Scaling::PerBlock { rows: 32 })), &ops(128), 1, 1),
        Err(Error::InvalidOption { .. })
    ));
    assert!(matches!(
        consumer_plan(&problem(128, Precision::default()), &ops(128), 1, 1),
        Err(Error::InvalidOption { .. })
    ));
    assert!(matches!(consumer_plan(&problem(128, fp8(block)), &ops(128), 6, 1), Err(Error::InvalidOption { .. })));
    let s4 = consumer_plan(&problem(128, fp8(block)), &ops(128), 4, 1).unwrap();
    assert_eq!((s4.kernel.as_str(), s4.block, s4.grid), ("fa3fp8s4_fwd_hd128_bf16", 384, (1, 2, 1)));
    let s5 = consumer_plan(&problem(128, fp8(block)), &ops(128), 5, 132).unwrap();
    assert_eq!((s5.kernel.as_str(), s5.block, s5.grid), ("fa3fp8s5_fwd_hd128_bf16", 384, (2, 1, 1)));
    let s2 = consumer_plan(&problem(128, fp8(block)), &ops(128), 2, 1).unwrap();
    assert_eq!((s2.kernel.as_str(), s2.tensor_maps.len()), ("fa3fp8s2_fwd_hd128_bf16", 3));
    assert_eq!(s2.tensor_maps[2].spec.box_dims, [128, 128, 1, 1]);
    let s3 = consumer_plan(&problem(128, fp8(block)), &ops(128), 3, 1).unwrap();
    assert_eq!((s3.kernel.as_str(), s3.block, s3.grid), ("fa3fp8s3_fwd_hd128_bf16", 384, (1, 2, 1)));
    let mut misaligned = ops(128);
    misaligned.vt_strides[1] = 70;
    assert!(matches!(consumer_plan(&problem(128, fp8(block)), &misaligned, 1, 1), Err(Error::InvalidLayout { .. })));
}

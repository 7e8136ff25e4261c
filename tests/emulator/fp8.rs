//! The FP8 path of the Hopper kernels in the CPU emulator (cuda/test/emu, docs/emulator.md,
//! docs/fp8.md "On Hopper"):
//!
//! * the pre-pass (`cuda/fp8_prepass.cu`): its e4m3 codes and scales must be **bit-identical** to
//!   the CPU oracle (`numerics::hadamard::Rotation` then `numerics::quant::quantize_e4m3`, what
//!   `Precision::Fp8` runs on the CPU) over a matrix of dtypes, head dims, shapes, block sizes,
//!   Hadamard seeds, strided inputs, the transposed V output, and edge values (zeros, huge values
//!   whose rotation overflows, subnormals, blocks whose amax / 448 underflows, inf, NaN);
//! * the emulator's host `cuda_fp8.h` (which the emulated kernels convert through) against the
//!   Rust codec, over a sweep of f32 bit patterns and every code.
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

fn work_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fp8_emu").join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
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

/// How the values of an operand are drawn.
#[derive(Clone, Copy, Debug)]
enum Fill {
    /// N(0, 1).
    Normal,
    /// FA3 §4.3: N(0, 1) + N(0, 100)·Bernoulli(0.001), plus some large outliers.
    Outliers,
    /// Each scale block picks one of: zeros, huge (near the dtype's max, so the rotation's sums
    /// overflow to inf), subnormals of the dtype, tiny (amax / 448 underflows), with ±inf, with
    /// NaN, or normal.
    Edges,
}

/// One operand of a launch: `[batch, seqlen, heads, d]` in a buffer with element strides.
#[derive(Clone, Debug)]
struct Operand {
    shape: [usize; 4],
    /// Element strides of batch, seqlen, heads (head_dim contiguous).
    x_strides: [usize; 3],
    /// Codes written transposed, `[b, h, d, s_pad]` (the K-major V of the PV product).
    transposed: bool,
    block_rows: usize,
    rotate: bool,
    bits: Vec<u16>,
}

impl Operand {
    #[allow(clippy::too_many_arguments)]
    fn new(
        rng: &mut Rng,
        dt: Dt,
        shape: [usize; 4],
        bhsd: bool,
        transposed: bool,
        block_rows: usize,
        rotate: bool,
        fill: Fill,
    ) -> Self {
        let [b_n, s_n, h_n, d] = shape;
        // Strided inputs: [b, h, s, d] storage, or padded rows in [b, s, h, d].
        let x_strides = if bhsd { [h_n * s_n * d, d, s_n * d] } else { [s_n * h_n * (d + 8), h_n * (d + 8), d + 8] };
        let len = (b_n - 1) * x_strides[0] + (s_n - 1) * x_strides[1] + (h_n - 1) * x_strides[2] + d;
        let mut bits = vec![dt.bits(7777.0); len]; // padding the kernel must not read into its result
        let (huge, sub) = match dt {
            Dt::F16 => (60000.0f32, 2.0f32.powi(-20)),
            Dt::Bf16 => (3.0e38f32, 2.0f32.powi(-130)),
        };
        for b in 0..b_n {
            for h in 0..h_n {
                let mut kind = 0u64;
                for s in 0..s_n {
                    if s % block_rows == 0 {
                        kind = rng.next_u64() % 8;
                    }
                    for j in 0..d {
                        let n = rng.normal() as f32;
                        let x = match fill {
                            Fill::Normal => n,
                            Fill::Outliers => {
                                let o = if rng.uniform() < 0.001 { 10.0 * rng.normal() as f32 } else { 0.0 };
                                n + o + if rng.uniform() < 0.0005 { 300.0 } else { 0.0 }
                            }
                            Fill::Edges => match kind {
                                0 => 0.0,
                                1 => huge * n.signum() * (0.5 + 0.5 * rng.uniform() as f32),
                                2 => sub * (rng.next_u64() % 7) as f32 * n.signum(),
                                3 => 1e-40 * n,
                                4 if rng.uniform() < 0.01 => f32::INFINITY * n.signum(),
                                5 if rng.uniform() < 0.01 => f32::NAN,
                                6 => n * 1e4,
                                _ => n,
                            },
                        };
                        bits[b * x_strides[0] + s * x_strides[1] + h * x_strides[2] + j] = dt.bits(x);
                    }
                }
            }
        }
        Operand { shape, x_strides, transposed, block_rows, rotate, bits }
    }

    fn s_pad(&self) -> usize {
        self.shape[1].div_ceil(16) * 16
    }
    /// Byte strides of the codes (batch, seqlen, heads, head_dim) and their buffer size.
    fn code_strides(&self) -> ([usize; 4], usize) {
        let [b_n, s_n, h_n, d] = self.shape;
        if self.transposed {
            let sp = self.s_pad();
            ([h_n * d * sp, 1, d * sp, sp], b_n * h_n * d * sp)
        } else {
            ([s_n * h_n * d, h_n * d, d, 1], b_n * s_n * h_n * d)
        }
    }
    /// The CPU oracle: the values read to f32, rotated (Q, K), quantised by `quantize_e4m3`.
    fn oracle(&self, dt: Dt, seed: u64) -> (Vec<u8>, Vec<f32>) {
        let [b_n, s_n, h_n, d] = self.shape;
        let mut buf = vec![0.0f32; b_n * s_n * h_n * d];
        for b in 0..b_n {
            for s in 0..s_n {
                for h in 0..h_n {
                    let at = ((b * s_n + s) * h_n + h) * d;
                    let src = b * self.x_strides[0] + s * self.x_strides[1] + h * self.x_strides[2];
                    for j in 0..d {
                        buf[at + j] = dt.value(self.bits[src + j]);
                    }
                }
            }
        }
        if self.rotate {
            Rotation::new(d, seed).unwrap().apply_rows(&mut buf);
        }
        let q = quantize_e4m3(&buf, self.shape, self.block_rows).unwrap();
        (q.codes, q.scales)
    }
}

struct Launch {
    name: String,
    dt: Dt,
    seed: u64,
    ops: Vec<Operand>,
}

fn is_nan_code(c: u8) -> bool {
    c & 0x7F == 0x7F
}

/// Runs the launch in the emulator and compares every code and scale with the oracle.
fn run(l: &Launch) -> Result<String, String> {
    let exe = tool_exe("fp8_prepass_main.cpp")?;
    let dir = work_dir(&l.name);
    // The crate's launch plan, on device addresses the driver maps onto host buffers.
    let o0 = &l.ops[0];
    let scaling =
        if o0.block_rows == o0.shape[1] { Fp8Scaling::PerTensor } else { Fp8Scaling::PerBlock { rows: o0.block_rows } };
    let base = |i: usize, which: u64| 0x1000_0000 * (1 + 3 * i as u64 + which);
    let inputs: Vec<PrepassInput> = l
        .ops
        .iter()
        .enumerate()
        .map(|(i, o)| PrepassInput {
            shape: o.shape,
            x: base(i, 0),
            x_strides: o.x_strides,
            codes: base(i, 1),
            code_strides: o.code_strides().0,
            scales: base(i, 2),
            rotate: o.rotate,
        })
        .collect();
    let plan = prepass_plan(l.dt.dtype(), scaling, Some(l.seed), &inputs).map_err(|e| e.to_string())?;
    let mut case = String::new();
    let hex: String = plan.params.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    writeln!(case, "kernel {}\ngrid {}\nblock {}\nseeds 1 2 3\nparams {hex}", plan.kernel, plan.grid, plan.block)
        .unwrap();
    for (i, o) in l.ops.iter().enumerate() {
        if o.block_rows != block_rows(scaling, o.shape[1]) {
            return Err(format!("op {i}: block_rows {} is not what {scaling:?} gives", o.block_rows));
        }
        let x_path = dir.join(format!("x{i}.bin"));
        let bytes: Vec<u8> = o.bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        std::fs::write(&x_path, &bytes).unwrap();
        let [b_n, _, h_n, _] = o.shape;
        let (_, c_bytes) = o.code_strides();
        writeln!(case, "in x{i} {:#x} {} {}", base(i, 0), bytes.len(), x_path.display()).unwrap();
        writeln!(case, "out codes{i} {:#x} {c_bytes} {}", base(i, 1), dir.join(format!("codes{i}.bin")).display())
            .unwrap();
        let scale_bytes = b_n * h_n * plan.blocks[i] * 4;
        writeln!(
            case,
            "out scales{i} {:#x} {scale_bytes} {}",
            base(i, 2),
            dir.join(format!("scales{i}.bin")).display()
        )
        .unwrap();
    }
    let case_path = dir.join("case.txt");
    std::fs::write(&case_path, &case).unwrap();
    let out = Command::new(&exe).arg(&case_path).output().map_err(|e| e.to_string())?;
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(format!("emulator run failed ({}):\n{log}", out.status));
    }
    let mut summary = String::new();
    for (i, o) in l.ops.iter().enumerate() {
        let codes = std::fs::read(dir.join(format!("codes{i}.bin"))).unwrap();
        let scales: Vec<f32> = std::fs::read(dir.join(format!("scales{i}.bin")))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let (want_codes, want_scales) = o.oracle(l.dt, l.seed);
        if scales.len() != want_scales.len() {
            return Err(format!("op {i}: {} scales, oracle {}", scales.len(), want_scales.len()));
        }
        for (k, (g, w)) in scales.iter().zip(&want_scales).enumerate() {
            if g.to_bits() != w.to_bits() {
                return Err(format!(
                    "op {i}: scale {k} is {g:e} ({:#x}), oracle {w:e} ({:#x})",
                    g.to_bits(),
                    w.to_bits()
                ));
            }
        }
        let [b_n, s_n, h_n, d] = o.shape;
        let (cs, _) = o.code_strides();
        let (mut nan, mut sat, mut zero) = (0, 0, 0);
        for b in 0..b_n {
            for s in 0..s_n {
                for h in 0..h_n {
                    for j in 0..d {
                        let w = want_codes[((b * s_n + s) * h_n + h) * d + j];
                        let g = codes[b * cs[0] + s * cs[1] + h * cs[2] + j * cs[3]];
                        let same = if is_nan_code(w) { is_nan_code(g) } else { g == w };
                        if !same {
                            return Err(format!(
                                "op {i}: code of (b {b}, s {s}, h {h}, d {j}) is {g:#04x} ({}), oracle {w:#04x} ({})",
                                e4m3_to_f32(g),
                                e4m3_to_f32(w)
                            ));
                        }
                        nan += is_nan_code(w) as usize;
                        sat += (w & 0x7F == 0x7E) as usize;
                        zero += (w & 0x7F == 0) as usize;
                    }
                }
            }
        }
        write!(
            summary,
            "op {i}: {} codes, {} scales ({nan} NaN, {sat} saturated, {zero} zero); ",
            want_codes.len(),
            scales.len()
        )
        .unwrap();
    }
    Ok(summary)
}

fn check(launches: &[Launch]) {
    crate::support::check_each("pre-pass launches (against the CPU oracle)", launches, |l| l.name.clone(), run);
}

/// Q and K in one launch (rotated), as the forward runs them: every dtype and head dim, several
/// Hadamard seeds, block sizes 64 / 128 / one per (batch, head), seqlens that are not block
/// multiples, GQA head counts, strided inputs.
#[test]
fn prepass_qk_bit_identical_to_cpu_oracle() {
    let mut rng = Rng::new(0x0F8F_8F8F);
    let mut launches = Vec::new();
    let mut n = 0;
    for dt in [Dt::Bf16, Dt::F16] {
        for d in [64usize, 128, 256, 32, 16] {
            for (block, fill) in [(64usize, Fill::Outliers), (128, Fill::Normal), (0, Fill::Outliers)] {
                n += 1;
                let seed = [0u64, 0x5EED, u64::MAX, 0x0123_4567_89AB_CDEF][n % 4];
                let (sq, sk) = [(130, 65), (63, 200), (1, 129), (257, 64)][n % 4];
                let bq = if block == 0 { sq } else { block };
                let bk = if block == 0 { sk } else { block };
                let q = Operand::new(&mut rng, dt, [2, sq, 4, d], n % 3 == 0, false, bq, true, fill);
                let k = Operand::new(&mut rng, dt, [2, sk, 2, d], n % 2 == 0, false, bk, true, fill);
                launches.push(Launch {
                    name: format!("qk_{}_d{d}_blk{block}_seed{seed:x}", dt.name()),
                    dt,
                    seed,
                    ops: vec![q, k],
                });
            }
        }
    }
    check(&launches);
}

/// V alone (no rotation), codes written `[b, s, h, d]` and transposed `[b, h, d, s_pad]` (the
/// K-major B operand of the FP8 PV product), and head dims that are not powers of two.
#[test]
fn prepass_v_bit_identical_to_cpu_oracle() {
    let mut rng = Rng::new(0x000F_8F8F_0000_0001);
    let mut launches = Vec::new();
    for dt in [Dt::Bf16, Dt::F16] {
        for d in [64usize, 128, 256, 96, 40] {
            for transposed in [false, true] {
                let s = if transposed { 143 } else { 77 };
                let v = Operand::new(&mut rng, dt, [2, s, 3, d], transposed, transposed, 64, false, Fill::Outliers);
                launches.push(Launch {
                    name: format!("v_{}_d{d}_t{}", dt.name(), transposed as u8),
                    dt,
                    seed: 0,
                    ops: vec![v],
                });
            }
        }
    }
    check(&launches);
}

/// Edge values: all-zero blocks, huge values (the rotation's sums overflow to ±inf: inf is left
/// out of amax and saturates to ±448, inf − inf is NaN), dtype subnormals, blocks whose
/// amax / 448 underflows (scale 1), ±inf, NaN; with and without rotation, per-block and one
/// scale per (batch, head).
#[test]
fn prepass_edge_values_bit_identical_to_cpu_oracle() {
    let mut rng = Rng::new(0xED6E);
    let mut launches = Vec::new();
    for dt in [Dt::Bf16, Dt::F16] {
        for d in [64usize, 128] {
            for rotate in [true, false] {
                for block in [16usize, 0] {
                    let s = 96;
                    let blk = if block == 0 { s } else { block };
                    let a = Operand::new(&mut rng, dt, [2, s, 3, d], false, false, blk, rotate, Fill::Edges);
                    let b = Operand::new(&mut rng, dt, [1, 40, 2, d], true, false, blk.min(40), rotate, Fill::Edges);
                    launches.push(Launch {
                        name: format!("edges_{}_d{d}_rot{}_blk{block}", dt.name(), rotate as u8),
                        dt,
                        seed: 0xE4,
                        ops: vec![a, b],
                    });
                }
            }
        }
    }
    check(&launches);
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

// ---------------------------------------------------------------- the FP8 consumer

use flash_attn::bench::fp8_baseline::attention_naive_fp8;
use flash_attn::numerics::quant::block_rows;
use flash_attn::numerics::rng::{fa3_outlier_values, SplitMix64};
use flash_attn::reference::{attention_f64, rmse};
use flash_attn::{forward, Backend, DType, ForwardOptions, Fp8Scaling, Precision, Problem, Tensor};

struct KernelOut {
    o: Vec<f32>,
    lse: Vec<f32>,
    secs: f64,
    /// The model's answer (`kernel_model`): the kernel's algorithm on the host.
    model: Vec<f64>,
}

/// The consumer's algorithm on the host, from the same codes and scales: key tiles of
/// `consumer_block_n(head_dim)` (128; 64 at head_dim 256), the
/// running max of descaled raw scores, P = exp2((s - m) · scale · log2 e) in f32 into the row sum,
/// e4m3(P · 2^8) times V's dequantised values into O (f64), O / (l · 2^8) at the end. What the
/// kernel computes up to f32 accumulation order (the CPU FP8 path differs more: it tiles keys by
/// 64, and the running max at each tile decides how P · 2^8 rounds to e4m3).
#[allow(clippy::too_many_arguments)]
fn kernel_model(
    shape_q: [usize; 4],
    shape_k: [usize; 4],
    qz: &flash_attn::numerics::quant::QuantizedE4m3,
    kz: &flash_attn::numerics::quant::QuantizedE4m3,
    vz: &flash_attn::numerics::quant::QuantizedE4m3,
    scale: f32,
    causal: bool,
) -> Vec<f64> {
    use flash_attn::numerics::fp8::round_e4m3;
    let [b_n, sq, hq, d] = shape_q;
    let [_, sk, hk, _] = shape_k;
    let deq = |z: &flash_attn::numerics::quant::QuantizedE4m3, b: usize, s: usize, h: usize| -> Vec<f32> {
        let at = ((b * z.shape[1] + s) * z.shape[2] + h) * d;
        z.codes[at..at + d].iter().map(|&c| e4m3_to_f32(c)).collect()
    };
    let mut out = vec![0.0f64; b_n * sq * hq * d];
    let bn = consumer_block_n(d);
    let sl2 = scale * std::f32::consts::LOG2_E;
    for b in 0..b_n {
        for h in 0..hq {
            let kh = h / (hq / hk);
            for i in 0..sq {
                let qc = deq(qz, b, i, h);
                let dq = qz.scale(b, i, h);
                // Causal, bottom-right aligned: keys j <= i + sk - sq (none when that is negative).
                let hi = if !causal {
                    sk
                } else if i + sk >= sq {
                    (i + sk - sq + 1).min(sk)
                } else {
                    0
                };
                let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
                let mut o = vec![0.0f64; d];
                for n0 in (0..hi).step_by(bn) {
                    let keys = n0..(n0 + bn).min(hi);
                    let s: Vec<f32> = keys
                        .clone()
                        .map(|j| {
                            let kc = deq(kz, b, j, kh);
                            let dot: f64 = qc.iter().zip(&kc).map(|(a, c)| *a as f64 * *c as f64).sum();
                            dot as f32 * (dq * kz.scale(b, j, kh))
                        })
                        .collect();
                    let mx = s.iter().fold(m, |a, &x| a.max(x));
                    let corr = if m == f32::NEG_INFINITY { 0.0 } else { ((m - mx) * sl2).exp2() };
                    m = mx;
                    let p: Vec<f32> = s.iter().map(|&x| ((x - m) * sl2).exp2()).collect();
                    l = l * corr + p.iter().sum::<f32>();
                    for x in o.iter_mut() {
                        *x *= corr as f64;
                    }
                    for (pj, j) in p.iter().zip(keys) {
                        let p8 = round_e4m3(pj * 256.0) as f64;
                        let vc = deq(vz, b, j, kh);
                        let dv = vz.scale(b, j, kh) as f64;
                        for (x, &c) in o.iter_mut().zip(&vc) {
                            *x += p8 * c as f64 * dv;
                        }
                    }
                }
                let at = ((b * sq + i) * hq + h) * d;
                for (jj, x) in o.iter().enumerate() {
                    out[at + jj] = if l == 0.0 { 0.0 } else { x / (l as f64 * 256.0) };
                }
            }
        }
    }
    out
}

/// Quantises q, k, v as the pre-pass does (the CPU oracle, bit-identical to it: the pre-pass
/// tests above), transposes V's codes to [b, h_kv, d, s_pad], and runs the FP8 consumer
/// `fa3fp8s<stage>_fwd_hd<d>_<dtype>` in the emulator with the driver's launch file (seeds given).
#[allow(clippy::too_many_arguments)]
fn run_fp8_kernel(
    name: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scaling: Fp8Scaling,
    hadamard: Option<u64>,
    causal: bool,
    seeds: &str,
    stage: u32,
    sm_count: u32,
) -> Result<KernelOut, String> {
    let [b_n, sq, hq, d] = q.shape();
    let [_, sk, hk, _] = k.shape();
    assert!([64, 128, 256].contains(&d), "the FP8 consumer is instantiated for head_dim 64, 128, 256");
    let codes = |t: &Tensor, rotate: bool| {
        let mut buf = t.to_f32_vec();
        if let (true, Some(seed)) = (rotate, hadamard) {
            Rotation::new(d, seed).unwrap().apply_rows(&mut buf);
        }
        quantize_e4m3(&buf, t.shape(), block_rows(scaling, t.shape()[1])).unwrap()
    };
    let (qz, kz, vz) = (codes(q, true), codes(k, true), codes(v, false));
    let s_pad = sk.div_ceil(16) * 16;
    let mut vt = vec![0u8; b_n * hk * d * s_pad];
    for b in 0..b_n {
        for s in 0..sk {
            for h in 0..hk {
                for j in 0..d {
                    vt[((b * hk + h) * d + j) * s_pad + s] = vz.codes[((b * sk + s) * hk + h) * d + j];
                }
            }
        }
    }
    // The crate's launch plan, on device addresses the driver maps onto host buffers.
    let opts =
        ForwardOptions::default().precision(Precision::Fp8 { scaling, hadamard }).causal(causal).return_lse(true);
    let problem = Problem::new(&q.view(), &k.view(), &v.view(), &opts).map_err(|e| e.to_string())?;
    let ops = ConsumerOperands {
        q: 0x1000_0000,
        q_strides: [sq * hq * d, hq * d, d],
        k: 0x2000_0000,
        k_strides: [sk * hk * d, hk * d, d],
        vt: 0x3000_0000,
        vt_strides: [hk * d * s_pad, s_pad, d * s_pad],
        o: 0x4000_0000,
        o_strides: [sq * hq * d, hq * d, d],
        lse: 0x5000_0000,
        descales: [0x6000_0000, 0x7000_0000, 0x8000_0000],
    };
    // Stage 5's persistent grid: a few CTAs, so each walks several tiles (sm_count).
    let plan = consumer_plan(&problem, &ops, stage, sm_count).map_err(|e| e.to_string())?;
    let p = plan.params;
    let scale = problem.scale;
    let dtype = q.dtype();
    let dir = work_dir(name);
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let ins: [(&str, u64, Vec<u8>); 6] = [
        ("q", p.q, qz.codes.clone()),
        ("k", p.k, kz.codes.clone()),
        ("v", p.v, vt),
        ("q_descale", p.q_descale, f32_bytes(&qz.scales)),
        ("k_descale", p.k_descale, f32_bytes(&kz.scales)),
        ("v_descale", p.v_descale, f32_bytes(&vz.scales)),
    ];
    let mut lf = String::new();
    writeln!(lf, "kernel {}", plan.kernel).unwrap();
    let (gx, gy, gz) = plan.grid;
    writeln!(lf, "grid {gx} {gy} {gz}\nblock {}\nsmem {}\nregs 0\nseeds {seeds}", plan.block, plan.smem_bytes).unwrap();
    let hex: String = p.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    writeln!(lf, "params {hex}").unwrap();
    for m in &plan.tensor_maps {
        writeln!(lf, "{}", tmap_directive(m)).unwrap();
    }
    for (n, addr, bytes) in &ins {
        let path = dir.join(format!("{n}.bin"));
        std::fs::write(&path, bytes).unwrap();
        writeln!(lf, "in {n} {addr:#x} {} {}", bytes.len(), path.display()).unwrap();
    }
    let o_path = dir.join("o.bin");
    let lse_path = dir.join("lse.bin");
    writeln!(lf, "out o {:#x} {} {}", p.o, b_n * sq * hq * d * 2, o_path.display()).unwrap();
    writeln!(lf, "out lse {:#x} {} {}", p.lse, b_n * hq * sq * 4, lse_path.display()).unwrap();
    let launch_path = dir.join("launch.txt");
    std::fs::write(&launch_path, &lf).unwrap();
    let exe = tool_exe("fa3_fp8_unit.cpp")?;
    let t0 = std::time::Instant::now();
    let out = Command::new(&exe).arg(&launch_path).output().map_err(|e| e.to_string())?;
    let secs = t0.elapsed().as_secs_f64();
    if !out.status.success() {
        return Err(format!(
            "emulator run failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let ob = std::fs::read(&o_path).unwrap();
    let o: Vec<f32> = ob
        .chunks_exact(2)
        .map(|c| {
            let bits = u16::from_le_bytes([c[0], c[1]]);
            if dtype == DType::BF16 {
                Dt::Bf16.value(bits)
            } else {
                Dt::F16.value(bits)
            }
        })
        .collect();
    let lse: Vec<f32> =
        std::fs::read(&lse_path).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let model = kernel_model(q.shape(), k.shape(), &qz, &kz, &vz, scale, causal);
    Ok(KernelOut { o, lse, secs, model })
}

fn fa3_inputs(dtype: DType, q_shape: [usize; 4], k_shape: [usize; 4], seed: u64) -> (Tensor, Tensor, Tensor) {
    let mut g = SplitMix64::new(seed);
    let mut mk = |s: [usize; 4]| Tensor::from_f32(&fa3_outlier_values(&mut g, s.iter().product()), dtype, s).unwrap();
    let q = mk(q_shape);
    let k = mk(k_shape);
    let v = mk(k_shape);
    (q, k, v)
}

fn cpu_fp8(q: &Tensor, k: &Tensor, v: &Tensor, precision: Precision, causal: bool) -> (Vec<f32>, Vec<f32>) {
    let opts = ForwardOptions::default().backend(Backend::Cpu).precision(precision).causal(causal).return_lse(true);
    let out = forward(q, k, v, &opts).unwrap();
    (out.o.to_f32_vec(), out.lse.unwrap())
}

/// The FP8 consumer (ran in the emulator) against the CPU FP8 path with the same settings:
/// outputs within the accumulation-order tolerance (the kernel multiplies the f32 accumulators
/// by the descales where the CPU multiplies dequantised values; the two roundings can move a
/// P · 2^8 across an e4m3 rounding boundary, a one-step change of that P), LSE within 1e-4.
/// Stages 1-3 here, stages 4-5 in `fp8_consumer_stages_4_5`.
#[test]
fn fp8_consumer_matches_cpu_fp8_path() {
    consumer_matrix(&[1, 2, 3], 128);
}

/// As `fp8_consumer_matches_cpu_fp8_path`, at stage 4 (ping-pong, intra-warpgroup overlap) and
/// stage 5 (persistent: 1-3 CTAs, so each walks several query tiles through the carried ring).
#[test]
fn fp8_consumer_stages_4_5() {
    consumer_matrix(&[4, 5], 128);
}

/// The same matrix at head_dim 64 (Q and K tiles with 64-byte swizzle rows: SW64 descriptors and
/// SWIZZLE_64B maps), stages 1 (plain loads), 3 (TMA, warp specialisation) and 5 (the top row).
#[test]
fn fp8_consumer_hd64() {
    consumer_matrix(&[1, 3, 5], 64);
}

/// The same matrix at head_dim 256 (64-key tiles, so Vᵀ rows are 64 bytes: SW64), stages 1, 3, 5.
#[test]
fn fp8_consumer_hd256() {
    consumer_matrix(&[1, 3, 5], 256);
}

/// Stage 5's CTAs for case `i`: fewer than the tiles, so the carried ring and Q buffer are used.
fn sm_count(stage: u32, i: usize) -> u32 {
    if stage == 5 {
        [2, 3, 1, 2][i % 4]
    } else {
        1
    }
}

fn consumer_matrix(stages: &[u32], d: usize) {
    let cases = [
        (
            "bf16_block64_had_gqa",
            DType::BF16,
            [2, 130, 4, d],
            [2, 257, 2, d],
            Fp8Scaling::PerBlock { rows: 64 },
            Some(0x5EED),
            false,
        ),
        (
            "f16_block64_had_causal",
            DType::F16,
            [1, 200, 2, d],
            [1, 300, 2, d],
            Fp8Scaling::PerBlock { rows: 64 },
            Some(7),
            true,
        ),
        (
            "bf16_block128_causal_rows_without_keys",
            DType::BF16,
            [1, 190, 2, d],
            [1, 70, 1, d],
            Fp8Scaling::PerBlock { rows: 128 },
            Some(1),
            true,
        ),
        ("f16_per_tensor_no_had", DType::F16, [1, 65, 2, d], [1, 129, 2, d], Fp8Scaling::PerTensor, None, false),
    ];
    let mut failed = Vec::new();
    for ((i, (name, dtype, qs, ks, scaling, hadamard, causal)), &stage) in
        cases.into_iter().enumerate().flat_map(|c| stages.iter().map(move |s| (c, s)))
    {
        let (q, k, v) = fa3_inputs(dtype, qs, ks, 100 + i as u64);
        let sms = sm_count(stage, i);
        let name = format!("s{stage}_hd{d}_{name}");
        let got = run_fp8_kernel(&name, &q, &k, &v, scaling, hadamard, causal, "1 2 3", stage, sms)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let (o, lse) = cpu_fp8(&q, &k, &v, Precision::Fp8 { scaling, hadamard }, causal);
        let max_o = got.o.iter().zip(&o).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        let o64: Vec<f64> = o.iter().map(|&x| x as f64).collect();
        let g64: Vec<f64> = got.o.iter().map(|&x| x as f64).collect();
        let rms = rmse(&g64, &o64);
        let max_lse =
            got.lse.iter().zip(&lse).map(|(a, b)| if a == b { 0.0 } else { (a - b).abs() }).fold(0.0f32, f32::max);
        let lse_ok = got.lse.iter().zip(&lse).all(|(a, b)| (a.is_infinite() && a == b) || (a - b).abs() <= 1e-4);
        // Against the model of the kernel's own tiling: output rounding (bf16 2^-9 relative)
        // plus rare one-step flips of an e4m3 P.
        let max_model = got.o.iter().zip(&got.model).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0f64, f64::max);
        let rms_model = rmse(&g64, &got.model);
        // Against the CPU FP8 path: the same method, keys tiled by 64 instead of 128, so P · 2^8
        // rounds against other running maxima: the two must be equally far from float64.
        let p = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default().causal(causal)).unwrap();
        let exact = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap().o;
        let (e_kernel, e_cpu) = (rmse(&g64, &exact), rmse(&o64, &exact));
        let ok = rms_model <= 1e-3
            && max_model <= 2e-2
            && (e_kernel / e_cpu - 1.0).abs() <= 0.15
            && max_o <= 0.1
            && lse_ok
            && got.o.iter().all(|x| x.is_finite());
        println!(
            "{}  {name} (CTAs: {}): vs the kernel model max {max_model:.2e} RMS {rms_model:.2e}; vs the CPU FP8 path max {max_o:.2e} \
             RMS {rms:.2e}, max|LSE diff| {max_lse:.2e}; RMSE vs float64: kernel {e_kernel:.3e}, CPU {e_cpu:.3e} ({:.1} s, 3 seeds)",
            if ok { "ok  " } else { "FAIL" },
            if stage == 5 { sms.to_string() } else { "one per tile".into() },
            got.secs
        );
        if !ok {
            failed.push(name);
        }
    }
    assert!(failed.is_empty(), "FP8 consumer differs from the CPU FP8 path: {failed:?}");
}

/// The accuracy table of examples/fp8_accuracy (docs/fp8.md) reproduced through the kernel (ran
/// in the emulator): FA3's inputs (N(0,1) + N(0,100)·Bernoulli(0.001)), shape [1, 1024, 4, 128],
/// seed 0, f16. Per-block (64) + Hadamard through the top stage (5, persistent on 7 CTAs for 32
/// tiles) must reach the paper's 9.1e-3 and beat the naive per-tensor FP8 baseline by at least
/// 2x; stages 1 and 3 must give the same bits (the same tiles in the same order); the per-tensor
/// kernel without Hadamard is reported.
#[test]
fn fp8_consumer_accuracy_table() {
    let (naive, rows) = accuracy_rows(
        128,
        &[
            ("per-block (64) + Hadamard, stage 5", Fp8Scaling::PerBlock { rows: 64 }, Some(0x5EED), 5),
            ("per-tensor, no Hadamard, stage 5", Fp8Scaling::PerTensor, None, 5),
            ("per-block (64) + Hadamard, stage 3", Fp8Scaling::PerBlock { rows: 64 }, Some(0x5EED), 3),
            ("per-block (64) + Hadamard, stage 1", Fp8Scaling::PerBlock { rows: 64 }, Some(0x5EED), 1),
        ],
    );
    let rows: Vec<f64> = rows.iter().map(|r| r.0).collect();
    assert!(rows[0] <= 9.1e-3, "per-block + Hadamard RMSE {:.3e} > 9.1e-3", rows[0]);
    assert_eq!(rows[0], rows[2], "stages 5 and 3 compute the same tiles in the same order");
    assert_eq!(rows[2], rows[3], "stages 3 and 1 compute the same tiles in the same order");
    assert!(naive / rows[0] >= 2.0, "gain over the naive per-tensor baseline only {:.2}x", naive / rows[0]);
}

/// The accuracy table's two stage-5 rows at head_dim 64 and 256 (ran in the emulator), shape
/// [1, 1024, 4, d], seed 0, FA3's inputs. The accuracy targets are stated at head_dim 128; here the
/// kernel must match the CPU FP8 path's RMSE within 3 % (the same method), per-block + Hadamard
/// must beat per-tensor without it, and its gain over the naive baseline is reported.
#[test]
fn fp8_consumer_accuracy_table_hd64_hd256() {
    for d in [64, 256] {
        let (naive, rows) = accuracy_rows(
            d,
            &[
                ("per-block (64) + Hadamard, stage 5", Fp8Scaling::PerBlock { rows: 64 }, Some(0x5EED), 5),
                ("per-tensor, no Hadamard, stage 5", Fp8Scaling::PerTensor, None, 5),
            ],
        );
        for &(ek, ec) in &rows {
            assert!((ek / ec - 1.0).abs() <= 0.03, "hd{d}: kernel RMSE {ek:.3e} vs the CPU FP8 path {ec:.3e}");
        }
        assert!(
            rows[0].0 < rows[1].0,
            "hd{d}: per-block + Hadamard {:.3e} not below per-tensor {:.3e}",
            rows[0].0,
            rows[1].0
        );
        assert!(rows[0].0 < naive, "hd{d}: no gain over the naive baseline");
    }
}

/// Runs the FP8 consumer on the accuracy table's inputs at head_dim `d` (the example's draw: q,
/// k, v from one stream, seed 0, f16, [1, 1024, 4, d]) for each (label, scaling, hadamard,
/// stage); returns the naive per-tensor FP8 baseline's RMSE vs float64 and, per run, the
/// kernel's and the CPU FP8 path's.
fn accuracy_rows(d: usize, runs: &[(&str, Fp8Scaling, Option<u64>, u32)]) -> (f64, Vec<(f64, f64)>) {
    let shape = [1, 1024, 4, d];
    let (q, k, v) = fa3_inputs(DType::F16, shape, shape, 0);
    // The example's draw: q, k, v from one stream in that order.
    let n: usize = shape.iter().product();
    let mut g = SplitMix64::new(0);
    let mut mk = || Tensor::from_f32(&fa3_outlier_values(&mut g, n), DType::F16, shape).unwrap();
    let (q2, k2, v2) = (mk(), mk(), mk());
    assert_eq!((q.to_f32_vec(), k.to_f32_vec(), v.to_f32_vec()), (q2.to_f32_vec(), k2.to_f32_vec(), v2.to_f32_vec()));
    let p = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default()).unwrap();
    let exact = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap().o;
    let err = |o: &[f32]| rmse(&o.iter().map(|&x| x as f64).collect::<Vec<_>>(), &exact);
    let naive = rmse(&attention_naive_fp8(&p, &q.view(), &k.view(), &v.view(), Fp8Scaling::PerTensor).unwrap(), &exact);
    let mut rows = Vec::new();
    for &(label, scaling, hadamard, stage) in runs {
        let name = format!("table_hd{d}_{}", rows.len());
        let got = run_fp8_kernel(&name, &q, &k, &v, scaling, hadamard, false, "1", stage, 7)
            .unwrap_or_else(|e| panic!("hd{d} {label}: {e}"));
        let (cpu, _) = cpu_fp8(&q, &k, &v, Precision::Fp8 { scaling, hadamard }, false);
        let (ek, ec) = (err(&got.o), err(&cpu));
        println!(
            "hd{d} {label}: kernel RMSE {ek:.3e} (CPU FP8 path {ec:.3e}), gain over the naive FP8 baseline \
             ({naive:.3e}) {:.2}x ({:.1} s)",
            naive / ek,
            got.secs
        );
        rows.push((ek, ec));
    }
    (naive, rows)
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

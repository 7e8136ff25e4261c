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
#![cfg(feature = "cuda")]

mod common;
use common::emu::tool_exe;
use common::Rng;
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
    fn new(rng: &mut Rng, dt: Dt, shape: [usize; 4], bhsd: bool, transposed: bool, block_rows: usize, rotate: bool, fill: Fill) -> Self {
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
    let d = l.ops[0].shape[3];
    let mut case = String::new();
    writeln!(case, "dtype {}\nhead_dim {d}\nhadamard_seed {:#x}\nseeds 1 2 3", l.dt.name(), l.seed).unwrap();
    for (i, o) in l.ops.iter().enumerate() {
        let x_path = dir.join(format!("x{i}.bin"));
        let bytes: Vec<u8> = o.bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        std::fs::write(&x_path, bytes).unwrap();
        let [b_n, s_n, h_n, _] = o.shape;
        let (cs, c_bytes) = o.code_strides();
        writeln!(
            case,
            "op {} {} {b_n} {s_n} {h_n} {} {} {} {} {c_bytes} {} {} {} {} {} {} {}",
            x_path.display(),
            o.bits.len(),
            o.x_strides[0],
            o.x_strides[1],
            o.x_strides[2],
            dir.join(format!("codes{i}.bin")).display(),
            cs[0],
            cs[1],
            cs[2],
            cs[3],
            dir.join(format!("scales{i}.bin")).display(),
            o.block_rows,
            o.rotate as u32
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
                return Err(format!("op {i}: scale {k} is {g:e} ({:#x}), oracle {w:e} ({:#x})", g.to_bits(), w.to_bits()));
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
        write!(summary, "op {i}: {} codes, {} scales ({nan} NaN, {sat} saturated, {zero} zero); ", want_codes.len(), scales.len()).unwrap();
    }
    Ok(summary)
}

fn check(launches: &[Launch]) {
    let mut failed = Vec::new();
    for l in launches {
        let t0 = std::time::Instant::now();
        match run(l) {
            Ok(s) => println!("ok    {} ({:.1} s): {s}", l.name, t0.elapsed().as_secs_f64()),
            Err(e) => {
                println!("FAIL  {}: {e}", l.name);
                failed.push(l.name.clone());
            }
        }
    }
    assert!(failed.is_empty(), "{} of {} pre-pass launches differ from the CPU oracle: {failed:#?}", failed.len(), launches.len());
}

/// Q and K in one launch (rotated), as the forward runs them: every dtype and head dim, several
/// Hadamard seeds, block sizes 64 / 128 / one per (batch, head), seqlens that are not block
/// multiples, GQA head counts, strided inputs.
#[test]
fn prepass_qk_bit_identical_to_cpu_oracle() {
    let mut rng = Rng(0x0F8F_8F8F);
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
                launches.push(Launch { name: format!("qk_{}_d{d}_blk{block}_seed{seed:x}", dt.name()), dt, seed, ops: vec![q, k] });
            }
        }
    }
    check(&launches);
}

/// V alone (no rotation), codes written `[b, s, h, d]` and transposed `[b, h, d, s_pad]` (the
/// K-major B operand of the FP8 PV product), and head dims that are not powers of two.
#[test]
fn prepass_v_bit_identical_to_cpu_oracle() {
    let mut rng = Rng(0x000F_8F8F_0000_0001);
    let mut launches = Vec::new();
    for dt in [Dt::Bf16, Dt::F16] {
        for d in [64usize, 128, 256, 96, 40] {
            for transposed in [false, true] {
                let s = if transposed { 143 } else { 77 };
                let v = Operand::new(&mut rng, dt, [2, s, 3, d], transposed, transposed, 64, false, Fill::Outliers);
                launches.push(Launch { name: format!("v_{}_d{d}_t{}", dt.name(), transposed as u8), dt, seed: 0, ops: vec![v] });
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
    let mut rng = Rng(0xED6E);
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
/// e4m3 wrappers of wgmma_fp8_sm90.cuh against host arithmetic under three scheduler seeds; P left
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

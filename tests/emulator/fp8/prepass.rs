//! The pre-pass (`cuda/fp8_prepass.cu`): e4m3 codes and scales bit-identical to the CPU oracle.

use super::*;

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

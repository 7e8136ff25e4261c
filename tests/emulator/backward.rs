//! The FA2 backward kernels (`cuda/fa2_bwd.cu`: preprocess, main, dq conversion, and the sink
//! gradient) in the CPU emulator (cuda/test/emu, docs/emulator.md), against the float64
//! reference gradient. Each case is the crate's own launch sequence
//! (`flash_attn::cuda::fa2_bwd::plan`), run by `cuda/test/emu/fa2_bwd_main.cpp` under three
//! scheduler seeds whose outputs (dq, dk, dv, d_sinks and the f32 scratch) must be
//! bit-identical, with every output NaN-poisoned first and guarded.
//!
//! The rule is FlashAttention's for gradients, as the CPU backward's (tests/cpu/backward_props.rs):
//! per gradient, `max|g − ref| ≤ 2·max|naive − ref| + floor·max(1, max|ref|)`, where `ref` is
//! `reference::attention_backward_f64`, `naive` the straightforward backward in the input dtype
//! (`reference::attention_backward_naive`) and floor the forward's (2e-3 f16, 1.6e-2 bf16). The
//! forward the kernels consume (O in the dtype, the f32 LSE) is `reference::attention_f64`'s.
//! With attention sinks the same rule holds the sink gradient `d_sinks` (the references'), and
//! a case whose sinks are all -inf must get exactly 0 for every head.
//!
//! Only g++ is needed (no nvcc, no GPU): these ran in the emulator; nothing here ran on a GPU.
//! `FLASH_ATTN_EMU=full` runs every head dim in both dtypes and random configurations.
#![cfg(feature = "cuda")]

use crate::support::emu::{matrix_seed, tool_exe_with, Mutation};
use crate::support::{floor_for, randn, Rng};
use flash_attn::cuda::bwd_params::BwdOperands;
use flash_attn::cuda::fa2_bwd::{plan, BwdPlan};
use flash_attn::cuda::fa3_bwd;
use flash_attn::reference::{attention_backward_f64, attention_backward_naive, attention_f64, max_abs_diff};
use flash_attn::{DType, Data, ForwardOptions, Mask, Problem, Tensor};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}

/// Device addresses of the emulated buffers (16-byte aligned, 4 GiB apart).
mod addr {
    pub const Q: u64 = 0x10_0000_0000;
    pub const K: u64 = 0x11_0000_0000;
    pub const V: u64 = 0x12_0000_0000;
    pub const O: u64 = 0x13_0000_0000;
    pub const DO: u64 = 0x14_0000_0000;
    pub const DQ: u64 = 0x15_0000_0000;
    pub const DK: u64 = 0x16_0000_0000;
    pub const DV: u64 = 0x17_0000_0000;
    pub const LSE: u64 = 0x18_0000_0000;
    pub const D_SUM: u64 = 0x19_0000_0000;
    pub const DQ_ACC: u64 = 0x1a_0000_0000;
    pub const ALIBI: u64 = 0x1b_0000_0000;
    pub const SINKS: u64 = 0x1c_0000_0000;
    pub const D_SINKS: u64 = 0x1d_0000_0000;
}

/// Sink logits of `hq` query heads for the backward cases: near the scores, none (-inf), one far
/// above them (P_sink ≈ 1, O ≈ 0), one below; every case with a sink has an informative head.
fn bwd_sinks(hq: usize) -> Vec<f32> {
    (0..hq).map(|h| [0.7, f32::NEG_INFINITY, 100.0, -2.0][h % 4]).collect()
}

#[derive(Clone, Debug)]
struct Case {
    dtype: DType,
    /// `[batch, seqlen, heads, head_dim]` of q and of k.
    q: [usize; 4],
    k: [usize; 4],
    opts: ForwardOptions,
    deterministic: bool,
    /// The main kernel: FA2's (`fa2_bwd_hd<D>`) or the FA3-style one (`fa3_bwd_hd<D>`, sm_90a).
    fa3: bool,
}

impl Case {
    fn new(dtype: DType, q: [usize; 4], k: [usize; 4], opts: ForwardOptions) -> Self {
        Case { dtype, q, k, opts, deterministic: false, fa3: false }
    }
    fn name(&self) -> String {
        format!(
            "{}{:?} q{:?} k{:?} {:?}{}{}{}{}",
            if self.fa3 { "fa3 " } else { "" },
            self.dtype,
            self.q,
            self.k,
            self.opts.mask,
            self.opts.softcap.map_or(String::new(), |c| format!(" softcap{c}")),
            if self.opts.alibi_slopes.is_some() { " alibi" } else { "" },
            if self.deterministic { " deterministic" } else { "" },
            if self.opts.sinks.is_some() { " sinks" } else { "" },
        )
    }
}

fn to_bytes(dt: DType, v: &[f32]) -> Vec<u8> {
    let t = Tensor::from_f32(v, dt, [1, 1, 1, v.len()]).unwrap();
    match t.view().data() {
        Data::F16(s) => s.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        Data::BF16(s) => s.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        _ => unreachable!("16-bit dtypes only"),
    }
}
fn from_bytes(dt: DType, b: &[u8]) -> Vec<f64> {
    b.chunks_exact(2)
        .map(|c| {
            let bits = u16::from_le_bytes([c[0], c[1]]);
            match dt {
                DType::BF16 => half::bf16::from_bits(bits).to_f64(),
                _ => half::f16::from_bits(bits).to_f64(),
            }
        })
        .collect()
}
fn contiguous(s: [usize; 4]) -> [usize; 3] {
    [s[1] * s[2] * s[3], s[2] * s[3], s[3]]
}

/// The outcome of one case: the largest error over its bound among dq, dk, dv.
type Outcome = Result<f64, String>;

/// Runs `c` in the emulator (built with `mutation` if any) and checks it.
fn run_case(c: &Case, mutation: Option<&Mutation>) -> Outcome {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(&c.name(), &mut h);
    let seed = std::hash::Hasher::finish(&h);
    let mut rng = Rng::new(seed | 1);
    let (q, k, v, d_o) = (randn(&mut rng, c.dtype, c.q), randn(&mut rng, c.dtype, c.k), randn(&mut rng, c.dtype, c.k), randn(&mut rng, c.dtype, c.q));
    let p = Problem::new(&q.view(), &k.view(), &v.view(), &c.opts).map_err(|e| format!("problem: {e}"))?;
    // The forward the backward consumes: O in the dtype, LSE in f32, both from float64.
    let fwd = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
    let o: Vec<f32> = fwd.o.iter().map(|&x| x as f32).collect();
    let lse: Vec<f32> = fwd.lse.iter().map(|&x| x as f32).collect();
    let (qs, ks) = (contiguous(c.q), contiguous(c.k));
    let ops = BwdOperands {
        ptrs: [addr::Q, addr::K, addr::V, addr::O, addr::DO, addr::DQ, addr::DK, addr::DV],
        strides: [qs, ks, ks, qs, qs, qs, ks, ks],
        lse: addr::LSE,
        d_sum: addr::D_SUM,
        dq_accum: addr::DQ_ACC,
        alibi: if c.opts.alibi_slopes.is_some() { addr::ALIBI } else { 0 },
        // Given sinks (even all -inf, no sink for the problem) the sink launch runs.
        sinks: if p.sinks.is_some() { addr::SINKS } else { 0 },
        d_sinks: if c.opts.sinks.is_some() { addr::D_SINKS } else { 0 },
    };
    // The engine's plans: FA2's, or the FA3-style one (FA2's preprocess and conversion around
    // the sm_90a main kernel; the emulator encodes the main kernel's tensor maps itself).
    let pl: BwdPlan = if c.fa3 {
        fa3_bwd::plan(&p, &ops, c.deterministic).map_err(|e| format!("fa3 plan: {e}"))?.bwd
    } else {
        plan(&p, &ops, c.deterministic).map_err(|e| format!("plan: {e}"))?
    };
    let exe = tool_exe_with(if c.fa3 { "fa3_bwd_main.cpp" } else { "fa2_bwd_main.cpp" }, mutation)?;

    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("emu_backward")
        .join(format!("{seed:016x}{}", mutation.map_or("", |m| m.name)));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |n: &str| dir.join(n).display().to_string();
    let mut lf = String::new();
    writeln!(lf, "seeds 1 2 3").unwrap();
    let hex: String = pl.params.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    writeln!(lf, "params {hex}").unwrap();
    for l in &pl.launches {
        writeln!(lf, "launch {} {} {} {} {} {}", l.kernel, l.grid.0, l.grid.1, l.grid.2, l.block.0, l.smem_bytes).unwrap();
    }
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut inputs: Vec<(&str, u64, Vec<u8>)> = vec![
        ("q", addr::Q, to_bytes(c.dtype, &q.to_f32_vec())),
        ("k", addr::K, to_bytes(c.dtype, &k.to_f32_vec())),
        ("v", addr::V, to_bytes(c.dtype, &v.to_f32_vec())),
        ("o", addr::O, to_bytes(c.dtype, &o)),
        ("do", addr::DO, to_bytes(c.dtype, &d_o.to_f32_vec())),
        ("lse", addr::LSE, f32_bytes(&lse)),
    ];
    if let Some(s) = &c.opts.alibi_slopes {
        inputs.push(("alibi", addr::ALIBI, f32_bytes(s)));
    }
    if let Some(s) = &p.sinks {
        inputs.push(("sinks", addr::SINKS, f32_bytes(s)));
    }
    for (name, a, bytes) in &inputs {
        std::fs::write(file(name), bytes).unwrap();
        writeln!(lf, "in {name} {a:#x} {} {}", bytes.len(), file(name)).unwrap();
    }
    let (nq, nk) = (c.q.iter().product::<usize>(), c.k.iter().product::<usize>());
    let mut outputs = vec![
        ("dq", addr::DQ, nq * 2),
        ("dk", addr::DK, nk * 2),
        ("dv", addr::DV, nk * 2),
        ("d_sum", addr::D_SUM, pl.d_sum_floats * 4),
        ("dq_accum", addr::DQ_ACC, pl.dq_accum_floats * 4),
    ];
    if ops.d_sinks != 0 {
        outputs.push(("d_sinks", addr::D_SINKS, p.heads_q * 4));
    }
    for (name, a, bytes) in outputs {
        writeln!(lf, "out {name} {a:#x} {bytes} {}", file(name)).unwrap();
    }
    std::fs::write(file("launch"), &lf).unwrap();
    let out = Command::new(&exe).arg(file("launch")).output().map_err(|e| format!("run {}: {e}", exe.display()))?;
    let log = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("emulator exit {:?}:\n{log}", out.status.code()));
    }
    let read = |n: &str| from_bytes(c.dtype, &std::fs::read(file(n)).unwrap());
    let (dq, dk, dv) = (read("dq"), read("dk"), read("dv"));
    let (qv, kv, vv, dov) = (q.view(), k.view(), v.view(), d_o.view());
    let reference = attention_backward_f64(&p, &qv, &kv, &vv, &dov).unwrap();
    let naive = attention_backward_naive(&p, &qv, &kv, &vv, &dov, c.dtype).unwrap();
    let mut worst = 0.0f64;
    for (name, g, r, n) in [
        ("dq", &dq, &reference.dq, &naive.dq),
        ("dk", &dk, &reference.dk, &naive.dk),
        ("dv", &dv, &reference.dv, &naive.dv),
    ] {
        let err = max_abs_diff(g, r);
        // The floor at the gradient's own scale (tests/cpu/backward_props.rs states the same rule).
        let scale = r.iter().fold(1.0f64, |m, x| m.max(x.abs()));
        let bound = 2.0 * max_abs_diff(n, r) + floor_for(c.dtype) * scale;
        if err > bound {
            let at = g.iter().zip(r.iter()).enumerate().max_by(|a, b| {
                let e = |x: &(usize, (&f64, &f64))| if x.1 .0.is_nan() { f64::INFINITY } else { (x.1 .0 - x.1 .1).abs() };
                e(a).total_cmp(&e(b))
            });
            return Err(format!("max |{name} - ref| {err:.3e} > bound {bound:.3e} (worst at {at:?})\n{log}"));
        }
        worst = worst.max(err / bound);
    }
    if ops.d_sinks != 0 {
        let got: Vec<f64> = std::fs::read(file("d_sinks"))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
            .collect();
        match (&reference.d_sinks, &naive.d_sinks) {
            (Some(r), Some(n)) => {
                let err = max_abs_diff(&got, r);
                let scale = r.iter().fold(1.0f64, |m, x| m.max(x.abs()));
                let bound = 2.0 * max_abs_diff(n, r) + floor_for(c.dtype) * scale;
                if err > bound {
                    return Err(format!("max |d_sinks - ref| {err:.3e} > bound {bound:.3e} (got {got:?}, ref {r:?})\n{log}"));
                }
                worst = worst.max(err / bound);
            }
            // Every sink -inf: no sink, and every head's gradient is exactly 0.
            _ if got.iter().all(|&x| x == 0.0) => {}
            _ => return Err(format!("no sink, but d_sinks = {got:?}\n{log}")),
        }
    }
    Ok(worst)
}

fn run_all(cases: &[Case]) {
    let mut failed = Vec::new();
    for c in cases {
        let t0 = std::time::Instant::now();
        match run_case(c, None) {
            Ok(r) => println!("ok   {} err/bound {r:.3} ({:.1} s)", c.name(), t0.elapsed().as_secs_f64()),
            Err(e) => {
                println!("FAIL {}: {e}", c.name());
                failed.push(c.name());
            }
        }
    }
    assert!(failed.is_empty(), "{} of {} cases failed: {failed:?}", failed.len(), cases.len());
}

/// The CI subset: head dims 64 and 128 in both dtypes, causal and not, GQA, odd lengths,
/// seqlen_q > seqlen_k (rows that see no key), a window with softcap and ALiBi, key blocks no
/// row sees, and the deterministic mode. `FLASH_ATTN_EMU=full` adds every head dim and random configurations.
fn cases() -> Vec<Case> {
    let o = ForwardOptions::default;
    let mut v = vec![
        Case::new(DType::F16, [1, 100, 2, 64], [1, 100, 2, 64], o()),
        Case::new(DType::BF16, [1, 70, 4, 128], [1, 130, 2, 128], o().causal(true)),
        Case::new(DType::F16, [2, 130, 3, 64], [2, 67, 1, 64], o().causal(true)),
        Case::new(DType::BF16, [1, 97, 2, 64], [1, 97, 2, 64], o().mask(Mask::window(20, 5)).softcap(5.0).alibi_slopes(vec![0.25f32, 0.5])),
        Case { deterministic: true, ..Case::new(DType::F16, [1, 90, 4, 128], [1, 150, 2, 128], o().causal(true)) },
        // Keys 0-159 are seen by no row: those key blocks load nothing and write dK = dV = 0.
        Case::new(DType::F16, [1, 10, 2, 64], [1, 200, 2, 64], o().mask(Mask::causal_window(30))),
        // Attention sinks: rows that see no key (LSE = the sink), GQA, batch 2; with softcap,
        // ALiBi, a window and the deterministic dq; a list of only -inf (no sink: d_sinks 0).
        Case::new(DType::F16, [2, 130, 4, 64], [2, 67, 2, 64], o().causal(true).sinks(bwd_sinks(4))),
        Case {
            deterministic: true,
            ..Case::new(
                DType::BF16,
                [1, 97, 4, 128],
                [1, 150, 2, 128],
                o().mask(Mask::window(20, 5)).softcap(5.0).alibi_slopes(vec![0.25f32, 0.5, 0.125, 1.0]).sinks(bwd_sinks(4)),
            )
        },
        Case::new(DType::BF16, [1, 40, 2, 64], [1, 40, 2, 64], o().sinks(vec![f32::NEG_INFINITY; 2])),
    ];
    if full() {
        let mut rng = Rng::new(matrix_seed("fa2 backward full matrix", 0xfa2b_ad00));
        for &d in &[32usize, 64, 96, 128, 192, 256] {
            for dt in [DType::F16, DType::BF16] {
                let pick = |rng: &mut Rng, n: u64| (rng.next_u64() % n) as usize;
                let hk = 1 + pick(&mut rng, 2);
                let hq = hk * (1 + pick(&mut rng, 3));
                let (sq, sk) = (1 + pick(&mut rng, 200), 1 + pick(&mut rng, 200));
                let mut opts = match pick(&mut rng, 4) {
                    0 => o(),
                    1 => o().causal(true),
                    2 => o().mask(Mask::window(pick(&mut rng, 60) as i64, pick(&mut rng, 20) as i64)),
                    _ => o().mask(Mask::causal_window(pick(&mut rng, 60) as i64)),
                };
                if pick(&mut rng, 3) == 0 {
                    opts = opts.softcap(2.0 + pick(&mut rng, 30) as f32);
                }
                if pick(&mut rng, 3) == 0 {
                    opts = opts.alibi_slopes((0..hq).map(|i| 0.1 * (i + 1) as f32).collect::<Vec<_>>());
                }
                let b = 1 + pick(&mut rng, 2);
                let deterministic = pick(&mut rng, 2) == 0;
                v.push(Case { deterministic, ..Case::new(dt, [b, sq, hq, d], [b, sk, hk, d], opts) });
            }
        }
        v.extend(random_sink_cases("fa2 backward sinks full matrix", 0xfa2b_5100, &[32, 64, 128, 256], 200));
    }
    v
}

/// Random cases with attention sinks (the full matrix): per head dim and dtype one random
/// shape, mask and dq mode, from their own seed (the other random cases stay as they are).
fn random_sink_cases(what: &str, fixed: u64, dims: &[usize], max_len: u64) -> Vec<Case> {
    let o = ForwardOptions::default;
    let mut rng = Rng::new(matrix_seed(what, fixed));
    let mut v = Vec::new();
    for &d in dims {
        for dt in [DType::F16, DType::BF16] {
            let pick = |rng: &mut Rng, n: u64| (rng.next_u64() % n) as usize;
            let hk = 1 + pick(&mut rng, 2);
            let hq = hk * (1 + pick(&mut rng, 3));
            let (sq, sk) = (1 + pick(&mut rng, max_len), 1 + pick(&mut rng, max_len));
            let opts = match pick(&mut rng, 3) {
                0 => o(),
                1 => o().causal(true),
                _ => o().mask(Mask::window(pick(&mut rng, 60) as i64, pick(&mut rng, 20) as i64)),
            };
            let b = 1 + pick(&mut rng, 2);
            let deterministic = pick(&mut rng, 2) == 0;
            v.push(Case { deterministic, ..Case::new(dt, [b, sq, hq, d], [b, sk, hk, d], opts.sinks(bwd_sinks(hq))) });
        }
    }
    v
}

/// The standalone row's `cpu_emulation` (build/instances.rs "fa2_bwd").
#[test]
fn fa2_backward_matches_f64_reference() {
    run_all(&cases());
}

/// Mutations the checks must catch: without the barrier between the dS stores and the
/// dQ = dS K mma, warps read dS tiles other warps have not written (the poisoned or the previous
/// block's); without D in dS = P o (dP - D), every gradient but dV is wrong.
#[test]
fn fa2_backward_mutations_are_caught() {
    let mutations = [
        Mutation {
            name: "fa2bwd-no-ds-barrier",
            file: "cuda/fa2/bwd_mainloop.cuh",
            from: "__syncthreads();  // dS complete for every warp",
            to: "// (barrier removed)",
            defines: &[],
        },
        Mutation {
            name: "fa2bwd-no-d",
            file: "cuda/fa2/bwd_mainloop.cuh",
            from: "(acc_dp[t][i] - sD[r])",
            to: "(acc_dp[t][i])",
            defines: &[],
        },
    ];
    let c = Case::new(DType::F16, [1, 130, 2, 64], [1, 100, 2, 64], ForwardOptions::default());
    for m in &mutations {
        match run_case(&c, Some(m)) {
            Ok(r) => panic!("the mutation {} was not caught (err/bound {r:.3})", m.name),
            Err(e) => println!("{} caught: {}", m.name, e.lines().find(|l| l.contains("EMU ERROR") || l.contains("max |")).unwrap_or(&e)),
        }
    }
}

/// Mutations the sink gradient's check must catch: the sum of warp 0 alone (the other warps'
/// rows dropped from the fixed-order reduction), and P_sink without the LSE.
#[test]
fn fa2_backward_sink_mutations_are_caught() {
    let mutations = [
        Mutation {
            name: "fa2bwd-sink-one-warp",
            file: "cuda/fa2/bwd_sink_grad.cuh",
            from: "for (int w = 0; w < kBwdSinkWarps; ++w)",
            to: "for (int w = 0; w < 1; ++w)",
            defines: &[],
        },
        Mutation {
            name: "fa2bwd-sink-no-lse",
            file: "cuda/fa2/bwd_sink_grad.cuh",
            from: "expf(sink - lse[base + r])",
            to: "expf(sink)",
            defines: &[],
        },
    ];
    let c = Case::new(DType::F16, [1, 160, 2, 64], [1, 100, 1, 64], ForwardOptions::default().sinks(vec![0.7f32, -2.0]));
    run_case(&c, None).unwrap_or_else(|e| panic!("fails unmutated: {e}"));
    for m in &mutations {
        match run_case(&c, Some(m)) {
            Ok(r) => panic!("the mutation {} was not caught (err/bound {r:.3})", m.name),
            Err(e) => {
                assert!(e.contains("d_sinks"), "{}: unexpected diagnosis {e}", m.name);
                println!("{} caught: {}", m.name, e.lines().next().unwrap_or(&e));
            }
        }
    }
}

/// The FA3-style main kernel (cuda/fa3_bwd_sm90.cu, sm_90a: TMA, mbarrier ring, wgmma, warp
/// specialised) between FA2's preprocess and conversion: head dims 64 and 128 in both dtypes,
/// causal and not, GQA, odd lengths, rows that see no key, key blocks no row sees, and the
/// deterministic mode. `FLASH_ATTN_EMU=full` adds random configurations.
fn fa3_cases() -> Vec<Case> {
    let o = ForwardOptions::default;
    let fa3 = |c: Case| Case { fa3: true, ..c };
    let mut v = vec![
        fa3(Case::new(DType::F16, [1, 100, 2, 64], [1, 100, 2, 64], o())),
        fa3(Case::new(DType::BF16, [2, 130, 3, 64], [2, 67, 1, 64], o().causal(true))),
        fa3(Case::new(DType::BF16, [1, 70, 4, 128], [1, 200, 2, 128], o().causal(true))),
        fa3(Case { deterministic: true, ..Case::new(DType::F16, [1, 90, 4, 128], [1, 150, 2, 128], o().causal(true)) }),
        fa3(Case::new(DType::F16, [1, 10, 2, 64], [1, 300, 2, 64], o().mask(Mask::causal_window(30)))),
        // Attention sinks (FA2's sink launch after this main kernel): rows that see no key, GQA;
        // the deterministic dq.
        fa3(Case::new(DType::BF16, [2, 130, 4, 64], [2, 67, 2, 64], o().causal(true).sinks(bwd_sinks(4)))),
        fa3(Case { deterministic: true, ..Case::new(DType::F16, [1, 90, 4, 128], [1, 150, 1, 128], o().sinks(bwd_sinks(4))) }),
    ];
    if full() {
        let mut rng = Rng::new(matrix_seed("fa3 backward full matrix", 0xfa3b_ad00));
        for &d in &[64usize, 128] {
            for dt in [DType::F16, DType::BF16] {
                for _ in 0..2 {
                    let pick = |rng: &mut Rng, n: u64| (rng.next_u64() % n) as usize;
                    let hk = 1 + pick(&mut rng, 2);
                    let hq = hk * (1 + pick(&mut rng, 3));
                    let (sq, sk) = (1 + pick(&mut rng, 300), 1 + pick(&mut rng, 300));
                    let opts = match pick(&mut rng, 4) {
                        0 => o(),
                        1 => o().causal(true),
                        2 => o().mask(Mask::window(pick(&mut rng, 60) as i64, pick(&mut rng, 20) as i64)),
                        _ => o().mask(Mask::causal_window(pick(&mut rng, 60) as i64)),
                    };
                    let b = 1 + pick(&mut rng, 2);
                    let deterministic = pick(&mut rng, 2) == 0;
                    v.push(fa3(Case { deterministic, ..Case::new(dt, [b, sq, hq, d], [b, sk, hk, d], opts) }));
                }
            }
        }
        v.extend(random_sink_cases("fa3 backward sinks full matrix", 0xfa3b_5100, &[64, 128], 300).into_iter().map(fa3));
    }
    v
}

/// The standalone row's `cpu_emulation` (build/instances.rs "fa3_bwd").
#[test]
fn fa3_backward_matches_f64_reference() {
    run_all(&fa3_cases());
}

/// Mutations the checks must catch in the FA3-style kernel: a consumer that reads the Q / dO slot
/// without waiting for its mbarrier (the emulator's happens-before check), and dS without D.
#[test]
fn fa3_backward_mutations_are_caught() {
    let mutations = [
        Mutation {
            name: "fa3bwd-no-q-wait",
            file: "cuda/fa3/bwd_mainloop.cuh",
            from: "mbar_wait(&bars.q_full[slot], (it / S) & 1);",
            to: "// (q_full wait removed)",
            defines: &[],
        },
        Mutation {
            name: "fa3bwd-no-d",
            file: "cuda/fa3/bwd_mainloop.cuh",
            from: "pr * (dp[i] - dsum)",
            to: "pr * dp[i]",
            defines: &[],
        },
    ];
    let c = Case { fa3: true, deterministic: true, ..Case::new(DType::F16, [1, 200, 2, 64], [1, 100, 2, 64], ForwardOptions::default()) };
    for m in &mutations {
        match run_case(&c, Some(m)) {
            Ok(r) => panic!("the mutation {} was not caught (err/bound {r:.3})", m.name),
            Err(e) => println!("{} caught: {}", m.name, e.lines().find(|l| l.contains("EMU ERROR") || l.contains("max |")).unwrap_or(&e)),
        }
    }
}

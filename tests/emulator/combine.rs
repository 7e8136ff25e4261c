//! The combine kernel (`cuda/combine.cu`: split-KV's second pass and the device
//! `merge_states`) in the CPU emulator (cuda/test/emu, docs/emulator.md), against the host
//! `serving::merge_states_n` (f64) on random states: rows with some or every state at LSE −inf
//! (their o is NaN: it must not be read), NaN LSEs, NaN in an o, +inf LSEs, huge LSE
//! differences and huge LSE magnitudes; 1, 2, 3, 8, 64 (list) and 128 (stacked) states; f32,
//! f16 and bf16 outputs; dense, packed (batch 1, [heads, total_q] LSE), strided inputs and
//! outputs. Each launch is the crate's own plan (`cuda::combine::{merge_plan, splits_plan}`), run
//! under three scheduler seeds whose outputs must be bit-identical.
//!
//! The device accumulates in f32; per row the bound is |Δo| ≤ (2n + 10)·2⁻²⁴·max_i|o_i| (plus one
//! ulp of a 16-bit output) and |ΔLSE| ≤ (n + 28)·2⁻²⁴ + 2⁻²³·|LSE| (docs/serving.md); special rows
//! (NaN, no key) must match exactly.
//!
//! Only g++ is needed (no nvcc, no GPU): these ran in the emulator; nothing here ran on a GPU.
//! `FLASH_ATTN_EMU=full` adds 40 random configurations.
use crate::support::emu::{tool_exe_with, Mutation};
use crate::support::Rng;
use flash_attn::cuda::combine::{lse_strides, merge_plan, splits_plan, CombineLaunch, Rows, StateRows, MAX_INPUTS};
use flash_attn::serving::merge_states_n;
use flash_attn::{DType, Error, TensorView};
use half::{bf16, f16};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

fn work_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("combine_emu").join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}

/// Values stored in a dtype, as little-endian bytes, and read back.
fn to_bytes(dt: DType, v: &[f32]) -> Vec<u8> {
    match dt {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
        other => panic!("no combine dtype {other:?}"),
    }
}
fn from_bytes(dt: DType, b: &[u8]) -> Vec<f32> {
    match dt {
        DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        DType::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
        DType::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
        other => panic!("no combine dtype {other:?}"),
    }
}
/// The value rounded to `dt` (what the host stores).
fn round(dt: DType, x: f32) -> f32 {
    from_bytes(dt, &to_bytes(dt, &[x]))[0]
}
/// The spacing of `dt` at |x| (for f32: 0, the bound covers it).
fn ulp(dt: DType, x: f32) -> f64 {
    let e = (x.abs().max(f32::MIN_POSITIVE) as f64).log2().floor();
    match dt {
        DType::F32 => 0.0,
        DType::F16 => 2f64.powf(e.max(-14.0) - 10.0),
        DType::BF16 => 2f64.powf(e - 7.0),
        other => panic!("no combine dtype {other:?}"),
    }
}

/// How the states of one row are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
enum RowKind {
    /// LSEs N(0, 2²).
    Normal,
    /// Each state −inf with probability 1/2 (its o NaN: never read).
    SomeEmpty,
    /// Every state −inf: o = 0, LSE −inf.
    AllEmpty,
    /// One LSE NaN: the row is NaN.
    NanLse,
    /// One finite-weight o element NaN: that column is NaN.
    NanO,
    /// One LSE +inf (an overflowed input): the row is NaN, as on the host.
    InfLse,
    /// LSEs spread over ±1e4: one state takes (almost) all the weight.
    HugeDiff,
    /// LSEs 3e4 + N(0, 1): large magnitudes, small differences.
    HugeMagnitude,
}

const KINDS: [RowKind; 8] = [
    RowKind::Normal,
    RowKind::SomeEmpty,
    RowKind::AllEmpty,
    RowKind::NanLse,
    RowKind::NanO,
    RowKind::InfLse,
    RowKind::HugeDiff,
    RowKind::HugeMagnitude,
];

/// The layout of the states.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Form {
    /// `merge_states_n`: one buffer per state; `strided` alternates [b, h, s, d] storage and
    /// padded rows between states, and pads the output's rows.
    List { strided: bool },
    /// Split-KV: `o_accum [n, b, h, s, d]`, `lse_accum [n, b, h, s]` (f32), output contiguous.
    Splits,
}

#[derive(Clone, Debug)]
struct Case {
    name: String,
    n: usize,
    /// `[batch, seqlen, heads, head_dim]` of the output (packed: batch 1, seqlen total_q).
    shape: [usize; 4],
    input: DType,
    output: DType,
    form: Form,
    seed: u64,
}

/// One state's o (values in f32, stored in the input dtype) with element strides, and its LSE
/// `[b, h, s]`.
struct State {
    strides: [usize; 3],
    o: Vec<f32>,
    lse: Vec<f32>,
}

fn strides_for(shape: [usize; 4], style: usize) -> ([usize; 3], usize) {
    let [b, s, h, d] = shape;
    let st = match style % 3 {
        0 => [s * h * d, h * d, d],
        1 => [h * s * d, d, s * d], // [b, h, s, d] storage (the split-KV partials' layout)
        _ => [s * h * (d + 5), h * (d + 5), d + 5], // padded rows
    };
    let len = (b - 1) * st[0] + (s - 1) * st[1] + (h - 1) * st[2] + d;
    (st, len)
}

/// Draws the states and each row's kind.
fn draw(c: &Case) -> (Vec<State>, Vec<RowKind>) {
    let mut rng = Rng::new(c.seed);
    let [b, s, h, d] = c.shape;
    let rows = b * s * h;
    let styles: Vec<usize> = (0..c.n)
        .map(|i| match c.form {
            Form::List { strided: true } => i,
            Form::List { strided: false } => 0,
            Form::Splits => 1,
        })
        .collect();
    let mut states: Vec<State> = styles
        .iter()
        .map(|&st| {
            let (strides, len) = strides_for(c.shape, st);
            // Padding the kernel must never read into a result.
            State { strides, o: vec![f32::NAN; len], lse: vec![0.0; rows] }
        })
        .collect();
    // Every kind appears in the first rows, then random kinds (mostly Normal).
    let kinds: Vec<RowKind> = (0..rows)
        .map(|r| {
            if r < KINDS.len() && rows >= 2 * KINDS.len() {
                KINDS[(r + c.seed as usize) % KINDS.len()]
            } else if rng.uniform() < 0.5 {
                RowKind::Normal
            } else {
                KINDS[(rng.next_u64() % KINDS.len() as u64) as usize]
            }
        })
        .collect();
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let row = (bi * s + si) * h + hi;
                let li = (bi * h + hi) * s + si;
                let kind = kinds[row];
                let special = (rng.next_u64() % c.n as u64) as usize;
                for (i, st) in states.iter_mut().enumerate() {
                    let mut l = match kind {
                        RowKind::HugeDiff => (rng.uniform() as f32 * 2.0 - 1.0) * 1e4,
                        RowKind::HugeMagnitude => 3e4 + rng.normal() as f32,
                        _ => 2.0 * rng.normal() as f32,
                    };
                    let empty = match kind {
                        RowKind::AllEmpty => true,
                        RowKind::SomeEmpty => rng.uniform() < 0.5,
                        _ => false,
                    };
                    if empty {
                        l = f32::NEG_INFINITY;
                    }
                    if i == special {
                        match kind {
                            RowKind::NanLse => l = f32::NAN,
                            RowKind::InfLse => l = f32::INFINITY,
                            _ => {}
                        }
                    }
                    st.lse[li] = l;
                    let at = bi * st.strides[0] + si * st.strides[1] + hi * st.strides[2];
                    for j in 0..d {
                        st.o[at + j] = if empty { f32::NAN } else { round(c.input, rng.normal() as f32) };
                    }
                    if kind == RowKind::NanO && i == special {
                        st.o[at + d / 2] = f32::NAN;
                    }
                }
            }
        }
    }
    (states, kinds)
}

/// The per-row bounds of the f32 device merge against the f64 host (module docs).
fn o_bound(n: usize, max_o: f64) -> f64 {
    (2 * n + 10) as f64 * 2f64.powi(-24) * max_o
}
fn lse_bound(n: usize, lse: f64) -> f64 {
    (n + 28) as f64 * 2f64.powi(-24) + 2f64.powi(-23) * lse.abs()
}

/// Runs one case in the emulator and compares it with the host merge. Returns a summary: the
/// largest error as a fraction of its bound.
fn run(c: &Case) -> Result<String, String> {
    run_with(c, None)
}

/// [`run`] on a mutated copy of the kernel source.
fn run_with(c: &Case, mutation: Option<&Mutation>) -> Result<String, String> {
    let exe = tool_exe_with("combine_main.cpp", mutation)?;
    let dir = work_dir(&c.name);
    let (states, kinds) = draw(c);
    let [b, s, h, d] = c.shape;
    let rows = b * s * h;
    let out_style = if c.form == (Form::List { strided: true }) { 2 } else { 0 };
    let (out_strides, out_len) = strides_for(c.shape, out_style);
    let (o_base, lse_base, out_base, out_lse_base) =
        (0x1000_0000u64, 0x8000_0000u64, 0x10_0000_0000u64, 0x20_0000_0000u64);
    let out = Rows { ptr: out_base, strides: out_strides };
    let mut buffers: Vec<(String, u64, Vec<u8>)> = Vec::new();
    let plan: CombineLaunch = match c.form {
        Form::List { .. } => {
            let mut list = Vec::new();
            for (i, st) in states.iter().enumerate() {
                let (o, l) = (o_base + 0x100_0000 * i as u64, lse_base + 0x10_0000 * i as u64);
                buffers.push((format!("o{i}"), o, to_bytes(c.input, &st.o)));
                buffers.push((format!("lse{i}"), l, to_bytes(DType::F32, &st.lse)));
                list.push(StateRows { o: Rows { ptr: o, strides: st.strides }, lse: l });
            }
            merge_plan(c.shape, c.input, c.output, &list, out, out_lse_base).map_err(|e| e.to_string())?
        }
        Form::Splits => {
            let o: Vec<f32> = states.iter().flat_map(|st| st.o.iter().copied()).collect();
            let l: Vec<f32> = states.iter().flat_map(|st| st.lse.iter().copied()).collect();
            buffers.push(("o_accum".into(), o_base, to_bytes(DType::F32, &o)));
            buffers.push(("lse_accum".into(), lse_base, to_bytes(DType::F32, &l)));
            splits_plan(c.shape, c.n, o_base, lse_base, c.output, out, out_lse_base, 0).map_err(|e| e.to_string())?
        }
    };
    let hex: String = plan.params.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let mut file =
        format!("kernel {}\ngrid {}\nblock {}\nseeds 1 2 3\nparams {hex}\n", plan.kernel, plan.grid, plan.block);
    for (name, addr, bytes) in &buffers {
        let path = dir.join(format!("{name}.bin"));
        std::fs::write(&path, bytes).unwrap();
        writeln!(file, "in {name} {addr:#x} {} {}", bytes.len(), path.display()).unwrap();
    }
    let (o_path, l_path) = (dir.join("out_o.bin"), dir.join("out_lse.bin"));
    writeln!(file, "out out_o {out_base:#x} {} {}", out_len * c.output.size(), o_path.display()).unwrap();
    writeln!(file, "out out_lse {out_lse_base:#x} {} {}", rows * 4, l_path.display()).unwrap();
    let case_path = dir.join("case.txt");
    std::fs::write(&case_path, &file).unwrap();
    let res = Command::new(&exe).arg(&case_path).output().map_err(|e| e.to_string())?;
    if !res.status.success() {
        return Err(format!(
            "emulator run failed ({}):\n{}{}",
            res.status,
            String::from_utf8_lossy(&res.stdout),
            String::from_utf8_lossy(&res.stderr)
        ));
    }
    let got_o = from_bytes(c.output, &std::fs::read(&o_path).unwrap());
    let got_lse = from_bytes(DType::F32, &std::fs::read(&l_path).unwrap());

    // The host merge of the same states (in the states' dtype; split partials are f32).
    let bits: Vec<Vec<u8>> = states.iter().map(|st| to_bytes(c.input, &st.o)).collect();
    let halves: Vec<Vec<f16>> =
        bits.iter().map(|b| b.chunks_exact(2).map(|c| f16::from_le_bytes(c.try_into().unwrap())).collect()).collect();
    let bhalves: Vec<Vec<bf16>> =
        bits.iter().map(|b| b.chunks_exact(2).map(|c| bf16::from_le_bytes(c.try_into().unwrap())).collect()).collect();
    let views: Vec<(TensorView, &[f32])> = states
        .iter()
        .enumerate()
        .map(|(i, st)| {
            let v = match c.input {
                DType::F32 => TensorView::with_strides(&st.o, c.shape, st.strides),
                DType::F16 => TensorView::with_strides(&halves[i], c.shape, st.strides),
                DType::BF16 => TensorView::with_strides(&bhalves[i], c.shape, st.strides),
                other => panic!("no combine dtype {other:?}"),
            };
            (v, st.lse.as_slice())
        })
        .collect();
    let want = merge_states_n(&views).map_err(|e| e.to_string())?;
    let want_o = want.o.to_f32_vec();

    let mut worst = (0.0f64, String::new());
    let mut counts = [0usize; KINDS.len()];
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let row = (bi * s + si) * h + hi;
                let li = (bi * h + hi) * s + si;
                counts[KINDS.iter().position(|k| *k == kinds[row]).unwrap()] += 1;
                let where_ = || format!("row (b {bi}, s {si}, h {hi}) {:?}", kinds[row]);
                let (gl, wl) = (got_lse[li], want.lse[li]);
                let lse_ok = if wl.is_nan() {
                    gl.is_nan()
                } else if wl.is_infinite() {
                    gl == wl
                } else {
                    let e = (gl as f64 - wl as f64).abs();
                    let bound = lse_bound(c.n, wl as f64);
                    if e / bound > worst.0 {
                        worst = (e / bound, format!("lse of {}", where_()));
                    }
                    e <= bound
                };
                if !lse_ok {
                    return Err(format!("{}: lse {gl:e}, host {wl:e}", where_()));
                }
                // max |o_i| over the states that weigh something (the weights sum to 1).
                let mut max_o = 0.0f64;
                for st in &states {
                    if st.lse[li] != f32::NEG_INFINITY {
                        let at = bi * st.strides[0] + si * st.strides[1] + hi * st.strides[2];
                        for j in 0..d {
                            max_o = max_o.max((st.o[at + j] as f64).abs());
                        }
                    }
                }
                for j in 0..d {
                    let g = got_o[bi * out_strides[0] + si * out_strides[1] + hi * out_strides[2] + j];
                    let w = want_o[((bi * s + si) * h + hi) * d + j];
                    let ok = if w.is_nan() {
                        g.is_nan()
                    } else if wl == f32::NEG_INFINITY {
                        g == 0.0
                    } else {
                        let bound = o_bound(c.n, max_o) + ulp(c.output, w) + ulp(c.input, w);
                        let e = (round(c.output, g) as f64 - round(c.output, w) as f64).abs();
                        if bound > 0.0 && e / bound > worst.0 {
                            worst = (e / bound, format!("o[{j}] of {}", where_()));
                        }
                        e <= bound
                    };
                    if !ok {
                        return Err(format!("{}: o[{j}] = {g:e}, host {w:e} (max |o_i| {max_o:e})", where_()));
                    }
                }
            }
        }
    }
    let kinds_seen: Vec<String> =
        KINDS.iter().zip(counts).filter(|(_, n)| *n > 0).map(|(k, n)| format!("{k:?} {n}")).collect();
    let worst = if worst.0 == 0.0 {
        "every value exact".to_string()
    } else {
        format!("worst {:.3} of the bound ({})", worst.0, worst.1)
    };
    Ok(format!("{rows} rows [{}]; {worst}", kinds_seen.join(", ")))
}

fn check(cases: &[Case]) {
    crate::support::check_each("combine launches (against the host merge)", cases, |c| c.name.clone(), run);
}

fn case(n: usize, shape: [usize; 4], input: DType, output: DType, form: Form, seed: u64) -> Case {
    let tag = match form {
        Form::List { strided: false } => "list",
        Form::List { strided: true } => "list_strided",
        Form::Splits => "splits",
    };
    let packed = if shape[0] == 1 && shape[1] > 1 { "_packed" } else { "" };
    let name =
        format!("{tag}{packed}_n{n}_{input:?}_to_{output:?}_{}x{}x{}x{}", shape[0], shape[1], shape[2], shape[3])
            .to_lowercase();
    Case { name, n, shape, input, output, form, seed }
}

/// Every state count, dtype pair and layout: the list form (merge_states_n: f32, f16, bf16
/// states into their own dtype; contiguous and strided) for 1, 2, 3, 8 and 64 states, the split
/// form (f32 partials into f32, f16, bf16) for 1, 2, 3, 8 and 128 splits, over dense, packed and
/// decode shapes with head dims 1 to 512.
#[test]
fn combine_matches_host_merge() {
    let shapes =
        [[2, 3, 4, 64], [1, 7, 3, 128], [1, 1, 8, 256], [3, 2, 2, 40], [2, 5, 2, 255], [1, 20, 1, 1], [1, 2, 2, 512]];
    let mut cases = Vec::new();
    let mut k = 0;
    for n in [1, 2, 3, 8, 64, 128] {
        for (input, output) in [(DType::F32, DType::F32), (DType::F16, DType::F16), (DType::BF16, DType::BF16)] {
            if n <= MAX_INPUTS {
                let form = Form::List { strided: k % 2 == 1 };
                cases.push(case(n, shapes[k % shapes.len()], input, output, form, 100 + k as u64));
                k += 1;
            }
        }
        if n != 64 {
            for output in [DType::F32, DType::F16, DType::BF16] {
                cases.push(case(n, shapes[k % shapes.len()], DType::F32, output, Form::Splits, 100 + k as u64));
                k += 1;
            }
        }
    }
    if full() {
        let mut rng = Rng::new(crate::support::emu::matrix_seed("combine full matrix", 7));
        for i in 0..40 {
            let splits = i % 2 == 0;
            let n = 1 + (rng.next_u64() % if splits { 128 } else { 64 }) as usize;
            let d = [1, 16, 32, 64, 80, 96, 128, 200, 256, 512][(rng.next_u64() % 10) as usize];
            let shape = [
                1 + (rng.next_u64() % 3) as usize,
                1 + (rng.next_u64() % 9) as usize,
                1 + (rng.next_u64() % 5) as usize,
                d,
            ];
            let (input, output) = if splits {
                (DType::F32, [DType::F32, DType::F16, DType::BF16][i % 3])
            } else {
                let dt = [DType::F32, DType::F16, DType::BF16][i % 3];
                (dt, dt)
            };
            let form = if splits { Form::Splits } else { Form::List { strided: rng.uniform() < 0.5 } };
            let mut c = case(n, shape, input, output, form, 1000 + i as u64);
            c.name = format!("random{i}_{}", c.name);
            cases.push(c);
        }
    }
    check(&cases);
}

/// The plans refuse what the kernel cannot run, with the errors the host API documents.
#[test]
fn combine_plans_refuse_what_the_kernel_cannot_run() {
    let out = Rows { ptr: 0x1000, strides: [64, 64, 64] };
    let st = StateRows { o: out, lse: 0x2000 };
    let too_many = vec![st; MAX_INPUTS + 1];
    let e = merge_plan([1, 1, 1, 64], DType::F32, DType::F32, &too_many, out, 0).unwrap_err();
    assert!(matches!(e, Error::InvalidOption { option: "merge_states_n states", .. }), "{e}");
    let e = merge_plan([1, 1, 1, 64], DType::BF16, DType::F16, &[st], out, 0).unwrap_err();
    assert!(matches!(e, Error::UnsupportedDType { .. }), "{e}");
    let e = splits_plan([1, 1, 1, 600], 2, 0x10, 0x20, DType::F16, out, 0, 0).unwrap_err();
    assert!(matches!(e, Error::UnsupportedHeadDim { head_dim: 600, .. }), "{e}");
    assert_eq!(lse_strides([2, 5, 3, 64]), [15, 1, 5]);
}

/// Wrong kernels must fail these checks: each mutation is a textual edit of a copy of cuda/
/// (exactly one occurrence), run on a list and a split case that hold every row kind.
#[test]
fn combine_mutations_are_caught() {
    const M: &[(&str, &str, &str)] = &[
        // The o of a state that saw no key is read (its NaN reaches the row).
        (
            "reads_empty_states",
            "            if (l == -INFINITY) continue;  // saw no key: weighs nothing, its o is not read\n",
            "",
        ),
        // Weights not divided by their sum.
        ("unnormalised_weights", "const float w = expf(l - m) * inv;", "const float w = expf(l - m);"),
        // The sum without the max subtracted (overflows at large LSEs, inconsistent with w).
        ("sum_without_max", "if (l != -INFINITY) sum += expf(l - m);", "if (l != -INFINITY) sum += expf(l);"),
        // The inputs' LSE read at (b, h, s) instead of (b, s, h).
        ("lse_rows_transposed", "at(p.lse_strides, b, s, h)", "at(p.lse_strides, b, h, s)"),
    ];
    let cases = [
        case(3, [2, 3, 4, 64], DType::F32, DType::F32, Form::List { strided: false }, 7),
        case(8, [2, 5, 2, 40], DType::F32, DType::BF16, Form::Splits, 8),
    ];
    for c in &cases {
        run(c).unwrap_or_else(|e| panic!("unmutated {}: {e}", c.name));
    }
    let mut missed = Vec::new();
    for &(name, from, to) in M {
        let m = Mutation { name, file: "cuda/combine.cu", from, to, defines: &[] };
        // A mutation must build: a compile error is not a caught defect.
        tool_exe_with("combine_main.cpp", Some(&m)).unwrap_or_else(|e| panic!("mutation {name}: {e}"));
        let failures: Vec<String> = cases.iter().filter_map(|c| run_with(c, Some(&m)).err()).collect();
        match failures.first() {
            Some(e) => println!("caught {name}: {}", e.lines().next().unwrap_or("")),
            None => missed.push(name),
        }
    }
    assert!(missed.is_empty(), "mutations the combine checks did not catch: {missed:?}");
}

/// Every standalone kernel of the table (build/instances.rs `STANDALONE`) names a test under
/// tests/ (any folder) that runs it in the emulator (`cpu_emulation`).
#[test]
fn every_standalone_kernel_runs_in_the_emulator() {
    fn rust_sources(dir: &std::path::Path) -> String {
        let mut all = String::new();
        for p in std::fs::read_dir(dir).unwrap().flatten().map(|e| e.path()) {
            if p.is_dir() {
                all += &rust_sources(&p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                all += &std::fs::read_to_string(&p).unwrap();
            }
        }
        all
    }
    let sources = rust_sources(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests"));
    for s in flash_attn::cuda::table::STANDALONE {
        assert!(sources.contains(&format!("fn {}()", s.cpu_emulation)), "{}: cpu_emulation names {:?}, no test under tests/", s.name, s.cpu_emulation);
    }
}

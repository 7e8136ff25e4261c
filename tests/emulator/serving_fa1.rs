//! FA1's serving paths (cuda/fa1_fwd.cu on cuda/common/seqlen.cuh) in the CPU emulator: varlen
//! (packed q and k/v), dense KV caches, paged caches (page sizes 1, 3, 16, 256; shuffled and
//! shared block tables; cache slots past each sequence NaN), packed q on a paged cache, split-KV
//! (the partial states merged by the combine kernel, also in the emulator), over random sequence
//! lengths including 0 and 1, GQA, causal and sliding-window masks, LSE. Each launch is the
//! crate's plan (`cuda::plan::plan_serving`, `cuda::combine::splits_plan`), three scheduler
//! seeds; each sequence is compared with the float64 reference run on that sequence alone, with
//! the GPU tests' rule. `FLASH_ATTN_EMU=full` adds random configurations.
//!
//! The runner (`Case`, `run`, `check`) takes the family and V's head dim from the case:
//! `head_dim_512` runs FA2's hd 512 instance through it, `head_dim_v` the fa2v row's pairs.
//!
//! Only g++ is needed: these ran in the emulator; nothing here ran on a GPU.
use crate::support::emu::{run_launch, tool_exe, unit_exe, LaunchBuf, LSE_TOL};
use crate::support::cu_seqlens;
use crate::support::emu::addr::{CU_K, CU_Q, K, LSE, LSE_ACC, O, O_ACC, Q, SEQUSED, SINKS, TABLE, V};
use crate::support::{floor_for, Rng};
use flash_attn::cuda::combine::{splits_plan, Rows};
use flash_attn::cuda::plan::{plan_serving, Operands, ServingOperands};
use flash_attn::cuda::table::FAMILIES;
use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff};
use flash_attn::serving::{BatchLayout, KvLayout, QueryLayout};
use flash_attn::{DType, ForwardOptions, Mask, Problem, Tensor};
use half::{bf16, f16};
use std::fmt::Write as _;
use std::path::PathBuf;

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}

/// Where the keys live.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Kv {
    /// Packed k/v with cu_seqlens_k.
    Varlen,
    /// A dense cache `[batch, capacity, hkv, d]` with cache_seqlens.
    Cache,
    /// A paged cache of this page size; `shared`: the sequences share their first block.
    Paged { page: usize, shared: bool },
}

#[derive(Clone, Debug)]
pub(crate) struct Case {
    /// The table row whose kernel runs ("fa1", "fa2").
    pub(crate) family: &'static str,
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) d: usize,
    /// V's (and O's) head dim: `d`, or its own (the fa2v row's pairs).
    pub(crate) dv: usize,
    pub(crate) hq: usize,
    pub(crate) hkv: usize,
    /// Packed q (cu_seqlens_q) with these lengths, or dense q of `sq[0]` rows for every sequence.
    pub(crate) packed_q: bool,
    pub(crate) sq: Vec<usize>,
    pub(crate) sk: Vec<usize>,
    pub(crate) kv: Kv,
    pub(crate) splits: usize,
    pub(crate) opts: ForwardOptions,
    pub(crate) seed: u64,
}

fn bits(dt: DType, v: &[f32]) -> Vec<u8> {
    match dt {
        DType::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
        other => panic!("the kernels take f16/bf16, not {other:?}"),
    }
}
fn values(dt: DType, b: &[u8]) -> Vec<f32> {
    match dt {
        DType::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => panic!("the kernels take f16/bf16, not {other:?}"),
    }
}
fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Runs one case; returns a summary (worst error / bound over the sequences). Sinks
/// (`opts.sinks`) go to the attention and, with split-KV, to the combine kernel, which folds them.
fn run(c: &Case) -> Result<String, String> {
    let mut rng = Rng::new(c.seed);
    let (b, d, dv, hq, hkv, dt) = (c.sq.len(), c.d, c.dv, c.hq, c.hkv, c.dtype);
    let round = |x: f32| values(dt, &bits(dt, &[x]))[0];
    // q: packed [1, total_q, hq, d] or dense [b, sq, hq, d].
    let (q_shape, cu_q) = if c.packed_q {
        ([1, c.sq.iter().sum::<usize>(), hq, d], Some(cu_seqlens(&c.sq)))
    } else {
        ([b, c.sq[0], hq, d], None)
    };
    let q: Vec<f32> = (0..q_shape.iter().product::<usize>()).map(|_| round(rng.normal() as f32)).collect();
    // k/v storage and the layout.
    let seqlens: Vec<i32> = c.sk.iter().map(|&x| x as i32).collect();
    let cu_k = cu_seqlens(&c.sk);
    let mut table: Vec<i32> = Vec::new();
    let (k_shape, max_blocks) = match c.kv {
        Kv::Varlen => ([1, c.sk.iter().sum::<usize>(), hkv, d], 0),
        Kv::Cache => ([b, c.sk.iter().max().copied().unwrap_or(0) + 3, hkv, d], 0),
        Kv::Paged { page, shared } => {
            let per: Vec<usize> = c.sk.iter().map(|&s| s.div_ceil(page)).collect();
            let max_blocks = per.iter().max().copied().unwrap_or(0).max(1) + 1;
            let n_blocks = per.iter().sum::<usize>() + 2;
            // A shuffled permutation of the blocks; with `shared`, every sequence's first block
            // is sequence 0's (a shared prefix: the tests below give them equal first keys).
            let mut ids: Vec<i32> = (0..n_blocks as i32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let mut next = 0;
            table = vec![-1; b * max_blocks];
            for (bi, &n) in per.iter().enumerate() {
                for j in 0..n {
                    table[bi * max_blocks + j] = if shared && j == 0 && bi > 0 && per[0] > 0 {
                        table[0]
                    } else {
                        next += 1;
                        ids[next - 1]
                    };
                }
            }
            ([n_blocks, page, hkv, d], max_blocks)
        }
    };
    // v: k's storage with V's head dim; o: q's with V's head dim.
    let v_shape = [k_shape[0], k_shape[1], hkv, dv];
    let o_shape = [q_shape[0], q_shape[1], hq, dv];
    // Slots no sequence uses stay NaN: the kernel must not read them.
    let mut k = vec![f32::NAN; k_shape.iter().product()];
    let mut v = vec![f32::NAN; v_shape.iter().product()];
    let ql = match &cu_q {
        Some(cuq) => QueryLayout::Varlen { cu_seqlens: cuq, max_seqlen: c.sq.iter().max().copied().unwrap_or(0) },
        None => QueryLayout::Dense,
    };
    let kl = match c.kv {
        Kv::Varlen => KvLayout::Varlen { cu_seqlens: &cu_k, max_seqlen: c.sk.iter().max().copied().unwrap_or(0) },
        Kv::Cache => KvLayout::Cache { seqlens: &seqlens, new: 0 },
        Kv::Paged { .. } => {
            KvLayout::Paged { block_table: &table, max_blocks_per_seq: max_blocks, seqlens: &seqlens, new: 0 }
        }
    };
    let layout = BatchLayout::new(ql, q_shape, kl, k_shape).map_err(|e| e.to_string())?;
    let (row, vrow) = (hkv * d, hkv * dv);
    for bi in 0..b {
        for j in 0..layout.seqlen_k(bi) {
            let (t0, t1) = layout.kv_row(bi, j);
            let slot = t0 * k_shape[1] + t1;
            // A shared block: the first writer's values stay (every sharer reads the same).
            if k[slot * row].is_nan() {
                for x in &mut k[slot * row..(slot + 1) * row] {
                    *x = round(rng.normal() as f32);
                }
                for x in &mut v[slot * vrow..(slot + 1) * vrow] {
                    *x = round(rng.normal() as f32);
                }
            }
        }
    }
    // The problem the serving path builds (the layout's batch and longest sequences).
    let (msq, msk) = (layout.max_seqlen_q(), layout.max_seqlen_k());
    let pq = Tensor::zeros(dt, [b, msq.max(1), hq, d]).unwrap();
    let pk = Tensor::zeros(dt, [b, msk.max(1), hkv, d]).unwrap();
    let pv = Tensor::zeros(dt, [b, msk.max(1), hkv, dv]).unwrap();
    let mut p = Problem::new(&pq.view(), &pk.view(), &pv.view(), &c.opts).map_err(|e| e.to_string())?;
    (p.seqlen_q, p.seqlen_k) = (msq, msk);
    let st = |s: [usize; 4]| [s[1] * s[2] * s[3], s[2] * s[3], s[3]];
    let lse_rows = if c.packed_q { hq * q_shape[1] } else { b * hq * q_shape[1] };
    let ops = Operands {
        ptrs: [Q, K, V, O],
        strides: [st(q_shape), st(k_shape), st(v_shape), st(o_shape)],
        lse: if c.opts.return_lse { LSE } else { 0 },
        alibi: 0,
        sinks: if p.sinks.is_some() { SINKS } else { 0 },
    };
    let sops = ServingOperands {
        cu_seqlens_q: if c.packed_q { CU_Q } else { 0 },
        cu_seqlens_k: CU_K,
        seqused_k: SEQUSED,
        block_table: TABLE,
        o_accum: O_ACC,
        lse_accum: LSE_ACC,
        ..ServingOperands::default()
    };
    let pl = plan_serving(c.family, &p, &layout, &ops, &sops, c.splits, 1).map_err(|e| e.to_string())?;
    let fam = FAMILIES.iter().find(|f| f.name == c.family).unwrap();
    let exe = unit_exe(fam, pl.tile, None)?;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{}_serving", c.family)).join(&c.name);
    let mut bufs = vec![
        LaunchBuf::input("q", Q, bits(dt, &q)),
        LaunchBuf::input("k", K, bits(dt, &k)),
        LaunchBuf::input("v", V, bits(dt, &v)),
        LaunchBuf::i32s("cu_k", CU_K, &cu_k),
        LaunchBuf::i32s("seqused", SEQUSED, &seqlens),
        LaunchBuf::i32s("table", TABLE, &table),
    ];
    if let Some(cuq) = &cu_q {
        bufs.push(LaunchBuf::i32s("cu_q", CU_Q, cuq));
    }
    let sink_bytes: Option<Vec<u8>> = p.sinks.as_ref().map(|s| s.iter().flat_map(|x| x.to_le_bytes()).collect());
    if let Some(sb) = &sink_bytes {
        bufs.push(LaunchBuf::input("sinks", SINKS, sb.clone()));
    }
    let n_o = o_shape.iter().product::<usize>() * 2;
    bufs.push(LaunchBuf::output("o", O, n_o));
    if c.opts.return_lse {
        bufs.push(LaunchBuf::output("lse", LSE, lse_rows * 4));
    }
    if c.splits > 1 {
        bufs.push(LaunchBuf::output("o_accum", O_ACC, c.splits * lse_rows * dv * 4));
        bufs.push(LaunchBuf::output("lse_accum", LSE_ACC, c.splits * lse_rows * 4));
    }
    let (_, mut outs) = run_launch(&exe, &dir, &pl, c.family, &[1, 2, 3], &bufs)?;
    if c.splits > 1 {
        // A split launch writes only the accumulators: o and lse keep the driver's NaN poison.
        for name in ["o", "lse"].into_iter().filter(|n| outs.contains_key(*n)) {
            if outs[name].iter().any(|&x| x != 0xFF) {
                return Err(format!("the split launch wrote into {name}"));
            }
        }
        // The combine kernel merges the partial states into o (and the LSE), in the emulator.
        let out = Rows { ptr: O, strides: st(o_shape) };
        let shape = if c.packed_q { o_shape } else { [b, q_shape[1], hq, dv] };
        let lse_out = if c.opts.return_lse { LSE } else { 0 };
        let cl = splits_plan(shape, c.splits, O_ACC, LSE_ACC, dt, out, lse_out, ops.sinks).map_err(|e| e.to_string())?;
        let hex: String = cl.params.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
        let cdir = dir.join("combine");
        std::fs::create_dir_all(&cdir).unwrap();
        let mut lf = format!("kernel {}\ngrid {}\nblock {}\nseeds 1 2 3\nparams {hex}\n", cl.kernel, cl.grid, cl.block);
        for (name, addr) in [("o_accum", O_ACC), ("lse_accum", LSE_ACC)] {
            let path = cdir.join(name);
            std::fs::write(&path, &outs[name]).unwrap();
            writeln!(lf, "in {name} {addr:#x} {} {}", outs[name].len(), path.display()).unwrap();
        }
        if let Some(sb) = &sink_bytes {
            let path = cdir.join("sinks");
            std::fs::write(&path, sb).unwrap();
            writeln!(lf, "in sinks {SINKS:#x} {} {}", sb.len(), path.display()).unwrap();
        }
        writeln!(lf, "out o {O:#x} {n_o} {}", cdir.join("o").display()).unwrap();
        writeln!(lf, "out lse {LSE:#x} {} {}", lse_rows * 4, cdir.join("lse").display()).unwrap();
        std::fs::write(cdir.join("launch"), lf).unwrap();
        let res = std::process::Command::new(tool_exe("combine_main.cpp")?)
            .arg(cdir.join("launch"))
            .output()
            .map_err(|e| e.to_string())?;
        if !res.status.success() {
            return Err(format!(
                "combine: {}{}",
                String::from_utf8_lossy(&res.stdout),
                String::from_utf8_lossy(&res.stderr)
            ));
        }
        outs.insert("o".into(), std::fs::read(cdir.join("o")).unwrap());
        outs.insert("lse".into(), std::fs::read(cdir.join("lse")).unwrap());
    }
    let got_o = values(dt, &outs["o"]);
    let got_lse = c.opts.return_lse.then(|| f32s(&outs["lse"]));

    // Each sequence against the float64 reference on that sequence alone.
    let mut worst: f64 = 0.0;
    for bi in 0..b {
        let (sq, sk) = (layout.seqlen_q(bi), layout.seqlen_k(bi));
        if sq == 0 {
            continue;
        }
        let mut qb = Vec::with_capacity(sq * hq * d);
        for i in 0..sq {
            let (t0, t1) = layout.q_row(bi, i);
            let at = (t0 * q_shape[1] + t1) * hq * d;
            qb.extend_from_slice(&q[at..at + hq * d]);
        }
        let lse_at = |h: usize, i: usize| {
            let (t0, t1) = layout.q_row(bi, i);
            if c.packed_q {
                h * q_shape[1] + t1
            } else {
                (t0 * hq + h) * q_shape[1] + t1
            }
        };
        let got_row = |i: usize| {
            let (t0, t1) = layout.q_row(bi, i);
            let at = (t0 * q_shape[1] + t1) * hq * dv;
            &got_o[at..at + hq * dv]
        };
        if sk == 0 {
            // No key: 0, with LSE -inf, or the head's sink logit where it has one.
            for i in 0..sq {
                if got_row(i).iter().any(|&x| x != 0.0) {
                    return Err(format!("sequence {bi} has no key: row {i} must be 0, got {:?}", &got_row(i)[..4]));
                }
                if let Some(l) = &got_lse {
                    for h in 0..hq {
                        let want = p.sink(h).unwrap_or(f32::NEG_INFINITY);
                        if l[lse_at(h, i)] != want {
                            return Err(format!("sequence {bi} has no key: lse must be {want}, got {}", l[lse_at(h, i)]));
                        }
                    }
                }
            }
            continue;
        }
        let (mut kb, mut vb) = (Vec::new(), Vec::new());
        for j in 0..sk {
            let (t0, t1) = layout.kv_row(bi, j);
            let slot = t0 * k_shape[1] + t1;
            kb.extend_from_slice(&k[slot * row..(slot + 1) * row]);
            vb.extend_from_slice(&v[slot * vrow..(slot + 1) * vrow]);
        }
        let qt = Tensor::from_f32(&qb, dt, [1, sq, hq, d]).unwrap();
        let kt = Tensor::from_f32(&kb, dt, [1, sk, hkv, d]).unwrap();
        let vt = Tensor::from_f32(&vb, dt, [1, sk, hkv, dv]).unwrap();
        let pb = Problem::new(&qt.view(), &kt.view(), &vt.view(), &c.opts).unwrap();
        let r = attention_f64(&pb, &qt.view(), &kt.view(), &vt.view()).unwrap();
        let naive = attention_naive(&pb, &qt.view(), &kt.view(), &vt.view(), dt).unwrap();
        let ours: Vec<f64> = (0..sq).flat_map(|i| got_row(i).iter().map(|&x| x as f64).collect::<Vec<_>>()).collect();
        let err = max_abs_diff(&ours, &r.o);
        let bound = 2.0 * max_abs_diff(&naive, &r.o) + floor_for(dt);
        if err.is_nan() || err > bound {
            return Err(format!("sequence {bi} (sq {sq}, sk {sk}): max |o - ref| {err:.3e} > bound {bound:.3e}"));
        }
        worst = worst.max(err / bound);
        if let Some(l) = &got_lse {
            for h in 0..hq {
                for i in 0..sq {
                    let (g, w) = (l[lse_at(h, i)] as f64, r.lse[h * sq + i]);
                    let ok = if w.is_infinite() { g == w } else { (g - w).abs() <= LSE_TOL };
                    if !ok {
                        return Err(format!("sequence {bi}: lse (h {h}, row {i}) {g} vs reference {w}"));
                    }
                }
            }
        }
    }
    Ok(format!("{b} sequences, worst {worst:.3} of the bound"))
}

pub(crate) fn check(cases: &[Case]) {
    crate::support::check_each("serving launches", cases, |c| c.name.clone(), run);
}

#[allow(clippy::too_many_arguments)]
pub(super) fn case(
    name: &str,
    dtype: DType,
    packed_q: bool,
    sq: Vec<usize>,
    sk: Vec<usize>,
    kv: Kv,
    splits: usize,
    hq: usize,
    hkv: usize,
    opts: ForwardOptions,
    seed: u64,
) -> Case {
    Case { family: "fa1", name: name.into(), dtype, d: 64, dv: 64, hq, hkv, packed_q, sq, sk, kv, splits, opts, seed }
}

/// The CI subset: every layout, page sizes 1/3/16/256 with shuffled and shared tables, lengths
/// 0 and 1, GQA, causal and window masks, LSE, split-KV through the combine.
#[test]
fn fa1_serving_matches_per_sequence_reference() {
    let causal = ForwardOptions::default().mask(Mask::Causal).return_lse(true);
    let window = ForwardOptions::default().mask(Mask::window(17, 3)).return_lse(true);
    let plain = ForwardOptions::default();
    let cases = vec![
        case(
            "varlen_causal_gqa",
            DType::F16,
            true,
            vec![5, 0, 1, 70],
            vec![9, 4, 0, 130],
            Kv::Varlen,
            1,
            4,
            2,
            causal.clone(),
            1,
        ),
        case(
            "cache_decode_window",
            DType::BF16,
            false,
            vec![1; 4],
            vec![0, 1, 77, 200],
            Kv::Cache,
            1,
            4,
            1,
            window.clone(),
            2,
        ),
        case(
            "paged1_decode",
            DType::F16,
            false,
            vec![1; 3],
            vec![33, 1, 90],
            Kv::Paged { page: 1, shared: false },
            1,
            2,
            2,
            causal.clone(),
            3,
        ),
        case(
            "paged3_shared_chunk",
            DType::BF16,
            false,
            vec![4; 3],
            vec![10, 35, 4],
            Kv::Paged { page: 3, shared: true },
            1,
            4,
            2,
            causal.clone(),
            4,
        ),
        case(
            "paged16_varlen_q",
            DType::F16,
            true,
            vec![3, 0, 17],
            vec![40, 5, 17],
            Kv::Paged { page: 16, shared: false },
            1,
            4,
            4,
            window,
            5,
        ),
        case(
            "paged256_splits3",
            DType::BF16,
            false,
            vec![1; 2],
            vec![300, 0],
            Kv::Paged { page: 256, shared: false },
            3,
            4,
            1,
            causal.clone(),
            6,
        ),
        case("cache_splits2_nolse", DType::F16, false, vec![2; 3], vec![150, 1, 64], Kv::Cache, 2, 2, 1, plain, 7),
        case("varlen_splits4", DType::BF16, true, vec![1, 6, 0], vec![200, 6, 3], Kv::Varlen, 4, 2, 2, causal, 8),
    ];
    let mut cases = cases;
    if full() {
        let mut rng = Rng::new(crate::support::emu::matrix_seed("fa1 serving full matrix", 99));
        for i in 0..24 {
            let b = 1 + (rng.next_u64() % 4) as usize;
            // Lengths 0 and 1 in 15 % of the draws each, otherwise up to `max`.
            let len = |rng: &mut Rng, max: u64| {
                let u = rng.uniform();
                if u < 0.15 {
                    0
                } else if u < 0.3 {
                    1
                } else {
                    2 + (rng.next_u64() % max) as usize
                }
            };
            let kv = match i % 3 {
                0 => Kv::Varlen,
                1 => Kv::Cache,
                _ => Kv::Paged { page: [1, 3, 16, 256][(rng.next_u64() % 4) as usize], shared: rng.uniform() < 0.5 },
            };
            let packed_q = kv == Kv::Varlen || rng.uniform() < 0.5;
            let sq: Vec<usize> = if packed_q {
                (0..b).map(|_| len(&mut rng, 40)).collect()
            } else {
                vec![1 + (rng.next_u64() % 4) as usize; b]
            };
            let sk: Vec<usize> = (0..b).map(|_| len(&mut rng, 400)).collect();
            let (hq, hkv) = [(4, 4), (4, 2), (4, 1), (2, 2)][(rng.next_u64() % 4) as usize];
            let mask =
                [Mask::None, Mask::Causal, Mask::window(30, 0), Mask::window(5, 9)][(rng.next_u64() % 4) as usize];
            let opts = ForwardOptions::default().mask(mask).return_lse(rng.uniform() < 0.7);
            let splits = [1, 1, 2, 3, 5][(rng.next_u64() % 5) as usize];
            let dt = if i % 2 == 0 { DType::F16 } else { DType::BF16 };
            cases.push(case(&format!("random{i}"), dt, packed_q, sq, sk, kv, splits, hq, hkv, opts, 1000 + i));
        }
    }
    check(&cases);
}

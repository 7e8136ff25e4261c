//! FA3 (sm_90a, stages 3-5) on the serving layouts, in the CPU emulator (docs/emulator.md,
//! docs/fa3.md "Serving layouts"): packed variable-length batches, dense caches with
//! `cache_seqlens`, paged caches of any page size (TMA through the block table when the page
//! size is a multiple of the 128-key tile, the gathered cp.async path otherwise), shuffled and
//! shared block tables, GQA, causal / window / softcap, LSE. Each launch is the crate's own plan
//! (`plan_serving`), run under three scheduler seeds (bit-identical outputs), and each sequence
//! is compared with the float64 reference run on that sequence alone, with the GPU tests' rule
//! (`max|O - ref| <= 2 max|naive - ref| + floor`, LSE within 2e-3; a sequence with no key: O = 0,
//! LSE = -inf). Unused cache slots and unused blocks hold NaN: a kernel that reads one into
//! P V fails. Outputs are NaN-poisoned by the driver, so an unwritten row fails too.
//!
//! The runner (`Case`, `run`) also takes a dense launch (`Kv::Dense`, the crate's `plan`) and a V
//! head dim of its own (`Case::dv`), for head_dim_v_fa3.rs.
//!
//! `cargo test --test emulator serving_fa3::` runs a subset; `FLASH_ATTN_EMU=full` the matrix.
use super::serving_fa2::{bits, from_bits};
use crate::support::cu_seqlens;
use crate::support::emu::addr::{CU_K, CU_Q, K, KNEW, LSE, O, Q, SEQUSED, TABLE, V, VNEW};
use crate::support::emu::{check_sequence, run_launch, unit_exe, LaunchBuf, Mutation};
use crate::support::serving::{values, Rng};
use flash_attn::cuda::plan::{plan, plan_serving, LaunchPlan, Operands, ServingOperands};
use flash_attn::cuda::table::FAMILIES;
use flash_attn::serving::{BatchLayout, KvLayout, QueryLayout};
use flash_attn::{DType, ForwardOptions, Mask, Problem, Tensor};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}

/// Where the keys of each sequence are.
#[derive(Clone, Debug)]
pub(super) enum Kv {
    /// A dense launch (`plan`, not a serving layout): k `[batch, sk, hkv, d]`, v `[.., dv]`, q
    /// dense.
    Dense(usize),
    /// Packed k/v `[1, total_k, hkv, ..]` with these lengths.
    Packed(Vec<usize>),
    /// A dense cache `[batch, capacity, hkv, ..]`, sequence b using its first `lens[b]` rows.
    Cache { lens: Vec<usize>, capacity: usize },
    /// A paged cache of `page`-key blocks: block ids shuffled, `spare` unused blocks, and with
    /// `shared` the second sequence's first block is the first one's (a shared prefix).
    Paged { lens: Vec<usize>, page: usize, spare: usize, shared: bool },
}

/// One emulated launch of an FA3 row.
#[derive(Clone, Debug)]
pub(super) struct Case {
    pub family: &'static str,
    pub dtype: DType,
    pub hq: usize,
    pub hkv: usize,
    /// Q/K's head dim and V's (O's columns; d but in the (192, 128) instance).
    pub d: usize,
    pub dv: usize,
    /// Query rows per sequence; `q_packed` false: dense q `[batch, sq, hq, d]` (all equal).
    pub q_lens: Vec<usize>,
    pub q_packed: bool,
    pub kv: Kv,
    pub opts: ForwardOptions,
    pub sm_count: u32,
    /// Cache layouts: the last `appended` keys of each sequence are this call's new rows
    /// (`seqlen_new`), already in the cache as the append kernel leaves it before the attention.
    pub appended: usize,
    /// Scheduler seeds (bit-identical outputs across them).
    pub seeds: Vec<u64>,
}

impl Case {
    pub(super) fn name(&self) -> String {
        format!(
            "{} {:?} hq{} hkv{} d{}{} q{}{:?} {:?} {:?}{}{} sms{}",
            self.family,
            self.dtype,
            self.hq,
            self.hkv,
            self.d,
            if self.dv != self.d { format!("/{}", self.dv) } else { String::new() },
            if self.q_packed { "packed" } else { "dense" },
            self.q_lens,
            self.kv,
            self.opts.mask,
            self.opts.softcap.map_or(String::new(), |c| format!(" softcap{c}")),
            if self.opts.return_lse { " lse" } else { "" },
            self.sm_count
        ) + &if self.appended > 0 { format!(" appended{}", self.appended) } else { String::new() }
    }

    fn k_lens(&self) -> Vec<usize> {
        match &self.kv {
            Kv::Dense(sk) => vec![*sk; self.q_lens.len()],
            Kv::Packed(l) | Kv::Cache { lens: l, .. } | Kv::Paged { lens: l, .. } => l.clone(),
        }
    }
}

/// Row of the k/v storage that holds key j of sequence b.
type KeyRow = Box<dyn Fn(usize, usize) -> usize>;

/// The k and v storage (`batch_dim` entries of `rows` rows of `hkv` heads: K with d columns, V
/// with dv), NaN where no sequence has a key, and where each sequence's keys are.
struct KvStore {
    rows: usize,
    batch_dim: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    key_row: KeyRow,
    table: Vec<i32>,
    max_blocks: usize,
}

fn kv_store(c: &Case, rng: &mut Rng) -> KvStore {
    let (rk, rv) = (c.hkv * c.d, c.hkv * c.dv);
    let lens = c.k_lens();
    let batch = lens.len();
    // (storage rows per batch entry, batch entries, key row of (b, j)).
    let (rows, batch_dim, key_row, table, max_blocks): (usize, usize, KeyRow, Vec<i32>, usize) = match &c.kv {
        Kv::Dense(sk) => {
            let sk = *sk;
            (sk, batch, Box::new(move |b, j| b * sk + j), Vec::new(), 0)
        }
        Kv::Packed(l) => {
            let cu = cu_seqlens(l);
            (l.iter().sum(), 1, Box::new(move |b, j| cu[b] as usize + j), Vec::new(), 0)
        }
        Kv::Cache { capacity, .. } => {
            let cap = *capacity;
            (cap, batch, Box::new(move |b, j| b * cap + j), Vec::new(), 0)
        }
        Kv::Paged { page, spare, shared, .. } => {
            let page = *page;
            let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(page)).collect();
            let shared = *shared && batch >= 2 && lens[0] >= page && lens[1] >= page;
            let num_blocks = need.iter().sum::<usize>() - usize::from(shared) + spare;
            // A shuffled permutation of the block ids (Fisher-Yates on the test's generator).
            let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
            rng.shuffle(&mut ids);
            let max_blocks = need.iter().copied().max().unwrap_or(0) + 1; // one -1 pad at least
            let mut table = vec![-1; batch * max_blocks];
            let mut next = ids.into_iter();
            for b in 0..batch {
                for blk in 0..need[b] {
                    table[b * max_blocks + blk] =
                        if shared && b == 1 && blk == 0 { table[0] } else { next.next().unwrap() };
                }
            }
            let t = table.clone();
            (page, num_blocks, Box::new(move |b, j| t[b * max_blocks + j / page] as usize * page + j % page), table, max_blocks)
        }
    };
    // Every row some sequence uses gets a value (a shared block's once); the rest stay NaN.
    let mut k = vec![f32::NAN; batch_dim * rows * rk];
    let mut v = vec![f32::NAN; batch_dim * rows * rv];
    for (b, &l) in lens.iter().enumerate() {
        for j in 0..l {
            let r = key_row(b, j);
            if k[r * rk].is_nan() {
                k[r * rk..][..rk].copy_from_slice(&values(rng, rk, c.dtype));
                v[r * rv..][..rv].copy_from_slice(&values(rng, rv, c.dtype));
            }
        }
    }
    KvStore { rows, batch_dim, k, v, key_row, table, max_blocks }
}

/// Runs one case; Ok(worst err / bound over its sequences, the plan) or Err(why). With
/// `execute` false only plans the launch (ratio 0).
pub(super) fn run(c: &Case, execute: bool) -> Result<(f64, LaunchPlan), String> {
    run_mutated(c, execute, None)
}

/// As [`run`], on a mutated copy of the kernel sources.
pub(super) fn run_mutated(c: &Case, execute: bool, mutation: Option<&Mutation>) -> Result<(f64, LaunchPlan), String> {
    let mut h = DefaultHasher::new();
    c.name().hash(&mut h);
    let mut rng = Rng::new(h.finish() | 1);
    let (hq, hkv, d, dv, dt) = (c.hq, c.hkv, c.d, c.dv, c.dtype);
    let batch = c.q_lens.len();
    let k_lens = c.k_lens();
    let (rk, rv) = (hkv * d, hkv * dv);

    // q: packed [1, total_q, hq, d] or dense [batch, sq, hq, d]; row r of sequence b at
    // q_row0[b] + r either way (dense: b * sq).
    let q_rows: usize = c.q_lens.iter().sum();
    let cu_q = cu_seqlens(&c.q_lens);
    let q = values(&mut rng, q_rows * hq * d, dt);
    let sq_dense = c.q_lens[0];
    if !c.q_packed {
        assert!(c.q_lens.iter().all(|&l| l == sq_dense), "a dense q has one seqlen");
    }
    let kvs = kv_store(c, &mut rng);

    // The launch: the layout the serving API would validate, the problem it would build, the plan.
    let q_shape = if c.q_packed { [1, q_rows, hq, d] } else { [batch, sq_dense, hq, d] };
    let o_shape = [q_shape[0], q_shape[1], hq, dv];
    let (k_shape, v_shape) = ([kvs.batch_dim, kvs.rows, hkv, d], [kvs.batch_dim, kvs.rows, hkv, dv]);
    let st = |s: [usize; 4]| [s[1] * s[2] * s[3], s[2] * s[3], s[3]];
    let ops = Operands {
        ptrs: [Q, K, V, O],
        strides: [st(q_shape), st(k_shape), st(v_shape), st(o_shape)],
        lse: if c.opts.return_lse { LSE } else { 0 },
        alibi: 0,
        sinks: 0,
    };
    // cache_seqlens count the keys before this call's appended rows.
    let seqlens: Vec<i32> = k_lens.iter().map(|&l| (l - c.appended) as i32).collect();
    let cu_k = cu_seqlens(&k_lens);
    let pl = if let Kv::Dense(_) = c.kv {
        let t = |x: &[f32], s: [usize; 4]| Tensor::from_f32(x, dt, s).unwrap();
        let (qt, kt, vt) = (t(&q, q_shape), t(&kvs.k, k_shape), t(&kvs.v, v_shape));
        let p = Problem::new(&qt.view(), &kt.view(), &vt.view(), &c.opts).map_err(|e| format!("problem: {e}"))?;
        plan(c.family, &p, &ops, c.sm_count).map_err(|e| format!("plan: {e}"))?
    } else {
        let ql = if c.q_packed {
            QueryLayout::Varlen { cu_seqlens: &cu_q, max_seqlen: c.q_lens.iter().copied().max().unwrap_or(0) }
        } else {
            QueryLayout::Dense
        };
        let kl = match &c.kv {
            Kv::Packed(lens) => KvLayout::Varlen { cu_seqlens: &cu_k, max_seqlen: lens.iter().copied().max().unwrap_or(0) },
            Kv::Cache { .. } => KvLayout::Cache { seqlens: &seqlens, new: c.appended },
            _ => KvLayout::Paged { block_table: &kvs.table, max_blocks_per_seq: kvs.max_blocks, seqlens: &seqlens, new: c.appended },
        };
        let layout = BatchLayout::new(ql, q_shape, kl, k_shape).map_err(|e| format!("layout: {e}"))?;
        let p = layout.launch_problem_v(hq, hkv, (d, dv), dt, &c.opts).map_err(|e| format!("problem: {e}"))?;
        let sops = ServingOperands {
            cu_seqlens_q: if c.q_packed { CU_Q } else { 0 },
            cu_seqlens_k: if matches!(c.kv, Kv::Packed(_)) { CU_K } else { 0 },
            seqused_k: if matches!(c.kv, Kv::Packed(_)) { 0 } else { SEQUSED },
            block_table: if matches!(c.kv, Kv::Paged { .. }) { TABLE } else { 0 },
            knew: if c.appended > 0 { KNEW } else { 0 },
            vnew: if c.appended > 0 { VNEW } else { 0 },
            new_strides: [[c.appended * rk, rk, d], [c.appended * rv, rv, dv]],
            ..ServingOperands::default()
        };
        plan_serving(c.family, &p, &layout, &ops, &sops, 1, c.sm_count).map_err(|e| format!("plan: {e}"))?
    };
    if pl.tile.head_dim != d as u32 {
        return Err(format!("planned on the hd {} instance, not hd {d}", pl.tile.head_dim));
    }
    if !execute {
        return Ok((0.0, pl));
    }
    let fam = FAMILIES.iter().find(|f| f.name == c.family).unwrap();
    let exe = unit_exe(fam, pl.tile, mutation)?;
    let mut bufs = vec![
        LaunchBuf::input("q", Q, bits(&q, dt)),
        LaunchBuf::input("k", K, bits(&kvs.k, dt)),
        LaunchBuf::input("v", V, bits(&kvs.v, dt)),
        LaunchBuf::output("o", O, q_rows * hq * dv * 2),
    ];
    if c.opts.return_lse {
        bufs.push(LaunchBuf::output("lse", LSE, hq * q_rows * 4));
    }
    if c.q_packed {
        bufs.push(LaunchBuf::i32s("cu_seqlens_q", CU_Q, &cu_q));
    }
    if c.appended > 0 {
        // The rows the append kernel already copied into the cache; the attention never reads them.
        bufs.push(LaunchBuf::input("k_new", KNEW, vec![0; batch * c.appended * rk * 2]));
        bufs.push(LaunchBuf::input("v_new", VNEW, vec![0; batch * c.appended * rv * 2]));
    }
    match &c.kv {
        Kv::Dense(_) => {}
        Kv::Packed(_) => bufs.push(LaunchBuf::i32s("cu_seqlens_k", CU_K, &cu_k)),
        Kv::Cache { .. } => bufs.push(LaunchBuf::i32s("seqused_k", SEQUSED, &seqlens)),
        Kv::Paged { .. } => {
            bufs.push(LaunchBuf::i32s("seqused_k", SEQUSED, &seqlens));
            bufs.push(LaunchBuf::i32s("block_table", TABLE, &kvs.table));
        }
    }
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("emu/serving-fa3").join(format!(
        "{:016x}{}",
        h.finish(),
        mutation.map_or("", |m| m.name)
    ));
    let (log, outs) = run_launch(&exe, &dir, &pl, c.family, &c.seeds, &bufs)?;
    let o = from_bits(&outs["o"], dt);
    let lse: Vec<f32> = outs
        .get("lse")
        .map_or(Vec::new(), |b| b.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect());

    // Each sequence against the float64 reference on that sequence alone.
    let mut worst = 0.0f64;
    for b in 0..batch {
        let (sq, sk) = (c.q_lens[b], k_lens[b]);
        if sq == 0 {
            continue;
        }
        let q0 = cu_q[b] as usize;
        let ob = &o[q0 * hq * dv..(q0 + sq) * hq * dv];
        // LSE: packed [hq, total_q]; dense [batch, hq, sq].
        let lse_at =
            |h: usize, i: usize| if c.q_packed { lse[h * q_rows + q0 + i] } else { lse[(b * hq + h) * sq + i] };
        let fail = |why: String| Err(format!("sequence {b} (sq {sq}, sk {sk}): {why}\n{log}"));
        if sk == 0 {
            if let Some(x) = ob.iter().find(|&&x| x != 0.0) {
                return fail(format!("no key, but O holds {x}"));
            }
            if c.opts.return_lse && (0..hq).any(|h| (0..sq).any(|i| lse_at(h, i) != f32::NEG_INFINITY)) {
                return fail("no key, but an LSE is not -inf".into());
            }
            continue;
        }
        let (mut kb, mut vb) = (Vec::with_capacity(sk * rk), Vec::with_capacity(sk * rv));
        for j in 0..sk {
            let r = (kvs.key_row)(b, j);
            kb.extend_from_slice(&kvs.k[r * rk..][..rk]);
            vb.extend_from_slice(&kvs.v[r * rv..][..rv]);
        }
        let qt = Tensor::from_f32(&q[q0 * hq * d..(q0 + sq) * hq * d], dt, [1, sq, hq, d]).unwrap();
        let kt = Tensor::from_f32(&kb, dt, [1, sk, hkv, d]).unwrap();
        let vt = Tensor::from_f32(&vb, dt, [1, sk, hkv, dv]).unwrap();
        let lse_rows: &dyn Fn(usize, usize) -> f32 = &lse_at;
        match check_sequence((&qt.view(), &kt.view(), &vt.view()), &c.opts, dt, ob, c.opts.return_lse.then_some(lse_rows)) {
            Ok(ratio) => worst = worst.max(ratio),
            Err(why) => return fail(why),
        }
    }
    Ok((worst, pl))
}

fn check(cases: &[Case]) {
    crate::support::check_each("FA3 serving cases", cases, Case::name, |c| {
        run(c, true).map(|(ratio, pl)| format!("err/bound {ratio:.3}; {}", pl.note.unwrap_or("")))
    });
}

pub(super) fn case(
    family: &'static str,
    dtype: DType,
    (hq, hkv, d): (usize, usize, usize),
    q_lens: &[usize],
    q_packed: bool,
    kv: Kv,
) -> Case {
    Case {
        family,
        dtype,
        hq,
        hkv,
        d,
        dv: d,
        q_lens: q_lens.to_vec(),
        q_packed,
        kv,
        opts: ForwardOptions::default().return_lse(true),
        sm_count: 1,
        appended: 0,
        seeds: vec![1, 2, 3],
    }
}
pub(super) fn with(mut c: Case, f: impl FnOnce(&mut Case)) -> Case {
    f(&mut c);
    c
}

/// The subset every `cargo test` runs: each load path (TMA through the table, gathered pages,
/// the gathered tail of a packed / cached sequence), every stage 3-5, both dtypes and head dims,
/// lengths 0 and 1, GQA, causal / window / softcap, shared and shuffled blocks.
fn subset() -> Vec<Case> {
    use DType::{BF16, F16};
    let paged = |lens: &[usize], page, shared| Kv::Paged { lens: lens.to_vec(), page, spare: 2, shared };
    vec![
        // Prefill of a packed batch: empty query rows, no keys, one key, several tiles.
        with(case("fa3s5", BF16, (4, 2, 128), &[0, 1, 130, 77], true, Kv::Packed(vec![5, 0, 300, 129])), |c| {
            c.opts.mask = Mask::Causal;
            c.sm_count = 2;
        }),
        // Decode against a paged cache of 3-key pages (gathered), shared prefix block, GQA 4:1.
        with(case("fa3s3", F16, (4, 1, 64), &[1, 1, 1], false, paged(&[200, 37, 1], 3, true)), |_| {}),
        // Chunked prefill on 128-key pages (TMA through the table, gathered tail), window + softcap.
        with(case("fa3s5", BF16, (2, 2, 64), &[16, 40], true, paged(&[300, 129], 128, true)), |c| {
            c.opts.mask = Mask::window(40, 7);
            c.opts.softcap = Some(30.0);
        }),
        // Decode after the append kernel (seqlen_new 2: sk_b = cache_seqlens + 2), 16-key pages.
        with(case("fa3s5", F16, (4, 2, 128), &[2, 2], false, paged(&[130, 2], 16, false)), |c| {
            c.appended = 2;
            c.opts.mask = Mask::Causal;
        }),
        // A dense cache with cache_seqlens (TMA, gathered tail; NaN past each length), stage 4.
        with(
            case("fa3s4", F16, (2, 1, 128), &[16, 16], false, Kv::Cache { lens: vec![140, 16], capacity: 300 }),
            |c| {
                c.opts.mask = Mask::Causal;
            },
        ),
    ]
}

#[test]
fn fa3_serving_subset() {
    check(&subset());
}

/// The whole matrix (FLASH_ATTN_EMU=full): stages 3, 4, 5 x both dtypes x head_dim 64 / 128 x
/// page sizes 1, 3, 16, 128, 256, packed and dense caches, random lengths with 0 and 1.
#[test]
fn fa3_serving_matrix() {
    if !full() {
        println!("the FA3 serving matrix runs with FLASH_ATTN_EMU=full (the subset runs always)");
        return;
    }
    let mut rng = Rng::new(crate::support::emu::matrix_seed("fa3 serving matrix", 0x005e_41f3));
    let mut cases = Vec::new();
    let masks = [Mask::None, Mask::Causal, Mask::window(33, 5)];
    for (si, family) in ["fa3s3", "fa3s4", "fa3s5"].into_iter().enumerate() {
        for (di, d) in [64, 128].into_iter().enumerate() {
            for (ki, kind) in ["packed", "cache", "p1", "p3", "p16", "p128", "p256"].into_iter().enumerate() {
                let i = si + di + ki;
                let dtype = if i % 2 == 0 { DType::BF16 } else { DType::F16 };
                let (hq, hkv) = [(4, 2), (4, 1), (2, 2)][i % 3];
                let batch = 2 + i % 3;
                let mut lens = |max: u64| -> Vec<usize> {
                    (0..batch).map(|b| if b == 1 { [0, 1][i % 2] } else { (rng.next_u64() % max) as usize }).collect()
                };
                let decode = kind.starts_with('p') && i % 2 == 0;
                let q_lens = if decode { vec![1; batch] } else { lens(150) };
                let k_lens: Vec<usize> = lens(400).iter().zip(&q_lens).map(|(&k, &q)| k.max(q)).collect();
                let kv = match kind {
                    "packed" => Kv::Packed(k_lens),
                    "cache" => Kv::Cache { capacity: k_lens.iter().copied().max().unwrap_or(0) + 9, lens: k_lens },
                    _ => Kv::Paged { lens: k_lens, page: kind[1..].parse().unwrap(), spare: 3, shared: i % 2 == 1 },
                };
                let mut c = case(family, dtype, (hq, hkv, d), &q_lens, !decode, kv);
                c.opts.mask = masks[i % 3];
                if i % 4 == 3 {
                    c.opts.softcap = Some(20.0);
                }
                c.sm_count = 1 + (i % 3) as u32;
                cases.push(c);
            }
        }
    }
    check(&cases);
}

/// Which load path a launch takes, as its plan says (and `Dispatch::reason` repeats).
#[test]
fn load_path_follows_the_page_size() {
    let k = |page| Kv::Paged { lens: vec![300], page, spare: 0, shared: false };
    for (page, want) in [(256, "TMA"), (128, "TMA"), (16, "gathered"), (3, "gathered")] {
        let c = case("fa3s5", DType::BF16, (2, 2, 64), &[1], false, k(page));
        let note = run(&c, false).unwrap().1.note.unwrap_or("");
        assert!(note.contains(want), "page {page}: {note}");
    }
}

/// Edits of the serving code that must fail a case of the subset: the gathered load reading
/// past a sequence's last key (NaN cache slots), the paged TMA coordinates ignoring the block
/// table (shuffled blocks), and (with FLASH_ATTN_EMU=full) the mask taking the longest
/// sequence's lengths instead of each sequence's own.
#[test]
fn mutations_are_caught() {
    use DType::{BF16, F16};
    let cache = with(
        case("fa3s3", F16, (2, 1, 64), &[16, 16], false, Kv::Cache { lens: vec![140, 16], capacity: 300 }),
        |_| {},
    );
    let pages = case(
        "fa3s5",
        BF16,
        (2, 2, 64),
        &[16, 40],
        true,
        Kv::Paged { lens: vec![300, 129], page: 128, spare: 2, shared: false },
    );
    let causal =
        with(case("fa3s4", F16, (2, 1, 64), &[16, 5], true, Kv::Packed(vec![40, 200])), |c| c.opts.mask = Mask::Causal);
    let mut muts = vec![
        (
            Mutation {
                name: "gather_past_sk",
                file: "cuda/fa3/serving.cuh",
                from: "const bool live = j < s.sk;",
                to: "const bool live = j < s.sk + 8;",
                defines: &[],
            },
            cache,
        ),
        (
            Mutation {
                name: "tma_page_untranslated",
                file: "cuda/fa3/serving.cuh",
                from: "*batch = pg.block;",
                to: "*batch = n0 / p.page_size;",
                defines: &[],
            },
            pages,
        ),
    ];
    if full() {
        muts.push((
            Mutation {
                name: "mask_on_longest",
                file: "cuda/fa3/serving.cuh",
                from: "own.seqlen_k = s.sk;",
                to: "",
                defines: &[],
            },
            causal,
        ));
    }
    for (m, c) in &muts {
        run(c, true).unwrap_or_else(|e| panic!("{}: the unmutated kernel fails: {e}", c.name()));
        match run_mutated(c, true, Some(m)) {
            Ok((ratio, _)) => panic!("mutation {} passed {} (err/bound {ratio:.3})", m.name, c.name()),
            Err(e) => println!("caught {}: {}", m.name, e.lines().next().unwrap_or("")),
        }
    }
}

/// The gathered (paged) load's producer warpgroup without its barrier before the one arrival
/// that publishes the tile: the consumers' wgmma reads other producer threads' cp.async copies
/// that nothing orders before it. Caught by happens-before under each seed alone, naming the
/// missing synchronisation with the copying thread.
#[test]
fn gathered_tile_published_without_producer_barrier_is_caught() {
    let m = Mutation {
        name: "gather_commit_without_barrier",
        file: "cuda/fa3/serving.cuh",
        from: "    named_bar_sync<kGatherBarrier, kWarpgroupThreads>();\n",
        to: "",
        defines: &[],
    };
    for family in ["fa3s3", "fa3s5"] {
        let paged = Kv::Paged { lens: vec![300, 129], page: 16, spare: 2, shared: false };
        let c = case(family, DType::BF16, (2, 2, 64), &[16, 40], true, paged);
        let note = run(&c, true).unwrap_or_else(|e| panic!("{}: the unmutated kernel fails: {e}", c.name())).1.note;
        assert!(note.unwrap_or("").contains("gathered"), "{}: not the gathered path: {note:?}", c.name());
        for seed in 1..=3 {
            let c = with(c.clone(), |c| c.seeds = vec![seed]);
            match run_mutated(&c, true, Some(&m)) {
                Ok((ratio, _)) => panic!("{} passed {} seed {seed} (err/bound {ratio:.3})", m.name, c.name()),
                Err(e) => {
                    println!("caught {} ({family}, seed {seed}):\n{}\n", m.name, e.lines().take(9).collect::<Vec<_>>().join("\n"));
                    assert!(e.contains("happens-before") && e.contains("cp.async copy of thread"), "{family} seed {seed}: {e}");
                }
            }
        }
    }
}

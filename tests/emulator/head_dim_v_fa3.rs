//! FA3 stage 5's (192, 128) instance (DeepSeek MLA prefill: Q/K head_dim 192, V and O head_dim
//! 128; docs/fa3.md "V head_dim") in the CPU emulator: dense launches (`plan`) and the serving
//! layouts (`plan_serving`: packed varlen batches, a dense cache with `cache_seqlens`, paged caches
//! by TMA through the block table and by the gathered cp.async path, whose K rows of 24 chunks
//! take one 64-column slab per pass). Each launch is the crate's own plan, run under three
//! scheduler seeds (bit-identical outputs; the emulator checks the mbarrier expect-tx byte counts
//! of K's and V's tiles, which differ here, and the TMA/wgmma ordering), and each sequence is
//! compared with the float64 reference on that sequence alone, with the GPU tests' rule
//! (`max|O - ref| <= 2 max|naive - ref| + floor`, LSE within 2e-3; a sequence with no key:
//! O = 0, LSE = -inf). Unused cache slots hold NaN; outputs are NaN-poisoned by the driver.
//!
//! `cargo test --release --test emulator head_dim_v_fa3::` runs the CI subset; `FLASH_ATTN_EMU=full`
//! adds a seeded random matrix (`FLASH_ATTN_EMU_SEED` replays it). Ran in the emulator only;
//! nothing here ran on a GPU.
use crate::support::cu_seqlens;
use crate::support::emu::addr::{CU_K, CU_Q, K, LSE, O, Q, SEQUSED, TABLE, V};
use crate::support::emu::{check_sequence, matrix_seed, run_launch, unit_exe, LaunchBuf, Mutation};
use crate::support::serving::{values, Rng};
use flash_attn::cuda::plan::{plan, plan_serving, LaunchPlan, Operands, ServingOperands};
use flash_attn::cuda::table::{FAMILIES, FA3_MLA_PREFILL};
use flash_attn::serving::{BatchLayout, KvLayout, QueryLayout};
use flash_attn::{DType, ForwardOptions, Mask, Problem, Tensor};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

/// The row with the instance: FA3 stage 5.
const FAMILY: &str = "fa3s5";
/// Q/K's and V's head dims.
const D: usize = FA3_MLA_PREFILL.0 as usize;
const DV: usize = FA3_MLA_PREFILL.1 as usize;

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}

/// Where the keys of each sequence are.
#[derive(Clone, Debug)]
enum Kv {
    /// A dense launch: k `[batch, sk, hkv, D]`, v `[batch, sk, hkv, DV]` (q dense too).
    Dense(usize),
    /// Packed k/v `[1, total_k, hkv, ..]` with these lengths.
    Packed(Vec<usize>),
    /// A dense cache `[batch, capacity, hkv, ..]`, sequence b using its first `lens[b]` rows.
    Cache { lens: Vec<usize>, capacity: usize },
    /// A paged cache of `page`-key blocks, block ids shuffled, `spare` unused blocks.
    Paged { lens: Vec<usize>, page: usize, spare: usize },
}

/// One emulated launch.
#[derive(Clone, Debug)]
struct Case {
    dtype: DType,
    hq: usize,
    hkv: usize,
    /// Query rows per sequence; `q_packed` false: dense q `[batch, sq, hq, D]` (all equal).
    q_lens: Vec<usize>,
    q_packed: bool,
    kv: Kv,
    opts: ForwardOptions,
    sm_count: u32,
}

impl Case {
    fn name(&self) -> String {
        format!(
            "{FAMILY} ({D}, {DV}) {:?} hq{} hkv{} q{}{:?} {:?} {:?}{}{} sms{}",
            self.dtype,
            self.hq,
            self.hkv,
            if self.q_packed { "packed" } else { "dense" },
            self.q_lens,
            self.kv,
            self.opts.mask,
            self.opts.softcap.map_or(String::new(), |c| format!(" softcap{c}")),
            if self.opts.return_lse { " lse" } else { "" },
            self.sm_count
        )
    }

    fn k_lens(&self) -> Vec<usize> {
        match &self.kv {
            Kv::Dense(sk) => vec![*sk; self.q_lens.len()],
            Kv::Packed(l) | Kv::Cache { lens: l, .. } | Kv::Paged { lens: l, .. } => l.clone(),
        }
    }
}

fn bits(x: &[f32], dtype: DType) -> Vec<u8> {
    let t = Tensor::from_f32(x, dtype, [1, 1, 1, x.len()]).unwrap();
    match t.view().data() {
        flash_attn::Data::F16(s) => s.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        flash_attn::Data::BF16(s) => s.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        _ => unreachable!(),
    }
}

fn from_bits(b: &[u8], dtype: DType) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| {
            let h = u16::from_le_bytes([c[0], c[1]]);
            match dtype {
                DType::BF16 => half::bf16::from_bits(h).to_f32(),
                _ => half::f16::from_bits(h).to_f32(),
            }
        })
        .collect()
}

/// Row of the k/v storage that holds key j of sequence b.
type KeyRow = Box<dyn Fn(usize, usize) -> usize>;

/// The k and v storage (`rows` rows of `hkv` heads: K with D columns, V with DV), NaN where no
/// sequence has a key, and where each sequence's keys are.
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
    let (hkv, dt) = (c.hkv, c.dtype);
    let (rk, rv) = (hkv * D, hkv * DV);
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
        Kv::Paged { page, spare, .. } => {
            let page = *page;
            let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(page)).collect();
            let num_blocks = need.iter().sum::<usize>() + spare;
            let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
            rng.shuffle(&mut ids);
            let max_blocks = need.iter().copied().max().unwrap_or(0) + 1; // one -1 pad at least
            let mut table = vec![-1; batch * max_blocks];
            let mut next = ids.into_iter();
            for b in 0..batch {
                for blk in 0..need[b] {
                    table[b * max_blocks + blk] = next.next().unwrap();
                }
            }
            let t = table.clone();
            (page, num_blocks, Box::new(move |b, j| t[b * max_blocks + j / page] as usize * page + j % page), table, max_blocks)
        }
    };
    let mut k = vec![f32::NAN; batch_dim * rows * rk];
    let mut v = vec![f32::NAN; batch_dim * rows * rv];
    for (b, &l) in lens.iter().enumerate() {
        for j in 0..l {
            let r = key_row(b, j);
            k[r * rk..][..rk].copy_from_slice(&values(rng, rk, dt));
            v[r * rv..][..rv].copy_from_slice(&values(rng, rv, dt));
        }
    }
    KvStore { rows, batch_dim, k, v, key_row, table, max_blocks }
}

/// Runs one case (with `mutation` if any); Ok(worst err / bound over its sequences, the plan)
/// or Err(why, with the emulator's log).
fn run(c: &Case, mutation: Option<&Mutation>) -> Result<(f64, LaunchPlan), String> {
    let mut h = DefaultHasher::new();
    c.name().hash(&mut h);
    let mut rng = Rng::new(h.finish() | 1);
    let (hq, hkv, dt) = (c.hq, c.hkv, c.dtype);
    let batch = c.q_lens.len();
    let k_lens = c.k_lens();
    let q_rows: usize = c.q_lens.iter().sum();
    let cu_q = cu_seqlens(&c.q_lens);
    let q = values(&mut rng, q_rows * hq * D, dt);
    let sq_dense = c.q_lens[0];
    if !c.q_packed {
        assert!(c.q_lens.iter().all(|&l| l == sq_dense), "a dense q has one seqlen");
    }
    let kvs = kv_store(c, &mut rng);

    let q_shape = if c.q_packed { [1, q_rows, hq, D] } else { [batch, sq_dense, hq, D] };
    let o_shape = [q_shape[0], q_shape[1], hq, DV];
    let (k_shape, v_shape) = ([kvs.batch_dim, kvs.rows, hkv, D], [kvs.batch_dim, kvs.rows, hkv, DV]);
    let st = |s: [usize; 4]| [s[1] * s[2] * s[3], s[2] * s[3], s[3]];
    let ops = Operands {
        ptrs: [Q, K, V, O],
        strides: [st(q_shape), st(k_shape), st(v_shape), st(o_shape)],
        lse: if c.opts.return_lse { LSE } else { 0 },
        alibi: 0,
        sinks: 0,
    };
    let seqlens: Vec<i32> = k_lens.iter().map(|&l| l as i32).collect();
    let cu_k = cu_seqlens(&k_lens);
    let pl = if let Kv::Dense(_) = c.kv {
        let t = |x: &[f32], s: [usize; 4]| Tensor::from_f32(x, dt, s).unwrap();
        let (qt, kt, vt) = (t(&q, q_shape), t(&kvs.k, k_shape), t(&kvs.v, v_shape));
        let p = Problem::new(&qt.view(), &kt.view(), &vt.view(), &c.opts).map_err(|e| format!("problem: {e}"))?;
        plan(FAMILY, &p, &ops, c.sm_count).map_err(|e| format!("plan: {e}"))?
    } else {
        let ql = if c.q_packed {
            QueryLayout::Varlen { cu_seqlens: &cu_q, max_seqlen: c.q_lens.iter().copied().max().unwrap_or(0) }
        } else {
            QueryLayout::Dense
        };
        let kl = match &c.kv {
            Kv::Packed(lens) => KvLayout::Varlen { cu_seqlens: &cu_k, max_seqlen: lens.iter().copied().max().unwrap_or(0) },
            Kv::Cache { .. } => KvLayout::Cache { seqlens: &seqlens, new: 0 },
            _ => KvLayout::Paged { block_table: &kvs.table, max_blocks_per_seq: kvs.max_blocks, seqlens: &seqlens, new: 0 },
        };
        let layout = BatchLayout::new(ql, q_shape, kl, k_shape).map_err(|e| format!("layout: {e}"))?;
        let p = layout.launch_problem_v(hq, hkv, (D, DV), dt, &c.opts).map_err(|e| format!("problem: {e}"))?;
        let sops = ServingOperands {
            cu_seqlens_q: if c.q_packed { CU_Q } else { 0 },
            cu_seqlens_k: if matches!(c.kv, Kv::Packed(_)) { CU_K } else { 0 },
            seqused_k: if matches!(c.kv, Kv::Packed(_)) { 0 } else { SEQUSED },
            block_table: if matches!(c.kv, Kv::Paged { .. }) { TABLE } else { 0 },
            ..ServingOperands::default()
        };
        plan_serving(FAMILY, &p, &layout, &ops, &sops, 1, c.sm_count).map_err(|e| format!("plan: {e}"))?
    };
    if pl.tile.head_dim != D as u32 {
        return Err(format!("planned on the hd {} instance, not hd {D}", pl.tile.head_dim));
    }
    let fam = FAMILIES.iter().find(|f| f.name == FAMILY).unwrap();
    let exe = unit_exe(fam, pl.tile, mutation)?;
    let mut bufs = vec![
        LaunchBuf::input("q", Q, bits(&q, dt)),
        LaunchBuf::input("k", K, bits(&kvs.k, dt)),
        LaunchBuf::input("v", V, bits(&kvs.v, dt)),
        LaunchBuf::output("o", O, q_rows * hq * DV * 2),
    ];
    if c.opts.return_lse {
        bufs.push(LaunchBuf::output("lse", LSE, hq * q_rows * 4));
    }
    if c.q_packed {
        bufs.push(LaunchBuf::i32s("cu_seqlens_q", CU_Q, &cu_q));
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
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("emu/head-dim-v-fa3")
        .join(format!("{:016x}{}", h.finish(), mutation.map_or("", |m| m.name)));
    let (log, outs) = run_launch(&exe, &dir, &pl, FAMILY, &[1, 2, 3], &bufs)?;
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
        let ob = &o[q0 * hq * DV..(q0 + sq) * hq * DV];
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
        let (mut kb, mut vb) = (Vec::with_capacity(sk * hkv * D), Vec::with_capacity(sk * hkv * DV));
        for j in 0..sk {
            let r = (kvs.key_row)(b, j);
            kb.extend_from_slice(&kvs.k[r * hkv * D..][..hkv * D]);
            vb.extend_from_slice(&kvs.v[r * hkv * DV..][..hkv * DV]);
        }
        let qt = Tensor::from_f32(&q[q0 * hq * D..(q0 + sq) * hq * D], dt, [1, sq, hq, D]).unwrap();
        let kt = Tensor::from_f32(&kb, dt, [1, sk, hkv, D]).unwrap();
        let vt = Tensor::from_f32(&vb, dt, [1, sk, hkv, DV]).unwrap();
        let lse_rows: &dyn Fn(usize, usize) -> f32 = &lse_at;
        match check_sequence((&qt.view(), &kt.view(), &vt.view()), &c.opts, dt, ob, c.opts.return_lse.then_some(lse_rows)) {
            Ok(ratio) => worst = worst.max(ratio),
            Err(why) => return fail(why),
        }
    }
    Ok((worst, pl))
}

fn check(cases: &[Case]) {
    crate::support::check_each("FA3 (192, 128) cases", cases, Case::name, |c| {
        run(c, None).map(|(ratio, pl)| format!("err/bound {ratio:.3}; {}", pl.note.unwrap_or("dense")))
    });
}

fn case(dtype: DType, (hq, hkv): (usize, usize), q_lens: &[usize], q_packed: bool, kv: Kv) -> Case {
    Case {
        dtype,
        hq,
        hkv,
        q_lens: q_lens.to_vec(),
        q_packed,
        kv,
        opts: ForwardOptions::default().return_lse(true),
        sm_count: 1,
    }
}
fn with(mut c: Case, f: impl FnOnce(&mut Case)) -> Case {
    f(&mut c);
    c
}

/// The table row: stage 5 has the (192, 128) instance (128-key tiles: O has 128 columns), with
/// `HEAD_DIM_V`, within sm_90's 227 KiB.
#[test]
fn fa3s5_has_the_mla_prefill_instance() {
    let fam = FAMILIES.iter().find(|f| f.name == FAMILY).unwrap();
    let t = fam.tiles.iter().find(|t| t.head_dim == D as u32).expect("fa3s5 has no hd 192 tile");
    assert_eq!((t.block_m, t.block_n, t.threads), (128, 128, 384));
    assert_eq!(fam.smem_bytes(t), 218_192);
    assert!(fam.smem_bytes(t) <= 227 * 1024);
}

/// The CI subset: dense causal and not (several key tiles, a partial last tile, sq != sk, GQA),
/// a packed varlen batch with empty and one-key sequences, a dense cache (TMA and the gathered
/// tail), paged caches by TMA through the table (128-key pages) and gathered (16-key pages).
fn subset() -> Vec<Case> {
    use DType::{BF16, F16};
    vec![
        with(case(BF16, (4, 2), &[130, 130], false, Kv::Dense(300)), |c| c.opts.mask = Mask::Causal),
        with(case(F16, (2, 1), &[70], false, Kv::Dense(200)), |c| c.sm_count = 2),
        with(case(BF16, (4, 2), &[0, 1, 130, 77], true, Kv::Packed(vec![5, 0, 300, 129])), |c| {
            c.opts.mask = Mask::Causal;
            c.sm_count = 2;
        }),
        case(F16, (2, 2), &[16, 16], false, Kv::Cache { lens: vec![140, 16], capacity: 300 }),
        with(case(BF16, (2, 2), &[16, 40], true, Kv::Paged { lens: vec![300, 129], page: 128, spare: 2 }), |c| {
            c.opts.mask = Mask::window(40, 7);
            c.opts.softcap = Some(30.0);
        }),
        case(F16, (4, 1), &[1, 1, 1], false, Kv::Paged { lens: vec![200, 37, 1], page: 16, spare: 2 }),
    ]
}

#[test]
fn fa3_head_dim_v_subset() {
    check(&subset());
}

/// The seeded random matrix (FLASH_ATTN_EMU=full): both dtypes, every layout and page size, masks,
/// softcap, GQA, random lengths with 0 and 1, persistent grids of 1-3 CTAs.
#[test]
fn fa3_head_dim_v_matrix() {
    if !full() {
        println!("the FA3 (192, 128) matrix runs with FLASH_ATTN_EMU=full (the subset runs always)");
        return;
    }
    let mut rng = Rng::new(matrix_seed("fa3 head_dim_v matrix", 0x00d5_c0de));
    let masks = [Mask::None, Mask::Causal, Mask::window(33, 5)];
    let mut cases = Vec::new();
    for (i, kind) in ["dense", "packed", "cache", "p1", "p3", "p16", "p128", "p256", "dense", "packed"].into_iter().enumerate() {
        let dtype = if i % 2 == 0 { DType::BF16 } else { DType::F16 };
        let (hq, hkv) = [(4, 2), (4, 1), (2, 2)][i % 3];
        let batch = 1 + i % 3;
        let mut c = match kind {
            "dense" => {
                let (sq, sk) = (1 + (rng.next_u64() % 200) as usize, 1 + (rng.next_u64() % 400) as usize);
                case(dtype, (hq, hkv), &vec![sq; batch], false, Kv::Dense(sk))
            }
            _ => {
                let mut lens = |max: u64| -> Vec<usize> {
                    (0..batch).map(|b| if b == 1 { [0, 1][i % 2] } else { (rng.next_u64() % max) as usize }).collect()
                };
                let decode = kind.starts_with('p') && i % 2 == 0;
                let q_lens = if decode { vec![1; batch] } else { lens(150) };
                let k_lens: Vec<usize> = lens(400).iter().zip(&q_lens).map(|(&k, &q)| k.max(q)).collect();
                let kv = match kind {
                    "packed" => Kv::Packed(k_lens),
                    "cache" => Kv::Cache { capacity: k_lens.iter().copied().max().unwrap_or(0) + 9, lens: k_lens },
                    _ => Kv::Paged { lens: k_lens, page: kind[1..].parse().unwrap(), spare: 3 },
                };
                case(dtype, (hq, hkv), &q_lens, !decode, kv)
            }
        };
        c.opts.mask = masks[i % 3];
        if i % 4 == 3 {
            c.opts.softcap = Some(20.0);
        }
        c.sm_count = 1 + (i % 3) as u32;
        cases.push(c);
    }
    check(&cases);
}

/// A wrong V tile must fail: the consumers reading V's ring slot 1 at K's tile stride (with equal
/// head dims the two strides agree, so only a launch whose V head dim differs can catch it; the
/// emulator's shared-memory bound stops it), V's two 64-column slabs swapped in the PV GEMM (in
/// bounds: caught by the comparison with float64), and (with FLASH_ATTN_EMU=full) the gathered V
/// tile copied with K's 192 columns.
#[test]
fn wrong_v_tile_is_caught() {
    let dense = case(DType::BF16, (2, 1), &[64], false, Kv::Dense(300));
    let mut muts = vec![
        (
            Mutation {
                name: "v_slot_at_k_stride",
                file: "cuda/fa3/preamble.cuh",
                from: "smem_u32(sv + slot * Tr::kVTileBytes)",
                to: "smem_u32(sv + slot * Tr::kKTileBytes)",
                defines: &[],
            },
            dense.clone(),
        ),
        (
            Mutation {
                name: "v_slabs_swapped",
                file: "cuda/fa3/mainloop.cuh",
                from: "Tr::pv_b_offset(kk, nh)",
                to: "Tr::pv_b_offset(kk, nh ^ 1)",
                defines: &[],
            },
            dense,
        ),
    ];
    if full() {
        let paged = case(DType::F16, (2, 2), &[1, 1], false, Kv::Paged { lens: vec![150, 37], page: 16, spare: 2 });
        muts.push((
            Mutation {
                name: "v_gathered_with_k_columns",
                file: "cuda/fa3/pipeline.cuh",
                from: "gather_tile<Tr, Tr::kHeadDimV>(",
                to: "gather_tile<Tr, Tr::kHeadDim>(",
                defines: &[],
            },
            paged,
        ));
    }
    for (m, c) in &muts {
        run(c, None).unwrap_or_else(|e| panic!("{}: the unmutated kernel fails: {e}", c.name()));
        match run(c, Some(m)) {
            Ok((ratio, _)) => panic!("mutation {} passed {} (err/bound {ratio:.3})", m.name, c.name()),
            Err(e) => println!("caught {}:\n{}", m.name, e.lines().filter(|l| !l.starts_with("tmap")).take(4).collect::<Vec<_>>().join("\n")),
        }
    }
}

//! The rotary embedding and `cache_batch_idx` / `cache_leftpad` of `flash_attn_with_kvcache` in
//! the kernels (docs/serving.md "GPU"), run in the CPU emulator exactly as `Engine` launches them:
//! the append kernel (`plan_append`) rotates k_new into the cache and q into a scratch, then
//! the attention (`plan_serving`: FA2, FA3 stages 3-5, FA1 in the full matrix) reads the rotated
//! q and the cache through each sequence's cache row and first key, or through a block table
//! (`rotary_with_paged_caches`).
//!
//! Two checks per case. The cache the append kernel leaves equals, slot for slot, the one the CPU
//! path (`serving::forward_kvcache_append_rotary` / `forward_kvcache_append`, the specification)
//! leaves from the same inputs (rotated rows within one ulp of the dtype: both compute in f32,
//! possibly contracted differently); every other slot, NaN slack included, is unchanged. Each
//! sequence's output is compared with the float64 reference over its keys (rotated in float64 at
//! the positions the CPU defines, `reference::rotary_f64`) with the GPU tests' rule
//! (`max|O - ref| <= 2·max|naive - ref| + floor`, LSE within 2e-3). Cache positions before a
//! sequence's leftpad, after its keys, and the cache rows no sequence uses hold NaN, so a kernel
//! that read one fails. `cargo test --release --test emulator kvcache_rotary::` runs the CI
//! subset; `FLASH_ATTN_EMU=full` adds a seeded random matrix.

use super::serving_fa2::{bits, contiguous, f32s, from_bits, merge_splits};
use crate::support::emu::addr::{ALIBI, K, KNEW, LSE, LSE_ACC, O, O_ACC, Q, SEQUSED, TABLE, V, VNEW};
use crate::support::emu::{check_sequence, matrix_seed, run_launch, unit_exe, LaunchBuf, Mutation};
use crate::support::serving::{slopes, values, Rng};
use flash_attn::cuda::plan::{plan_append, plan_serving, FwdParams, Operands, RotaryOperands, ServingOperands};
use flash_attn::cuda::table::FAMILIES;
use flash_attn::reference::{rotary_f64};
use flash_attn::serving::{
    forward_kvcache_append, forward_kvcache_append_rotary, BatchLayout, BlockTable, CacheRows, KvCacheMut, KvLayout,
    QueryLayout, Rotary,
};
use flash_attn::{DType, Element, ForwardOptions, Mask, Tensor};
use std::hash::{Hash, Hasher};
use std::path::Path;

// Device addresses of this module's own buffers (beside support/emu's map).
const BATCH_IDX: u64 = 0x79_0000_0000;
const LEFTPAD: u64 = 0x7A_0000_0000;
const COS: u64 = 0x7B_0000_0000;
const SIN: u64 = 0x7C_0000_0000;
const Q_ROT: u64 = 0x7D_0000_0000;

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}

/// One emulated call: a dense cache `[rows, capacity, hkv, d]`, sequence b in cache row
/// `batch_idx[b]` (else b) holding keys at positions `leftpad[b]..cached[b]`, `new` rows
/// appended, a dense q of `sq` rows per sequence.
#[derive(Clone, Debug)]
struct Case {
    family: &'static str,
    dtype: DType,
    d: usize,
    hq: usize,
    hkv: usize,
    cached: Vec<usize>,
    leftpad: Option<Vec<usize>>,
    batch_idx: Option<Vec<usize>>,
    rows: usize,
    capacity: usize,
    new: usize,
    sq: usize,
    /// (rotary_dim, interleaved); only with `new > 0` (the rotary belongs to the append).
    rotary: Option<(usize, bool)>,
    /// A paged cache of this many keys per block instead of the dense one (no batch_idx or
    /// leftpad: FlashAttention has neither with a block table): `capacity / page` blocks per
    /// sequence, block ids shuffled, two spare blocks.
    page: Option<usize>,
    mask: Mask,
    alibi: bool,
    splits: usize,
    seed: u64,
}

impl Case {
    fn name(&self) -> String {
        format!(
            "{} {:?} d{} h{}/{} cached{:?} leftpad{:?} batch_idx{:?} rows{} cap{} new{} sq{} rotary{:?} {:?}{} splits{}{}",
            self.family,
            self.dtype,
            self.d,
            self.hq,
            self.hkv,
            self.cached,
            self.leftpad,
            self.batch_idx,
            self.rows,
            self.capacity,
            self.new,
            self.sq,
            self.rotary,
            self.mask,
            if self.alibi { " alibi" } else { "" },
            self.splits,
            self.page.map_or(String::new(), |p| format!(" page{p}"))
        )
    }
    fn batch(&self) -> usize {
        self.cached.len()
    }
    fn pad(&self, b: usize) -> usize {
        self.leftpad.as_ref().map_or(0, |p| p[b])
    }
    fn cache_row(&self, b: usize) -> usize {
        self.batch_idx.as_ref().map_or(b, |i| i[b])
    }
    fn opts(&self) -> ForwardOptions {
        let mut o = ForwardOptions::default().mask(self.mask).return_lse(true);
        if self.alibi {
            o.alibi_slopes = Some(slopes(self.hq).into());
        }
        o
    }
    /// FlashAttention's rule (src/serving/rotary.rs): q's rows advance under a causal mask or a
    /// window side below the cache's capacity.
    fn q_rows_advance(&self) -> bool {
        let bounded = |x: i64| usize::try_from(x).is_ok_and(|x| x < self.capacity);
        match self.mask {
            Mask::Causal => true,
            Mask::Window { left, right, causal } => causal || bounded(left) || bounded(right),
            _ => false,
        }
    }
}

fn i32s(v: &[usize]) -> Vec<i32> {
    v.iter().map(|&x| x as i32).collect()
}

/// Tables `[seqlen_ro, rd / 2]`: position p turns pair t by p·10000^(-2t/rd) (the usual
/// frequencies), in f32.
fn tables(seqlen_ro: usize, rd: usize) -> (Vec<f32>, Vec<f32>) {
    let half = rd / 2;
    let angle = |p: usize, t: usize| p as f64 * 10000f64.powf(-2.0 * t as f64 / rd as f64);
    let cos = (0..seqlen_ro * half).map(|x| angle(x / half, x % half).cos() as f32).collect();
    let sin = (0..seqlen_ro * half).map(|x| angle(x / half, x % half).sin() as f32).collect();
    (cos, sin)
}

/// The CPU path on the inputs (the cache as f32 values of `T`): the cache it leaves.
#[allow(clippy::too_many_arguments)]
fn cpu_append<T: Element>(
    c: &Case,
    (k, v): (&[f32], &[f32]),
    (q, knew, vnew): (&[f32], &[f32], &[f32]),
    seqlens: &[i32],
    (shape, table, rows): ([usize; 4], Option<BlockTable<'_>>, CacheRows<'_>),
    rot: Option<Rotary<'_>>,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let (mut kt, mut vt): (Vec<T>, Vec<T>) =
        (k.iter().map(|&x| T::from_f32(x)).collect(), v.iter().map(|&x| T::from_f32(x)).collect());
    let (b, dt) = (c.batch(), T::DTYPE);
    let qt = Tensor::from_f32(q, dt, [b, c.sq, c.hq, c.d]).unwrap();
    let kn = Tensor::from_f32(knew, dt, [b, c.new, c.hkv, c.d]).unwrap();
    let vn = Tensor::from_f32(vnew, dt, [b, c.new, c.hkv, c.d]).unwrap();
    let mut cache = KvCacheMut {
        k: &mut kt,
        v: &mut vt,
        shape,
        seqlens,
        block_table: table,
        batch_idx: rows.batch_idx,
        leftpad: rows.leftpad,
    };
    let opts = c.opts();
    match rot {
        Some(r) => forward_kvcache_append_rotary(&qt, &mut cache, &kn, &vn, &r, &opts),
        None => forward_kvcache_append(&qt, &mut cache, &kn, &vn, &opts),
    }
    .map_err(|e| format!("CPU path: {e}"))?;
    Ok((kt.iter().map(|x| x.to_f32()).collect(), vt.iter().map(|x| x.to_f32()).collect()))
}

/// `got` equals `want` slot for slot: equal (NaN included), or within one ulp of the dtype.
fn same_cache(what: &str, got: &[f32], want: &[f32], dtype: DType) -> Result<(), String> {
    let ulp = if dtype == DType::BF16 { 2f32.powi(-7) } else { 2f32.powi(-10) };
    for (at, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = g == w || (g.is_nan() && w.is_nan()) || (g - w).abs() <= ulp * g.abs().max(w.abs());
        if !ok {
            return Err(format!("append: cache {what} element {at} is {g}, the CPU path's {w}"));
        }
    }
    Ok(())
}

/// Row `row` (`[heads][d]`) rotated in float64 at `pos` and rounded to `dtype`.
fn rotated(row: &[f32], heads: usize, d: usize, rot: Option<(usize, bool)>, tab: &(Vec<f32>, Vec<f32>), pos: usize, dtype: DType) -> Vec<f32> {
    let Some((rd, inter)) = rot else { return row.to_vec() };
    let half = rd / 2;
    let (cos, sin) = (&tab.0[pos * half..][..half], &tab.1[pos * half..][..half]);
    let mut out = Vec::with_capacity(heads * d);
    for h in 0..heads {
        let x: Vec<f64> = row[h * d..][..d].iter().map(|&x| x as f64).collect();
        out.extend(rotary_f64(&x, cos, sin, inter).iter().map(|&y| dtype.round(y as f32)));
    }
    out
}

fn run(c: &Case) -> Result<f64, String> {
    run_mutated(c, None)
}

fn run_mutated(c: &Case, mutation: Option<&Mutation>) -> Result<f64, String> {
    let mut rng = Rng::new(c.seed | 1);
    let (hq, hkv, d, dtype, batch) = (c.hq, c.hkv, c.d, c.dtype, c.batch());
    let row = hkv * d;
    // The paged cache's block table (shuffled ids, two spare blocks), and where key `pos` of
    // sequence b lies: its slot in the cache storage.
    let (shape, table, max_blocks) = match c.page {
        None => ([c.rows, c.capacity, hkv, d], Vec::new(), 0),
        Some(page) => {
            let max_blocks = c.capacity / page;
            let num_blocks = batch * max_blocks + 2;
            let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
            rng.shuffle(&mut ids);
            ([num_blocks, page, hkv, d], ids[..batch * max_blocks].to_vec(), max_blocks)
        }
    };
    let slot = |b: usize, pos: usize| match c.page {
        None => c.cache_row(b) * c.capacity + pos,
        Some(page) => table[b * max_blocks + pos / page] as usize * page + pos % page,
    };
    let n: usize = shape.iter().product();
    let (mut kc, mut vc) = (vec![f32::NAN; n], vec![f32::NAN; n]);
    for b in 0..batch {
        for pos in c.pad(b)..c.cached[b] {
            let at = slot(b, pos) * row;
            kc[at..at + row].copy_from_slice(&values(&mut rng, row, dtype));
            vc[at..at + row].copy_from_slice(&values(&mut rng, row, dtype));
        }
    }
    let knew = values(&mut rng, batch * c.new * row, dtype);
    let vnew = values(&mut rng, batch * c.new * row, dtype);
    let q_shape = [batch, c.sq, hq, d];
    let qx = values(&mut rng, q_shape.iter().product(), dtype);
    let tab = c.rotary.map_or((Vec::new(), Vec::new()), |(rd, _)| tables(c.capacity, rd));
    let seqlens = i32s(&c.cached);
    let (idx, pad) = (c.batch_idx.as_deref().map(i32s), c.leftpad.as_deref().map(i32s));
    let rows = CacheRows { batch_idx: idx.as_deref(), leftpad: pad.as_deref() };
    let block_table = c.page.map(|_| BlockTable { ids: &table, max_blocks_per_seq: max_blocks });
    let rot = c.rotary.map(|(rd, inter)| Rotary::new(&tab.0, &tab.1, rd, inter));

    // The cache the CPU path leaves (the specification of the append).
    let cpu = match (c.new, dtype) {
        (0, _) => (kc.clone(), vc.clone()),
        (_, DType::BF16) => {
            cpu_append::<half::bf16>(c, (&kc, &vc), (&qx, &knew, &vnew), &seqlens, (shape, block_table, rows), rot)?
        }
        _ => cpu_append::<half::f16>(c, (&kc, &vc), (&qx, &knew, &vnew), &seqlens, (shape, block_table, rows), rot)?,
    };

    let kl = match c.page {
        None => KvLayout::Cache { seqlens: &seqlens, new: c.new },
        Some(_) => KvLayout::Paged { block_table: &table, max_blocks_per_seq: max_blocks, seqlens: &seqlens, new: c.new },
    };
    let layout =
        BatchLayout::with_cache_rows(QueryLayout::Dense, q_shape, kl, shape, rows).map_err(|e| format!("layout: {e}"))?;
    let opts = c.opts();
    let p = layout.launch_problem(hq, hkv, d, dtype, &opts).map_err(|e| format!("problem: {e}"))?;
    let mut ops = Operands {
        ptrs: [Q, K, V, O],
        strides: [contiguous(q_shape), contiguous(shape), contiguous(shape), contiguous(q_shape)],
        lse: LSE,
        alibi: if c.alibi { ALIBI } else { 0 },
        sinks: 0,
    };
    let advance = c.q_rows_advance();
    let mut sops = ServingOperands {
        seqused_k: SEQUSED,
        block_table: if c.page.is_some() { TABLE } else { 0 },
        o_accum: O_ACC,
        lse_accum: LSE_ACC,
        knew: KNEW,
        vnew: VNEW,
        new_strides: [contiguous([batch, c.new, hkv, d]); 2],
        cache_batch_idx: if idx.is_some() { BATCH_IDX } else { 0 },
        cache_leftpad: if pad.is_some() { LEFTPAD } else { 0 },
        rotary: c.rotary.map(|(rotary_dim, interleaved)| RotaryOperands {
            cos: COS,
            sin: SIN,
            rotary_dim,
            interleaved,
            q_rows_advance: advance,
            q_rot: Q_ROT,
        }),
        ..ServingOperands::default()
    };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    c.name().hash(&mut h);
    mutation.map(|m| m.name).hash(&mut h);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("emu/kvcache_rotary").join(format!("{:016x}", h.finish()));
    let index_bufs = |fp: &FwdParams| {
        let mut v = vec![LaunchBuf::i32s("seqused_k", SEQUSED, &seqlens)];
        if fp.block_table != 0 {
            v.push(LaunchBuf::i32s("block_table", TABLE, &table));
        }
        if fp.cache_batch_idx != 0 {
            v.push(LaunchBuf::i32s("cache_batch_idx", BATCH_IDX, idx.as_deref().unwrap_or_default()));
        }
        if fp.cache_leftpad != 0 {
            v.push(LaunchBuf::i32s("cache_leftpad", LEFTPAD, pad.as_deref().unwrap_or_default()));
        }
        if fp.lse != 0 {
            v.push(LaunchBuf::output("lse", LSE, fp.lse_rows() * 4));
        }
        if fp.alibi_slopes != 0 {
            v.push(LaunchBuf::input("alibi", ALIBI, slopes(hq).iter().flat_map(|x| x.to_le_bytes()).collect()));
        }
        v
    };
    let fa2 = FAMILIES.iter().find(|f| f.name == "fa2").unwrap();
    let f32_bytes = |x: &[f32]| x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();

    // The append launch: k_new (rotated) into the cache, q rotated into its scratch.
    let (mut k_bytes, mut v_bytes, mut q_bytes) = (bits(&kc, dtype), bits(&vc, dtype), bits(&qx, dtype));
    if c.new > 0 {
        let pl = plan_append(&p, &layout, &ops, &sops).map_err(|e| format!("plan_append: {e}"))?;
        let exe = unit_exe(fa2, pl.tile, mutation)?;
        let mut bufs = vec![
            LaunchBuf::inout("k", K, k_bytes.clone()),
            LaunchBuf::inout("v", V, v_bytes.clone()),
            LaunchBuf::input("knew", KNEW, bits(&knew, dtype)),
            LaunchBuf::input("vnew", VNEW, bits(&vnew, dtype)),
            LaunchBuf::input("q", Q, q_bytes.clone()),
        ];
        bufs.extend(index_bufs(&pl.params));
        if c.rotary.is_some() {
            bufs.push(LaunchBuf::input("rotary_cos", COS, f32_bytes(&tab.0)));
            bufs.push(LaunchBuf::input("rotary_sin", SIN, f32_bytes(&tab.1)));
            bufs.push(LaunchBuf::output("q_rot", Q_ROT, qx.len() * 2));
        } else {
            bufs.push(LaunchBuf::input("o", O, vec![0; 16]));
        }
        let (log, outs) = run_launch(&exe, &dir.join("append"), &pl, "fa2", &[1, 2], &bufs)?;
        let (gk, gv) = (from_bits(&outs["k"], dtype), from_bits(&outs["v"], dtype));
        same_cache("k", &gk, &cpu.0, dtype).map_err(|e| format!("{e}\n{log}"))?;
        same_cache("v", &gv, &cpu.1, dtype).map_err(|e| format!("{e}\n{log}"))?;
        (k_bytes, v_bytes) = (outs["k"].clone(), outs["v"].clone());
        if c.rotary.is_some() {
            q_bytes = outs["q_rot"].clone();
            ops.ptrs[0] = Q_ROT;
        }
    }

    // The attention over the cache (the rotary is the append's: its launch does not carry it).
    sops.rotary = None;
    let pl = plan_serving(c.family, &p, &layout, &ops, &sops, c.splits, 1).map_err(|e| format!("plan: {e}"))?;
    let fam = FAMILIES.iter().find(|f| f.name == c.family).unwrap();
    let exe = unit_exe(fam, pl.tile, mutation)?;
    let fp = pl.params;
    let lse_rows = fp.lse_rows();
    let mut bufs = vec![
        LaunchBuf::input("q", ops.ptrs[0], q_bytes),
        LaunchBuf::input("k", K, k_bytes),
        LaunchBuf::input("v", V, v_bytes),
        LaunchBuf::output("o", O, qx.len() * 2),
    ];
    bufs.extend(index_bufs(&fp));
    if fp.knew != 0 {
        // Stubs: the attention reads the new rows from the cache.
        bufs.push(LaunchBuf::input("knew", KNEW, vec![0; 16]));
        bufs.push(LaunchBuf::input("vnew", VNEW, vec![0; 16]));
    }
    if c.splits > 1 {
        bufs.push(LaunchBuf::output("o_accum", O_ACC, c.splits * lse_rows * d * 4));
        bufs.push(LaunchBuf::output("lse_accum", LSE_ACC, c.splits * lse_rows * 4));
    }
    let (log, outs) = run_launch(&exe, &dir, &pl, c.family, &[1, 2], &bufs)?;
    let (o, lse) = if c.splits > 1 {
        merge_splits(&outs, c.splits, lse_rows, q_shape, &fp, &p)?
    } else {
        (from_bits(&outs["o"], dtype), f32s(&outs["lse"]))
    };

    // Per sequence, against float64 over its keys as the CPU defines them.
    let mut worst = 0.0f64;
    for b in 0..batch {
        let (pad, cached) = (c.pad(b), c.cached[b]);
        let sk = cached + c.new - pad;
        let (mut qb, mut kb, mut vb, mut ob) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..c.sq {
            let at = (b * c.sq + i) * hq * d;
            let pos = cached + if advance { i } else { 0 };
            qb.extend(rotated(&qx[at..at + hq * d], hq, d, c.rotary, &tab, pos, dtype));
            ob.extend_from_slice(&o[at..at + hq * d]);
        }
        for pos in pad..cached + c.new {
            if pos < cached {
                let at = slot(b, pos) * row;
                kb.extend_from_slice(&kc[at..at + row]);
                vb.extend_from_slice(&vc[at..at + row]);
            } else {
                let at = (b * c.new + pos - cached) * row;
                kb.extend(rotated(&knew[at..at + row], hkv, d, c.rotary, &tab, pos, dtype));
                vb.extend_from_slice(&vnew[at..at + row]);
            }
        }
        let name = || format!("sequence {b} (sq {}, sk {sk})", c.sq);
        if sk == 0 {
            let lse_inf = (0..hq * c.sq).all(|r| lse[(b * hq + r / c.sq) * c.sq + r % c.sq] == f32::NEG_INFINITY);
            if ob.iter().any(|&x| x != 0.0) || !lse_inf {
                return Err(format!("{}: no keys but O != 0 or LSE != -inf\n{log}", name()));
            }
            continue;
        }
        let qt = Tensor::from_f32(&qb, dtype, [1, c.sq, hq, d]).unwrap();
        let kt = Tensor::from_f32(&kb, dtype, [1, sk, hkv, d]).unwrap();
        let vt = Tensor::from_f32(&vb, dtype, [1, sk, hkv, d]).unwrap();
        let lse_at = |h: usize, i: usize| lse[(b * hq + h) * c.sq + i];
        let ratio = check_sequence((&qt.view(), &kt.view(), &vt.view()), &opts, dtype, &ob, Some(&lse_at))
            .map_err(|e| format!("{}: {e}\n{log}", name()))?;
        worst = worst.max(ratio);
    }
    Ok(worst)
}

fn check(cases: &[Case]) {
    crate::support::check_each("kvcache rotary cases", cases, Case::name, |c| {
        run(c).map(|r| format!("err/bound {r:.3}"))
    });
}

/// A case of 3 sequences in a 5-row cache of capacity 48: cache rows permuted (sequence b in
/// row 4, 0, 2), leftpads 0, 5, 2 under 9, 20, 14 cached keys.
fn base(family: &'static str, dtype: DType, d: usize, (hq, hkv): (usize, usize), new: usize) -> Case {
    Case {
        family,
        dtype,
        d,
        hq,
        hkv,
        cached: vec![9, 20, 14],
        leftpad: Some(vec![0, 5, 2]),
        batch_idx: Some(vec![4, 0, 2]),
        rows: 5,
        capacity: 48,
        new,
        sq: new.max(1),
        rotary: None,
        page: None,
        mask: Mask::Causal,
        alibi: false,
        splits: 1,
        seed: 11,
    }
}

/// `base` on a paged cache of `page`-key blocks, `blocks` per sequence (the capacity the rotary
/// tables and q's positions count).
fn paged(c: Case, page: usize, blocks: usize) -> Case {
    Case { page: Some(page), capacity: page * blocks, leftpad: None, batch_idx: None, rows: c.batch(), ..c }
}

/// FA2: interleaved and half-split, rotary_dim below and equal to head_dim, appends of 1-4 rows,
/// q at advancing positions (causal, local) and at one position (no mask), split-KV, ALiBi
/// counted from the leftpad.
#[test]
fn fa2_rotary_batch_idx_leftpad() {
    use DType::{BF16, F16};
    let mut cases = vec![
        Case { rotary: Some((64, true)), ..base("fa2", F16, 64, (4, 2), 3) },
        Case { rotary: Some((32, false)), mask: Mask::None, splits: 3, ..base("fa2", BF16, 128, (8, 2), 1) },
        Case { rotary: Some((64, false)), mask: Mask::window(6, 0), alibi: true, batch_idx: None, rows: 3, ..base("fa2", F16, 64, (2, 2), 4) },
        Case { rotary: Some((16, true)), mask: Mask::None, leftpad: None, ..base("fa2", BF16, 64, (4, 1), 2) },
        // No rotary: the append and the attention through cache_batch_idx / cache_leftpad alone.
        Case { splits: 2, ..base("fa2", F16, 64, (4, 2), 2) },
        Case { sq: 5, ..base("fa2", BF16, 128, (2, 1), 0) },
    ];
    if full() {
        cases.extend(matrix(&["fa2", "fa1"], 0xF2, 16));
    }
    check(&cases);
}

/// Paged caches: the append kernel rotates k_new into the slots the block table names (its cache
/// slot for slot as the CPU path's, every other slot and the spare blocks unchanged), FA2 and FA3
/// read them through the table (FA3 stage 5 gathered at 16-key pages, by TMA at 128).
#[test]
fn rotary_with_paged_caches() {
    use DType::{BF16, F16};
    check(&[
        paged(Case { rotary: Some((64, true)), ..base("fa2", F16, 64, (4, 2), 3) }, 16, 2),
        paged(Case { rotary: Some((32, false)), mask: Mask::None, splits: 2, ..base("fa2", BF16, 128, (8, 2), 2) }, 3, 9),
        paged(Case { rotary: Some((64, false)), ..base("fa3s5", BF16, 128, (4, 2), 2) }, 16, 2),
        paged(Case { rotary: Some((128, true)), mask: Mask::None, ..base("fa3s5", F16, 128, (2, 1), 1) }, 128, 1),
    ]);
}

/// FA3 stages 4 and 5 (and 3 in the full matrix) after the same append kernel: the rotated q from
/// the scratch, TMA and gathered K/V tiles of a cache row and first key per sequence.
#[test]
fn fa3_rotary_batch_idx_leftpad() {
    use DType::{BF16, F16};
    let mut cases = vec![
        Case { rotary: Some((64, true)), ..base("fa3s5", BF16, 128, (4, 2), 2) },
        Case { rotary: Some((64, false)), mask: Mask::None, ..base("fa3s4", F16, 64, (2, 1), 1) },
        Case { cached: vec![150, 20, 140], capacity: 300, sq: 3, ..base("fa3s5", F16, 64, (2, 2), 0) },
    ];
    if full() {
        cases.extend(matrix(&["fa3s3", "fa3s4", "fa3s5"], 0xF3, 12));
    }
    check(&cases);
}

/// `n` seeded random cases over `families` (split-KV only where the family has it: not FA3).
fn matrix(families: &[&'static str], fixed: u64, n: u64) -> Vec<Case> {
    let mut rng = Rng::new(matrix_seed("kvcache_rotary matrix", fixed));
    (0..n)
        .map(|seed| {
            let family = families[rng.below(families.len())];
            let d = [64, 128][rng.below(2)];
            let batch = 1 + rng.below(4);
            // cache_batch_idx: distinct rows of a pool of up to batch + 2 (without it, one per sequence).
            let with_idx = rng.below(3) != 0;
            let rows = if with_idx { batch + rng.below(3) } else { batch };
            let mut perm: Vec<usize> = (0..rows).collect();
            rng.shuffle(&mut perm);
            let cached: Vec<usize> = (0..batch).map(|_| [0, 1, 1 + rng.below(40), 100 + rng.below(160)][rng.below(4)]).collect();
            let new = rng.below(5);
            let sq = if new > 0 { new } else { 1 + rng.below(6) };
            let capacity = cached.iter().max().unwrap() + new.max(sq) + rng.below(9);
            let rotary = (new > 0 && rng.below(4) != 0).then(|| (2 * (1 + rng.below(d / 2)), rng.below(2) == 0));
            let hkv = 1 + rng.below(2);
            Case {
                family,
                dtype: [DType::F16, DType::BF16][rng.below(2)],
                d,
                hq: hkv * [1, 2, 4][rng.below(3)],
                hkv,
                leftpad: (rng.below(3) != 0).then(|| cached.iter().map(|&c| rng.below(c + 1)).collect()),
                batch_idx: with_idx.then(|| perm[..batch].to_vec()),
                cached,
                rows,
                capacity,
                new,
                sq,
                rotary,
                page: None,
                mask: [Mask::None, Mask::Causal, Mask::window(rng.below(30) as i64, rng.below(3) as i64)][rng.below(3)],
                alibi: !family.starts_with("fa3") && rng.below(4) == 0,
                splits: if family.starts_with("fa3") { 1 } else { [1, 1, 2, 3][rng.below(4)] },
                seed,
            }
        })
        .collect()
}

/// Each mistake these tests exist for fails a CI case: the pairings swapped, q rotated at one
/// position under a causal mask, the leftpad ignored by the per-sequence view, the cache row of
/// cache_batch_idx ignored.
#[test]
fn kvcache_rotary_mutations_are_caught() {
    let rot = Case { rotary: Some((64, true)), ..base("fa2", DType::F16, 64, (4, 2), 3) };
    let plain = base("fa2", DType::F16, 64, (4, 2), 2);
    let muts = [
        (
            Mutation {
                name: "rotary_pairing_swapped",
                file: "cuda/common/append_kv.cuh",
                from: "const bool inter = (p.flags & FA_FLAG_ROTARY_INTERLEAVED) != 0u;",
                to: "const bool inter = (p.flags & FA_FLAG_ROTARY_INTERLEAVED) == 0u;",
                defines: &[],
            },
            rot.clone(),
        ),
        (
            Mutation {
                name: "rotary_q_rows_do_not_advance",
                file: "cuda/common/append_kv.cuh",
                from: "(p.flags & FA_FLAG_ROTARY_Q_ADVANCE) != 0u ? i : 0",
                to: "(p.flags & FA_FLAG_ROTARY_Q_ADVANCE) != 0u ? 0 : 0",
                defines: &[],
            },
            rot,
        ),
        (
            Mutation { name: "leftpad_ignored", file: "cuda/common/seqlen.cuh", from: "s.sk -= s.kv_row0;", to: "s.kv_row0 = 0;", defines: &[] },
            plain.clone(),
        ),
        (
            Mutation {
                name: "cache_batch_idx_ignored",
                file: "cuda/common/seqlen.cuh",
                from: "s.kv_batch = reinterpret_cast<const int32_t*>(p.cache_batch_idx)[b];",
                to: "s.kv_batch = b;",
                defines: &[],
            },
            plain,
        ),
    ];
    for (m, c) in &muts {
        assert!(run(c).is_ok(), "{}: the unmutated case must pass", m.name);
        match run_mutated(c, Some(m)) {
            Ok(r) => panic!("mutation {} was not caught (err/bound {r:.3})", m.name),
            Err(e) => assert!(
                e.contains("max |O - ref|") || e.contains("LSE") || e.contains("append: cache"),
                "mutation {}: unexpected failure {e}",
                m.name
            ),
        }
    }
}

//! The serving paths of the kernels (docs/serving.md "GPU"), run in the CPU emulator
//! (cuda/test/emu) exactly as `Engine` would launch them (`cuda::plan::plan_serving`): packed
//! (varlen) q and k/v, dense caches with `cache_seqlens`, paged caches of any page size with
//! shuffled and shared block tables, split-KV (the splits merged on the host with
//! `serving::merge_states_n`, the combine kernel's arithmetic), and the KV append kernel.
//!
//! Each sequence is compared with the float64 reference run on that sequence alone, with the GPU
//! tests' rule (`max|O - ref| <= 2·max|naive - ref| + floor`, LSE within 2e-3); cache slots past
//! a sequence's keys (and unused blocks) hold NaN, so a kernel that read one would produce NaN.
//! `cargo test --test emulator serving_fa2::` runs a representative subset; `FLASH_ATTN_EMU=full`
//! adds a seeded random matrix (docs/emulator.md).

use crate::support::emu::{check_sequence, run_launch, unit_exe, LaunchBuf, Mutation};
use crate::support::cu_seqlens;
use crate::support::emu::addr::{ALIBI, CU_K, CU_Q, K, KNEW, LSE, LSE_ACC, O, O_ACC, Q, SEQUSED, SINKS, TABLE, V, VNEW};
use flash_attn::cuda::plan::{plan_append, plan_serving, FwdParams, LaunchPlan, Operands, ServingOperands};
use flash_attn::cuda::table::FAMILIES;
use flash_attn::serving::layout::{BatchLayout, KvLayout, QueryLayout};
use flash_attn::serving::merge_states_n;
use flash_attn::{DType, ForwardOptions, Mask, Problem, Tensor, TensorView};
use crate::support::serving::{sinks, slopes, values, Rng};
use std::collections::HashMap;
use std::path::Path;

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}

/// Where the keys of a case live.
#[derive(Clone, Debug)]
pub(super) enum Kv {
    /// Packed `[1, total_k, hkv, d]` with these lengths.
    Varlen(Vec<usize>),
    /// A dense cache `[batch, max + extra, hkv, d]` holding these lengths.
    Cache { lens: Vec<usize>, extra: usize },
    /// A paged cache `[num_blocks, page, hkv, d]`: blocks shuffled, `spare` unused ones, and with
    /// `share` every sequence's first full pages are sequence 0's (prefix sharing).
    Paged { lens: Vec<usize>, page: usize, share: bool, spare: usize, extra_table: usize },
}

impl Kv {
    fn lens(&self) -> &[usize] {
        match self {
            Kv::Varlen(l) | Kv::Cache { lens: l, .. } | Kv::Paged { lens: l, .. } => l,
        }
    }
}

/// One emulated serving launch.
#[derive(Clone, Debug)]
pub(super) struct SCase {
    /// The table row whose kernel runs ("fa2", or "fa2v" for V's own head dim).
    pub(super) family: &'static str,
    pub(super) dtype: DType,
    pub(super) d: usize,
    /// V's (and O's) head dim: `d` but in the fa2v row's pairs.
    pub(super) dv: usize,
    pub(super) hq: usize,
    pub(super) hkv: usize,
    /// `Err(sq)`: a dense q of `sq` rows per sequence; `Ok(lens)`: packed with these lengths.
    pub(super) q: Result<Vec<usize>, usize>,
    pub(super) kv: Kv,
    pub(super) mask: Mask,
    pub(super) softcap: Option<f32>,
    pub(super) alibi: bool,
    /// Sink logits (support/serving.rs `sinks`): in the unsplit epilogue, or in the merge of the
    /// splits (which leave them out).
    pub(super) sinks: bool,
    pub(super) lse: bool,
    pub(super) splits: usize,
    /// Rows appended by this call (a cache layout): the lengths in `kv` include them; the append
    /// kernel writes them first, then the attention reads the cache.
    pub(super) new: usize,
    pub(super) seed: u64,
}

impl SCase {
    fn name(&self) -> String {
        format!(
            "{} {:?} d{}/{} h{}/{} q{:?} kv{:?} {:?}{}{}{}{} splits{} new{}",
            self.family,
            self.dtype,
            self.d,
            self.dv,
            self.hq,
            self.hkv,
            self.q,
            self.kv,
            self.mask,
            self.softcap.map_or(String::new(), |c| format!(" softcap{c}")),
            if self.alibi { " alibi" } else { "" },
            if self.sinks { " sinks" } else { "" },
            if self.lse { " lse" } else { "" },
            self.splits,
            self.new
        )
    }
    fn batch(&self) -> usize {
        self.kv.lens().len()
    }
    fn opts(&self) -> ForwardOptions {
        let mut o = ForwardOptions::default().mask(self.mask).return_lse(self.lse);
        o.softcap = self.softcap;
        if self.alibi {
            o.alibi_slopes = Some(slopes(self.hq).into());
        }
        if self.sinks {
            o = o.sinks(sinks(self.hq));
        }
        o
    }
}

pub(super) fn bits(x: &[f32], dtype: DType) -> Vec<u8> {
    x.iter()
        .flat_map(|&v| match dtype {
            DType::BF16 => half::bf16::from_f32(v).to_bits().to_le_bytes(),
            _ => half::f16::from_f32(v).to_bits().to_le_bytes(),
        })
        .collect()
}
pub(super) fn from_bits(b: &[u8], dtype: DType) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| {
            let u = u16::from_le_bytes([c[0], c[1]]);
            match dtype {
                DType::BF16 => half::bf16::from_bits(u).to_f32(),
                _ => half::f16::from_bits(u).to_f32(),
            }
        })
        .collect()
}
pub(super) fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
pub(super) fn contiguous(s: [usize; 4]) -> [usize; 3] {
    [s[1] * s[2] * s[3], s[2] * s[3], s[3]]
}

/// The cache storage of a case: shape, NaN-filled contents with each sequence's keys placed, the
/// block table (paged), and the logical keys/values per sequence `[sk_b][hkv][d]` (values `dv`).
struct Store {
    /// k's shape; v's is the same with `dv` last.
    shape: [usize; 4],
    k: Vec<f32>,
    v: Vec<f32>,
    table: Vec<i32>,
    max_blocks: usize,
    logical_k: Vec<Vec<f32>>,
    logical_v: Vec<Vec<f32>>,
}

fn build_store(c: &SCase, rng: &mut Rng) -> Store {
    let (row, vrow) = (c.hkv * c.d, c.hkv * c.dv);
    let lens = c.kv.lens();
    let batch = lens.len();
    let mut logical_k: Vec<Vec<f32>> = lens.iter().map(|&l| values(rng, l * row, c.dtype)).collect();
    let mut logical_v: Vec<Vec<f32>> = lens.iter().map(|&l| values(rng, l * vrow, c.dtype)).collect();
    let (shape, table, max_blocks) = match &c.kv {
        Kv::Varlen(_) => ([1, lens.iter().sum(), c.hkv, c.d], Vec::new(), 0),
        Kv::Cache { extra, .. } => ([batch, lens.iter().copied().max().unwrap_or(0) + extra, c.hkv, c.d], Vec::new(), 0),
        Kv::Paged { page, share, spare, extra_table, .. } => {
            let ps = *page;
            let pages: Vec<usize> = lens.iter().map(|l| l.div_ceil(ps)).collect();
            // Only cached pages are shared: two sequences appending into one slot is refused.
            let cached = |b: usize| lens[b] - c.new;
            let shared: Vec<usize> =
                (0..batch).map(|b| if *share && b > 0 { (cached(0) / ps).min(cached(b) / ps) } else { 0 }).collect();
            let own: usize = (0..batch).map(|b| pages[b] - shared[b]).sum();
            let num_blocks = (own + spare).max(1);
            let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
            rng.shuffle(&mut ids);
            let max_blocks = pages.iter().copied().max().unwrap_or(0) + extra_table;
            let mut table = vec![-1i32; batch * max_blocks];
            let mut next = ids.into_iter();
            for b in 0..batch {
                for p in 0..pages[b] {
                    table[b * max_blocks + p] = if p < shared[b] { table[p] } else { next.next().unwrap() };
                }
                let (n, nv) = (shared[b] * ps * row, shared[b] * ps * vrow);
                let (sk, sv) = (logical_k[0][..n].to_vec(), logical_v[0][..nv].to_vec());
                logical_k[b][..n].copy_from_slice(&sk);
                logical_v[b][..nv].copy_from_slice(&sv);
            }
            ([num_blocks, ps, c.hkv, c.d], table, max_blocks)
        }
    };
    let slots = shape[0] * shape[1];
    let (mut k, mut v) = (vec![f32::NAN; slots * row], vec![f32::NAN; slots * vrow]);
    let offs = cu_seqlens(lens);
    for b in 0..batch {
        for j in 0..lens[b] {
            let slot = match &c.kv {
                Kv::Varlen(_) => offs[b] as usize + j,
                Kv::Cache { .. } => b * shape[1] + j,
                Kv::Paged { page, .. } => table[b * max_blocks + j / page] as usize * page + j % page,
            };
            k[slot * row..][..row].copy_from_slice(&logical_k[b][j * row..][..row]);
            v[slot * vrow..][..vrow].copy_from_slice(&logical_v[b][j * vrow..][..vrow]);
        }
    }
    Store { shape, k, v, table, max_blocks, logical_k, logical_v }
}

/// Runs `c` in the emulator; returns the worst err / bound over its sequences.
fn run(c: &SCase) -> Result<f64, String> {
    run_mutated(c, None)
}

/// [`run`] on a mutated copy of the kernel sources (the mutation self-test).
fn run_mutated(c: &SCase, mutation: Option<&Mutation>) -> Result<f64, String> {
    let mut rng = Rng::new(c.seed | 1);
    let (hq, hkv, d, dv, dtype) = (c.hq, c.hkv, c.d, c.dv, c.dtype);
    let batch = c.batch();
    let qlens: Vec<usize> = match &c.q {
        Ok(l) => l.clone(),
        Err(sq) => vec![*sq; batch],
    };
    assert_eq!(qlens.len(), batch);
    let total_q: usize = qlens.iter().sum();
    let q_shape = match &c.q {
        Ok(_) => [1, total_q, hq, d],
        Err(sq) => [batch, *sq, hq, d],
    };
    let qx = values(&mut rng, q_shape.iter().product(), dtype);
    let st = build_store(c, &mut rng);
    let cu_q = cu_seqlens(&qlens);
    let kv_lens: Vec<usize> = c.kv.lens().to_vec();
    let cu_k = cu_seqlens(&kv_lens);
    let seqlens: Vec<i32> = kv_lens.iter().map(|&l| (l - c.new) as i32).collect();
    let ql = match &c.q {
        Ok(l) => QueryLayout::Varlen { cu_seqlens: &cu_q, max_seqlen: l.iter().copied().max().unwrap_or(0) },
        Err(_) => QueryLayout::Dense,
    };
    let kl = match &c.kv {
        Kv::Varlen(l) => KvLayout::Varlen { cu_seqlens: &cu_k, max_seqlen: l.iter().copied().max().unwrap_or(0) },
        Kv::Cache { .. } => KvLayout::Cache { seqlens: &seqlens, new: c.new },
        Kv::Paged { .. } => {
            KvLayout::Paged { block_table: &st.table, max_blocks_per_seq: st.max_blocks, seqlens: &seqlens, new: c.new }
        }
    };
    let layout = BatchLayout::new(ql, q_shape, kl, st.shape).map_err(|e| format!("layout: {e}"))?;
    let opts = c.opts();
    let p = layout.launch_problem_v(hq, hkv, (d, dv), dtype, &opts).map_err(|e| format!("problem: {e}"))?;
    let (v_shape, o_shape) = ([st.shape[0], st.shape[1], hkv, dv], [q_shape[0], q_shape[1], hq, dv]);
    let ops = Operands {
        ptrs: [Q, K, V, O],
        strides: [contiguous(q_shape), contiguous(st.shape), contiguous(v_shape), contiguous(o_shape)],
        lse: if c.lse { LSE } else { 0 },
        alibi: if c.alibi { ALIBI } else { 0 },
        sinks: if p.sinks.is_some() { SINKS } else { 0 },
    };
    let (new_shape, vnew_shape) = ([batch, c.new, hkv, d], [batch, c.new, hkv, dv]);
    let sops = ServingOperands {
        cu_seqlens_q: CU_Q,
        cu_seqlens_k: CU_K,
        seqused_k: SEQUSED,
        block_table: TABLE,
        o_accum: O_ACC,
        lse_accum: LSE_ACC,
        knew: KNEW,
        vnew: VNEW,
        new_strides: [contiguous(new_shape), contiguous(vnew_shape)],
        ..ServingOperands::default()
    };
    if layout.max_seqlen_q() == 0 {
        // No query row anywhere: the engine launches nothing (grid x would be 0).
        return Ok(0.0);
    }
    let pl: LaunchPlan =
        plan_serving(c.family, &p, &layout, &ops, &sops, c.splits, 1).map_err(|e| format!("plan: {e}"))?;
    let fp: FwdParams = pl.params;
    let lse_rows = fp.lse_rows();
    let fam = FAMILIES.iter().find(|f| f.name == c.family).unwrap();
    let exe = unit_exe(fam, pl.tile, mutation)?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(&c.name(), &mut h);
    std::hash::Hash::hash(&mutation.map(|m| m.name), &mut h);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("emu/serving")
        .join(format!("{:016x}", std::hash::Hasher::finish(&h)));
    let (k_bytes, v_bytes) = if c.new > 0 {
        append(c, &st, &layout, &p, &ops, &sops, &dir, &seqlens)?
    } else {
        (bits(&st.k, dtype), bits(&st.v, dtype))
    };
    let mut bufs = vec![
        LaunchBuf::input("q", Q, bits(&qx, dtype)),
        LaunchBuf::input("k", K, k_bytes),
        LaunchBuf::input("v", V, v_bytes),
        LaunchBuf::output("o", O, o_shape.iter().product::<usize>() * 2),
    ];
    if c.lse {
        bufs.push(LaunchBuf::output("lse", LSE, lse_rows * 4));
    }
    if let Some(s) = &opts.alibi_slopes {
        bufs.push(LaunchBuf::input("alibi", ALIBI, s.iter().flat_map(|x| x.to_le_bytes()).collect()));
    }
    if let Some(s) = &p.sinks {
        bufs.push(LaunchBuf::input("sinks", SINKS, s.iter().flat_map(|x| x.to_le_bytes()).collect()));
    }
    if fp.cu_seqlens_q != 0 {
        bufs.push(LaunchBuf::i32s("cu_seqlens_q", CU_Q, &cu_q));
    }
    if fp.cu_seqlens_k != 0 {
        bufs.push(LaunchBuf::i32s("cu_seqlens_k", CU_K, &cu_k));
    }
    if fp.seqused_k != 0 {
        bufs.push(LaunchBuf::i32s("seqused_k", SEQUSED, &seqlens));
    }
    if fp.block_table != 0 {
        bufs.push(LaunchBuf::i32s("block_table", TABLE, &st.table));
    }
    if fp.knew != 0 {
        // The attention does not read the new rows (the append kernel wrote them into the
        // cache): a stub buffer, so its address translates.
        bufs.push(LaunchBuf::input("knew", KNEW, vec![0; 16]));
        bufs.push(LaunchBuf::input("vnew", VNEW, vec![0; 16]));
    }
    if c.splits > 1 {
        bufs.push(LaunchBuf::output("o_accum", O_ACC, c.splits * lse_rows * dv * 4));
        bufs.push(LaunchBuf::output("lse_accum", LSE_ACC, c.splits * lse_rows * 4));
    }
    let (log, outs) = run_launch(&exe, &dir, &pl, c.family, &[1, 2], &bufs)?;
    let (o, lse): (Vec<f32>, Vec<f32>) = if c.splits > 1 {
        if outs["o"].iter().any(|&b| b != 0xFF) {
            return Err(format!("a split-KV launch wrote o (the combine's job)\n{log}"));
        }
        merge_splits(&outs, c.splits, lse_rows, o_shape, &fp, &p)?
    } else {
        let lse = if c.lse { f32s(&outs["lse"]) } else { Vec::new() };
        (from_bits(&outs["o"], dtype), lse)
    };
    // Per sequence, against the float64 reference on that sequence alone.
    let mut worst = 0.0f64;
    for b in 0..batch {
        let (sq, sk) = (layout.seqlen_q(b), layout.seqlen_k(b));
        let mut ob = Vec::with_capacity(sq * hq * dv);
        let mut qb = Vec::with_capacity(sq * hq * d);
        for i in 0..sq {
            let (qb_i, row) = layout.q_row(b, i);
            let at = (qb_i * q_shape[1] + row) * hq;
            ob.extend_from_slice(&o[at * dv..(at + hq) * dv]);
            qb.extend_from_slice(&qx[at * d..(at + hq) * d]);
        }
        let lse_at = |h: usize, i: usize| -> f32 {
            let (qbi, row) = layout.q_row(b, i);
            let idx = if c.q.is_ok() { h * total_q + row } else { (qbi * hq + h) * q_shape[1] + row };
            lse[idx]
        };
        let name = || format!("sequence {b} (sq {sq}, sk {sk})");
        if sq == 0 {
            continue;
        }
        if sk == 0 {
            if ob.iter().any(|&x| x != 0.0) {
                return Err(format!("{}: no keys but O != 0\n{log}", name()));
            }
            // LSE -inf, or the head's sink logit where it has one.
            let want = |h: usize| p.sink(h).unwrap_or(f32::NEG_INFINITY);
            if c.lse && (0..hq).any(|h| (0..sq).any(|i| lse_at(h, i) != want(h))) {
                return Err(format!("{}: no keys but LSE is not -inf / the sink\n{log}", name()));
            }
            continue;
        }
        let qt = Tensor::from_f32(&qb, dtype, [1, sq, hq, d]).unwrap();
        let kt = Tensor::from_f32(&st.logical_k[b], dtype, [1, sk, hkv, d]).unwrap();
        let vt = Tensor::from_f32(&st.logical_v[b], dtype, [1, sk, hkv, dv]).unwrap();
        let lse_rows: &dyn Fn(usize, usize) -> f32 = &lse_at;
        let ratio = check_sequence((&qt.view(), &kt.view(), &vt.view()), &opts, dtype, &ob, c.lse.then_some(lse_rows))
            .map_err(|e| format!("{}: {e}\n{log}", name()))?;
        worst = worst.max(ratio);
    }
    Ok(worst)
}

/// The append half of `forward_kvcache_append` in the emulator: the cache with the new rows'
/// slots still NaN, k_new / v_new `[batch, new, hkv, d / dv]`; runs the append kernel
/// (`plan_append`) with the cache as `inout`, checks that exactly the new rows were written
/// (every other byte unchanged, NaN slack included) and returns the cache it left.
#[allow(clippy::too_many_arguments)]
fn append(
    c: &SCase,
    st: &Store,
    layout: &BatchLayout<'_>,
    p: &Problem,
    ops: &Operands,
    sops: &ServingOperands,
    dir: &Path,
    seqlens: &[i32],
) -> Result<(Vec<u8>, Vec<u8>), String> {
    let (hkv, dtype) = (c.hkv, c.dtype);
    let (row, vrow) = (hkv * c.d, hkv * c.dv);
    let (mut pre_k, mut pre_v) = (st.k.clone(), st.v.clone());
    let (mut knew, mut vnew) = (Vec::new(), Vec::new());
    for (b, &cached) in seqlens.iter().enumerate() {
        for i in 0..c.new {
            let j = cached as usize + i;
            let (outer, r) = layout.kv_row(b, j);
            let slot = outer * st.shape[1] + r;
            pre_k[slot * row..][..row].fill(f32::NAN);
            pre_v[slot * vrow..][..vrow].fill(f32::NAN);
            knew.extend_from_slice(&st.logical_k[b][j * row..][..row]);
            vnew.extend_from_slice(&st.logical_v[b][j * vrow..][..vrow]);
        }
    }
    let pl = plan_append(p, layout, ops, sops).map_err(|e| format!("plan_append: {e}"))?;
    assert_eq!(pl.kernel(), format!("fa_append_kv_hd{}_{}", pl.tile.head_dim, pl.dtype));
    let fam = FAMILIES.iter().find(|f| f.name == "fa2").unwrap();
    let exe = unit_exe(fam, pl.tile, None)?;
    let mut bufs = vec![
        LaunchBuf::inout("k", K, bits(&pre_k, dtype)),
        LaunchBuf::inout("v", V, bits(&pre_v, dtype)),
        LaunchBuf::input("knew", KNEW, bits(&knew, dtype)),
        LaunchBuf::input("vnew", VNEW, bits(&vnew, dtype)),
        LaunchBuf::i32s("seqused_k", SEQUSED, seqlens),
        // The forward's other operands are in the params (the append does not touch them).
        LaunchBuf::input("q", Q, vec![0; 16]),
        LaunchBuf::input("o", O, vec![0; 16]),
    ];
    if pl.params.block_table != 0 {
        bufs.push(LaunchBuf::i32s("block_table", TABLE, &st.table));
    }
    if pl.params.lse != 0 {
        bufs.push(LaunchBuf::input("lse", LSE, vec![0; 16]));
    }
    if pl.params.alibi_slopes != 0 {
        bufs.push(LaunchBuf::input("alibi", ALIBI, vec![0; 16]));
    }
    let (log, outs) = run_launch(&exe, &dir.join("append"), &pl, "fa2", &[1, 2], &bufs)?;
    let (want_k, want_v) = (bits(&st.k, dtype), bits(&st.v, dtype));
    for (name, want) in [("k", &want_k), ("v", &want_v)] {
        if let Some(at) = outs[name].iter().zip(want.iter()).position(|(a, b)| a != b) {
            return Err(format!("append: cache {name} byte {at} differs from the expected cache\n{log}"));
        }
    }
    Ok((outs["k"].clone(), outs["v"].clone()))
}

/// Merges the split-KV partial states (docs/serving.md: o_accum `[splits, lse rows, dv]`,
/// lse_accum `[splits, lse rows]`, rows in the LSE's order) with `merge_states_n`, into o in its
/// layout `o_shape` (f32) and the LSE. The problem's sinks join as one more state, `(0, sink of the row's
/// head)`, as docs/serving.md says a caller merging states adds them: the splits carry none.
pub(super) fn merge_splits(
    outs: &HashMap<String, Vec<u8>>,
    splits: usize,
    lse_rows: usize,
    o_shape: [usize; 4],
    fp: &FwdParams,
    p: &Problem,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let q_shape = o_shape;
    let (oacc, lacc) = (f32s(&outs["o_accum"]), f32s(&outs["lse_accum"]));
    let (hq, d) = (q_shape[2], q_shape[3]);
    let packed = fp.cu_seqlens_q != 0;
    let total = q_shape[1];
    // Rows of the LSE layout that belong to a sequence (packed: all; dense: all) map to o rows.
    let o_index = |r: usize| -> usize {
        if packed {
            let (h, row) = (r / total, r % total);
            (row * hq + h) * d
        } else {
            let (b, h, i) = (r / (hq * total), (r / total) % hq, r % total);
            ((b * total + i) * hq + h) * d
        }
    };
    let mut states: Vec<(Tensor, Vec<f32>)> = Vec::new();
    for s in 0..splits {
        let mut o = vec![0.0f32; q_shape.iter().product()];
        for r in 0..lse_rows {
            o[o_index(r)..][..d].copy_from_slice(&oacc[(s * lse_rows + r) * d..][..d]);
        }
        let lse = lacc[s * lse_rows..(s + 1) * lse_rows].to_vec();
        states.push((Tensor::from_f32(&o, DType::F32, q_shape).unwrap(), lse));
    }
    if p.sinks.is_some() {
        let head = |r: usize| if packed { r / total } else { (r / total) % hq };
        let lse = (0..lse_rows).map(|r| p.sink(head(r)).unwrap_or(f32::NEG_INFINITY)).collect();
        states.push((Tensor::zeros(DType::F32, q_shape).unwrap(), lse));
    }
    let views: Vec<(TensorView, &[f32])> = states.iter().map(|(o, l)| (o.view(), l.as_slice())).collect();
    let m = merge_states_n(&views).map_err(|e| format!("merge: {e}"))?;
    Ok((m.o.to_f32_vec(), m.lse))
}

pub(super) fn check(cases: &[SCase]) {
    crate::support::check_each("serving cases", cases, SCase::name, |c| run(c).map(|r| format!("err/bound {r:.3}")));
}

pub(super) fn base(dtype: DType, d: usize, hq: usize, hkv: usize, q: Result<Vec<usize>, usize>, kv: Kv) -> SCase {
    SCase {
        family: "fa2",
        dtype,
        d,
        dv: d,
        hq,
        hkv,
        q,
        kv,
        mask: Mask::None,
        softcap: None,
        alibi: false,
        sinks: false,
        lse: true,
        splits: 1,
        new: 0,
        seed: 7,
    }
}

pub(super) fn paged(lens: &[usize], page: usize, share: bool) -> Kv {
    Kv::Paged { lens: lens.to_vec(), page, share, spare: 2, extra_table: 1 }
}

/// Varlen: packed q and k/v, lengths 0 and 1 included, every mask kind.
#[test]
fn fa2_varlen() {
    let q = vec![0, 1, 37, 130, 5];
    let k = vec![5, 0, 64, 200, 1];
    let mut cases = vec![
        SCase { mask: Mask::Causal, ..base(DType::F16, 64, 4, 2, Ok(q.clone()), Kv::Varlen(k.clone())) },
        SCase { mask: Mask::window(17, 3), alibi: true, ..base(DType::BF16, 64, 4, 1, Ok(q.clone()), Kv::Varlen(k.clone())) },
        SCase { softcap: Some(5.0), ..base(DType::F16, 128, 2, 2, Ok(vec![3, 70]), Kv::Varlen(vec![129, 7])) },
    ];
    if full() {
        for d in [32, 96, 192, 256] {
            cases.push(SCase { mask: Mask::Causal, ..base(DType::BF16, d, 4, 2, Ok(q.clone()), Kv::Varlen(k.clone())) });
        }
    }
    check(&cases);
}

/// Paged caches of page sizes 1, 3, 16, 256 with shuffled and shared tables, a dense cache with
/// cache_seqlens; decode (dense q of 1 row) and chunked prefill (packed q).
#[test]
fn fa2_paged_and_cache() {
    let lens = [33, 0, 300, 1];
    let mut cases = vec![
        SCase { mask: Mask::Causal, ..base(DType::F16, 64, 8, 2, Err(1), paged(&lens, 3, true)) },
        SCase { alibi: true, softcap: Some(8.0), ..base(DType::BF16, 64, 4, 4, Err(4), paged(&lens, 16, true)) },
        SCase { mask: Mask::window(40, 0), ..base(DType::F16, 64, 4, 2, Ok(vec![2, 0, 70, 1]), paged(&lens, 1, false)) },
        SCase { mask: Mask::Causal, ..base(DType::BF16, 128, 2, 1, Ok(vec![5, 0, 130, 1]), paged(&lens, 256, true)) },
        SCase { mask: Mask::Causal, ..base(DType::F16, 64, 4, 2, Err(3), Kv::Cache { lens: lens.to_vec(), extra: 5 }) },
    ];
    if full() {
        let mut rng = Rng::new(crate::support::emu::matrix_seed("serving full matrix", 0x5e41));
        for n in 0..24 {
            let batch = 1 + rng.below(4);
            let lens: Vec<usize> =
                (0..batch).map(|_| [0, 1, 2 + rng.below(60), 100 + rng.below(400)][rng.below(4)]).collect();
            let page = [1, 3, 16, 256, 1 + rng.below(40)][rng.below(5)];
            let d = [64, 128][rng.below(2)];
            let hkv = 1 + rng.below(2);
            let group = [1, 2, 4][rng.below(3)];
            let q = if rng.below(2) == 0 {
                Err(1 + rng.below(8))
            } else {
                Ok((0..batch).map(|_| [0, 1, 1 + rng.below(150)][rng.below(3)]).collect())
            };
            let kv = if rng.below(5) == 0 {
                Kv::Cache { lens, extra: rng.below(9) }
            } else {
                Kv::Paged { lens, page, share: rng.below(2) == 0, spare: rng.below(3), extra_table: rng.below(2) }
            };
            let mask = [Mask::None, Mask::Causal, Mask::window(rng.below(50) as i64, rng.below(4) as i64)][rng.below(3)];
            cases.push(SCase {
                mask,
                softcap: (rng.below(4) == 0).then_some(6.0),
                alibi: rng.below(4) == 0,
                lse: rng.below(3) != 0,
                seed: n,
                ..base([DType::F16, DType::BF16][rng.below(2)], d, hkv * group, hkv, q, kv)
            });
        }
    }
    check(&cases);
}

/// Split-KV: each split's partial state in o_accum / lse_accum, merged on the host, equals the
/// reference; o is never written by the split launch.
#[test]
fn fa2_split_kv() {
    let lens = [300, 0, 77, 1];
    let mut cases = vec![
        SCase { splits: 3, mask: Mask::Causal, ..base(DType::F16, 64, 8, 2, Err(1), paged(&lens, 16, true)) },
        SCase { splits: 5, alibi: true, ..base(DType::BF16, 64, 4, 2, Ok(vec![2, 3, 40, 1]), Kv::Varlen(lens.to_vec())) },
    ];
    if full() {
        for splits in [2, 4, 128] {
            cases.push(SCase { splits, mask: Mask::window(90, 0), ..base(DType::F16, 128, 4, 1, Err(2), paged(&lens, 3, false)) });
        }
    }
    check(&cases);
}

/// `forward_kvcache_append` in the emulator: the append kernel writes k_new / v_new into a dense
/// or paged cache (page sizes 1, 3, 16; a new row may open a new page), then the attention
/// (seqused_k = cache_seqlens, seqlen_new) attends them in the same call.
#[test]
fn fa2_kvcache_append() {
    let lens = [35, 2, 130, 4];
    let mut cases = vec![
        SCase { new: 2, mask: Mask::Causal, ..base(DType::F16, 64, 8, 2, Err(2), paged(&lens, 3, true)) },
        SCase { new: 1, ..base(DType::BF16, 64, 4, 2, Err(1), paged(&lens, 16, false)) },
        SCase { new: 1, mask: Mask::Causal, ..base(DType::F16, 64, 4, 4, Err(1), Kv::Cache { lens: lens.to_vec(), extra: 3 }) },
    ];
    if full() {
        let lens = [35, 4, 130, 5];
        cases.push(SCase { new: 3, mask: Mask::Causal, splits: 2, ..base(DType::BF16, 128, 4, 2, Err(3), paged(&lens, 1, true)) });
        cases.push(SCase { new: 4, alibi: true, ..base(DType::F16, 96, 2, 1, Err(4), paged(&lens, 256, false)) });
    }
    check(&cases);
}

/// The serving tests catch the mistakes they exist for: each mutation of the per-sequence view
/// makes a CI case fail (a kernel that ignored the block table, the sequence's own diagonal, or
/// overlapped the splits would otherwise pass unnoticed).
#[test]
fn serving_mutations_are_caught() {
    let lens = [33, 0, 300, 1];
    let muts = [
        (
            Mutation { name: "block_table_ignored", file: "cuda/common/seqlen.cuh", from: "row[j / p.page_size]", to: "row[0]", defines: &[] },
            SCase { mask: Mask::Causal, ..base(DType::F16, 64, 8, 2, Err(1), paged(&lens, 3, true)) },
        ),
        (
            Mutation {
                name: "alibi_whole_batch_diagonal",
                file: "cuda/fa2_fwd.cu",
                from: "m0 + wrow, n0, seqlen_k - seqlen_q);",
                to: "m0 + wrow, n0, p.seqlen_k - p.seqlen_q);",
                defines: &[],
            },
            SCase { alibi: true, ..base(DType::F16, 64, 4, 2, Ok(vec![2, 0, 70, 1]), paged(&lens, 16, false)) },
        ),
        (
            Mutation {
                name: "splits_overlap",
                file: "cuda/common/seqlen.cuh",
                from: "const long long b = static_cast<long long>(split) * per, e = b + per;",
                to: "const long long b = static_cast<long long>(split) * per, e = b + per + 1;",
                defines: &[],
            },
            SCase { splits: 3, ..base(DType::F16, 64, 8, 2, Err(1), paged(&[300, 0, 77, 1], 16, true)) },
        ),
    ];
    for (m, c) in &muts {
        assert!(run(c).is_ok(), "{}: the unmutated case must pass", m.name);
        match run_mutated(c, Some(m)) {
            Ok(r) => panic!("mutation {} was not caught (err/bound {r:.3})", m.name),
            Err(e) => assert!(e.contains("max |O - ref|") || e.contains("LSE"), "mutation {}: unexpected failure {e}", m.name),
        }
    }
}

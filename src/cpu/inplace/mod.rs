//! The in-place CPU path: attention that reads K and V where they lie (dense, packed, a dense
//! cache or a paged cache, any dtype), for decode, paged KV caches and variable-length batches.
//!
//! Unlike the tiled path (`cpu::tiled`), nothing is repacked per call: a work item takes a block
//! of up to [`ITEM_ROWS`] query rows that share one kv head (every query head of the GQA group and the
//! sequence's query positions, flattened as `row = i · group + head_in_group`) and streams over
//! that kv head's keys in chunks of [`CHUNK_KEYS`](sizes::CHUNK_KEYS), reading each K and V row
//! once per item (f16/bf16 rows are widened into a chunk-sized L1 buffer, f32 rows are used in place). Products are
//! vectorised over head_dim with small register tiles (4 rows × 2 keys for `Q·Kᵀ`, 4 rows × 16
//! columns for `P·V`); scores are held as panels of [`NR`] = 16 rows per key, the layout of the
//! shared online-softmax verbs (`cpu::softmax`), which run unchanged.
//!
//! Decode-like calls (each row block fits one panel: `seqlen_q · group <= 16`) run the items of
//! all kv heads of a (sequence, row block, split) as one unit that advances chunk by chunk over
//! every head: a chunk's K/V rows of all heads lie side by side (`[.., seqlen, heads,
//! head_dim]`), so memory is swept in order instead of one head's rows a whole row of all heads
//! apart, which left a decode step waiting on scattered cache misses. K/V stored head-major
//! (each head's keys one run: `[batch, heads, seqlen, head_dim]` as strided views; the rule is
//! `cpu::rows::heads_side_by_side`) instead run one kv head per unit, each head's K and V two
//! sequential runs, the blocked sweep prefetching the next block of keys.
//!
//! Decode (up to 16 query rows per kv head: the heads of its GQA group; every key visible) with
//! the native arithmetic on the AVX-512 and AVX2 builds, at head dims that are multiples of 32 up
//! to 256, runs in blocks of 16 keys instead (`sweep_key_blocks_with`, the products in
//! `inplace::lanes`, written once over both ISAs' vectors): a block's 16 scores of a tile of
//! rows at once, one softmax step per block and row, O held in registers over the block's V rows.
//! The items of several kv heads whose K/V lie side by side take each block in key order
//! (`key_block_in_key_order`: 8 keys of every head at a time), so memory is read as a few sequential
//! streams rather than one per key; the same operations per row, the same bits. Each of its
//! passes asks for the next pass's rows into L2 (the block's V while K is read, the next
//! block's K while V is read), so that DRAM is read while the core computes.
//!
//! Split-KV (flash-decoding): when there are too few items to occupy the workers, each item's
//! key range is split; each split writes its normalised output and LSE, and a second pass merges
//! them with `serving::merge::merge_row` (the arithmetic of the public `merge_states`). The
//! split count is [`num_splits`]'s heuristic or the caller's `num_splits`. An attention sink is
//! merged there too, once per row as the state `(0, sink)`: the splits' states carry none.
//!
//! An FP8 KV cache (e4m3 codes with f32 scales, `RunOpts::fp8`) runs on the chunked sweeps: each
//! chunk's K/V rows are dequantised into the chunk buffer the 16-bit rows are widened into
//! (`fp8_rows`), so no f32 copy of the cache is made; the blocked and one-key sweeps decline it.
//!
//! All parallel work goes through `cpu::parallel::for_each`.
//!
//! Files: this driver (items, units, splits); the ways to sweep a unit's keys behind one trait
//! (`sweep`), tried in order: `key_blocks` (its products in `lanes`), `key_by_key`, `chunks`;
//! the merge of the splits (`combine`); the per-worker buffers (`scratch`); an FP8 cache's rows
//! (`fp8_rows`).

mod chunks;
mod combine;
mod fp8_rows;
mod item;
mod key_blocks;
mod key_by_key;
mod lanes;
mod scratch;
mod sizes;
mod sweep;

use super::head_dim::check_head_dim;
use super::gemm::NR;
use super::isa::{detect_isa, isa, Isa};
use super::parallel;
use super::pool;
use super::rows::heads_side_by_side;
use super::score::ScoreMod;
use super::softmax::{finalize, lse_f64, RowState};
use crate::error::{Error, Result};
use crate::numerics::softmax_math::Exp2Math;
use crate::problem::Problem;
use crate::serving::layout::BatchLayout;
use crate::splits::{num_splits, MIN_SPLIT_KEYS};
use crate::tensor::{numel, try_filled, OwnedData, Tensor, TensorView};
use combine::{combine, Parts, SeqPlan};
use item::{Ctx, Item, ItemSpan};
use chunks::{ChunksAlone, ChunksTogether};
use key_blocks::KeyBlocks;
use key_by_key::KeyByKey;
use scratch::{Scratch, Scratches};
use sizes::ITEM_ROWS;
use sweep::Sweep;

pub(crate) use fp8_rows::{Fp8Kv, Fp8Rows, RowScales};

/// Multiply-adds a thread must get before another thread is started (roughly 50 µs of work).
const MIN_WORK_PER_THREAD: u64 = 1 << 18;
/// The dense forward takes this path when `seqlen_q` is at most this: the tiled path packs all of
/// K/V per call and computes 16-row panels per head, most of them padding for a decode step.
pub const DENSE_MAX_SEQLEN_Q: usize = 16;

/// Whether the dense forward should take the in-place path.
pub(crate) fn prefers_dense(p: &Problem) -> bool {
    p.seqlen_q <= DENSE_MAX_SEQLEN_Q && matches!(p.precision, crate::options::Precision::Native)
}

/// The result of the in-place path: `o` as `[q batch dim, q rows, heads_q, head_dim_v]` in q's
/// dtype, `lse` as `[q batch dim, heads_q, q rows]`.
pub(crate) struct InplaceOutput {
    pub o: Tensor,
    pub lse: Vec<f32>,
    /// Largest number of key splits any sequence used.
    pub splits: usize,
}

/// Runs a group of items (see the module documentation): items of one sequence, row block and
/// key split that differ only in their kv head. When they see the same keys they advance chunk
/// by chunk together, so each chunk's K/V rows of all their heads, which lie side by side in
/// memory (`[.., seqlen, heads, head_dim]`), are read in one sweep rather than one head's rows a
/// whole row of all heads apart at a time; otherwise each runs alone.
#[inline(always)]
fn attend<M: Exp2Math, const FMA: bool>(c: &Ctx<'_, M>, items: &mut [Item<'_>], scrs: &mut [Scratch]) {
    let spans: Vec<ItemSpan> = items.iter_mut().zip(scrs.iter_mut()).map(|(it, scr)| attend_begin(c, it, scr)).collect();
    // Decode (at most one panel of rows per item, every row seeing the whole span): the blocked
    // sweep where it applies, else for group-1 16-bit K/V the one-key sweep (the widening fused
    // into the products); f32 rows otherwise take the chunks, which measured faster than the
    // one-key sweep for them. The chunks take every unit.
    let _ = KeyBlocks::run::<M, FMA>(c, items, scrs, &spans)
        || KeyByKey::run::<M, FMA>(c, items, scrs, &spans)
        || ChunksTogether::run::<M, FMA>(c, items, scrs, &spans)
        || ChunksAlone::run::<M, FMA>(c, items, scrs, &spans);
    for (it, scr) in items.iter_mut().zip(scrs.iter_mut()) {
        attend_end(c, it, scr);
    }
}

/// An item's queries, key ranges and cleared state.
#[inline(always)]
fn attend_begin<M: Exp2Math>(c: &Ctx<'_, M>, it: &mut Item<'_>, scr: &mut Scratch) -> ItemSpan {
    let (d, dv) = (c.p.head_dim, c.p.head_dim_v);
    let g = c.group;
    let (b, hk) = (it.b, it.hk);
    let nrows = it.r1 - it.r0;
    let (sq, sk) = (c.layout.seqlen_q(b), c.layout.seqlen_k(b));
    // The problem of this sequence alone: masks, ALiBi and causal alignment are per sequence.
    let ps = Problem {
        batch: 1,
        seqlen_q: sq,
        seqlen_k: sk,
        ..c.p.clone()
    };
    let Scratch {
        q, o, rows, lo, hi, qi, head, ..
    } = scr;

    for rl in 0..nrows {
        let r = it.r0 + rl;
        let (i, h) = (r / g, hk * g + r % g);
        let (qo, qr) = c.layout.q_row(b, i);
        let dst = &mut q[rl * d..(rl + 1) * d];
        c.q.read_row(qo, qr, h, dst);
        let (l, hh) = ps.key_range(i);
        lo[rl] = l.max(it.k0);
        hi[rl] = hh.min(it.k1);
        qi[rl] = i;
        head[rl] = h;
    }
    // Padding rows of the last panel: zero queries, no keys. A one-row item's panel is never
    // read past its row (`softmax_one_row`, the products over `nl` rows, the sweeps), so its 15
    // padding rows are left as they are: zeroing them cost 16 KiB per item, and a group-1
    // decode call has heads × splits items.
    let padded = if nrows == 1 { 1 } else { nrows.div_ceil(NR) * NR };
    q[nrows * d..padded * d].iter_mut().for_each(|x| *x = 0.0);
    o[..padded * dv].iter_mut().for_each(|x| *x = 0.0);
    rows[..nrows.div_ceil(NR) * NR].iter_mut().for_each(|r| *r = RowState::EMPTY);

    let lo_all = lo[..nrows].iter().copied().min().unwrap_or(0);
    let hi_all = hi[..nrows].iter().copied().max().unwrap_or(0);

    ItemSpan { ps, lo_all, hi_all }
}

/// An item's normalised outputs and LSEs.
#[inline(always)]
fn attend_end<M: Exp2Math>(c: &Ctx<'_, M>, it: &mut Item<'_>, scr: &mut Scratch) {
    let d = c.p.head_dim_v;
    let nrows = it.r1 - it.r0;
    let Scratch { o, rows, .. } = scr;
    for rl in 0..nrows {
        let (inv, _) = finalize(&rows[rl], c.sm.u, &c.math);
        it.lse[rl] = lse_f64(&rows[rl], c.sm.u, &c.math);
        let out = &mut it.o[rl * d..(rl + 1) * d];
        if rows[rl].l == 0.0 {
            out.fill(0.0); // saw no key (in this split): exactly 0
        } else {
            for (dst, &x) in out.iter_mut().zip(&o[rl * d..(rl + 1) * d]) {
                *dst = x * inv;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn attend_avx512<M: Exp2Math>(c: &Ctx<'_, M>, items: &mut [Item<'_>], scrs: &mut [Scratch]) {
    attend::<M, true>(c, items, scrs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_avx2<M: Exp2Math>(c: &Ctx<'_, M>, items: &mut [Item<'_>], scrs: &mut [Scratch]) {
    attend::<M, true>(c, items, scrs)
}

/// [`attend`] compiled for `c.isa` (the tiled path's [`Isa`]), or the best lesser one this CPU has.
fn attend_any<M: Exp2Math>(c: &Ctx<'_, M>, items: &mut [Item<'_>], scrs: &mut [Scratch]) {
    let want = c.isa;
    // Detected again here (a cached atomic load) so that each call's safety rests on this check.
    #[cfg(target_arch = "x86_64")]
    {
        let has = detect_isa();
        if want == Isa::Avx512 && has == Isa::Avx512 {
            // SAFETY: `detect_isa()` found AVX-512F, AVX2 and FMA on this CPU, the only
            // requirement of a `#[target_feature]` function; the function itself is safe code.
            unsafe { attend_avx512(c, items, scrs) };
            return;
        }
        if want != Isa::Portable && has != Isa::Portable {
            // SAFETY: `detect_isa()` found AVX2 and FMA on this CPU, the only requirement of a
            // `#[target_feature]` function; the function itself is safe code.
            unsafe { attend_avx2(c, items, scrs) };
            return;
        }
    }
    let _ = want;
    attend::<M, false>(c, items, scrs)
}

/// Name of the kernel this CPU runs on this path.
pub(crate) fn path_name() -> &'static str {
    match isa() {
        Isa::Avx512 => "cpu-inplace-avx512",
        Isa::Avx2Fma => "cpu-inplace-avx2-fma",
        Isa::Portable => "cpu-inplace-portable",
    }
}

/// How one in-place call runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunOpts<'a> {
    pub threads: usize,
    /// Forced split count (`ForwardOptions::num_splits`), or `None` for [`num_splits`].
    pub splits: Option<usize>,
    /// Sequences another path computes (`true`): no items; their output rows stay 0.
    pub skip: &'a [bool],
    /// An FP8 cache: K and V are read (dequantised) from these codes, and the `k`, `v` views
    /// give only the cache's shape and strides (views of no elements).
    pub fp8: Option<Fp8Kv<'a>>,
}

/// The in-place forward pass on a validated problem and layout.
pub(crate) fn forward<M: Exp2Math>(
    p: &Problem,
    layout: &BatchLayout<'_>,
    qkv: (&TensorView<'_>, &TensorView<'_>, &TensorView<'_>),
    math: M,
    run: RunOpts<'_>,
) -> Result<InplaceOutput> {
    forward_isa(p, layout, qkv, math, run, isa())
}

/// [`forward`] on the instruction set `want` (or the best lesser one this CPU has).
fn forward_isa<M: Exp2Math>(
    p: &Problem,
    layout: &BatchLayout<'_>,
    (q, k, v): (&TensorView<'_>, &TensorView<'_>, &TensorView<'_>),
    math: M,
    run: RunOpts<'_>,
    want: Isa,
) -> Result<InplaceOutput> {
    let RunOpts { threads, splits, skip, fp8 } = run;
    let seqlen_q = |b: usize| {
        if skip.get(b).copied().unwrap_or(false) {
            0
        } else {
            layout.seqlen_q(b)
        }
    };
    check_head_dim(p)?;
    // `d`: the head_dim of v, o and the partial outputs; q·k runs over `p.head_dim`.
    let (d, g, hkv, hq) = (p.head_dim_v, p.group(), p.heads_kv, p.heads_q);
    let batch = layout.batch();
    // The outputs first (fallibly): a problem whose output cannot exist (a broadcast q of 2^40
    // sequences) fails here, before any per-sequence bookkeeping is allocated.
    let q_outer = q.shape()[0];
    let q_rows = layout.q_rows();
    let mut o = Tensor::zeros(p.dtype, [q_outer, q_rows, hq, d])?;
    let n_lse = numel([q_outer, hq, q_rows, 1], "lse")?;
    let mut lse_tok = try_filled(n_lse, f32::NEG_INFINITY, || "LSE".into())?;

    // Per sequence and row block: the keys any of its rows sees. Then how much work there is,
    // and how many threads and splits it deserves.
    let mut spans: Vec<Vec<(usize, usize)>> = Vec::with_capacity(batch);
    let (mut base_items, mut work, mut max_span) = (0usize, 0u64, 0usize);
    for b in 0..batch {
        let (sq, sk) = (seqlen_q(b), layout.seqlen_k(b));
        let rows = sq * g;
        let ps = Problem {
            batch: 1,
            seqlen_q: sq,
            seqlen_k: sk,
            ..p.clone()
        };
        let blocks: Vec<(usize, usize)> = (0..rows.div_ceil(ITEM_ROWS))
            .map(|rb| {
                let (r0, r1) = (rb * ITEM_ROWS, ((rb + 1) * ITEM_ROWS).min(rows));
                let (mut lo, mut hi) = (usize::MAX, 0);
                for i in r0 / g..=(r1 - 1) / g {
                    let (l, h) = ps.key_range(i);
                    if l < h {
                        lo = lo.min(l);
                        hi = hi.max(h);
                    }
                }
                let span = if lo < hi { (lo, hi) } else { (0, 0) };
                max_span = max_span.max(span.1 - span.0);
                let pairs = ((r1 - r0) * hkv) as u64 * (span.1 - span.0) as u64;
                work = work.saturating_add(pairs.saturating_mul(p.head_dim.max(d) as u64));
                span
            })
            .collect();
        base_items += hkv * blocks.len();
        spans.push(blocks);
    }
    let threads = threads.clamp(1, (work / MIN_WORK_PER_THREAD).max(1).try_into().unwrap_or(usize::MAX));
    // Decode-like calls (every row block within one panel) run all kv heads of a (sequence, row
    // block, split) as one unit (see `attend`): the split heuristic counts those units. Not when
    // K/V are head-major (`heads_side_by_side`): the heads' chunks then lie apart, 2 × heads
    // interleaved runs per sweep, and one head per unit (its K and V two sequential runs, with
    // `sweep_key_blocks_with`' prefetch) measured faster, most of all for bf16.
    let max_rows = (0..batch).map(|b| (seqlen_q(b) * g).min(ITEM_ROWS)).max().unwrap_or(0);
    let by_heads = max_rows <= NR && heads_side_by_side(k, v);
    let units = if by_heads { base_items / hkv.max(1) } else { base_items };
    let ns_all = splits.unwrap_or_else(|| num_splits(units, threads, max_span));

    // Items (ordered by sequence, kv head, row block, split) and their output buffers.
    let mut plans = Vec::with_capacity(batch);
    let mut metas: Vec<(usize, usize, usize, usize, usize, usize)> = Vec::new(); // b, hk, r0, r1, k0, k1
    let mut max_ns = 1;
    for (b, blocks) in spans.iter().enumerate() {
        let rows = seqlen_q(b) * g;
        let span = blocks.iter().map(|s| s.1 - s.0).max().unwrap_or(0);
        let ns = match splits {
            Some(_) => ns_all.min(span).max(1),
            None => ns_all.min(span / MIN_SPLIT_KEYS).max(1),
        };
        max_ns = max_ns.max(ns);
        plans.push(SeqPlan {
            first: metas.len(),
            nrb: blocks.len(),
            ns,
        });
        for hk in 0..hkv {
            for (rb, &(klo, khi)) in blocks.iter().enumerate() {
                let (r0, r1) = (rb * ITEM_ROWS, ((rb + 1) * ITEM_ROWS).min(rows));
                // Even splits of the block's keys (in u64: span · s may pass 2^32).
                let cut = |s: usize| klo + ((khi - klo) as u64 * s as u64 / ns as u64) as usize;
                for s in 0..ns {
                    metas.push((b, hk, r0, r1, cut(s), cut(s + 1)));
                }
            }
        }
    }
    let part_rows: usize = metas.iter().map(|m| m.3 - m.2).sum();
    let part_len = part_rows.checked_mul(d).ok_or_else(|| Error::TooLarge {
        what: "split-KV partial outputs".into(),
    })?;
    let mut part_o = pool::take(part_len, "split-KV partial outputs")?;
    let mut part_lse = try_filled(part_rows, f64::NEG_INFINITY, || "split-KV partial LSEs".into())?;
    let mut offsets = Vec::with_capacity(metas.len());
    {
        let (mut o_rest, mut l_rest) = (&mut part_o[..], &mut part_lse[..]);
        let mut items: Vec<Item<'_>> = Vec::with_capacity(metas.len());
        let mut row_off = 0;
        for &(b, hk, r0, r1, k0, k1) in &metas {
            let n = r1 - r0;
            let (oi, ot) = std::mem::take(&mut o_rest).split_at_mut(n * d);
            let (li, lt) = std::mem::take(&mut l_rest).split_at_mut(n);
            (o_rest, l_rest) = (ot, lt);
            offsets.push(row_off);
            row_off += n;
            let cost = (n as u64) * (k1 - k0) as u64 + 1;
            items.push(Item {
                b,
                hk,
                r0,
                r1,
                k0,
                k1,
                cost,
                o: oi,
                lse: li,
            });
        }
        // Work units: one item, or (decode-like) the items of all kv heads of one (sequence, row
        // block, split). Heaviest first, so the last units to finish are short.
        let mut units: Vec<(u64, Vec<Item<'_>>)> = if by_heads {
            let mut map: std::collections::BTreeMap<(usize, usize, usize), Vec<Item<'_>>> = Default::default();
            for it in items {
                map.entry((it.b, it.r0, it.k0)).or_default().push(it);
            }
            map.into_values().map(|u| (u.iter().map(|it| it.cost).sum(), u)).collect()
        } else {
            items.into_iter().map(|it| (it.cost, vec![it])).collect()
        };
        units.sort_by_key(|u| std::cmp::Reverse(u.0));
        let ctx = Ctx {
            p,
            layout,
            q: *q,
            k: *k,
            v: *v,
            sm: ScoreMod::new(p),
            math,
            group: g,
            isa: want,
            fp8,
        };
        parallel::for_each(
            &mut units,
            threads,
            || Scratches::take((p.head_dim, d), max_rows),
            |scrs, (_, unit)| {
                let scrs = scrs.at_least(unit.len());
                attend_any(&ctx, unit, scrs);
            },
        );
    }

    // Merge the splits (or copy) into o in q's dtype, sequence by sequence.
    let parts = Parts {
        o: &part_o,
        lse: &part_lse,
        offsets: &offsets,
        plans: &plans,
        g,
        d,
        hq,
        sinks: p.sinks.as_deref(),
    };
    match o.data_mut() {
        OwnedData::F32(x) => combine(&parts, layout, &seqlen_q, x, &mut lse_tok, threads),
        OwnedData::F16(x) => combine(&parts, layout, &seqlen_q, x, &mut lse_tok, threads),
        OwnedData::BF16(x) => combine(&parts, layout, &seqlen_q, x, &mut lse_tok, threads),
    }
    pool::give(part_o);
    // [token][head] -> [outer][head][row].
    let mut lse = try_filled(n_lse, f32::NEG_INFINITY, || "LSE".into())?;
    for t in 0..q_outer * q_rows {
        let (outer, row) = (t / q_rows.max(1), t % q_rows.max(1));
        for h in 0..hq {
            lse[(outer * hq + h) * q_rows + row] = lse_tok[t * hq + h];
        }
    }
    Ok(InplaceOutput { o, lse, splits: max_ns })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set this CPU has (AVX-512 only where the CPU has it; elsewhere that
    /// case runs the AVX2 build again, said on stderr) gives the float64 reference's output:
    /// decode with all heads sweeping together (MHA and GQA, f32, f16 and bf16, forced splits;
    /// the blocked decode on the AVX-512 and the AVX2 builds, the one-key and chunked paths on
    /// the portable one), a few query rows with a causal mask and a window, and an infinite V
    /// behind the mask; each also with the inputs stored head-major (strided views: one kv head
    /// per unit) at 1 and 2 threads.
    #[test]
    #[cfg(feature = "bench")] // the head-major copies are bench::support::HeadMajor
    fn every_isa_matches_the_reference() {
        use crate::options::{ForwardOptions, Mask};
        use crate::reference::{attention_f64, max_abs_diff};
        use crate::tensor::DType;
        if detect_isa() != Isa::Avx512 {
            eprintln!("this CPU has no AVX-512: the AVX-512 build is compiled but not run here");
        }
        // (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, options)
        type Case = (usize, usize, usize, usize, usize, usize, DType, ForwardOptions);
        let cases: [Case; 18] = [
            (1, 1, 700, 8, 8, 128, DType::F32, ForwardOptions::default()),
            // Group-1 decode of 16-bit K/V (`sweep_key_by_key`), with softcap and ALiBi (natural units).
            (1, 1, 530, 4, 4, 72, DType::F16, ForwardOptions::default().softcap(5.0)),
            (2, 1, 300, 3, 3, 64, DType::BF16, ForwardOptions::default().alibi_slopes(vec![0.5, 0.25, 0.125])),
            (2, 1, 1100, 8, 2, 64, DType::F32, ForwardOptions::default().num_splits(3)),
            (1, 1, 333, 4, 4, 80, DType::BF16, ForwardOptions::default()),
            (1, 5, 260, 4, 2, 40, DType::F32, ForwardOptions::default().causal(true)),
            (1, 3, 150, 2, 1, 33, DType::F16, ForwardOptions::default().mask(Mask::window(20, 0))),
            (1, 2, 90, 2, 2, 16, DType::F32, ForwardOptions::default().causal(true)),
            // The blocked AVX-512 decode (`sweep_key_blocks_with`, head_dim a multiple of 32): f16 with
            // softcap; bf16 with ALiBi and an infinite V in the last key (seen by every row: the
            // outputs are infinite where the reference's are); a window (keys 30.. of 50: the
            // span starts inside a block, the last block is partial); f32 at head_dim 256.
            (1, 1, 200, 4, 4, 128, DType::F16, ForwardOptions::default().softcap(5.0)),
            (1, 1, 77, 2, 2, 96, DType::BF16, ForwardOptions::default().alibi_slopes(vec![0.5, 0.25])),
            (3, 1, 50, 2, 2, 32, DType::BF16, ForwardOptions::default().mask(Mask::window(20, 0))),
            (1, 1, 40, 2, 2, 256, DType::F32, ForwardOptions::default()),
            // GQA decode in blocks (tiles of 4, 2 and 1 rows of a kv head; AVX2 tiles of 2 and
            // 1): bf16 group 4 with forced splits; f16 group 8 at head_dim 256 with softcap;
            // bf16 group 7 at head_dim 32 with ALiBi (tiles 4 + 2 + 1); f32 group 3 at head_dim
            // 96 with a window and a partial last block; f16 group 16 (the largest one item
            // takes) at head_dim 64; and f32 group 2 at head_dim 80 (not a multiple of 32: the
            // chunked path).
            (1, 1, 1030, 8, 2, 128, DType::BF16, ForwardOptions::default().num_splits(2)),
            (1, 1, 90, 16, 2, 256, DType::F16, ForwardOptions::default().softcap(5.0)),
            (2, 1, 75, 7, 1, 32, DType::BF16, {
                ForwardOptions::default().alibi_slopes(vec![0.5, 0.25, 0.125, 0.0625, 0.03, 0.02, 0.01])
            }),
            (1, 1, 61, 6, 2, 96, DType::F32, ForwardOptions::default().mask(Mask::window(40, 0))),
            (1, 1, 100, 16, 1, 64, DType::F16, ForwardOptions::default()),
            (1, 1, 120, 4, 2, 80, DType::F32, ForwardOptions::default()),
        ];
        for (ci, (b, sq, sk, hq, hkv, d, dt, opts)) in cases.into_iter().enumerate() {
            let val = |i: usize, m: usize| (((i * m) % 97) as f32 / 97.0 - 0.5) * 2.0;
            let mk = |n: usize, s: usize, h: usize, m: usize, inf: bool| {
                let mut x: Vec<f32> = (0..n).map(|i| val(i, m)).collect();
                if inf {
                    x[(s - 1) * h * d] = f32::INFINITY; // the last key: masked for all but the last row
                }
                Tensor::from_f32(&x, dt, [b, s, h, d]).unwrap()
            };
            let q = mk(b * sq * hq * d, sq, hq, 31, false);
            let k = mk(b * sk * hkv * d, sk, hkv, 17, false);
            let v = mk(b * sk * hkv * d, sk, hkv, 13, ci == 5 || ci == 9);
            let p = Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
            let r = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
            let layout = BatchLayout::dense(b, sq, sk);
            let finite = |x: &[f64]| x.iter().map(|&y| if y.is_finite() { y } else { 0.0 }).collect::<Vec<_>>();
            // Also stored head-major (strided views: one kv head per unit, the blocked sweep
            // prefetching) at 1 and 2 threads.
            let stored = [&q, &k, &v].map(crate::bench::support::HeadMajor::new);
            let hm = [&stored[0], &stored[1], &stored[2]].map(|t| t.view());
            assert!(!heads_side_by_side(&hm[1], &hm[2]) || hkv == 1);
            let runs = [(q.view(), k.view(), v.view(), 2), (hm[0], hm[1], hm[2], 1), (hm[0], hm[1], hm[2], 2)];
            let mut outs = Vec::new();
            let isas = [Isa::Avx512, Isa::Avx2Fma, Isa::Portable];
            for (isa, (qx, kx, vx, threads)) in isas.into_iter().flat_map(|i| runs.iter().map(move |r| (i, r))) {
                let isa = (isa, kx.strides(), threads);
                let run = RunOpts { threads: *threads, splits: opts.num_splits, skip: &[], fp8: None };
                let out = forward_isa(&p, &layout, (qx, kx, vx), super::super::Native, run, isa.0).unwrap();
                let o: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
                let same_inf = o.iter().zip(&r.o).all(|(a, b)| a.is_finite() == b.is_finite());
                assert!(same_inf, "case {ci} {isa:?}: non-finite outputs differ from the reference");
                let tol = if dt == DType::F32 { 2e-6 } else { 1e-2 };
                let err = max_abs_diff(&finite(&o), &finite(&r.o));
                assert!(err < tol, "case {ci} {isa:?}: max error {err}");
                let lse: Vec<f64> = out.lse.iter().map(|&x| x as f64).collect();
                assert!(max_abs_diff(&finite(&lse), &finite(&r.lse)) < 2e-5, "case {ci} {isa:?}: LSE");
                outs.push(finite(&o));
            }
            // The paths sum in different orders, so a 16-bit output may round to the neighbouring
            // value on one of them: up to one unit in the last place at 1.0 (|o| <= 1 here).
            let same = match dt {
                DType::F32 => 1e-6,
                DType::F16 => f64::powi(2.0, -10),
                _ => f64::powi(2.0, -7),
            };
            for w in outs.windows(2) {
                assert!(max_abs_diff(&w[0], &w[1]) <= same, "case {ci}: paths disagree");
            }
            // With one split, the blocked decode on K/V side by side (the items of all kv heads
            // in one unit, each block taken in key order: `key_block_in_key_order`) and head-major (one
            // kv head per unit, each item its whole block in turn) runs the same operations per
            // row: the same bits. (The chunked path, where the blocked one does not apply, takes
            // chunks of different lengths in the two.)
            let one = RunOpts { threads: 1, splits: Some(1), skip: &[], fp8: None };
            let blocked = sq == 1 && d % 32 == 0 && d <= 256;
            let has = detect_isa();
            let runs_blocked = |isa: Isa| match isa {
                Isa::Avx512 => has == Isa::Avx512,
                // Every AVX2 + FMA CPU has F16C, which the AVX2 blocked decode also needs.
                Isa::Avx2Fma => has != Isa::Portable,
                Isa::Portable => false,
            };
            for isa in isas.into_iter().filter(|&i| blocked && runs_blocked(i)) {
                let bits = |(qx, kx, vx): (TensorView<'_>, TensorView<'_>, TensorView<'_>)| {
                    let out = forward_isa(&p, &layout, (&qx, &kx, &vx), super::super::Native, one, isa).unwrap();
                    let o: Vec<u32> = out.o.to_f32_vec().iter().map(|x| x.to_bits()).collect();
                    (o, out.lse.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
                };
                let side = bits((q.view(), k.view(), v.view()));
                assert!(side == bits((hm[0], hm[1], hm[2])), "case {ci} {isa:?}: layouts differ in bits");
            }
        }
    }
}

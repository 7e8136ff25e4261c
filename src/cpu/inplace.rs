//! The in-place CPU path: attention that reads K and V where they lie (dense, packed, a dense
//! cache or a paged cache, any dtype), for decode, paged KV caches and variable-length batches.
//!
//! Unlike the tiled path of `cpu/mod.rs`, nothing is repacked per call: a work item takes a block
//! of up to [`RB`] query rows that share one kv head (every query head of the GQA group and the
//! sequence's query positions, flattened as `row = i · group + head_in_group`) and streams over
//! that kv head's keys in chunks of [`KC`], reading each K and V row once per item (f16/bf16
//! rows are widened into a chunk-sized L1 buffer, f32 rows are used in place). Products are
//! vectorised over head_dim with small register tiles (4 rows × 2 keys for `Q·Kᵀ`, 4 rows × 16
//! columns for `P·V`); scores are held as panels of [`NR`] = 16 rows per key, the layout of the
//! shared online-softmax verbs (`cpu/softmax.rs`), which run unchanged.
//!
//! Decode-like calls (each row block fits one panel: `seqlen_q · group <= 16`) run the items of
//! all kv heads of a (sequence, row block, split) as one unit that advances chunk by chunk over
//! every head: a chunk's K/V rows of all heads lie side by side (`[.., seqlen, heads,
//! head_dim]`), so memory is swept in order instead of one head's rows a whole row of all heads
//! apart, which left a decode step waiting on scattered cache misses. K/V stored head-major
//! (each head's keys one run: `[batch, heads, seqlen, head_dim]` as strided views; the rule is
//! `cpu::heads_side_by_side`) instead run one kv head per unit, each head's K and V two
//! sequential runs, the blocked sweep prefetching the next block of keys.
//!
//! Decode (up to 16 query rows per kv head: the heads of its GQA group; every key visible) with
//! the native arithmetic on the AVX-512 and AVX2 builds, at head dims that are multiples of 32 up
//! to 256, runs in blocks of 16 keys instead (`sweep_blocks`, the products in
//! `inplace/blocks.rs`, written once over both ISAs' vectors): a block's 16 scores of a tile of
//! rows at once, one softmax step per block and row, O held in registers over the block's V rows.
//! The items of several kv heads whose K/V lie side by side take each block in key order
//! (`block_key_major`: 8 keys of every head at a time), so memory is read as a few sequential
//! streams rather than one per key; the same operations per row, the same bits. Each of its
//! passes asks for the next pass's rows into L2 (the block's V while K is read, the next
//! block's K while V is read), so that DRAM is read while the core computes.
//!
//! Split-KV (flash-decoding): when there are too few items to occupy the workers, each item's
//! key range is split; each split writes its normalised output and LSE, and a second pass merges
//! them with `serving::merge::merge_row` (the arithmetic of the public `merge_states`). The
//! split count is [`num_splits`]'s heuristic or the caller's `num_splits`.
//!
//! All parallel work goes through `cpu::parallel::for_each`.

use super::gemm::NR;
use super::parallel;
use super::pool;
use super::softmax::{finalize, lse_f64, max_get_scale, online_softmax, panel_max, panel_scales, Exp2Math, RowState};
use super::{detect_isa, heads_side_by_side, isa, Isa, ScoreMod, MAX_HEAD_DIM};
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::serving::layout::BatchLayout;
use crate::serving::merge::merge_row;
use crate::tensor::{numel, try_filled, Data, Element, OwnedData, Tensor, TensorView};

mod blocks;

/// Query rows per work item (4 panels of 16).
pub const RB: usize = 64;
/// Keys per chunk: the K and V rows of a chunk stay in L1/L2 while every panel of the item uses
/// them.
pub const KC: usize = 64;
/// Keys per chunk when the items of all kv heads sweep the keys together (decode): a chunk of
/// every head then spans `KC_SWEEP` whole rows of all heads (`[.., seqlen, heads, head_dim]`),
/// few enough concurrent streams for the hardware prefetchers, and each head's chunk is
/// prefetched while the previous head's is computed.
pub const KC_SWEEP: usize = 16;
/// Group-1 decode (`sweep_rows`): K/V rows of this many keys ahead (all heads) are prefetched
/// into L1 besides what the hardware prefetchers fetch (0: none).
const SWEEP_AHEAD: usize = 1;
/// A split of the keys must hold at least this many: below it the split's fixed costs (loading
/// the queries, the merge, a pool worker's wake-up) outweigh the
/// parallelism it buys.
pub const MIN_SPLIT_KEYS: usize = 512;
/// Most splits of one item's keys (FlashAttention's limit too).
pub const MAX_SPLITS: usize = 128;
/// A split count is accepted when its worker efficiency is within this fraction of the best one
/// (FlashAttention's `num_splits_heuristic` uses 0.85), so the smallest good count wins.
const SPLIT_EFFICIENCY: f64 = 0.85;
/// Multiply-adds a thread must get before another thread is started (roughly 50 µs of work).
const MIN_WORK_PER_THREAD: u64 = 1 << 18;
/// The dense forward takes this path when `seqlen_q` is at most this: the tiled path packs all of
/// K/V per call and computes 16-row panels per head, most of them padding for a decode step.
pub const DENSE_MAX_SEQLEN_Q: usize = 16;

/// Number of key splits per work item (flash-decoding), FlashAttention's rule on CPU workers.
///
/// `items` work items (each a pass over one kv head's keys) go to `workers` threads. Without
/// splitting, the last round of items leaves `workers - items % workers` threads idle; with `s`
/// splits there are `items · s` pieces and the efficiency is
/// `items·s / (ceil(items·s / workers) · workers)`. Candidates are `s = 1 ..=
/// min(MAX_SPLITS, keys / MIN_SPLIT_KEYS)` and the smallest `s` whose efficiency is within
/// 85 % of the best wins. So: never with one worker, never when the keys are too few for two
/// splits of [`MIN_SPLIT_KEYS`], and never when the items already fill the workers (8 kv heads
/// on 2 cores: 1 split; 1 kv head with 4096 keys on 2 cores: 2 splits).
pub fn num_splits(items: usize, workers: usize, keys: usize) -> usize {
    let max_s = MAX_SPLITS.min(keys / MIN_SPLIT_KEYS).max(1);
    if workers <= 1 || items == 0 || max_s == 1 {
        return 1;
    }
    let eff = |s: usize| {
        let pieces = items * s;
        pieces as f64 / (pieces.div_ceil(workers) * workers) as f64
    };
    let best = (1..=max_s).map(eff).fold(0.0, f64::max);
    (1..=max_s).find(|&s| eff(s) >= SPLIT_EFFICIENCY * best).unwrap_or(1)
}

/// Whether the dense forward should take the in-place path.
pub(crate) fn prefers_dense(p: &Problem) -> bool {
    p.seqlen_q <= DENSE_MAX_SEQLEN_Q && matches!(p.precision, crate::options::Precision::Native)
}

/// The result of the in-place path: `o` as `[q batch dim, q rows, heads_q, head_dim]` in q's
/// dtype, `lse` as `[q batch dim, heads_q, q rows]`.
pub(crate) struct InplaceOutput {
    pub o: Tensor,
    pub lse: Vec<f32>,
    /// Largest number of key splits any sequence used.
    pub splits: usize,
}

/// Everything an item reads.
struct Ctx<'a, M> {
    p: &'a Problem,
    layout: &'a BatchLayout<'a>,
    q: TensorView<'a>,
    k: TensorView<'a>,
    v: TensorView<'a>,
    sm: ScoreMod,
    math: M,
    group: usize,
    /// The instruction set to run (the CPU's best unless a test asks for a lesser one).
    isa: Isa,
}

/// One work item: rows `r0..r1` of the (sequence `b`, kv head `hk`) group, keys `k0..k1` (a
/// split), writing normalised outputs `[rows][d]` and LSEs. The LSEs are kept in f64 until the
/// splits are merged: an f32 LSE of a large score is off by up to half its ulp (5e-4 at 1e4),
/// which the merge would turn into a relative error of each split's weight.
struct Item<'o> {
    b: usize,
    hk: usize,
    r0: usize,
    r1: usize,
    k0: usize,
    k1: usize,
    cost: u64,
    o: &'o mut [f32],
    lse: &'o mut [f64],
}

/// Per-worker buffers, sized once.
struct Scratch {
    /// Query rows `[RB][d]`.
    q: Vec<f32>,
    /// Unnormalised outputs `[RB][d]`.
    o: Vec<f32>,
    /// One panel's scores, then probabilities: `[KC][NR]`.
    s: Vec<[f32; NR]>,
    rows: Vec<RowState>,
    /// Per row: visible keys `[lo, hi)` (clipped to the split), query position, query head.
    lo: Vec<usize>,
    hi: Vec<usize>,
    qi: Vec<usize>,
    head: Vec<usize>,
    /// Widened K and V rows of one chunk (16-bit inputs only): `[KC][d]`, sized on first use
    /// (the group-1 sweeps never use them, and a decode unit holds one scratch per kv head:
    /// zeroing 2 × 32 KiB for each on every call would cost as much as a short decode call).
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    /// Element offsets of the chunk's K and V rows.
    kofs: Vec<usize>,
    vofs: Vec<usize>,
    /// The query rows and their unnormalised outputs in the blocked decode's lane order
    /// (`sweep_blocks`): `[rows][d]` each, `rows` at most `NR` (the most an item it takes has).
    qp: Vec<f32>,
    op: Vec<f32>,
    /// The blocked decode's scores of each row against a block's keys (`block_key_major`),
    /// then the rows' probabilities, `[rows][KB]` each, and output factors `[rows]`.
    xb: Vec<[f32; blocks::KB]>,
    pb: Vec<[f32; blocks::KB]>,
    fb: Vec<f32>,
}

/// A worker's scratches for one call, kept by its thread for the next call, because a decode
/// unit holds one per kv head and allocating and zeroing them on every call is a visible part
/// of a short decode call's time. Only scratches for the same head_dim and row count are reused.
struct Scratches {
    d: usize,
    rows: usize,
    v: Vec<Scratch>,
}

/// Most bytes of scratch a thread keeps between calls.
const SCRATCH_KEEP_BYTES: usize = 4 << 20;

thread_local! {
    static KEPT: std::cell::RefCell<Option<(usize, usize, Vec<Scratch>)>> = const { std::cell::RefCell::new(None) };
}

impl Scratches {
    fn take(d: usize, rows: usize) -> Self {
        let kept = KEPT.try_with(|k| k.try_borrow_mut().ok().and_then(|mut s| s.take())).ok().flatten();
        match kept {
            Some((kd, kr, v)) if (kd, kr) == (d, rows) => Scratches { d, rows, v },
            _ => Scratches { d, rows, v: Vec::new() },
        }
    }

    /// The first `n` scratches, made as needed.
    fn at_least(&mut self, n: usize) -> &mut [Scratch] {
        while self.v.len() < n {
            self.v.push(Scratch::new(self.d, self.rows));
        }
        &mut self.v[..n]
    }
}

impl Drop for Scratches {
    fn drop(&mut self) {
        let rb = self.rows.div_ceil(NR).max(1) * NR;
        let dec = self.rows.clamp(1, NR);
        let floats = 2 * rb * self.d + KC * NR + 2 * dec * self.d + dec * (2 * blocks::KB + 1);
        let each = 4 * floats + 2 * 4 * KC * self.d;
        if self.v.is_empty() || self.v.len().saturating_mul(each) > SCRATCH_KEEP_BYTES {
            return;
        }
        let v = std::mem::take(&mut self.v);
        // Kept only in an empty slot of a live thread (a nested call on this thread may have
        // filled it, or hold it borrowed); otherwise freed here.
        let _ = KEPT.try_with(|k| {
            if let Ok(mut slot) = k.try_borrow_mut() {
                if slot.is_none() {
                    *slot = Some((self.d, self.rows, v));
                }
            }
        });
    }
}

impl Scratch {
    /// For items of up to `rows` query rows (at most [`RB`]).
    fn new(d: usize, rows: usize) -> Self {
        let rb = rows.div_ceil(NR).max(1) * NR;
        Scratch {
            q: vec![0.0; rb * d],
            o: vec![0.0; rb * d],
            s: vec![[0.0; NR]; KC],
            rows: vec![RowState::EMPTY; rb],
            lo: vec![0; rb],
            hi: vec![0; rb],
            qi: vec![0; rb],
            head: vec![0; rb],
            kbuf: Vec::new(),
            vbuf: Vec::new(),
            kofs: vec![0; KC],
            vofs: vec![0; KC],
            qp: vec![0.0; rows.clamp(1, NR) * d],
            op: vec![0.0; rows.clamp(1, NR) * d],
            xb: vec![[0.0; blocks::KB]; rows.clamp(1, NR)],
            pb: vec![[0.0; blocks::KB]; rows.clamp(1, NR)],
            fb: vec![1.0; rows.clamp(1, NR)],
        }
    }
}

/// f16 → f32, exact, branch-free so that it vectorises: the exponent and mantissa bits moved to
/// f32's positions and scaled by 2^112 (the difference of the exponent biases; this also turns
/// f16 subnormals into the right normal f32), infinities and NaNs given f32's all-ones exponent,
/// the sign put back.
#[inline(always)]
fn f16_to_f32(h: half::f16) -> f32 {
    const SCALE: f32 = f32::from_bits((127 + 112) << 23); // 2^112
    let h = u32::from(h.to_bits());
    let em = (h & 0x7fff) << 13;
    let finite = f32::from_bits(em) * SCALE;
    let v = if em >= 0x7c00 << 13 {
        f32::from_bits(em | 0x7f80_0000)
    } else {
        finite
    };
    f32::from_bits(v.to_bits() | ((h & 0x8000) << 16))
}

/// [`f16_to_f32`] over a row.
#[inline(always)]
fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
    for (a, &h) in dst.iter_mut().zip(src) {
        *a = f16_to_f32(h);
    }
}

/// An element type K/V rows are stored in, widened to f32 exactly where it is used.
trait Widen: Copy {
    fn widen(self) -> f32;
}

impl Widen for half::bf16 {
    /// bf16 is the high half of an f32: exact (a NaN stays a NaN).
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

impl Widen for half::f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f16_to_f32(self)
    }
}

/// The rows of a chunk as f32 slices: in place for f32, widened into `buf` for 16-bit types
/// (inlined into the AVX2 context, where both widenings vectorise).
#[inline(always)]
fn chunk_rows<'r>(data: Data<'r>, ofs: &[usize], d: usize, buf: &'r mut [f32]) -> [&'r [f32]; KC] {
    let n = ofs.len();
    match data {
        Data::F32(x) => std::array::from_fn(|j| if j < n { &x[ofs[j]..ofs[j] + d] } else { &[] }),
        Data::F16(x) => {
            for (dst, &o) in buf.chunks_exact_mut(d).zip(ofs) {
                widen_f16(&x[o..o + d], dst);
            }
            let mut it = buf.chunks_exact(d);
            std::array::from_fn(|j| if j < n { it.next().unwrap_or(&[]) } else { &[] })
        }
        Data::BF16(x) => {
            for (dst, &o) in buf.chunks_exact_mut(d).zip(ofs) {
                for (a, b) in dst.iter_mut().zip(&x[o..o + d]) {
                    *a = b.widen();
                }
            }
            let mut it = buf.chunks_exact(d);
            std::array::from_fn(|j| if j < n { it.next().unwrap_or(&[]) } else { &[] })
        }
    }
}

#[inline(always)]
fn fma<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `W` consecutive elements from `x` as a value (one bounds check; then registers).
#[inline(always)]
fn load<const W: usize>(s: &[f32], x: usize) -> [f32; W] {
    let mut a = [0.0; W];
    a.copy_from_slice(&s[x..x + W]);
    a
}

/// `a · b + c` lane by lane.
#[inline(always)]
fn fma_lanes<const W: usize, const FMA: bool>(a: [f32; W], b: [f32; W], c: [f32; W]) -> [f32; W] {
    std::array::from_fn(|l| fma::<FMA>(a[l], b[l], c[l]))
}

/// Sum of 8 lanes as a tree (two halves, then pairs), which vectorises.
#[inline(always)]
fn hsum8(a: [f32; 8]) -> f32 {
    let h = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (h[0] + h[2]) + (h[1] + h[3])
}

/// Dot products of one query row with 4 key rows, all of length head_dim: one 8-lane
/// accumulator per key over the 8-element chunks (the query chunk loaded once for all keys), a
/// scalar tail for `d % 8`, and one horizontal sum per key.
///
/// The shape of this loop matters to LLVM: a zip of whole chunks with one accumulator per key
/// keeps each accumulator in a vector register along head_dim. The `black_box` keeps the final
/// horizontal sums from being vectorised across keys, which LLVM otherwise does by rebuilding
/// the whole loop across keys, with shuffles. (Index loops over several query rows at once, or
/// chunks copied into local arrays, end up scalar or shuffled the same way.)
#[inline(always)]
fn dot_row4<const FMA: bool>(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let mut acc = [[0.0f32; 8]; 4];
    let chunks = q.chunks_exact(8).zip(k[0].chunks_exact(8)).zip(k[1].chunks_exact(8));
    let chunks = chunks.zip(k[2].chunks_exact(8)).zip(k[3].chunks_exact(8));
    for ((((x, y0), y1), y2), y3) in chunks {
        for (t, y) in [y0, y1, y2, y3].into_iter().enumerate() {
            for l in 0..8 {
                acc[t][l] = fma::<FMA>(x[l], y[l], acc[t][l]);
            }
        }
    }
    let acc = std::hint::black_box(acc);
    let mut out: [f32; 4] = std::array::from_fn(|t| hsum8(acc[t]));
    let n8 = q.len() / 8 * 8;
    if n8 < q.len() {
        for (t, o) in out.iter_mut().enumerate() {
            *o += q[n8..]
                .iter()
                .zip(&k[t][n8..])
                .fold(0.0, |a, (x, y)| fma::<FMA>(*x, *y, a));
        }
    }
    out
}

/// [`dot_row4`] for one key.
#[inline(always)]
fn dot_row1<const FMA: bool>(q: &[f32], k: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = fma::<FMA>(x[l], y[l], acc[l]);
        }
    }
    let n8 = q.len() / 8 * 8;
    hsum8(acc)
        + q[n8..]
            .iter()
            .zip(&k[n8..])
            .fold(0.0, |a, (x, y)| fma::<FMA>(*x, *y, a))
}

/// `s[t][l] = q_l · k_t` for the panel's `nl` query rows and the chunk's keys `krows`, four keys
/// at a time (their rows stay in L1 while every query row passes over them).
#[inline(always)]
fn qk_panel<const FMA: bool>(q: &[f32], d: usize, nl: usize, krows: &[&[f32]], s: &mut [[f32; NR]]) {
    let mut t0 = 0;
    while t0 < krows.len() {
        if t0 + 4 <= krows.len() {
            let kr: [&[f32]; 4] = std::array::from_fn(|t| &krows[t0 + t][..d]);
            for l in 0..nl {
                let sums = dot_row4::<FMA>(&q[l * d..(l + 1) * d], kr);
                for (t, &x) in sums.iter().enumerate() {
                    s[t0 + t][l % NR] = x;
                }
            }
            t0 += 4;
        } else {
            let kr = &krows[t0][..d];
            for l in 0..nl {
                s[t0][l % NR] = dot_row1::<FMA>(&q[l * d..(l + 1) * d], kr);
            }
            t0 += 1;
        }
    }
}

/// `o_{l0 + r}[x..x + W] += Σ_t p[t][l0 + r] · v_t[x..x + W]` for `NQ` rows: `NQ × W`
/// accumulators held over all keys of the chunk. `SKIP`: a zero probability (a key the row does
/// not see) contributes nothing even when V is infinite or NaN (`0 · inf` is NaN), so a key's V
/// reaches only the rows that see it; used on chunks where some row does not see some key.
#[inline(always)]
fn pv_strip<const NQ: usize, const W: usize, const FMA: bool, const SKIP: bool>(
    o: &mut [f32],
    d: usize,
    x: usize,
    l0: usize,
    p: &[[f32; NR]],
    vrows: &[&[f32]],
) {
    let mut acc: [[f32; W]; NQ] = std::array::from_fn(|r| load::<W>(o, (l0 + r) * d + x));
    for (pt, vt) in p.iter().zip(vrows) {
        let vc = load::<W>(vt, x);
        let pr: [f32; NQ] = std::array::from_fn(|r| pt[(l0 + r) % NR]);
        for r in 0..NQ {
            let t = fma_lanes::<W, FMA>([pr[r]; W], vc, acc[r]);
            acc[r] = if SKIP && pr[r] == 0.0 { acc[r] } else { t };
        }
    }
    for (r, a) in acc.iter().enumerate() {
        o[(l0 + r) * d + x..][..W].copy_from_slice(a);
    }
}

#[inline(always)]
fn pv_rows<const NQ: usize, const FMA: bool, const SKIP: bool>(
    o: &mut [f32],
    d: usize,
    l0: usize,
    p: &[[f32; NR]],
    vrows: &[&[f32]],
) {
    let mut x = 0;
    while x + 16 <= d {
        pv_strip::<NQ, 16, FMA, SKIP>(o, d, x, l0, p, vrows);
        x += 16;
    }
    if x + 8 <= d {
        pv_strip::<NQ, 8, FMA, SKIP>(o, d, x, l0, p, vrows);
        x += 8;
    }
    while x < d {
        pv_strip::<NQ, 1, FMA, SKIP>(o, d, x, l0, p, vrows);
        x += 1;
    }
}

/// `O += P·V` for the panel's `nl` rows, 4, 2 or 1 at a time.
#[inline(always)]
fn pv_panel<const FMA: bool, const SKIP: bool>(o: &mut [f32], d: usize, nl: usize, p: &[[f32; NR]], vrows: &[&[f32]]) {
    let mut r = 0;
    while r < nl {
        if nl - r >= 4 {
            pv_rows::<4, FMA, SKIP>(o, d, r, p, vrows);
            r += 4;
        } else if nl - r >= 2 {
            pv_rows::<2, FMA, SKIP>(o, d, r, p, vrows);
            r += 2;
        } else {
            pv_rows::<1, FMA, SKIP>(o, d, r, p, vrows);
            r += 1;
        }
    }
}

/// What an item keeps between its chunks: its sequence's own problem (masks, ALiBi and causal
/// alignment are per sequence) and the keys any of its rows sees.
struct ItemSpan {
    ps: Problem,
    lo_all: usize,
    hi_all: usize,
}

/// Runs a group of items (see the module documentation): items of one sequence, row block and
/// key split that differ only in their kv head. When they see the same keys they advance chunk
/// by chunk together, so each chunk's K/V rows of all their heads, which lie side by side in
/// memory (`[.., seqlen, heads, head_dim]`), are read in one sweep rather than one head's rows a
/// whole row of all heads apart at a time; otherwise each runs alone.
#[inline(always)]
fn attend<M: Exp2Math, const FMA: bool>(c: &Ctx<'_, M>, items: &mut [Item<'_>], scrs: &mut [Scratch]) {
    let spans: Vec<ItemSpan> = items.iter_mut().zip(scrs.iter_mut()).map(|(it, scr)| attend_begin(c, it, scr)).collect();
    let together = spans.windows(2).all(|w| (w[0].lo_all, w[0].hi_all) == (w[1].lo_all, w[1].hi_all));
    let one_row = items.iter().all(|it| it.r1 - it.r0 == 1);
    let span = spans.first().map_or((0, 0), |s| (s.lo_all, s.hi_all));
    // Decode (at most one panel of rows per item, every row seeing the whole span): the blocked
    // sweep (`sweep_fast`) where it applies, else for group-1 16-bit K/V the one-key sweep (the
    // widening fused into the products); f32 rows otherwise take the chunked path below, which
    // measured faster than the one-key sweep for them.
    let swept = together
        && match (c.k.data(), c.v.data()) {
            (Data::BF16(k), Data::BF16(v)) => {
                sweep_fast(c, items, scrs, &spans, span, (k, v))
                    || (one_row && sweep_rows::<M, FMA, half::bf16>(c, items, scrs, &spans, span, (k, v)))
            }
            (Data::F16(k), Data::F16(v)) => {
                sweep_fast(c, items, scrs, &spans, span, (k, v))
                    || (one_row && sweep_rows::<M, FMA, half::f16>(c, items, scrs, &spans, span, (k, v)))
            }
            (Data::F32(k), Data::F32(v)) => sweep_fast(c, items, scrs, &spans, span, (k, v)),
            _ => false,
        };
    if swept {
    } else if together && items.len() > 1 {
        let (lo_all, hi_all) = spans.first().map_or((0, 0), |s| (s.lo_all, s.hi_all));
        let first_hk = items[0].hk;
        let mut j0 = lo_all;
        while j0 < hi_all {
            let j1 = (j0 + KC_SWEEP).min(hi_all);
            let n = items.len();
            for i in 0..n {
                // What this worker reads next: the same keys of the next head, or the next
                // chunk of the first head.
                let next = if i + 1 < n {
                    Some((items[i + 1].hk, j0, j1))
                } else {
                    (j1 < hi_all).then(|| (first_hk, j1, (j1 + KC_SWEEP).min(hi_all)))
                };
                attend_chunk::<M, FMA>(c, &mut items[i], &mut scrs[i], &spans[i].ps, (j0, j1), next);
            }
            j0 = j1;
        }
    } else {
        for ((it, scr), sp) in items.iter_mut().zip(scrs.iter_mut()).zip(&spans) {
            let mut j0 = sp.lo_all;
            while j0 < sp.hi_all {
                let j1 = (j0 + KC).min(sp.hi_all);
                let next = (j1 < sp.hi_all).then(|| (it.hk, j1, (j1 + KC).min(sp.hi_all)));
                attend_chunk::<M, FMA>(c, it, scr, &sp.ps, (j0, j1), next);
                j0 = j1;
            }
        }
    }
    for (it, scr) in items.iter_mut().zip(scrs.iter_mut()) {
        attend_end(c, it, scr);
    }
}

/// Dot product of an f32 query row with a K row stored as `T`, widened on the fly: 16 lanes
/// along head_dim, one horizontal sum, a scalar tail for `d % 16`.
#[inline(always)]
fn dot_widen<const FMA: bool, T: Widen>(q: &[f32], k: &[T]) -> f32 {
    let mut acc = [0.0f32; 16];
    for (x, y) in q.chunks_exact(16).zip(k.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] = fma::<FMA>(x[l], y[l].widen(), acc[l]);
        }
    }
    // As in `dot_row4`: without the `black_box` LLVM rebuilds the loop around the horizontal
    // sum, in 2-lane pieces (seen in the assembly: `vmovsd` loads, one `xmm` FMA per 2 lanes).
    let acc = std::hint::black_box(acc);
    let n16 = q.len() / 16 * 16;
    let tail = q[n16..].iter().zip(&k[n16..]).fold(0.0, |a, (x, y)| fma::<FMA>(*x, y.widen(), a));
    let h: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
    hsum8(h) + tail
}

/// Group-1 decode of 16-bit K/V, key-major: every item is one query row (of its own kv head)
/// that sees every key of `lo..hi`, and K/V are read strictly in address order: for each key, the rows of all
/// the items' heads (side by side in memory for `[.., seqlen, heads, head_dim]`), each folded
/// into its row at once (score, online softmax of one key, `o += p·v`), 16-bit rows widened in
/// the products. The loads of a step form two forward streams (K and V), which the hardware
/// prefetchers follow; the rows [`SWEEP_AHEAD`] keys ahead are also prefetched. Returns `false`
/// (nothing done) when a row does not see the whole span (the chunked path then runs).
///
/// Per key the softmax is `max_get_scale` and `online_softmax` on a one-key tile: the same
/// arithmetic as the chunked path, with the max and the rescale taken per key instead of per
/// chunk (rounding differs, within the tests' tolerance of the float64 reference).
#[inline(always)]
fn sweep_rows<M: Exp2Math, const FMA: bool, T: Widen>(
    c: &Ctx<'_, M>,
    items: &mut [Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
    (lo, hi): (usize, usize),
    (k, v): (&[T], &[T]),
) -> bool {
    if scrs.iter().any(|scr| scr.lo[0] != lo || scr.hi[0] != hi) {
        return false;
    }
    let Some(b) = items.first().map(|it| it.b) else {
        return true;
    };
    let d = c.p.head_dim;
    let cc = c.sm.c;
    // Key positions `(outer, row)` of the current and the next chunk of keys.
    let fill = |pos: &mut [(usize, usize); KC_SWEEP], j0: usize| {
        let j1 = (j0 + KC_SWEEP).min(hi);
        c.layout.for_kv_rows(b, j0, j1, |jl, outer, row| pos[jl] = (outer, row));
        j1 - j0
    };
    let (mut cur, mut next) = ([(0, 0); KC_SWEEP], [(0, 0); KC_SWEEP]);
    let mut j0 = lo;
    let mut nc = if lo < hi { fill(&mut cur, lo) } else { 0 };
    while nc > 0 {
        let nn = if j0 + nc < hi { fill(&mut next, j0 + nc) } else { 0 };
        for (t, &(outer, row)) in cur[..nc].iter().enumerate() {
            let a = t + SWEEP_AHEAD;
            let ahead = if a < nc {
                Some(cur[a])
            } else {
                next[..nn].get(a - nc).copied()
            };
            for ((it, scr), sp) in items.iter().zip(scrs.iter_mut()).zip(spans) {
                let hk = it.hk;
                if let Some((po, pr)) = ahead.filter(|_| SWEEP_AHEAD > 0) {
                    prefetch_row(c.k.data(), c.k.offset(po, pr, hk), d);
                    prefetch_row(c.v.data(), c.v.offset(po, pr, hk), d);
                }
                let (ko, vo) = (c.k.offset(outer, row, hk), c.v.offset(outer, row, hk));
                let mut x = dot_widen::<FMA, T>(&scr.q[..d], &k[ko..ko + d]);
                if c.sm.natural {
                    // Softcap and ALiBi in natural units, as in `attend_chunk`.
                    x = c.sm.natural_score(x) + sp.ps.alibi_bias(scr.head[0], scr.qi[0], j0 + t);
                }
                let st = &mut scr.rows[0];
                let ([p], scale) = row_probs::<M, 1, FMA>(st, &[x], 1, cc, &c.math);
                st.l = st.l * scale + p;
                let p = c.math.round_p(p);
                let o = &mut scr.o[..d];
                if scale != 1.0 {
                    o.iter_mut().for_each(|y| *y *= scale);
                }
                for (y, w) in o.iter_mut().zip(&v[vo..vo + d]) {
                    *y = fma::<FMA>(p, w.widen(), *y);
                }
            }
        }
        j0 += nc;
        std::mem::swap(&mut cur, &mut next);
        nc = nn;
    }
    true
}

/// Decode in blocks of [`blocks::KB`] keys ([`sweep_blocks`]) with the AVX-512 products when
/// this call runs the AVX-512 build, else the AVX2 + FMA + F16C ones when it runs the AVX2 build
/// (and the CPU has F16C), when head_dim is a multiple of 32 up to `32 · blocks::MAX_W`, every
/// item holds at most [`NR`] query rows and every row sees the whole span, with the native
/// arithmetic only (`M::NATIVE`: the emulated numerics, a tool for comparing with kernels, take
/// the chunked path; each arithmetic doubled this function's 48 instantiations per ISA and the
/// crate's release build time); `false` (nothing done) otherwise.
#[inline(always)]
fn sweep_fast<M: Exp2Math, T: blocks::Elem>(
    c: &Ctx<'_, M>,
    items: &mut [Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
    span: (usize, usize),
    kv: (&[T], &[T]),
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if M::NATIVE {
        let d = c.p.head_dim;
        let fits = d.is_multiple_of(32) && (1..=blocks::MAX_W).contains(&(d / 32));
        let rows_fit = items.iter().all(|it| it.r1 - it.r0 <= NR);
        let whole = items.iter().zip(scrs.iter()).all(|(it, scr)| {
            let n = it.r1 - it.r0;
            scr.lo[..n].iter().all(|&l| l == span.0) && scr.hi[..n].iter().all(|&h| h == span.1)
        });
        if !(fits && rows_fit && whole) {
            return false;
        }
        macro_rules! by_w {
            ($f:ident) => {
                match d / 32 {
                    1 => $f::<M, T, 1>(c, items, scrs, spans, span, kv),
                    2 => $f::<M, T, 2>(c, items, scrs, spans, span, kv),
                    3 => $f::<M, T, 3>(c, items, scrs, spans, span, kv),
                    4 => $f::<M, T, 4>(c, items, scrs, spans, span, kv),
                    5 => $f::<M, T, 5>(c, items, scrs, spans, span, kv),
                    6 => $f::<M, T, 6>(c, items, scrs, spans, span, kv),
                    7 => $f::<M, T, 7>(c, items, scrs, spans, span, kv),
                    _ => $f::<M, T, 8>(c, items, scrs, spans, span, kv),
                }
            };
        }
        let has = detect_isa();
        if c.isa == Isa::Avx512 && has == Isa::Avx512 {
            // SAFETY: `detect_isa()` found AVX-512F, AVX2 and FMA on this CPU, the only
            // requirement of the `#[target_feature]` functions `sweep_blocks_avx512`; they are
            // safe code.
            unsafe { by_w!(sweep_blocks_avx512) };
            return true;
        }
        if c.isa != Isa::Portable && has != Isa::Portable && std::is_x86_feature_detected!("f16c") {
            // SAFETY: `detect_isa()` found AVX2 and FMA on this CPU and F16C was just detected,
            // the only requirements of the `#[target_feature]` functions `sweep_blocks_avx2`;
            // they are safe code.
            unsafe { by_w!(sweep_blocks_avx2) };
            return true;
        }
    }
    let _ = (c, items, scrs, spans, span, kv);
    false
}

/// [`sweep_blocks`] compiled for AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn sweep_blocks_avx512<M: Exp2Math, T: blocks::Elem, const W: usize>(
    c: &Ctx<'_, M>,
    items: &mut [Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
    span: (usize, usize),
    kv: (&[T], &[T]),
) {
    if let Some(s) = blocks::Avx512::new() {
        sweep_blocks::<blocks::Avx512, M, T, W>(s, c, items, scrs, spans, span, kv);
    }
}

/// [`sweep_blocks`] compiled for AVX2 + FMA + F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn sweep_blocks_avx2<M: Exp2Math, T: blocks::Elem, const W: usize>(
    c: &Ctx<'_, M>,
    items: &mut [Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
    span: (usize, usize),
    kv: (&[T], &[T]),
) {
    if let Some(s) = blocks::Avx2::new() {
        sweep_blocks::<blocks::Avx2, M, T, W>(s, c, items, scrs, spans, span, kv);
    }
}

/// Decode-like items (each at most [`NR`] query rows of one kv head: the query heads of its GQA
/// group at one query position, all seeing every key of `lo..hi`) in blocks of [`blocks::KB`]
/// keys: per block and item, in tiles of up to `S::MAX_R` rows, the tile's scores against the
/// block (`blocks::scores`: each K vector loaded once for the tile's rows), one online-softmax
/// step per row for the block (the chunked path's rule: one max and one rescale per block), and
/// `o = o · scale + P·V` with O in registers (`blocks::scale_add_pv`). The items take the block
/// in turn, so a block's K/V rows of all heads (`[.., seqlen, heads, head_dim]`: side by side)
/// are read within a short window, and the tiles after an item's first read them from L1.
/// head_dim is `32 · W`; the queries and O are held in the element type's lane order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn sweep_blocks<S: blocks::Lanes, M: Exp2Math, T: blocks::Elem, const W: usize>(
    s: S,
    c: &Ctx<'_, M>,
    items: &mut [Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
    (lo, hi): (usize, usize),
    (k, v): (&[T], &[T]),
) {
    use blocks::{lane_order, KB};
    let Some(b) = items.first().map(|it| it.b) else {
        return;
    };
    let d = 32 * W;
    let ord = lane_order(T::KIND, S::LANES);
    for (it, scr) in items.iter().zip(scrs.iter_mut()) {
        let n = (it.r1 - it.r0) * d;
        for (i, x) in scr.qp[..n].iter_mut().enumerate() {
            *x = scr.q[i / 32 * 32 + ord[i % 32]];
        }
        scr.op[..n].fill(0.0);
    }
    let (mut kb, mut vb, mut nkb) = ([0usize; KB], [0usize; KB], [0usize; KB]);
    let (mut kofs, mut vofs) = ([0usize; KB], [0usize; KB]);
    // Head-major K/V (one head per unit, see `forward_isa`): each item's next block of keys is
    // asked for into L1 while this one is computed, which measured faster than the hardware
    // prefetchers alone on that single pair of streams (further ahead, into L2, or one line per
    // page: slower). Side by side, `block_key_major` prefetches its own way;
    // a lone item side by side leaves it to the hardware.
    let side = heads_side_by_side(&c.k, &c.v);
    let ahead = !side;
    // Side by side, the items of several kv heads take each block in key order
    // (`block_key_major`), so that memory is read as a few sequential streams.
    let key_major = side && items.len() > 1;
    let mut j0 = lo;
    while j0 < hi {
        let n = KB.min(hi - j0);
        c.layout.for_kv_rows(b, j0, j0 + n, |t, outer, row| {
            kb[t] = c.k.offset(outer, row, 0);
            vb[t] = c.v.offset(outer, row, 0);
        });
        if key_major {
            let nn = KB.min(hi - (j0 + n));
            c.layout.for_kv_rows(b, j0 + n, j0 + n + nn, |t, outer, row| nkb[t] = c.k.offset(outer, row, 0));
            block_key_major::<S, M, T, W>(s, c, items, scrs, spans, j0, (k, v), (&kb[..n], &vb[..n]), &nkb[..nn]);
            j0 += n;
            continue;
        }
        for ((it, scr), sp) in items.iter().zip(scrs.iter_mut()).zip(spans) {
            if ahead {
                prefetch_rows(c, b, (it.hk, (j0 + n).min(hi), (j0 + n + KB).min(hi)));
            }
            let (kh, vh) = (c.k.offset(0, 0, it.hk), c.v.offset(0, 0, it.hk));
            for t in 0..n {
                kofs[t] = kb[t] + kh;
                vofs[t] = vb[t] + vh;
            }
            let (kofs, vofs) = (&kofs[..n], &vofs[..n]);
            for (r0, r) in tiles::<S>(it.r1 - it.r0) {
                match r {
                    4 => block_rows::<S, M, T, W, 4>(s, c, scr, &sp.ps, r0, j0, (k, v), (kofs, vofs)),
                    2 => block_rows::<S, M, T, W, 2>(s, c, scr, &sp.ps, r0, j0, (k, v), (kofs, vofs)),
                    _ => block_rows::<S, M, T, W, 1>(s, c, scr, &sp.ps, r0, j0, (k, v), (kofs, vofs)),
                }
            }
        }
        j0 += n;
    }
    for (it, scr) in items.iter().zip(scrs.iter_mut()) {
        let n = (it.r1 - it.r0) * d;
        for (i, &x) in scr.op[..n].iter().enumerate() {
            scr.o[i / 32 * 32 + ord[i % 32]] = x;
        }
    }
}

/// The product tiles of an item's `rows` query rows in the blocked decode: `(first row, rows)`,
/// 4 rows at a time where `S` holds them (AVX-512), then 2, then 1.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn tiles<S: blocks::Lanes>(rows: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut r0 = 0;
    std::iter::from_fn(move || {
        let left = rows - r0;
        let r = if S::MAX_R >= 4 && left >= 4 {
            4
        } else if S::MAX_R >= 2 && left >= 2 {
            2
        } else {
            1
        };
        (left > 0).then(|| {
            r0 += r;
            (r0 - r, r)
        })
    })
}

/// One block of keys (starting at key `j0`, offsets `kofs`, `vofs`) for rows `r0..r0 + R` of
/// an item ([`sweep_blocks`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block_rows<S: blocks::Lanes, M: Exp2Math, T: blocks::Elem, const W: usize, const R: usize>(
    s: S,
    c: &Ctx<'_, M>,
    scr: &mut Scratch,
    ps: &Problem,
    r0: usize,
    j0: usize,
    (k, v): (&[T], &[T]),
    (kofs, vofs): (&[usize], &[usize]),
) {
    use blocks::{scale_add_pv, scores, KB};
    let d = 32 * W;
    let n = kofs.len();
    let rows = r0 * d..(r0 + R) * d;
    let mut x = scores::<S, T, W, R>(s, &scr.qp[rows.clone()], k, kofs);
    let mut p = [[0.0f32; KB]; R];
    let mut scale = [1.0f32; R];
    for (r, (xr, (pr, sc))) in x.iter_mut().zip(p.iter_mut().zip(scale.iter_mut())).enumerate() {
        (*pr, *sc) = block_probs(c, scr, ps, r0 + r, j0, n, xr);
    }
    scale_add_pv::<S, T, W, R>(s, &mut scr.op[rows], scale, (&p, 0), v, vofs);
}

/// Row `rl`'s softmax step over a block's scores `x[..n]` (keys `j0..`): softcap and ALiBi in
/// natural units (as in `attend_chunk`), [`row_probs`], the sum updated; returns the
/// probabilities as P·V takes them and the factor for the row's output.
#[inline(always)]
fn block_probs<M: Exp2Math>(
    c: &Ctx<'_, M>,
    scr: &mut Scratch,
    ps: &Problem,
    rl: usize,
    j0: usize,
    n: usize,
    x: &mut [f32; blocks::KB],
) -> ([f32; blocks::KB], f32) {
    if c.sm.natural {
        for (t, y) in x.iter_mut().enumerate().take(n) {
            *y = c.sm.natural_score(*y) + ps.alibi_bias(scr.head[rl], scr.qi[rl], j0 + t);
        }
    }
    let st = &mut scr.rows[rl];
    let (q, f) = row_probs::<M, { blocks::KB }, true>(st, x, n, c.sm.c, &c.math);
    st.l = st.l * f + tree_sum(q);
    (q.map(|y| c.math.round_p(y)), f)
}

/// Keys a decode item takes at a time in [`block_key_major`]: as many sequential streams of K
/// (then V) rows. 8 streams read faster than 4 (f32, bf16, GQA), and 16 no faster than 8.
const KQ: usize = 8;

/// One block of keys (starting at key `j0`; `kb`, `vb`: the element offsets of its K and V rows
/// for kv head 0) for items of several kv heads whose rows lie side by side, in key order: the
/// products of every item with keys `t0..t0 + KQ`, then the next `KQ` keys, so that the block's
/// K rows (`[.., seqlen, heads, head_dim]`) are read as `KQ` sequential streams, not as one
/// stream per key a row of all heads apart, as each item taking the whole block in turn would
/// read (that order is markedly slower, most of all for bf16); then
/// each row's softmax step, then `o·scale + P·V` in the same order over V. The same operations
/// in the same order per row as [`block_rows`] (each key's horizontal sum by `Lanes::hsum_one`,
/// `hsum_keys`' tree for one key; O waits in `Scratch::op` between key groups, scaled before
/// the first), so the bits are the same.
///
/// Each pass asks for the rows the next one reads, into L2 (`next_kb`: the next block's K
/// offsets for kv head 0, empty after the last block): the first pass for the block's V rows,
/// the third for the next block's K rows, the same keys of the same head at each step, so they
/// arrive half a block (256 KiB at 1×32×…×128 f32) before they are used. With the hardware
/// prefetchers alone the core computes and reads DRAM in turn, waiting on memory between its
/// bursts of work; the prefetches overlap the two (T1 and T2 hints measure the same, T0 and
/// NTA slower).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block_key_major<S: blocks::Lanes, M: Exp2Math, T: blocks::Elem, const W: usize>(
    s: S,
    c: &Ctx<'_, M>,
    items: &[Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
    j0: usize,
    (k, v): (&[T], &[T]),
    (kb, vb): (&[usize], &[usize]),
    next_kb: &[usize],
) {
    use blocks::{key_sums, scale_add_pv, KB};
    let d = 32 * W;
    let n = kb.len().min(KB);
    for t0 in (0..n).step_by(KQ) {
        let nt = KQ.min(n - t0);
        for (it, scr) in items.iter().zip(scrs.iter_mut()) {
            let kh = c.k.offset(0, 0, it.hk);
            let kofs: [usize; KQ] = std::array::from_fn(|t| kb[(t0 + t).min(n - 1)] + kh);
            let Scratch { qp, xb, .. } = scr;
            for (r0, r) in tiles::<S>(it.r1 - it.r0) {
                let q = &qp[r0 * d..(r0 + r) * d];
                macro_rules! sums {
                    ($r:literal) => {{
                        let mut sums = [[s.fold(s.zero()); KQ]; $r];
                        key_sums::<S, T, W, $r, KQ>(s, q, k, &kofs[..nt], &mut sums);
                        for (x, sr) in xb[r0..r0 + $r].iter_mut().zip(&sums) {
                            for (xt, &v) in x[t0..t0 + nt].iter_mut().zip(sr) {
                                *xt = s.hsum_one(v);
                            }
                        }
                    }};
                }
                match r {
                    4 => sums!(4),
                    2 => sums!(2),
                    _ => sums!(1),
                }
            }
            // The same keys' V rows, which the third pass reads: asked for now, into L2.
            let vh = c.v.offset(0, 0, it.hk);
            for &o in &vb[t0..t0 + nt] {
                prefetch_row_with(c.v.data(), o + vh, d, super::simd::prefetch_l2);
            }
        }
    }
    for ((it, scr), sp) in items.iter().zip(scrs.iter_mut()).zip(spans) {
        for rl in 0..it.r1 - it.r0 {
            // Keys past `n` score 0, as in `scores`.
            let mut x: [f32; KB] = std::array::from_fn(|t| if t < n { scr.xb[rl][t] } else { 0.0 });
            (scr.pb[rl], scr.fb[rl]) = block_probs(c, scr, &sp.ps, rl, j0, n, &mut x);
        }
    }
    for t0 in (0..n).step_by(KQ) {
        let nt = KQ.min(n - t0);
        for (it, scr) in items.iter().zip(scrs.iter_mut()) {
            let vh = c.v.offset(0, 0, it.hk);
            let vofs: [usize; KQ] = std::array::from_fn(|t| vb[(t0 + t).min(n - 1)] + vh);
            let Scratch { op, pb, fb, .. } = scr;
            for (r0, r) in tiles::<S>(it.r1 - it.r0) {
                let o = &mut op[r0 * d..(r0 + r) * d];
                // The rows' probabilities of keys `t0..`; the output scaled before the block's
                // first keys only (× 1 after: exact).
                macro_rules! pv {
                    ($r:literal) => {{
                        let scale: [f32; $r] = std::array::from_fn(|i| if t0 == 0 { fb[r0 + i] } else { 1.0 });
                        scale_add_pv::<S, T, W, $r>(s, o, scale, (&pb[r0..r0 + $r], t0), v, &vofs[..nt])
                    }};
                }
                match r {
                    4 => pv!(4),
                    2 => pv!(2),
                    _ => pv!(1),
                }
            }
            // The same keys of the next block's K rows, which its first pass reads.
            let kh = c.k.offset(0, 0, it.hk);
            for &o in next_kb.iter().skip(t0).take(nt) {
                prefetch_row_with(c.k.data(), o + kh, d, super::simd::prefetch_l2);
            }
        }
    }
}

/// One query row's online-softmax step over the scores `x[..n]` (score units): the new max and
/// the factor the old sum and output must be scaled by (`max_get_scale`), and the unrounded
/// probabilities `exp2((x − m)·c + offset)`, 0 past `n` (`online_softmax`'s arithmetic, its −inf
/// guard included). The caller adds them to the row's sum in its own order and rounds them for
/// P·V. `N` is a power of two.
#[inline(always)]
fn row_probs<M: Exp2Math, const N: usize, const FMA: bool>(
    st: &mut RowState,
    x: &[f32; N],
    n: usize,
    c: f32,
    math: &M,
) -> ([f32; N], f32) {
    let scale = max_get_scale(st, block_max(x, n), c, math);
    // The −inf guard of `online_softmax`: a row with no visible key yet keeps m = −inf.
    let shift = if st.m == f32::NEG_INFINITY { 0.0 } else { st.m };
    let off = math.p_offset();
    let mut p = [0.0f32; N];
    for (t, (pt, &xt)) in p.iter_mut().zip(x).enumerate() {
        let dx = xt - shift;
        let e = math.exp2(if FMA { dx.mul_add(c, off) } else { dx * c + off });
        *pt = if t < n { e } else { 0.0 };
    }
    (p, scale)
}

/// The max of `x[..n]` as `panel_max` takes it (NaN scores skipped; −inf when there is none),
/// as a tree so that it vectorises.
#[inline(always)]
fn block_max<const N: usize>(x: &[f32; N], n: usize) -> f32 {
    let mut a: [f32; N] = std::array::from_fn(|t| if t < n && x[t] > f32::NEG_INFINITY { x[t] } else { f32::NEG_INFINITY });
    let mut w = N / 2;
    while w > 0 {
        for i in 0..w {
            a[i] = if a[i + w] > a[i] { a[i + w] } else { a[i] };
        }
        w /= 2;
    }
    a[0]
}

/// The sum of `N` (a power of two) values as a tree of halves.
#[inline(always)]
fn tree_sum<const N: usize>(mut a: [f32; N]) -> f32 {
    let mut w = N / 2;
    while w > 0 {
        for i in 0..w {
            a[i] += a[i + w];
        }
        w /= 2;
    }
    a[0]
}

/// An item's queries, key ranges and cleared state.
#[inline(always)]
fn attend_begin<M: Exp2Math>(c: &Ctx<'_, M>, it: &mut Item<'_>, scr: &mut Scratch) -> ItemSpan {
    let d = c.p.head_dim;
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
    o[..padded * d].iter_mut().for_each(|x| *x = 0.0);
    rows[..nrows.div_ceil(NR) * NR].iter_mut().for_each(|r| *r = RowState::EMPTY);

    let lo_all = lo[..nrows].iter().copied().min().unwrap_or(0);
    let hi_all = hi[..nrows].iter().copied().max().unwrap_or(0);

    ItemSpan { ps, lo_all, hi_all }
}

/// Asks the cache for the K and V rows of kv head `hk`, keys `j0..j1` of sequence `b`: the
/// rows a worker reads next, fetched while it computes on the current ones.
#[inline(always)]
fn prefetch_rows<M>(c: &Ctx<'_, M>, b: usize, (hk, j0, j1): (usize, usize, usize)) {
    let d = c.p.head_dim;
    c.layout.for_kv_rows(b, j0, j1, |_, outer, row| {
        prefetch_row(c.k.data(), c.k.offset(outer, row, hk), d);
        prefetch_row(c.v.data(), c.v.offset(outer, row, hk), d);
    });
}

/// Prefetches (into L1) the cache lines of `d` elements from element `ofs` of `data`.
#[inline(always)]
pub(super) fn prefetch_row(data: Data<'_>, ofs: usize, d: usize) {
    prefetch_row_with(data, ofs, d, super::simd::prefetch);
}

/// As [`prefetch_row`], with the given prefetch instruction (`simd::prefetch` or `prefetch_l2`).
#[inline(always)]
pub(super) fn prefetch_row_with(data: Data<'_>, ofs: usize, d: usize, fetch: impl Fn(*const i8)) {
    let (ptr, bytes) = match data {
        Data::F32(x) => (x.as_ptr().wrapping_add(ofs) as *const i8, 4 * d),
        Data::F16(x) => (x.as_ptr().wrapping_add(ofs) as *const i8, 2 * d),
        Data::BF16(x) => (x.as_ptr().wrapping_add(ofs) as *const i8, 2 * d),
    };
    // Every line the row touches, once: from the line holding its first byte (a row need not
    // start on a line boundary) to the one holding its last.
    let lead = ptr as usize % 64;
    let mut at = 0;
    while at < lead + bytes {
        fetch(ptr.wrapping_sub(lead).wrapping_add(at));
        at += 64;
    }
}

/// Keys `j0..j1` of an item; `next`: the (kv head, keys) this worker reads after these, to
/// prefetch.
#[inline(always)]
fn attend_chunk<M: Exp2Math, const FMA: bool>(
    c: &Ctx<'_, M>,
    it: &mut Item<'_>,
    scr: &mut Scratch,
    ps: &Problem,
    (j0, j1): (usize, usize),
    next: Option<(usize, usize, usize)>,
) {
    let d = c.p.head_dim;
    let (b, hk) = (it.b, it.hk);
    let nrows = it.r1 - it.r0;
    let Scratch {
        q,
        o,
        s,
        rows,
        lo,
        hi,
        qi,
        head,
        kbuf,
        vbuf,
        kofs,
        vofs,
        ..
    } = scr;
    let n = j1 - j0;
    c.layout.for_kv_rows(b, j0, j1, |jl, outer, row| {
        kofs[jl] = c.k.offset(outer, row, hk);
        vofs[jl] = c.v.offset(outer, row, hk);
    });
    if let Some(next) = next {
        prefetch_rows(c, b, next);
    }
    let half = !matches!(c.k.data(), Data::F32(_)) || !matches!(c.v.data(), Data::F32(_));
    if half && kbuf.len() < KC * d {
        kbuf.resize(KC * d, 0.0);
        vbuf.resize(KC * d, 0.0);
    }
    let krows = chunk_rows(c.k.data(), &kofs[..n], d, kbuf);
    let vrows = chunk_rows(c.v.data(), &vofs[..n], d, vbuf);

    for l0 in (0..nrows).step_by(NR) {
        let nl = NR.min(nrows - l0);
        let plo = lo[l0..l0 + nl].iter().copied().min().unwrap_or(0).max(j0);
        let phi = hi[l0..l0 + nl].iter().copied().max().unwrap_or(0).min(j1);
        if plo >= phi {
            continue;
        }
        let (c0, c1) = (plo - j0, phi - j0);
        let full = (l0..l0 + nl).all(|r| lo[r] <= plo && hi[r] >= phi);
        let qp = &q[l0 * d..(l0 + NR) * d];
        let sp = &mut s[c0..c1];
        // S = Q·Kᵀ for this panel's rows.
        qk_panel::<FMA>(qp, d, nl, &krows[c0..c1], sp);
        // Softcap and ALiBi in natural units (score units: `cpu::softmax`), the mask, and
        // −inf for the padding lanes.
        for (tl, row) in sp.iter_mut().enumerate() {
            let j = plo + tl;
            for (l, x) in row.iter_mut().enumerate().take(nl) {
                let rl = l0 + l;
                if c.sm.natural {
                    *x = c.sm.natural_score(*x) + ps.alibi_bias(head[rl], qi[rl], j);
                }
                if !full && (j < lo[rl] || j >= hi[rl]) {
                    *x = f32::NEG_INFINITY;
                }
            }
            if nl > 1 {
                row[nl..].iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
            }
        }
        let op = &mut o[l0 * d..(l0 + NR) * d];
        if nl == 1 {
            // One real row (group-1 decode): its softmax alone, vectorised over the keys, not
            // over 16 lanes of which 15 are padding.
            let sc = softmax_one_row::<M, FMA>(&mut rows[l0], sp, c.sm.c, &c.math);
            if sc != 1.0 {
                op[..d].iter_mut().for_each(|x| *x *= sc);
            }
        } else {
            // The online softmax, the verbs of the tiled path.
            let states = &mut rows[l0..l0 + NR];
            let tile_max = panel_max(sp.as_flattened());
            let scales = panel_scales(states, &tile_max, c.sm.c, &c.math);
            online_softmax::<M, FMA>(states, &scales, sp.as_flattened_mut(), c.sm.c, &c.math);
            for (l, &sc) in scales.iter().enumerate().take(nl) {
                if sc != 1.0 {
                    op[l * d..(l + 1) * d].iter_mut().for_each(|x| *x *= sc);
                }
            }
        }
        // O += P·V; where some row does not see some key of the chunk, zeros of P are
        // skipped so that key's V (possibly inf/NaN) cannot reach that row.
        let vr = &vrows[c0..c1];
        if full {
            pv_panel::<FMA, false>(op, d, nl, sp, vr);
        } else {
            pv_panel::<FMA, true>(op, d, nl, sp, vr);
        }
    }
}

/// The online softmax of lane 0 of a `[keys][NR]` panel (a panel holding one query row): the
/// same operations as `panel_max`, `max_get_scale` and `online_softmax` on that lane, in the same
/// order (so the same bits), with the exponentials computed on the keys side by side instead of
/// on 16 lanes of which 15 are padding. Lanes 1.. are left as they are (nothing reads them).
/// Returns the factor the row's output must be multiplied by.
#[inline(always)]
fn softmax_one_row<M: Exp2Math, const FMA: bool>(st: &mut RowState, panel: &mut [[f32; NR]], c: f32, math: &M) -> f32 {
    let mut x = [0.0f32; KC];
    let n = panel.len().min(KC);
    for (xt, row) in x.iter_mut().zip(&panel[..n]) {
        *xt = row[0];
    }
    let (p, scale) = row_probs::<M, KC, FMA>(st, &x, n, c, math);
    let mut sum = 0.0f32;
    for (row, &pt) in panel[..n].iter_mut().zip(&p[..n]) {
        sum += pt;
        row[0] = math.round_p(pt);
    }
    st.l = st.l * scale + sum;
    scale
}

/// An item's normalised outputs and LSEs.
#[inline(always)]
fn attend_end<M: Exp2Math>(c: &Ctx<'_, M>, it: &mut Item<'_>, scr: &mut Scratch) {
    let d = c.p.head_dim;
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

/// Work items of one sequence: `nrb` row blocks per kv head, `ns` splits each, starting at item
/// `first` of the item list (ordered by sequence, kv head, row block, split).
#[derive(Clone, Copy)]
struct SeqPlan {
    first: usize,
    nrb: usize,
    ns: usize,
}

/// How one in-place call runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunOpts<'a> {
    pub threads: usize,
    /// Forced split count (`ForwardOptions::num_splits`), or `None` for [`num_splits`].
    pub splits: Option<usize>,
    /// Sequences another path computes (`true`): no items; their output rows stay 0.
    pub skip: &'a [bool],
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
    let RunOpts { threads, splits, skip } = run;
    let seqlen_q = |b: usize| {
        if skip.get(b).copied().unwrap_or(false) {
            0
        } else {
            layout.seqlen_q(b)
        }
    };
    if p.head_dim > MAX_HEAD_DIM {
        return Err(Error::UnsupportedHeadDim {
            head_dim: p.head_dim,
            backend: "the CPU backend".into(),
            supported: format!("1..={MAX_HEAD_DIM}"),
        });
    }
    let (d, g, hkv, hq) = (p.head_dim, p.group(), p.heads_kv, p.heads_q);
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
        let blocks: Vec<(usize, usize)> = (0..rows.div_ceil(RB))
            .map(|rb| {
                let (r0, r1) = (rb * RB, ((rb + 1) * RB).min(rows));
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
                work = work.saturating_add(pairs.saturating_mul(d as u64));
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
    // `sweep_blocks`' prefetch) measured faster, most of all for bf16.
    let max_rows = (0..batch).map(|b| (seqlen_q(b) * g).min(RB)).max().unwrap_or(0);
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
                let (r0, r1) = (rb * RB, ((rb + 1) * RB).min(rows));
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
        };
        parallel::for_each(
            &mut units,
            threads,
            || Scratches::take(d, max_rows),
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

/// The partial states, addressed by (sequence, kv head, row block, split).
struct Parts<'a> {
    o: &'a [f32],
    lse: &'a [f64],
    /// First partial row of each item.
    offsets: &'a [usize],
    plans: &'a [SeqPlan],
    g: usize,
    d: usize,
    hq: usize,
}

/// A run of query tokens of one sequence, with its output rows `[tokens][heads][d]` and LSEs
/// `[tokens][heads]`.
struct Tokens<'o, T> {
    b: usize,
    i0: usize,
    o: &'o mut [T],
    lse: &'o mut [f32],
}

/// Tokens per merge item.
const MERGE_TOKENS: usize = 64;

fn combine<T: Element>(
    parts: &Parts<'_>,
    layout: &BatchLayout<'_>,
    seqlen_q: &dyn Fn(usize) -> usize,
    o: &mut [T],
    lse: &mut [f32],
    threads: usize,
) {
    let (hq, d) = (parts.hq, parts.d);
    let mut items = Vec::new();
    let (mut o_rest, mut l_rest) = (o, lse);
    let mut next_token = 0;
    for b in 0..layout.batch() {
        let sq = seqlen_q(b);
        if sq == 0 {
            continue;
        }
        let (outer, row) = layout.q_row(b, 0);
        let t0 = outer * layout.q_rows() + row;
        // Sequences are in token order in both layouts; skip any gap (no layout leaves one).
        let gap = t0 - next_token;
        o_rest = &mut std::mem::take(&mut o_rest)[gap * hq * d..];
        l_rest = &mut std::mem::take(&mut l_rest)[gap * hq..];
        for i0 in (0..sq).step_by(MERGE_TOKENS) {
            let n = MERGE_TOKENS.min(sq - i0);
            let (oi, ot) = std::mem::take(&mut o_rest).split_at_mut(n * hq * d);
            let (li, lt) = std::mem::take(&mut l_rest).split_at_mut(n * hq);
            (o_rest, l_rest) = (ot, lt);
            items.push(Tokens { b, i0, o: oi, lse: li });
        }
        next_token = t0 + sq;
    }
    let threads = if parts.plans.iter().any(|p| p.ns > 1) || items.len() > 8 {
        threads
    } else {
        1
    };
    parallel::for_each(
        &mut items,
        threads,
        || vec![0.0f32; d],
        |row, tk| {
            let pl = parts.plans[tk.b];
            let n = tk.lse.len() / hq;
            for ti in 0..n {
                let i = tk.i0 + ti;
                for h in 0..hq {
                    let (hk, r) = (h / parts.g, i * parts.g + h % parts.g);
                    let first = pl.first + (hk * pl.nrb + r / RB) * pl.ns;
                    let rr = r % RB;
                    let src = |s: usize| {
                        let at = parts.offsets[first + s] + rr;
                        (&parts.o[at * d..(at + 1) * d], parts.lse[at])
                    };
                    let dst = &mut tk.o[(ti * hq + h) * d..(ti * hq + h + 1) * d];
                    let l = if pl.ns == 1 {
                        let (x, l) = src(0);
                        row.copy_from_slice(x);
                        l as f32
                    } else {
                        merge_row((0..pl.ns).map(src), row)
                    };
                    for (o, &x) in dst.iter_mut().zip(row.iter()) {
                        *o = T::from_f32(x);
                    }
                    tk.lse[ti * hq + h] = l;
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_widening_is_exact() {
        let all: Vec<half::f16> = (0..=u16::MAX).map(half::f16::from_bits).collect();
        let mut out = vec![0.0f32; all.len()];
        widen_f16(&all, &mut out);
        for (h, &w) in all.iter().zip(&out) {
            let want = h.to_f32();
            assert!(
                want.to_bits() == w.to_bits() || (want.is_nan() && w.is_nan()),
                "{h:?}: {w} vs {want}"
            );
        }
    }

    /// The blocked decode's max skips NaN scores and the keys past `n` as `panel_max` does, and
    /// is −inf when there is no other score; its sum is the tree of halves.
    #[test]
    fn block_max_and_sum() {
        let nan = f32::NAN;
        let mut x = [0.5f32; 16];
        x[3] = nan;
        x[7] = 2.0;
        x[12] = 9.0;
        assert_eq!(block_max(&x, 12), 2.0);
        assert_eq!(block_max(&x, 16), 9.0);
        let all_nan = [nan; 16];
        assert_eq!(block_max(&all_nan, 16), f32::NEG_INFINITY);
        let ninf = [f32::NEG_INFINITY; 16];
        assert_eq!(block_max(&ninf, 5), f32::NEG_INFINITY);
        for n in 0..=16 {
            let y: [f32; 16] = std::array::from_fn(|t| if t < n { (t * t) as f32 - 7.5 } else { f32::NEG_INFINITY });
            let want = y[..n].iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
            assert_eq!(block_max(&y, n), want);
        }
        let p: [f32; 16] = std::array::from_fn(|t| t as f32);
        assert_eq!(tree_sum(p), 120.0);
        let mut q = [0.0f32; 16];
        q[5] = f32::INFINITY;
        assert_eq!(tree_sum(q), f32::INFINITY);
    }

    #[test]
    fn split_heuristic() {
        // Enough items for the workers: never split.
        assert_eq!(num_splits(8, 2, 4096), 1);
        assert_eq!(num_splits(17, 2, 1 << 20), 1);
        // One worker, or too few keys: never split.
        assert_eq!(num_splits(1, 1, 1 << 20), 1);
        assert_eq!(num_splits(1, 2, 2 * MIN_SPLIT_KEYS - 1), 1);
        // One item, two workers: two splits; five items on two workers: ten pieces.
        assert_eq!(num_splits(1, 2, 4096), 2);
        assert_eq!(num_splits(5, 2, 4096), 2);
        // Many workers, one long sequence: about one split per worker (the smallest count
        // within 85 % of the best efficiency: 14 of 16).
        assert_eq!(num_splits(1, 16, 1 << 20), 14);
        assert!(num_splits(1, 1000, 1 << 20) <= MAX_SPLITS);
    }

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
            // Group-1 decode of 16-bit K/V (`sweep_rows`), with softcap and ALiBi (natural units).
            (1, 1, 530, 4, 4, 72, DType::F16, ForwardOptions::default().softcap(5.0)),
            (2, 1, 300, 3, 3, 64, DType::BF16, ForwardOptions::default().alibi_slopes(vec![0.5, 0.25, 0.125])),
            (2, 1, 1100, 8, 2, 64, DType::F32, ForwardOptions::default().num_splits(3)),
            (1, 1, 333, 4, 4, 80, DType::BF16, ForwardOptions::default()),
            (1, 5, 260, 4, 2, 40, DType::F32, ForwardOptions::default().causal(true)),
            (1, 3, 150, 2, 1, 33, DType::F16, ForwardOptions::default().mask(Mask::window(20, 0))),
            (1, 2, 90, 2, 2, 16, DType::F32, ForwardOptions::default().causal(true)),
            // The blocked AVX-512 decode (`sweep_blocks`, head_dim a multiple of 32): f16 with
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
                let run = RunOpts { threads: *threads, splits: opts.num_splits, skip: &[] };
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
            // in one unit, each block taken in key order: `block_key_major`) and head-major (one
            // kv head per unit, each item its whole block in turn) runs the same operations per
            // row: the same bits. (The chunked path, where the blocked one does not apply, takes
            // chunks of different lengths in the two.)
            let one = RunOpts { threads: 1, splits: Some(1), skip: &[] };
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

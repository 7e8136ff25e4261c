//! The CPU backward pass: FlashAttention-2's algorithm on the host, deterministic by
//! construction.
//!
//! 1. Per (sequence, query head), Q and dO are widened to f32 rows padded to `dp` columns, and
//!    per row `D = rowsum(dO ∘ O)` and the LSE in log2 units are kept; per (sequence, kv head) K
//!    and V are widened likewise. This is all the extra memory besides the dq partials: O(N).
//! 2. Work items are (sequence, kv head, chunk of key blocks). For each block of `BC` keys the
//!    item packs Kᵀ and Vᵀ and, for every query head of the GQA group and every block of `BR`
//!    query rows that sees one of those keys, recomputes `S = Q·Kᵀ` and `P = exp2(S·c − LSE)`,
//!    forms `dP = dO·Vᵀ` and `dS = P ∘ (dP − D)` (times `1 − tanh²` under a softcap), and
//!    accumulates `dV += Pᵀ·dO`, `dK += dSᵀ·Q` in the item's own f32 tiles and `dQ += dS·K`
//!    into the item's own dq partial. A key block's dk and dv are complete when its loop ends
//!    and are written then (one owner per row: GQA groups are summed inside the item, in head
//!    order).
//! 3. dq is the sum of the chunks' partials, taken in chunk order per row.
//!
//! The chunks of a sequence depend on its key count only (at most [`MAX_KEY_CHUNKS`]), never on
//! the thread count, and every sum runs in a fixed order: the gradients are bit-identical across
//! runs and thread counts. No score matrix is materialised beyond one `BR × BC` tile per worker.

mod tile;

use super::parallel;
use super::pool;
use crate::numerics::softmax_math::Exp2Math;
use super::isa::{isa, Isa};
use super::Native;
use crate::error::{Error, Result};
use crate::problem::{Problem, LOG2E};
use crate::tensor::{Element, TensorView};
use tile::{product, ALayout, Dims, MR};

/// Query rows per tile (a multiple of the products' 6-row tiles).
pub(crate) const BR: usize = 48;
/// Keys per tile (a multiple of the 6-row tiles and of the widest column panel, 32).
pub(crate) const BC: usize = 96;
/// head_dim is padded to a multiple of this (the widest column panel): the larger of q/k's and
/// v's, so that q, k, v and dO rows share one padded width (zeros past their own head_dim).
const DPAD: usize = 32;
/// Largest head_dim (q/k's and v's) the CPU backward takes: 512. The forward's 576 (MLA's
/// absorbed decode, an inference shape) is not tested here: a draw at (16, 576) in bf16 put dq
/// past FlashAttention's bound of the float64 gradient.
pub(crate) const MAX_BWD_HEAD_DIM: usize = 512;
/// The most key chunks of one (sequence, kv head): work items, and dq partials per row.
pub(crate) const MAX_KEY_CHUNKS: usize = 8;

/// One sequence of a backward call: its rows in the views and its LSE.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    /// Batch index in the views (0 for a packed varlen batch).
    pub b: usize,
    /// First query row (seqlen index of q, o, d_o and dq) and the number of rows.
    pub q0: usize,
    pub sq: usize,
    /// First key row (seqlen index of k, v, dk, dv) and the number of keys.
    pub k0: usize,
    pub sk: usize,
    /// LSE index of (head 0, row 0), and the distance between heads (rows are contiguous).
    pub lse0: usize,
    pub lse_head: usize,
}

/// The inputs of a backward call, validated by the caller (shapes, layouts, dtypes, LSE length).
pub(crate) struct Inputs<'a> {
    pub q: TensorView<'a>,
    pub k: TensorView<'a>,
    pub v: TensorView<'a>,
    pub o: TensorView<'a>,
    pub d_o: TensorView<'a>,
    pub lse: &'a [f32],
}

/// The caller's gradient buffers: `dq` contiguous in q's shape, `dk` in k's and `dv` in v's, and
/// with attention sinks the sink logits' gradient, one per query head.
pub(crate) struct GradsOut<'a, T> {
    pub dq: &'a mut [T],
    pub dk: &'a mut [T],
    pub dv: &'a mut [T],
    pub d_sinks: Option<&'a mut [f32]>,
}

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// Key blocks per chunk and the number of chunks of a sequence of `sk` keys.
fn chunking(sk: usize) -> (usize, usize) {
    let nkb = sk.div_ceil(BC);
    let per = nkb.div_ceil(MAX_KEY_CHUNKS).max(1);
    (per, nkb.div_ceil(per))
}

/// `a · b · c` or [`Error::TooLarge`] naming `what`.
fn size(factors: &[usize], what: &str) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &x| acc.checked_mul(x))
        .ok_or_else(|| Error::TooLarge { what: format!("{what}: {factors:?} elements overflow usize") })
}

/// Where each span's buffers start in the flat f32 buffers.
struct Offsets {
    /// Q / dO rows: `q[s] + h · sqp · dp`.
    q: Vec<usize>,
    /// Row values (LSE, D): `row[s] + h · sqp`.
    row: Vec<usize>,
    /// K / V rows: `k[s] + hk · sk · dp`.
    k: Vec<usize>,
    /// dq partials: `part[s] + ((hk · chunks + c) · group + g) · sqp · dp`.
    part: Vec<usize>,
    totals: [usize; 4],
}

impl Offsets {
    fn new(p: &Problem, spans: &[Span], dp: usize) -> Result<Self> {
        let (mut q, mut row, mut k, mut part) = (vec![], vec![], vec![], vec![]);
        let mut t = [0usize; 4];
        for sp in spans {
            let sqp = round_up(sp.sq, BR);
            let (_, chunks) = chunking(sp.sk);
            q.push(t[0]);
            row.push(t[1]);
            k.push(t[2]);
            part.push(t[3]);
            let add = |acc: usize, f: &[usize], what: &str| -> Result<usize> {
                acc.checked_add(size(f, what)?).ok_or_else(|| Error::TooLarge { what: what.into() })
            };
            t[0] = add(t[0], &[p.heads_q, sqp, dp], "backward f32 copies of q and d_o")?;
            t[1] = add(t[1], &[p.heads_q, sqp], "backward row values")?;
            t[2] = add(t[2], &[p.heads_kv, sp.sk, dp], "backward f32 copies of k and v")?;
            t[3] = add(t[3], &[p.heads_kv, chunks, p.group(), sqp, dp], "backward dq partials")?;
        }
        Ok(Offsets { q, row, k, part, totals: t })
    }
}

/// Everything the workers read.
struct Ctx<'a> {
    problems: Vec<Problem>,
    spans: &'a [Span],
    off: Offsets,
    /// head_dim of q and k, of v, and the padded width of every f32 row.
    d: usize,
    d_v: usize,
    dp: usize,
    q: &'a [f32],
    d_o: &'a [f32],
    lse2: &'a [f32],
    delta: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
}

/// A work item of the main pass: (span, kv head, chunk), its dq partial and its dk/dv rows.
struct Item<'a, T> {
    s: usize,
    hk: usize,
    /// Key blocks `blocks.0..blocks.1` of the span.
    blocks: (usize, usize),
    part: &'a mut [f32],
    dk: Vec<&'a mut [T]>,
    dv: Vec<&'a mut [T]>,
}

/// A worker's tiles.
struct Scratch {
    kt: Vec<f32>,
    vt: Vec<f32>,
    s: Vec<f32>,
    dp: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

impl Scratch {
    fn new(dp: usize) -> Self {
        Scratch {
            kt: vec![0.0; dp * BC],
            vt: vec![0.0; dp * BC],
            s: vec![0.0; BR * BC],
            dp: vec![0.0; BR * BC],
            dk: vec![0.0; BC * dp],
            dv: vec![0.0; BC * dp],
        }
    }
}

/// The rows of a contiguous `[batch, seqlen, heads, head_dim]` buffer, each taken once.
fn rows<T>(buf: &mut [T], d: usize) -> Vec<Option<&mut [T]>> {
    buf.chunks_exact_mut(d).map(Some).collect()
}

/// The rows at `idx`, each taken out of `rows` (a row taken before is skipped).
fn take_rows<'a, T>(rows: &mut [Option<&'a mut [T]>], idx: impl Iterator<Item = usize>) -> Vec<&'a mut [T]> {
    idx.filter_map(|i| rows.get_mut(i).and_then(Option::take)).collect()
}

/// The name of the path [`run`] takes on this CPU.
pub(crate) fn path_name() -> &'static str {
    match isa() {
        Isa::Avx512 => "cpu-bwd-tiled-avx512",
        Isa::Avx2Fma => "cpu-bwd-tiled-avx2",
        Isa::Portable => "cpu-bwd-tiled-portable",
    }
}

/// The backward of every span into `out`. `p` carries the heads, head_dim and options (its
/// seqlens are replaced per span); `x` and `out` were checked against `p` and the spans.
pub(crate) fn run<T: Element>(
    p: &Problem,
    spans: &[Span],
    x: &Inputs<'_>,
    threads: usize,
    out: GradsOut<'_, T>,
) -> Result<&'static str> {
    for (head_dim, of) in [(p.head_dim, "q and k"), (p.head_dim_v, "v")] {
        if head_dim > MAX_BWD_HEAD_DIM {
            return Err(Error::UnsupportedHeadDim {
                head_dim,
                backend: "the CPU backward".into(),
                supported: format!("1..={MAX_BWD_HEAD_DIM} (for the head_dim of {of})"),
            });
        }
    }
    let (d, d_v) = (p.head_dim, p.head_dim_v);
    let dp = round_up(d.max(d_v), DPAD);
    let group = p.group();
    let off = Offsets::new(p, spans, dp)?;
    let [nq, nrow, nk, npart] = off.totals;
    let mut qb = pool::take_dirty(nq, "backward f32 q")?;
    let mut dob = pool::take_dirty(nq, "backward f32 d_o")?;
    let mut lse2 = pool::take_dirty(nrow, "backward LSE")?;
    let mut delta = pool::take_dirty(nrow, "backward D")?;
    let mut kb = pool::take_dirty(nk, "backward f32 k")?;
    let mut vb = pool::take_dirty(nk, "backward f32 v")?;
    let mut part = pool::take(npart, "backward dq partials")?;

    // 1. Widen Q and dO (zero padding), D and the LSE per (span, head); K and V per (span, kv head).
    {
        struct QItem<'a> {
            s: usize,
            h: usize,
            q: &'a mut [f32],
            d_o: &'a mut [f32],
            lse2: &'a mut [f32],
            delta: &'a mut [f32],
        }
        let mut items = Vec::new();
        let (mut qr, mut dor, mut lr, mut dr) = (&mut qb[..], &mut dob[..], &mut lse2[..], &mut delta[..]);
        for (s, sp) in spans.iter().enumerate() {
            let sqp = round_up(sp.sq, BR);
            for h in 0..p.heads_q {
                let (q, rest) = std::mem::take(&mut qr).split_at_mut(sqp * dp);
                qr = rest;
                let (d_o, rest) = std::mem::take(&mut dor).split_at_mut(sqp * dp);
                dor = rest;
                let (l, rest) = std::mem::take(&mut lr).split_at_mut(sqp);
                lr = rest;
                let (dd, rest) = std::mem::take(&mut dr).split_at_mut(sqp);
                dr = rest;
                items.push(QItem { s, h, q, d_o, lse2: l, delta: dd });
            }
        }
        parallel::for_each(&mut items, threads, || vec![0.0f32; d_v], |orow, it| {
            let sp = spans[it.s];
            it.q.fill(0.0);
            it.d_o.fill(0.0);
            it.lse2.fill(f32::NEG_INFINITY);
            it.delta.fill(0.0);
            for i in 0..sp.sq {
                let row = sp.q0 + i;
                x.q.read_row(sp.b, row, it.h, &mut it.q[i * dp..][..d]);
                let dorow = &mut it.d_o[i * dp..][..d_v];
                x.d_o.read_row(sp.b, row, it.h, dorow);
                x.o.read_row(sp.b, row, it.h, orow);
                it.delta[i] = dorow.iter().zip(orow.iter()).map(|(a, b)| a * b).sum();
                it.lse2[i] = x.lse[sp.lse0 + it.h * sp.lse_head + i] * LOG2E;
            }
        });
        struct KItem<'a> {
            s: usize,
            hk: usize,
            k: &'a mut [f32],
            v: &'a mut [f32],
        }
        let mut items = Vec::new();
        let (mut kr, mut vr) = (&mut kb[..], &mut vb[..]);
        for (s, sp) in spans.iter().enumerate() {
            for hk in 0..p.heads_kv {
                let (k, rest) = std::mem::take(&mut kr).split_at_mut(sp.sk * dp);
                kr = rest;
                let (v, rest) = std::mem::take(&mut vr).split_at_mut(sp.sk * dp);
                vr = rest;
                items.push(KItem { s, hk, k, v });
            }
        }
        parallel::for_each(&mut items, threads, || (), |_, it| {
            let sp = spans[it.s];
            it.k.fill(0.0);
            it.v.fill(0.0);
            for j in 0..sp.sk {
                x.k.read_row(sp.b, sp.k0 + j, it.hk, &mut it.k[j * dp..][..d]);
                x.v.read_row(sp.b, sp.k0 + j, it.hk, &mut it.v[j * dp..][..d_v]);
            }
        });
    }

    let problems: Vec<Problem> = spans
        .iter()
        .map(|sp| {
            let mut ps = p.clone();
            ps.seqlen_q = sp.sq;
            ps.seqlen_k = sp.sk;
            ps
        })
        .collect();
    let (q_rows, k_rows) = (x.q.shape()[1], x.k.shape()[1]);
    let (hq, hkv) = (p.heads_q, p.heads_kv);
    let GradsOut { dq, dk, dv, d_sinks } = out;
    if let Some(ds) = d_sinks {
        sink_gradients(p, spans, &off, &lse2, &delta, ds);
    }
    let mut dq_rows = rows(dq, d);
    let mut dk_rows = rows(dk, d);
    let mut dv_rows = rows(dv, d_v);

    // 2. The main pass over key chunks.
    let ctx = Ctx {
        problems,
        spans,
        off,
        d,
        d_v,
        dp,
        q: &qb,
        d_o: &dob,
        lse2: &lse2,
        delta: &delta,
        k: &kb,
        v: &vb,
    };
    {
        let mut items: Vec<(u64, Item<'_, T>)> = Vec::new();
        let mut pr = &mut part[..];
        for (s, sp) in spans.iter().enumerate() {
            let sqp = round_up(sp.sq, BR);
            let (per, chunks) = chunking(sp.sk);
            let nkb = sp.sk.div_ceil(BC);
            for hk in 0..hkv {
                for c in 0..chunks {
                    let (pt, rest) = std::mem::take(&mut pr).split_at_mut(group * sqp * dp);
                    pr = rest;
                    let blocks = (c * per, ((c + 1) * per).min(nkb));
                    let keys = (blocks.0 * BC, (blocks.1 * BC).min(sp.sk));
                    let row = |j: usize| (sp.b * k_rows + sp.k0 + j) * hkv + hk;
                    if sp.sq == 0 {
                        continue; // no query: its dk and dv rows are zeroed with the unowned ones
                    }
                    let dk_item = take_rows(&mut dk_rows, (keys.0..keys.1).map(row));
                    let dv_item = take_rows(&mut dv_rows, (keys.0..keys.1).map(row));
                    let ps = &ctx.problems[s];
                    let cost: u64 = (0..sp.sq)
                        .map(|i| {
                            let (lo, hi) = ps.key_range(i);
                            hi.min(keys.1).saturating_sub(lo.max(keys.0)) as u64
                        })
                        .sum();
                    items.push((cost, Item { s, hk, blocks, part: pt, dk: dk_item, dv: dv_item }));
                }
            }
        }
        items.sort_by_key(|x| std::cmp::Reverse(x.0));
        let mut items: Vec<Item<'_, T>> = items.into_iter().map(|x| x.1).collect();
        let isa = isa();
        parallel::for_each(&mut items, threads, || Scratch::new(dp), |scr, it| run_item(isa, &ctx, scr, it));
    }

    // 3. dq: the partials summed in chunk order, scaled, per (span, head, block of rows).
    {
        struct RItem<'a, T> {
            s: usize,
            h: usize,
            i0: usize,
            rows: Vec<&'a mut [T]>,
        }
        let mut items = Vec::new();
        for (s, sp) in spans.iter().enumerate() {
            for h in 0..hq {
                for i0 in (0..sp.sq).step_by(BR) {
                    let i1 = (i0 + BR).min(sp.sq);
                    let rows = take_rows(&mut dq_rows, (i0..i1).map(|i| (sp.b * q_rows + sp.q0 + i) * hq + h));
                    items.push(RItem { s, h, i0, rows });
                }
            }
        }
        let part = &part[..];
        let scale = p.scale;
        parallel::for_each(&mut items, threads, || vec![0.0f32; d], |acc, it| {
            let sp = spans[it.s];
            let sqp = round_up(sp.sq, BR);
            let (_, chunks) = chunking(sp.sk);
            let (hk, g) = (it.h / group, it.h % group);
            for (r, dst) in it.rows.iter_mut().enumerate() {
                let i = it.i0 + r;
                acc.fill(0.0);
                for c in 0..chunks {
                    let at = ctx.off.part[it.s] + ((hk * chunks + c) * group + g) * sqp * dp + i * dp;
                    for (a, y) in acc.iter_mut().zip(&part[at..][..d]) {
                        *a += y;
                    }
                }
                for (o, a) in dst.iter_mut().zip(acc.iter()) {
                    *o = T::from_f32(a * scale);
                }
            }
        });
    }
    // Rows no sequence owns (between varlen sequences, or of empty ones) get zero gradients.
    for r in dq_rows.into_iter().chain(dk_rows).chain(dv_rows).flatten() {
        r.fill(T::from_f32(0.0));
    }
    for b in [qb, dob, lse2, delta, kb, vb, part] {
        pool::give(b);
    }
    Ok(path_name())
}

/// The sink logits' gradient `d_s_h = −Σ_rows exp(s_h − LSE) · D` per query head (the sink
/// enters the softmax denominator only: its probability is `exp(s_h − LSE)` and it has no value,
/// so its dP is 0 and its dS is `P_sink · (0 − D)`), from the rows' LSE (log2 units) and D of
/// step 1, summed in f64 in span and row order (deterministic). A head without a sink (−inf)
/// gets 0.
fn sink_gradients(p: &Problem, spans: &[Span], off: &Offsets, lse2: &[f32], delta: &[f32], out: &mut [f32]) {
    for (h, o) in out.iter_mut().enumerate().take(p.heads_q) {
        let Some(sink) = p.sink(h) else {
            *o = 0.0;
            continue;
        };
        let sink2 = sink as f64 * LOG2E as f64;
        let mut sum = 0.0f64;
        for (s, sp) in spans.iter().enumerate() {
            let at = off.row[s] + h * round_up(sp.sq, BR);
            for (l, dd) in lse2[at..][..sp.sq].iter().zip(&delta[at..][..sp.sq]) {
                sum += (sink2 - *l as f64).exp2() * *dd as f64;
            }
        }
        *o = -sum as f32;
    }
}

/// [`item`] compiled for the best instruction set this CPU has (and `isa` allows).
fn run_item<T: Element>(isa: Isa, ctx: &Ctx, scr: &mut Scratch, it: &mut Item<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
        if isa == Isa::Avx512 && avx2 && std::is_x86_feature_detected!("avx512f") {
            #[target_feature(enable = "avx512f,avx2,fma")]
            fn wide<T: Element>(ctx: &Ctx, scr: &mut Scratch, it: &mut Item<'_, T>) {
                item::<T, 32, true>(ctx, scr, it)
            }
            // SAFETY: AVX-512F, AVX2 and FMA were just detected on this CPU, the only
            // requirement of a `#[target_feature]` function; the function itself is safe code.
            unsafe { wide(ctx, scr, it) };
            return;
        }
        if isa != Isa::Portable && avx2 {
            #[target_feature(enable = "avx2,fma")]
            fn narrow<T: Element>(ctx: &Ctx, scr: &mut Scratch, it: &mut Item<'_, T>) {
                item::<T, 16, true>(ctx, scr, it)
            }
            // SAFETY: AVX2 and FMA were just detected on this CPU, the only requirement of a
            // `#[target_feature]` function; the function itself is safe code.
            unsafe { narrow(ctx, scr, it) };
            return;
        }
    }
    let _ = isa;
    item::<T, 16, false>(ctx, scr, it)
}

/// One work item: every key block of its chunk, for every query head of its group.
#[inline(always)]
fn item<T: Element, const N: usize, const FMA: bool>(ctx: &Ctx, scr: &mut Scratch, it: &mut Item<'_, T>) {
    let (s, hk) = (it.s, it.hk);
    let sp = ctx.spans[s];
    let ps = &ctx.problems[s];
    let (d, d_v, dp) = (ctx.d, ctx.d_v, ctx.dp);
    let group = ps.group();
    let sqp = round_up(sp.sq, BR);
    let kv_at = ctx.off.k[s] + hk * sp.sk * dp;
    let (kh, vh) = (&ctx.k[kv_at..][..sp.sk * dp], &ctx.v[kv_at..][..sp.sk * dp]);
    let scale = ps.scale;
    let plain = ps.softcap.is_none() && ps.alibi.is_none();
    let first_key = it.blocks.0 * BC;
    for blk in it.blocks.0..it.blocks.1 {
        let j0 = blk * BC;
        let nj = BC.min(sp.sk - j0);
        let njp = round_up(nj, MR);
        // Kᵀ and Vᵀ of the block, [d][BC] and [d_v][BC], zero past the last key.
        for (t, src, d) in [(&mut scr.kt, kh, d), (&mut scr.vt, vh, d_v)] {
            for x in 0..d {
                let row = &mut t[x * BC..][..BC];
                for (j, y) in row[..nj].iter_mut().enumerate() {
                    *y = src[(j0 + j) * dp + x];
                }
                row[nj..].fill(0.0);
            }
        }
        scr.dk[..njp * dp].fill(0.0);
        scr.dv[..njp * dp].fill(0.0);
        for g in 0..group {
            let h = hk * group + g;
            let q_at = ctx.off.q[s] + h * sqp * dp;
            let (qh, doh) = (&ctx.q[q_at..][..sqp * dp], &ctx.d_o[q_at..][..sqp * dp]);
            let row_at = ctx.off.row[s] + h * sqp;
            let (lse2, delta) = (&ctx.lse2[row_at..][..sqp], &ctx.delta[row_at..][..sqp]);
            let part = &mut it.part[g * sqp * dp..][..sqp * dp];
            for i0 in (0..sp.sq).step_by(BR) {
                let ni = BR.min(sp.sq - i0);
                let nip = round_up(ni, MR);
                // Each row's visible keys inside the block, local; the block is skipped when no
                // row of it sees one (or every such row has no key at all).
                let ranges: [(usize, usize); BR] = std::array::from_fn(|r| {
                    if r >= ni || lse2[i0 + r] == f32::NEG_INFINITY {
                        return (0, 0);
                    }
                    let (lo, hi) = ps.key_range(i0 + r);
                    (lo.clamp(j0, j0 + nj) - j0, hi.clamp(j0, j0 + nj) - j0)
                });
                if ranges.iter().all(|&(lo, hi)| lo >= hi) {
                    continue;
                }
                let dims = Dims { m: nip, n: BC, k: d };
                product::<N, FMA, false>(dims, &qh[i0 * dp..], ALayout::RowMajor(dp), &scr.kt, BC, &mut scr.s, BC);
                let vdims = Dims { m: nip, n: BC, k: d_v };
                product::<N, FMA, false>(vdims, &doh[i0 * dp..], ALayout::RowMajor(dp), &scr.vt, BC, &mut scr.dp, BC);
                // P into `s`, dS into `dp`; zero where masked, past the keys and past the rows.
                let c = scale * LOG2E;
                for (r, &(lo, hi)) in ranges.iter().enumerate().take(nip) {
                    let srow = &mut scr.s[r * BC..][..BC];
                    let drow = &mut scr.dp[r * BC..][..BC];
                    if lo >= hi {
                        srow.fill(0.0);
                        drow.fill(0.0);
                        continue;
                    }
                    let (l2, dd) = (lse2[i0 + r], delta[i0 + r]);
                    srow[..lo].fill(0.0);
                    drow[..lo].fill(0.0);
                    srow[hi..].fill(0.0);
                    drow[hi..].fill(0.0);
                    let (sv, dv) = (&mut srow[lo..hi], &mut drow[lo..hi]);
                    if plain {
                        for (sx, dx) in sv.iter_mut().zip(dv.iter_mut()) {
                            let pr = Native.exp2(*sx * c - l2);
                            *dx = pr * (*dx - dd);
                            *sx = pr;
                        }
                    } else {
                        let i = i0 + r;
                        for (jl, (sx, dx)) in sv.iter_mut().zip(dv.iter_mut()).enumerate() {
                            let u = *sx * scale;
                            let (sc, t) = match ps.softcap {
                                Some(cap) => {
                                    let t = (u / cap).tanh();
                                    (cap * t, t)
                                }
                                None => (u, 0.0),
                            };
                            let sc = sc + ps.alibi_bias(h, i, j0 + lo + jl);
                            let pr = Native.exp2(sc * LOG2E - l2);
                            *dx = pr * (*dx - dd) * (1.0 - t * t);
                            *sx = pr;
                        }
                    }
                }
                let kdims = Dims { m: njp, n: dp, k: ni };
                product::<N, FMA, true>(kdims, &scr.s, ALayout::ColMajor(BC), &doh[i0 * dp..], dp, &mut scr.dv, dp);
                product::<N, FMA, true>(kdims, &scr.dp, ALayout::ColMajor(BC), &qh[i0 * dp..], dp, &mut scr.dk, dp);
                let qdims = Dims { m: nip, n: dp, k: nj };
                let kblk = &kh[j0 * dp..];
                product::<N, FMA, true>(qdims, &scr.dp, ALayout::RowMajor(BC), kblk, dp, &mut part[i0 * dp..], dp);
            }
        }
        // The block's dk and dv are complete: write them (dk scaled) in the output type.
        for j in 0..nj {
            let jr = j0 + j - first_key;
            if let (Some(dk), Some(dv)) = (it.dk.get_mut(jr), it.dv.get_mut(jr)) {
                for (o, &y) in dk.iter_mut().zip(&scr.dk[j * dp..][..d]) {
                    *o = T::from_f32(y * scale);
                }
                for (o, &y) in dv.iter_mut().zip(&scr.dv[j * dp..][..d_v]) {
                    *o = T::from_f32(y);
                }
            }
        }
    }
}

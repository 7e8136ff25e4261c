//! The in-place path's general sweep: an item's keys in chunks, each chunk's K/V rows read once
//! for every panel of the item's query rows.

use super::scratch::Scratch;
use super::sweep::{same_span, Sweep};
use super::item::{Ctx, Item, ItemSpan};
use super::sizes::{CHUNK_KEYS, SWEEP_CHUNK_KEYS};
use crate::convert::Widen;
use crate::cpu::gemm::NR;
use crate::cpu::row_products::{pv_panel, qk_panel};
use crate::cpu::rows::{prefetch_codes, prefetch_row};
use crate::cpu::softmax::{online_softmax, panel_max, panel_scales, row_probs, RowState};
use crate::numerics::softmax_math::Exp2Math;
use crate::problem::Problem;
use crate::tensor::Data;

/// The items of one unit that see the same keys (more than one item), advancing chunk by chunk
/// together: each chunk of [`SWEEP_CHUNK_KEYS`] keys is taken by every item in turn, so the
/// chunk's K/V rows of all their heads, side by side in memory, are read in one sweep.
pub(super) struct ChunksTogether;

impl Sweep for ChunksTogether {
    #[inline(always)]
    fn run<M: Exp2Math, const FMA: bool>(c: &Ctx<'_, M>, items: &mut [Item<'_>], scrs: &mut [Scratch], spans: &[ItemSpan]) -> bool {
        if !(same_span(spans) && items.len() > 1) {
            return false;
        }
        sweep_chunks_together::<M, FMA>(c, items, scrs, spans);
        true
    }
}

/// Each item alone over its own keys, in chunks of [`CHUNK_KEYS`]: any unit.
pub(super) struct ChunksAlone;

impl Sweep for ChunksAlone {
    #[inline(always)]
    fn run<M: Exp2Math, const FMA: bool>(c: &Ctx<'_, M>, items: &mut [Item<'_>], scrs: &mut [Scratch], spans: &[ItemSpan]) -> bool {
        sweep_chunks_alone::<M, FMA>(c, items, scrs, spans);
        true
    }
}

/// [`ChunksTogether`]'s loop.
#[inline(always)]
fn sweep_chunks_together<M: Exp2Math, const FMA: bool>(
    c: &Ctx<'_, M>,
    items: &mut [Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
) {
    let (lo_all, hi_all) = spans.first().map_or((0, 0), |s| (s.lo_all, s.hi_all));
    let first_hk = items[0].hk;
    let mut j0 = lo_all;
    while j0 < hi_all {
        let j1 = (j0 + SWEEP_CHUNK_KEYS).min(hi_all);
        let n = items.len();
        for i in 0..n {
            // What this worker reads next: the same keys of the next head, or the next
            // chunk of the first head.
            let next = if i + 1 < n {
                Some((items[i + 1].hk, j0, j1))
            } else {
                (j1 < hi_all).then(|| (first_hk, j1, (j1 + SWEEP_CHUNK_KEYS).min(hi_all)))
            };
            attend_chunk::<M, FMA>(c, &mut items[i], &mut scrs[i], &spans[i].ps, (j0, j1), next);
        }
        j0 = j1;
    }
}

/// [`ChunksAlone`]'s loop.
#[inline(always)]
fn sweep_chunks_alone<M: Exp2Math, const FMA: bool>(
    c: &Ctx<'_, M>,
    items: &mut [Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
) {
    for ((it, scr), sp) in items.iter_mut().zip(scrs.iter_mut()).zip(spans) {
        let mut j0 = sp.lo_all;
        while j0 < sp.hi_all {
            let j1 = (j0 + CHUNK_KEYS).min(sp.hi_all);
            let next = (j1 < sp.hi_all).then(|| (it.hk, j1, (j1 + CHUNK_KEYS).min(sp.hi_all)));
            attend_chunk::<M, FMA>(c, it, scr, &sp.ps, (j0, j1), next);
            j0 = j1;
        }
    }
}

/// The rows of a chunk as f32 slices: in place for f32, widened into `buf` for 16-bit types
/// (inlined into the AVX2 context, where both widenings vectorise).
#[inline(always)]
pub(super) fn chunk_rows<'r>(data: Data<'r>, ofs: &[usize], d: usize, buf: &'r mut [f32]) -> [&'r [f32]; CHUNK_KEYS] {
    let n = ofs.len();
    match data {
        Data::F32(x) => std::array::from_fn(|j| if j < n { &x[ofs[j]..ofs[j] + d] } else { &[] }),
        Data::F16(x) => {
            for (dst, &o) in buf.chunks_exact_mut(d).zip(ofs) {
                for (a, h) in dst.iter_mut().zip(&x[o..o + d]) {
                    *a = h.widen();
                }
            }
            buffered_rows(buf, n, d)
        }
        Data::BF16(x) => {
            for (dst, &o) in buf.chunks_exact_mut(d).zip(ofs) {
                for (a, b) in dst.iter_mut().zip(&x[o..o + d]) {
                    *a = b.widen();
                }
            }
            buffered_rows(buf, n, d)
        }
    }
}

/// The first `n` rows of `d` elements of `buf` (the rest empty).
#[inline(always)]
fn buffered_rows(buf: &[f32], n: usize, d: usize) -> [&[f32]; CHUNK_KEYS] {
    let mut it = buf.chunks_exact(d);
    std::array::from_fn(|j| if j < n { it.next().unwrap_or(&[]) } else { &[] })
}

/// Asks the cache for the K and V rows of kv head `hk`, keys `j0..j1` of sequence `b`: the
/// rows a worker reads next, fetched while it computes on the current ones.
#[inline(always)]
pub(super) fn prefetch_rows<M>(c: &Ctx<'_, M>, b: usize, (hk, j0, j1): (usize, usize, usize)) {
    let (d, dv) = (c.p.head_dim, c.p.head_dim_v);
    c.layout.for_kv_rows(b, j0, j1, |_, outer, row| {
        let (ko, vo) = (c.k.offset(outer, row, hk), c.v.offset(outer, row, hk));
        match &c.fp8 {
            Some(f) => {
                prefetch_codes(f.k.codes, ko, d);
                prefetch_codes(f.v.codes, vo, dv);
            }
            None => {
                prefetch_row(c.k.data(), ko, d);
                prefetch_row(c.v.data(), vo, dv);
            }
        }
    });
}

/// Keys `j0..j1` of an item; `next`: the (kv head, keys) this worker reads after these, to
/// prefetch.
#[inline(always)]
pub(super) fn attend_chunk<M: Exp2Math, const FMA: bool>(
    c: &Ctx<'_, M>,
    it: &mut Item<'_>,
    scr: &mut Scratch,
    ps: &Problem,
    (j0, j1): (usize, usize),
    next: Option<(usize, usize, usize)>,
) {
    let (d, dv) = (c.p.head_dim, c.p.head_dim_v);
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
    let widened = c.fp8.is_some() || !matches!(c.k.data(), Data::F32(_)) || !matches!(c.v.data(), Data::F32(_));
    if widened && (kbuf.len() < CHUNK_KEYS * d || vbuf.len() < CHUNK_KEYS * dv) {
        kbuf.resize(CHUNK_KEYS * d, 0.0);
        vbuf.resize(CHUNK_KEYS * dv, 0.0);
    }
    let (krows, vrows) = match &c.fp8 {
        Some(f) => {
            f.k.dequantize(&kofs[..n], d, kbuf);
            f.v.dequantize(&vofs[..n], dv, vbuf);
            (buffered_rows(kbuf, n, d), buffered_rows(vbuf, n, dv))
        }
        None => (chunk_rows(c.k.data(), &kofs[..n], d, kbuf), chunk_rows(c.v.data(), &vofs[..n], dv, vbuf)),
    };

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
        let op = &mut o[l0 * dv..(l0 + NR) * dv];
        if nl == 1 {
            // One real row (group-1 decode): its softmax alone, vectorised over the keys, not
            // over 16 lanes of which 15 are padding.
            let sc = softmax_one_row::<M, FMA>(&mut rows[l0], sp, c.sm.c, &c.math);
            if sc != 1.0 {
                op[..dv].iter_mut().for_each(|x| *x *= sc);
            }
        } else {
            // The online softmax, the verbs of the tiled path.
            let states = &mut rows[l0..l0 + NR];
            let tile_max = panel_max(sp.as_flattened());
            let scales = panel_scales(states, &tile_max, c.sm.c, &c.math);
            online_softmax::<M, FMA>(states, &scales, sp.as_flattened_mut(), c.sm.c, &c.math);
            for (l, &sc) in scales.iter().enumerate().take(nl) {
                if sc != 1.0 {
                    op[l * dv..(l + 1) * dv].iter_mut().for_each(|x| *x *= sc);
                }
            }
        }
        // O += P·V; where some row does not see some key of the chunk, zeros of P are
        // skipped so that key's V (possibly inf/NaN) cannot reach that row.
        let vr = &vrows[c0..c1];
        if full {
            pv_panel::<FMA, false>(op, dv, nl, sp, vr);
        } else {
            pv_panel::<FMA, true>(op, dv, nl, sp, vr);
        }
    }
}

/// The online softmax of lane 0 of a `[keys][NR]` panel (a panel holding one query row): the
/// same operations as `panel_max`, `max_get_scale` and `online_softmax` on that lane, in the same
/// order (so the same bits), with the exponentials computed on the keys side by side instead of
/// on 16 lanes of which 15 are padding. Lanes 1.. are left as they are (nothing reads them).
/// Returns the factor the row's output must be multiplied by.
#[inline(always)]
pub(super) fn softmax_one_row<M: Exp2Math, const FMA: bool>(st: &mut RowState, panel: &mut [[f32; NR]], c: f32, math: &M) -> f32 {
    let mut x = [0.0f32; CHUNK_KEYS];
    let n = panel.len().min(CHUNK_KEYS);
    for (xt, row) in x.iter_mut().zip(&panel[..n]) {
        *xt = row[0];
    }
    let (p, scale) = row_probs::<M, CHUNK_KEYS, FMA>(st, &x, n, c, math);
    let mut sum = 0.0f32;
    for (row, &pt) in panel[..n].iter_mut().zip(&p[..n]) {
        sum += pt;
        row[0] = math.round_p(pt);
    }
    st.l = st.l * scale + sum;
    scale
}

//! Group-1 decode of 16-bit K/V, one key at a time in address order.

use super::scratch::Scratch;
use super::sweep::{same_span, span, Sweep};
use super::item::{Ctx, Item, ItemSpan};
use super::sizes::SWEEP_CHUNK_KEYS;
use crate::convert::Widen;
use crate::cpu::row_products::{dot_widen, fma};
use crate::cpu::rows::prefetch_row;
use crate::cpu::softmax::row_probs;
use crate::numerics::softmax_math::Exp2Math;
use crate::tensor::Data;

/// Group-1 decode (`sweep_key_by_key`): K/V rows of this many keys ahead (all heads) are prefetched
/// into L1 besides what the hardware prefetchers fetch (0: none).
const PREFETCH_KEYS_AHEAD: usize = 1;

/// Group-1 decode of 16-bit K/V one key at a time ([`sweep_key_by_key`]), for units of one-row
/// items that see the same keys.
pub(super) struct KeyByKey;

impl Sweep for KeyByKey {
    #[inline(always)]
    fn run<M: Exp2Math, const FMA: bool>(c: &Ctx<'_, M>, items: &mut [Item<'_>], scrs: &mut [Scratch], spans: &[ItemSpan]) -> bool {
        if !same_span(spans) || !items.iter().all(|it| it.r1 - it.r0 == 1) || c.fp8.is_some() {
            return false;
        }
        let span = span(spans);
        match (c.k.data(), c.v.data()) {
            (Data::BF16(k), Data::BF16(v)) => sweep_key_by_key::<M, FMA, half::bf16>(c, items, scrs, spans, span, (k, v)),
            (Data::F16(k), Data::F16(v)) => sweep_key_by_key::<M, FMA, half::f16>(c, items, scrs, spans, span, (k, v)),
            _ => false,
        }
    }
}

/// Group-1 decode of 16-bit K/V, key-major: every item is one query row (of its own kv head)
/// that sees every key of `lo..hi`, and K/V are read strictly in address order: for each key, the rows of all
/// the items' heads (side by side in memory for `[.., seqlen, heads, head_dim]`), each folded
/// into its row at once (score, online softmax of one key, `o += p·v`), 16-bit rows widened in
/// the products. The loads of a step form two forward streams (K and V), which the hardware
/// prefetchers follow; the rows [`PREFETCH_KEYS_AHEAD`] keys ahead are also prefetched. Returns `false`
/// (nothing done) when a row does not see the whole span (the chunked path then runs).
///
/// Per key the softmax is `max_get_scale` and `online_softmax` on a one-key tile: the same
/// arithmetic as the chunked path, with the max and the rescale taken per key instead of per
/// chunk (rounding differs, within the tests' tolerance of the float64 reference).
#[inline(always)]
fn sweep_key_by_key<M: Exp2Math, const FMA: bool, T: Widen>(
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
    let (d, dv) = (c.p.head_dim, c.p.head_dim_v);
    let cc = c.sm.c;
    // Key positions `(outer, row)` of the current and the next chunk of keys.
    let fill = |pos: &mut [(usize, usize); SWEEP_CHUNK_KEYS], j0: usize| {
        let j1 = (j0 + SWEEP_CHUNK_KEYS).min(hi);
        c.layout.for_kv_rows(b, j0, j1, |jl, outer, row| pos[jl] = (outer, row));
        j1 - j0
    };
    let (mut cur, mut next) = ([(0, 0); SWEEP_CHUNK_KEYS], [(0, 0); SWEEP_CHUNK_KEYS]);
    let mut j0 = lo;
    let mut nc = if lo < hi { fill(&mut cur, lo) } else { 0 };
    while nc > 0 {
        let nn = if j0 + nc < hi { fill(&mut next, j0 + nc) } else { 0 };
        for (t, &(outer, row)) in cur[..nc].iter().enumerate() {
            let a = t + PREFETCH_KEYS_AHEAD;
            let ahead = if a < nc {
                Some(cur[a])
            } else {
                next[..nn].get(a - nc).copied()
            };
            for ((it, scr), sp) in items.iter().zip(scrs.iter_mut()).zip(spans) {
                let hk = it.hk;
                if let Some((po, pr)) = ahead.filter(|_| PREFETCH_KEYS_AHEAD > 0) {
                    prefetch_row(c.k.data(), c.k.offset(po, pr, hk), d);
                    prefetch_row(c.v.data(), c.v.offset(po, pr, hk), dv);
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
                let o = &mut scr.o[..dv];
                if scale != 1.0 {
                    o.iter_mut().for_each(|y| *y *= scale);
                }
                for (y, w) in o.iter_mut().zip(&v[vo..vo + dv]) {
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

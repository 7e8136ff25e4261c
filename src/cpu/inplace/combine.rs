//! The in-place path's second pass: each query row's split partials merged (or its one partial
//! copied) into the output in q's dtype.

use super::sizes::ITEM_ROWS;
use crate::cpu::parallel;
use crate::serving::layout::BatchLayout;
use crate::serving::merge::merge_row;
use crate::tensor::Element;

/// Work items of one sequence: `nrb` row blocks per kv head, `ns` splits each, starting at item
/// `first` of the item list (ordered by sequence, kv head, row block, split).
#[derive(Clone, Copy)]
pub(super) struct SeqPlan {
    pub(super) first: usize,
    pub(super) nrb: usize,
    pub(super) ns: usize,
}

/// The partial states, addressed by (sequence, kv head, row block, split).
pub(super) struct Parts<'a> {
    pub(super) o: &'a [f32],
    pub(super) lse: &'a [f64],
    /// First partial row of each item.
    pub(super) offsets: &'a [usize],
    pub(super) plans: &'a [SeqPlan],
    pub(super) g: usize,
    pub(super) d: usize,
    pub(super) hq: usize,
    /// The problem's sink logits (one per query head, −inf for none): partial states carry no
    /// sink, each row's is merged in here, once, as the state `(0, sink)`.
    pub(super) sinks: Option<&'a [f32]>,
}

/// A run of query tokens of one sequence, with its output rows `[tokens][heads][d]` and LSEs
/// `[tokens][heads]`.
pub(super) struct Tokens<'o, T> {
    pub(super) b: usize,
    pub(super) i0: usize,
    pub(super) o: &'o mut [T],
    pub(super) lse: &'o mut [f32],
}

/// Tokens per merge item.
pub(super) const MERGE_TOKENS: usize = 64;

pub(super) fn combine<T: Element>(
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
        || (vec![0.0f32; d], vec![0.0f32; d]),
        |(row, zeros), tk| {
            let pl = parts.plans[tk.b];
            let n = tk.lse.len() / hq;
            for ti in 0..n {
                let i = tk.i0 + ti;
                for h in 0..hq {
                    let (hk, r) = (h / parts.g, i * parts.g + h % parts.g);
                    let first = pl.first + (hk * pl.nrb + r / ITEM_ROWS) * pl.ns;
                    let rr = r % ITEM_ROWS;
                    let src = |s: usize| {
                        let at = parts.offsets[first + s] + rr;
                        (&parts.o[at * d..(at + 1) * d], parts.lse[at])
                    };
                    let dst = &mut tk.o[(ti * hq + h) * d..(ti * hq + h + 1) * d];
                    let sink = parts.sinks.and_then(|s| s.get(h).copied()).filter(|&z| z != f32::NEG_INFINITY);
                    let l = if pl.ns == 1 && sink.is_none() {
                        let (x, l) = src(0);
                        row.copy_from_slice(x);
                        l as f32
                    } else {
                        let sink = sink.map(|z| (&zeros[..], z as f64));
                        merge_row((0..pl.ns).map(src).chain(sink), row)
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

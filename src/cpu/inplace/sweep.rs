//! The in-place path's ways of running a unit's items over their keys, behind one trait, tried
//! in order of speed: the first that applies runs the unit.

use super::scratch::Scratch;
use super::item::{Ctx, Item, ItemSpan};
use crate::numerics::softmax_math::Exp2Math;

/// One way to run a unit's items (begun: their `spans` set) to the end of their keys.
pub(super) trait Sweep {
    /// Runs the items and returns `true`, or returns `false` having done nothing where this way
    /// does not apply (an element type, row count or span it does not take).
    fn run<M: Exp2Math, const FMA: bool>(
        c: &Ctx<'_, M>,
        items: &mut [Item<'_>],
        scrs: &mut [Scratch],
        spans: &[ItemSpan],
    ) -> bool;
}

/// Whether every item sees the same keys: the decode sweeps then take them in one pass.
#[inline(always)]
pub(super) fn same_span(spans: &[ItemSpan]) -> bool {
    spans.windows(2).all(|w| (w[0].lo_all, w[0].hi_all) == (w[1].lo_all, w[1].hi_all))
}

/// The keys every item sees, where [`same_span`] holds.
#[inline(always)]
pub(super) fn span(spans: &[ItemSpan]) -> (usize, usize) {
    spans.first().map_or((0, 0), |s| (s.lo_all, s.hi_all))
}

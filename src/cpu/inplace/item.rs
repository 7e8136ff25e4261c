//! A work item of the in-place path: what it reads (`Ctx`), what it writes (`Item`) and what it
//! keeps between its chunks (`ItemSpan`).

use super::fp8_rows::Fp8Kv;
use crate::cpu::isa::Isa;
use crate::cpu::score::ScoreMod;
use crate::problem::Problem;
use crate::serving::layout::BatchLayout;
use crate::tensor::TensorView;

/// Everything an item reads.
pub(super) struct Ctx<'a, M> {
    pub(super) p: &'a Problem,
    pub(super) layout: &'a BatchLayout<'a>,
    pub(super) q: TensorView<'a>,
    pub(super) k: TensorView<'a>,
    pub(super) v: TensorView<'a>,
    pub(super) sm: ScoreMod,
    pub(super) math: M,
    pub(super) group: usize,
    /// The instruction set to run (the CPU's best unless a test asks for a lesser one).
    pub(super) isa: Isa,
    /// An FP8 cache's K and V (then `k` and `v` hold no elements: they give the shape and
    /// strides); the chunked sweeps dequantise its rows as they read them.
    pub(super) fp8: Option<Fp8Kv<'a>>,
}

/// One work item: rows `r0..r1` of the (sequence `b`, kv head `hk`) group, keys `k0..k1` (a
/// split), writing normalised outputs `[rows][d]` and LSEs. The LSEs are kept in f64 until the
/// splits are merged: an f32 LSE of a large score is off by up to half its ulp (5e-4 at 1e4),
/// which the merge would turn into a relative error of each split's weight.
pub(super) struct Item<'o> {
    pub(super) b: usize,
    pub(super) hk: usize,
    pub(super) r0: usize,
    pub(super) r1: usize,
    pub(super) k0: usize,
    pub(super) k1: usize,
    pub(super) cost: u64,
    pub(super) o: &'o mut [f32],
    pub(super) lse: &'o mut [f64],
}

/// What an item keeps between its chunks: its sequence's own problem (masks, ALiBi and causal
/// alignment are per sequence) and the keys any of its rows sees.
pub(super) struct ItemSpan {
    pub(super) ps: Problem,
    pub(super) lo_all: usize,
    pub(super) hi_all: usize,
}

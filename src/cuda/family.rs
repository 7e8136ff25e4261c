//! The host side of a kernel family: the one trait each family's module implements, and the
//! rules several families share. A family is its row in build/instances.rs (tiles, shared
//! memory, targets, options, rank), its kernel file under cuda/, and its module here
//! (docs/cuda.md, "Adding a family").
//!
//! One vocabulary: a *refusal* is why a family cannot run something, a `&'static str` naming
//! the rule (no allocation when a choice is made on the hot path).
//! - A *problem refusal* ([`FamilyHost::refusal`]) looks at the problem's shapes and options; it
//!   is checked when the kernel is chosen (`select`), so `Engine::dispatch` reports it too.
//! - A *layout refusal* ([`FamilyHost::layout_refusal`]) looks at device addresses and element
//!   strides, known only at launch.
//!
//! Under `Variant::Auto` a refused family is passed over: the best lower-ranked family runs and
//! `Dispatch::reason` says why. An explicit variant that is refused is an error, never a silent
//! switch: `Error::VariantUnavailable` for a problem refusal, `Error::InvalidLayout` naming the
//! operand for a layout refusal.

use super::launch::TensorMaps;
use super::params::{FwdParams, Operands};
use super::table::{Family, Tile};
use crate::error::{Operand, Result};
use crate::problem::Problem;
use crate::tensor::DType;
use std::fmt;

/// A launch grid, (x, y, z).
pub(crate) type Grid = (u32, u32, u32);

/// What a family's kernels need from the host beyond their table row. Every method has the
/// default of a kernel that takes `FwdParams` alone on the (query tile, head, batch) grid and
/// runs whatever its row admits.
pub(crate) trait FamilyHost: Sync + fmt::Debug {
    /// Why `fam`'s instance `tile` cannot run `p` (checked after the table's own rules: SM,
    /// target, dtype, options, head dim, shared memory), or `None`.
    fn refusal(&self, _fam: &Family, _tile: &Tile, _p: &Problem) -> Option<&'static str> {
        None
    }

    /// Why the family cannot run the serving launch `params` (varlen, KV cache, paged, append,
    /// split-KV: `FwdParams::is_serving`), or `None`. Checked only for serving launches; the
    /// default refuses every one (a family opts in to what its kernels read, seqlen.cuh).
    fn serving_refusal(&self, _fam: &Family, _tile: &Tile, _params: &FwdParams) -> Option<&'static str> {
        Some("has no varlen / KV-cache / split-KV path (cuda/common/seqlen.cuh) yet")
    }

    /// What a launch of `tile` with `params` does that its family name does not say (FA3 on a
    /// serving layout: which K/V load path), for the launch plan's `note` and `Dispatch::reason`.
    fn launch_note(&self, _fam: &Family, _tile: &Tile, _params: &FwdParams) -> Option<&'static str> {
        None
    }

    /// Why the kernels cannot run on these device addresses and element strides, or `None`.
    fn layout_refusal(&self, _ops: &Operands) -> Option<LayoutRefusal> {
        None
    }

    /// The grid of a launch of `tile` with `params`; `sm_count` is the GPU's (persistent grids).
    fn grid(&self, _fam: &Family, tile: &Tile, params: &FwdParams, _sm_count: u32) -> Grid {
        tile_grid(tile.block_m, params)
    }

    /// Tensor maps passed after `FwdParams` (as `const __grid_constant__ CUtensorMap`), as data:
    /// the launch encodes them (`launch.rs`), the emulator reads them from the plan.
    ///
    /// # Errors
    /// [`crate::Error::InvalidLayout`] when a tensor cannot be described to TMA.
    fn tensor_maps(&self, _fam: &Family, _dtype: DType, _params: &FwdParams) -> Result<TensorMaps> {
        Ok(TensorMaps::default())
    }
}

/// A layout refusal: the operand and the rule it breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LayoutRefusal {
    pub operand: Operand,
    pub why: &'static str,
}

/// The grid of every non-persistent kernel: (query tiles of `block_m` rows, heads_q, batch ×
/// key splits). On a serving launch `seqlen_q` is the longest sequence: CTAs past a shorter
/// one's rows exit; z is `b * splits + split` (cuda/common/seqlen.cuh).
pub(crate) fn tile_grid(block_m: u32, params: &FwdParams) -> Grid {
    let tiles = (params.seqlen_q as u32).div_ceil(block_m);
    let splits = params.num_splits.max(1) as u32;
    (tiles, params.heads_q as u32, params.batch as u32 * splits)
}

/// Elements of one 16-byte chunk of an f16/bf16 row.
const CHUNK_ELEMS: usize = 8;
/// Alignment, in bytes, of those chunks.
const CHUNK_BYTES: u64 = 16;

/// The rule of kernels that move f16/bf16 rows in 16-byte chunks (cp.async, vector loads and
/// stores, TMA): q, k, v and o 16-byte aligned, every batch/row/head stride a multiple of 8
/// elements. The crate's contiguous tensors of head dims that are multiples of 8 meet it.
pub(crate) fn chunked_rows_refusal(ops: &Operands) -> Option<LayoutRefusal> {
    let operands = [Operand::Q, Operand::K, Operand::V, Operand::O];
    for ((&operand, &ptr), strides) in operands.iter().zip(&ops.ptrs).zip(&ops.strides) {
        if ptr % CHUNK_BYTES != 0 {
            return Some(LayoutRefusal {
                operand,
                why: "needs q/k/v/o 16-byte aligned (16-byte row chunks: cp.async, vector loads, TMA)",
            });
        }
        if strides.iter().any(|&s| s % CHUNK_ELEMS != 0) {
            return Some(LayoutRefusal {
                operand,
                why: "needs every batch/row/head stride a multiple of 8 elements (16-byte row chunks)",
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(ptrs: [u64; 4], strides: [[usize; 3]; 4]) -> Operands {
        Operands { ptrs, strides, lse: 0, alibi: 0, sinks: 0 }
    }

    #[test]
    fn chunked_rows_rule() {
        let contiguous = [4096 * 8 * 64, 8 * 64, 64];
        assert_eq!(chunked_rows_refusal(&ops([0x1000, 0x2000, 0x3000, 0x4000], [contiguous; 4])), None);
        let r = chunked_rows_refusal(&ops([0x1000, 0x2008, 0x3000, 0x4000], [contiguous; 4])).unwrap();
        assert_eq!(r.operand, Operand::K);
        assert!(r.why.contains("aligned"));
        let odd_row = [4096 * 8 * 68, 8 * 68 + 4, 68];
        let r = chunked_rows_refusal(&ops([0; 4], [contiguous, contiguous, odd_row, contiguous])).unwrap();
        assert_eq!(r.operand, Operand::V);
        assert!(r.why.contains("stride"));
    }

    #[test]
    fn tile_grid_covers_every_query_row() {
        let p = FwdParams { batch: 2, seqlen_q: 1000, heads_q: 16, ..FwdParams::default() };
        assert_eq!(tile_grid(128, &p), (8, 16, 2)); // ceil(1000 / 128) = 8
        assert_eq!(tile_grid(64, &FwdParams { seqlen_q: 64, heads_q: 1, batch: 1, ..p }), (1, 1, 1));
        assert_eq!(tile_grid(128, &FwdParams { num_splits: 3, ..p }), (8, 16, 6)); // z = batch x splits
    }
}

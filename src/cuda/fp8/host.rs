//! The host rules of the FP8 rows (`FamilyHost` for `Pipeline::Fa3Fp8`).

use super::consumer::{consumer_maps, CONSUMER_HEAD_DIMS};
use crate::cuda::fa3::tma::persistent_grid;
use crate::cuda::family::{chunked_rows_refusal, tile_grid, FamilyHost, Grid, LayoutRefusal};
use crate::cuda::launch::TensorMaps;
use crate::cuda::params::{FwdParams, Operands};
use crate::cuda::table::{Family, Tile};
use crate::error::Result;
use crate::options::{Fp8Scaling, Precision};
use crate::problem::Problem;
use crate::DType;

/// The host rules of the FP8 rows ("fa3fp8s3".."fa3fp8s5"): the problems the consumer runs, the
/// layout of the bf16/f16 inputs the pre-pass reads, stage 5's persistent grid, and the
/// consumer's tensor maps (over the e4m3 codes its `FwdParams` point at).
#[derive(Debug)]
pub(crate) struct Fp8;

/// Why the FP8 consumer cannot run `p` (the same rules `consumer_plan` reports as typed errors).
pub(crate) fn problem_refusal(p: &Problem) -> Option<&'static str> {
    let Precision::Fp8 { scaling, .. } = p.precision else {
        return Some("runs only Precision::Fp8 problems");
    };
    if !matches!(scaling, Fp8Scaling::PerTensor)
        && !matches!(scaling, Fp8Scaling::PerBlock { rows } if rows > 0 && rows % 64 == 0)
    {
        return Some(
            "needs Fp8Scaling::PerTensor or PerBlock with a multiple of 64 rows (a V scale per 64-key half tile)",
        );
    }
    if p.alibi.is_some() {
        return Some("has no ALiBi (as the 16-bit FA3 kernels)");
    }
    (!CONSUMER_HEAD_DIMS.contains(&p.head_dim))
        .then_some("runs head_dim 64, 128 or 256 only (the FP8 consumer's instances)")
}

impl FamilyHost for Fp8 {
    fn refusal(&self, _fam: &Family, _tile: &Tile, p: &Problem) -> Option<&'static str> {
        problem_refusal(p)
    }

    /// The pre-pass reads the caller's bf16/f16 rows in 16-byte chunks.
    fn layout_refusal(&self, ops: &Operands) -> Option<LayoutRefusal> {
        chunked_rows_refusal(ops)
    }

    /// Stage 5: min(SMs, tiles) CTAs walking every (query tile, head, batch); else one CTA per tile.
    fn grid(&self, fam: &Family, tile: &Tile, params: &FwdParams, sm_count: u32) -> Grid {
        if fam.stage.unwrap_or(3) >= 5 {
            persistent_grid(tile.block_m, params, sm_count)
        } else {
            tile_grid(tile.block_m, params)
        }
    }

    /// Over the e4m3 codes: the launch's `FwdParams` point at the pre-pass's outputs.
    fn tensor_maps(&self, _fam: &Family, _dtype: DType, params: &FwdParams) -> Result<TensorMaps> {
        let [q, k, v] = consumer_maps(params);
        Ok(TensorMaps::new([q.spec, k.spec, v.spec], [q.global_address, k.global_address, v.global_address]))
    }
}

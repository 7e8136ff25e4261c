//! The host side of the FA2 family (cuda/fa2_fwd.cu, docs/fa2.md): the preconditions its kernel
//! relies on without checking them. Grid, block and shared memory are the generic ones of its
//! table row: (ceil(seqlen_q / block_m), heads_q, batch), 128 threads, `fa2_smem_bytes` (above
//! 48 KB after the opt-in attribute, which `Device::function` sets).
//!
//! Preconditions and where each is enforced:
//! - head_dim (and V's, in the fa2v row) equal to the instance's (the kernel has no tail masking): the problem refusal,
//!   checked when the kernel is chosen, so `Engine::dispatch` already reports the fallback;
//! - q/k/v/o 16-byte aligned and every batch/row/head stride a multiple of 8 elements (16-byte
//!   cp.async loads and stores of f16/bf16 rows): the layout refusal, at launch (pointers and
//!   strides are known only there); the crate's contiguous tensors of those head dims meet it;
//! - batch and heads_q at most 65535 (grid z/y), seqlens up to 2^30: the engine's generic check
//!   (`Error::TooLarge`) for every family;
//! - lse / alibi_slopes non-null when FA_FLAG_RETURN_LSE / FA_FLAG_ALIBI are set: `FwdParams`
//!   sets those flags only from non-null device pointers.
//!
//! A refusal is a fallback under `Variant::Auto` and a typed error under an explicit
//! `Variant::Fa2` (src/cuda/family.rs).

use super::family::{chunked_rows_refusal, FamilyHost, LayoutRefusal};
use super::params::{FwdParams, Operands, FLAG_KV_FP8};
use super::table::{Family, KernelOptions, Tile};
use crate::problem::Problem;

/// The FA2 family's host rules.
#[derive(Debug)]
pub(crate) struct Fa2;

impl FamilyHost for Fa2 {
    /// The fa2v row (V's head dim its own) runs its tiles' exact (q/k, v) pairs; the others
    /// their exact head dims.
    fn refusal(&self, fam: &Family, tile: &Tile, p: &Problem) -> Option<&'static str> {
        let exact = p.head_dim == tile.head_dim as usize && p.head_dim_v == tile.head_dim_v as usize;
        let why = if fam.options.contains(KernelOptions::HEAD_DIM_V) {
            "runs only its exact (q/k, v) head_dim pairs ((192, 128), (576, 512): no tail masking)"
        } else {
            "runs only its exact head dims (32, 64, 96, 128, 192, 256, 512: no tail masking)"
        };
        (!exact).then_some(why)
    }

    /// Every serving layout runs (cuda/common/seqlen.cuh): packed q and k/v, a dense cache with
    /// `cache_seqlens`, a paged cache of any page size (each K/V row's address goes through the
    /// block table), and split-KV into `o_accum`/`lse_accum`. The rows an append writes are the
    /// append kernel's (it runs first); the attention only reads the cache. An FP8 cache's tiles
    /// are loaded at Q/K's row pitch, so the fa2v row (V rows of their own width) refuses one.
    fn serving_refusal(&self, fam: &Family, _tile: &Tile, params: &FwdParams) -> Option<&'static str> {
        let fp8 = params.flags & FLAG_KV_FP8 != 0;
        (fp8 && fam.options.contains(KernelOptions::HEAD_DIM_V))
            .then_some("reads an FP8 KV cache only with V's head dim equal to Q/K's (the fa2v row does not)")
    }

    fn layout_refusal(&self, ops: &Operands) -> Option<LayoutRefusal> {
        chunked_rows_refusal(ops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::table::FAMILIES;
    use crate::options::ForwardOptions;
    use crate::tensor::DType;

    #[test]
    fn exact_head_dim_only() {
        let fa2 = FAMILIES.iter().find(|f| f.name == "fa2").unwrap();
        let tile = Tile { head_dim: 64, head_dim_v: 64, block_m: 128, block_n: 64, threads: 128 };
        let p = |d: usize| {
            Problem::from_shapes([1, 8, 2, d], [1, 8, 2, d], [1, 8, 2, d], DType::F16, &ForwardOptions::default()).unwrap()
        };
        assert_eq!(Fa2.refusal(fa2, &tile, &p(64)), None);
        assert!(Fa2.refusal(fa2, &tile, &p(40)).unwrap().contains("exact head dims"));
    }

    /// The fa2v row runs exactly the (q/k, v) pairs its tiles name, which its refusal lists.
    #[test]
    fn fa2v_runs_its_exact_pairs() {
        let fa2v = FAMILIES.iter().find(|f| f.name == "fa2v").unwrap();
        let p = |d: usize, dv: usize| {
            Problem::from_shapes([1, 8, 2, d], [1, 8, 2, d], [1, 8, 2, dv], DType::F16, &ForwardOptions::default()).unwrap()
        };
        for tile in fa2v.tiles {
            let (d, dv) = (tile.head_dim as usize, tile.head_dim_v as usize);
            assert_eq!(Fa2.refusal(fa2v, tile, &p(d, dv)), None);
            for (d, dv) in [(d, d), (d, dv - 16), (d - 16, dv)] {
                let why = Fa2.refusal(fa2v, tile, &p(d, dv)).unwrap();
                assert!(why.contains("(192, 128), (576, 512)"), "{why}");
            }
        }
        let pairs: Vec<(u32, u32)> = fa2v.tiles.iter().map(|t| (t.head_dim, t.head_dim_v)).collect();
        assert_eq!(pairs, [(192, 128), (576, 512)], "the refusal's list is the row's");
    }

    /// An FP8 cache runs on the fa2 row and is refused by the fa2v row, whose V rows have a pitch
    /// of their own that the FP8 tile load does not take.
    #[test]
    fn fp8_cache_only_at_equal_head_dims() {
        let row = |name: &str| FAMILIES.iter().find(|f| f.name == name).unwrap();
        let fp8 = FwdParams { flags: FLAG_KV_FP8, ..FwdParams::default() };
        let (fa2, fa2v) = (row("fa2"), row("fa2v"));
        assert_eq!(Fa2.serving_refusal(fa2, &fa2.tiles[0], &fp8), None);
        assert!(Fa2.serving_refusal(fa2v, &fa2v.tiles[0], &fp8).unwrap().contains("FP8"));
        assert_eq!(Fa2.serving_refusal(fa2v, &fa2v.tiles[0], &FwdParams::default()), None);
    }
}

//! The host side of the FA2 family (cuda/fa2_fwd.cu, docs/fa2.md): the preconditions its kernel
//! relies on without checking them. Its launch is the generic one of `engine.rs`, from the
//! family's row in build/instances.rs: grid (ceil(seqlen_q / block_m), heads_q, batch), 128
//! threads, dynamic shared memory from `fa2_smem_bytes` (above 48 KB after the opt-in attribute,
//! which `Device::function` sets).
//!
//! Preconditions and where each is enforced:
//! - head_dim equal to the instance's (the kernel has no tail masking): `problem_unmet`, at
//!   dispatch, so `Engine::dispatch` already reports the fallback;
//! - q/k/v/o 16-byte aligned and every batch/row/head stride a multiple of 8 elements (16-byte
//!   cp.async loads and stores of f16/bf16 rows): `layout_unmet`, at launch (pointers and strides
//!   are known only there); the crate's contiguous tensors of those head dims always satisfy it;
//! - batch and heads_q at most 65535 (grid z/y), seqlens within i32: the engine's generic check
//!   (`Error::TooLarge`) for every family;
//! - lse / alibi_slopes non-null when FA_FLAG_RETURN_LSE / FA_FLAG_ALIBI are set: the engine sets
//!   those flags only from non-null device pointers.
//!
//! An unmet precondition is a fallback under `Variant::Auto` (the next family down, FA1, runs and
//! `Dispatch::reason` says why FA2 was passed over) and `Error::VariantUnavailable` under an
//! explicit `Variant::Fa2` (never a silent switch of the requested family).

use super::kernels::Tile;
use crate::problem::Problem;

/// Elements of one 16-byte chunk of an f16/bf16 row: the kernel's unit of cp.async and stores.
const CHUNK_ELEMS: usize = 8;
/// Alignment, in bytes, of those 16-byte accesses.
const CHUNK_BYTES: u64 = 16;

/// Why FA2's instance `tile` cannot run `p` (problem-level), or `None`.
pub(crate) fn problem_unmet(tile: &Tile, p: &Problem) -> Option<&'static str> {
    (p.head_dim != tile.head_dim as usize)
        .then_some("fa2 runs only its exact head dims (32, 64, 96, 128, 192, 256: no tail masking)")
}

/// Why FA2 cannot run on these device addresses and element strides (q, k, v, o), or `None`.
pub(crate) fn layout_unmet(ptrs: [u64; 4], strides: [[usize; 3]; 4]) -> Option<&'static str> {
    if ptrs.iter().any(|&a| a % CHUNK_BYTES != 0) {
        return Some("fa2 needs q/k/v/o 16-byte aligned (16-byte cp.async and stores)");
    }
    if strides.iter().flatten().any(|&s| s % CHUNK_ELEMS != 0) {
        return Some("fa2 needs every batch/row/head stride a multiple of 8 elements (16-byte rows chunks)");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::ForwardOptions;
    use crate::tensor::DType;

    #[test]
    fn layout_preconditions() {
        let contiguous = [4096 * 8 * 64, 8 * 64, 64];
        assert_eq!(layout_unmet([0x1000, 0x2000, 0x3000, 0x4000], [contiguous; 4]), None);
        assert!(layout_unmet([0x1000, 0x2008, 0x3000, 0x4000], [contiguous; 4]).unwrap().contains("aligned"));
        let odd_row = [4096 * 8 * 68, 8 * 68 + 4, 68];
        assert!(layout_unmet([0; 4], [contiguous, odd_row, contiguous, contiguous]).unwrap().contains("stride"));
    }

    #[test]
    fn exact_head_dim_only() {
        let tile = Tile { head_dim: 64, block_m: 128, block_n: 64, threads: 128 };
        let p = |d: usize| {
            Problem::from_shapes([1, 8, 2, d], [1, 8, 2, d], [1, 8, 2, d], DType::F16, &ForwardOptions::default()).unwrap()
        };
        assert_eq!(problem_unmet(&tile, &p(64)), None);
        assert!(problem_unmet(&tile, &p(40)).is_some());
    }
}

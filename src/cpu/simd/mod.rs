//! The CPU backend's explicit instructions (`std::arch`): the tiled path's AVX-512 kernels, one
//! file per job (the softmax, the products, the panel layouts), and the prefetch hints.
//!
//! The AVX-512 intrinsics are stable since Rust 1.89, as are the `avx512f` target features the
//! tiled path's AVX-512 build already enables (`tiled::attend_any`): the crate needs 1.89 whatever
//! `rust-version` says, hence the `incompatible_msrv` allowance below.
#![allow(clippy::incompatible_msrv)]

mod lanes;
mod panels;
mod products;
mod softmax;
#[cfg(test)]
mod tests;

pub(crate) use panels::{fill_panel, pack_strip, pack_v_strip, write_panel_rows};
pub(crate) use products::{product_max, scaled_product, KTile};
pub(crate) use softmax::{finalize_lanes, native_softmax};

/// Asks for the cache line holding `p` to be brought into L1 (a hint: no memory is read
/// architecturally, any address is allowed, nothing happens on other architectures).
#[inline(always)]
pub(crate) fn prefetch(p: *const i8) {
    prefetch_hint::<true>(p)
}

/// As [`prefetch`], into L2 only: for data read a whole work item later, which would only
/// crowd the L1 that the current item's panels live in.
#[inline(always)]
pub(crate) fn prefetch_l2(p: *const i8) {
    prefetch_hint::<false>(p)
}

#[inline(always)]
fn prefetch_hint<const L1: bool>(p: *const i8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has (it is part of the
        // x86_64 baseline the crate is compiled for); a prefetch never faults, whatever the address.
        unsafe {
            if L1 {
                _mm_prefetch::<_MM_HINT_T0>(p)
            } else {
                _mm_prefetch::<_MM_HINT_T1>(p)
            }
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

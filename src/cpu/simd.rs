//! The CPU backend's explicit instructions (`std::arch`), in one place.

/// Asks for the cache line holding `p` to be brought into L1 (a hint: no memory is read
/// architecturally, any address is allowed, nothing happens on other architectures).
#[inline(always)]
pub(crate) fn prefetch(p: *const i8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has (it is part of the
    // x86_64 baseline the crate is compiled for); a prefetch never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

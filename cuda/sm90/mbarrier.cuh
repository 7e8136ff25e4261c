// mbarrier helpers for sm_90a kernels (TMA arrival and producer/consumer hand-off).
//
// An mbarrier is a 64-bit shared-memory object with an expected arrival count and a
// transaction-byte count. Its current *phase* completes when both reach zero; the phase bit then
// flips. Waiters poll `try_wait.parity P`: it succeeds once the phase with parity P has completed.
// A barrier used once per ring slot `s` is completed for the u-th time (u = 0, 1, ...) after the
// u-th use, so the waiter of use u waits parity (u & 1). (PTX ISA "Parallel Synchronization and
// Communication Instructions: mbarrier", phases and tx-count.)
//
// Compiled for sm_90a and sm_100a (the FA3 and FA4 kernels; the bodies are guarded).
// With FA_HANG_CHECK defined (build.rs: FLASH_ATTN_HANG_CHECK=1) the waits report and trap
// instead of hanging (sm90/hang_check.cuh); without it they are exactly the plain loops below.
#pragma once
#include <stdint.h>
#if defined(FA_HANG_CHECK)
#include "sm90/hang_check.cuh"
#endif

namespace fa3 {

// 32-bit shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Inline PTX: only when nvcc compiles for sm_90a or sm_100a. The CPU emulator (cuda/test/emu, which defines
// FA_HOST_EMULATION) supplies host versions of exactly the functions in this block.
#if (defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(__CUDA_ARCH_FEAT_SM100_ALL)) && !defined(FA_HOST_EMULATION)

// One thread initialises; `count` arrivals (mbarrier.arrive / arrive.expect_tx) complete a phase.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
                 : "memory");
}

// Makes the initialisations visible to other threads and to the async proxy (TMA's complete_tx)
// before anyone uses the barriers; followed by a CTA barrier in the caller.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrive once and add `bytes` to the transaction count the current phase must still receive
// (the producer calls this once per TMA batch, before or after issuing the copies).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}

// Plain arrival (release semantics by default): consumers signal "slot free".
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// Non-blocking probe of the phase with the given parity (acquire semantics by default).
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

// Hardware named barriers (bar.sync / bar.arrive with an id and a thread count): `sync` blocks
// until `threads` threads have arrived at barrier `id` (itself included); `arrive` counts this
// warp's threads and does not wait. Used for warpgroup ping-pong: one warpgroup syncs, the other
// arrives. Id 0 is __syncthreads'; counts are multiples of 32. Ids are immediates so ptxas
// knows how many barriers the kernel uses.
template <int Id, int Threads>
__device__ __forceinline__ void named_bar_sync() {
    static_assert(Id > 0 && Id < 16 && Threads % 32 == 0, "named barrier id/count");
#if defined(FA_HANG_CHECK)
    fa_hang::board_set(fa_hang::Wait{fa_hang::kNamedBarrier, Id, Threads});  // bar.sync cannot time out
#endif
    asm volatile("bar.sync %0, %1;\n" ::"n"(Id), "n"(Threads) : "memory");
#if defined(FA_HANG_CHECK)
    fa_hang::board_clear();
#endif
}
template <int Id, int Threads>
__device__ __forceinline__ void named_bar_arrive() {
    static_assert(Id > 0 && Id < 16 && Threads % 32 == 0, "named barrier id/count");
    asm volatile("bar.arrive %0, %1;\n" ::"n"(Id), "n"(Threads) : "memory");
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL && !FA_HOST_EMULATION

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(__CUDA_ARCH_FEAT_SM100_ALL)

#if defined(FA_HANG_CHECK)
// The bounded wait, out of line so the clock, board and report code stay out of the callers'
// register allocation.
__device__ __noinline__ void mbar_wait_checked(uint64_t* bar, uint32_t parity) {
    fa_hang::checked_wait([&] { return mbar_try_wait(bar, parity); },
                          fa_hang::Wait{fa_hang::kMbarrier, fa_hang::smem_offset(bar), parity});
}
#endif

// Blocks until the phase with `parity` has completed. try_wait itself suspends for a
// hardware-chosen time before returning false, so the loop is not a hot spin.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(FA_HANG_CHECK)
    if (!mbar_try_wait(bar, parity)) mbar_wait_checked(bar, parity);
#else
    while (!mbar_try_wait(bar, parity)) {
    }
#endif
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

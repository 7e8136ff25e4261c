// Opt-in hang diagnosis for the real GPU: compiled in only when the unit defines FA_HANG_CHECK
// (build.rs does so for FLASH_ATTN_HANG_CHECK=1; docs/fa3.md "Hang check"). Without it nothing
// here is included and every wait of the kernels is the plain `while (!try_wait) {}` loop.
//
// A GPU window is minutes long and a hung kernel only shows as a timeout. In the hang-check build:
//  * every mbarrier wait (mbar_wait, sm90/mbarrier.cuh) polls against the %globaltimer clock; once
//    it has waited FA_HANG_CHECK_NS ns it prints one line per waiting warp: block, warp, thread,
//    the barrier (its name when the kernel file provides FA_HANG_BARRIER_NAME, and its byte
//    offset from the 1024-aligned dynamic shared memory base), the awaited parity, time and polls;
//    the first reporters also print their CTA's *wait board*: what every warp of the CTA waits on
//    at that moment. After twice that time the waiter traps, so the launch fails with an error
//    (and the printf buffer is flushed) instead of hanging;
//  * named-barrier waits (bar.sync) have no bounded form; they are entered on the wait board, so
//    a warp stuck in bar.sync is named by the report of any mbarrier waiter of its CTA (the FA3
//    producers wait for their slots' release at the end for this reason, cuda/fa3_fwd_sm90.cu).
// The policy (wait_loop) and the report text (print_wait) are __host__ __device__ so that
// cuda/test/hang_check_test.cpp runs the very same loop on the host with a fake clock.
#pragma once
#include <stdint.h>
#include <stdio.h>

#ifndef FA_HANG_CHECK_NS
#define FA_HANG_CHECK_NS 1000000000ull  // report after 1 s in one wait, trap after 2 s
#endif

namespace fa_hang {

enum Kind : uint32_t { kNone = 0, kMbarrier = 1, kNamedBarrier = 2 };

// What one warp waits on: an mbarrier (where = byte offset from the aligned dynamic smem base,
// arg = awaited parity) or a named barrier (where = id, arg = thread count).
struct Wait {
    uint32_t kind;
    uint32_t where;
    uint32_t arg;
};

// Polls probe() until it returns true. After limit_ns (measured with now()) calls report(waited,
// polls) once; after 2 * limit_ns calls trap(waited, polls), which does not return on the GPU
// (on the host the loop then returns). Returns the number of polls.
template <class Probe, class Now, class Report, class Trap>
__host__ __device__ inline uint64_t wait_loop(Probe&& probe, Now&& now, uint64_t limit_ns, Report&& report,
                                              Trap&& trap) {
    uint64_t polls = 1;
    if (probe()) return polls;
    const uint64_t t0 = now();
    bool reported = false;
    for (;;) {
        ++polls;
        if (probe()) return polls;
        const uint64_t waited = now() - t0;
        if (!reported && waited >= limit_ns) {
            reported = true;
            report(waited, polls);
        } else if (reported && waited >= 2 * limit_ns) {
            trap(waited, polls);
            return polls;
        }
    }
}

// What w is, as the tail of a report line: "mbarrier k_full[1] (smem +0x18008) parity 1" or
// "named barrier 2 (bar.sync, 256 threads)". name / slot: the barrier's name and index in its
// array (nullptr / -1 when unknown). prefix and warp head the line; thread < 0 omits the thread.
__host__ __device__ inline void print_wait(const char* prefix, uint32_t bx, uint32_t by, uint32_t bz, uint32_t warp,
                                           int thread, const Wait& w, const char* name, int slot) {
    const char* n = name ? name : "?";
    if (w.kind == kMbarrier && thread >= 0)
        printf("%s block (%u,%u,%u) warp %u thread %d: mbarrier %s[%d] (smem +0x%x) parity %u\n", prefix, bx, by, bz,
               warp, thread, n, slot, w.where, w.arg);
    else if (w.kind == kMbarrier)
        printf("%s block (%u,%u,%u) warp %u: mbarrier %s[%d] (smem +0x%x) parity %u\n", prefix, bx, by, bz, warp, n,
               slot, w.where, w.arg);
    else if (w.kind == kNamedBarrier && thread >= 0)
        printf("%s block (%u,%u,%u) warp %u thread %d: named barrier %u (bar.sync, %u threads)\n", prefix, bx, by, bz,
               warp, thread, w.where, w.arg);
    else if (w.kind == kNamedBarrier)
        printf("%s block (%u,%u,%u) warp %u: named barrier %u (bar.sync, %u threads)\n", prefix, bx, by, bz, warp,
               w.where, w.arg);
}

// The report of a waiter that ran out of time, then the time and polls.
__host__ __device__ inline void print_timeout(uint32_t bx, uint32_t by, uint32_t bz, uint32_t warp, int thread,
                                              const Wait& w, const char* name, int slot, uint64_t waited_ns,
                                              uint64_t polls, bool trapping) {
    print_wait(trapping ? "flash_attn hang check: TRAP:" : "flash_attn hang check: HANG:", bx, by, bz, warp, thread, w,
               name, slot);
    printf("flash_attn hang check:   not complete after %llu ms (%llu polls)%s\n",
           static_cast<unsigned long long>(waited_ns / 1000000), static_cast<unsigned long long>(polls),
           trapping ? "; trapping" : "");
}

#if defined(__CUDA_ARCH__)

// Nanosecond global timer (PTX %globaltimer). The CPU emulator (cuda/test/emu/emu.h) supplies
// its host version.
#if !defined(FA_HOST_EMULATION)
__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}
#endif  // !FA_HOST_EMULATION

// The wait board: per CTA (linear block index modulo kBoardCtas) and warp, what the warp waits on.
constexpr uint32_t kBoardCtas = 1024, kBoardWarps = 32;
struct BoardEntry {
    uint32_t cta_plus1;  // which CTA wrote it (0: never)
    uint32_t kind, where, arg;
};
__device__ BoardEntry g_board[kBoardCtas * kBoardWarps];
__device__ unsigned int g_reports;  // reports printed so far, all CTAs (output is capped)
constexpr unsigned int kMaxReports = 64, kMaxBoards = 4;

__device__ __forceinline__ uint32_t cta_linear() {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}
__device__ __forceinline__ volatile BoardEntry& board_entry(uint32_t cta, uint32_t warp) {
    return g_board[(cta % kBoardCtas) * kBoardWarps + warp % kBoardWarps];
}
__device__ __forceinline__ void board_set(const Wait& w) {
    volatile BoardEntry& e = board_entry(cta_linear(), threadIdx.x / 32);
    e.cta_plus1 = cta_linear() + 1;
    e.where = w.where;
    e.arg = w.arg;
    e.kind = w.kind;
}
__device__ __forceinline__ void board_clear() { board_entry(cta_linear(), threadIdx.x / 32).kind = kNone; }

// Byte offset of a shared-memory object from the 1024-aligned start of the dynamic shared memory
// (the base every kernel aligns to: the offsets of its Traits).
__device__ __forceinline__ uint32_t smem_offset(const void* p) {
    extern __shared__ uint8_t fa_hang_dynamic_smem[];
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(fa_hang_dynamic_smem));
    return static_cast<uint32_t>(__cvta_generic_to_shared(p)) - ((base + 1023u) & ~1023u);
}

__device__ __forceinline__ const char* barrier_name(const Wait& w, int* slot) {
    *slot = -1;
#if defined(FA_HANG_BARRIER_NAME)
    if (w.kind == kMbarrier) return FA_HANG_BARRIER_NAME(w.where, slot);
#endif
    return nullptr;
}

// Called by every thread of a warp whose wait timed out: the lowest active lane prints.
__device__ __noinline__ void report(const Wait& w, uint64_t waited_ns, uint64_t polls, bool trapping) {
    const unsigned int active = __activemask();
    if (threadIdx.x % 32 != static_cast<unsigned int>(__ffs(active) - 1)) return;
    const unsigned int n = atomicAdd(&g_reports, 1u);
    if (n >= kMaxReports) return;
    int slot;
    const char* name = barrier_name(w, &slot);
    print_timeout(blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x / 32, static_cast<int>(threadIdx.x), w, name, slot,
                  waited_ns, polls, trapping);
    if (trapping || n >= kMaxBoards) return;
    const uint32_t cta = cta_linear();
    for (uint32_t warp = 0; warp < (blockDim.x + 31) / 32 && warp < kBoardWarps; ++warp) {
        volatile BoardEntry& e = board_entry(cta, warp);
        if (e.cta_plus1 != cta + 1 || e.kind == kNone) continue;
        const Wait o{e.kind, e.where, e.arg};
        const char* oname = barrier_name(o, &slot);
        print_wait("flash_attn hang check:   board:", blockIdx.x, blockIdx.y, blockIdx.z, warp, -1, o, oname, slot);
    }
}

// The bounded wait of the hang-check build; probe() is one non-blocking try.
template <class Probe>
__device__ __forceinline__ void checked_wait(Probe&& probe, const Wait& w) {
    if (probe()) return;  // the common case: no clock, no board
    board_set(w);
    wait_loop(
        probe, [] { return globaltimer_ns(); }, FA_HANG_CHECK_NS,
        [&](uint64_t waited, uint64_t polls) { report(w, waited, polls, false); },
        [&](uint64_t waited, uint64_t polls) {
            report(w, waited, polls, true);
            __trap();
        });
    board_clear();
}

#endif  // __CUDA_ARCH__

}  // namespace fa_hang

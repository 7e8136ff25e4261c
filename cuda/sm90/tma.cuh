// TMA (cp.async.bulk.tensor) helpers for sm_90a kernels.
//
// The host encodes one CUtensorMap per operand with cuTensorMapEncodeTiled (see docs/fa3.md for
// the exact parameters) and passes it by value as a `const __grid_constant__` kernel parameter;
// the kernel hands its generic address to the copy instruction. We declare our own 128-byte,
// 128-aligned opaque struct (same size and alignment as CUDA 13's CUtensorMap) so the .cu file
// needs no <cuda.h>.
#pragma once
#include <stdint.h>
#include "sm90/mbarrier.cuh"

namespace fa3 {

struct alignas(128) TmaDesc {
    unsigned long long opaque[16];
};
static_assert(sizeof(TmaDesc) == 128, "CUtensorMap is 128 bytes");

// Inline PTX: only when nvcc compiles for sm_90a or sm_100a. The CPU emulator (cuda/test/emu, which defines
// FA_HOST_EMULATION) supplies host versions of exactly the functions in this block.
#if (defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(__CUDA_ARCH_FEAT_SM100_ALL)) && !defined(FA_HOST_EMULATION)

// Pull the descriptor into the TMA unit's cache ahead of the first copy.
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 4-D tiled load of one box into shared memory; completion is reported to `bar` as transaction
// bytes (the full box size, out-of-bounds elements included: they are written as zeros).
// Coordinates are in elements, innermost first. Our maps (docs/fa3.md) describe a [b, s, h, d]
// tensor in its natural memory order {c0 = head_dim, c1 = head, c2 = seq, c3 = batch} (strides
// increasing for contiguous tensors), with box {64, 1, rows, 1}: the box lands in shared memory
// as `rows` consecutive 128-byte rows. `dst` must be 1024-aligned for SWIZZLE_128B.
__device__ __forceinline__ void tma_load_4d(void* dst, const TmaDesc* map, uint64_t* bar, int c0,
                                            int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2),
        "r"(c3)
        : "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy accesses
// (wgmma operand reads, TMA) of the same bytes. Needed after plain st.shared of wgmma operands.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// elect.sync over the full warp: true in exactly one lane (the same lane for every thread of the
// warp), for "one thread of the warp issues" patterns without hard-coding lane 0. Every lane of
// the warp must execute it.
__device__ __forceinline__ bool elect_one_sync() {
    uint32_t pred = 0;
    asm volatile(
        "{\n"
        ".reg .b32 lane;\n"
        ".reg .pred p;\n"
        "elect.sync lane|p, 0xffffffff;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(pred));
    return pred != 0;
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL && !FA_HOST_EMULATION

}  // namespace fa3

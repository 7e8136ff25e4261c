// The preamble every FA3 stage starts with: shared memory carve-up and the tensor-map prefetch.
// (Block coordinates: scheduler.cuh; accumulator init: Acc::init in mainloop.cuh.)
#pragma once
#include "common/cta.cuh"
#include "fa3/traits.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace fa3 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// 1024-aligned start of the dynamic shared memory (Fa3Traits::kSmemBytes includes the slack).
using fa_cta::aligned_smem;
static_assert(static_cast<int>(fa_cta::kSmemAlignBytes) == kSwizzleAtomBytes, "the base alignment is the SW128 atom");

// What every stage sets up first: the 1024-aligned dynamic shared memory carved into the Q tile,
// the K and V rings, the barrier block and the FP8 cache's scale slots (Fa3Traits offsets).
template <class Tr>
struct Cta {
    uint8_t* smem;  // 1024-aligned base; the barrier block is at Tr::kOffBarriers
    uint8_t* sq;
    uint8_t* sk;
    uint8_t* sv;
    __device__ __forceinline__ Cta() {
        extern __shared__ uint8_t smem_raw[];
        smem = aligned_smem(smem_raw);
        sq = smem + Tr::kOffQ;
        sk = smem + Tr::kOffK;
        sv = smem + Tr::kOffV;
    }
    // Shared addresses of K and V ring slot `slot`.
    __device__ __forceinline__ uint32_t k_slot(int slot) const { return smem_u32(sk + slot * Tr::kKTileBytes); }
    __device__ __forceinline__ uint32_t v_slot(int slot) const { return smem_u32(sv + slot * Tr::kVTileBytes); }
    // The FP8 cache's scales of the K/V tile at ring position `it` (Tr::kOffScales; serving
    // instances only): K's kBlockN, then V's.
    __device__ __forceinline__ float* kv_scales(int it) const {
        return reinterpret_cast<float*>(smem + Tr::kOffScales) + (it % Tr::kScaleSlots) * 2 * Tr::kBlockN;
    }
};

// The producer's first step: the three tensor maps into the TMA unit's descriptor cache.
__device__ __forceinline__ void prefetch_maps(const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv) {
    tma_prefetch_desc(tq);
    tma_prefetch_desc(tk);
    tma_prefetch_desc(tv);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

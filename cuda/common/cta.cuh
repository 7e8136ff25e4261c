// Where a CTA of the FA3 (sm_90a) and FA4 (sm_100a) kernels works and where its dynamic shared
// memory starts: one definition for the FA3 pieces (cuda/fa3/) and cuda/fa4_fwd_sm100.cu.
#pragma once
#include <stdint.h>
#include "common/params.h"

namespace fa_cta {

// Block coordinates of a non-persistent grid (build/instances.rs: (query tiles, heads_q,
// batch)): x = query tile (heaviest first under a causal/window mask), y = q head, z = batch.
struct BlockCoord {
    int m_block, head, kv_head, batch;
};
__device__ __forceinline__ BlockCoord block_coord(const FwdParams& p) {
    BlockCoord bc;
    bc.m_block = p.window_right >= 0 ? static_cast<int>(gridDim.x - 1 - blockIdx.x)
                                     : static_cast<int>(blockIdx.x);
    bc.head = blockIdx.y;
    bc.kv_head = bc.head / (p.heads_q / p.heads_kv);
    bc.batch = blockIdx.z;
    return bc;
}

// The 1024-byte swizzle atom of SW128 tiles (wgmma and tcgen05 descriptors alike): the
// alignment of the tiles' base. Both kernels' kSmemBytes include this much slack.
constexpr uint32_t kSmemAlignBytes = 1024;

// 1024-aligned start of the dynamic shared memory.
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
    return raw + (kSmemAlignBytes - addr % kSmemAlignBytes) % kSmemAlignBytes;
}

}  // namespace fa_cta

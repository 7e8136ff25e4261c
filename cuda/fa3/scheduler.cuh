// Which (query tile, head, batch) a CTA computes: block coordinates of the one-tile stages
// (heaviest query tile first under a causal/window mask), stage 5's persistent walk over the
// same tiles, and the K/V tiles a query tile sees (the shared mask rule).
#pragma once
#include "common/cta.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "fa3/traits.cuh"

namespace fa3 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Block coordinates of the one-tile stages (common/cta.cuh, shared with FA4).
using fa_cta::block_coord;
using fa_cta::BlockCoord;

// Stage 5's linear tile numbering: t = m_index * (heads_q * batch) + batch * heads_q + head,
// with m_index counting query tiles from the last one (the heaviest under a causal/window mask,
// so the first wave of CTAs takes the longest tiles).
__device__ __forceinline__ BlockCoord tile_coord(const FwdParams& p, int t, int num_m_blocks) {
    const int per_m = p.heads_q * p.batch;
    const int m_index = t / per_m, rest = t % per_m;
    BlockCoord bc;
    bc.m_block = p.window_right >= 0 ? num_m_blocks - 1 - m_index : m_index;
    bc.head = rest % p.heads_q;
    bc.kv_head = bc.head / (p.heads_q / p.heads_kv);
    bc.batch = rest / p.heads_q;
    return bc;
}

// The K/V tiles the query tile of bc sees.
template <class Tr>
__device__ __forceinline__ KvRange kv_range(const FwdParams& p, const BlockCoord& bc) {
    const int m0 = bc.m_block * Tr::kBlockM;
    return kv_tile_range(p, m0, min(m0 + Tr::kBlockM, p.seqlen_q), Tr::kBlockN);
}

// The one query tile of stages 1-3 (from blockIdx): its coordinates, first row and K/V tiles.
template <class Tr>
struct OneTile {
    BlockCoord bc;
    int m0;
    KvRange kv;
    int n_tiles;
    __device__ __forceinline__ explicit OneTile(const FwdParams& p)
        : bc(block_coord(p)), m0(bc.m_block * Tr::kBlockM), kv(kv_range<Tr>(p, bc)), n_tiles(kv.n_end - kv.n_begin) {}
    // Tile bc of one sequence: ps holds that sequence's lengths (fa3/serving.cuh seq_params).
    __device__ __forceinline__ OneTile(const FwdParams& ps, const BlockCoord& c)
        : bc(c), m0(bc.m_block * Tr::kBlockM), kv(kv_range<Tr>(ps, bc)), n_tiles(kv.n_end - kv.n_begin) {}
};

// Where stage 1's plain loads read from: the one tile's first Q row, and K and V (the FP8
// consumer: Vᵀ) of its (batch, kv head). E: the element type as stored (strides in elements).
template <class E>
struct TileSources {
    const E* q;
    const E* k;
    const E* v;
    template <class Tr>
    __device__ __forceinline__ TileSources(const FwdParams& p, const OneTile<Tr>& t)
        : q(reinterpret_cast<const E*>(p.q) + t.bc.batch * p.q_batch_stride + t.m0 * p.q_row_stride +
            t.bc.head * p.q_head_stride),
          k(reinterpret_cast<const E*>(p.k) + t.bc.batch * p.k_batch_stride + t.bc.kv_head * p.k_head_stride),
          v(reinterpret_cast<const E*>(p.v) + t.bc.batch * p.v_batch_stride + t.bc.kv_head * p.v_head_stride) {}
};

// The tiles a CTA computes in stages 4-5: stage 4 exactly one, from blockIdx; stage 5 (persistent)
// t = blockIdx.x, blockIdx.x + gridDim.x, ... over every (query tile, head, batch).
template <class Tr>
struct TileScheduler {
    int num_m_blocks, num_tiles, begin, step;
    __device__ __forceinline__ explicit TileScheduler(const FwdParams& p)
        : num_m_blocks((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM),
          num_tiles(Tr::kStage >= 5 ? num_m_blocks * p.heads_q * p.batch : 1),
          begin(Tr::kStage >= 5 ? static_cast<int>(blockIdx.x) : 0),
          step(Tr::kStage >= 5 ? static_cast<int>(gridDim.x) : 1) {}
    __device__ __forceinline__ BlockCoord coord(const FwdParams& p, int t) const {
        if (Tr::kStage < 5) return block_coord(p);
        return tile_coord(p, t, num_m_blocks);
    }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

// Tile shapes, warpgroup roles and shared-memory plan of the FA3-style sm_90a kernels, one
// struct per (stage, head_dim of Q/K, head_dim of V). Everything the host needs for a launch (threads, dynamic smem,
// rows per CTA) is a constexpr here and repeated in docs/fa3.md.
#pragma once
#include "common/params.h"
#include "common/mask.cuh"
#include "sm90/wgmma.cuh"

namespace fa3 {

// ---- Tile ranges and mask predicates: the shared 64-bit rule of mask.cuh (__host__ too:
// cuda/test/fa3_layout_sim.cpp brute-forces them against the definition, written there).

// Key tiles [n_begin, n_end) that a block of query rows [m_begin, m_end) can see (every tile
// holding at least one visible key of some row in the block; n_end == n_begin when none).
using KvRange = FaKeyTiles;
__host__ __device__ constexpr KvRange kv_tile_range(const FwdParams& p, int m_begin, int m_end,
                                                    int block_n) {
    return fa_key_tiles(p, m_begin, m_end, block_n);
}

// False only when every (row, key) of rows [m_first, m_first + rows) x keys [n0, n0 + block_n)
// is visible, so the per-element mask can be skipped.
__host__ __device__ constexpr bool block_needs_mask(const FwdParams& p, int m_first, int rows,
                                                    int n0, int block_n) {
    return fa_tile_needs_mask(p, m_first, m_first + rows - 1, n0, (long long)n0 + block_n - 1);
}

constexpr int kWarpgroupThreads = 128;  // 4 warps issue one wgmma together

// The stage ladder (docs/fa3.md):
//   1: wgmma only, plain loads into swizzled smem, one warpgroup, single-buffered K/V.
//   2: + TMA into a K/V ring guarded by mbarriers, one warpgroup (thread 0 issues the copies).
//   3: + warp specialisation: a producer warpgroup (TMA, setmaxnreg.dec) and two consumer
//      warpgroups (setmaxnreg.inc), each consumer owning 64 query rows.
//   4: + ping-pong (the two consumers take turns issuing their GEMMs, named barriers) and
//      intra-warpgroup overlap (QK^T of tile j+1 and PV of tile j in flight during the softmax
//      of tile j+1); K and V get separate full/empty barriers.
//   5: + persistent scheduling: gridDim.x CTAs stride over all (query tile, head, batch) tiles,
//      heaviest first; the K/V ring and the Q buffer (q_empty barrier) carry over tiles.
// HeadDimV: V's head dim (the columns of O), Q/K's unless the instance is built for a pair
// (DeepSeek MLA prefill's (192, 128): FA_HEAD_DIM_V, docs/fa3.md "V head_dim").
template <int Stage, int HeadDim, int HeadDimV = HeadDim>
struct Fa3Traits {
    static_assert(Stage >= 1 && Stage <= 5, "stages 1..5 are implemented");
    static_assert(HeadDim % kSlabCols == 0 && HeadDim <= 256, "head_dim: 64, 128, 192 or 256");
    static_assert(HeadDimV % kSlabCols == 0 && HeadDimV <= 256, "head_dim_v: whole 64-column slabs");

    static constexpr int kStage = Stage;
    static constexpr int kHeadDim = HeadDim;    // Q and K columns: the reduction of S = Q K^T
    static constexpr int kHeadDimV = HeadDimV;  // V and O columns: the N of O += P V
    static constexpr int kSlabs = HeadDim / kSlabCols;    // 64-column SW128 slabs per Q/K row
    static constexpr int kSlabsV = HeadDimV / kSlabCols;  // ... per V row

    static constexpr int kConsumerWarpgroups = Stage >= 3 ? 2 : 1;
    static constexpr int kProducerWarpgroups = Stage >= 3 ? 1 : 0;
    static constexpr int kThreads = kWarpgroupThreads * (kConsumerWarpgroups + kProducerWarpgroups);
    static constexpr int kConsumerThreads = kWarpgroupThreads * kConsumerWarpgroups;

    // Query rows per CTA: 64 per consumer warpgroup (the M of one wgmma).
    static constexpr int kBlockM = kMmaM * kConsumerWarpgroups;
    // Keys per K/V tile. 128 keeps S (64 fp32/thread) + O (D_v/2) + P (32 b32) under the 240
    // consumer registers for D_v <= 128 (Q/K's head dim only lengthens the QK^T reduction);
    // D_v = 256 would need O = 128 regs, so it uses 64 keys.
    // (FA3 proper uses 128x128 causal / 128x176 non-causal at hdim 128; we use 128 for both.)
    static constexpr int kBlockN = HeadDimV <= 128 ? 128 : 64;
    static_assert(kBlockN % kMmaN == 0, "N is issued as m64n64 instructions");

    // Skip the per-element mask on K/V tiles where every (row, key) is visible. Off only for
    // the persistent stage at hd 256: its consumers sit at the 240-register ceiling (O alone is
    // 128 registers) and the extra branch made ptxas spill there.
    static constexpr bool kSkipUnmaskedTiles = !(Stage >= 5 && HeadDimV > 128);

    // Runs the serving layouts (varlen, caches, pages: fa3/serving.cuh) from stage 3 on, at
    // V head_dim <= 128 (64, 128 and (192, 128)): at 256 the consumers already sit at the
    // 240-register ceiling. The host refuses the rest (src/cuda/fa3/mod.rs).
    static constexpr bool kServing = Stage >= 3 && HeadDimV <= 128;

    // K/V ring depth: stage 1 loads synchronously into one buffer.
    static constexpr int kKvStages = Stage >= 2 ? 2 : 1;

    // Register split for the warp-specialised stage (3 warpgroups = 384 threads share 64K regs:
    // 128 * (24 + 2 * 240) = 64512 <= 65536). The kernel is compiled with
    // __launch_bounds__(384, 1), i.e. at most 168 registers at entry. Instances that serve the
    // batch layouts move registers to the producer (its per-sequence view and gathered loads):
    // stage 5, with its tile walk, 56 (24 to 48 spilled) and the consumers 216 (hd 128 reaches
    // R203); stages 3-4 32 and 232 (stage 4 hd 128 reaches R229; 224 spilled). Totals
    // 128 * (56 + 2 * 216) = 62464 and 128 * (32 + 2 * 232) = 63488, within the 64512 of the
    // CTA's launch allocation (ptxas at CUDA 13.0, no spills: tests/toolchain/sass.rs).
    static constexpr int kProducerRegs = kServing ? (Stage >= 5 ? 56 : 32) : 24;
    static constexpr int kConsumerRegs = kServing ? (Stage >= 5 ? 216 : 232) : 240;

    // Shared-memory plan (bytes). Every tile is a whole number of 1024-byte swizzle atoms, so
    // each one starts 1024-aligned once the base is.
    static constexpr int kElemBytes = 2;
    static constexpr int kQBytes = kBlockM * HeadDim * kElemBytes;
    static constexpr int kKTileBytes = kBlockN * HeadDim * kElemBytes;   // one K tile
    static constexpr int kVTileBytes = kBlockN * HeadDimV * kElemBytes;  // one V tile
    static constexpr int kQSlabStride = kBlockM * kSwizzleBytes;           // bytes between Q slabs
    static constexpr int kKvSlabStride = kBlockN * kSwizzleBytes;          // ... between K/V slabs
    static constexpr int kOffQ = 0;
    static constexpr int kOffK = kOffQ + kQBytes;
    static constexpr int kOffV = kOffK + kKvStages * kKTileBytes;
    static constexpr int kOffBarriers = kOffV + kKvStages * kVTileBytes;
    // Stages 2-3: q_full, kv_full[slots], kv_empty[slots]. Stages 4-5 (K and V separately):
    // q_full, k_full[slots], v_full[slots], k_empty[slots], v_empty[slots], q_empty.
    // 8 bytes each.
    static constexpr bool kSplitKv = Stage >= 4;
    static constexpr int kNumBarriers = kSplitKv ? 2 + 4 * kKvStages : 1 + 2 * kKvStages;
    // An FP8 KV cache's per-key scales (serving instances, fa3/serving.cuh "FP8 KV cache"): the
    // tile at ring position `it` has slot it % kScaleSlots, K's kBlockN f32 then V's. Twice the
    // ring's slots, as the consumers read a tile's scales after releasing its K slot (until P is
    // scaled): the producer rewrites a scale slot only after the K slot's next use was released.
    static constexpr int kScaleSlots = 2 * kKvStages;
    static constexpr int kBarriersEnd = kOffBarriers + 8 * kNumBarriers;
    static constexpr int kOffScales = (kBarriersEnd + 15) / 16 * 16;  // whole 16-byte units
    static constexpr int kScaleBytes = kScaleSlots * 2 * kBlockN * 4;
    static constexpr int kSmemUsed = kServing ? kOffScales + kScaleBytes : kBarriersEnd;
    // Dynamic smem is only guaranteed 16-byte aligned: ask for one extra atom and round up.
    static constexpr int kSmemBytes = kSmemUsed + kSwizzleAtomBytes;

    // TMA boxes (elements), innermost first: {64 columns (= 128 B swizzle span), 1 head, rows,
    // 1 batch}.
    static constexpr int kTmaBoxCols = kSlabCols;
    // V as stored, [keys x D] (the FP8 consumer's traits read Vᵀ instead: pipeline.cuh).
    static constexpr bool kVTransposed = false;
    static constexpr int kTmaBoxRowsQ = kMmaM;  // a 128-row Q tile is two boxes per slab
    static constexpr int kTmaBoxRowsKv = kBlockN;
    static constexpr int kTmaQBytes = kQBytes;
    static constexpr int kTmaKvBytes = kKTileBytes + kVTileBytes;  // K and V of one slot, one barrier
    // Stage 4 ping-pong: hardware named barrier ids (0 is __syncthreads), one per consumer
    // warpgroup, each completed by both consumer warpgroups (2 x 128 threads).
    static constexpr int kPingPongBarrier0 = 1;
    static constexpr int kPingPongThreads = 2 * kWarpgroupThreads;

    // ---- Offsets the mainloop uses (bytes); shared with cuda/test/fa3_layout_sim.cpp. ----
    static constexpr int kStepsPerSlab = kSlabCols / kMmaK;  // 4 k16 steps per 64-column slab
    // S = Q K^T, reduction step kk (columns 16kk.. of D). A = Q (K-major), relative to the
    // warpgroup's first Q row in slab 0.
    __host__ __device__ static constexpr int qk_a_offset(int kk) {
        return (kk / kStepsPerSlab) * kQSlabStride + (kk % kStepsPerSlab) * kMmaKBytes;
    }
    // B = K (K-major), keys 64nh.. of the tile: 64 rows * 128 B further into the same slab.
    __host__ __device__ static constexpr int qk_b_offset(int kk, int nh) {
        return (kk / kStepsPerSlab) * kKvSlabStride + nh * kMmaN * kSwizzleBytes +
               (kk % kStepsPerSlab) * kMmaKBytes;
    }
    // O += P V, key step kk (keys 16kk..), output columns 64nh.. (= slab nh). B = V (MN-major).
    __host__ __device__ static constexpr int pv_b_offset(int kk, int nh) {
        return nh * kKvSlabStride + kk * kMmaK * kSwizzleBytes;
    }
    // First Q row of consumer warpgroup cw inside slab 0.
    __host__ __device__ static constexpr int q_warpgroup_offset(int cw) {
        return cw * kMmaM * kSwizzleBytes;
    }
    // TMA box destinations: Q box (slab, 64-row block rb) and K/V box (slab).
    __host__ __device__ static constexpr int q_box_offset(int slab, int rb) {
        return slab * kQSlabStride + rb * kTmaBoxRowsQ * kSwizzleBytes;
    }
    __host__ __device__ static constexpr int kv_box_offset(int slab) {
        return slab * kKvSlabStride;
    }

    static_assert(kQBytes % kSwizzleAtomBytes == 0 && kKTileBytes % kSwizzleAtomBytes == 0 &&
                      kVTileBytes % kSwizzleAtomBytes == 0,
                  "tiles must be whole swizzle atoms");
    static_assert(kSmemBytes <= 227 * 1024, "sm_90 opt-in shared memory is 227 KiB per block");
};

}  // namespace fa3

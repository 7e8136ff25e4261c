// Shape, roles and shared/tensor-memory plan of the FA4-style sm_100a kernels, one struct per
// (stage, head_dim): what the host launches with (threads, block_m, dynamic shared memory) is a
// constexpr here and repeated in build/instances.rs (the unit static_asserts the two agree).
#pragma once
#include "common/cta.cuh"
#include "common/dtype.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/softmax.cuh"
#include "sm100/tcgen05.cuh"
#include "sm80/fast_math.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"

namespace fa4 {

using fa3::TmaDesc;

// Shape, roles and shared/tensor-memory plan of stage `Stage` at head dim `HeadDim`; the table
// row of build/instances.rs (fa4_tile, fa4_smem_bytes) repeats these numbers and the unit
// static_asserts the two agree.
template <int Stage, int HeadDim>
struct Fa4Traits {
    static_assert(Stage >= 1 && Stage <= 3, "stages 1, 2 and 3 are implemented");
    static_assert(HeadDim == 64 || HeadDim == 128, "head_dim 64 or 128");
    static constexpr int kHeadDim = HeadDim;
    static constexpr int kSlabs = HeadDim / kSlabCols;
    // Stage 1: one warpgroup, a thread per TMEM lane = query row. Stage 2 (FA4's roles):
    // warpgroups 0-1 softmax (each on 64 of the 128 keys of every row), warpgroup 2 correction
    // (O rescale, epilogue), warp 12 loads (TMA), warp 13 issues the MMAs, warp 14 owns the TMEM
    // allocation, warp 15 idles.
    static constexpr int kThreads = Stage == 1 ? 128 : 512;
    // Stage 3: two Q tiles of 128 rows (ping-pong), one per softmax warpgroup.
    static constexpr int kQTiles = Stage >= 3 ? 2 : 1;
    static constexpr int kBlockM = kUmmaM * kQTiles;
    static constexpr int kBlockN = 128;
    static constexpr int kSoftmaxWarpgroups = Stage == 1 ? 1 : 2;
    static constexpr int kKeysPerSoftmaxWg = Stage == 2 ? kBlockN / 2 : kBlockN;
    static constexpr int kCorrectionWarp0 = 8;
    static constexpr int kLoadWarp = 12;
    static constexpr int kMmaWarp = 13;
    static constexpr int kAllocWarp = Stage == 1 ? 0 : 14;

    // Shared memory (bytes; every tile a whole number of 1024-byte swizzle atoms).
    static constexpr int kElemBytes = 2;
    static constexpr int kKvStages = Stage == 1 ? 1 : 2;
    static constexpr int kQTileBytes = kUmmaM * HeadDim * kElemBytes;  // one 128-row Q tile
    static constexpr int kQBytes = kBlockM * HeadDim * kElemBytes;
    static constexpr int kKvTileBytes = kBlockN * HeadDim * kElemBytes;
    static constexpr int kPBytes = Stage == 1 ? kBlockM * kBlockN * kElemBytes : 0;  // stage 2: P in TMEM
    static constexpr int kQSlabStride = kUmmaM * kSwizzleBytes;  // within one 128-row Q tile
    static constexpr int kKvSlabStride = kBlockN * kSwizzleBytes;
    static constexpr int kPSlabStride = kBlockM * kSwizzleBytes;
    static constexpr int kOffQ = 0;
    static constexpr int kOffK = kOffQ + kQBytes;
    static constexpr int kOffV = kOffK + kKvStages * kKvTileBytes;
    static constexpr int kOffP = kOffV + kKvStages * kKvTileBytes;
    static constexpr int kOffBarriers = kOffP + kPBytes;
    // Stage 1: q_full, kv_full, s_full (S = Q K^T done), o_full (O += P V done). S and O get
    // separate barriers: with one, the issuer's next S commit could complete the phase after the
    // one a slow thread still waits for (same parity), and that thread would wait a phase late.
    // Stage 2: q_full, kv_full[2], kv_empty[2], s_full[2], p_full[2], corr_full[2], o_ready,
    // o_done, stats_full (Barriers2 below).
    // Stage 3: q_full, kv_full[2], kv_empty[2], then per Q tile t: s_full[t], p_full[t],
    // corr_full[t], o_ready[t], o_done[t], and stats_full (Barriers3 below).
    static constexpr int kNumBarriers = Stage == 1 ? 4 : Stage == 2 ? 14 : 16;
    static constexpr int kOffTmemSlot = kOffBarriers + 8 * kNumBarriers;
    // Stage 2 exchange buffers (f32, one per row): partial row max [2 tiles][2 wgs], the
    // correction factor [2 tiles], partial row sums [2 wgs], the final max.
    // Stage 3: the factors [Q tile][row], partial sums and maxima [Q tile][row].
    static constexpr int kOffRed = kOffTmemSlot + 8;
    static constexpr int kOffCorr = kOffRed + (Stage == 2 ? 4 * kUmmaM * 4 : 0);
    static constexpr int kOffLsum = kOffCorr + (Stage == 1 ? 0 : 2 * kUmmaM * 4);
    static constexpr int kOffMax = kOffLsum + (Stage == 1 ? 0 : 2 * kUmmaM * 4);
    static constexpr int kSmemUsed = kOffMax + (Stage == 1 ? 0 : Stage == 2 ? kUmmaM * 4 : 2 * kUmmaM * 4);
    static constexpr int kSmemBytes = kSmemUsed + kSwizzleAtomBytes;  // alignment slack

    // Tensor memory. Stage 1: S in columns [0, kBlockN), O in [kBlockN, kBlockN + D). Stage 2:
    // two S buffers (S_j in buffer j % 2, P_j written over it as packed 16-bit pairs) and O.
    // Stage 3: S_t (P_t over it) for Q tile t in columns [128 t, 128 t + 128), O_t at
    // 256 + D t.
    static constexpr int kSBuffers = Stage == 1 ? 1 : 2;
    static constexpr int kTmemS = 0;
    static constexpr int kTmemO = kSBuffers * kBlockN;
    static constexpr int kTmemCols = kTmemO + kQTiles * HeadDim <= 256 ? 256 : 512;

    // Stage 3 softmax (FlashAttention-4, docs/fa4.md), with its table row's parameters
    // (build/instances.rs FA4_SOFTMAX, passed as FA_EXP2_POLY_DEGREE, FA_EXP2_POLY_EVERY,
    // FA_LAZY_TAU): elements with index % kPolyEvery == kPolyEvery - 1 take the software exp2 of
    // common/exp2_poly.cuh (degree kPolyDegree) on the FMA units, the rest MUFU; the running max is kept
    // unless it grew by more than kLazyTau (log2 units). Stages 1-2 use neither.
#if defined(FA_EXP2_POLY_EVERY) && defined(FA_EXP2_POLY_DEGREE) && defined(FA_LAZY_TAU)
    static constexpr int kPolyEvery = Stage >= 3 ? FA_EXP2_POLY_EVERY : 0;
    static constexpr int kPolyDegree = Stage >= 3 ? FA_EXP2_POLY_DEGREE : 0;
    static constexpr float kLazyTau = Stage >= 3 ? FA_LAZY_TAU : -1.0f;
#else
    static constexpr int kPolyEvery = 0;
    static constexpr int kPolyDegree = 0;
    static constexpr float kLazyTau = -1.0f;
#endif
    static_assert(Stage < 3 || (kPolyEvery >= 1 && kPolyDegree >= 2 && kLazyTau >= 0.0f),
                  "stage 3 runs FA4's softmax: its table row passes the parameters");

    // TMA: boxes of {64 columns, 1 head, rows, 1 batch}; one box per slab per tile.
    static constexpr int kTmaBoxRows = 128;
    static constexpr int kTmaQBytes = kQBytes;
    static constexpr int kTmaKvBytes = 2 * kKvTileBytes;

    static_assert(kUmmaM == kTmaBoxRows && kBlockN == kTmaBoxRows, "one TMA box per slab and Q tile");
    static_assert(kSmemBytes <= 227 * 1024, "sm_100 opt-in shared memory is 227 KiB per block");
    static_assert(kTmemO + kQTiles * HeadDim <= kTmemColumns, "S and O fit the tensor memory");
};

}  // namespace fa4

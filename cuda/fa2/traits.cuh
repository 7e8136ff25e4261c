// Tile shapes of the FA2 kernel, one specialisation per head dim (per (Q/K, V) pair where V's
// differs). The host mirrors these numbers
// (docs/fa2.md has the table): grid = (ceil(seqlen_q / kBlockM), heads_q, batch), block =
// kNThreads, dynamic shared memory = kSmemBytes (above 48 KiB the launcher must first raise
// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES to kSmemBytes).
//
// Choices start from FA2's sm80 launch table (Dao-AILab/flash-attention csrc,
// flash_fwd_launch_template.h): 128 query rows with 4 warps up to hdim 128 (each warp owns 32 rows
// = 2 m-tiles, so every K/V fragment read from shared memory feeds two mma), and 64 rows with
// 4 warps x 1 m-tile for hdim 192/256, where 2 m-tiles would not fit in 255 registers (O alone is
// 4 * hdim / 8 floats per thread per m-tile). Differences from FA2, both measured with ptxas -v:
//  - hdim 128 uses 128x32, not 128x64: with 64 S + 128 O accumulators per thread ptxas spilled
//    16-90 bytes at 255 registers; 128x32 keeps the two-m-tile reuse of K/V fragments.
//  - K/V use a two-stage ring (one barrier per tile, each load overlapping a whole tile of
//    compute) instead of FA2's single K and V buffers; to fit 99 KiB with the ring, hdim 192/256
//    take 32-key tiles (FA2: 64x64 single-buffered).
// hdim 512 splits O's columns over warps (kColSplit = 2): one warp of 16 rows holding all 512
// columns of O would need 256 f32 accumulators per thread. Two warps share each 16 rows, each
// computes the rows' full S = Q K^T (the same instructions on the same data, so both hold the
// same S, softmax state and P bit for bit) and accumulates O for its own 256 columns: 128 O
// registers per thread, as at hdim 256. The cost is QK^T twice per row (1.5x the tensor-core work
// of one pass). 32x16 tiles with 4 warps (2 row groups x 2 column halves) take 99840 bytes, within
// the 99 KiB of sm_86/sm_89 (32x32 would need 166400: A100 and Hopper only; docs/fa2.md "Head dim 512").
// Every instance fits the 99 KiB opt-in limit of sm_86/sm_89, so one cubin runs on all sm_80+ parts.
#pragma once

namespace fa2 {

// Largest dynamic shared memory per block of the smallest sm_8x part (sm_86/sm_89: 99 KiB opt-in).
constexpr int kSmemLimitSm8x = 99 * 1024;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kColSplit_ = 1, int kHeadDimV_ = kHeadDim_>
struct Fa2TraitsBase {
    static constexpr int kHeadDim = kHeadDim_;    // Q's and K's
    static constexpr int kHeadDimV = kHeadDimV_;  // V's and O's (DeepSeek's MLA: 192/128, 576/512)
    static constexpr int kBlockM = kBlockM_;  // query rows per CTA
    static constexpr int kBlockN = kBlockN_;  // keys per K/V tile
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    // kColSplit warps share each row group, each owning kOCols consecutive columns of O (1: a
    // warp owns whole rows). Warp w is row group w % kRowWarps, column part w / kRowWarps.
    static constexpr int kColSplit = kColSplit_;
    static constexpr int kRowWarps = kNWarps / kColSplit;
    static constexpr int kOCols = kHeadDimV / kColSplit;
    // Each row group owns kMTiles consecutive m16 tiles of the CTA's rows (split-Q, no cross-warp sums).
    static constexpr int kMTiles = kBlockM / (16 * kRowWarps);
    static constexpr int kNTiles = kBlockN / 8;   // n8 tiles of S per m-tile
    static constexpr int kDTiles = kOCols / 8;    // n8 tiles of O per m-tile, this warp's columns
    static constexpr int kKSteps = kHeadDim / 16; // k16 steps of Q K^T
    // Row pitch of every shared tile, in elements: 16 bytes of padding keep ldmatrix conflict-free
    // (see fa2/layout.h) and keep each row 16-byte aligned for cp.async and the 16-byte O stores.
    static constexpr int kStride = kHeadDim + 8;    // Q and K tiles
    static constexpr int kStrideV = kHeadDimV + 8;  // V tiles and the O staging (in Q's space)
    static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per global row
    static constexpr int kElemBytes = 2;                // f16 / bf16
    // Q (reused for O staging) plus a kStages-deep ring of K/V tiles: tile j-1 loads while tile j
    // is computed, with one barrier per tile.
    static constexpr int kStages = 2;
    static constexpr int kSmemQ = kBlockM * kStride * kElemBytes;
    static constexpr int kSmemK = kStages * kBlockN * kStride * kElemBytes;
    static constexpr int kSmemV = kStages * kBlockN * kStrideV * kElemBytes;
    static constexpr int kSmemBytes = kSmemQ + kSmemK + kSmemV;

    static_assert(kHeadDim % 16 == 0, "head dim must be a multiple of the mma k (16)");
    static_assert(kHeadDimV % 16 == 0 && kHeadDimV <= kHeadDim, "O is staged in Q's tile: V's head dim at most Q's");
    static_assert(kBlockN % 16 == 0, "K/V tile must be a multiple of 16 keys (ldmatrix.x4 pairs)");
    static_assert(kNWarps % kColSplit == 0 && kOCols % 16 == 0, "O columns must split into d16 pairs per warp");
    static_assert(kBlockM == 16 * kRowWarps * kMTiles, "kBlockM must split into m16 tiles per row group");
    static_assert(kSmemBytes <= kSmemLimitSm8x, "shared memory above the sm_86/89 opt-in limit");
    static_assert((kStride * kElemBytes) % 16 == 0, "rows must stay 16-byte aligned");
};

template <int kHeadDim, int kHeadDimV = kHeadDim>
struct Fa2Traits;
template <> struct Fa2Traits<32> : Fa2TraitsBase<32, 128, 64, 4> {};
template <> struct Fa2Traits<64> : Fa2TraitsBase<64, 128, 64, 4> {};
template <> struct Fa2Traits<96> : Fa2TraitsBase<96, 128, 64, 4> {};
template <> struct Fa2Traits<128> : Fa2TraitsBase<128, 128, 32, 4> {};
template <> struct Fa2Traits<192> : Fa2TraitsBase<192, 64, 32, 4> {};
template <> struct Fa2Traits<256> : Fa2TraitsBase<256, 64, 32, 4> {};
template <> struct Fa2Traits<512> : Fa2TraitsBase<512, 32, 16, 4, 2> {};
// V's head dim below Q/K's (the fa2v row): MLA's prefill pair on hd 192's tile, and its absorbed
// decode pair with 16 rows per CTA and O's 512 columns split over all 4 warps (128 each; every
// warp computes the 16 rows' S): 89344 bytes, where hd 512's 32x16 with these rows would need
// 108032, past the 99 KiB of sm_86/sm_89.
template <> struct Fa2Traits<192, 128> : Fa2TraitsBase<192, 64, 32, 4, 1, 128> {};
template <> struct Fa2Traits<576, 512> : Fa2TraitsBase<576, 16, 16, 4, 4, 512> {};

}  // namespace fa2

// Tile shapes of the FA2 backward main kernel (cuda/fa2/bwd_mainloop.cuh), one specialisation
// per head dim; the host mirrors them (src/cuda/fa2_bwd.rs) and docs/fa2-backward.md has the
// table. One CTA owns kBlockN keys of one (kv head, batch) and loops over the query blocks of
// kBlockM rows that see them.
//
// Warps: kKeyWarps x kDSplit. Warp w owns the 16 keys of key tile w % kKeyWarps (S^T, dP^T and
// dS^T of those keys against the whole query block) and the head-dim columns
// [(w / kKeyWarps) * kDPart, +kDPart) of their dK and dV, which stay in registers across the
// CTA's whole loop. kDSplit = 2 at head dims 192/256 halves those accumulators (each warp then
// recomputes its keys' S^T and dP^T, the price of fitting 255 registers); smaller head dims keep
// one warp per key tile.
#pragma once

namespace fa2 {

template <int kHeadDim_, int kBlockM_, int kKeyWarps_, int kDSplit_>
struct Fa2BwdTraits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;            // query rows per inner iteration
    static constexpr int kKeyWarps = kKeyWarps_;
    static constexpr int kDSplit = kDSplit_;
    static constexpr int kBlockN = 16 * kKeyWarps;      // keys per CTA
    static constexpr int kNWarps = kKeyWarps * kDSplit;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kQTiles = kBlockM / 8;         // n8 tiles of S^T (queries) per warp
    static constexpr int kKSteps = kHeadDim / 16;       // k16 steps of K Q^T and V dO^T
    static constexpr int kDPart = kHeadDim / kDSplit;   // dK / dV columns per warp
    static constexpr int kDPartTiles = kDPart / 8;
    static constexpr int kDqCols = 32;                  // dQ columns per warp task (32 f32 acc)
    static constexpr int kDqTasks = (kBlockM / 16) * (kHeadDim / kDqCols);
    // Row pitches (elements): 16 bytes of padding keep ldmatrix conflict-free (fa2/layout.h).
    static constexpr int kStride = kHeadDim + 8;
    static constexpr int kSStride = kBlockN + 8;        // dS [query][key]
    static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per global row
    static constexpr int kSmemQ = kBlockM * kStride * 2;
    static constexpr int kSmemDo = kBlockM * kStride * 2;
    static constexpr int kSmemK = kBlockN * kStride * 2;
    static constexpr int kSmemV = kBlockN * kStride * 2;
    static constexpr int kSmemDs = kBlockM * kSStride * 2;
    static constexpr int kSmemRows = 2 * kBlockM * 4;   // LSE (log2 units) and D per query row
    static constexpr int kSmemBytes = kSmemQ + kSmemDo + kSmemK + kSmemV + kSmemDs + kSmemRows;

    static_assert(kHeadDim % kDqCols == 0 && kDPart % 16 == 0, "head dim must split into 16-column pairs");
    static_assert(kBlockM % 16 == 0, "query block must be whole m16 tiles");
    static_assert(kSmemBytes <= 99 * 1024, "shared memory above the sm_86/89 opt-in limit");
    static_assert((kStride * 2) % 16 == 0 && (kSStride * 2) % 16 == 0, "rows must stay 16-byte aligned");
};

template <int kHeadDim>
struct Fa2BwdTile;
template <> struct Fa2BwdTile<32> : Fa2BwdTraits<32, 64, 4, 1> {};
template <> struct Fa2BwdTile<64> : Fa2BwdTraits<64, 64, 4, 1> {};
template <> struct Fa2BwdTile<96> : Fa2BwdTraits<96, 64, 4, 1> {};
template <> struct Fa2BwdTile<128> : Fa2BwdTraits<128, 32, 4, 1> {};
template <> struct Fa2BwdTile<192> : Fa2BwdTraits<192, 64, 2, 2> {};
template <> struct Fa2BwdTile<256> : Fa2BwdTraits<256, 32, 2, 2> {};

// The preprocess and convert kernels: 128 threads, 16 query rows per CTA.
constexpr int kBwdRowThreads = 128;
constexpr int kBwdRowsPerCta = 16;

}  // namespace fa2

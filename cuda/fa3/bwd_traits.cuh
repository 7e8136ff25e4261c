// Tile shapes, roles and shared-memory plan of the FA3-style backward main kernel (sm_90a,
// cuda/fa3_bwd_sm90.cu), one struct per head dim. One CTA owns kBlockN keys of one (kv head,
// batch): K and V stay resident in shared memory while a producer warpgroup streams the query
// blocks (Q and dO, kBlockM rows each) through a kStages-deep TMA ring; each consumer warpgroup
// owns 64 of the keys (the M of one wgmma) and keeps their dK and dV in registers.
#pragma once
#include "sm90/wgmma.cuh"

namespace fa3 {

template <int HeadDim>
struct Fa3BwdTraits {
    static_assert(HeadDim == 64 || HeadDim == 128, "the FA3 backward is built for head dims 64 and 128");
    static constexpr int kHeadDim = HeadDim;
    static constexpr int kSlabs = HeadDim / kSlabCols;      // 64-column SW128 slabs per row
    static constexpr int kConsumerWarpgroups = 2;
    static constexpr int kKeysPerWarpgroup = kMmaM;           // S^T = K Q^T: keys are the M
    static constexpr int kBlockN = kConsumerWarpgroups * kKeysPerWarpgroup;
    static constexpr int kBlockM = kMmaN;                     // query rows per ring slot
    static constexpr int kStages = 2;                         // Q / dO ring depth
    static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
    static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
    // Register split (384 threads, 64K registers): 128 * (24 + 2 * 240) = 64512.
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = 240;

    static constexpr int kElemBytes = 2;
    static constexpr int kKvBytes = kBlockN * HeadDim * kElemBytes;  // K (or V), resident
    static constexpr int kQBytes = kBlockM * HeadDim * kElemBytes;   // one Q (or dO) slot
    static constexpr int kKvSlabStride = kBlockN * kSwizzleBytes;
    static constexpr int kQSlabStride = kBlockM * kSwizzleBytes;
    // dS of one consumer warpgroup, [query][key], row-major with 8 elements of padding: written by
    // plain stores from the dS^T accumulator, read back as the A fragments of dQ = dS K.
    static constexpr int kDsStride = kKeysPerWarpgroup + 8;
    static constexpr int kDsBytes = kBlockM * kDsStride * kElemBytes;

    static constexpr int kOffK = 0;
    static constexpr int kOffV = kOffK + kKvBytes;
    static constexpr int kOffQ = kOffV + kKvBytes;
    static constexpr int kOffDo = kOffQ + kStages * kQBytes;
    static constexpr int kOffDs = kOffDo + kStages * kQBytes;
    static constexpr int kOffBarriers = kOffDs + kConsumerWarpgroups * kDsBytes;
    // kv_full, then q_full[kStages] (Q and dO of a slot), q_empty[kStages].
    static constexpr int kNumBarriers = 1 + 2 * kStages;
    static constexpr int kSmemUsed = kOffBarriers + 8 * kNumBarriers;
    static constexpr int kSmemBytes = kSmemUsed + kSwizzleAtomBytes;  // 1024-alignment slack

    // Named barrier of consumer warpgroup cw (its 128 threads around the dS tile).
    static constexpr int kDsBarrier0 = 1;
    // Named barrier ordering the two consumer warpgroups' dQ additions (atomic mode).
    static constexpr int kDqOrderBarrier = kDsBarrier0 + kConsumerWarpgroups;

    // Byte offsets inside SW128 slabs. K-major step kk (16 columns of D) of a tile whose slabs are
    // slab_stride apart; MN-major step kk (16 rows) and 64-column block nh.
    __host__ __device__ static constexpr int kmajor_offset(int kk, int slab_stride) {
        return (kk / (kSlabCols / kMmaK)) * slab_stride + (kk % (kSlabCols / kMmaK)) * kMmaKBytes;
    }
    __host__ __device__ static constexpr int mnmajor_offset(int kk, int nh, int slab_stride) {
        return nh * slab_stride + kk * kMmaK * kSwizzleBytes;
    }

    static_assert(kOffQ % kSwizzleAtomBytes == 0 && kOffDo % kSwizzleAtomBytes == 0 && kQBytes % kSwizzleAtomBytes == 0,
                  "every TMA destination starts on a 1024-byte swizzle atom");
    static_assert(kOffBarriers % 8 == 0, "mbarriers are 8-byte aligned");
    static_assert(kSmemBytes <= 227 * 1024, "shared memory above the sm_90 opt-in limit");
};

}  // namespace fa3

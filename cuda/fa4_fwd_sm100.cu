// FA4-style forward attention for Blackwell (sm_100a), bf16/f16, on the 5th-generation tensor
// cores (tcgen05) with the accumulators in tensor memory (TMEM). Built as a ladder of stages,
// each a complete kernel (docs/fa4.md has the status, launch shape and what ran where):
//   stage 1  tcgen05.mma with S = Q K^T and O = P V accumulated in TMEM (tcgen05.alloc /
//            relinquish / dealloc, tcgen05.ld / st), Q/K/V by TMA into 128B-swizzled shared
//            memory, one CTA of one warpgroup: thread 0 issues TMA and MMAs, each MMA batch is
//            tcgen05.commit-ed to an mbarrier every thread waits on; each thread owns one query
//            row (TMEM lane), so the softmax needs no shuffles. P goes through shared memory.
//   stage 2  + FA4's warp roles: a load warp (TMA, 2-slot K/V ring), an MMA warp (S_{j+1} into
//            the second TMEM S buffer while tile j's softmax runs), two softmax warpgroups (64
//            keys each, the row max shared through smem + a named barrier), a correction
//            warpgroup (O rescale in TMEM, epilogue); P is written over S in TMEM and the PV MMA
//            reads A from tensor memory.
//   stage 3  + two Q tiles (256 rows) in ping-pong, one per softmax warpgroup, and FA4's softmax:
//            software exp2 (common/exp2_poly.cuh) for 1 element in 8, conditional rescaling with
//            tau = 8 (common/softmax.cuh); the correction warpgroup rescales only when a row of
//            the warp needs it.
// Layouts (smem tiles, descriptors, TMEM) are derived in sm100/tcgen05.cuh.
//
// The kernels are compositions (cuda/fa4/): traits.cuh (tile shapes, roles, shared and tensor
// memory plan), tile.cuh (the GEMMs, softmax verbs, epilogue and CTA carve-up every stage uses),
// stage1.cuh, roles2.cuh and roles3.cuh (the warp roles of stages 2 and 3), and stages.cuh, which
// composes them into one `forward` per stage. This file holds only the entry points.
//
// Semantics (same as every backend): s = scale * q.k, optional softcap, bottom-right aligned
// causal/sliding window, GQA, LSE (natural log) on request, attention sinks (FwdParams::sinks,
// folded once per row by the epilogue, common/softmax.cuh fa_softmax_finalize_sink), rows with
// no visible key give O = 0 and LSE -inf (the head's sink with one). No ALiBi (the host refuses
// it). Seqlens need not be multiples of the tile: TMA
// zero-fills rows past the end and those keys are masked.
// Host requirements (src/cuda/fa4.rs): head_dim == the instance's D; q/k/v/o strides multiples
// of 8 elements, 16-byte aligned base addresses (TMA, 16-byte stores of O).
#include <climits>

#include "fa4/stages.cuh"

// ---------------------------------------------------------------- instances
// Symbol: fa4s<stage>_fwd_hd<D>_<dtype> (build/instances.rs: one family row per stage). Every
// stage takes the params and the tensor maps of Q, K, V (box rows 128; src/cuda/fa4.rs).

#define FA4_KERNEL(S, DT, T, D)                                                                       \
    extern "C" __global__ void __launch_bounds__(fa4::Fa4Traits<S, D>::kThreads, 1)                   \
        fa4s##S##_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p,                               \
                                   const __grid_constant__ fa3::TmaDesc tmap_q,                       \
                                   const __grid_constant__ fa3::TmaDesc tmap_k,                       \
                                   const __grid_constant__ fa3::TmaDesc tmap_v) {                     \
        fa4::forward<S, T, D>(p, &tmap_q, &tmap_k, &tmap_v);                                          \
    }
#define FA4_TYPE_bf16 __nv_bfloat16
#define FA4_TYPE_f16 __half

#if defined(FA_STAGE)
// FA_STAGE is the row's `stage` (build/instances.rs: one family row per stage).
#define FA4_STAGE FA_STAGE
// The table (build/instances.rs) and the traits must agree on the launch shape.
static_assert(FA_THREADS == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kThreads, "table: threads");
static_assert(FA_BLOCK_M == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kBlockM, "table: block_m");
static_assert(FA_BLOCK_N == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kBlockN, "table: block_n");
static_assert(FA_SMEM_BYTES == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kSmemBytes,
              "table: dynamic shared memory (fa4_smem_bytes in build/instances.rs)");
#define FA4_INSTANCE_(S, DT, D) FA4_KERNEL(S, DT, FA4_TYPE_##DT, D)
#define FA4_INSTANCE(S, DT, D) FA4_INSTANCE_(S, DT, D)
#define FA_INSTANCE(DT) FA4_INSTANCE(FA4_STAGE, DT, FA_HEAD_DIM)
#endif

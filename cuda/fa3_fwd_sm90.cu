// FA3-style forward attention for Hopper (sm_90a), bf16/f16, built as a ladder of stages that
// each add one mechanism (docs/fa3.md has the status, launch configuration and tensor maps):
//   stage 1  wgmma only: one warpgroup per 64 query rows, Q/K/V copied by plain 16-byte loads
//            into 128B-swizzled shared memory, S = Q K^T (both operands in smem) and O += P V
//            (P from registers, V through a transposed "MN-major" descriptor).
//   stage 2  + TMA (cp.async.bulk.tensor.4d) into a 2-slot K/V ring with mbarrier
//            expect_tx / try_wait.parity phase tracking; one warpgroup, thread 0 issues.
//   stage 3  + warp specialisation: warpgroup 0 produces (TMA, setmaxnreg.dec), warpgroups 1-2
//            consume (setmaxnreg.inc), each on its own 64 of the CTA's 128 query rows; slots are
//            released through "empty" mbarriers.
//   stage 4  + ping-pong (the consumers pass a GEMM-issue token through two named barriers) and
//            intra-warpgroup overlap (S_j+1 and PV_j in flight during the softmax of S_j+1);
//            separate K and V barriers.
//   stage 5  + persistent scheduling (CTAs stride over heaviest-first tiles; the ring and the Q
//            buffer carry across tiles).
// Layouts (smem tiles, descriptors, register fragments) are derived in sm90/wgmma.cuh.
//
// The kernels are compositions (cuda/fa3/): traits.cuh (tile shapes, roles, shared-memory plan),
// preamble.cuh, scheduler.cuh, pipeline.cuh, mainloop.cuh, epilogue.cuh, and stages.cuh, which
// composes the five stages from them. This file holds only the entry points.
//
// Semantics (same as every backend): s = scale * q.k, optional softcap, bottom-right aligned
// causal/sliding window, GQA (kv head = q head / (heads_q / heads_kv)), LSE (natural log) on
// request, rows with no visible key give O = 0 and LSE = -inf. No ALiBi: the dispatcher must not
// route FA_FLAG_ALIBI here. Seqlens need not be multiples of the tile: loads past the end are
// zero (plain loads: explicit; TMA: out-of-bounds fill) and those keys are masked.
// Host requirements: head_dim == the instance's D, and V's head dim == its D_v (FA_HEAD_DIM_V, the
// table's pair: (192, 128), DeepSeek MLA prefill; D elsewhere); q/k/v/o row, head and batch strides multiples
// of 8 elements and base addresses 16-byte aligned (16-byte vector loads / TMA strides).
#include <climits>

#if defined(FA_HANG_CHECK)
// Hang-check builds (cuda/sm90/hang_check.cuh) name a stuck mbarrier from its shared-memory
// offset; defined at the end of this file from the Barriers / SplitBarriers layouts.
namespace fa3 {
__device__ const char* hang_barrier_name(unsigned int offset, int* slot);
}
#define FA_HANG_BARRIER_NAME(offset, slot) fa3::hang_barrier_name(offset, slot)
#endif

#include "fa3/stages.cuh"

// ---------------------------------------------------------------- instances
// Symbol: fa3s<stage>_fwd_hd<D>_<dtype> (the table's `<family>_fwd_hd<D>_<dtype>` convention,
// build/instances.rs: one family row per stage, "fa3s1".."fa3s5"). Stage 1 takes only the
// params; stages 2-5 also take the tensor maps of Q, K, V (docs/fa3.md). __launch_bounds__ pins
// the thread count each stage is written for.
//
// Built through the units build.rs generates from build/instances.rs: one per (stage, head dim),
// defining FA_HEAD_DIM, FA_BLOCK_M, FA_BLOCK_N, FA_THREADS and FA_SMEM_BYTES from the table
// (static_asserted below against Fa3Traits), FA_HEAD_DIM_V where V's head dim differs (the
// (192, 128) instance), and the stage, as FA_STAGE=<n> or (older units) through the family token
// FA_FAMILY=fa3s<n>; then FA_INSTANCE(f16) and FA_INSTANCE(bf16).

// FAM: the row's name (FA_FAMILY): fa3s<S>, or fa4_fa3s5* for the rows that run FA4's softmax
// in this pipeline (with their FaRowPolicy).
#define FA3_S1(FAM, DT, T, D)                                                              \
    extern "C" __global__ void __launch_bounds__(fa3::Fa3Traits<1, D>::kThreads, 1)        \
        FAM##_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p) {                      \
        fa3::stage1<T, D, FA3_HEAD_DIM_V>(p);                                              \
    }
#define FA3_SN(FAM, S, DT, T, D)                                                           \
    extern "C" __global__ void __launch_bounds__(fa3::Fa3Traits<S, D>::kThreads, 1)        \
        FAM##_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p,                        \
                                   const __grid_constant__ fa3::TmaDesc tmap_q,            \
                                   const __grid_constant__ fa3::TmaDesc tmap_k,            \
                                   const __grid_constant__ fa3::TmaDesc tmap_v) {          \
        fa3::stage_with_maps<S, T, D, FA3_HEAD_DIM_V>(p, &tmap_q, &tmap_k, &tmap_v);       \
    }
#define FA3_S2(FAM, DT, T, D) FA3_SN(FAM, 2, DT, T, D)
#define FA3_S3(FAM, DT, T, D) FA3_SN(FAM, 3, DT, T, D)
#define FA3_S4(FAM, DT, T, D) FA3_SN(FAM, 4, DT, T, D)
#define FA3_S5(FAM, DT, T, D) FA3_SN(FAM, 5, DT, T, D)
#define FA3_TYPE_bf16 __nv_bfloat16
#define FA3_TYPE_f16 __half

#if defined(FA_HANG_CHECK)
// The hang-check name hook declared at the top: barrier block index -> name, from the one
// (stage, head dim) of this unit.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FA3_HANG_NAMES 1
#endif
#endif

#if !defined(FA_STAGE) && defined(FA_FAMILY)
// The stage of the family row this unit was generated for (FA_FAMILY is a bare token).
#define FA3_STAGE_OF_fa3s1 1
#define FA3_STAGE_OF_fa3s2 2
#define FA3_STAGE_OF_fa3s3 3
#define FA3_STAGE_OF_fa3s4 4
#define FA3_STAGE_OF_fa3s5 5
#define FA3_CAT_(a, b) a##b
#define FA3_CAT(a, b) FA3_CAT_(a, b)
#define FA_STAGE FA3_CAT(FA3_STAGE_OF_, FA_FAMILY)
#endif
#if !defined(FA_STAGE)
#error "compile through the unit build.rs generates (it defines FA_STAGE, the FA3 stage 1-5)"
#endif
#define FA3_STAGE FA_STAGE
// V's head dim: the unit's FA_HEAD_DIM_V where the table row's pair differs, else Q/K's.
#if defined(FA_HEAD_DIM_V)
#define FA3_HEAD_DIM_V FA_HEAD_DIM_V
#else
#define FA3_HEAD_DIM_V FA_HEAD_DIM
#endif
// The table (build/instances.rs) and the traits must agree on the launch shape.
using Fa3UnitTraits = fa3::Fa3Traits<FA3_STAGE, FA_HEAD_DIM, FA3_HEAD_DIM_V>;
static_assert(FA_THREADS == Fa3UnitTraits::kThreads, "table: threads");
static_assert(FA_BLOCK_M == Fa3UnitTraits::kBlockM, "table: block_m");
static_assert(FA_BLOCK_N == Fa3UnitTraits::kBlockN, "table: block_n");
static_assert(FA_SMEM_BYTES == Fa3UnitTraits::kSmemBytes,
              "table: dynamic shared memory (fa3_smem_bytes in build/instances.rs)");
// Two expansion levels so FA_FAMILY, FA3_STAGE and FA_HEAD_DIM become literals before pasting.
#define FA3_INSTANCE_(FAM, S, DT, D) FA3_S##S(FAM, DT, FA3_TYPE_##DT, D)
#define FA3_INSTANCE(FAM, S, DT, D) FA3_INSTANCE_(FAM, S, DT, D)
#define FA_INSTANCE(DT) FA3_INSTANCE(FA_FAMILY, FA3_STAGE, DT, FA_HEAD_DIM)
#if defined(FA3_HANG_NAMES)
__device__ const char* fa3::hang_barrier_name(unsigned int offset, int* slot) {
    using Tr = Fa3UnitTraits;
    *slot = -1;
    if (Tr::kStage == 1 || offset < Tr::kOffBarriers || offset >= Tr::kSmemUsed || offset % 8) return nullptr;
    const int i = static_cast<int>(offset - Tr::kOffBarriers) / 8;
    return Tr::kSplitKv ? fa3::SplitBarriers<Tr>::name(i, slot) : fa3::Barriers<Tr>::name(i, slot);
}
#endif

#if defined(FA_HANG_CHECK) && !defined(FA3_HANG_NAMES)
__device__ const char* fa3::hang_barrier_name(unsigned int, int* slot) {
    *slot = -1;
    return nullptr;
}
#endif

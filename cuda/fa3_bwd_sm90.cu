// FA3-style backward main kernel for Hopper (sm_90a): dK, dV and the f32 dQ accumulation with
// TMA, an mbarrier ring and wgmma in warp-specialised warpgroups (cuda/fa3/bwd_mainloop.cuh;
// docs/fa3.md, "Backward"). It replaces only the FA2 backward's main kernel: the launch sequence
// is
//   1. fa2_bwd_preprocess_<dt>   (cuda/fa2_bwd.cu) D = rowsum(dO o O); zeroes dq_accum (atomic mode)
//   2. fa3_bwd_hd<D>_<dt>        grid (ceil(seqlen_k / 128), heads_kv, batch), 384 threads,
//                                Fa3BwdTraits<D>::kSmemBytes of dynamic shared memory, and four
//                                tensor maps (Q, K, V, dO) as the forward's: {64 columns, 1 head,
//                                rows, 1 batch} boxes with SWIZZLE_128B, 64 rows for Q and dO,
//                                128 for K and V
//          D   smem bytes
//          64     85032
//         128    150568
//   3. fa2_bwd_convert_dq_<dt>   (cuda/fa2_bwd.cu) with BwdParams::block_n = 64
// BwdParams as the FA2 backward's; softcap and ALiBi are not supported here.
#include "common/bwd_params.h"
#include "fa3/bwd_mainloop.cuh"

#define FA3_BWD_TYPE_bf16 __nv_bfloat16
#define FA3_BWD_TYPE_f16 __half
#define FA3_BWD_KERNEL(HDIM, DT)                                                                        \
    extern "C" __global__ void __launch_bounds__(fa3::Fa3BwdTraits<HDIM>::kThreads, 1)                 \
        fa3_bwd_hd##HDIM##_##DT(const __grid_constant__ BwdParams p, const __grid_constant__ fa3::TmaDesc tmap_q, \
                                const __grid_constant__ fa3::TmaDesc tmap_k,                            \
                                const __grid_constant__ fa3::TmaDesc tmap_v,                            \
                                const __grid_constant__ fa3::TmaDesc tmap_do) {                         \
        fa3::bwd_kernel<FA3_BWD_TYPE_##DT, HDIM>(p, &tmap_q, &tmap_k, &tmap_v, &tmap_do);               \
    }
FA3_BWD_KERNEL(64, f16)
FA3_BWD_KERNEL(64, bf16)
FA3_BWD_KERNEL(128, f16)
FA3_BWD_KERNEL(128, bf16)

// The launch table of the header comment, checked against the traits.
static_assert(fa3::Fa3BwdTraits<64>::kSmemBytes == 85032 && fa3::Fa3BwdTraits<128>::kSmemBytes == 150568,
              "fa3_bwd launch table out of date");
static_assert(fa3::Fa3BwdTraits<64>::kThreads == 384 && fa3::Fa3BwdTraits<64>::kBlockN == 128,
              "fa3_bwd launch table out of date");

// FA2 backward: FlashAttention-2's backward pass (Dao, arXiv 2307.08691) on mma.sync tensor
// cores, sm_80 and newer, as three launches on one stream (src/cuda/fa2_bwd.rs plans them):
//
//   1. fa2_bwd_preprocess_<dt>     D = rowsum(dO o O); zeroes the f32 dq accumulator (atomic mode)
//        grid (ceil(seqlen_q / 16), heads_q, batch), 128 threads, no shared memory
//   2. fa2_bwd_hd<D>_<dt>          dK, dV of one key block, dQ accumulated (fa2/bwd_mainloop.cuh)
//        grid (ceil(seqlen_k / kBlockN), heads_kv, batch), kNThreads, kSmemBytes of dynamic smem
//          D   kBlockM kBlockN warps smem bytes
//          32     64     64     4     30208
//          64     64     64     4     46592
//          96     64     64     4     62976
//         128     32     64     4     57088
//         192     64     32     4     82432
//         256     32     32     4     70400
//        (static_asserted below)
//   3. fa2_bwd_convert_dq_<dt>     dq = scale * accumulated dS K, in the dtype (fa2/bwd_convert.cuh)
//        grid (ceil(seqlen_q / 16), heads_q, batch), 128 threads, no shared memory
//   4. fa2_bwd_sink_grad           only when BwdParams::d_sinks is set: the attention sinks'
//        gradient from D and the LSE (fa2/bwd_sink_grad.cuh), any dtype
//        grid (heads_q), 128 threads, 16 bytes of dynamic shared memory
//
// Preconditions checked by the host: head_dim == D; every tensor 16-byte aligned and every stride
// a multiple of 8 elements; heads_q % heads_kv == 0; lse is the forward's (natural log, -inf for
// rows that see no key); alibi_slopes non-null when FA_FLAG_ALIBI; dq_accum holds
// dq_accum_splits x batch x heads_q x seqlen_q x D floats.
//
// Standalone image (build/instances.rs STANDALONE, "fa2_bwd"): every head dim and dtype in one
// unit.
#include "common/bwd_params.h"
#include "fa2/bwd_convert.cuh"
#include "fa2/bwd_mainloop.cuh"
#include "fa2/bwd_preprocess.cuh"
#include "fa2/bwd_sink_grad.cuh"

namespace fa2 {
using bwd_f16 = __half;
using bwd_bf16 = __nv_bfloat16;
}  // namespace fa2

#define FA2_BWD_ROW_KERNELS(DT)                                                                        \
    extern "C" __global__ void __launch_bounds__(fa2::kBwdRowThreads)                                  \
        fa2_bwd_preprocess_##DT(const __grid_constant__ BwdParams p) {                                 \
        fa2::bwd_preprocess<fa2::bwd_##DT>(p);                                                         \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(fa2::kBwdRowThreads)                                  \
        fa2_bwd_convert_dq_##DT(const __grid_constant__ BwdParams p) {                                 \
        fa2::bwd_convert_dq<fa2::bwd_##DT>(p);                                                         \
    }
#define FA2_BWD_KERNEL(HDIM, DT)                                                                       \
    extern "C" __global__ void __launch_bounds__(fa2::Fa2BwdTile<HDIM>::kNThreads, 1)                  \
        fa2_bwd_hd##HDIM##_##DT(const __grid_constant__ BwdParams p) {                                 \
        fa2::bwd_kernel<fa2::bwd_##DT, HDIM>(p);                                                       \
    }
#define FA2_BWD_INSTANCES(DT)                                                                          \
    FA2_BWD_ROW_KERNELS(DT)                                                                            \
    FA2_BWD_KERNEL(32, DT)                                                                             \
    FA2_BWD_KERNEL(64, DT)                                                                             \
    FA2_BWD_KERNEL(96, DT)                                                                             \
    FA2_BWD_KERNEL(128, DT)                                                                            \
    FA2_BWD_KERNEL(192, DT)                                                                            \
    FA2_BWD_KERNEL(256, DT)
FA2_BWD_INSTANCES(f16)
FA2_BWD_INSTANCES(bf16)
extern "C" __global__ void __launch_bounds__(fa2::kBwdRowThreads) fa2_bwd_sink_grad(const __grid_constant__ BwdParams p) {
    fa2::bwd_sink_grad(p);
}
static_assert(fa2::kBwdSinkSmemBytes == 16, "fa2_bwd_sink_grad launch table out of date");

// The launch table of the header comment (and of src/cuda/fa2_bwd.rs), checked against the traits.
#define FA2_BWD_CHECK(D, M, N, W, SMEM)                                                                \
    static_assert(fa2::Fa2BwdTile<D>::kBlockM == M && fa2::Fa2BwdTile<D>::kBlockN == N &&              \
                      fa2::Fa2BwdTile<D>::kNWarps == W && fa2::Fa2BwdTile<D>::kSmemBytes == SMEM,      \
                  "fa2_bwd launch table out of date for hdim " #D);
FA2_BWD_CHECK(32, 64, 64, 4, 30208)
FA2_BWD_CHECK(64, 64, 64, 4, 46592)
FA2_BWD_CHECK(96, 64, 64, 4, 62976)
FA2_BWD_CHECK(128, 32, 64, 4, 57088)
FA2_BWD_CHECK(192, 64, 32, 4, 82432)
FA2_BWD_CHECK(256, 32, 32, 4, 70400)

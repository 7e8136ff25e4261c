// The backward's first kernel: D = rowsum(dO o O) per query row (f32 from the 16-bit inputs),
// which dS = P o (dP - D) needs, and (atomic mode) the f32 dq accumulator of those rows zeroed.
// One warp per row at a time, lanes striding the head dim and summing by butterfly; any head_dim
// (a multiple of 8, as the main kernel's instances). Grid (ceil(seqlen_q / kBwdRowsPerCta),
// heads_q, batch), kBwdRowThreads threads.
#pragma once
#include <stdint.h>

#include "common/bwd_params.h"
#include "common/dtype.cuh"
#include "fa2/bwd_traits.cuh"

namespace fa2 {

template <typename Elem>
__device__ __forceinline__ void bwd_preprocess(const BwdParams& p) {
    const int head = blockIdx.y, batch = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = blockIdx.x * kBwdRowsPerCta;
    const int64_t row_base = (static_cast<int64_t>(batch) * p.heads_q + head) * p.seqlen_q;
    const Elem* gO = reinterpret_cast<const Elem*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;
    const Elem* gDo = reinterpret_cast<const Elem*>(p.d_o) + batch * p.do_batch_stride + head * p.do_head_stride;
    const bool zero_accum = (p.flags & FA_BWD_FLAG_DETERMINISTIC) == 0u;
    for (int r = row0 + warp; r < min(row0 + kBwdRowsPerCta, p.seqlen_q); r += kBwdRowThreads / 32) {
        const Elem* o = gO + static_cast<int64_t>(r) * p.o_row_stride;
        const Elem* d_o = gDo + static_cast<int64_t>(r) * p.do_row_stride;
        float sum = 0.f;
        for (int c = lane; c < p.head_dim; c += 32) sum += fa_to_float(o[c]) * fa_to_float(d_o[c]);
#pragma unroll
        for (int off = 16; off >= 1; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (lane == 0) reinterpret_cast<float*>(p.d_sum)[row_base + r] = sum;
        if (zero_accum) {
            float* acc = reinterpret_cast<float*>(p.dq_accum) + (row_base + r) * p.head_dim;
            for (int c = lane; c < p.head_dim; c += 32) acc[c] = 0.f;
        }
    }
}

}  // namespace fa2

// The backward's last kernel: dq = softmax_scale * (sum dS K) from the f32 accumulator into the
// input dtype and dq's strides. Atomic mode: one accumulator. Deterministic mode: the sum of the
// key blocks' partials in key-block order, over exactly the blocks holding a key the row sees
// (the ones the main kernel wrote for it; a row that sees none gets 0). Grid
// (ceil(seqlen_q / kBwdRowsPerCta), heads_q, batch), kBwdRowThreads threads, any head_dim.
#pragma once
#include <stdint.h>

#include "common/bwd_params.h"
#include "common/dtype.cuh"
#include "common/mask.cuh"
#include "fa2/bwd_traits.cuh"

namespace fa2 {

template <typename Elem>
__device__ __forceinline__ void bwd_convert_dq(const BwdParams& p) {
    const int head = blockIdx.y, batch = blockIdx.z;
    const int row0 = blockIdx.x * kBwdRowsPerCta;
    const int64_t row_base = (static_cast<int64_t>(batch) * p.heads_q + head) * p.seqlen_q;
    const int64_t split_stride = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q * p.head_dim;
    const bool deterministic = (p.flags & FA_BWD_FLAG_DETERMINISTIC) != 0u;
    Elem* gDq = reinterpret_cast<Elem*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride;
    const int rows = min(row0 + kBwdRowsPerCta, p.seqlen_q) - row0;
    for (int e = threadIdx.x; e < rows * p.head_dim; e += kBwdRowThreads) {
        const int r = row0 + e / p.head_dim, c = e % p.head_dim;
        const float* acc = reinterpret_cast<const float*>(p.dq_accum) + (row_base + r) * p.head_dim + c;
        float sum;
        if (deterministic) {
            sum = 0.f;
            const int lo = fa_key_lo(p, r), hi = fa_key_hi(p, r);
            if (hi > lo)
                for (int n = lo / p.block_n; n < (hi + p.block_n - 1) / p.block_n; ++n) sum += acc[n * split_stride];
        } else {
            sum = *acc;
        }
        gDq[static_cast<int64_t>(r) * p.dq_row_stride + c] = fa_from_float<Elem>(sum * p.softmax_scale);
    }
}

}  // namespace fa2

// The attention sinks' gradient (BwdParams::sinks -> d_sinks), after the preprocess wrote D:
// d_sink[h] = -sum over batch and rows of exp(sink[h] - LSE[row]) * D[row]. The forward's LSE
// already holds the sink's term, so exp(sink - LSE) is the sink's probability; the sink has no
// value, so its dP is 0 and its dS is P_sink * (0 - D) (src/cpu/backward sink_gradients, the
// reference's attention_backward_f64). One CTA per query head, a fixed-order sum (each thread
// its rows in order, a butterfly per warp, the warps' sums in order by thread 0): no atomics,
// bit-identical run to run in either dq mode. A head without a sink (-inf, or sinks == 0) gets 0.
// Grid (heads_q), kBwdRowThreads threads, kBwdSinkSmemBytes of dynamic shared memory.
#pragma once
#include <math.h>
#include <stdint.h>

#include "common/bwd_params.h"
#include "fa2/bwd_traits.cuh"

namespace fa2 {

constexpr int kBwdSinkWarps = kBwdRowThreads / 32;
constexpr int kBwdSinkSmemBytes = kBwdSinkWarps * 4;  // one f32 per warp

__device__ __forceinline__ void bwd_sink_grad(const BwdParams& p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* warp_sums = reinterpret_cast<float*>(smem_raw);
    const int head = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float sink = p.sinks != 0 ? reinterpret_cast<const float*>(p.sinks)[head] : -INFINITY;
    float sum = 0.f;
    if (sink != -INFINITY) {
        const float* lse = reinterpret_cast<const float*>(p.lse);
        const float* d = reinterpret_cast<const float*>(p.d_sum);
        for (int b = 0; b < p.batch; ++b) {
            const int64_t base = (static_cast<int64_t>(b) * p.heads_q + head) * p.seqlen_q;
            for (int r = threadIdx.x; r < p.seqlen_q; r += kBwdRowThreads)
                sum += expf(sink - lse[base + r]) * d[base + r];
        }
    }
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) warp_sums[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < kBwdSinkWarps; ++w) total += warp_sums[w];
        reinterpret_cast<float*>(p.d_sinks)[head] = sink == -INFINITY ? 0.f : -total;
    }
}

}  // namespace fa2

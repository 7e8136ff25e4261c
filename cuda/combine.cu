// The combine kernel: merges n attention states (o_i, lse_i) of the same query rows over
// disjoint key sets into one (docs/serving.md, "Merging attention states"). It is the second
// pass of split-KV decode (f32 partials o_accum / lse_accum -> o in the output dtype and the
// forward's LSE) and the device form of `merge_states` / `merge_states_n`.
//
// Per row, the arithmetic of the host's `merge_row` (src/serving/merge.rs), in f32:
//   m = max_i lse_i; NaN in any lse_i -> o = NaN, lse = NaN; m = −inf (no state saw a key) ->
//   o = 0, lse = −inf; otherwise e_i = exp(lse_i − m) over the states with lse_i ≠ −inf (the
//   others are not read: their o may be anything), sum = Σ e_i,
//   o = Σ (e_i / sum) · o_i, lse = m + log(sum).
// A sink logit z of the row's head (CombineParams::sinks) is the state (o = 0, lse = z): in m and
// the sum (last), never in o; so a row whose states all saw no key gets o = 0 and lse = z.
// The host forms w_i = exp(lse_i − lse) in f64; e_i / sum is the same number, and in f32 it
// avoids subtracting two large LSEs (exp of a difference rounded at |lse|'s ulp). m = +inf (an
// overflowed input) gives NaN weights, as on the host. Sums run over the states in order, each
// step an explicit fmaf, so the emulator (g++, no contraction) computes the same bits as nvcc.
//
// Work split: one warp per row (b, s, h), FA_COMBINE_WARPS rows per CTA, no shared memory. Lane
// l holds columns l, l + 32, ... (coalesced row reads), at most FA_COMBINE_MAX_HEAD_DIM / 32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/combine_params.h"
#include "common/dtype.cuh"

namespace fa_combine {

constexpr int kWarp = 32;
constexpr int kThreads = FA_COMBINE_WARPS * kWarp;
constexpr int kColsPerLane = FA_COMBINE_MAX_HEAD_DIM / kWarp;

// The instance macro's type names (fa_f16 and fa_bf16 are common/dtype.cuh's).
using fa_f32 = float;
using fa_f16 = ::fa_f16;
using fa_bf16 = ::fa_bf16;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return fa_to_float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return fa_to_float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x) {
    if constexpr (std::is_same<T, float>::value) {
        return x;
    } else {
        return fa_from_float<T>(x);
    }
}

__device__ __forceinline__ int64_t at(const int64_t (&stride)[3], int64_t b, int64_t s, int64_t h) {
    return b * stride[0] + s * stride[1] + h * stride[2];
}

template <typename Tin, typename Tout>
__device__ __forceinline__ void combine(const CombineParams& p) {
    // A head_dim the lanes cannot hold would leave columns unwritten: never a silent answer
    // (the host refuses it).
    if (p.head_dim > FA_COMBINE_MAX_HEAD_DIM) __trap();
    const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * FA_COMBINE_WARPS + warp;
    const int64_t rows = static_cast<int64_t>(p.batch) * p.seqlen * p.heads;
    if (row >= rows) return;  // the whole warp: row is warp-uniform
    const int64_t h = row % p.heads, s = (row / p.heads) % p.seqlen, b = row / p.heads / p.seqlen;
    const int n = p.n_inputs * p.states_per_input;
    const int per = p.states_per_input;
    const int d = p.head_dim;
    const int64_t lse_row = at(p.lse_strides, b, s, h);
    const auto lse_of = [&](int i) -> float {
        const float* l = reinterpret_cast<const float*>(p.in[i / per].lse);
        return l[(i % per) * p.lse_state_stride + lse_row];
    };
    const auto o_of = [&](int i) -> const Tin* {
        const CombineInput& in = p.in[i / per];
        return reinterpret_cast<const Tin*>(in.o) + (i % per) * p.o_state_stride + at(in.o_strides, b, s, h);
    };

    // The head's sink logit is one more state (o = 0, lse = sink): in m and the sum, not in o.
    const float sink = p.sinks != 0 ? reinterpret_cast<const float*>(p.sinks)[h] : -INFINITY;
    float m = sink;
    bool nan = false;
    for (int i = 0; i < n; ++i) {
        const float l = lse_of(i);
        nan |= isnan(l);
        m = fmaxf(m, l);
    }
    float lse, acc[kColsPerLane];
    if (nan || m == -INFINITY) {
        // NaN propagates to the whole row; a row no state saw a key of is 0 with LSE −inf.
        lse = nan ? NAN : -INFINITY;
#pragma unroll
        for (int k = 0; k < kColsPerLane; ++k) acc[k] = nan ? NAN : 0.0f;
    } else {
        float sum = 0.0f;
        for (int i = 0; i < n; ++i) {
            const float l = lse_of(i);
            if (l != -INFINITY) sum += expf(l - m);
        }
        if (sink != -INFINITY) sum += expf(sink - m);
        const float inv = 1.0f / sum;
#pragma unroll
        for (int k = 0; k < kColsPerLane; ++k) acc[k] = 0.0f;
        for (int i = 0; i < n; ++i) {
            const float l = lse_of(i);
            if (l == -INFINITY) continue;  // saw no key: weighs nothing, its o is not read
            const float w = expf(l - m) * inv;
            const Tin* o = o_of(i);
#pragma unroll
            for (int k = 0; k < kColsPerLane; ++k) {
                const int c = lane + k * kWarp;
                if (c < d) acc[k] = fmaf(w, to_f32(o[c]), acc[k]);
            }
        }
        lse = m + logf(sum);
    }
    Tout* out = reinterpret_cast<Tout*>(p.out_o) + at(p.out_strides, b, s, h);
#pragma unroll
    for (int k = 0; k < kColsPerLane; ++k) {
        const int c = lane + k * kWarp;
        if (c < d) out[c] = from_f32<Tout>(acc[k]);
    }
    if (p.out_lse != 0 && lane == 0) reinterpret_cast<float*>(p.out_lse)[at(p.out_lse_strides, b, s, h)] = lse;
}

}  // namespace fa_combine

// One kernel per (input type, output type): f32 partials into any output dtype (split-KV), and
// 16-bit states into their own dtype (merge_states keeps the inputs' dtype).
#define FA_COMBINE_INSTANCE(TIN, TOUT)                                                               \
    extern "C" __global__ void __launch_bounds__(fa_combine::kThreads)                                \
        fa_combine_##TIN##_##TOUT(const __grid_constant__ CombineParams p) {                          \
        fa_combine::combine<fa_combine::fa_##TIN, fa_combine::fa_##TOUT>(p);                         \
    }

FA_COMBINE_INSTANCE(f32, f32)
FA_COMBINE_INSTANCE(f32, f16)
FA_COMBINE_INSTANCE(f32, bf16)
FA_COMBINE_INSTANCE(f16, f16)
FA_COMBINE_INSTANCE(bf16, bf16)

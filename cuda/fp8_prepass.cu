// The FP8 pre-pass of the Hopper FP8 forward (docs/fp8.md, "On Hopper"): bf16/f16 operands in,
// e4m3 codes plus one f32 scale per (batch, head, block of rows) out, Q and K optionally rotated
// by the seeded random-sign Hadamard transform H·D/sqrt(d) first. The same steps, in the same
// f32 operations, as the CPU path (src/numerics/quant.rs quantize_e4m3 after
// src/numerics/hadamard.rs Rotation::apply), through the shared definitions of fp8.cuh and
// hadamard.cuh, so the codes and scales are bit-identical to the CPU oracle
// (tests/emulator/fp8.rs checks this in the emulator).
//
// Work split: one warp per scale block (work item = operand, batch, head, block), no shared
// memory. A row of d elements lives in the warp as E = max(1, ceil(d / 32)) consecutive elements
// per lane (element j = lane·E + e). The block is read twice: once for its amax, once to quantise
// (the rotation is recomputed, which gives the same bits; rows are not kept in shared memory so
// that any block size works, one scale per (batch, head) included).
//
// Why it is bit-identical to the CPU code:
//  * the signs multiply exactly (±1); the butterfly computes every pair (a + b, a − b) from the
//    same two f32 values as fwht(), stage by stage (stages h < E inside a lane, h >= E across
//    lanes with shfl.xor: the lower element's partner is lane ^ (h / E)), then the same 1/sqrt(d)
//    product; no step can be contracted into an FMA (no product feeds an addition other than the
//    exact ±1 products, whose FMA gives the same value);
//  * amax is a max over the finite magnitudes, which does not depend on the order;
//  * scale and code come from fa_block_scale / fa_quantize_e4m3 (correctly rounded division,
//    satfinite round-to-nearest-even conversion).
// NaN inputs: the code of a NaN is 0x7F here, 0x7F or 0xFF in the Rust codec (compare NaN-ness).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/dtype.cuh"
#include "common/fp8.cuh"
#include "common/fp8_prepass_params.h"
#include "common/hadamard.cuh"

namespace fp8pre {

constexpr int kWarp = 32;
constexpr int kThreads = FA_FP8_PREPASS_WARPS * kWarp;

__device__ __forceinline__ int64_t work_items(const Fp8PrepassOperand& op) {
    return static_cast<int64_t>(op.batch) * op.heads * op.blocks;
}

// Loads row `row` of (b, h) into v (E elements per lane; 0 past head_dim) and rotates it when the
// operand asks for it.
template <typename T, int E>
__device__ __forceinline__ void load_row(const Fp8PrepassOperand& op, const Fp8PrepassParams& p, int b, int h,
                                         int row, int lane, float (&v)[E]) {
    const T* x = reinterpret_cast<const T*>(op.x) + b * op.x_batch_stride + row * op.x_row_stride +
                 h * op.x_head_stride;
    const int d = p.head_dim;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int j = lane * E + e;
        v[e] = j < d ? fa_to_float(x[j]) : 0.0f;
    }
    if (!(op.flags & FA_FP8_ROTATE)) return;
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] *= fa_hadamard_sign(p.hadamard_seed, lane * E + e);
    // Butterfly stages h = 1, 2, 4, ... < d: pair (x[j], x[j + h]) -> (a + b, a − b). Stages
    // h < E pair elements of one lane (unrolled: constant register indices), the others pair
    // lane with lane ^ (h / E).
#pragma unroll
    for (int hs = 1; hs < E; hs *= 2) {
        if (hs >= d) break;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            if ((e & hs) == 0) {
                const float a = v[e], c = v[e + hs];
                v[e] = a + c;
                v[e + hs] = a - c;
            }
        }
    }
    for (int hs = E; hs < d; hs *= 2) {
        const int lane_mask = hs / E;
        const bool upper = (lane & lane_mask) != 0;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float other = __shfl_xor_sync(0xffffffffu, v[e], lane_mask);
            // Lower element j: a + b with a = self; upper element j + h: a − b with a = partner.
            v[e] = upper ? other - v[e] : v[e] + other;
        }
    }
    const float norm = fa_hadamard_norm(d);
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] *= norm;
}

template <typename T, int E>
__device__ __forceinline__ void prepass(const Fp8PrepassParams& p) {
    const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
    int64_t item = static_cast<int64_t>(blockIdx.x) * FA_FP8_PREPASS_WARPS + warp;
    int o = 0;
    while (o < p.n_ops && item >= work_items(p.op[o])) item -= work_items(p.op[o++]);
    if (o >= p.n_ops) return;  // the whole warp: item is warp-uniform
    const Fp8PrepassOperand& op = p.op[o];
    // Rotation needs a power-of-two head_dim (the host refuses others); never a silent answer.
    if ((op.flags & FA_FP8_ROTATE) && (p.head_dim & (p.head_dim - 1))) __trap();
    const int blk = static_cast<int>(item % op.blocks);
    const int64_t bh = item / op.blocks;
    const int h = static_cast<int>(bh % op.heads), b = static_cast<int>(bh / op.heads);
    const int row0 = blk * op.block_rows;
    const int row1 = min(op.seqlen, row0 + op.block_rows);
    const int d = p.head_dim;

    float v[E];
    float amax = 0.0f;
    for (int r = row0; r < row1; ++r) {
        load_row<T, E>(op, p, b, h, r, lane, v);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float a = fabsf(v[e]);
            // Finite magnitudes only (NaN fails the comparison, infinity is excluded).
            amax = (a > amax && a != INFINITY) ? a : amax;
        }
    }
#pragma unroll
    for (int m = kWarp / 2; m > 0; m /= 2) {
        const float other = __shfl_xor_sync(0xffffffffu, amax, m);
        amax = other > amax ? other : amax;
    }
    const float scale = fa_block_scale(amax);
    if (lane == 0) reinterpret_cast<float*>(op.scales)[bh * op.blocks + blk] = scale;

    uint8_t* codes = reinterpret_cast<uint8_t*>(op.codes) + b * op.c_batch_stride + h * op.c_head_stride;
    for (int r = row0; r < row1; ++r) {
        load_row<T, E>(op, p, b, h, r, lane, v);
        uint8_t* row = codes + r * op.c_row_stride;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int j = lane * E + e;
            if (j < d) row[j * op.c_dim_stride] = fa_quantize_e4m3(v[e], scale);
        }
    }
}

}  // namespace fp8pre

// One kernel per (dtype, E): E = elements per lane, head_dim <= 32·E.
#define FA_FP8_PREPASS_INSTANCE(DT, E)                                                                 \
    extern "C" __global__ void __launch_bounds__(fp8pre::kThreads)                                      \
        fa_fp8_prepass_e##E##_##DT(const __grid_constant__ Fp8PrepassParams p) {                        \
        fp8pre::prepass<fa_##DT, E>(p);                                                                 \
    }

// A unit of the table (build/instances.rs) includes this file for the one E of its head dim
// (fa3_fp8_fwd_sm90.cu); standalone, every E.
#if !defined(FA_FP8_PREPASS_NO_INSTANCES)
FA_FP8_PREPASS_INSTANCE(f16, 1)
FA_FP8_PREPASS_INSTANCE(f16, 2)
FA_FP8_PREPASS_INSTANCE(f16, 4)
FA_FP8_PREPASS_INSTANCE(f16, 8)
FA_FP8_PREPASS_INSTANCE(bf16, 1)
FA_FP8_PREPASS_INSTANCE(bf16, 2)
FA_FP8_PREPASS_INSTANCE(bf16, 4)
FA_FP8_PREPASS_INSTANCE(bf16, 8)
#endif

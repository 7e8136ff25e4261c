// Score transform, mask and online-softmax pieces of the FA2 kernel, on the m16n8k16 accumulator
// layout: each lane holds, per m16 tile, two query rows (g and g+8) and, per n8 tile, two adjacent
// key columns of each row; the 4 lanes of a quad (same g) together hold a full row of the tile.
//
// Conventions (shared with every backend of the crate, see src/cpu/softmax.rs):
//   s2 = score in log2 units: q.k * softmax_scale_log2, or with softcap
//        softcap * softmax_scale_log2 * tanh(q.k * softmax_scale / softcap) (softmax_scale_log2 is
//        log2(e) then), plus the ALiBi bias -slope[h] * log2(e) * |i + sk - sq - j|; masked = -inf.
//   m = running row max of s2; p = 2^(s2 - m); l = running sum of p; O rescaled by 2^(m_old - m).
//   The -inf guard: while a row has seen only masked keys m = -inf and we subtract 0 instead,
//   so 2^(-inf - 0) = 0 and never NaN from (-inf) - (-inf).
// Portable C++ apart from __device__: the GPU-only primitives (ex2, quad shuffles) live in
// mma_sm80.cuh, so the CPU emulator (cuda/test/emu) can compile this file unchanged.
#pragma once
#include <math.h>
#include <stdint.h>

#include "fa2_layout.h"
#include "fa_params.h"

namespace fa2 {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): natural -> log2 units
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): log2 -> natural units (LSE)

// The score transform reads its constants straight from the __grid_constant__ params (constant
// bank operands in SASS, no registers: the hot loop of hdim 128 is at the 255-register limit).
// Only the ALiBi slope is per head; the kernel loads it once.
__device__ __forceinline__ float alibi_log2(const FwdParams& p, int head) {
    return (p.flags & FA_FLAG_ALIBI) ? reinterpret_cast<const float*>(p.alibi_slopes)[head] * kLog2e : 0.f;
}

// Raw q.k of one (m-tile set x n-tile set) accumulator block -> s2 in place: log2 units, softcap,
// ALiBi. `row0` is the absolute query row of m-tile 0's row 0, `col0` the key of n-tile 0's col 0.
// The common case (neither softcap nor ALiBi) is one FMUL per score with no index math, so the
// register-tight hot loop carries no row/column integers.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void scores_to_log2(float (&s)[kMTiles][kNTiles][4], const FwdParams& p,
                                               float slope_log2, int row0, int col0, int lane) {
    if (p.flags & (FA_FLAG_SOFTCAP | FA_FLAG_ALIBI)) {
        const bool softcap = (p.flags & FA_FLAG_SOFTCAP) != 0u;
        const float cap_in = softcap ? p.softmax_scale / p.softcap : 0.f;
        const float cap_out = p.softcap * p.softmax_scale_log2;
        const int diag = p.seqlen_k - p.seqlen_q;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float qk = s[mt][nt][i];
                    float v = softcap ? cap_out * tanhf(qk * cap_in) : qk * p.softmax_scale_log2;
                    const int row = row0 + mt * 16 + acc_row(lane, i);
                    const int col = col0 + nt * 8 + acc_col(lane, i);
                    // slope_log2 is 0 without ALiBi, so softcap-only adds a zero bias.
                    v -= slope_log2 * static_cast<float>(abs(row + diag - col));
                    s[mt][nt][i] = v;
                }
    } else {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[mt][nt][i] *= p.softmax_scale_log2;
    }
}

// Visible keys of query `row`, clamped to [0, seqlen_k - 1] (lo > hi when none): bottom-right
// aligned, row + diag - left <= key <= row + diag + right with diag = seqlen_k - seqlen_q; an
// unbounded side (-1) is ignored. 64-bit so that huge windows cannot overflow.
struct KeyRange {
    int lo, hi;
};
__device__ __forceinline__ KeyRange key_range(const FwdParams& p, int row) {
    const int64_t d = static_cast<int64_t>(row) + p.seqlen_k - p.seqlen_q;
    int64_t lo = 0, hi = p.seqlen_k - 1;
    if (p.window_left >= 0) lo = d - p.window_left > lo ? d - p.window_left : lo;
    if (p.window_right >= 0) hi = d + p.window_right < hi ? d + p.window_right : hi;
    if (lo > p.seqlen_k) lo = p.seqlen_k;  // keep both in int range; lo > hi still means empty
    if (hi < -1) hi = -1;
    return KeyRange{static_cast<int>(lo), static_cast<int>(hi)};
}

// Sets invisible scores of the block to -inf (only called on tiles crossing a mask boundary).
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask(float (&s)[kMTiles][kNTiles][4], const FwdParams& p, int row0,
                                           int col0, int lane) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const KeyRange kr = key_range(p, row0 + mt * 16 + hr * 8 + (lane >> 2));
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = col0 + nt * 8 + acc_col(lane, e);
                    if (col < kr.lo || col > kr.hi) s[mt][nt][2 * hr + e] = -INFINITY;
                }
        }
}

}  // namespace fa2

// Score transform, mask and online-softmax pieces of the FA2 kernel, on the m16n8k16 accumulator
// layout: each lane holds, per m16 tile, two query rows (g and g+8) and, per n8 tile, two adjacent
// key columns of each row; the 4 lanes of a quad (same g) together hold a full row of the tile.
//
// Conventions (shared with every backend of the crate, see src/cpu/softmax.rs, "Units"):
//   s = score in score units: the raw q.k, or with softcap / ALiBi natural units
//       softcap * tanh(q.k * softmax_scale * (1 / softcap)) and/or q.k * softmax_scale, minus the
//       ALiBi bias slope[h] * |i + sk - sq - j|; masked = -inf.
//   c = softmax_scale_log2 (the host sets scale * log2(e) for raw scores, log2(e) for natural).
//   m = running row max of s; p = 2^((s - m) * c); l = running sum of p; O rescaled by
//   2^((m_old - m) * c). Never m * c on its own (off by up to ±128 in the exponent once
//   |m * c| >= 2^31, overflowing above f32::MAX / log2 e).
//   The -inf guard: while a row has seen only masked keys m = -inf and we subtract 0 instead,
//   so 2^(-inf - 0) = 0 and never NaN from (-inf) - (-inf).
// Portable C++ apart from __device__: the GPU-only primitives (ex2, quad shuffles) live in
// mma_sm80.cuh, so the CPU emulator (cuda/test/emu) can compile this file unchanged.
#pragma once
#include <math.h>
#include <stdint.h>

#include "fa2_layout.h"
#include "fa_numerics_common.cuh"  // FA_LN2: log2 of the sum -> natural units (LSE)
#include "fa_params.h"
#include "mask.cuh"

namespace fa2 {


// The score transform reads its constants straight from the __grid_constant__ params (constant
// bank operands in SASS, no registers: the hot loop of hdim 128 is at the 255-register limit).
// Only the ALiBi slope is per head; the kernel loads it once.
__device__ __forceinline__ float alibi_slope(const FwdParams& p, int head) {
    return (p.flags & FA_FLAG_ALIBI) ? reinterpret_cast<const float*>(p.alibi_slopes)[head] : 0.f;
}

// Whether scores are in natural units (softcap or ALiBi) rather than raw q.k.
__device__ __forceinline__ bool natural_scores(const FwdParams& p) {
    return (p.flags & (FA_FLAG_SOFTCAP | FA_FLAG_ALIBI)) != 0u;
}

// Raw q.k of one (m-tile set x n-tile set) accumulator block -> natural units in place, with
// softcap and ALiBi, each step as a straightforward f32 softmax takes it (so each is finite
// wherever its counterpart there is). Called only when natural_scores(p): the common case keeps
// raw q.k and costs nothing here, so the register-tight hot loop carries no row/column integers.
// `row0` is the absolute query row of m-tile 0's row 0, `col0` the key of n-tile 0's col 0.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void scores_to_natural(float (&s)[kMTiles][kNTiles][4], const FwdParams& p,
                                                  float slope, int row0, int col0, int lane) {
    const bool softcap = (p.flags & FA_FLAG_SOFTCAP) != 0u;
    const float inv_cap = softcap ? 1.f / p.softcap : 0.f;  // finite: the host refuses subnormal caps
    // 32-bit on purpose (64-bit costs 18 registers at hdim 128): with seqlens <= 2^30 (the
    // engine's limit) |row + diag - col| <= 2^30 + 127 for every row and key of a tile, padding
    // included, and so is every partial sum.
    const int diag = p.seqlen_k - p.seqlen_q;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float v = s[mt][nt][i] * p.softmax_scale;
                if (softcap) v = p.softcap * tanhf(v * inv_cap);
                const int row = row0 + mt * 16 + acc_row(lane, i);
                const int col = col0 + nt * 8 + acc_col(lane, i);
                // slope is 0 without ALiBi, so softcap-only adds a zero bias.
                v -= slope * static_cast<float>(abs(row + diag - col));
                s[mt][nt][i] = v;
            }
}

// Visible keys of query `row`, [lo, hi] inclusive (lo > hi when none), from the one mask rule of
// mask.cuh (64-bit positions, clamped to the sequence).
struct KeyRange {
    int lo, hi;
};
__device__ __forceinline__ KeyRange key_range(const FwdParams& p, int row) {
    return KeyRange{fa_key_lo(p, row), fa_key_hi(p, row) - 1};
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

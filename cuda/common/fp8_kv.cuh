// The FP8 (e4m3) KV cache of a serving launch (FA_FLAG_KV_FP8, docs/serving.md "FP8 KV cache"):
// a code c with scale s stands for e4m3(c) * s, the scale one per tensor (k/v_cache_scale[0]) or,
// with FA_FLAG_KV_SCALE_PER_TOKEN, one per (slot, kv head), laid out as the cache without head
// dim: [kv_batches, kv_rows, heads_kv]. The same values as the CPU path (src/serving/fp8_cache.rs):
// reading puts the codes' values in the MMA's dtype (exact) and applies the scales in f32, K's to
// the scores and V's to P, per key; the append quantises a row as the code of x / scale (satfinite, round to nearest even, NaN kept),
// per (token, head) with the scale amax / 448 over the row's finite values (1 for none).
#pragma once
#include <math.h>
#include <stdint.h>

#include "common/params.h"
#include "common/seqlen.cuh"
#include "common/dtype.cuh"
#include "common/fp8.cuh"
#include "sm80/shared.cuh"

FA_SEQ_FN bool fa_kv_fp8(const FwdParams& p) { return (p.flags & FA_FLAG_KV_FP8) != 0u; }

// Where the scale of key row j (kv head hk) of sequence s lies in k/v_cache_scale: index 0 with a
// per-tensor scale, else the row's (slot, kv head) in [kv_batches, kv_rows, heads_kv] (the cache
// without head dim: fa_kv_row_offset with strides of heads_kv per slot). Only for j < s.sk.
FA_SEQ_FN int64_t fa_kv_scale_index(const FwdParams& p, const FaSeq& s, int j, int hk) {
    if ((p.flags & FA_FLAG_KV_SCALE_PER_TOKEN) == 0u) return 0;
    const int64_t row_stride = p.heads_kv;
    return fa_kv_row_offset(p, s, row_stride * p.kv_rows, row_stride, j) + hk;
}

// Eight codes (one 8-byte word, code 0 in the low byte) as eight Elem values, in the order of the
// codes: one 16-byte shared-memory chunk of a K or V tile. Exact: f16 and bf16 hold every e4m3
// value (the scale is applied in f32 to the scores, fa_scale_key_columns).
template <typename Elem>
__device__ __forceinline__ uint4 fa_e4m3x8(uint64_t codes) {
    uint32_t out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[i] = fa_pack2<Elem>(fa_e4m3_decode(static_cast<uint8_t>(codes >> (16 * i))),
                                fa_e4m3_decode(static_cast<uint8_t>(codes >> (16 * i + 8))));
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}

// Multiplies column j (key j of the tile) of one thread's score or P fragment (the layouts of
// softmax.cuh: Frag::s, f.col) by that key's scale, the f32 in shared memory at `scales + j *
// stride` (bytes; another thread stored it, so it is loaded through sm80/shared.cuh):
// with K's scales right after Q K^T, S is q·(e4m3(c)·s) in f32; with V's after the softmax,
// P·diag(s) · e4m3(V) is P V (the row sums already hold P itself).
template <class Frag, class S>
__device__ __forceinline__ void fa_scale_key_columns(S& s, const Frag& f, const unsigned char* scales, int stride) {
#pragma unroll
    for (int j = 0; j < Frag::kSCols; ++j) {
        const float sc = fa_ld_shared_f32(static_cast<uint32_t>(__cvta_generic_to_shared(scales + f.col(j) * stride)));
#pragma unroll
        for (int r = 0; r < Frag::kRows; ++r) Frag::s(s, r, j) *= sc;
    }
}

// The append of one new row into an FP8 cache: `n` elements of `src` as codes into `dst` and, per
// (token, head), the row's scale into *scale_slot (per tensor: the scale is read from it). Every
// thread of the CTA reduces the row's amax itself (no shared memory, no barrier; a row is at most
// 512 elements), so every thread agrees on the scale; thread 0 stores it.
template <typename Elem>
__device__ __forceinline__ void fa_append_row_fp8(const FwdParams& p, uint8_t* dst, const Elem* src, int n,
                                                  float* scale_slot) {
    float scale;
    if ((p.flags & FA_FLAG_KV_SCALE_PER_TOKEN) != 0u) {
        // The largest finite magnitude (NaN fails the comparison, infinity is left out).
        float amax = 0.f;
        for (int c = 0; c < n; ++c) {
            const float a = fabsf(fa_to_float(src[c]));
            if (a > amax && a != INFINITY) amax = a;
        }
        scale = fa_block_scale(amax);
        if (threadIdx.x == 0) *scale_slot = scale;
    } else {
        scale = *scale_slot;
    }
    for (int c = threadIdx.x; c < n; c += blockDim.x) dst[c] = fa_quantize_e4m3(fa_to_float(src[c]), scale);
}

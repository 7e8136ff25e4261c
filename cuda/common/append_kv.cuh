// The KV append of a serving call (docs/serving.md "KV append"): row i of knew/vnew[b] goes to
// key position seqused_k[b] + i of sequence b's cache, dense or paged (through the block table:
// cuda/common/seqlen.cuh fa_kv_row_offset; a dense cache's row cache_batch_idx[b]), for every kv
// head. One small kernel for every family: it runs before the attention launch on the same
// stream, so all writes land before any read and the attention (seqlen_new set, sk_b =
// seqused_k[b] + seqlen_new) attends the new keys in the same call.
//
// Rotary (rotary_dim > 0, FlashAttention's rotary_cos / rotary_sin): k's row i is rotated to
// cache position seqused_k[b] + i before it is written (leftpad counts: positions are cache
// rows from 0), and the same launch writes q rotated into o, a q-shaped scratch the attention
// then reads as its q: row i at seqused_k[b] + i with FA_FLAG_ROTARY_Q_ADVANCE (the host sets it
// under a causal or local mask, FlashAttention's rule), else every row at seqused_k[b]. The
// first rotary_dim features turn in pairs, (2t, 2t + 1) with FA_FLAG_ROTARY_INTERLEAVED, else
// (t, t + rotary_dim / 2), by the angle of cos/sin[pos][t], in f32 rounded once to the dtype
// (src/serving/rotary.rs is the same arithmetic); the rest and v are copied. Each thread writes
// one element from the two it reads in the source row, which is never the destination.
//
// Launch contract: grid (max(seqlen_new, seqlen_q with rotary), heads_kv + heads_q with rotary,
// batch), block kFaAppendThreads, no shared memory; FwdParams from FwdParams::for_serving (k, v:
// the cache; knew, vnew and their strides; seqused_k; block_table / page_size when paged;
// cache_batch_idx; the rotary fields, with o the rotated q's scratch). Element by element, so any
// head_dim and any alignment (coalesced: consecutive threads copy consecutive elements of one
// row). The host has validated the layout (slots in range, no two sequences appending to one
// slot, tables covering every position). K rows are head_dim wide, V rows head_dim_v (0:
// head_dim).
//
// With FA_FLAG_KV_FP8 the cache holds e4m3 codes (k/v strides in codes) and the rows are
// quantised as the CPU append quantises them, bit for bit (common/fp8_kv.cuh
// fa_append_row_fp8); the host refuses a rotary into an FP8 cache on the GPU.
#pragma once
#include <stdint.h>

#include "common/dtype.cuh"
#include "common/params.h"
#include "common/seqlen.cuh"
#include "common/fp8_kv.cuh"

constexpr int kFaAppendThreads = 128;

// Feature c of `row` (a head's row in the source) rotated to table row `pos`: the pair (a, b)
// holding c turns by cos/sin[pos][t] (a' = a cos - b sin, b' = a sin + b cos); features past
// rotary_dim pass through.
template <typename Elem>
__device__ __forceinline__ Elem fa_rotary_elem(const FwdParams& p, const Elem* row, int c, int pos) {
    if (c >= p.rotary_dim) return row[c];
    const int half = p.rotary_dim / 2;
    const bool inter = (p.flags & FA_FLAG_ROTARY_INTERLEAVED) != 0u;
    const int t = inter ? c / 2 : (c < half ? c : c - half);
    const bool first = inter ? (c % 2 == 0) : c < half;
    const int a = inter ? 2 * t : t, b = inter ? 2 * t + 1 : t + half;
    const int64_t at = static_cast<int64_t>(pos) * half + t;
    const float cs = reinterpret_cast<const float*>(p.rotary_cos)[at];
    const float sn = reinterpret_cast<const float*>(p.rotary_sin)[at];
    const float x0 = fa_to_float(row[a]), x1 = fa_to_float(row[b]);
    return fa_from_float<Elem>(first ? x0 * cs - x1 * sn : x0 * sn + x1 * cs);
}

template <typename Elem>
__device__ __forceinline__ void fa_append_kv(const FwdParams& p) {
    const int i = blockIdx.x, b = blockIdx.z;
    const FaSeq seq = fa_seq(p, b);
    const int cached = reinterpret_cast<const int32_t*>(p.seqused_k)[b];  // cache positions from 0
    if (static_cast<int>(blockIdx.y) >= p.heads_kv) {
        // q's row i of head h, rotated into o (the attention's q).
        const int h = blockIdx.y - p.heads_kv;
        if (i >= seq.sq) return;
        const int pos = cached + ((p.flags & FA_FLAG_ROTARY_Q_ADVANCE) != 0u ? i : 0);
        const Elem* q = reinterpret_cast<const Elem*>(p.q) + fa_q_offset(p, seq, h, i);
        Elem* o = reinterpret_cast<Elem*>(p.o) + fa_o_offset(p, seq, h, i);
        for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) o[c] = fa_rotary_elem(p, q, c, pos);
        return;
    }
    if (i >= p.seqlen_new) return;
    const int hk = blockIdx.y;
    const int j = seq.sk - p.seqlen_new + i;  // key j of the sequence: cache position cached + i
    const int64_t k_at = fa_kv_row_offset(p, seq, p.k_batch_stride, p.k_row_stride, j) +
                         static_cast<int64_t>(hk) * p.k_head_stride;
    const int64_t v_at = fa_kv_row_offset(p, seq, p.v_batch_stride, p.v_row_stride, j) +
                         static_cast<int64_t>(hk) * p.v_head_stride;
    const Elem* kn = reinterpret_cast<const Elem*>(p.knew) + static_cast<int64_t>(b) * p.knew_batch_stride +
                     static_cast<int64_t>(i) * p.knew_row_stride + static_cast<int64_t>(hk) * p.knew_head_stride;
    const Elem* vn = reinterpret_cast<const Elem*>(p.vnew) + static_cast<int64_t>(b) * p.vnew_batch_stride +
                     static_cast<int64_t>(i) * p.vnew_row_stride + static_cast<int64_t>(hk) * p.vnew_head_stride;
    const int head_dim_v = p.head_dim_v > 0 ? p.head_dim_v : p.head_dim;  // 0: V's is Q/K's
    if (fa_kv_fp8(p)) {
        // An FP8 cache: the rows' codes and, per (token, head), their scales (common/fp8_kv.cuh).
        const int64_t s = fa_kv_scale_index(p, seq, j, hk);
        fa_append_row_fp8(p, reinterpret_cast<uint8_t*>(p.k) + k_at, kn, p.head_dim,
                          reinterpret_cast<float*>(p.k_cache_scale) + s);
        fa_append_row_fp8(p, reinterpret_cast<uint8_t*>(p.v) + v_at, vn, head_dim_v,
                          reinterpret_cast<float*>(p.v_cache_scale) + s);
        return;
    }
    Elem* k = reinterpret_cast<Elem*>(p.k) + k_at;
    Elem* v = reinterpret_cast<Elem*>(p.v) + v_at;
    for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x)
        k[c] = p.rotary_dim > 0 ? fa_rotary_elem(p, kn, c, cached + i) : kn[c];
    for (int c = threadIdx.x; c < head_dim_v; c += blockDim.x) v[c] = vn[c];
}

// One instance: extern "C" NAME(FwdParams), the symbol build/instances.rs `append_kv_symbol` gives.
#define FA_APPEND_KV_KERNEL(NAME, ELEM)                                                         \
    extern "C" __global__ void __launch_bounds__(kFaAppendThreads, 1)                          \
        NAME(const __grid_constant__ FwdParams p) {                                             \
        fa_append_kv<ELEM>(p);                                                                  \
    }

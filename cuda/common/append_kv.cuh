// The KV append of a serving call (docs/serving.md "KV append"): row i of knew/vnew[b] goes to
// key position seqused_k[b] + i of sequence b's cache, dense or paged (through the block table:
// cuda/common/seqlen.cuh fa_kv_row_offset), for every kv head. One small kernel for every family:
// it runs before the attention launch on the same stream, so all writes land before any read
// and the attention (seqlen_new set, sk_b = seqused_k[b] + seqlen_new) attends the new keys in
// the same call. Rotary embedding of the new keys belongs here (at positions seqused_k[b] + i).
//
// Launch contract: grid (seqlen_new, heads_kv, batch), block kFaAppendThreads, no shared memory;
// FwdParams from FwdParams::for_serving (k, v: the cache; knew, vnew and their strides;
// seqused_k; block_table / page_size when paged). Element by element, so any head_dim and any
// alignment (coalesced: consecutive threads copy consecutive elements of one row). The host has
// validated the layout (slots in range, no two sequences appending to one slot). With
// FA_FLAG_KV_FP8 the cache holds e4m3 codes (k/v strides in codes) and the rows are quantised as
// the CPU append quantises them, bit for bit (common/fp8_kv.cuh fa_append_row_fp8).
#pragma once
#include <stdint.h>

#include "common/params.h"
#include "common/seqlen.cuh"
#include "common/fp8_kv.cuh"

constexpr int kFaAppendThreads = 128;

template <typename Elem>
__device__ __forceinline__ void fa_append_kv(const FwdParams& p) {
    const int i = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const FaSeq seq = fa_seq(p, b);
    const int j = seq.sk - p.seqlen_new + i;  // seqused_k[b] + i
    const int64_t k_at = fa_kv_row_offset(p, seq, p.k_batch_stride, p.k_row_stride, j) +
                         static_cast<int64_t>(hk) * p.k_head_stride;
    const int64_t v_at = fa_kv_row_offset(p, seq, p.v_batch_stride, p.v_row_stride, j) +
                         static_cast<int64_t>(hk) * p.v_head_stride;
    const Elem* kn = reinterpret_cast<const Elem*>(p.knew) + static_cast<int64_t>(b) * p.knew_batch_stride +
                     static_cast<int64_t>(i) * p.knew_row_stride + static_cast<int64_t>(hk) * p.knew_head_stride;
    const Elem* vn = reinterpret_cast<const Elem*>(p.vnew) + static_cast<int64_t>(b) * p.vnew_batch_stride +
                     static_cast<int64_t>(i) * p.vnew_row_stride + static_cast<int64_t>(hk) * p.vnew_head_stride;
    if (fa_kv_fp8(p)) {
        // An FP8 cache: the rows' codes and, per (token, head), their scales (common/fp8_kv.cuh).
        const int64_t s = fa_kv_scale_index(p, seq, j, hk);
        fa_append_row_fp8(p, reinterpret_cast<uint8_t*>(p.k) + k_at, kn, p.head_dim,
                          reinterpret_cast<float*>(p.k_cache_scale) + s);
        fa_append_row_fp8(p, reinterpret_cast<uint8_t*>(p.v) + v_at, vn, p.head_dim,
                          reinterpret_cast<float*>(p.v_cache_scale) + s);
        return;
    }
    Elem* k = reinterpret_cast<Elem*>(p.k) + k_at;
    Elem* v = reinterpret_cast<Elem*>(p.v) + v_at;
    for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) {
        k[c] = kn[c];
        v[c] = vn[c];
    }
}

// One instance: extern "C" NAME(FwdParams), the symbol build/instances.rs `append_kv_symbol` gives.
#define FA_APPEND_KV_KERNEL(NAME, ELEM)                                                         \
    extern "C" __global__ void __launch_bounds__(kFaAppendThreads, 1)                          \
        NAME(const __grid_constant__ FwdParams p) {                                             \
        fa_append_kv<ELEM>(p);                                                                  \
    }

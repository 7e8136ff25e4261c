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
// validated the layout (slots in range, no two sequences appending to one slot). K rows are
// head_dim wide, V rows head_dim_v (0: head_dim).
#pragma once
#include <stdint.h>

#include "common/params.h"
#include "common/seqlen.cuh"

constexpr int kFaAppendThreads = 128;

template <typename Elem>
__device__ __forceinline__ void fa_append_kv(const FwdParams& p) {
    const int i = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const FaSeq seq = fa_seq(p, b);
    const int j = seq.sk - p.seqlen_new + i;  // seqused_k[b] + i
    Elem* k = reinterpret_cast<Elem*>(p.k) + fa_kv_row_offset(p, seq, p.k_batch_stride, p.k_row_stride, j) +
              static_cast<int64_t>(hk) * p.k_head_stride;
    Elem* v = reinterpret_cast<Elem*>(p.v) + fa_kv_row_offset(p, seq, p.v_batch_stride, p.v_row_stride, j) +
              static_cast<int64_t>(hk) * p.v_head_stride;
    const Elem* kn = reinterpret_cast<const Elem*>(p.knew) + static_cast<int64_t>(b) * p.knew_batch_stride +
                     static_cast<int64_t>(i) * p.knew_row_stride + static_cast<int64_t>(hk) * p.knew_head_stride;
    const Elem* vn = reinterpret_cast<const Elem*>(p.vnew) + static_cast<int64_t>(b) * p.vnew_batch_stride +
                     static_cast<int64_t>(i) * p.vnew_row_stride + static_cast<int64_t>(hk) * p.vnew_head_stride;
    const int head_dim_v = p.head_dim_v > 0 ? p.head_dim_v : p.head_dim;  // 0: V's is Q/K's
    for (int c = threadIdx.x; c < p.head_dim; c += blockDim.x) k[c] = kn[c];
    for (int c = threadIdx.x; c < head_dim_v; c += blockDim.x) v[c] = vn[c];
}

// One instance: extern "C" NAME(FwdParams), the symbol build/instances.rs `append_kv_symbol` gives.
#define FA_APPEND_KV_KERNEL(NAME, ELEM)                                                         \
    extern "C" __global__ void __launch_bounds__(kFaAppendThreads, 1)                          \
        NAME(const __grid_constant__ FwdParams p) {                                             \
        fa_append_kv<ELEM>(p);                                                                  \
    }

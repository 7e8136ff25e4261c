// Which keys a query row sees (FlashAttention's bottom-right aligned causal/window mask), as
// src/problem.rs `visible` / `key_range`: key j is visible to query i iff
//   i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right,
// an unbounded side (-1) being ignored. Causal is window_right = 0.
#pragma once
#include "fa_params.h"

struct FaMask {
    int seqlen_q, seqlen_k;
    int left, right;  // -1 = unbounded
    int diag_offset;  // seqlen_k - seqlen_q: the key position of query 0's diagonal

    __device__ __forceinline__ explicit FaMask(const FwdParams& p)
        : seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k), left(p.window_left), right(p.window_right),
          diag_offset(p.seqlen_k - p.seqlen_q) {}

    // Whether (i, j) is inside both sequences and the window.
    __device__ __forceinline__ bool visible(int i, int j) const {
        if (i >= seqlen_q || j >= seqlen_k) return false;
        const int rel = j - (i + diag_offset);
        return (left < 0 || rel >= -left) && (right < 0 || rel <= right);
    }

    // First key any of the rows [row_begin, row_end) sees (clamped to [0, seqlen_k]).
    __device__ __forceinline__ int key_begin(int row_begin) const {
        if (left < 0) return 0;
        const long long lo = (long long)row_begin + diag_offset - left;
        return (int)max(0LL, min(lo, (long long)seqlen_k));
    }

    // One past the last key any of the rows [row_begin, row_end) sees (clamped to [0, seqlen_k]).
    __device__ __forceinline__ int key_end(int row_end) const {
        if (right < 0) return seqlen_k;
        const long long hi = (long long)(row_end - 1) + diag_offset + right + 1;
        return (int)max(0LL, min(hi, (long long)seqlen_k));
    }
};

// Which keys a query row sees: FlashAttention's bottom-right aligned causal/window mask, the one
// rule of every kernel (FA1, FA2, FA3) and of src/problem.rs `key_range`. Query i sees key j iff
//   i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right
// and 0 <= j < seqlen_k; a negative bound is unbounded (-1 by convention). Causal is
// window_right = 0.
//
// The sums of a row, the diagonal offset and a bound are formed in 64 bits (only the one add that
// can overflow: the other terms are differences of non-negative ints) and clamped to
// [0, seqlen_k] before they come back as int, so nothing overflows whatever int32 values the
// params hold (the host also clamps bounds to the sequence, src/problem.rs; this header does not
// rely on it). Kernels then compare 32-bit key indices against the clamped bounds. Rows are >= 0.
// (Written for register pressure too: FA3 stages 4-5 at head_dim 256 sit at their 168-register
// budget, and a fully 64-bit form spilled there.)
//
// Every function takes the dimensions as any `P` with window_left, window_right, seqlen_q and
// seqlen_k: FwdParams itself on a dense launch, or the FaMaskDims of one sequence
// (cuda/common/seqlen.cuh fa_seq_mask: that sequence's sq_b and sk_b, so each sequence of a
// varlen / cache batch is aligned bottom-right on its own).
//
// Plain C++ apart from the qualifiers, so the host emulations and cuda/test/fa3_layout_sim.cpp
// compile it unchanged.
#pragma once
#include <math.h>

#include "common/params.h"

#define FA_MASK_FN __host__ __device__ __forceinline__ constexpr

// The mask's view of one sequence: the window of FwdParams and the sequence's own lengths.
struct FaMaskDims {
    int32_t window_left, window_right, seqlen_q, seqlen_k;
};

FA_MASK_FN long long fa_clamp_keys(long long x, long long seqlen_k) {
    return x < 0 ? 0 : (x > seqlen_k ? seqlen_k : x);
}

// First key query row i (>= 0) sees, in [0, seqlen_k].
template <class P>
FA_MASK_FN int fa_key_lo(const P& p, int i) {
    if (p.window_left < 0) return 0;
    // i - left and seqlen_k - seqlen_q are differences of non-negative ints: they fit; only their
    // sum needs 64 bits.
    const long long lo = (long long)(i - p.window_left) + (p.seqlen_k - p.seqlen_q);
    return lo < 0 ? 0 : (lo > p.seqlen_k ? p.seqlen_k : (int)lo);
}

// One past the last key query row i (>= 0) sees, in [0, seqlen_k] (no key when hi <= lo).
template <class P>
FA_MASK_FN int fa_key_hi(const P& p, int i) {
    if (p.window_right < 0) return p.seqlen_k;
    // seqlen_k - seqlen_q + 1 <= seqlen_k fits (seqlen_q >= 1); i + right needs 64 bits.
    const long long hi = (long long)i + p.window_right + (p.seqlen_k - p.seqlen_q + 1);
    return hi < 0 ? 0 : (hi > p.seqlen_k ? p.seqlen_k : (int)hi);
}

// Whether query row i sees key j.
template <class P>
FA_MASK_FN bool fa_key_visible(const P& p, int i, long long j) {
    return j >= fa_key_lo(p, i) && j < fa_key_hi(p, i);
}

// The tiles of block_n keys that query rows [row_begin, row_end) can see: [n_begin, n_end), every
// tile holding at least one visible key of some row (n_end == n_begin when none). Both bounds
// are monotone in the row, so the first and last rows decide.
struct FaKeyTiles {
    int n_begin, n_end;
};
template <class P>
FA_MASK_FN FaKeyTiles fa_key_tiles(const P& p, int row_begin, int row_end, int block_n) {
    const int lo = fa_key_lo(p, row_begin), hi = fa_key_hi(p, row_end - 1);
    const int n_begin = lo / block_n;
    return FaKeyTiles{n_begin, hi <= lo ? n_begin : (int)(((long long)hi + block_n - 1) / block_n)};
}

// Whether some (row, key) of rows [row_first, row_last] x keys [key_first, key_last] is hidden
// (false: every pair is visible and the per-element mask may be skipped). Keys at or past
// seqlen_k count as hidden.
template <class P>
FA_MASK_FN bool fa_tile_needs_mask(const P& p, int row_first, int row_last,
                                   long long key_first, long long key_last) {
    return key_first < fa_key_lo(p, row_last) || key_last >= fa_key_hi(p, row_first);
}

// Sets the scores of keys their row does not see to -inf, over one thread's fragment of a tile
// (the layouts of softmax.cuh: Frag::s, f.row, f.col); row0 / col0: the query row and the key of
// the tile's origin. Kernels call it only on tiles where fa_tile_needs_mask says some pair is
// hidden.
template <class Frag, class S, class P>
__host__ __device__ __forceinline__ void fa_mask_fragment(S& s, const Frag& f, const P& p, int row0,
                                                          int col0) {
#pragma unroll
    for (int r = 0; r < Frag::kRows; ++r) {
        const int i = row0 + f.row(r);
        const int lo = fa_key_lo(p, i), hi = fa_key_hi(p, i);  // visible keys [lo, hi)
#pragma unroll
        for (int j = 0; j < Frag::kSCols; ++j) {
            const int key = col0 + f.col(j);
            if (key < lo || key >= hi) Frag::s(s, r, j) = -INFINITY;
        }
    }
}

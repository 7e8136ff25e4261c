// The online-softmax steps of the forward pass, on scores already in log2 units
// (s * log2(e)), so every exponential is one exp2. Mirrors the verbs of src/cpu/softmax.rs:
// max_get_scale (here fa_softmax_rescale: new running max and the factor that rescales the old
// sum and output), then finalize (fa_softmax_finalize: 1 / sum and the natural-log LSE).
// Eager rescaling and MUFU exp2 only; the lazy/polynomial variants live in online_softmax.cuh.
#pragma once
#include <math.h>

// log2(e): natural-unit scores times it are log2-unit scores (src/problem.rs LOG2E).
#define FA_LOG2E 1.44269504088896340736f
// ln(2): turns the log2-domain LSE back into natural log.
#define FA_LN2 0.693147180559945309417f

// New running max `m_new` from the old max and this tile's row max, and the factor
// exp2(m_old - m_ref) the old sum and output are multiplied by. `m_ref` is what exponents are
// taken against: the max itself, or 0 while the row has seen only -inf (every key masked), so
// exp2(-inf - m_ref) = 0 instead of exp2(-inf + inf) = NaN (the -inf guard).
__device__ __forceinline__ float fa_softmax_rescale(float m_old, float tile_max, float& m_new, float& m_ref) {
    m_new = fmaxf(m_old, tile_max);
    m_ref = (m_new == -INFINITY) ? 0.f : m_new;
    return exp2f(m_old - m_ref);  // m_old = -inf gives 0: nothing to rescale yet
}

// The end of a row: output multiplier 1/l and LSE (natural log). A row that saw no key (l = 0)
// gets output 0 and LSE -inf, FlashAttention's convention.
__device__ __forceinline__ void fa_softmax_finalize(float m, float l, float& inv_l, float& lse) {
    if (l > 0.f) {
        inv_l = 1.f / l;
        lse = (m + log2f(l)) * FA_LN2;
    } else {
        inv_l = 0.f;
        lse = -INFINITY;
    }
}

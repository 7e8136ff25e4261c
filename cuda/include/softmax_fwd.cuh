// The online-softmax steps of the forward pass (FA1), mirroring the verbs of src/cpu/softmax.rs:
// max_get_scale (here fa_softmax_rescale: new running max and the factor that rescales the old
// sum and output), then finalize (fa_softmax_finalize: 1 / sum and the natural-log LSE).
// Eager rescaling and MUFU exp2 only; the lazy/polynomial variants live in online_softmax.cuh.
//
// Units, as on the CPU (src/cpu/softmax.rs, "Units"): scores x and the running max m are in
// score units (raw q.k, or natural units when softcap or ALiBi is on); every exponent is
// (x - m) * c with c = FwdParams::softmax_scale_log2 (scale * log2 e for raw scores, log2 e for
// natural ones), and u converts score units to natural units for the LSE (scale, or 1). Never
// m * c alone: rounded to f32 next to an exact x * c it is off by up to ±128 in the exponent once
// |m * c| >= 2^31, and x * c overflows above f32::MAX / log2 e.
#pragma once
#include <math.h>

#include "fa_numerics_common.cuh"  // FA_LN2: log2 of the sum -> natural log for the LSE

// New running max `m_new` from the old max and this tile's row max, and the factor
// exp2((m_old - m_ref) * c) the old sum and output are multiplied by. `m_ref` is what exponents
// are taken against: the max itself, or 0 while the row has seen only -inf (every key masked), so
// exp2((-inf - m_ref) * c) = 0 instead of exp2(-inf + inf) = NaN (the -inf guard).
__device__ __forceinline__ float fa_softmax_rescale(float m_old, float tile_max, float c, float& m_new,
                                                    float& m_ref) {
    m_new = fmaxf(m_old, tile_max);
    m_ref = (m_new == -INFINITY) ? 0.f : m_new;
    return exp2f((m_old - m_ref) * c);  // m_old = -inf gives 0: nothing to rescale yet
}

// The probability of score x against m_ref: exp2((x - m_ref) * c), at most 1 (x <= m_ref).
__device__ __forceinline__ float fa_softmax_p(float x, float m_ref, float c) { return exp2f((x - m_ref) * c); }

// The end of a row: output multiplier 1/l and LSE (natural log), u converting the max to natural
// units. A row that saw no key (l = 0) gets output 0 and LSE -inf, FlashAttention's convention;
// the caller writes that 0 itself rather than O * 0 (NaN if a masked key's infinite V reached
// O). A NaN sum (a NaN score the row sees) stays NaN.
__device__ __forceinline__ void fa_softmax_finalize(float m, float l, float u, float& inv_l, float& lse) {
    if (l == 0.f) {
        inv_l = 0.f;
        lse = -INFINITY;
    } else {
        inv_l = 1.f / l;
        lse = m * u + log2f(l) * FA_LN2;
    }
}

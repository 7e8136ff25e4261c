// The running-max update of the online softmax with FlashAttention-4's lazy rescale, the same rule
// as max_get_scale in src/cpu/softmax.rs (proof of exactness and of no overflow there).
// Scores and the running max are in score units (raw q.k, or natural units); c converts score
// units to log2 units and is applied to differences only, never to a max on its own (see
// src/cpu/softmax.rs, "Units"). tau < 0 means eager rescaling.
#pragma once

#include "exp2_poly.cuh"
#include "fp8.cuh"

// FA_LAZY_THRESHOLD_MAX, the largest lazy threshold accepted, is generated from
// src/numerics/mod.rs LAZY_THRESHOLD_MAX (fa_numerics_constants.h).

// Whether a tile may keep the stale running max: growth = (tile_max - m) * c, the growth of the
// max in log2 units, is at most tau.
FA_HD bool fa_lazy_keeps_max(float growth, float tau) { return growth <= tau; }

// With P in e4m3 offset by 2^8, tau + 8 must stay below log2(448) or P saturates while the f32
// row sum still counts it (FlashAttention issues #2131, #2716).
// Written as fp8_lazy_limit() in src/numerics/mod.rs (log2(448) - 8, then compare) so the two
// agree at the boundary too.
FA_HD bool fa_fp8_lazy_threshold_ok(float tau) { return tau < log2f(FA_E4M3_MAX) - FA_FP8_P_SCALE_LOG2; }

// Folds a tile's max into the running max *m and returns the factor for O and l (1 when
// nothing changes). exp2 is the degree-D polynomial here; a kernel may use exp2f (MUFU).
template <int D> FA_HD float fa_max_get_scale(float* m, float tile_max, float c, float tau) {
    if (!(tile_max > *m)) return 1.0f;  // no growth, or NaN
    if (*m == -INFINITY) {              // first visible key: nothing to rescale
        *m = tile_max;
        return 1.0f;
    }
    const float growth = (tile_max - *m) * c;  // > 0, possibly +inf (then the factor is 0)
    if (tau >= 0.0f && fa_lazy_keeps_max(growth, tau)) return 1.0f;
    float scale = fa_exp2_poly<D>(-growth);
    *m = tile_max;
    return scale;
}

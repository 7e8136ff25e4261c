// FP8 (e4m3) conversion and block quantisation, the same steps as src/numerics/fp8.rs and
// src/numerics/quant.rs. Conversions go through cuda_fp8.h with satfinite and round to nearest
// even (F2FP.SATFINITE.E4M3.F32 on sm_89+); the Rust side uses float8 0.7, which matches CUDA
// 13.0 bit for bit except for the NaN encoding (compare NaN-ness, not bits).
#pragma once

#include <cuda_fp8.h>
#include "common/numerics.cuh"

// FA_E4M3_MAX and FA_FP8_P_SCALE_LOG2 (P is multiplied by 2^that before its e4m3 cast, FA3's
// Max_offset = 8) come from the generated fa_numerics_constants.h.

FA_HD uint8_t fa_e4m3_encode(float x) {
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

FA_HD float fa_e4m3_decode(uint8_t code) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3);
    return __half2float(__half(h));
}

// x rounded to the nearest e4m3 value, back in f32 (what P becomes before the PV product).
FA_HD float fa_e4m3_round(float x) { return fa_e4m3_decode(fa_e4m3_encode(x)); }

// The scale of a block whose largest finite magnitude is amax: amax / 448, or 1 when that is not
// a positive finite number (all-zero block, amax / 448 underflowing to 0, non-finite amax), so
// x / scale never divides by 0 or infinity (src/numerics/quant.rs block_scale).
FA_HD float fa_block_scale(float amax) {
    const float s = fa_div_rn(amax, FA_E4M3_MAX);
    return (s > 0.0f && amax <= 3.40282347e38f) ? s : 1.0f;
}

// The e4m3 code of x in a block with this scale (the descale multiplies the accumulator later).
FA_HD uint8_t fa_quantize_e4m3(float x, float scale) { return fa_e4m3_encode(fa_div_rn(x, scale)); }

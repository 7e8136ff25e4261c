// Software exp2 (FlashAttention-4's emulation on the FMA units). The same constants and steps
// as src/numerics/exp2.rs; tests/numerics_cuda_parity.rs checks that the two agree bit for bit.
//
// 2^x = 2^floor(x) * 2^f, f = x - floor(x) in [0, 1):
// 1. clamp x below at -127 (NaN passes through: the comparison is false);
// 2. floor(x): on the device, x + (2^23 + 2^22) rounded DOWN (add.rm) leaves floor(x) in the
//    low mantissa bits, read back as an integer; on the host floorf (the same value);
// 3. 2^f by a minimax polynomial in Horner form with explicit FMAs (Rust uses mul_add);
// 4. floor(x) << 23 added to the bits of 2^f (a multiply by 2^floor(x) through the exponent).
//
// Coefficients: FlashAttention-4, flash_attn/cute/utils.py POLY_EX2, from Sollya
// fpminimax(exp(x * log(2.0)), d, [|1,24...|], [0;1], relative), constant term fixed to 1.
#pragma once

#include <math.h>
#include "fa_numerics_common.cuh"

#define FA_EXP2_CLAMP_LOW (-127.0f)
// 2^23 + 2^22: in [2^23, 2^24) the f32 spacing is 1, so a round-down add keeps floor(x).
#define FA_EXP2_ROUND_MAGIC 12582912.0f

template <int D> FA_HD float fa_exp2_frac(float f);

template <> FA_HD float fa_exp2_frac<2>(float f) {
    float acc = 0.330107033252716064453125f;
    acc = fmaf(acc, f, 0.6657850742340087890625f);
    return fmaf(acc, f, 1.0f);
}

template <> FA_HD float fa_exp2_frac<3>(float f) {
    float acc = 0.077119089663028717041015625f;
    acc = fmaf(acc, f, 0.227564394474029541015625f);
    acc = fmaf(acc, f, 0.695146143436431884765625f);
    return fmaf(acc, f, 1.0f);
}

template <> FA_HD float fa_exp2_frac<4>(float f) {
    float acc = 1.3434938155114650726318359375e-2f;
    acc = fmaf(acc, f, 5.2225358784198760986328125e-2f);
    acc = fmaf(acc, f, 0.2412912547588348388671875f);
    acc = fmaf(acc, f, 0.693042695522308349609375f);
    return fmaf(acc, f, 1.0f);
}

template <> FA_HD float fa_exp2_frac<5>(float f) {
    float acc = 1.86810153536498546600341796875e-3f;
    acc = fmaf(acc, f, 9.01452265679836273193359375e-3f);
    acc = fmaf(acc, f, 5.5802188813686370849609375e-2f);
    acc = fmaf(acc, f, 0.24016360938549041748046875f);
    acc = fmaf(acc, f, 0.693151414394378662109375f);
    return fmaf(acc, f, 1.0f);
}

// Software exp2 with a degree-D polynomial (D in 2..5).
template <int D> FA_HD float fa_exp2_poly(float x) {
    x = x < FA_EXP2_CLAMP_LOW ? FA_EXP2_CLAMP_LOW : x;
#ifdef __CUDA_ARCH__
    float t = __fadd_rd(x, FA_EXP2_ROUND_MAGIC);
    float n = t - FA_EXP2_ROUND_MAGIC;  // exact
    int ni = (int)(fa_f2u(t) - fa_f2u(FA_EXP2_ROUND_MAGIC));
#else
    float n = floorf(x);
    int ni = (n == n) ? (int)n : 0;  // NaN: Rust's `as i32` gives 0 too
#endif
    float f = x - n;
    float p = fa_exp2_frac<D>(f);
    return fa_u2f(fa_f2u(p) + ((uint32_t)ni << 23));
}

// Runtime degree (2..5; anything else uses 5), as exp2_poly_deg in Rust.
FA_HD float fa_exp2_poly_deg(float x, int degree) {
    switch (degree) {
        case 2: return fa_exp2_poly<2>(x);
        case 3: return fa_exp2_poly<3>(x);
        case 4: return fa_exp2_poly<4>(x);
        default: return fa_exp2_poly<5>(x);
    }
}

// Software exp2 (FlashAttention-4's emulation on the FMA units). The same steps as
// src/numerics/exp2.rs, with its constants (clamp, coefficients) from the header build.rs
// generates from it; tests/toolchain/numerics_cuda_parity.rs checks that the two agree bit for bit.
//
// 2^x = 2^floor(x) * 2^f, f = x - floor(x) in [0, 1):
// 1. clamp x below at -127 (NaN passes through: the comparison is false);
// 2. floor(x): on the device, x + (2^23 + 2^22) rounded DOWN (add.rm) leaves floor(x) in the
//    low mantissa bits, read back as an integer; on the host floorf (the same value);
// 3. 2^f by a minimax polynomial in Horner form with explicit FMAs (Rust uses mul_add);
// 4. floor(x) << 23 added to the bits of 2^f (a multiply by 2^floor(x) through the exponent).
#pragma once

#include <math.h>
#include "common/numerics.cuh"

// 2^23 + 2^22: in [2^23, 2^24) the f32 spacing is 1, so a round-down add keeps floor(x).
#define FA_EXP2_ROUND_MAGIC 12582912.0f

// 2^f on [0, 1) by the degree-D polynomial of the generated FA_EXP2_POLY_COEFFS_<D> (Horner, explicit
// FMAs, highest coefficient first, as poly_frac in Rust).
template <int D> FA_HD float fa_exp2_frac(float f) {
    static_assert(D >= 2 && D <= FA_EXP2_POLY_MAX_DEGREE, "exp2 polynomial degree: 2..5");
    const float c2[] = {FA_EXP2_POLY_COEFFS_2}, c3[] = {FA_EXP2_POLY_COEFFS_3};
    const float c4[] = {FA_EXP2_POLY_COEFFS_4}, c5[] = {FA_EXP2_POLY_COEFFS_5};
    const float* c = D == 2 ? c2 : D == 3 ? c3 : D == 4 ? c4 : c5;
    float acc = c[D];
#pragma unroll
    for (int i = D - 1; i >= 0; --i) acc = fmaf(acc, f, c[i]);
    return acc;
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

// Small helpers shared by the numerics headers (exp2_poly.cuh, fp8.cuh, hadamard.cuh,
// online_softmax.cuh): the function qualifier and bit casts that work on host and device.
#pragma once

#include <stdint.h>
#include <string.h>

#include <math.h>

// Under nvcc: callable from host and device. Under a plain C++ compiler (the host-only parity
// program of tests/numerics_cuda_parity.rs): ordinary inline functions.
#ifndef FA_HD
#if defined(__CUDACC__)
#define FA_HD __host__ __device__ __forceinline__
#else
#define FA_HD inline
#endif
#endif

FA_HD uint32_t fa_f2u(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
#endif
}

FA_HD float fa_u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
#endif
}

// Correctly rounded division and square root on both sides, even under --use_fast_math (the
// host's IEEE operators are already correctly rounded).
FA_HD float fa_div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

FA_HD float fa_sqrt_rn(float a) {
#ifdef __CUDA_ARCH__
    return __fsqrt_rn(a);
#else
    return sqrtf(a);
#endif
}

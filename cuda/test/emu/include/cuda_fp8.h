// Host stand-in for CUDA's <cuda_fp8.h>, for the CPU emulator (cuda/test/emu): the e4m3 / e5m2
// conversions cuda/common/fp8.cuh uses, bit-exact with CUDA 13.0's (one rounding to nearest
// even, __NV_SATFINITE saturates to the largest finite value, NaN -> 0x7F for e4m3 / 0x7F for
// e5m2 whatever its sign), so the emulator builds with a plain g++ and no CUDA toolkit.
// tests/emulator/fp8.rs checks encode over every f32 bit pattern class against the Rust codec
// (float8, which equals CUDA except for NaN's sign) and every code's decode.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include <cuda_fp16.h>

typedef unsigned char __nv_fp8_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };

struct __half_raw {
    unsigned short x;
    operator __half() const { return __half{x}; }
};

namespace emu_fp8_detail {
// |x| (finite, not NaN) rounded to a float with `mbits` mantissa bits, or to a multiple of
// 2^sub_step_exp (the format's subnormal step) below 2^min_normal_exp; one rounding, ties to even.
inline float round_to(float a, int mbits, int min_normal_exp, int sub_step_exp) {
    if (a >= std::ldexp(1.0f, min_normal_exp)) {
        uint32_t u;
        std::memcpy(&u, &a, 4);
        const int drop = 23 - mbits;
        const uint32_t lsb = (u >> drop) & 1u;
        u = (u + ((1u << (drop - 1)) - 1u) + lsb) & ~((1u << drop) - 1u);
        float r;
        std::memcpy(&r, &u, 4);
        return r;
    }
    // Scaling by a power of two is exact; nearbyint rounds ties to even (default mode).
    return std::ldexp(std::nearbyint(std::ldexp(a, -sub_step_exp)), sub_step_exp);
}
}  // namespace emu_fp8_detail

inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t fmt) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
    if (std::isnan(x)) return 0x7F;
    const float a = std::fabs(x);
    if (fmt == __NV_E4M3) {
        // 1-4-3, bias 7, no infinity, S.1111.111 = NaN; largest finite 448 = S.1111.110.
        // Past 448: saturate (SATFINITE), else NaN for what rounds beyond 448 (e4m3 has no inf).
        if (a >= 448.0f) return sat == __NV_SATFINITE ? (sign | 0x7E) : (a > 464.0f || std::isinf(x) ? 0x7F : (sign | 0x7E));
        // Below 448 the rounded value is at most 448 (the binade's step is 32).
        const float r = emu_fp8_detail::round_to(a, 3, -6, -9);
        if (r < std::ldexp(1.0f, -6)) return sign | static_cast<uint8_t>(std::ldexp(r, 9));
        uint32_t ru;
        std::memcpy(&ru, &r, 4);
        const int e = static_cast<int>((ru >> 23) & 0xFF) - 127 + 7;
        return sign | static_cast<uint8_t>((e << 3) | ((ru >> 20) & 7));
    }
    // e5m2: 1-5-2, bias 15, IEEE-like; largest finite 57344 = S.11110.11.
    if (std::isinf(x) || a > 57344.0f) {
        const float r0 = std::isinf(x) ? INFINITY : emu_fp8_detail::round_to(a, 2, -14, -16);
        if (sat == __NV_SATFINITE) return sign | 0x7B;
        return r0 > 57344.0f ? (sign | 0x7C) : (sign | 0x7B);
    }
    const float r = emu_fp8_detail::round_to(a, 2, -14, -16);
    if (r > 57344.0f) return sat == __NV_SATFINITE ? (sign | 0x7B) : (sign | 0x7C);
    if (r < std::ldexp(1.0f, -14)) return sign | static_cast<uint8_t>(std::ldexp(r, 16));
    uint32_t ru;
    std::memcpy(&ru, &r, 4);
    const int e = static_cast<int>((ru >> 23) & 0xFF) - 127 + 15;
    return sign | static_cast<uint8_t>((e << 2) | ((ru >> 21) & 3));
}

// e4m3 / e5m2 -> f16 is exact (both ranges lie inside f16's); NaN -> the canonical f16 NaN.
inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t c, __nv_fp8_interpretation_t fmt) {
    float v;
    const uint32_t s = (c >> 7) & 1u;
    if (fmt == __NV_E4M3) {
        const uint32_t ex = (c >> 3) & 15u, m = c & 7u;
        if (ex == 15 && m == 7) return __half_raw{0x7FFF};
        v = ex == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, static_cast<int>(ex) - 7);
    } else {
        const uint32_t ex = (c >> 2) & 31u, m = c & 3u;
        if (ex == 31 && m) return __half_raw{0x7FFF};
        if (ex == 31) v = INFINITY;
        else v = ex == 0 ? std::ldexp(static_cast<float>(m), -16) : std::ldexp(1.0f + m / 4.0f, static_cast<int>(ex) - 15);
    }
    return __half_raw{__float2half_rn(s ? -v : v).__x};
}

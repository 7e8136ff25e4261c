// Host stand-in for CUDA's <cuda_fp16.h>, for the CPU emulator (cuda/test/emu): the 16-bit types
// and the conversions the kernels use, bit-exact (round to nearest even, like the device
// intrinsics), so the emulator builds with a plain g++ and no CUDA toolkit.
#pragma once
#include <cstdint>
#include <cstring>

struct __half {
    uint16_t __x;
};
struct alignas(4) __half2 {
    __half x, y;
};

inline float __half2float(__half h) {
    _Float16 f;
    std::memcpy(&f, &h.__x, 2);
    return static_cast<float>(f);
}
inline __half __float2half_rn(float x) {
    const _Float16 f = static_cast<_Float16>(x);  // IEEE round to nearest even
    __half h;
    std::memcpy(&h.__x, &f, 2);
    return h;
}
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2{__float2half_rn(lo), __float2half_rn(hi)}; }

// The emulator's host stand-in for cuda_fp8.h: declarations only, so that headers which include it
// (cuda/include/fp8.cuh, through online_softmax.cuh) compile into kernels that do not convert to or
// from FP8 (FA4 stage 3 uses the lazy-rescale rule of online_softmax.cuh). No kernel the emulator
// runs is an FP8 kernel: a kernel that called these conversions would fail to link, by design.
#pragma once
#include <cuda_fp16.h>

typedef unsigned char __nv_fp8_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
struct __half_raw {
    unsigned short x;
    operator __half() const;  // declared only (see above)
};
__nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t fmt);
__half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t x, __nv_fp8_interpretation_t fmt);

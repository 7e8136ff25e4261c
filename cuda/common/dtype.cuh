// Element types of the kernels and their conversions to and from f32 (the accumulation type).
// The instance macros name dtypes by the suffix of the kernel symbol: f16, bf16.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

using fa_f16 = __half;
using fa_bf16 = __nv_bfloat16;

__device__ __forceinline__ float fa_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float fa_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round-to-nearest-even, as half::f16::from_f32 / bf16::from_f32 on the host.
template <typename T>
__device__ __forceinline__ T fa_from_float(float x);
template <>
__device__ __forceinline__ __half fa_from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 fa_from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }


// Two floats -> one 32-bit register of two 16-bit values (round to nearest even), `lo` in the low
// half: the lower element index of an mma / wgmma fragment pair, or of two adjacent columns.
template <typename T>
__device__ __forceinline__ uint32_t fa_pack2(float lo, float hi) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low half), .y = hi
        return *reinterpret_cast<uint32_t*>(&v);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
}

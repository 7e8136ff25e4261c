// Approximate transcendental functions of the FA3 kernels (the MUFU special-function unit),
// one inline-PTX instruction each. Both instructions exist on sm_75 and newer; the header is
// named for the sm_90a kernels that use it.
#pragma once

namespace fa3 {

// Inline PTX: only when nvcc compiles for sm_90a or sm_100a. The CPU emulator (cuda/test/emu, which defines
// FA_HOST_EMULATION) supplies host versions of exactly the functions in this block.
#if (defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(__CUDA_ARCH_FEAT_SM100_ALL)) && !defined(FA_HOST_EMULATION)

// 2^x; flushes subnormal inputs and results to zero; ex2.approx(-inf) = +0, which the softmax's
// -inf guard relies on. Maximum relative error 2^-22 (PTX ISA, ex2).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// tanh(x), maximum relative error about 2^-11 (PTX ISA, tanh).
__device__ __forceinline__ float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL && !FA_HOST_EMULATION

}  // namespace fa3

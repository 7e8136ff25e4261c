// Approximate transcendental functions of the softmax (the MUFU special-function unit), one
// inline-PTX instruction each. Both exist on sm_75 and newer, so every kernel family (sm_80 and
// up, and the compute_80 PTX) shares them.
#pragma once

// Inline PTX: only when nvcc compiles device code. The CPU emulator (cuda/test/emu, which
// defines FA_HOST_EMULATION) supplies host versions of exactly the functions in this block.
#if !defined(FA_HOST_EMULATION)

// 2^x; flushes subnormal inputs and results to zero (p < 2^-126 contributes nothing next to the
// p = 1 of the row max); ex2.approx(-inf) = +0, which the softmax's -inf guard relies on.
// Maximum relative error 2^-22 (PTX ISA, ex2).
__device__ __forceinline__ float fa_ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// tanh(x), maximum relative error about 2^-11 (PTX ISA, tanh).
__device__ __forceinline__ float fa_tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

#endif  // !FA_HOST_EMULATION

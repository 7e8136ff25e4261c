// Global-memory reductions of the sm_80 kernels (the backward's f32 dq accumulator), one
// inline-PTX instruction each. `red` exists on every architecture the crate builds for.
// The CPU emulator (cuda/test/emu, which defines FA_HOST_EMULATION) supplies host versions of
// exactly the functions in the guarded block.
#pragma once

namespace fa2 {

#if !defined(FA_HOST_EMULATION)

// *addr += v in f32, atomically, with no result (red, not atom). The order of concurrent adds
// is the hardware's, so the sum is not bit-reproducible run to run.
__device__ __forceinline__ void red_add_f32(float* addr, float v) {
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr), "f"(v) : "memory");
}

#endif  // !FA_HOST_EMULATION

}  // namespace fa2

// Plain shared-memory loads and stores as instructions (ld.shared.f32, st.shared.v4.b32), for
// values one thread writes and other threads read across a barrier or an mbarrier: an FP8 KV
// cache's per-key scales, and the converted chunks of FA3's gathered FP8 tiles. Through these
// wrappers the CPU emulator (cuda/test/emu) checks each such handoff's happens-before: a load
// must have acquired the last store into its bytes, and a later store must have acquired the
// load. Both exist on sm_80 and every later architecture.
#pragma once
#include <stdint.h>

// Every inline-PTX wrapper of this header sits inside the FA_HOST_EMULATION guards: the emulator
// supplies host versions of exactly these functions.
#if !defined(FA_HOST_EMULATION)

// The f32 at shared address `addr` (4-byte aligned). Volatile with a memory clobber: it stays
// after the barrier or mbarrier wait that acquired the value.
__device__ __forceinline__ float fa_ld_shared_f32(uint32_t addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}

// 16 bytes to shared address `addr` (16-byte aligned).
__device__ __forceinline__ void fa_st_shared_v4(uint32_t addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

#endif  // !FA_HOST_EMULATION

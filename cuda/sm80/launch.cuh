// Launch-shape checks shared by the kernels.
#pragma once

// The dynamic shared memory this launch was given, in bytes (kernels check it against what
// their layout needs, so a host/kernel mismatch traps instead of corrupting memory).
#ifndef FA_HOST_EMULATION
__device__ __forceinline__ unsigned fa_dynamic_smem_bytes() {
    unsigned bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}
#endif

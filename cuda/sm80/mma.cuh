// Thin wrappers over the sm_80 warp-level instructions the FA2 kernel uses: cp.async (global ->
// shared, 16 bytes, zero-fill), ldmatrix (shared -> mma fragments) and mma.sync m16n8k16 with f32
// accumulation, plus the CTA coordinates read through %ctaid (the softmax's ex2 and shuffles are
// the shared ones of fast_math.cuh and softmax.cuh).
// The CPU emulator (cuda/test/emu) implements the PTX wrappers on the host, from the PTX ISA text,
// to run the unchanged kernel source on the CPU. Fragment layouts are documented (and host-tested)
// in fa2/layout.h. All of these exist on sm_80 and every later architecture (sm_90a and sm_100a
// keep mma.sync), so the same source compiles for every target of the crate.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>


namespace fa2 {

// Shared-state-space address of a generic pointer into shared memory (what ldmatrix/cp.async take).
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Every inline-PTX wrapper of this header sits inside the FA_HOST_EMULATION guards below: the CPU
// emulator (cuda/test/emu) compiles the kernel sources unchanged and supplies host versions of
// exactly these functions (their semantics, from the PTX ISA, are modelled there).
#if !defined(FA_HOST_EMULATION)

// ---- cp.async ------------------------------------------------------------------------------------
// 16-byte asynchronous copy, L2-only (.cg: K/V tiles are reused by other CTAs through L2, not L1).
// src_bytes < 16 zero-fills the rest of the destination; src_bytes = 0 reads nothing and writes 16
// zero bytes, which is how rows past seqlen become zeros (the source address must still be a valid
// global address, callers pass the tensor base).
__device__ __forceinline__ void cp_async_16(uint32_t dst_smem, const void* src_gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_smem), "l"(src_gmem),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- ldmatrix ------------------------------------------------------------------------------------
// Four 8x8 b16 matrices; this lane supplies the row address `addr` (see fa2/layout.h for which).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// ---- mma.sync m16n8k16, f32 accumulate -----------------------------------------------------------
// d += a * b with d the C/D fragment, a the A fragment (4 regs), b0/b1 the B fragment.
template <typename Elem>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                     uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                            uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- CTA coordinates ------------------------------------------------------------------------------
// %ctaid.{y,z} read through volatile asm: the compiler cannot hoist these out of the main loop, so
// the 64-bit K/V head pointers are recomputed per tile (a few integer ops next to thousands of
// mma) instead of occupying four registers across the register-bound loop (hdim 128 spilled).
__device__ __forceinline__ int cta_head() {
    int v;
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(v));
    return v;
}
__device__ __forceinline__ int cta_batch() {
    int v;
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(v));
    return v;
}

#endif  // !FA_HOST_EMULATION

// ---- the mma interface the kernel uses: one struct per element type ------------------------------
template <typename Elem>
struct Mma {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        mma_m16n8k16<Elem>(d, a, b0, b1);
    }
};

}  // namespace fa2

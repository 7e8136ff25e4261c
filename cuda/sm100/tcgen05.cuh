// tcgen05 (5th-generation tensor cores, sm_100a) helpers: the UMMA shared-memory matrix
// descriptor and instruction descriptor our tiles use, tensor-memory (TMEM) addresses, and the
// instruction wrappers (allocation, MMA, commit, loads/stores, waits, fences).
//
// ---- Layout derivations (PTX ISA 9.0, "Tensor Core 5th Generation Family Instructions";
//      checked against CuTe's cute/arch/mma_sm100_desc.hpp by cuda/test/oracle/check_sm100.cpp) ----
//
// Shared-memory tiles are the SW128 slabs of wgmma_sm90.cuh (TMA writes them with
// CU_TENSOR_MAP_SWIZZLE_128B and 64-element boxes): slab s of a [rows x D] tile holds columns
// 64s..64s+63, each row 128 bytes, 16-byte chunks XOR-swizzled with the row mod 8. The canonical
// UMMA layouts are those of wgmma, so descriptors differ from sm_90's only in their fields:
//   [0:14) start >> 4, [16:30) LBO >> 4, [32:46) SBO >> 4, [46:48) version = 1 (Blackwell),
//   [49:52) base offset (0: our tiles start on 1024-byte pattern boundaries), [52] LBO mode (0),
//   [61:64) layout type: 0 none, 1 128B with 32B base, 2 = 128B, 4 = 64B, 6 = 32B.
// K-major (Q and K of S = Q K^T, P of O = P V): rows 128 B apart inside an 8-row atom, atoms
// SBO = 1024 B apart; one MMA reads K = 16 elements = 32 bytes of each row, the k-th step of a
// slab starts 32k bytes in (the swizzle acts on the absolute address), LBO unused (CuTe writes 1).
// MN-major (V as B of O = P V: B is N x K with N = D contiguous): 64 N-elements per 128-byte row,
// the next 64 LBO = slab stride away, 8 keys 128 B apart, the next 8 SBO = 1024 B away; the k-th
// 16-key step starts 2048k bytes in.
//
// Instruction descriptor (32 bits, kind::f16, dense): [4:6) D format (1 = F32), [7:10) A format
// and [10:13) B format (0 = F16, 1 = BF16), [13] / [14] negate A / B, [15] / [16] A / B major
// (0 = K, 1 = MN), [17:23) N >> 3, [24:29) M >> 4; every other bit 0.
//
// Tensor memory: 128 lanes x 512 columns of 32 bits per CTA, address = (lane << 16) | column;
// tcgen05.alloc returns the base (lane 0, first column). With cta_group::1 and M = 128, row i of
// an accumulator D lives in lane i, element (i, n) in column base + n (f32). A warp reaches only
// its quarter of the lanes: warp w (w % 4) lanes 32 (w % 4) .. + 31. tcgen05.ld/st .32x32b.xN:
// lane l of the warp moves columns c .. c + N - 1 of TMEM lane 32 (w % 4) + l, one per register,
// so a thread owns one accumulator row (no shuffles in the softmax).
//
// Ordering rules the callers follow: an MMA's completion is observed through tcgen05.commit, which
// arrives on an mbarrier once every earlier tcgen05 async operation of the issuing thread is done;
// waiters then tcgen05.fence::after_thread_sync before touching TMEM. tcgen05.ld/st results are
// usable after tcgen05.wait::ld / wait::st. Before a CTA barrier that hands TMEM (or the end of its
// use) to another thread: tcgen05.fence::before_thread_sync; after it: fence::after_thread_sync.
// Shared memory written by ordinary stores (P in stage 1) needs fence.proxy.async before an MMA
// reads it (tma_sm90.cuh).
#pragma once
#include <stdint.h>

namespace fa4 {

// SW128 geometry (16-bit elements), as in wgmma_sm90.cuh.
constexpr int kSwizzleBytes = 128;
constexpr int kSlabCols = 64;
constexpr int kSwizzleAtomBytes = 1024;
constexpr int kUmmaK = 16;          // reduction depth of one kind::f16 MMA
constexpr int kUmmaKBytes = 32;     // its bytes along a K-major row
constexpr int kUmmaM = 128;         // rows per MMA (cta_group::1): one per TMEM lane
constexpr int kTmemLanes = 128;
constexpr int kTmemColumns = 512;

constexpr uint64_t kUmmaDescVersion = 1;    // bits 46-47
constexpr uint64_t kUmmaLayoutSw128 = 2;    // bits 61-63
constexpr uint32_t kUmmaFormatF16 = 0;
constexpr uint32_t kUmmaFormatBF16 = 1;
constexpr uint32_t kUmmaFormatF32 = 1;      // D format

// A 14-bit descriptor field: bytes in 16-byte units.
__host__ __device__ constexpr uint64_t umma_desc_field(uint32_t bytes) {
    return static_cast<uint64_t>((bytes & 0x3FFFF) >> 4);
}

// K-major SW128 operand at shared address `addr` (1024-aligned slab + 32-byte k step).
__host__ __device__ constexpr uint64_t umma_desc_kmajor_sw128(uint32_t addr) {
    return umma_desc_field(addr) | (umma_desc_field(16) << 16) |  // LBO: unused (K-major swizzled)
           (umma_desc_field(kSwizzleAtomBytes) << 32) | (kUmmaDescVersion << 46) |
           (kUmmaLayoutSw128 << 61);
}

// MN-major SW128 operand; `slab_stride`: bytes between 64-element column slabs (LBO).
__host__ __device__ constexpr uint64_t umma_desc_mnmajor_sw128(uint32_t addr, uint32_t slab_stride) {
    return umma_desc_field(addr) | (umma_desc_field(slab_stride) << 16) |
           (umma_desc_field(kSwizzleAtomBytes) << 32) | (kUmmaDescVersion << 46) |
           (kUmmaLayoutSw128 << 61);
}

// kind::f16 instruction descriptor: f32 accumulator, A and B both f16 or both bf16.
__host__ __device__ constexpr uint32_t umma_idesc_f16(bool bf16, int m, int n, bool a_mn_major,
                                                      bool b_mn_major) {
    const uint32_t fmt = bf16 ? kUmmaFormatBF16 : kUmmaFormatF16;
    return (kUmmaFormatF32 << 4) | (fmt << 7) | (fmt << 10) | (uint32_t(a_mn_major) << 15) |
           (uint32_t(b_mn_major) << 16) | (uint32_t(n >> 3) << 17) | (uint32_t(m >> 4) << 24);
}

// TMEM address of (lane, column) relative to an allocation's base.
__host__ __device__ constexpr uint32_t tmem_addr(uint32_t base, int lane, int column) {
    return base + (static_cast<uint32_t>(lane) << 16) + static_cast<uint32_t>(column);
}

// Inline PTX: only when nvcc compiles for sm_100a. The CPU emulator (cuda/test/emu, which defines
// FA_HOST_EMULATION) supplies host versions of exactly the functions in this block.
#if defined(__CUDA_ARCH_FEAT_SM100_ALL) && !defined(FA_HOST_EMULATION)

// Warp-collective: allocates `ncols` TMEM columns (a power of 2, 32..512) and writes the base
// address to the shared-memory word `dst`.
__device__ __forceinline__ void tmem_alloc(uint32_t* dst, uint32_t ncols) {
    asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;\n" ::"r"(
                     static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
                 "r"(ncols)
                 : "memory");
}
// Warp-collective: this CTA will allocate no more (lets a co-resident CTA's alloc proceed).
__device__ __forceinline__ void tmem_relinquish() {
    asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n" ::: "memory");
}
// Warp-collective (the allocating warp): frees the allocation at `taddr`.
__device__ __forceinline__ void tmem_dealloc(uint32_t taddr, uint32_t ncols) {
    asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;\n" ::"r"(taddr), "r"(ncols)
                 : "memory");
}

// One thread: D[tmem] (+)= A[smem desc] * B[smem desc]^T, shape and types from `idesc`;
// accumulate = 0 overwrites D.
__device__ __forceinline__ void umma_f16_ss(uint32_t d_tmem, uint64_t a_desc, uint64_t b_desc,
                                            uint32_t idesc, uint32_t accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %4, 0;\n"
        "tcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, p;\n"
        "}\n" ::"r"(d_tmem),
        "l"(a_desc), "l"(b_desc), "r"(idesc), "r"(accumulate)
        : "memory");
}
// One thread: as umma_f16_ss with A read from tensor memory (16-bit elements packed two per
// column, row i in lane i).
__device__ __forceinline__ void umma_f16_ts(uint32_t d_tmem, uint32_t a_tmem, uint64_t b_desc,
                                            uint32_t idesc, uint32_t accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %4, 0;\n"
        "tcgen05.mma.cta_group::1.kind::f16 [%0], [%1], %2, %3, p;\n"
        "}\n" ::"r"(d_tmem),
        "r"(a_tmem), "l"(b_desc), "r"(idesc), "r"(accumulate)
        : "memory");
}
// One thread: one arrival on `bar` once every earlier tcgen05 async operation of this thread
// (its MMAs) has completed.
__device__ __forceinline__ void umma_commit(uint64_t* bar) {
    asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n" ::"r"(
                     static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
                 : "memory");
}

// Warp-collective: 32 consecutive columns of this thread's lane into r (valid after
// tmem_wait_ld).
__device__ __forceinline__ void tmem_ld_32x32b_x32(uint32_t taddr, uint32_t (&r)[32]) {
    asm volatile(
        "tcgen05.ld.sync.aligned.32x32b.x32.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "[%32];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7]),
          "=r"(r[8]), "=r"(r[9]), "=r"(r[10]), "=r"(r[11]), "=r"(r[12]), "=r"(r[13]), "=r"(r[14]),
          "=r"(r[15]), "=r"(r[16]), "=r"(r[17]), "=r"(r[18]), "=r"(r[19]), "=r"(r[20]), "=r"(r[21]),
          "=r"(r[22]), "=r"(r[23]), "=r"(r[24]), "=r"(r[25]), "=r"(r[26]), "=r"(r[27]), "=r"(r[28]),
          "=r"(r[29]), "=r"(r[30]), "=r"(r[31])
        : "r"(taddr)
        : "memory");
}
// Warp-collective: r into 32 consecutive columns of this thread's lane (done after
// tmem_wait_st).
__device__ __forceinline__ void tmem_st_32x32b_x32(uint32_t taddr, const uint32_t (&r)[32]) {
    asm volatile(
        "tcgen05.st.sync.aligned.32x32b.x32.b32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
        "%31, %32};\n" ::"r"(taddr),
        "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "r"(r[4]), "r"(r[5]), "r"(r[6]), "r"(r[7]), "r"(r[8]),
        "r"(r[9]), "r"(r[10]), "r"(r[11]), "r"(r[12]), "r"(r[13]), "r"(r[14]), "r"(r[15]), "r"(r[16]),
        "r"(r[17]), "r"(r[18]), "r"(r[19]), "r"(r[20]), "r"(r[21]), "r"(r[22]), "r"(r[23]), "r"(r[24]),
        "r"(r[25]), "r"(r[26]), "r"(r[27]), "r"(r[28]), "r"(r[29]), "r"(r[30]), "r"(r[31])
        : "memory");
}
// Warp-collective: r into 16 consecutive columns of this thread's lane.
__device__ __forceinline__ void tmem_st_32x32b_x16(uint32_t taddr, const uint32_t (&r)[16]) {
    asm volatile(
        "tcgen05.st.sync.aligned.32x32b.x16.b32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "
        "%14, %15, %16};\n" ::"r"(taddr),
        "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "r"(r[4]), "r"(r[5]), "r"(r[6]), "r"(r[7]), "r"(r[8]),
        "r"(r[9]), "r"(r[10]), "r"(r[11]), "r"(r[12]), "r"(r[13]), "r"(r[14]), "r"(r[15])
        : "memory");
}
// Warp-collective: waits for this thread's tcgen05.ld; the registers it names are pinned after
// the wait so the compiler cannot read them earlier.
template <int N>
__device__ __forceinline__ void tmem_wait_ld(uint32_t (&r)[N]) {
    asm volatile("tcgen05.wait::ld.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
// Warp-collective: waits for this thread's tcgen05.st.
__device__ __forceinline__ void tmem_wait_st() {
    asm volatile("tcgen05.wait::st.sync.aligned;\n" ::: "memory");
}
// Orders this thread's earlier tcgen05 operations before a following thread synchronisation
// (bar.sync, mbarrier arrive) ...
__device__ __forceinline__ void tcgen05_fence_before() {
    asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
}
// ... and tcgen05 operations after a thread synchronisation (bar.sync, mbarrier wait) after it.
__device__ __forceinline__ void tcgen05_fence_after() {
    asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory");
}

#endif  // __CUDA_ARCH_FEAT_SM100_ALL && !FA_HOST_EMULATION

}  // namespace fa4

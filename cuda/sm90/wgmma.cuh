// wgmma (warpgroup MMA, sm_90a) helpers: shared-memory matrix descriptors for the 128-byte
// swizzled layouts our tiles use, fences, and m64n64k16 f32-accumulating MMAs for bf16/f16.
//
// ---- Layout derivations (PTX ISA 9.0, "Asynchronous Warpgroup Level Matrix ...") ----
//
// Tile storage ("SW128 slabs"). Every 16-bit operand tile in shared memory is a [rows x D] matrix
// (row = query or key, D = head_dim, contiguous) stored as D/64 *slabs*: slab s holds columns
// 64s..64s+63 of every row, each row exactly 128 bytes, rows packed: byte offset of (row r, col c)
//     slab(c) * rows * 128  +  r * 128  +  (((c % 64) / 8) XOR (r % 8)) * 16  +  (c % 8) * 2.
// The XOR is the 128-byte swizzle: inside each 8-row x 128-byte atom (1024 B) the 16-byte chunk
// index is XORed with the row index mod 8 (address bits [4:6] ^= bits [7:9]). It is what TMA
// writes with CU_TENSOR_MAP_SWIZZLE_128B and a 64-element (128-byte) inner box, and what wgmma
// un-does when the descriptor says "128B swizzle". Because the hardware applies it to absolute
// address bits, every slab must start on a 1024-byte boundary (we align the dynamic smem base
// and make every tile size a multiple of 1024 B), and the descriptor's base-offset field is 0.
//
// Descriptor (64 bits): [0:14) start address >> 4, [16:30) leading-dimension byte offset (LBO)
// >> 4, [32:46) stride-dimension byte offset (SBO) >> 4, [49:52) base offset (0 here),
// [62:64) swizzle mode: 0 none, 1 = 128B, 2 = 64B, 3 = 32B.
//
// K-major operand (Q as A, K as B of S = Q K^T: the reduction dim D is contiguous). A "core
// matrix" is 8 rows x 16 bytes. One wgmma reads 64 (A) or N (B) rows x 16 elements (32 bytes)
// of K. Rows step by 128 B inside an 8-row atom; consecutive 8-row groups are SBO = 1024 B
// apart. K = 16 elements never leaves one 128-byte swizzle row, so LBO is unused for swizzled
// K-major layouts (set to 1, as the ISA allows). The k-th 16-wide step of the reduction inside a
// slab starts at +32*k bytes (k = 0..3): the swizzle is applied by hardware to the final address
// so a plain byte advance of the start address is correct; step 4 moves to the next slab.
//
// MN-major operand (V as B of O += P V: B is [keys x D] = K x N with N = D contiguous, so
// imm-trans-b = 1). Canonical SW128 MN-major layout in 16-byte units T (8 elements):
// ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO)): 64 contiguous N-elements (one 128-byte row), the next
// 64 N-elements LBO bytes away (= the next slab = rows * 128), 8 consecutive K-rows (keys) 128 B
// apart, the next group of 8 keys SBO = 1024 B away. So V uses the *same* SW128 slab storage
// as K; only the descriptor (LBO = slab stride) and the transpose bit differ. One wgmma
// consumes 16 keys, so the k-th step starts at +16*128 = 2048*k bytes.
//
// Fragments (per thread; warp w = warp index in the warpgroup, g = lane / 4, t = lane % 4):
//  * D (f32 accumulator of m64nNk16, N/2 registers): d[4j + 2h + e] is element
//    (row 16w + g + 8h, col 8j + 2t + e), j = 0..N/8-1, h, e in {0, 1}.
//  * A from registers (16-bit, 4 x b32 each packing 2 elements, low half = lower column):
//    a[0] = (row 16w+g,   cols 2t, 2t+1)   a[1] = (row 16w+g+8, cols 2t, 2t+1)
//    a[2] = (row 16w+g,   cols 2t+8, +9)   a[3] = (row 16w+g+8, cols 2t+8, +9)
//    So the accumulator of S for keys 16k..16k+15 (chunks j = 2k, 2k+1) turns into the A
//    fragment of P for reduction step k without any data movement:
//    a[r] = pack(d[8k + 2r], d[8k + 2r + 1]), r = 0..3.
//
// Ordering rules used by the callers: wgmma_fence() before the first wgmma of a batch whenever
// the accumulator or A registers were touched by ordinary instructions; wgmma_commit() closes a
// group; wgmma_wait<N>() waits until at most N groups are pending (afterwards the accumulators
// may be read and the shared-memory operands overwritten). Shared memory written by ordinary
// stores must be followed by fence.proxy.async before a wgmma reads it (sm90/tma.cuh).
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

namespace fa3 {

// Byte geometry of the SW128 layout (16-bit elements).
constexpr int kSwizzleBytes = 128;                  // one swizzled row
constexpr int kSlabCols = kSwizzleBytes / 2;        // 64 16-bit elements per slab row
constexpr int kSwizzleAtomRows = 8;                 // rows per 1024-byte atom
constexpr int kSwizzleAtomBytes = kSwizzleBytes * kSwizzleAtomRows;  // 1024 = SBO
constexpr int kMmaK = 16;                           // reduction depth of m64nNk16
constexpr int kMmaKBytes = kMmaK * 2;               // 32: K-major step inside a slab
constexpr int kMmaM = 64;                           // rows per warpgroup MMA
constexpr int kMmaN = 64;                           // N of the one instruction shape we use

// Swizzle-mode field values for 128B and 64B swizzle.
constexpr uint64_t kDescSwizzle128B = 1;
constexpr uint64_t kDescSwizzle64B = 2;

// The descriptor and offset helpers are __host__ too: cuda/test/fa3_layout_sim.cpp runs them
// against a software model of wgmma's operand fetch.
__host__ __device__ constexpr uint64_t desc_field(uint32_t bytes) {
    return static_cast<uint64_t>((bytes & 0x3FFFF) >> 4);  // 14-bit field, 16-byte units
}

// Descriptor for a K-major SW128 operand starting at shared address `addr` (1024-aligned slab
// plus a 32-byte multiple for the k step).
__host__ __device__ constexpr uint64_t desc_kmajor_sw128(uint32_t addr) {
    return desc_field(addr) | (desc_field(16) << 16) |  // LBO: unused for swizzled K-major
           (desc_field(kSwizzleAtomBytes) << 32) | (kDescSwizzle128B << 62);
}

// Descriptor for a K-major SW64 operand (8-bit tiles whose K extent is 64 bytes: rows of 64
// bytes, 8-row atoms of 512 bytes = SBO; the 16-byte chunk index is XORed with address bits
// [7:9), i.e. (row / 2) % 4). `addr`: a 512-aligned slab plus a 32-byte multiple for the k step.
__host__ __device__ constexpr uint64_t desc_kmajor_sw64(uint32_t addr) {
    return desc_field(addr) | (desc_field(16) << 16) | (desc_field(8 * 64) << 32) | (kDescSwizzle64B << 62);
}

// Descriptor for an MN-major SW128 operand (use with imm-trans-b = 1). `slab_stride` is the
// byte distance between consecutive 64-column slabs (= rows of the tile * 128).
__host__ __device__ constexpr uint64_t desc_mnmajor_sw128(uint32_t addr, uint32_t slab_stride) {
    return desc_field(addr) | (desc_field(slab_stride) << 16) |
           (desc_field(kSwizzleAtomBytes) << 32) | (kDescSwizzle128B << 62);
}

// Byte offset of element (row, col) of a [rows x D] tile stored as SW128 slabs (see above).
__host__ __device__ constexpr int sw128_offset(int row, int col, int rows) {
    return (col / kSlabCols) * rows * kSwizzleBytes + row * kSwizzleBytes +
           ((((col % kSlabCols) / 8) ^ (row % kSwizzleAtomRows)) * 16) + (col % 8) * 2;
}

// Index into an m64nNk16 f32 accumulator array of the thread's element in 8-column chunk j,
// row half h (0: row 16w+g, 1: row 16w+g+8), column parity e.
__host__ __device__ constexpr int acc_index(int j, int h, int e) { return 4 * j + 2 * h + e; }

// Reusing an accumulator as the next MMA's register A operand: register r (0..3) of the A
// fragment for reduction step k packs accumulator elements acc_to_a_index(k, r) (low half) and
// acc_to_a_index(k, r) + 1 (high half): a[r] covers row half r % 2 and column chunk 2k + r / 2.
__host__ __device__ constexpr int acc_to_a_index(int k, int r) {
    return acc_index(2 * k + r / 2, r % 2, 0);
}

// Inline PTX: only when nvcc compiles for sm_90a. The CPU emulator (cuda/test/emu, which defines
// FA_HOST_EMULATION) supplies host versions of exactly the functions in this block.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(FA_HOST_EMULATION)

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0..7");
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads/writes of accumulator registers across wgmma issue/wait
// points (the asm statements above only order memory).
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Register budget hand-off between warpgroups (warp-specialised kernels). Counts must be
// multiples of 8 in [24, 256]; every thread of the warpgroup executes the instruction.
template <int Regs>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(Regs % 8 == 0 && Regs >= 24 && Regs <= 256, "setmaxnreg range");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
}
template <int Regs>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(Regs % 8 == 0 && Regs >= 24 && Regs <= 256, "setmaxnreg range");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
}

// d[0..32) (+)= A(smem, K-major) * B(smem, K-major), m64n64k16. scale_d = 0 overwrites d.
template <class T>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float* d, uint64_t desc_a, uint64_t desc_b,
                                                   int scale_d) {
    static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                  "16-bit inputs only");
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    }
}

// d[0..32) += A(registers, 4 x b32 fragment) * B(smem, MN-major => imm-trans-b = 1), m64n64k16.
template <class T>
__device__ __forceinline__ void wgmma_m64n64k16_rs_tb(float* d, const uint32_t (&a)[4],
                                                      uint64_t desc_b) {
    static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                  "16-bit inputs only");
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "{%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    } else {
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "{%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL && !FA_HOST_EMULATION

}  // namespace fa3

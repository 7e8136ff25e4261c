// FP8 (e4m3) warpgroup MMA for the Hopper FP8 forward: m64n64k32 f32 += e4m3 · e4m3, from shared
// memory (SS: S = Q Kᵀ) or with A from registers (RS: O += P V), the e4m3 tile geometry, and the
// permutation of the f32 accumulator of S into the 8-bit A fragment of P.
//
// Layout facts (PTX ISA 9.0, "Asynchronous Warpgroup Level Matrix ..."; checked against CuTe's
// tables by the oracle, cuda/test/oracle: check_sm90.cpp check_e4m3, check_emu.cpp A8):
//  * 8-bit operands must be K-major, both of them (the instruction has no transpose immediates).
//    S = Q Kᵀ: Q [m × d] and K [n × d] are K-major as stored. O = P V: the B operand is V with
//    K = keys, so V must be stored transposed, Vᵀ [d × keys] with keys contiguous (the pre-pass
//    writes it so, cuda/fp8_prepass.cu; or the producer transposes it in shared memory).
//  * SW128 K-major e4m3 tiles: a 128-byte swizzle row holds 128 elements, so a [rows × D] tile is
//    D / 128 slabs of rows × 128 bytes with the same byte geometry as the 16-bit tiles
//    (swz_offset8<128> below), and one k32 step is 32 bytes: desc_kmajor_sw128 of sm90/wgmma.cuh
//    applies unchanged (the oracle compares it with CuTe's e4m3 descriptors).
//  * Accumulator (f32): as for 16-bit inputs (acc_index in sm90/wgmma.cuh): register
//    4j + 2h + e of thread (warp w, g = lane / 4, q = lane % 4) is (row 16w + g + 8h, col 8j + 2q + e).
//  * A from registers, 8-bit (4 × b32): byte b of register r is
//    (row 16w + g + 8 (r % 2), col 4q + b + 16 (r / 2)). A thread's accumulator holds columns
//    2q, 2q + 1 of every 8, its A fragment columns 4q .. 4q + 3 of every 16: P must move between
//    the lanes of a quad before PV (acc_to_a8 below), unlike the 16-bit case where it stays put.
#pragma once
#include <stdint.h>

#include "common/fp8.cuh"
#include "sm90/wgmma.cuh"

namespace fa3 {

constexpr int kMmaK8 = 32;          // reduction depth of m64nNk32 (8-bit inputs)
constexpr int kSlabCols8 = 128;     // e4m3 elements per 128-byte swizzle row
constexpr int kMmaK8Bytes = kMmaK8;  // 32: K-major step inside a slab, as for 16-bit inputs

// Byte offset of element (row, col) of a [rows × D] K-major e4m3 tile whose swizzle rows are W
// bytes (128 or 64; W = 128: the SW128 slabs of kSlabCols8 columns above): slabs of W
// columns, rows W bytes apart, the 16-byte chunk XORed with address bits [7, 7 + log2(W / 16))
// of the row's offset, i.e. row % 8 (SW128) or (row / 2) % 4 (SW64). Tiles whose K extent is 64
// bytes (Q and K at head_dim 64, Vᵀ with 64-key tiles) need W = 64: TMA's box inner extent must
// equal the swizzle row. Slabs start on W · 8-byte boundaries (rows a multiple of 8).
template <int W>
__host__ __device__ constexpr int swz_offset8(int row, int col, int rows) {
    static_assert(W == 128 || W == 64, "e4m3 tiles use 128- or 64-byte swizzle rows");
    return (col / W) * rows * W + row * W + ((((col % W) / 16) ^ ((row * W / 128) % (W / 16))) * 16) + (col % 16);
}

// The K-major descriptor of an e4m3 operand with W-byte swizzle rows (the k32 step is 32 bytes in
// either: a 64-byte row holds two, a 128-byte row four).
template <int W>
__host__ __device__ constexpr uint64_t desc_kmajor8(uint32_t addr) {
    static_assert(W == 128 || W == 64, "e4m3 tiles use 128- or 64-byte swizzle rows");
    if constexpr (W == 128)
        return desc_kmajor_sw128(addr);
    else
        return desc_kmajor_sw64(addr);
}

// Source lanes and byte selection of acc_to_a8 for a lane (pure, tested on the host against the
// fragment maps: cuda/test/emu/layouts_test.cpp). Byte b of A register r of lane 4g + q is key
// 16 (r / 2) + 4q + b, held by lane 4g + 2 (q % 2) + b / 2 as element b % 2 of its accumulator
// chunk 2 (r / 2) + q / 2. So each register takes two bytes from each of two lanes of its quad.
__host__ __device__ constexpr int a8_src_lane(int lane, int which) { return (lane & ~3) | ((lane & 1) << 1) | which; }
// __byte_perm selector: bytes 2 (q / 2), +1 of the first source, then of the second.
__host__ __device__ constexpr unsigned a8_byte_sel(int lane) { return ((lane & 3) >> 1) ? 0x7632u : 0x5410u; }

// Inline PTX: only when nvcc compiles for sm_90a. The CPU emulator (cuda/test/emu, which defines
// FA_HOST_EMULATION) supplies host versions of exactly the functions in this block.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(FA_HOST_EMULATION)

// d[0..32) (+)= A(smem, K-major e4m3) · B(smem, K-major e4m3), m64n64k32. scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_m64n64k32_ss_e4m3(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// d[0..32) += A(registers, 4 × b32 of e4m3, the 8-bit fragment) · B(smem, K-major e4m3), m64n64k32.
__device__ __forceinline__ void wgmma_m64n64k32_rs_e4m3(float* d, const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL && !FA_HOST_EMULATION

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Four f32 -> four e4m3 codes in one b32 (byte 0 = x0), satfinite round to nearest even (fp8.cuh).
__device__ __forceinline__ uint32_t pack4_e4m3(float x0, float x1, float x2, float x3) {
    return static_cast<uint32_t>(fa_e4m3_encode(x0)) | (static_cast<uint32_t>(fa_e4m3_encode(x1)) << 8) |
           (static_cast<uint32_t>(fa_e4m3_encode(x2)) << 16) | (static_cast<uint32_t>(fa_e4m3_encode(x3)) << 24);
}

// The P fragment of reduction step k of O += P V from the f32 accumulator of S (already scaled
// for the cast): p points at the thread's accumulator registers of keys 32k .. 32k + 31, i.e.
// chunks 4k .. 4k + 3 (acc_index(4k + c, h, e) - 16k = 4c + 2h + e). Each thread first packs, per
// row half h and key half kh, the four codes it holds (chunks 2kh, 2kh + 1, columns 2q, 2q + 1),
// then takes two of them from each of its two source lanes (a8_src_lane) with one shuffle each.
// Every lane of the warp must call it (shuffles).
__device__ __forceinline__ void acc_to_a8(const float* p, uint32_t (&a)[4]) {
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int src0 = a8_src_lane(lane, 0), src1 = a8_src_lane(lane, 1);
    const unsigned sel = a8_byte_sel(lane);
#pragma unroll
    for (int kh = 0; kh < 2; ++kh) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c0 = 4 * (2 * kh) + 2 * h, c1 = 4 * (2 * kh + 1) + 2 * h;
            const uint32_t x = pack4_e4m3(p[c0], p[c0 + 1], p[c1], p[c1 + 1]);
            const uint32_t y0 = __shfl_sync(0xffffffffu, x, src0);
            const uint32_t y1 = __shfl_sync(0xffffffffu, x, src1);
            a[2 * kh + h] = __byte_perm(y0, y1, sel);
        }
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

// The emulator's reading of the sm_90a data layouts, as pure functions: how wgmma finds an
// operand element in shared memory from its 64-bit matrix descriptor, where the accumulator and
// the register-A fragments live, and the shared-memory swizzle TMA and wgmma apply. Everything
// the emulator (cuda/test/emu/runtime/: async_copy.cpp, wgmma.cpp) does with these layouts goes
// through this header, so an independent oracle (CuTe's tables) can check exactly these functions.
//
// Written from the PTX ISA 9.0 ("Asynchronous Warpgroup Level Matrix Multiply-Accumulate":
// matrix descriptor format, shared memory matrix layouts, register fragments) and the CUDA driver
// documentation of cuTensorMapEncodeTiled (swizzle modes); nothing here is copied from the kernels
// (cuda/sm90/wgmma.cuh builds descriptors; this header decodes them).
//
// Conventions:
//  * Addresses are byte addresses in the CTA's shared-memory window (what
//    __cvta_generic_to_shared returns, what descriptors and TMA take).
//  * An operand of one wgmma is an MN x K matrix: A is M x K (M = 64), B is N x K (B(k, n)
//    is element (mn = n, k)). "K-major": K is the contiguous dimension (imm-trans = 0);
//    "MN-major": M or N is contiguous (imm-trans = 1, 16-bit types only on real hardware).
//  * One instruction reads K = 32 bytes of every row: 16 elements of 16 bits, or 32 of 8 bits.
//  * Canonical layouts, in bytes, for element size e, swizzle width W (32, 64, 128 bytes; 16 for
//    no swizzle), T = 16 / e elements per 16-byte chunk:
//      K-major, swizzled:   (mn % 8) * W + (mn / 8) * SBO + k * e
//      K-major, none:       (mn % 8) * 16 + (mn / 8) * SBO + (k % T) * e + (k / T) * LBO
//      MN-major, swizzled:  (mn % (W / e)) * e + (mn / (W / e)) * LBO + (k % 8) * W + (k / 8) * SBO
//      MN-major, none:      (mn % T) * e + (mn / T) * SBO + (k % 8) * 16 + (k / 8) * LBO
//    (LBO and SBO swap roles between the swizzled and the unswizzled MN-major forms; LBO is never
//    read by a swizzled K-major operand because 32 bytes of K never leave one swizzle row.) The
//    address is start + offset, and the swizzle is then applied to the *absolute* address.
//  * Swizzle (Swizzle<B, 4, 3> in CuTe's notation): the 16-byte chunk index, address bits [4, 4+B),
//    is XORed with bits [7, 7+B): B = 3 for 128B, 2 for 64B, 1 for 32B. The pattern repeats every
//    8 rows of W bytes (1024, 512, 256 bytes).
//  * Descriptor base offset (bits 49-51): for a swizzled operand whose start address is not at a
//    pattern boundary the ISA asks for base_offset = (start >> 7) & 7 (masked to the pattern).
//    With the absolute-address model above that field carries no extra information, so the
//    emulator *requires* it to equal the start address's phase (desc_problem says why not) rather
//    than guessing what silicon does with an inconsistent value.
#pragma once
#include <cstdint>

namespace emu {
namespace sm90 {

// Descriptor swizzle field (bits 62-63).
enum class Swizzle : uint32_t { None = 0, B128 = 1, B64 = 2, B32 = 3 };
enum class Major { K, MN };

// Row width of a swizzle mode in bytes (16: one chunk, no swizzle).
constexpr uint32_t swizzle_width(Swizzle s) {
    return s == Swizzle::B128 ? 128 : s == Swizzle::B64 ? 64 : s == Swizzle::B32 ? 32 : 16;
}
// log2 of the number of 16-byte chunks the swizzle permutes (B of Swizzle<B, 4, 3>).
constexpr uint32_t swizzle_bits(Swizzle s) {
    return s == Swizzle::B128 ? 3 : s == Swizzle::B64 ? 2 : s == Swizzle::B32 ? 1 : 0;
}
// Bytes after which the swizzle pattern repeats (8 rows of the swizzle width).
constexpr uint32_t swizzle_repeat(Swizzle s) { return 8 * swizzle_width(s); }

// The swizzle as a function of the absolute shared address (an involution).
constexpr uint32_t swizzle_addr(uint32_t addr, Swizzle s) {
    const uint32_t b = swizzle_bits(s);
    const uint32_t mask = (1u << b) - 1u;
    return addr ^ (((addr >> 7) & mask) << 4);
}

// The fields of a wgmma shared-memory matrix descriptor, in bytes.
struct SmemDesc {
    uint32_t start;        // bits 0-13: address >> 4
    uint32_t lbo;          // bits 16-29: leading dimension byte offset >> 4
    uint32_t sbo;          // bits 32-45: stride dimension byte offset >> 4
    uint32_t base_offset;  // bits 49-51
    Swizzle swizzle;       // bits 62-63
    uint64_t reserved;     // every other bit (must be 0)
};

constexpr SmemDesc decode_desc(uint64_t d) {
    constexpr uint64_t used = 0x3FFFull | (0x3FFFull << 16) | (0x3FFFull << 32) | (7ull << 49) | (3ull << 62);
    return SmemDesc{static_cast<uint32_t>(d & 0x3FFF) << 4, static_cast<uint32_t>((d >> 16) & 0x3FFF) << 4,
                    static_cast<uint32_t>((d >> 32) & 0x3FFF) << 4, static_cast<uint32_t>((d >> 49) & 7),
                    static_cast<Swizzle>(d >> 62), d & ~used};
}

// The inverse of decode_desc for addresses and offsets that are multiples of 16 below 2^18.
constexpr uint64_t encode_desc(uint32_t start, uint32_t lbo, uint32_t sbo, uint32_t base_offset, Swizzle s) {
    return static_cast<uint64_t>((start & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
           (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (static_cast<uint64_t>(base_offset & 7) << 49) |
           (static_cast<uint64_t>(s) << 62);
}

// Why the emulator refuses a descriptor (nullptr: it is fine).
constexpr const char* desc_problem(uint64_t d) {
    const SmemDesc x = decode_desc(d);
    if (x.reserved != 0) return "reserved descriptor bits are set";
    if (x.swizzle != Swizzle::None) {
        const uint32_t phase = (x.start % swizzle_repeat(x.swizzle)) >> 7;
        if (phase != x.base_offset)
            return "base_offset does not equal the start address's row phase in the swizzle pattern ((start >> 7) & "
                   "pattern mask)";
    } else if (x.base_offset != 0) {
        return "base_offset is set on an unswizzled operand";
    }
    return nullptr;
}

// Shared byte address of element (mn, k) of a wgmma operand (k < 32 / elem_bytes).
constexpr uint32_t operand_addr(uint64_t desc, Major major, uint32_t elem_bytes, uint32_t mn, uint32_t k) {
    const SmemDesc x = decode_desc(desc);
    const uint32_t e = elem_bytes;
    const uint32_t w = swizzle_width(x.swizzle);
    uint32_t off = 0;
    if (major == Major::K) {
        if (x.swizzle == Swizzle::None) {
            const uint32_t t = 16 / e;
            off = (mn % 8) * 16 + (mn / 8) * x.sbo + (k % t) * e + (k / t) * x.lbo;
        } else {
            off = (mn % 8) * w + (mn / 8) * x.sbo + k * e;
        }
    } else {
        if (x.swizzle == Swizzle::None) {
            const uint32_t t = 16 / e;
            off = (mn % t) * e + (mn / t) * x.sbo + (k % 8) * 16 + (k / 8) * x.lbo;
        } else {
            const uint32_t per_row = w / e;
            off = (mn % per_row) * e + (mn / per_row) * x.lbo + (k % 8) * w + (k / 8) * x.sbo;
        }
    }
    return swizzle_addr(x.start + off, x.swizzle);
}

// ---- register fragments (warpgroup of 128 threads: warp w = t / 32, lane l = t % 32,
// g = l / 4, q = l % 4) ----

struct RowCol {
    int row, col;
};

// f32 accumulator of m64nNk*: register i (0 .. N/2-1) of thread t holds
// (16w + g + 8 * ((i / 2) % 2), 8 * (i / 4) + 2q + i % 2).
constexpr RowCol acc_coord(int t, int i) {
    const int w = t / 32, l = t % 32;
    return RowCol{16 * w + l / 4 + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (l % 4) + (i & 1)};
}

// A from registers, 16-bit elements (m64k16): register r (0..3), half h (0 = low 16 bits) of
// thread t holds A(16w + g + 8 * (r % 2), 2q + h + 8 * (r / 2)). Value index v = 2r + h.
constexpr RowCol a_reg_coord16(int t, int r, int h) {
    const int w = t / 32, l = t % 32;
    return RowCol{16 * w + l / 4 + 8 * (r & 1), 2 * (l % 4) + h + 8 * (r >> 1)};
}
// A from registers, 8-bit elements (m64k32): register r (0..3), byte b (0 = lowest) of thread t
// holds A(16w + g + 8 * (r % 2), 4q + b + 16 * (r / 2)).
constexpr RowCol a_reg_coord8(int t, int r, int b) {
    const int w = t / 32, l = t % 32;
    return RowCol{16 * w + l / 4 + 8 * (r & 1), 4 * (l % 4) + b + 16 * (r >> 1)};
}

// ---- TMA (cp.async.bulk.tensor, tile mode) ----
// Box element at dense box offset `linear` (bytes, innermost dimension fastest, rows of
// box_inner_bytes) lands at swizzle_addr(dst + linear, mode) for the tensor map's swizzle mode.
// CUtensorMapSwizzle values: 0 none, 1 32B, 2 64B, 3 128B.
constexpr Swizzle tma_swizzle(uint32_t cu_swizzle) {
    return cu_swizzle == 3 ? Swizzle::B128 : cu_swizzle == 2 ? Swizzle::B64 : cu_swizzle == 1 ? Swizzle::B32 : Swizzle::None;
}
constexpr uint32_t tma_smem_addr(uint32_t dst, uint32_t linear, uint32_t cu_swizzle) {
    return swizzle_addr(dst + linear, tma_swizzle(cu_swizzle));
}

}  // namespace sm90
}  // namespace emu

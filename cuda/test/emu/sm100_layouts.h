// The emulator's reading of the sm_100a (tcgen05) data layouts, as pure functions: the UMMA
// shared-memory matrix descriptor, the instruction descriptor of kind::f16, tensor-memory
// addresses, and where tcgen05.mma / tcgen05.ld / tcgen05.st put elements in tensor memory.
// Everything the emulator's tcgen05 model (tcgen05.cpp) does with these layouts goes through this
// header, so CuTe's definitions can check exactly these functions (cuda/test/oracle/check_sm100.cpp).
//
// Written from the PTX ISA 9.0 ("Tensor Core 5th Generation Family Instructions": shared memory
// descriptor, instruction descriptor, matrix fragments and data-path layouts); nothing here is
// copied from the kernels (cuda/sm100/tcgen05.cuh encodes, this header decodes).
//
//  * UMMA shared-memory descriptor (64 bits): [0:14) start >> 4, [16:30) LBO >> 4, [32:46) SBO
//    >> 4, [46:48) fixed version 1, [49:52) base offset, [52] LBO mode (0: the canonical byte
//    offset, the only one emulated), [61:64) layout: 0 no swizzle, 1 128B with 32-byte atomic
//    base (not emulated), 2 128B, 4 64B, 6 32B. The canonical layouts these describe are wgmma's,
//    so an operand's addresses come from sm90::operand_addr on the equivalent sm_90 descriptor.
//  * Instruction descriptor (kind::f16 / kind::tf32 layout, 32 bits): [0:2) sparsity selector,
//    [2] sparse, [3] saturate, [4:6) D format (0 F16, 1 F32), [7:10) A format, [10:13) B format
//    (0 F16, 1 BF16, 2 TF32), [13] negate A, [14] negate B, [15] A major, [16] B major (0 K, 1 MN),
//    [17:23) N >> 3, [24:29) M >> 4, [30:32) maximum shift (.ws only); bits 6, 23, 29 reserved.
//  * Tensor memory: 128 lanes x 512 columns of 32 bits; address = lane << 16 | column.
//    cta_group::1, M = 128: D(i, n) is lane i, column d + n. A from tensor memory (16-bit):
//    A(i, k) is lane i, column a + k / 2, low half for even k.
//  * tcgen05.ld / st .32x32b.xN: warp w reaches lanes 32 (w % 4) .. + 31 only; thread l of the
//    warp moves register r <-> (lane 32 (w % 4) + l, column c + r).
#pragma once
#include <cstdint>

#include "sm90_layouts.h"

namespace emu {
namespace sm100 {

enum class Layout : uint32_t { None = 0, B128Base32 = 1, B128 = 2, B64 = 4, B32 = 6 };

struct UmmaDesc {
    uint32_t start, lbo, sbo;  // bytes
    uint32_t version;          // bits 46-47
    uint32_t base_offset;      // bits 49-51
    uint32_t lbo_mode;         // bit 52
    uint32_t layout;           // bits 61-63
    uint64_t reserved;         // every other bit
};

constexpr UmmaDesc decode_umma_desc(uint64_t d) {
    constexpr uint64_t used = 0x3FFFull | (0x3FFFull << 16) | (0x3FFFull << 32) | (3ull << 46) | (7ull << 49) |
                              (1ull << 52) | (7ull << 61);
    return UmmaDesc{static_cast<uint32_t>(d & 0x3FFF) << 4,
                    static_cast<uint32_t>((d >> 16) & 0x3FFF) << 4,
                    static_cast<uint32_t>((d >> 32) & 0x3FFF) << 4,
                    static_cast<uint32_t>((d >> 46) & 3),
                    static_cast<uint32_t>((d >> 49) & 7),
                    static_cast<uint32_t>((d >> 52) & 1),
                    static_cast<uint32_t>((d >> 61) & 7),
                    d & ~used};
}

constexpr uint64_t encode_umma_desc(uint32_t start, uint32_t lbo, uint32_t sbo, uint32_t base_offset, Layout l) {
    return static_cast<uint64_t>((start & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
           (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 46) |
           (static_cast<uint64_t>(base_offset & 7) << 49) | (static_cast<uint64_t>(l) << 61);
}

// The swizzle of a layout type (Layout::B128Base32 has none here: it is refused).
constexpr sm90::Swizzle umma_swizzle(uint32_t layout) {
    return layout == 2 ? sm90::Swizzle::B128 : layout == 4 ? sm90::Swizzle::B64 : layout == 6 ? sm90::Swizzle::B32
                                                                                               : sm90::Swizzle::None;
}

// The sm_90 descriptor of the same canonical layout (start, LBO, SBO, base offset, swizzle).
constexpr uint64_t to_sm90_desc(uint64_t d) {
    const UmmaDesc x = decode_umma_desc(d);
    return sm90::encode_desc(x.start, x.lbo, x.sbo, x.base_offset, umma_swizzle(x.layout));
}

// Why the emulator refuses a descriptor (nullptr: fine).
constexpr const char* umma_desc_problem(uint64_t d) {
    const UmmaDesc x = decode_umma_desc(d);
    if (x.reserved != 0) return "reserved descriptor bits are set";
    if (x.version != 1) return "the version field (bits 46-47) is not 1, which sm_100 requires";
    if (x.lbo_mode != 0) return "LBO mode 1 is not emulated";
    if (x.layout == 1) return "layout SWIZZLE_128B_BASE32B is not emulated";
    if (x.layout == 3 || x.layout == 5 || x.layout == 7) return "layout type 3, 5 or 7 is not defined";
    return sm90::desc_problem(to_sm90_desc(d));
}

// Shared byte address of element (mn, k) of an operand (k < 32 / elem_bytes).
constexpr uint32_t operand_addr(uint64_t desc, sm90::Major major, uint32_t elem_bytes, uint32_t mn, uint32_t k) {
    return sm90::operand_addr(to_sm90_desc(desc), major, elem_bytes, mn, k);
}

// ---- instruction descriptor (kind::f16) ----

struct Idesc {
    uint32_t sparse_sel, sparse, saturate, d_format, a_format, b_format, a_negate, b_negate, a_major, b_major;
    int n, m;
    uint32_t max_shift, reserved;
};

constexpr Idesc decode_idesc(uint32_t d) {
    return Idesc{d & 3u,
                 (d >> 2) & 1u,
                 (d >> 3) & 1u,
                 (d >> 4) & 3u,
                 (d >> 7) & 7u,
                 (d >> 10) & 7u,
                 (d >> 13) & 1u,
                 (d >> 14) & 1u,
                 (d >> 15) & 1u,
                 (d >> 16) & 1u,
                 static_cast<int>(((d >> 17) & 0x3Fu) << 3),
                 static_cast<int>(((d >> 24) & 0x1Fu) << 4),
                 (d >> 30) & 3u,
                 d & ((1u << 6) | (1u << 23) | (1u << 29))};
}

constexpr uint32_t encode_idesc(uint32_t d_format, uint32_t a_format, uint32_t b_format, uint32_t a_major,
                                uint32_t b_major, int m, int n) {
    return (d_format << 4) | (a_format << 7) | (b_format << 10) | (a_major << 15) | (b_major << 16) |
           (static_cast<uint32_t>(n >> 3) << 17) | (static_cast<uint32_t>(m >> 4) << 24);
}

// Why the emulator refuses a kind::f16 instruction descriptor (a_tmem: A from tensor memory).
constexpr const char* idesc_problem(uint32_t d, bool a_tmem) {
    const Idesc x = decode_idesc(d);
    if (x.reserved) return "reserved instruction-descriptor bits (6, 23, 29) are set";
    if (x.sparse || x.sparse_sel) return "sparse MMA is not emulated";
    if (x.saturate) return "saturate is only defined for integer MMA";
    if (x.max_shift) return "maximum shift is for .ws only";
    if (x.d_format != 1) return "only an F32 accumulator (D format 1) is emulated";
    if (x.a_format > 1 || x.b_format > 1) return "only F16 / BF16 operands (format 0 / 1) are emulated";
    if (x.a_format != x.b_format) return "A and B formats differ (kind::f16 takes one 16-bit type)";
    if (x.a_negate || x.b_negate) return "negated operands are not emulated";
    if (a_tmem && x.a_major) return "A from tensor memory cannot be MN-major";
    if (x.m != 128) return "only M = 128 (cta_group::1, one row per lane) is emulated";
    if (x.n < 16 || x.n > 256 || x.n % 16) return "M = 128 needs N a multiple of 16 in 16..256";
    return nullptr;
}

// ---- tensor memory ----

constexpr uint32_t tmem_lane(uint32_t taddr) { return taddr >> 16; }
constexpr uint32_t tmem_col(uint32_t taddr) { return taddr & 0xFFFF; }

struct LaneCol {
    uint32_t lane, col;
};
// D of an M = 128 MMA at d_taddr: element (i, n).
constexpr LaneCol acc_lane_col(uint32_t d_taddr, int i, int n) {
    return LaneCol{tmem_lane(d_taddr) + static_cast<uint32_t>(i), tmem_col(d_taddr) + static_cast<uint32_t>(n)};
}
// 16-bit A in tensor memory at a_taddr: element (i, k) is in the low (k even) or high half.
constexpr LaneCol a_tmem_lane_col(uint32_t a_taddr, int i, int k) {
    return LaneCol{tmem_lane(a_taddr) + static_cast<uint32_t>(i), tmem_col(a_taddr) + static_cast<uint32_t>(k / 2)};
}
// tcgen05.ld/st .32x32b: register r of lane l of warp w, from the warp's address taddr.
constexpr LaneCol ld32x32b_lane_col(uint32_t taddr, int warp, int l, int r) {
    return LaneCol{32u * static_cast<uint32_t>(warp % 4) + static_cast<uint32_t>(l),
                   tmem_col(taddr) + static_cast<uint32_t>(r)};
}

}  // namespace sm100
}  // namespace emu

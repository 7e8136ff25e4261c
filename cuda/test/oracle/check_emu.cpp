// The emulator's layout decoders (cuda/test/emu/sm90_layouts.h, sm80_layouts.h) against CuTe
// (cute_maps.h). The emulator moves every operand, fragment and TMA byte through these pure
// functions, and the kernels' encoders are checked against them (cuda/test/emu/layouts_test.cpp);
// here they meet NVIDIA's definitions instead of our own reading of the PTX ISA.
//
// Checked (every check goes through a table of decoder functions, so the mutation pass at the end
// runs exactly the same code on deliberately wrong decoders and must see mismatches):
//  1. descriptor fields: decode_desc (start, LBO, SBO, base offset, layout type, reserved bits)
//     equals CuTe's GmmaDescriptor bitfield on edge-case and random 64-bit values, and
//     encode_desc equals the descriptor CuTe's bitfield packs from the same fields;
//  2. swizzle: swizzle_addr equals CuTe's Swizzle<3,4,3> / <2,4,3> / <1,4,3> (and the identity
//     for no swizzle) on every byte address of 256 KiB;
//  3. operand fetch: for every tile of the oracle (the kernels' Q/K/V tiles, V at N = 64, 128 and
//     256, e4m3 tiles, every swizzle mode K-major and MN-major as A and B) and every instruction
//     block, CuTe's own descriptor, rebased to a 1024-aligned shared address, is accepted by
//     desc_problem and operand_addr finds every element (mn, k) where CuTe's layout has it;
//  4. unused LBO: where a descriptor's LBO is not part of the layout (K-major swizzled: CuTe
//     writes 1; MN-major swizzled with the instruction's MN extent within one swizzle row, e.g.
//     the kernels' N = 64 V descriptor: CuTe writes 0, our kernels the slab stride) operand_addr
//     returns the same addresses for any LBO value, so the emulator reads CuTe's and our kernels'
//     descriptors identically;
//  5. TMA: boxes of one swizzle-row width (what the kernels load: 64 bf16 columns = 128 bytes)
//     placed by tma_smem_addr slab by slab fill every swizzled tile exactly as CuTe lays it out;
//  6. wgmma fragments: acc_coord equals CuTe's CLayout_64xN for every N = 8..256, a_reg_coord16
//     its ALayout_64x16, a_reg_coord8 its ALayout_64x32 (the 8-bit A fragment, which is not the
//     accumulator's: an FP8 P needs a permutation);
//  7. sm_80: mma_a/b/c_coord equal CuTe's SM80_16x8x16 traits; ldmatrix_coord with
//     ldmatrix_row_lane equals CuTe's SM75 LDSM copy traits (.x1/.x2/.x4, with and without .trans;
//     the emulator itself issues .x4 only).
#include <cstdio>
#include <vector>

#include "cute_maps.h"
#include "sm80_layouts.h"
#include "sm90_layouts.h"

namespace {

namespace co = cute_oracle;
namespace e90 = emu::sm90;
namespace e80 = emu::sm80;

// The decoders under test: the emulator's, or a mutant.
struct Decoders {
    e90::SmemDesc (*decode_desc)(uint64_t);
    uint64_t (*encode_desc)(uint32_t, uint32_t, uint32_t, uint32_t, e90::Swizzle);
    const char* (*desc_problem)(uint64_t);
    uint32_t (*operand_addr)(uint64_t, e90::Major, uint32_t, uint32_t, uint32_t);
    uint32_t (*swizzle_addr)(uint32_t, e90::Swizzle);
    uint32_t (*tma_smem_addr)(uint32_t, uint32_t, uint32_t);
    e90::RowCol (*acc_coord)(int, int);
    e90::RowCol (*a_reg_coord16)(int, int, int);
    e90::RowCol (*a_reg_coord8)(int, int, int);
    e80::RowCol (*mma_a_coord)(int, int, int);
    e80::RowCol (*mma_b_coord)(int, int, int);
    e80::RowCol (*mma_c_coord)(int, int);
    e80::RowCol (*ldmatrix_coord)(int, int, bool);
    int (*ldmatrix_row_lane)(int, int);
};

constexpr Decoders kEmu{&e90::decode_desc,   &e90::encode_desc,   &e90::desc_problem,   &e90::operand_addr,
                        &e90::swizzle_addr,  &e90::tma_smem_addr, &e90::acc_coord,      &e90::a_reg_coord16,
                        &e90::a_reg_coord8,  &e80::mma_a_coord,   &e80::mma_b_coord,    &e80::mma_c_coord,
                        &e80::ldmatrix_coord, &e80::ldmatrix_row_lane};

// Checks and mismatches of one pass; `quiet` for the mutation pass (mismatches are expected).
struct Tally {
    long checks = 0;
    long bad = 0;
    bool quiet = false;
};

#define EXPECT_EMU(t, cond, ...)                                           \
    do {                                                                   \
        ++(t).checks;                                                      \
        if (!(cond)) {                                                     \
            if ((t).bad++ < 20 && !(t).quiet) {                            \
                std::printf("  MISMATCH %s:%d: ", __FILE__, __LINE__);     \
                std::printf(__VA_ARGS__);                                  \
                std::printf("\n");                                         \
            }                                                              \
        }                                                                  \
    } while (0)

constexpr e90::Swizzle kModes[] = {e90::Swizzle::None, e90::Swizzle::B32, e90::Swizzle::B64, e90::Swizzle::B128};
// CuTe's name of a mode: swizzle bytes (0 = none / INTERLEAVE).
int swizzle_bytes(e90::Swizzle s) {
    return s == e90::Swizzle::None ? 0 : static_cast<int>(e90::swizzle_width(s));
}
// The CUtensorMapSwizzle value of a mode.
uint32_t cu_swizzle(int swizzle_bytes) {
    return swizzle_bytes == 128 ? 3 : swizzle_bytes == 64 ? 2 : swizzle_bytes == 32 ? 1 : 0;
}

uint64_t g_rng = 0x9E3779B97F4A7C15ull;
uint64_t next_rand() {  // xorshift64*: a fixed sequence, so runs are reproducible
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 0x2545F4914F6CDD1Dull;
}

const char* tile_name(const co::GmmaTile& t) {
    static char buf[96];
    std::snprintf(buf, sizeof buf, "%s %s-major %d-bit sw%d %dx%d inst %d", t.operand == co::Operand::A ? "A" : "B",
                  t.major == co::Major::K ? "K" : "MN", t.elem_bits, t.swizzle_bytes, t.mn, t.k, t.inst_mn);
    return buf;
}

// CuTe's layout of a whole tile, (mn, k) -> byte offset from the 1024-aligned tile base.
std::vector<int64_t> cute_tile(const co::GmmaTile& t) {
    std::vector<int64_t> off(static_cast<size_t>(t.mn) * t.k, -1);
    for (int mn = 0; mn < t.mn; ++mn)
        for (int k = 0; k < t.k; ++k) co::gmma_tile_offset(t, mn, k, &off[static_cast<size_t>(mn) * t.k + k]);
    return off;
}

// 1024-aligned tile bases in the 256 KiB a descriptor's 14-bit start field can address (the
// largest tile, 128 x 256 x 2 bytes, still fits after the last).
constexpr uint32_t kBases[] = {0x0, 0x400, 0x7C00, 0x30000};

// ---- 1. descriptor fields

void check_desc_fields(const Decoders& d, Tally& t) {
    std::vector<uint64_t> raws = {0, ~0ull};
    for (int b = 0; b < 64; ++b) raws.push_back(1ull << b), raws.push_back(~(1ull << b));
    for (int i = 0; i < 20000; ++i) raws.push_back(next_rand());
    for (uint64_t raw : raws) {
        const co::GmmaDesc c = co::gmma_desc_fields(raw);
        const e90::SmemDesc x = d.decode_desc(raw);
        const uint64_t cute_reserved = raw & ~co::gmma_desc_pack(~0u, ~0u, ~0u, 7, 3);
        EXPECT_EMU(t,
                   x.start == c.start_offset && x.lbo == c.lbo && x.sbo == c.sbo &&
                       static_cast<int>(x.base_offset) == c.base_offset &&
                       static_cast<int>(x.swizzle) == c.layout_type && x.reserved == cute_reserved,
                   "decode_desc(%016llx): start %u lbo %u sbo %u base %u layout %u reserved %016llx; CuTe start %u "
                   "lbo %u sbo %u base %d layout %d reserved %016llx",
                   (unsigned long long)raw, x.start, x.lbo, x.sbo, x.base_offset, static_cast<unsigned>(x.swizzle),
                   (unsigned long long)x.reserved, c.start_offset, c.lbo, c.sbo, c.base_offset, c.layout_type,
                   (unsigned long long)cute_reserved);
    }
    for (int i = 0; i < 20000; ++i) {
        const uint64_t r = next_rand();
        const uint32_t start = (r & 0x3FFF) << 4, lbo = ((r >> 14) & 0x3FFF) << 4, sbo = ((r >> 28) & 0x3FFF) << 4;
        const uint32_t base = (r >> 42) & 7;
        const e90::Swizzle s = kModes[(r >> 45) & 3];
        const uint64_t ours = d.encode_desc(start, lbo, sbo, base, s);
        const uint64_t cute = co::gmma_desc_pack(start, lbo, sbo, static_cast<int>(base), static_cast<int>(s));
        EXPECT_EMU(t, ours == cute, "encode_desc(%u, %u, %u, %u, %u) = %016llx, CuTe %016llx", start, lbo, sbo, base,
                   static_cast<unsigned>(s), (unsigned long long)ours, (unsigned long long)cute);
    }
}

// ---- 2. swizzle

void check_swizzle(const Decoders& d, Tally& t) {
    for (e90::Swizzle s : kModes)
        for (uint32_t a = 0; a < (256u << 10); ++a) {
            const uint32_t ours = d.swizzle_addr(a, s), cute = co::swizzle_addr(swizzle_bytes(s), a);
            EXPECT_EMU(t, ours == cute, "swizzle_addr(0x%x, sw%d) = 0x%x, CuTe 0x%x", a, swizzle_bytes(s), ours, cute);
        }
}

// ---- 3. operand fetch through CuTe's descriptors

void check_operands(const Decoders& d, Tally& t) {
    int n = 0;
    const co::GmmaTile* tiles = co::gmma_tiles(&n);
    for (int ti = 0; ti < n; ++ti) {
        const co::GmmaTile& tile = tiles[ti];
        const std::vector<int64_t> off = cute_tile(tile);
        const uint32_t eb = static_cast<uint32_t>(tile.elem_bits / 8), kper = 32 / eb;
        const e90::Major major = tile.major == co::Major::K ? e90::Major::K : e90::Major::MN;
        for (int mb = 0; mb < tile.mn / tile.inst_mn; ++mb)
            for (int kb = 0; kb < tile.k / static_cast<int>(kper); ++kb) {
                co::GmmaDesc c{};
                EXPECT_EMU(t, co::gmma_desc(tile, mb, kb, &c), "%s: no CuTe descriptor for block (%d, %d)",
                           tile_name(tile), mb, kb);
                const e90::SmemDesc x = d.decode_desc(c.raw);
                EXPECT_EMU(t,
                           x.start == c.start_offset && x.lbo == c.lbo && x.sbo == c.sbo &&
                               static_cast<int>(x.base_offset) == c.base_offset &&
                               static_cast<int>(x.swizzle) == c.layout_type && x.reserved == 0,
                           "%s block (%d, %d): decode_desc(%016llx) differs from CuTe's fields", tile_name(tile), mb,
                           kb, (unsigned long long)c.raw);
                for (uint32_t base : kBases) {
                    const uint64_t desc = c.raw + (base >> 4);  // start field += base (no carry: < 2^14)
                    const char* why = d.desc_problem(desc);
                    EXPECT_EMU(t, why == nullptr,
                               "%s block (%d, %d) at 0x%x: desc_problem refuses CuTe's descriptor: %s",
                               tile_name(tile), mb, kb, base, why ? why : "");
                    for (int i = 0; i < tile.inst_mn; ++i)
                        for (uint32_t k = 0; k < kper; ++k) {
                            const int mn = mb * tile.inst_mn + i;
                            const int kk = kb * static_cast<int>(kper) + static_cast<int>(k);
                            const int64_t want = base + off[static_cast<size_t>(mn) * tile.k + kk];
                            const uint32_t got = d.operand_addr(desc, major, eb, static_cast<uint32_t>(i), k);
                            EXPECT_EMU(t, got == want,
                                       "%s block (%d, %d) at 0x%x: element (%d, %u) read at 0x%x, CuTe: 0x%llx",
                                       tile_name(tile), mb, kb, base, i, k, got, (long long)want);
                        }
                }
            }
    }
}

// ---- 4. LBO where the layout has no use for it

// Whether CuTe's descriptor of `tile` carries an LBO the layout does not use: K-major swizzled
// (32 bytes of K stay inside one swizzle row), or MN-major swizzled with the instruction's MN
// extent inside one swizzle row (the kernels' N = 64 V descriptor).
bool lbo_unused(const co::GmmaTile& tile) {
    if (tile.swizzle_bytes == 0) return false;
    return tile.major == co::Major::K || tile.inst_mn * tile.elem_bits / 8 <= tile.swizzle_bytes;
}

void check_lbo_unused(const Decoders& d, Tally& t, int* tiles_checked) {
    int n = 0;
    const co::GmmaTile* tiles = co::gmma_tiles(&n);
    // LBO byte values: 0 (CuTe, MN-major), 16 (CuTe, K-major), our kernels' V slab strides (BN x
    // 128 bytes for BN = 64, 128), the largest, and random ones.
    std::vector<uint32_t> lbos = {0, 16, 8192, 16384, 0x3FFF0};
    for (int i = 0; i < 16; ++i) lbos.push_back(static_cast<uint32_t>(next_rand() & 0x3FFF) << 4);
    *tiles_checked = 0;
    for (int ti = 0; ti < n; ++ti) {
        const co::GmmaTile& tile = tiles[ti];
        if (!lbo_unused(tile)) continue;
        ++*tiles_checked;
        const uint32_t eb = static_cast<uint32_t>(tile.elem_bits / 8), kper = 32 / eb;
        const e90::Major major = tile.major == co::Major::K ? e90::Major::K : e90::Major::MN;
        for (int mb = 0; mb < tile.mn / tile.inst_mn; ++mb)
            for (int kb = 0; kb < tile.k / static_cast<int>(kper); ++kb) {
                co::GmmaDesc c{};
                if (!co::gmma_desc(tile, mb, kb, &c)) continue;  // reported by check_operands
                const uint64_t desc = c.raw + (0x400 >> 4);
                for (uint32_t lbo : lbos) {
                    const uint64_t other = (desc & ~(0x3FFFull << 16)) | (static_cast<uint64_t>(lbo >> 4) << 16);
                    bool same = true;
                    for (int i = 0; i < tile.inst_mn && same; ++i)
                        for (uint32_t k = 0; k < kper && same; ++k)
                            same = d.operand_addr(desc, major, eb, static_cast<uint32_t>(i), k) ==
                                   d.operand_addr(other, major, eb, static_cast<uint32_t>(i), k);
                    EXPECT_EMU(t, same, "%s block (%d, %d): the addresses depend on LBO (CuTe's %u vs %u)",
                               tile_name(tile), mb, kb, c.lbo, lbo);
                }
            }
    }
}

// ---- 5. TMA boxes of one swizzle row fill CuTe's tiles

// A K-major tile is a sequence of slabs (one atom column: mn rows of W bytes, W = swizzle width);
// an MN-major one, of k rows of W bytes. The kernels load one slab with one TMA box of W-byte
// rows (inner box extent = swizzle width, as the driver requires for swizzled maps).
void check_tma(const Decoders& d, Tally& t) {
    int n = 0;
    const co::GmmaTile* tiles = co::gmma_tiles(&n);
    for (int ti = 0; ti < n; ++ti) {
        const co::GmmaTile& tile = tiles[ti];
        if (tile.swizzle_bytes == 0) continue;
        const std::vector<int64_t> off = cute_tile(tile);
        const uint32_t eb = static_cast<uint32_t>(tile.elem_bits / 8), w = static_cast<uint32_t>(tile.swizzle_bytes);
        const bool kmaj = tile.major == co::Major::K;
        const uint32_t rows = static_cast<uint32_t>(kmaj ? tile.mn : tile.k);  // box rows = slab rows
        for (uint32_t base : kBases)
            for (int mn = 0; mn < tile.mn; ++mn)
                for (int k = 0; k < tile.k; ++k) {
                    const uint32_t row = static_cast<uint32_t>(kmaj ? mn : k);
                    const uint32_t inner = static_cast<uint32_t>(kmaj ? k : mn) * eb;  // byte in the contiguous dim
                    const uint32_t dst = base + (inner / w) * rows * w;
                    const uint32_t got = d.tma_smem_addr(dst, row * w + inner % w, cu_swizzle(tile.swizzle_bytes));
                    const int64_t want = base + off[static_cast<size_t>(mn) * tile.k + k];
                    EXPECT_EMU(t, got == want, "%s at 0x%x: TMA puts element (%d, %d) at 0x%x, CuTe has it at 0x%llx",
                               tile_name(tile), base, mn, k, got, (long long)want);
                }
    }
    // No swizzle: a box lands densely.
    for (uint32_t linear = 0; linear < 4096; ++linear)
        EXPECT_EMU(t, d.tma_smem_addr(0x1230, linear, 0) == 0x1230 + linear, "TMA without swizzle, byte %u", linear);
}

// ---- 6. wgmma register fragments

void check_wgmma_fragments(const Decoders& d, Tally& t) {
    for (int n = 8; n <= 256; n += 8)
        for (int th = 0; th < 128; ++th)
            for (int i = 0; i < n / 2; ++i) {
                const e90::RowCol o = d.acc_coord(th, i);
                const co::RowCol c = co::wgmma_c_map(n, th, i);
                EXPECT_EMU(t, o.row == c.row && o.col == c.col,
                           "acc_coord(N=%d, thread %d, reg %d) = (%d, %d), CuTe (%d, %d)", n, th, i, o.row, o.col,
                           c.row, c.col);
            }
    for (int th = 0; th < 128; ++th)
        for (int r = 0; r < 4; ++r) {
            for (int h = 0; h < 2; ++h) {
                const e90::RowCol o = d.a_reg_coord16(th, r, h);
                const co::RowCol c = co::wgmma_a_map(16, th, 2 * r + h);
                EXPECT_EMU(t, o.row == c.row && o.col == c.col,
                           "a_reg_coord16(thread %d, reg %d, half %d) = (%d, %d), CuTe (%d, %d)", th, r, h, o.row,
                           o.col, c.row, c.col);
            }
            for (int b = 0; b < 4; ++b) {
                const e90::RowCol o = d.a_reg_coord8(th, r, b);
                const co::RowCol c = co::wgmma_a_map(8, th, 4 * r + b);
                EXPECT_EMU(t, o.row == c.row && o.col == c.col,
                           "a_reg_coord8(thread %d, reg %d, byte %d) = (%d, %d), CuTe (%d, %d)", th, r, b, o.row, o.col,
                           c.row, c.col);
            }
        }
}

// ---- 7. sm_80 mma.sync and ldmatrix

void check_sm80_maps(const Decoders& d, Tally& t) {
    for (int l = 0; l < 32; ++l) {
        for (int r = 0; r < 4; ++r)
            for (int h = 0; h < 2; ++h) {
                const e80::RowCol o = d.mma_a_coord(l, r, h);
                const co::RowCol c = co::mma16816_a_map(l, 2 * r + h);
                EXPECT_EMU(t, o.row == c.row && o.col == c.col,
                           "mma_a_coord(lane %d, reg %d, half %d) = (%d, %d), CuTe (%d, %d)", l, r, h, o.row, o.col,
                           c.row, c.col);
            }
        for (int r = 0; r < 2; ++r)
            for (int h = 0; h < 2; ++h) {
                const e80::RowCol o = d.mma_b_coord(l, r, h);
                const co::RowCol c = co::mma16816_b_map(l, 2 * r + h);
                EXPECT_EMU(t, o.row == c.row && o.col == c.col,
                           "mma_b_coord(lane %d, reg %d, half %d) = (%d, %d), CuTe (%d, %d)", l, r, h, o.row, o.col,
                           c.row, c.col);
            }
        for (int i = 0; i < 4; ++i) {
            const e80::RowCol o = d.mma_c_coord(l, i);
            const co::RowCol c = co::mma16816_c_map(l, i);
            EXPECT_EMU(t, o.row == c.row && o.col == c.col, "mma_c_coord(lane %d, %d) = (%d, %d), CuTe (%d, %d)", l, i,
                       o.row, o.col, c.row, c.col);
        }
    }
    // Register m, half h of lane l: the emulator reads row rc.row of matrix m from the address
    // lane ldmatrix_row_lane(m, rc.row) supplied, at element rc.col.
    for (int num : {1, 2, 4})
        for (int trans = 0; trans < 2; ++trans)
            for (int l = 0; l < 32; ++l)
                for (int m = 0; m < num; ++m)
                    for (int h = 0; h < 2; ++h) {
                        const e80::RowCol rc = d.ldmatrix_coord(l, h, trans != 0);
                        const int lane = d.ldmatrix_row_lane(m, rc.row);
                        const co::LdsmSource c = co::ldmatrix_map(num, trans != 0, l, m, h);
                        EXPECT_EMU(t, lane == 8 * c.matrix + c.row && rc.col == c.col,
                                   "ldmatrix.x%d%s lane %d reg %d half %d: emulator reads lane %d's row at element %d, "
                                   "CuTe: matrix %d row %d (lane %d) element %d",
                                   num, trans ? ".trans" : "", l, m, h, lane, rc.col, c.matrix, c.row,
                                   8 * c.matrix + c.row, c.col);
                    }
}

// ---- mutants: each a plausible misreading; the check of its function must catch it

// operand_addr variants. 0: LBO and SBO roles swapped in MN-major swizzled layouts; 1: LBO
// ignored in MN-major swizzled layouts (MN runs on contiguously across swizzle rows); 2: the
// swizzle applied to the offset from the start address, not to the absolute address; 3: K-major
// without swizzle read with K contiguous (LBO ignored); 4: MN-major without swizzle with the
// swizzled form's LBO / SBO roles; 5: 8-bit elements read with the 16-bit geometry.
template <int V>
uint32_t operand_addr_mut(uint64_t desc, e90::Major major, uint32_t e, uint32_t mn, uint32_t k) {
    const e90::SmemDesc x = e90::decode_desc(desc);
    if (V == 5) e = 2;
    const uint32_t w = e90::swizzle_width(x.swizzle), t = 16 / e;
    const bool none = x.swizzle == e90::Swizzle::None;
    uint32_t off = 0;
    if (major == e90::Major::K) {
        if (none)
            off = V == 3 ? (mn % 8) * 16 + (mn / 8) * x.sbo + k * e
                         : (mn % 8) * 16 + (mn / 8) * x.sbo + (k % t) * e + (k / t) * x.lbo;
        else
            off = (mn % 8) * w + (mn / 8) * x.sbo + k * e;
    } else if (none) {
        off = V == 4 ? (mn % t) * e + (mn / t) * x.lbo + (k % 8) * 16 + (k / 8) * x.sbo
                     : (mn % t) * e + (mn / t) * x.sbo + (k % 8) * 16 + (k / 8) * x.lbo;
    } else {
        const uint32_t per_row = w / e;
        off = V == 0   ? (mn % per_row) * e + (mn / per_row) * x.sbo + (k % 8) * w + (k / 8) * x.lbo
              : V == 1 ? mn * e + (k % 8) * w + (k / 8) * x.sbo
                       : (mn % per_row) * e + (mn / per_row) * x.lbo + (k % 8) * w + (k / 8) * x.sbo;
    }
    return V == 2 ? x.start + e90::swizzle_addr(off, x.swizzle) : e90::swizzle_addr(x.start + off, x.swizzle);
}

// decode_desc variants. 0: the layout type read in CUtensorMapSwizzle order (1 = 32B, 3 = 128B);
// 1: base offset from bits 50-52; 2: a 13-bit LBO field.
template <int V>
e90::SmemDesc decode_desc_mut(uint64_t raw) {
    e90::SmemDesc x = e90::decode_desc(raw);
    if (V == 0 && (x.swizzle == e90::Swizzle::B128 || x.swizzle == e90::Swizzle::B32))
        x.swizzle = x.swizzle == e90::Swizzle::B128 ? e90::Swizzle::B32 : e90::Swizzle::B128;
    if (V == 1) x.base_offset = static_cast<uint32_t>((raw >> 50) & 7);
    if (V == 2) x.lbo &= 0x1FFFu << 4;
    return x;
}
// encode_desc with SBO at bit 33.
uint64_t encode_desc_mut(uint32_t start, uint32_t lbo, uint32_t sbo, uint32_t base, e90::Swizzle s) {
    const uint64_t d = e90::encode_desc(start, lbo, 0, base, s);
    return d | (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 33);
}
// desc_problem that also refuses a set LBO (a K-major swizzled descriptor must not carry one).
const char* desc_problem_mut(uint64_t d) {
    return e90::decode_desc(d).lbo != 0 ? "LBO set" : e90::desc_problem(d);
}

// swizzle_addr variants. 0: every mode XORs three bits (the 128B pattern); 1: the row index taken
// from bits [6, 6+B) instead of [7, 7+B).
template <int V>
uint32_t swizzle_addr_mut(uint32_t a, e90::Swizzle s) {
    if (s == e90::Swizzle::None) return a;
    if (V == 0) return e90::swizzle_addr(a, e90::Swizzle::B128);
    const uint32_t mask = (1u << e90::swizzle_bits(s)) - 1u;
    return a ^ (((a >> 6) & mask) << 4);
}
// tma_smem_addr with the CUtensorMapSwizzle values read in descriptor order (1 = 128B, 3 = 32B).
uint32_t tma_smem_addr_mut(uint32_t dst, uint32_t linear, uint32_t cu) {
    return e90::tma_smem_addr(dst, linear, cu == 1 ? 3 : cu == 3 ? 1 : cu);
}

// acc_coord variants. 0: register bits 0 and 1 swapped (row half <-> column); 1: lanes laid out
// 8 rows by 4 column pairs the other way round (row = lane % 8, column pair = lane / 8).
template <int V>
e90::RowCol acc_coord_mut(int t, int i) {
    if (V == 0) return e90::acc_coord(t, (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1));
    const int w = t / 32, l = t % 32;
    return e90::RowCol{16 * w + l % 8 + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (l / 8) + (i & 1)};
}
// a_reg_coord16 with registers 1 and 2 swapped (row half <-> k half).
e90::RowCol a_reg_coord16_mut(int t, int r, int h) { return e90::a_reg_coord16(t, ((r & 1) << 1) | (r >> 1), h); }
// a_reg_coord8 variants. 0: the accumulator-shaped map an FP8 P would need to be reused without a
// permutation (bytes 0-1 at columns 2q, 2q + 1, bytes 2-3 eight columns on); 1: registers 1 and 2
// swapped.
template <int V>
e90::RowCol a_reg_coord8_mut(int t, int r, int b) {
    if (V == 1) return e90::a_reg_coord8(t, ((r & 1) << 1) | (r >> 1), b);
    const int w = t / 32, l = t % 32;
    return e90::RowCol{16 * w + l / 4 + 8 * (r & 1), 16 * (r >> 1) + 8 * (b >> 1) + 2 * (l % 4) + (b & 1)};
}
e80::RowCol mma_a_coord_mut(int l, int r, int h) { return e80::mma_a_coord(l, r, 1 - h); }  // halves swapped
e80::RowCol mma_b_coord_mut(int l, int r, int h) { return e80::mma_b_coord(l, 1 - r, h); }  // registers swapped
e80::RowCol mma_c_coord_mut(int l, int i) {  // row half <-> column
    return e80::mma_c_coord(l, ((i & 1) << 1) | (i >> 1));
}
e80::RowCol ldmatrix_coord_mut(int l, int h, bool) { return e80::ldmatrix_coord(l, h, false); }  // .trans ignored
int ldmatrix_row_lane_mut(int m, int row) { return 4 * row + m; }  // matrices interleaved over the lanes

struct Mutant {
    const char* what;
    Decoders d;
    void (*check)(const Decoders&, Tally&);
};

void check_lbo_unused_only(const Decoders& d, Tally& t) {
    int tiles = 0;
    check_lbo_unused(d, t, &tiles);
}

void section(const char* what, const Tally& t) {
    std::printf("cute-oracle emu: %s: %ld checks, %s\n", what, t.checks, t.bad == 0 ? "equal to CuTe" : "MISMATCH");
}

}  // namespace

int check_emu() {
    int bad = 0;
    struct Group {
        const char* what;
        void (*check)(const Decoders&, Tally&);
    };
    const Group groups[] = {
        {"descriptor fields (decode_desc / encode_desc vs CuTe's GmmaDescriptor bitfield)", &check_desc_fields},
        {"swizzle_addr, 128B/64B/32B/none, every address of 256 KiB", &check_swizzle},
        {"operand_addr through CuTe's descriptors (every oracle tile and block, 4 bases; desc_problem accepts "
         "them)",
         &check_operands},
        {"tma_smem_addr: swizzle-row boxes fill CuTe's tiles (128B/64B/32B, 16- and 8-bit)", &check_tma},
        {"wgmma fragments: acc_coord (N = 8..256), a_reg_coord16, a_reg_coord8 (e4m3)", &check_wgmma_fragments},
        {"sm_80 mma_a/b/c_coord, ldmatrix_coord/row_lane (.x1/.x2/.x4, .trans)", &check_sm80_maps},
    };
    for (const Group& g : groups) {
        Tally t;
        g.check(kEmu, t);
        section(g.what, t);
        bad += t.bad != 0;
    }
    {
        Tally t;
        int tiles = 0;
        check_lbo_unused(kEmu, t, &tiles);
        char what[160];
        std::snprintf(what, sizeof what,
                      "operand_addr ignores LBO where the layout does not use it (%d tiles: K-major swizzled, "
                      "MN-major within one swizzle row such as the N = 64 V)",
                      tiles);
        section(what, t);
        bad += t.bad != 0 || tiles == 0;
    }

    // The same checks on deliberately wrong decoders: each must see a mismatch.
    auto with = [](auto set) {
        Decoders d = kEmu;
        set(d);
        return d;
    };
    const Mutant mutants[] = {
        {"MN-major LBO/SBO swapped", with([](Decoders& d) { d.operand_addr = &operand_addr_mut<0>; }), &check_operands},
        {"MN-major LBO ignored", with([](Decoders& d) { d.operand_addr = &operand_addr_mut<1>; }), &check_operands},
        {"swizzle of the relative offset", with([](Decoders& d) { d.operand_addr = &operand_addr_mut<2>; }),
         &check_operands},
        {"K-major interleave LBO ignored", with([](Decoders& d) { d.operand_addr = &operand_addr_mut<3>; }),
         &check_operands},
        {"MN-major interleave LBO/SBO roles", with([](Decoders& d) { d.operand_addr = &operand_addr_mut<4>; }),
         &check_operands},
        {"8-bit with 16-bit geometry", with([](Decoders& d) { d.operand_addr = &operand_addr_mut<5>; }),
         &check_operands},
        {"LBO read by the N = 64 V (LBO/SBO swapped)", with([](Decoders& d) { d.operand_addr = &operand_addr_mut<0>; }),
         &check_lbo_unused_only},
        {"layout type in TMA order", with([](Decoders& d) { d.decode_desc = &decode_desc_mut<0>; }),
         &check_desc_fields},
        {"base offset bits 50-52", with([](Decoders& d) { d.decode_desc = &decode_desc_mut<1>; }), &check_desc_fields},
        {"13-bit LBO field", with([](Decoders& d) { d.decode_desc = &decode_desc_mut<2>; }), &check_desc_fields},
        {"SBO at bit 33", with([](Decoders& d) { d.encode_desc = &encode_desc_mut; }), &check_desc_fields},
        {"desc_problem refuses CuTe's LBO", with([](Decoders& d) { d.desc_problem = &desc_problem_mut; }),
         &check_operands},
        {"swizzle 3 bits in every mode", with([](Decoders& d) { d.swizzle_addr = &swizzle_addr_mut<0>; }),
         &check_swizzle},
        {"swizzle row from bit 6", with([](Decoders& d) { d.swizzle_addr = &swizzle_addr_mut<1>; }), &check_swizzle},
        {"TMA swizzle values reversed", with([](Decoders& d) { d.tma_smem_addr = &tma_smem_addr_mut; }), &check_tma},
        {"accumulator bits swapped", with([](Decoders& d) { d.acc_coord = &acc_coord_mut<0>; }),
         &check_wgmma_fragments},
        {"accumulator lanes transposed", with([](Decoders& d) { d.acc_coord = &acc_coord_mut<1>; }),
         &check_wgmma_fragments},
        {"A16 registers 1/2 swapped", with([](Decoders& d) { d.a_reg_coord16 = &a_reg_coord16_mut; }),
         &check_wgmma_fragments},
        {"A8 accumulator-shaped", with([](Decoders& d) { d.a_reg_coord8 = &a_reg_coord8_mut<0>; }),
         &check_wgmma_fragments},
        {"A8 registers 1/2 swapped", with([](Decoders& d) { d.a_reg_coord8 = &a_reg_coord8_mut<1>; }),
         &check_wgmma_fragments},
        {"mma A halves", with([](Decoders& d) { d.mma_a_coord = &mma_a_coord_mut; }), &check_sm80_maps},
        {"mma B registers", with([](Decoders& d) { d.mma_b_coord = &mma_b_coord_mut; }), &check_sm80_maps},
        {"mma C bits", with([](Decoders& d) { d.mma_c_coord = &mma_c_coord_mut; }), &check_sm80_maps},
        {"ldmatrix .trans ignored", with([](Decoders& d) { d.ldmatrix_coord = &ldmatrix_coord_mut; }),
         &check_sm80_maps},
        {"ldmatrix lanes interleaved", with([](Decoders& d) { d.ldmatrix_row_lane = &ldmatrix_row_lane_mut; }),
         &check_sm80_maps},
    };
    int detected = 0, tried = 0;
    for (const Mutant& m : mutants) {
        Tally t;
        t.quiet = true;
        m.check(m.d, t);
        ++tried;
        if (t.bad > 0)
            ++detected;
        else
            std::printf("  MUTANT NOT DETECTED: %s (%ld checks)\n", m.what, t.checks);
    }
    std::printf("cute-oracle emu: mutations (operand addressing x6, LBO use, descriptor fields x4, desc_problem, "
                "swizzle x2, TMA, accumulator x2, A16, A8 x2, mma A/B/C, ldmatrix x2): %d of %d detected\n",
                detected, tried);
    bad += detected != tried;
    return bad;
}

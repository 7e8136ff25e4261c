// The sm_100a (tcgen05) encodings against CuTe (cute_maps_sm100.h): the FA4 kernels' descriptor
// builders (cuda/sm100/tcgen05.cuh) and the emulator's decoders (cuda/test/emu/
// sm100_layouts.h).
//  1. descriptor fields: decode_umma_desc equals CuTe's UMMA::SmemDescriptor bitfield on edge-case
//     and random 64-bit values, encode_umma_desc equals CuTe's packing of the same fields;
//  2. instruction descriptor: fa4::umma_idesc_f16 equals CuTe's make_instr_desc for every form the
//     kernels issue (f16 / bf16, M 128, N 64 / 128, B K- or MN-major), and decode_idesc equals
//     CuTe's InstrDescriptor bitfield on random values;
//  3. the kernels' smem descriptors: for the Q/K/P slab (K-major SW128) and the V tiles (MN-major
//     SW128, N = 64 and 128), every field but the start address of fa4::umma_desc_*_sw128 equals
//     CuTe's make_umma_desc of the same instruction block (CuTe writes start 0 on the host; LBO of
//     the N = 64 V is never read and is not compared), and the start advance per k block equals
//     CuTe's layout offset of the block's first element;
//  4. operand fetch: sm100::operand_addr through the kernels' descriptors finds every element of
//     every instruction block where CuTe's layout has it (tile at a 1024-aligned address);
//  5. mutations: a decoder with the layout field misread, and an MN-major fetch with LBO and SBO
//     swapped, are detected.
#include <array>
#include <cstdio>
#include <random>
#include <vector>

#include "cute_maps_sm100.h"
#include "sm100_layouts.h"
#include "sm100/tcgen05.cuh"

namespace {

namespace co = cute_oracle::sm100;
namespace e100 = emu::sm100;
namespace e90 = emu::sm90;

int report(const char* what, long checks, long bad) {
    if (bad) std::printf("cute-oracle sm100: %s: %ld of %ld checks DIFFER from CuTe\n", what, bad, checks);
    else std::printf("cute-oracle sm100: %s: equal to CuTe: %ld checks\n", what, checks);
    return bad ? 1 : 0;
}

bool fields_equal(const e100::UmmaDesc& e, const co::UmmaDescFields& c) {
    return e.start == c.start << 4 && e.lbo == c.lbo << 4 && e.sbo == c.sbo << 4 && e.version == c.version &&
           e.base_offset == c.base_offset && e.lbo_mode == c.lbo_mode && e.layout == c.layout;
}

int check_desc_fields() {
    long n = 0, bad = 0;
    std::mt19937_64 rng(17);
    std::vector<uint64_t> vals = {0, ~0ull};
    for (int b = 0; b < 64; ++b) vals.push_back(1ull << b), vals.push_back(~(1ull << b));
    for (int i = 0; i < 20000; ++i) vals.push_back(rng());
    for (uint64_t v : vals) {
        const e100::UmmaDesc e = e100::decode_umma_desc(v);
        const co::UmmaDescFields c = co::umma_desc_fields(v);
        ++n;
        if (!fields_equal(e, c)) ++bad;
        // Every bit outside CuTe's fields is what the emulator calls reserved.
        ++n;
        if ((v ^ co::umma_desc_pack(c)) != e.reserved) ++bad;
    }
    for (int i = 0; i < 20000; ++i) {
        const uint32_t start = (rng() & 0x3FFF) << 4, lbo = (rng() & 0x3FFF) << 4, sbo = (rng() & 0x3FFF) << 4;
        const uint32_t base = rng() & 7;
        const e100::Layout lay = std::array<e100::Layout, 4>{e100::Layout::None, e100::Layout::B128, e100::Layout::B64,
                                                             e100::Layout::B32}[rng() % 4];
        const uint64_t ours = e100::encode_umma_desc(start, lbo, sbo, base, lay);
        const uint64_t cute = co::umma_desc_pack({start >> 4, lbo >> 4, sbo >> 4, 1, base, 0, static_cast<uint32_t>(lay)});
        ++n;
        if (ours != cute) ++bad;
    }
    return report("UMMA descriptor fields (decode_umma_desc, encode_umma_desc)", n, bad);
}

int check_idesc() {
    long n = 0, bad = 0;
    for (bool bf16 : {false, true})
        for (int nn : {64, 128})
            for (bool a_mn : {false, true})
                for (bool b_mn : {false, true}) {
                    uint32_t cute = 0;
                    if (!co::make_idesc_f16(bf16, 128, nn, a_mn, b_mn, &cute)) {
                        ++bad;
                        continue;
                    }
                    ++n;
                    if (fa4::umma_idesc_f16(bf16, 128, nn, a_mn, b_mn) != cute) {
                        std::printf("  idesc bf16=%d n=%d a_mn=%d b_mn=%d: ours 0x%08x, CuTe 0x%08x\n", bf16, nn, a_mn,
                                    b_mn, fa4::umma_idesc_f16(bf16, 128, nn, a_mn, b_mn), cute);
                        ++bad;
                    }
                    ++n;
                    if (e100::idesc_problem(cute, false) != nullptr) ++bad;  // the emulator accepts CuTe's
                }
    std::mt19937 rng(5);
    for (int i = 0; i < 20000; ++i) {
        const uint32_t v = rng();
        const e100::Idesc e = e100::decode_idesc(v);
        const co::IdescFields c = co::idesc_fields(v);
        ++n;
        if (e.sparse_sel != c.sparse_id2 || e.sparse != c.sparse_flag || e.saturate != c.saturate ||
            e.d_format != c.c_format || e.a_format != c.a_format || e.b_format != c.b_format ||
            e.a_negate != c.a_negate || e.b_negate != c.b_negate || e.a_major != c.a_major || e.b_major != c.b_major ||
            e.n != static_cast<int>(c.n_dim << 3) || e.m != static_cast<int>(c.m_dim << 4) || e.max_shift != c.max_shift)
            ++bad;
    }
    return report("instruction descriptor (umma_idesc_f16, decode_idesc)", n, bad);
}

// The kernels' descriptor of tile `kind`'s block kb at tile address `base` (1024-aligned), as
// cuda/fa4/tile.cuh builds it (issue_qk / issue_pv: K-major +32 bytes per k block inside a
// slab; MN-major +16 rows of 128 bytes per k block, LBO = the slab stride of 128 rows).
uint64_t kernel_desc(int kind, uint32_t base, int kb) {
    if (kind == 0) return fa4::umma_desc_kmajor_sw128(base + kb * fa4::kUmmaKBytes);
    return fa4::umma_desc_mnmajor_sw128(base + kb * fa4::kUmmaK * fa4::kSwizzleBytes, 128 * fa4::kSwizzleBytes);
}

using FetchFn = uint32_t (*)(uint64_t, e90::Major, uint32_t, uint32_t, uint32_t);
uint32_t fetch_ok(uint64_t d, e90::Major m, uint32_t e, uint32_t mn, uint32_t k) { return e100::operand_addr(d, m, e, mn, k); }
// Mutant: LBO and SBO swapped for MN-major operands.
uint32_t fetch_swapped(uint64_t d, e90::Major m, uint32_t e, uint32_t mn, uint32_t k) {
    if (m == e90::Major::K) return e100::operand_addr(d, m, e, mn, k);
    const e100::UmmaDesc x = e100::decode_umma_desc(d);
    const uint64_t s = e100::encode_umma_desc(x.start, x.sbo, x.lbo, x.base_offset, static_cast<e100::Layout>(x.layout));
    return e100::operand_addr(s, m, e, mn, k);
}

long tiles_mismatches(FetchFn fetch, long* checks) {
    long bad = 0;
    const uint32_t base = 0x8000;  // 1024-aligned
    for (int kind = 0; kind < 3; ++kind) {
        const int mn = co::umma_tile_mn(kind), kx = co::umma_tile_k(kind);
        const e90::Major major = kind == 0 ? e90::Major::K : e90::Major::MN;
        for (int kb = 0; kb < kx / 16; ++kb) {
            const uint64_t ours = kernel_desc(kind, base, kb);
            uint64_t cute = 0;
            if (!co::umma_tile_desc(kind, kb, &cute)) return ++bad;
            const e100::UmmaDesc o = e100::decode_umma_desc(ours);
            const co::UmmaDescFields c = co::umma_desc_fields(cute);
            ++*checks;
            const bool lbo_read = kind == 2;  // K-major swizzled and the N = 64 V never read LBO
            if (o.sbo != c.sbo << 4 || o.version != c.version || o.layout != c.layout || o.base_offset != c.base_offset ||
                o.lbo_mode != c.lbo_mode || (lbo_read && o.lbo != c.lbo << 4))
                ++bad;
            ++*checks;
            if (o.start != base + static_cast<uint32_t>(co::umma_tile_offset(kind, 0, 16 * kb))) ++bad;
            for (int i = 0; i < mn; ++i)
                for (int k = 0; k < 16; ++k) {
                    ++*checks;
                    const uint32_t want = base + static_cast<uint32_t>(co::umma_tile_offset(kind, i, 16 * kb + k));
                    if (fetch(ours, major, 2, static_cast<uint32_t>(i), static_cast<uint32_t>(k)) != want) ++bad;
                }
        }
    }
    return bad;
}

int check_tiles() {
    long n = 0;
    const long bad = tiles_mismatches(fetch_ok, &n);
    return report("FA4 descriptors and operand fetch (Q/K/P K-major slab, V MN-major N = 64 / 128)", n, bad);
}

int check_mutations() {
    int detected = 0, total = 0;
    long n = 0;
    ++total;
    detected += tiles_mismatches(fetch_swapped, &n) > 0;
    ++total;
    {  // layout field read from bit 62 (the sm_90 position) instead of 61
        long bad = 0;
        std::mt19937_64 rng(3);
        for (int i = 0; i < 1000; ++i) {
            const uint64_t v = rng();
            if (static_cast<uint32_t>((v >> 62) & 3) != co::umma_desc_fields(v).layout) ++bad;
        }
        detected += bad > 0;
    }
    std::printf("cute-oracle sm100: mutations (MN-major LBO/SBO swapped, layout field at the sm_90 position): %d of %d "
                "detected\n",
                detected, total);
    return detected == total ? 0 : 1;
}

}  // namespace

int check_sm100() { return check_desc_fields() + check_idesc() + check_tiles() + check_mutations(); }

// Checks of the emulator's layout functions (sm80_layouts.h, sm90_layouts.h), run by
// tests/emulator/forward.rs: their own properties (bijections, involutions, round trips), and that the
// kernels' encoders (the descriptors, tile offsets and fragment indices of sm90/wgmma.cuh,
// fa3/traits.cuh and fa2/layout.h) address exactly the elements the emulator's decoders read.
// Both sides share one reading of the PTX ISA; an oracle that is not ours (CuTe) checks the
// decoders separately. Exit status 0 when every check holds.
#include <cstdio>
#include <cstdlib>
#include <set>
#include <utility>

#include "fa2/layout.h"
#include "fa3/traits.cuh"
#include "sm80_layouts.h"
#include "sm90_layouts.h"

namespace {

int g_checks = 0, g_failures = 0;
#define EXPECT(c, ...)                                                    \
    do {                                                                  \
        ++g_checks;                                                       \
        if (!(c) && g_failures++ < 20) {                                  \
            std::printf("FAILED %s (line %d): ", #c, __LINE__);           \
            std::printf(__VA_ARGS__);                                     \
            std::printf("\n");                                            \
        }                                                                 \
    } while (0)

using namespace emu::sm90;

void swizzle_properties() {
    for (Swizzle s : {Swizzle::None, Swizzle::B32, Swizzle::B64, Swizzle::B128}) {
        std::set<uint32_t> seen;
        for (uint32_t a = 0x400; a < 0x400 + 4096; ++a) {
            const uint32_t b = swizzle_addr(a, s);
            EXPECT(swizzle_addr(b, s) == a, "involution, mode %u addr 0x%x", static_cast<unsigned>(s), a);
            EXPECT(b / swizzle_repeat(s) == a / swizzle_repeat(s) || s == Swizzle::None, "stays in its pattern block");
            EXPECT((b & 15) == (a & 15), "moves whole 16-byte chunks");
            seen.insert(b);
        }
        EXPECT(seen.size() == 4096, "a permutation");
    }
    // 128B: chunk index XOR row index inside an 8 x 128-byte atom.
    for (uint32_t r = 0; r < 8; ++r)
        for (uint32_t c = 0; c < 8; ++c) EXPECT(swizzle_addr(r * 128 + c * 16, Swizzle::B128) == r * 128 + ((c ^ r) * 16), "SW128");
}

void descriptor_round_trip() {
    for (uint32_t start : {0u, 0x400u, 0x1230u, 0x3FFF0u})
        for (uint32_t lbo : {16u, 1024u, 8192u})
            for (uint32_t sbo : {256u, 1024u})
                for (Swizzle s : {Swizzle::None, Swizzle::B32, Swizzle::B64, Swizzle::B128}) {
                    const SmemDesc d = decode_desc(encode_desc(start, lbo, sbo, 0, s));
                    EXPECT(d.start == start && d.lbo == lbo && d.sbo == sbo && d.swizzle == s && d.reserved == 0,
                           "round trip 0x%x", start);
                }
    EXPECT(desc_problem(encode_desc(0x480, 16, 1024, 0, Swizzle::B128)) != nullptr, "phase 1 needs base_offset 1");
    EXPECT(desc_problem(encode_desc(0x480, 16, 1024, 1, Swizzle::B128)) == nullptr, "phase 1 with base_offset 1");
    EXPECT(desc_problem(encode_desc(0x420, 16, 1024, 0, Swizzle::B128)) == nullptr, "k-step advance inside a row");
    EXPECT(desc_problem(encode_desc(0x400, 16, 1024, 0, Swizzle::B128) | (1ull << 47)) != nullptr, "reserved bit");
}

void fragment_bijections() {
    for (int n : {8, 64, 256}) {
        std::set<std::pair<int, int>> acc;
        for (int t = 0; t < 128; ++t)
            for (int i = 0; i < n / 2; ++i) {
                const RowCol rc = acc_coord(t, i);
                EXPECT(rc.row >= 0 && rc.row < 64 && rc.col >= 0 && rc.col < n, "accumulator in range");
                acc.insert({rc.row, rc.col});
            }
        EXPECT(static_cast<int>(acc.size()) == 64 * n, "accumulator m64n%d covered once", n);
    }
    std::set<std::pair<int, int>> a16, a8;
    for (int t = 0; t < 128; ++t)
        for (int r = 0; r < 4; ++r) {
            for (int h = 0; h < 2; ++h) a16.insert({a_reg_coord16(t, r, h).row, a_reg_coord16(t, r, h).col});
            for (int b = 0; b < 4; ++b) a8.insert({a_reg_coord8(t, r, b).row, a_reg_coord8(t, r, b).col});
        }
    EXPECT(a16.size() == 64 * 16 && a8.size() == 64 * 32, "A fragments cover m64k16 / m64k32 once");
    for (Swizzle s : {Swizzle::None, Swizzle::B32, Swizzle::B64, Swizzle::B128})
        for (uint32_t e : {1u, 2u}) {
            std::set<uint32_t> k_addrs, mn_addrs;
            const uint32_t w = swizzle_width(s);
            const uint64_t dk = encode_desc(0x1000, s == Swizzle::None ? 1024 : 16, s == Swizzle::None ? 128 : 8 * w, 0, s);
            // MN-major: K groups of 8 rows SBO apart, the next swizzle row of MN LBO apart.
            const uint64_t dm = s == Swizzle::None ? encode_desc(0x1000, 128, 256, 0, s) : encode_desc(0x1000, 16 * w, 8 * w, 0, s);
            const uint32_t kk = 32 / e;
            for (uint32_t mn = 0; mn < 64; ++mn)
                for (uint32_t k = 0; k < kk; ++k) {
                    k_addrs.insert(operand_addr(dk, Major::K, e, mn, k));
                    if (e == 2 && (s != Swizzle::None || mn < 64)) mn_addrs.insert(operand_addr(dm, Major::MN, e, mn, k));
                }
            EXPECT(k_addrs.size() == 64 * kk, "K-major mode %u e%u: distinct addresses", static_cast<unsigned>(s), e);
            if (e == 2) EXPECT(mn_addrs.size() == 64 * kk, "MN-major mode %u: distinct addresses", static_cast<unsigned>(s));
        }
}

// The FA3 kernel's descriptors and offsets against the decoder, for every stage and head dim.
template <int Stage, int D>
void fa3_operands() {
    using Tr = fa3::Fa3Traits<Stage, D>;
    const uint32_t q = 0x400, k = q + Tr::kQBytes, v = k + Tr::kKTileBytes;  // 1024-aligned tiles
    for (int cw = 0; cw < Tr::kConsumerWarpgroups; ++cw)
        for (int kk = 0; kk < D / fa3::kMmaK; ++kk) {
            const uint64_t da = fa3::desc_kmajor_sw128(q + Tr::q_warpgroup_offset(cw) + Tr::qk_a_offset(kk));
            EXPECT(desc_problem(da) == nullptr, "Q descriptor accepted");
            for (uint32_t m = 0; m < 64; ++m)
                for (uint32_t c = 0; c < 16; ++c)
                    EXPECT(operand_addr(da, Major::K, 2, m, c) ==
                               q + static_cast<uint32_t>(fa3::sw128_offset(64 * cw + m, 16 * kk + c, Tr::kBlockM)),
                           "stage %d D %d: Q (A) cw %d kk %d m %u k %u", Stage, D, cw, kk, m, c);
            for (int nh = 0; nh < Tr::kBlockN / fa3::kMmaN; ++nh) {
                const uint64_t db = fa3::desc_kmajor_sw128(k + Tr::qk_b_offset(kk, nh));
                for (uint32_t n = 0; n < 64; ++n)
                    for (uint32_t c = 0; c < 16; ++c)
                        EXPECT(operand_addr(db, Major::K, 2, n, c) ==
                                   k + static_cast<uint32_t>(fa3::sw128_offset(64 * nh + n, 16 * kk + c, Tr::kBlockN)),
                               "stage %d D %d: K (B) kk %d nh %d", Stage, D, kk, nh);
            }
        }
    for (int kk = 0; kk < Tr::kBlockN / fa3::kMmaK; ++kk)
        for (int nh = 0; nh < D / fa3::kMmaN; ++nh) {
            const uint64_t db = fa3::desc_mnmajor_sw128(v + Tr::pv_b_offset(kk, nh), Tr::kKvSlabStride);
            EXPECT(desc_problem(db) == nullptr, "V descriptor accepted");
            for (uint32_t n = 0; n < 64; ++n)
                for (uint32_t c = 0; c < 16; ++c)
                    EXPECT(operand_addr(db, Major::MN, 2, n, c) ==
                               v + static_cast<uint32_t>(fa3::sw128_offset(16 * kk + c, 64 * nh + n, Tr::kBlockN)),
                           "stage %d D %d: V (B, MN-major) kk %d nh %d", Stage, D, kk, nh);
        }
    // TMA boxes {64 columns, rows}: box element (r, c) lands where the kernel's tile layout says.
    for (int slab = 0; slab < Tr::kSlabs; ++slab) {
        for (int rb = 0; rb < Tr::kBlockM / Tr::kTmaBoxRowsQ; ++rb)
            for (uint32_t r = 0; r < static_cast<uint32_t>(Tr::kTmaBoxRowsQ); ++r)
                for (uint32_t c = 0; c < 64; ++c)
                    EXPECT(tma_smem_addr(q + Tr::q_box_offset(slab, rb), r * 128 + c * 2, 3) ==
                               q + static_cast<uint32_t>(fa3::sw128_offset(64 * rb + r, 64 * slab + c, Tr::kBlockM)),
                           "Q box");
        for (uint32_t r = 0; r < static_cast<uint32_t>(Tr::kTmaBoxRowsKv); ++r)
            for (uint32_t c = 0; c < 64; ++c)
                EXPECT(tma_smem_addr(k + Tr::kv_box_offset(slab), r * 128 + c * 2, 3) ==
                           k + static_cast<uint32_t>(fa3::sw128_offset(r, 64 * slab + c, Tr::kBlockN)),
                       "K/V box");
    }
}

void fa3_fragments() {
    for (int t = 0; t < 128; ++t) {
        const int w = t / 32, g = (t % 32) / 4, q = t % 4;
        for (int j = 0; j < 32; ++j)
            for (int h = 0; h < 2; ++h)
                for (int e = 0; e < 2; ++e) {
                    const RowCol rc = acc_coord(t, fa3::acc_index(j, h, e));
                    EXPECT(rc.row == 16 * w + g + 8 * h && rc.col == 8 * j + 2 * q + e, "acc_index");
                }
        // P = exp(S) goes from S's accumulator straight into PV's A fragment (no data movement):
        // A register r, half h of key step k must be the accumulator element at the same
        // (row, 16k + col).
        for (int k = 0; k < 8; ++k)
            for (int r = 0; r < 4; ++r)
                for (int h = 0; h < 2; ++h) {
                    const RowCol a = a_reg_coord16(t, r, h);
                    const RowCol s = acc_coord(t, fa3::acc_to_a_index(k, r) + h);
                    EXPECT(a.row == s.row && 16 * k + a.col == s.col, "acc_to_a_index k %d r %d h %d", k, r, h);
                }
    }
}

void fa2_fragments() {
    using namespace emu::sm80;
    for (int l = 0; l < 32; ++l) {
        for (int i = 0; i < 4; ++i)
            EXPECT(mma_c_coord(l, i).row == fa2::acc_row(l, i) && mma_c_coord(l, i).col == fa2::acc_col(l, i), "C/D");
        for (int r = 0; r < 4; ++r)
            for (int h = 0; h < 2; ++h) {
                EXPECT(mma_a_coord(l, r, h).row == fa2::a_row(l, r) && mma_a_coord(l, r, h).col == fa2::a_col(l, r, h), "A");
                // P's A fragment from the two S tiles of the k-slice.
                const emu::sm80::RowCol c = mma_c_coord(l, fa2::p_src_elem(r, h));
                EXPECT(mma_a_coord(l, r, h).row == c.row && mma_a_coord(l, r, h).col == 8 * fa2::p_src_tile(r) + c.col,
                       "P reuse");
            }
        for (int r = 0; r < 2; ++r)
            for (int h = 0; h < 2; ++h)
                EXPECT(mma_b_coord(l, r, h).row == fa2::b_row(l, r, h) && mma_b_coord(l, r, h).col == fa2::b_col(l), "B");
    }
    // ldmatrix with the kernel's lane -> row-address maps delivers the mma fragments: register m,
    // half h of lane l comes from row `rc.row` of matrix m, i.e. from the address lane
    // 8m + rc.row supplies, at column rc.col.
    for (int l = 0; l < 32; ++l)
        for (int m = 0; m < 4; ++m)
            for (int h = 0; h < 2; ++h) {
                const emu::sm80::RowCol q = ldmatrix_coord(l, h, false);
                const int src = ldmatrix_row_lane(m, q.row);
                // Q (A operand, [m][k]): element (row, col) of the 16x16 block.
                const int qr = fa2::ldsm_q_row(src), qc = fa2::ldsm_q_col(src) + q.col;
                EXPECT(qr == mma_a_coord(l, m, h).row && qc == mma_a_coord(l, m, h).col, "ldmatrix Q lane %d m %d", l, m);
                // K ([n][k], B "col"): registers 0-1 are n-tile 0's b0/b1, 2-3 n-tile 1's.
                const int kr = fa2::ldsm_k_row(src), kc = fa2::ldsm_k_col(src) + q.col;
                const emu::sm80::RowCol kb = mma_b_coord(l, m % 2, h);
                EXPECT(kr == 8 * (m / 2) + kb.col && kc == kb.row, "ldmatrix K lane %d m %d", l, m);
                // V ([k][n], .trans): registers 0-1 are d-tile 0's b0/b1, 2-3 d-tile 1's.
                const emu::sm80::RowCol t = ldmatrix_coord(l, h, true);
                const int tsrc = ldmatrix_row_lane(m, t.row);
                const int vr = fa2::ldsm_v_row(tsrc), vc = fa2::ldsm_v_col(tsrc) + t.col;
                const emu::sm80::RowCol vb = mma_b_coord(l, m % 2, h);
                EXPECT(vr == vb.row && vc == 8 * (m / 2) + vb.col, "ldmatrix V lane %d m %d", l, m);
            }
}

}  // namespace

int main() {
    swizzle_properties();
    descriptor_round_trip();
    fragment_bijections();
    fa3_operands<1, 64>();
    fa3_operands<1, 128>();
    fa3_operands<1, 256>();
    fa3_operands<2, 128>();
    fa3_operands<3, 64>();
    fa3_operands<3, 128>();
    fa3_operands<3, 256>();
    fa3_operands<5, 256>();
    fa3_fragments();
    fa2_fragments();
    std::printf("%d layout checks, %d failed\n", g_checks, g_failures);
    return g_failures ? 1 : 0;
}

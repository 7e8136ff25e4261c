// The FA2 (sm_80) layouts against CuTe (cute_maps.h): the kernel's fragment helpers in
// cuda/fa2/layout.h and the PTX ISA models of cuda/test/fa2_layout_test.cpp (compiled in
// here with its main renamed, so its own spec_* maps and ldmatrix model are the ones checked).
//
// Checked:
//  1. mma.sync m16n8k16 A / B / C fragment maps: fa2/layout.h and the test's spec_* == CuTe's
//     MMA_Traits<SM80_16x8x16_F32BF16BF16F32_TN> (f16 identical, static_assert in cute_maps.cpp);
//  2. ldmatrix .x4 and .x4.trans: the test's ldmatrix model == CuTe's Copy_Traits
//     <SM75_U32x4_LDSM_N> / <SM75_U16x8_LDSM_T> (which lane's row, which element of it);
//  3. the kernel's ldmatrix addressing (ldsm_{q,k,v}_{row,col}) composed with CuTe's ldmatrix
//     map delivers exactly CuTe's mma A fragment (Q), B fragments of two n-tiles (K) and, through
//     .trans, of two d-tiles (V);
//  4. P reuse (p_src_tile / p_src_elem): CuTe's A fragment element == the C element it is
//     packed from.
#include <cstdio>

#include "cute_maps.h"
#include "expect.h"

#define main fa2_layout_test_main
#include "../fa2_layout_test.cpp"
#undef main

namespace {

namespace co = cute_oracle;

co::Expect g_sm80{"sm80"};
#define EXPECT80(cond, ...) CUTE_ORACLE_EXPECT(g_sm80, cond, __VA_ARGS__)

void check_mma_maps() {
    const long c0 = g_sm80.cases;
    const int b0 = g_sm80.bad;
    for (int l = 0; l < 32; ++l) {
        for (int v = 0; v < 8; ++v) {
            const co::RowCol a = co::mma16816_a_map(l, v);
            EXPECT80(fa2::a_row(l, v / 2) == a.row && fa2::a_col(l, v / 2, v % 2) == a.col, "fa2 A lane %d value %d", l, v);
            EXPECT80(spec_a_row(l, v) == a.row && spec_a_col(l, v) == a.col, "spec A lane %d value %d", l, v);
        }
        for (int v = 0; v < 4; ++v) {
            const co::RowCol b = co::mma16816_b_map(l, v);
            EXPECT80(fa2::b_row(l, v / 2, v % 2) == b.row && fa2::b_col(l) == b.col, "fa2 B lane %d value %d", l, v);
            EXPECT80(spec_b_row(l, v) == b.row && spec_b_col(l) == b.col, "spec B lane %d value %d", l, v);
            const co::RowCol c = co::mma16816_c_map(l, v);
            EXPECT80(fa2::acc_row(l, v) == c.row && fa2::acc_col(l, v) == c.col, "fa2 C lane %d value %d", l, v);
            EXPECT80(spec_c_row(l, v) == c.row && spec_c_col(l, v) == c.col, "spec C lane %d value %d", l, v);
        }
    }
    g_sm80.section("mma.m16n8k16 A/B/C fragments (fa2/layout.h, fa2_layout_test spec_*)", c0, b0);
}

void check_ldmatrix_model() {
    const long c0 = g_sm80.cases;
    const int b0 = g_sm80.bad;
    // 32 rows of 8 elements; element (row s, col c) holds 8 s + c; lane s addresses row s.
    std::vector<double> smem(32 * 8);
    for (int i = 0; i < 32 * 8; ++i) smem[i] = i;
    int addr[32];
    for (int s = 0; s < 32; ++s) addr[s] = 8 * s;
    for (int trans = 0; trans < 2; ++trans) {
        Reg r[32][4];
        ldmatrix(r, smem, addr, trans != 0);
        for (int l = 0; l < 32; ++l)
            for (int reg = 0; reg < 4; ++reg)
                for (int h = 0; h < 2; ++h) {
                    const co::LdsmSource src = co::ldmatrix_map(4, trans != 0, l, reg, h);
                    const double want = 8 * (8 * src.matrix + src.row) + src.col;
                    const double got = h ? r[l][reg].hi : r[l][reg].lo;
                    EXPECT80(got == want, "ldmatrix%s lane %d reg %d half %d: model %g CuTe %g", trans ? ".trans" : "", l,
                             reg, h, got, want);
                }
    }
    g_sm80.section("ldmatrix .x4 / .x4.trans (fa2_layout_test model)", c0, b0);
}

// The element of the 16x16 block (row, col) that (lane, reg, half) receives when lane s supplies
// the address of block row row_of(s), columns col_of(s) .. col_of(s) + 7.
struct Elem {
    int row, col;
};
Elem ldsm_elem(int (*row_of)(int), int (*col_of)(int), bool trans, int lane, int reg, int half) {
    const co::LdsmSource src = co::ldmatrix_map(4, trans, lane, reg, half);
    const int s = 8 * src.matrix + src.row;
    return Elem{row_of(s), col_of(s) + src.col};
}

void check_kernel_addressing() {
    const long c0 = g_sm80.cases;
    const int b0 = g_sm80.bad;
    for (int l = 0; l < 32; ++l)
        for (int reg = 0; reg < 4; ++reg)
            for (int h = 0; h < 2; ++h) {
                // Q (row-major [query][d]) -> A fragment: registers 0..3 = a0..a3.
                const Elem q = ldsm_elem(fa2::ldsm_q_row, fa2::ldsm_q_col, false, l, reg, h);
                const co::RowCol a = co::mma16816_a_map(l, 2 * reg + h);
                EXPECT80(q.row == a.row && q.col == a.col, "Q lane %d reg %d half %d", l, reg, h);
                // K ([key][d]) -> B fragments of n-tiles reg / 2 (b0, b1 = reg % 2): (k = d, n = key).
                const Elem k = ldsm_elem(fa2::ldsm_k_row, fa2::ldsm_k_col, false, l, reg, h);
                const co::RowCol bk = co::mma16816_b_map(l, 2 * (reg % 2) + h);
                EXPECT80(k.col == bk.row && k.row == bk.col + 8 * (reg / 2), "K lane %d reg %d half %d", l, reg, h);
                // V ([key][d], .trans) -> B fragments of d-tiles reg / 2: (k = key, n = d).
                const Elem v = ldsm_elem(fa2::ldsm_v_row, fa2::ldsm_v_col, true, l, reg, h);
                const co::RowCol bv = co::mma16816_b_map(l, 2 * (reg % 2) + h);
                EXPECT80(v.row == bv.row && v.col == bv.col + 8 * (reg / 2), "V lane %d reg %d half %d", l, reg, h);
                // P reuse: A element (reg, h) of a k16 slice = C element p_src_elem of n-tile p_src_tile.
                const co::RowCol c = co::mma16816_c_map(l, fa2::p_src_elem(reg, h));
                EXPECT80(c.row == a.row && c.col + 8 * fa2::p_src_tile(reg) == a.col, "P lane %d reg %d half %d", l, reg,
                         h);
            }
    g_sm80.section("FA2 ldmatrix addressing -> mma fragments, P reuse (fa2/layout.h)", c0, b0);
}

// The checks must bite: each deliberate error has to disagree with CuTe somewhere.
void check_mutations80() {
    int detected = 0, tried = 0;
    bool diff = false;
    for (int l = 0; l < 32 && !diff; ++l)  // A halves swapped
        diff = fa2::a_col(l, 0, 1) != co::mma16816_a_map(l, 0).col;
    ++tried, detected += diff;
    diff = false;
    for (int l = 0; l < 32 && !diff; ++l)  // B registers swapped
        diff = fa2::b_row(l, 1, 0) != co::mma16816_b_map(l, 0).row;
    ++tried, detected += diff;
    diff = false;
    for (int l = 0; l < 32 && !diff; ++l)  // V loaded without .trans
        for (int reg = 0; reg < 4 && !diff; ++reg) {
            const Elem v = ldsm_elem(fa2::ldsm_v_row, fa2::ldsm_v_col, false, l, reg, 0);
            const co::RowCol bv = co::mma16816_b_map(l, 2 * (reg % 2));
            diff = v.row != bv.row || v.col != bv.col + 8 * (reg / 2);
        }
    ++tried, detected += diff;
    ++g_sm80.cases;
    if (detected != tried) ++g_sm80.bad;
    std::printf("cute-oracle sm80: mutations (A halves, B registers, V without .trans): %d of %d detected\n", detected,
                tried);
}

}  // namespace

int check_sm80() {
    check_mma_maps();
    check_ldmatrix_model();
    check_kernel_addressing();
    check_mutations80();
    return g_sm80.bad;
}

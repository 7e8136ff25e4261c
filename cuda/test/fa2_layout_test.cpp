// Host check of the FA2 kernel's index math, no GPU needed (g++ -std=c++17 -Icuda/include).
//
// The instructions are modelled here straight from the PTX ISA text (section 9.7.14.5.8 for the
// mma.m16n8k16 fragments, 9.7.14.5.15 for ldmatrix), written independently of fa2/layout.h; the
// kernel's loops are then replayed for one warp with the functions of fa2/layout.h and the traits
// of fa2/traits.cuh, on integer-valued tiles (exact in double), and compared with plain matmuls:
//   S = Q K^T through ldmatrix(Q) / ldmatrix(K) / mma, P = S reused as the A operand in registers,
//   O = P V through ldmatrix.trans(V) / mma, and the epilogue's (row, col) of every O element.
// It also checks that the padded shared layout keeps each 8-row ldmatrix phase on 8 distinct
// 16-byte bank groups, and that load_tile's thread layout covers every 16-byte chunk once.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fa2/layout.h"
#include "fa2/traits.cuh"

static int failures = 0;
#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) {                                     \
            if (failures < 20) {                           \
                std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
                std::printf(__VA_ARGS__);                  \
                std::printf("\n");                         \
            }                                              \
            ++failures;                                    \
        }                                                  \
    } while (0)

// ---- PTX ISA models ---------------------------------------------------------------------------
// A register = two 16-bit elements (low, high); we carry them as doubles.
struct Reg {
    double lo = 0, hi = 0;
};

// Element i (0..7) of the A fragment: row = g for i in {0,1,4,5}, else g+8;
// col = 2t + (i & 1) for i < 4, 2t + (i & 1) + 8 for i >= 4.
static int spec_a_row(int lane, int i) { return (lane >> 2) + ((i < 2 || (i >= 4 && i < 6)) ? 0 : 8); }
static int spec_a_col(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 4 ? 8 : 0); }
// Element i (0..3) of the B fragment: row = 2t + (i & 1) (+8 for i >= 2), col = g.
static int spec_b_row(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 2 ? 8 : 0); }
static int spec_b_col(int lane) { return lane >> 2; }
// Element i (0..3) of C/D: row = g for c0, c1, g+8 for c2, c3; col = 2t + (i & 1).
static int spec_c_row(int lane, int i) { return (lane >> 2) + (i >= 2 ? 8 : 0); }
static int spec_c_col(int lane, int i) { return (lane % 4) * 2 + (i & 1); }

// mma.m16n8k16: d[lane][0..3] += A * B with A from a[lane][0..3] (8 elements), B from b[lane][0..1].
static void mma(double (*d)[4], const Reg (*a)[4], const Reg* b0, const Reg* b1) {
    double A[16][16] = {}, B[16][8] = {};
    for (int l = 0; l < 32; ++l) {
        for (int i = 0; i < 8; ++i) {
            const Reg& r = a[l][i / 2];
            A[spec_a_row(l, i)][spec_a_col(l, i)] = (i & 1) ? r.hi : r.lo;
        }
        for (int i = 0; i < 4; ++i) {
            const Reg& r = (i < 2) ? b0[l] : b1[l];
            B[spec_b_row(l, i)][spec_b_col(l)] = (i & 1) ? r.hi : r.lo;
        }
    }
    for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 4; ++i) {
            double acc = 0;
            for (int k = 0; k < 16; ++k) acc += A[spec_c_row(l, i)][k] * B[k][spec_c_col(l, i)];
            d[l][i] += acc;
        }
}

// ldmatrix.m8n8.x4[.trans].b16 on a shared array of elements; addr[lane] = element index of the row
// that lane supplies (lane 8m + r: row r of matrix m). Destination register m of lane l: without
// .trans row l/4, columns 2(l%4), 2(l%4)+1 of matrix m; with .trans column l/4, rows 2(l%4), +1.
static void ldmatrix(Reg (*r)[4], const std::vector<double>& smem, const int* addr, bool trans) {
    for (int l = 0; l < 32; ++l)
        for (int m = 0; m < 4; ++m) {
            auto elem = [&](int row, int col) { return smem.at(addr[8 * m + row] + col); };
            const int x = l / 4, y = 2 * (l % 4);
            r[l][m] = trans ? Reg{elem(y, x), elem(y + 1, x)} : Reg{elem(x, y), elem(x, y + 1)};
        }
}

// ---- checks --------------------------------------------------------------------------------------
static void check_spec_bijections() {
    // Each fragment map of the spec hits every matrix element exactly once ...
    int a[16][16] = {}, b[16][8] = {}, c[16][8] = {};
    for (int l = 0; l < 32; ++l) {
        for (int i = 0; i < 8; ++i) ++a[spec_a_row(l, i)][spec_a_col(l, i)];
        for (int i = 0; i < 4; ++i) ++b[spec_b_row(l, i)][spec_b_col(l)];
        for (int i = 0; i < 4; ++i) ++c[spec_c_row(l, i)][spec_c_col(l, i)];
    }
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) CHECK(a[i][j] == 1, "A element (%d,%d) covered %d times", i, j, a[i][j]);
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 8; ++j) {
            CHECK(b[i][j] == 1, "B element (%d,%d) covered %d times", i, j, b[i][j]);
            CHECK(c[i][j] == 1, "C element (%d,%d) covered %d times", i, j, c[i][j]);
        }
    // ... and fa2/layout.h agrees with the spec.
    for (int l = 0; l < 32; ++l) {
        for (int i = 0; i < 4; ++i) {
            CHECK(fa2::acc_row(l, i) == spec_c_row(l, i) && fa2::acc_col(l, i) == spec_c_col(l, i), "acc map");
            for (int h = 0; h < 2; ++h) {
                CHECK(fa2::a_row(l, i) == spec_a_row(l, 2 * i + h), "a_row lane %d reg %d", l, i);
                CHECK(fa2::a_col(l, i, h) == spec_a_col(l, 2 * i + h), "a_col lane %d reg %d", l, i);
            }
        }
        for (int r = 0; r < 2; ++r)
            for (int h = 0; h < 2; ++h) CHECK(fa2::b_row(l, r, h) == spec_b_row(l, 2 * r + h), "b_row");
        CHECK(fa2::b_col(l) == spec_b_col(l), "b_col");
        // P reuse: A element (reg r, half h) of a k16 slice = accumulator element p_src_elem of
        // n-tile p_src_tile: same row, and column 8 * tile + acc_col.
        for (int r = 0; r < 4; ++r)
            for (int h = 0; h < 2; ++h) {
                const int tile = fa2::p_src_tile(r), e = fa2::p_src_elem(r, h);
                CHECK(spec_a_row(l, 2 * r + h) == spec_c_row(l, e), "P row lane %d reg %d", l, r);
                CHECK(spec_a_col(l, 2 * r + h) == 8 * tile + spec_c_col(l, e), "P col lane %d reg %d", l, r);
            }
    }
}

// Replays the kernel's warp-level loops for warp `warp` of a CTA with traits T on one K/V tile.
template <typename T>
static void check_warp(int warp, unsigned seed) {
    constexpr int S = T::kStride, D = T::kHeadDim, BM = T::kBlockM, BN = T::kBlockN;
    constexpr int MT = T::kMTiles, NT = T::kNTiles, DT = T::kDTiles;
    std::vector<double> sQ(BM * S, 1e30), sK(BN * S, 1e30), sV(BN * S, 1e30);  // padding = poison
    std::srand(seed);
    auto rnd = [] { return static_cast<double>(std::rand() % 5 - 2); };
    for (int r = 0; r < BM; ++r)
        for (int c = 0; c < D; ++c) sQ[r * S + c] = rnd();
    for (int r = 0; r < BN; ++r)
        for (int c = 0; c < D; ++c) { sK[r * S + c] = rnd(); sV[r * S + c] = rnd(); }

    const int wrow = fa2::warp_row0(fa2::warp_row_group(warp, T::kRowWarps), MT);
    const int col0 = fa2::warp_col0(warp, T::kRowWarps, T::kOCols);  // this warp's O columns
    static double acc_s[32][MT][NT][4];
    static double acc_o[32][MT][DT][4];
    for (int l = 0; l < 32; ++l) {
        for (int mt = 0; mt < MT; ++mt) {
            for (int nt = 0; nt < NT; ++nt)
                for (int i = 0; i < 4; ++i) acc_s[l][mt][nt][i] = 0;
            for (int dt = 0; dt < DT; ++dt)
                for (int i = 0; i < 4; ++i) acc_o[l][mt][dt][i] = 0;
        }
    }
    int addr[32];
    // S = Q K^T, loop structure of fwd_kernel.
    for (int ks = 0; ks < T::kKSteps; ++ks) {
        Reg qa[MT][32][4];
        for (int mt = 0; mt < MT; ++mt) {
            for (int l = 0; l < 32; ++l)
                addr[l] = (wrow + fa2::ldsm_q_row(l)) * S + fa2::ldsm_q_col(l) + mt * 16 * S + ks * 16;
            ldmatrix(qa[mt], sQ, addr, false);
        }
        for (int np = 0; np < NT / 2; ++np) {
            Reg kb[32][4];
            for (int l = 0; l < 32; ++l)
                addr[l] = fa2::ldsm_k_row(l) * S + fa2::ldsm_k_col(l) + np * 16 * S + ks * 16;
            ldmatrix(kb, sK, addr, false);
            Reg b0[32], b1[32], b2[32], b3[32];
            for (int l = 0; l < 32; ++l) { b0[l] = kb[l][0]; b1[l] = kb[l][1]; b2[l] = kb[l][2]; b3[l] = kb[l][3]; }
            for (int mt = 0; mt < MT; ++mt) {
                double d0[32][4], d1[32][4];
                for (int l = 0; l < 32; ++l)
                    for (int i = 0; i < 4; ++i) { d0[l][i] = acc_s[l][mt][2 * np][i]; d1[l][i] = acc_s[l][mt][2 * np + 1][i]; }
                mma(d0, qa[mt], b0, b1);
                mma(d1, qa[mt], b2, b3);
                for (int l = 0; l < 32; ++l)
                    for (int i = 0; i < 4; ++i) { acc_s[l][mt][2 * np][i] = d0[l][i]; acc_s[l][mt][2 * np + 1][i] = d1[l][i]; }
            }
        }
    }
    // S against the plain product, at the (row, col) the kernel's mask/softmax attribute to it.
    std::vector<double> Sref(BM * BN, 0);
    for (int i = 0; i < BM; ++i)
        for (int j = 0; j < BN; ++j) {
            double acc = 0;
            for (int k = 0; k < D; ++k) acc += sQ[i * S + k] * sK[j * S + k];
            Sref[i * BN + j] = acc;
        }
    for (int l = 0; l < 32; ++l)
        for (int mt = 0; mt < MT; ++mt)
            for (int nt = 0; nt < NT; ++nt)
                for (int i = 0; i < 4; ++i) {
                    const int row = wrow + mt * 16 + fa2::acc_row(l, i), col = nt * 8 + fa2::acc_col(l, i);
                    CHECK(acc_s[l][mt][nt][i] == Sref[row * BN + col], "hd%d warp %d S(%d,%d) = %g, want %g", D,
                          warp, row, col, acc_s[l][mt][nt][i], Sref[row * BN + col]);
                }
    // O = P V with P = S (exact small integers), P reused from the accumulators in registers.
    for (int kk = 0; kk < BN / 16; ++kk) {
        Reg pa[MT][32][4];
        for (int mt = 0; mt < MT; ++mt)
            for (int l = 0; l < 32; ++l)
                for (int r = 0; r < 4; ++r) {
                    const double* src = acc_s[l][mt][2 * kk + fa2::p_src_tile(r)];
                    pa[mt][l][r] = Reg{src[fa2::p_src_elem(r, 0)], src[fa2::p_src_elem(r, 1)]};
                }
        for (int dp = 0; dp < DT / 2; ++dp) {
            Reg vb[32][4];
            for (int l = 0; l < 32; ++l)
                addr[l] = fa2::ldsm_v_row(l) * S + fa2::ldsm_v_col(l) + kk * 16 * S + col0 + dp * 16;
            ldmatrix(vb, sV, addr, true);
            Reg b0[32], b1[32], b2[32], b3[32];
            for (int l = 0; l < 32; ++l) { b0[l] = vb[l][0]; b1[l] = vb[l][1]; b2[l] = vb[l][2]; b3[l] = vb[l][3]; }
            for (int mt = 0; mt < MT; ++mt) {
                double d0[32][4], d1[32][4];
                for (int l = 0; l < 32; ++l)
                    for (int i = 0; i < 4; ++i) { d0[l][i] = acc_o[l][mt][2 * dp][i]; d1[l][i] = acc_o[l][mt][2 * dp + 1][i]; }
                mma(d0, pa[mt], b0, b1);
                mma(d1, pa[mt], b2, b3);
                for (int l = 0; l < 32; ++l)
                    for (int i = 0; i < 4; ++i) { acc_o[l][mt][2 * dp][i] = d0[l][i]; acc_o[l][mt][2 * dp + 1][i] = d1[l][i]; }
            }
        }
    }
    // Epilogue mapping: srow = wrow + 16 mt + 8 hr + lane/4, col = col0 + 8 dt + acc_col(lane, 2 hr) (+1).
    std::vector<double> sO(BM * S, 1e30);
    std::vector<int> hits(BM * D, 0);
    for (int l = 0; l < 32; ++l)
        for (int mt = 0; mt < MT; ++mt)
            for (int hr = 0; hr < 2; ++hr)
                for (int dt = 0; dt < DT; ++dt) {
                    const int srow = wrow + mt * 16 + hr * 8 + (l >> 2);
                    const int col = col0 + dt * 8 + fa2::acc_col(l, 2 * hr);
                    CHECK(fa2::acc_row(l, 2 * hr) + wrow + mt * 16 == srow, "epilogue row");
                    sO[srow * S + col] = acc_o[l][mt][dt][2 * hr];
                    sO[srow * S + col + 1] = acc_o[l][mt][dt][2 * hr + 1];
                    ++hits[srow * D + col];
                    ++hits[srow * D + col + 1];
                }
    for (int i = wrow; i < wrow + 16 * MT; ++i)
        for (int c = col0; c < col0 + T::kOCols; ++c) {
            double acc = 0;
            for (int j = 0; j < BN; ++j) acc += Sref[i * BN + j] * sV[j * S + c];
            CHECK(hits[i * D + c] == 1, "hd%d O(%d,%d) written %d times", D, i, c, hits[i * D + c]);
            CHECK(sO[i * S + c] == acc, "hd%d warp %d O(%d,%d) = %g, want %g", D, warp, i, c, sO[i * S + c], acc);
        }
}

// ldmatrix phases: the 8 addresses of one matrix must fall in 8 distinct 16-byte bank groups of a
// 128-byte line (otherwise the load is replayed), for every operand and tile offset.
template <typename T>
static void check_banks() {
    constexpr int S = T::kStride;
    auto check = [&](int (*row)(int), int (*col)(int), const char* what) {
        for (int base_row = 0; base_row < 16; base_row += 16)
            for (int base_col = 0; base_col < T::kHeadDim; base_col += 16)
                for (int m = 0; m < 4; ++m) {
                    int seen = 0;
                    for (int r = 0; r < 8; ++r) {
                        const int l = 8 * m + r;
                        const int byte = ((base_row + row(l)) * S + base_col + col(l)) * 2;
                        CHECK(byte % 16 == 0, "%s: unaligned ldmatrix row", what);
                        seen |= 1 << ((byte / 16) % 8);
                    }
                    CHECK(seen == 0xff, "hd%d %s: bank conflict in matrix %d (mask %x)", T::kHeadDim, what, m, seen);
                }
    };
    check(fa2::ldsm_q_row, fa2::ldsm_q_col, "Q");
    check(fa2::ldsm_k_row, fa2::ldsm_k_col, "K");
    check(fa2::ldsm_v_row, fa2::ldsm_v_col, "V");
}

// load_tile thread layout: kChunksPerRow threads per row, kNThreads / kChunksPerRow rows per pass.
template <typename T>
static void check_load_cover(int rows) {
    constexpr int kChunks = T::kChunksPerRow, kRowsPerPass = T::kNThreads / kChunks;
    const int passes = (rows + kRowsPerPass - 1) / kRowsPerPass;
    std::vector<int> hits(rows * kChunks, 0);
    for (int tid = 0; tid < T::kNThreads; ++tid) {
        const int r = tid / kChunks, c = tid % kChunks;
        if (r >= kRowsPerPass) continue;
        for (int pass = 0; pass < passes; ++pass) {
            const int rr = r + pass * kRowsPerPass;
            if (rr < rows) ++hits[rr * kChunks + c];
        }
    }
    for (int i = 0; i < rows * kChunks; ++i) CHECK(hits[i] == 1, "hd%d load chunk %d covered %d times", T::kHeadDim, i, hits[i]);
}

template <int D>
static void check_hdim() {
    using T = fa2::Fa2Traits<D>;
    check_banks<T>();
    check_load_cover<T>(T::kBlockM);
    check_load_cover<T>(T::kBlockN);
    check_warp<T>(0, 1234u + D);
    check_warp<T>(T::kNWarps - 1, 4321u + D);
    std::printf("hd%-3d: %dx%d tile, %d warps (%d column parts) x %d m-tiles, smem %d B: layout OK so far (%d failures)\n",
                D, T::kBlockM, T::kBlockN, T::kNWarps, T::kColSplit, T::kMTiles, T::kSmemBytes, failures);
}

int main() {
    check_spec_bijections();
    check_hdim<32>();
    check_hdim<64>();
    check_hdim<96>();
    check_hdim<128>();
    check_hdim<192>();
    check_hdim<256>();
    check_hdim<512>();
    if (failures) {
        std::printf("fa2_layout_test: %d FAILURES\n", failures);
        return 1;
    }
    std::printf("fa2_layout_test: all fragment, ldmatrix, epilogue, bank and load-coverage checks passed\n");
    return 0;
}

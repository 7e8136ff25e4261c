// Host-only consistency check of the FA3 kernel's layouts (no GPU): runs the kernel's own offset,
// descriptor and fragment-index helpers (cuda/fa3/traits.cuh, sm90/wgmma.cuh) against a
// software model of how the hardware is documented to use them, and compares S = Q K^T and
// O = S V with exact integer arithmetic.
//
// The model (PTX ISA 9.0 + CUDA driver docs), written independently of the kernel code:
//  * 128B swizzle: physical byte address = linear ^ (((linear >> 7) & 7) << 4), applied to the
//    absolute shared address (tiles are 1024-aligned; the model's smem base is 0).
//  * TMA, SWIZZLE_128B, box {64 cols, 1, rows, 1} of 16-bit elements: box element (r, c) goes to
//    linear dst + r * 128 + c * 2, then swizzled.
//  * wgmma K-major SW128 operand, element (row i, k) of a k16 step:
//    linear = start + (i / 8) * SBO + (i % 8) * 128 + k * 2.
//  * wgmma MN-major SW128 operand (imm-trans-b = 1), element (k, n):
//    linear = start + (n / 64) * LBO + (n % 64) * 2 + (k % 8) * 128 + (k / 8) * SBO.
//  * m64nNk16 accumulator fragment: thread (warp w, lane = 4g + t) holds element
//    (16w + g + 8h, 8j + 2t + e) for j < N/8, h, e in {0, 1}.
//  * register A fragment (16-bit): a[r] holds row 16w + g + 8 (r % 2), cols 8 (r / 2) + 2t + {0, 1}.
// What it proves: the kernel's address arithmetic and index helpers agree with that model for
// every stage and head dim; the K/V tile range and mask-skip predicates agree with the
// visibility rule (brute force). What it cannot prove: that the model is what the silicon does.
//
// Built and run by tests/emulator/fa3_layout.rs: g++ -std=c++17 -O1 -D__host__= -D__device__=
//   -D__forceinline__=inline -I<cuda include> -Icuda cuda/test/fa3_layout_sim.cpp
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fa3/traits.cuh"

using namespace fa3;

namespace {

constexpr int kThreadsPerWg = 128;

uint32_t swizzle128(uint32_t linear) { return linear ^ (((linear >> 7) & 7u) << 4); }

struct Smem {
    std::vector<int16_t> bytes_as_elems;  // indexed by byte address / 2
    explicit Smem(int bytes) : bytes_as_elems(bytes / 2, INT16_MIN) {}
    void put(uint32_t byte, int16_t v) {
        if (byte % 2 || byte / 2 >= bytes_as_elems.size()) fail("store out of range", byte);
        if (bytes_as_elems[byte / 2] != INT16_MIN) fail("two elements stored at", byte);
        bytes_as_elems[byte / 2] = v;
    }
    int16_t get(uint32_t byte) const {
        if (byte % 2 || byte / 2 >= bytes_as_elems.size()) fail("load out of range", byte);
        const int16_t v = bytes_as_elems[byte / 2];
        if (v == INT16_MIN) fail("load of a byte nobody stored", byte);
        return v;
    }
    [[noreturn]] static void fail(const char* what, uint32_t byte) {
        std::fprintf(stderr, "fa3-layout-sim: %s %u\n", what, byte);
        std::exit(1);
    }
};

struct Desc {
    uint32_t start, lbo, sbo, swizzle;
};
Desc decode(uint64_t d) {
    return Desc{static_cast<uint32_t>(d & 0x3FFF) << 4, static_cast<uint32_t>((d >> 16) & 0x3FFF) << 4,
                static_cast<uint32_t>((d >> 32) & 0x3FFF) << 4, static_cast<uint32_t>(d >> 62)};
}
int16_t fetch_kmajor(const Smem& sm, uint64_t desc, int i, int k) {
    const Desc d = decode(desc);
    if (d.swizzle != 1) Smem::fail("descriptor swizzle is not 128B", d.swizzle);
    return sm.get(swizzle128(d.start + (i / 8) * d.sbo + (i % 8) * 128 + k * 2));
}
int16_t fetch_mnmajor(const Smem& sm, uint64_t desc, int k, int n) {
    const Desc d = decode(desc);
    if (d.swizzle != 1) Smem::fail("descriptor swizzle is not 128B", d.swizzle);
    return sm.get(swizzle128(d.start + (n / 64) * d.lbo + (n % 64) * 2 + (k % 8) * 128 +
                             (k / 8) * d.sbo));
}

// Accumulator fragments of one warpgroup: acc[thread][index] (model mapping above).
using Frags = std::vector<std::vector<double>>;
void frag_rc(int thread, int j, int h, int e, int& row, int& col) {
    const int w = thread / 32, lane = thread % 32, g = lane / 4, t = lane % 4;
    row = 16 * w + g + 8 * h;
    col = 8 * j + 2 * t + e;
}

// d (chunks base_chunk.. of each thread, N = 64) += A[64 x 16] * B[16 x 64].
void mma_m64n64k16(Frags& acc, int base_index, const double (&a)[64][16],
                   const double (&b)[16][64], bool accumulate) {
    for (int th = 0; th < kThreadsPerWg; ++th)
        for (int j = 0; j < 8; ++j)
            for (int h = 0; h < 2; ++h)
                for (int e = 0; e < 2; ++e) {
                    int row, col;
                    frag_rc(th, j, h, e, row, col);
                    double sum = 0;
                    for (int k = 0; k < 16; ++k) sum += a[row][k] * b[k][col];
                    double& d = acc[th][base_index + acc_index(j, h, e)];
                    d = accumulate ? d + sum : sum;
                }
}

int g_failures = 0;
void expect_eq(double got, double want, const char* what, int a, int b, int c) {
    if (got != want && g_failures++ < 10)
        std::fprintf(stderr, "  mismatch %s [%d][%d][%d]: got %g want %g\n", what, a, b, c, got, want);
}

// DV: V's (and O's) head dim, D unless the instance is built for a pair ((192, 128) at stage 5).
template <int Stage, int D, int DV = D>
void run() {
    using Tr = Fa3Traits<Stage, D, DV>;
    constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN;
    Smem sm(Tr::kOffBarriers);
    std::vector<int16_t> q(BM * D), k(BN * D), v(BN * DV);
    uint32_t seed = 12345u + Stage * 7 + D;
    auto rnd = [&]() {
        seed = seed * 1664525u + 1013904223u;
        return static_cast<int16_t>(static_cast<int>((seed >> 24) % 9) - 4);
    };
    for (auto& x : q) x = rnd();
    for (auto& x : k) x = rnd();
    for (auto& x : v) x = rnd();

    // Fill shared memory the way the stage does: plain loads (stage 1) or TMA boxes.
    if (Stage == 1) {
        for (int r = 0; r < BM; ++r)
            for (int c = 0; c < D; ++c) sm.put(Tr::kOffQ + sw128_offset(r, c, BM), q[r * D + c]);
        for (int r = 0; r < BN; ++r) {
            for (int c = 0; c < D; ++c) sm.put(Tr::kOffK + sw128_offset(r, c, BN), k[r * D + c]);
            for (int c = 0; c < DV; ++c) sm.put(Tr::kOffV + sw128_offset(r, c, BN), v[r * DV + c]);
        }
    } else {
        for (int slab = 0; slab < Tr::kSlabs; ++slab) {
            for (int rb = 0; rb < BM / Tr::kTmaBoxRowsQ; ++rb)
                for (int r = 0; r < Tr::kTmaBoxRowsQ; ++r)
                    for (int c = 0; c < Tr::kTmaBoxCols; ++c)
                        sm.put(swizzle128(Tr::kOffQ + Tr::q_box_offset(slab, rb) + r * 128 + c * 2),
                               q[(rb * Tr::kTmaBoxRowsQ + r) * D + slab * 64 + c]);
            for (int r = 0; r < Tr::kTmaBoxRowsKv; ++r)
                for (int c = 0; c < Tr::kTmaBoxCols; ++c) {
                    const uint32_t off = Tr::kv_box_offset(slab) + r * 128 + c * 2;
                    sm.put(swizzle128(Tr::kOffK + off), k[r * D + slab * 64 + c]);  // ring slot 0
                    if (slab < Tr::kSlabsV) sm.put(swizzle128(Tr::kOffV + off), v[r * DV + slab * 64 + c]);
                }
        }
    }

    for (int cw = 0; cw < Tr::kConsumerWarpgroups; ++cw) {
        // ---- S = Q K^T, as gemm_qk issues it.
        Frags s(kThreadsPerWg, std::vector<double>(BN / 2, 0.0));
        const uint32_t q_addr = Tr::kOffQ + Tr::q_warpgroup_offset(cw);
        for (int kk = 0; kk < D / kMmaK; ++kk) {
            const uint64_t da = desc_kmajor_sw128(q_addr + Tr::qk_a_offset(kk));
            static double a[64][16];
            for (int i = 0; i < 64; ++i)
                for (int kx = 0; kx < 16; ++kx) a[i][kx] = fetch_kmajor(sm, da, i, kx);
            for (int nh = 0; nh < BN / kMmaN; ++nh) {
                const uint64_t db = desc_kmajor_sw128(Tr::kOffK + Tr::qk_b_offset(kk, nh));
                static double b[16][64];
                for (int kx = 0; kx < 16; ++kx)
                    for (int n = 0; n < 64; ++n) b[kx][n] = fetch_kmajor(sm, db, n, kx);
                mma_m64n64k16(s, acc_index(nh * kMmaN / 8, 0, 0), a, b, kk > 0);
            }
        }
        std::vector<double> s_ref(64 * BN);
        for (int i = 0; i < 64; ++i)
            for (int j = 0; j < BN; ++j) {
                double sum = 0;
                for (int c = 0; c < D; ++c) sum += double(q[(cw * 64 + i) * D + c]) * k[j * D + c];
                s_ref[i * BN + j] = sum;
            }
        for (int th = 0; th < kThreadsPerWg; ++th)
            for (int j = 0; j < BN / 8; ++j)
                for (int h = 0; h < 2; ++h)
                    for (int e = 0; e < 2; ++e) {
                        int row, col;
                        frag_rc(th, j, h, e, row, col);
                        expect_eq(s[th][acc_index(j, h, e)], s_ref[row * BN + col], "S", cw, row, col);
                    }

        // ---- O = S V with S turned into A fragments as consume_tile does (P := S here).
        Frags o(kThreadsPerWg, std::vector<double>(DV / 2, 0.0));
        for (int kk = 0; kk < BN / kMmaK; ++kk) {
            static double a[64][16];
            for (int th = 0; th < kThreadsPerWg; ++th) {
                const int w = th / 32, lane = th % 32, g = lane / 4, t = lane % 4;
                for (int r = 0; r < 4; ++r)
                    for (int e = 0; e < 2; ++e)
                        a[16 * w + g + 8 * (r % 2)][8 * (r / 2) + 2 * t + e] =
                            s[th][acc_to_a_index(kk, r) + e];
            }
            for (int nh = 0; nh < DV / kMmaN; ++nh) {
                const uint64_t db =
                    desc_mnmajor_sw128(Tr::kOffV + Tr::pv_b_offset(kk, nh), Tr::kKvSlabStride);
                static double b[16][64];
                for (int kx = 0; kx < 16; ++kx)
                    for (int n = 0; n < 64; ++n) b[kx][n] = fetch_mnmajor(sm, db, kx, n);
                mma_m64n64k16(o, acc_index(nh * kMmaN / 8, 0, 0), a, b, true);
            }
        }
        for (int th = 0; th < kThreadsPerWg; ++th)
            for (int j = 0; j < DV / 8; ++j)
                for (int h = 0; h < 2; ++h)
                    for (int e = 0; e < 2; ++e) {
                        int row, col;
                        frag_rc(th, j, h, e, row, col);
                        double want = 0;
                        for (int key = 0; key < BN; ++key)
                            want += s_ref[row * BN + key] * v[key * DV + col];
                        expect_eq(o[th][acc_index(j, h, e)], want, "O", cw, row, col);
                    }
    }
    std::printf("fa3-layout-sim: stage %d hd %3d (BM %3d, BN %3d): %s\n", Stage, D, BM, BN,
                g_failures ? "MISMATCH" : "S and O exact");
}

// The test's own statement of the visibility rule, from its definition (not the kernels' code):
// key j is visible to query i iff i + off - left <= j <= i + off + right (off = seqlen_k -
// seqlen_q, bottom-right aligned; -1 = unbounded side) and 0 <= j < seqlen_k; in 64 bits.
bool key_visible(const FwdParams& p, int i, int j) {
    const long long off = (long long)p.seqlen_k - p.seqlen_q;
    return j >= 0 && j < p.seqlen_k && (p.window_left < 0 || j >= i + off - p.window_left) &&
           (p.window_right < 0 || j <= i + off + p.window_right);
}

// Brute force of the tile-range and mask-skip predicates against key_visible(): every visible
// key of every row of a query block lies in its K/V tile range, no tile of the range starts past
// seqlen_k (so no K/V TMA box is entirely out of bounds), and a tile judged mask-free really
// has every (row, key) of the warpgroup's 64 rows visible.
void check_ranges() {
    uint32_t seed = 777;
    auto rnd = [&](int n) {
        seed = seed * 1664525u + 1013904223u;
        return static_cast<int>((seed >> 8) % static_cast<uint32_t>(n));
    };
    int cases = 0;
    for (int trial = 0; trial < 3000; ++trial) {
        FwdParams p{};
        p.seqlen_q = 1 + rnd(300);
        p.seqlen_k = 1 + rnd(300);
        // Bounds up to INT_MAX too: the 64-bit rule of mask.cuh must not overflow.
        p.window_left = rnd(3) == 0 ? -1 : rnd(6) == 0 ? INT_MAX - rnd(2) : rnd(80);
        p.window_right = rnd(3) == 0 ? -1 : rnd(3) == 0 ? 0 : rnd(6) == 0 ? INT_MAX - rnd(2) : rnd(80);
        const int block_m = rnd(2) ? 64 : 128, block_n = rnd(2) ? 64 : 128;
        for (int m_begin = 0; m_begin < p.seqlen_q; m_begin += block_m) {
            const int m_end = m_begin + block_m < p.seqlen_q ? m_begin + block_m : p.seqlen_q;
            const KvRange r = kv_tile_range(p, m_begin, m_end, block_n);
            ++cases;
            if (r.n_end < r.n_begin || r.n_begin < 0 ||
                (r.n_end > r.n_begin && (r.n_end - 1) * block_n >= p.seqlen_k)) {
                std::fprintf(stderr, "  bad range [%d, %d) sq %d sk %d\n", r.n_begin, r.n_end,
                             p.seqlen_q, p.seqlen_k);
                ++g_failures;
            }
            for (int i = m_begin; i < m_end; ++i)
                for (int j = 0; j < p.seqlen_k; ++j)
                    if (key_visible(p, i, j) && (j < r.n_begin * block_n || j >= r.n_end * block_n)) {
                        if (g_failures++ < 10)
                            std::fprintf(stderr, "  visible key %d of row %d outside tiles [%d, %d)\n", j, i,
                                         r.n_begin, r.n_end);
                    }
            for (int m_first = m_begin; m_first < m_begin + block_m; m_first += 64)
                for (int n = r.n_begin; n < r.n_end; ++n) {
                    if (block_needs_mask(p, m_first, 64, n * block_n, block_n)) continue;
                    for (int i = m_first; i < m_first + 64; ++i)
                        for (int j = n * block_n; j < (n + 1) * block_n; ++j)
                            if (!key_visible(p, i, j) && g_failures++ < 10)
                                std::fprintf(stderr, "  mask skipped but (%d, %d) hidden\n", i, j);
                }
        }
    }
    std::printf("fa3-layout-sim: tile ranges and mask skip: %d query blocks %s\n", cases,
                g_failures ? "MISMATCH" : "consistent with key_visible");
}

}  // namespace

int main() {
    check_ranges();
    run<1, 64>();
    run<1, 128>();
    run<1, 256>();
    run<2, 64>();
    run<2, 128>();
    run<2, 256>();
    run<3, 64>();
    run<3, 128>();
    run<3, 256>();
    run<4, 64>();
    run<4, 128>();
    run<4, 256>();
    run<5, 64>();
    run<5, 128>();
    run<5, 256>();
    run<5, 192, 128>();  // DeepSeek MLA prefill's pair: Q/K 192, V and O 128
    if (g_failures) {
        std::fprintf(stderr, "fa3-layout-sim: %d mismatches\n", g_failures);
        return 1;
    }
    return 0;
}

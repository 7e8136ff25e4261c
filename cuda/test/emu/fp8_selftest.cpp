// Self-tests of the FP8 (e4m3) wgmma path in the emulator (tests/emulator/fp8.rs runs them):
//   a8_permutation       acc_to_a8's lane/byte routing (a8_src_lane, a8_byte_sel, the packing
//                        order) moves every accumulator element of S to the A8 fragment slot of
//                        the same (row, key), by the emulator's fragment maps (acc_coord,
//                        a_reg_coord8; both equal CuTe's CLayout_64xN / ALayout_64x32, cuda/test/oracle)
//   swz_offset8          the e4m3 tile placement of sm90/wgmma_fp8.cuh equals the emulator's
//                        descriptor decoding (operand_addr, 8-bit, K-major, 128B and 64B swizzle)
//   qk_pv_chain          one warpgroup: S = Q Kᵀ (SS e4m3, 4 k32 steps x 2 N halves), P = e4m3(S·c)
//                        through acc_to_a8, O = P Vᵀᵀ (RS e4m3, Vᵀ K-major), through the wrappers of
//                        sm90/wgmma_fp8.cuh, against host arithmetic, under seeds 1-3
//   qk_pv_unpermuted     the same with P packed in the accumulator's order (no permutation): the
//                        result must be wrong (the check notices a missing permutation)
// Prints "PASS <name>" / "FAIL <name>" and "<n> of <n> fp8 self-tests as expected"; exit 1 on failure.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "sm90_layouts.h"
#include "sm90/wgmma_fp8.cuh"

namespace {

int g_failures = 0;
#define CHECK(c)                                                                    \
    do {                                                                            \
        if (!(c)) {                                                                 \
            std::fprintf(stderr, "CHECK FAILED (line %d): %s\n", __LINE__, #c);     \
            std::exit(1);                                                           \
        }                                                                           \
    } while (0)

std::function<void()> g_body;
void trampoline(void*) { g_body(); }
void launch(unsigned threads, unsigned smem, std::function<void()> body, uint64_t seed) {
    g_body = std::move(body);
    emu::LaunchConfig cfg;
    cfg.block = emu::Dim3{threads, 1, 1};
    cfg.smem_bytes = smem;
    cfg.seed = seed;
    emu::launch(cfg, &trampoline, nullptr);
}
uint8_t* smem_aligned() {
    uint8_t* s = emu_shared_window;
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(s));
    return s + (1024 - a % 1024) % 1024;
}

void a8_permutation() {
    int checked = 0;
    for (int t = 0; t < 128; ++t) {
        const int lane = t % 32, warp = t / 32;
        for (int r = 0; r < 4; ++r) {
            const int kh = r / 2, h = r % 2;
            for (int b = 0; b < 4; ++b) {
                const unsigned sel = fa3::a8_byte_sel(lane);
                const int sb = static_cast<int>((sel >> (4 * b)) & 7);  // byte of y1:y0
                const int src = fa3::a8_src_lane(lane, sb / 4);
                const int beta = sb % 4;  // byte of the source's packed word x
                // x packs chunks 2kh (bytes 0, 1) and 2kh + 1 (bytes 2, 3), elements e = 0, 1, row half h.
                const int acc = fa3::acc_index(2 * kh + beta / 2, h, beta % 2);
                const emu::sm90::RowCol have = emu::sm90::acc_coord(32 * warp + src, acc);
                const emu::sm90::RowCol want = emu::sm90::a_reg_coord8(t, r, b);
                CHECK(have.row == want.row && have.col == want.col);
                CHECK(src / 4 == lane / 4);  // stays inside the quad (same row group)
                ++checked;
            }
        }
    }
    CHECK(checked == 128 * 16);
}

// A [128 x 256] e4m3 tile (256 / W slabs) at a 1024-aligned address, read through K-major
// W-byte-swizzle descriptors at every 64-row block, k32 step and slab, as the kernels address it.
template <int W>
void swz_offset8_case() {
    const uint32_t base = 0x4000;
    const int rows = 128, cols = 256;
    int checked = 0;
    for (int slab = 0; slab < cols / W; ++slab)
        for (int mb = 0; mb < rows / 64; ++mb)
            for (int ks = 0; ks < W / fa3::kMmaK8Bytes; ++ks) {
                const uint32_t start = base + slab * rows * W + mb * 64 * W + ks * fa3::kMmaK8Bytes;
                const uint64_t desc = fa3::desc_kmajor8<W>(start);
                for (int m = 0; m < 64; ++m)
                    for (int k = 0; k < fa3::kMmaK8; ++k) {
                        const uint32_t a = emu::sm90::operand_addr(desc, emu::sm90::Major::K, 1, m, k);
                        const int row = mb * 64 + m, col = slab * W + ks * fa3::kMmaK8 + k;
                        CHECK(a == base + static_cast<uint32_t>(fa3::swz_offset8<W>(row, col, rows)));
                        ++checked;
                    }
            }
    CHECK(checked == rows * cols);
}

void swz_offset8() {
    swz_offset8_case<128>();
    swz_offset8_case<64>();
}

// Small integers (exact in e4m3 and in every product and sum here).
float pat(int i, int j, int salt) { return static_cast<float>(((i * 7 + j * 13 + salt * 5) % 9) - 4); }

// Q [64 x 128], K [128 keys x 128], Vᵀ [128 d x 128 keys], all e4m3 K-major SW128 (one slab each).
// Returns the number of output elements that differ from the host result.
int qk_pv(bool permute, uint64_t seed) {
    constexpr int M = 64, D = 128, N = 128;
    constexpr float c = 0.0625f;  // P = e4m3(S · c): S up to ±2048 -> P up to ±128, with rounding
    auto qv = [](int m, int d) { return pat(m, d, 1); };
    auto kv = [](int n, int d) { return pat(n, d, 2) * 0.5f; };
    auto vv = [](int n, int d) { return pat(d, n, 3); };
    // Host reference: S exact, P rounded to e4m3 through fp8.cuh, O in double.
    std::vector<double> oref(M * D, 0.0);
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
            float s = 0;
            for (int d = 0; d < D; ++d) s += qv(m, d) * kv(n, d);
            const float p = fa_e4m3_round(s * c);
            for (int d = 0; d < D; ++d) oref[m * D + d] += static_cast<double>(p) * vv(n, d);
        }
    int bad_total = 0;
    launch(128, 64 * 1024, [&] {
        uint8_t* base = smem_aligned();
        uint8_t* sq = base;                // 64 x 128 = 8 KiB
        uint8_t* sk = base + 8192;         // 128 x 128 = 16 KiB
        uint8_t* sv = base + 8192 + 16384; // 128 x 128 = 16 KiB
        const int t = static_cast<int>(threadIdx.x);
        if (t == 0) {
            for (int m = 0; m < M; ++m)
                for (int d = 0; d < D; ++d) sq[fa3::swz_offset8<128>(m, d, M)] = fa_e4m3_encode(qv(m, d));
            for (int n = 0; n < N; ++n)
                for (int d = 0; d < D; ++d) sk[fa3::swz_offset8<128>(n, d, N)] = fa_e4m3_encode(kv(n, d));
            for (int d = 0; d < D; ++d)
                for (int n = 0; n < N; ++n) sv[fa3::swz_offset8<128>(d, n, D)] = fa_e4m3_encode(vv(n, d));
        }
        fa3::fence_proxy_async_smem();
        __syncthreads();
        const uint32_t aq = static_cast<uint32_t>(__cvta_generic_to_shared(sq));
        const uint32_t ak = static_cast<uint32_t>(__cvta_generic_to_shared(sk));
        const uint32_t av = static_cast<uint32_t>(__cvta_generic_to_shared(sv));
        float s[2][32];
        fa3::wgmma_fence();
        for (int ks = 0; ks < D / fa3::kMmaK8; ++ks)
            for (int nh = 0; nh < 2; ++nh)
                fa3::wgmma_m64n64k32_ss_e4m3(s[nh], fa3::desc_kmajor_sw128(aq + ks * fa3::kMmaK8Bytes),
                                             fa3::desc_kmajor_sw128(ak + nh * 64 * 128 + ks * fa3::kMmaK8Bytes), ks > 0);
        fa3::wgmma_commit();
        fa3::wgmma_wait<0>();
        fa3::fence_regs(s[0]);
        fa3::fence_regs(s[1]);
        for (auto& half : s)
            for (float& x : half) x *= c;
        float o[2][32];
        for (auto& half : o)
            for (float& x : half) x = 0.0f;
        uint32_t a[N / fa3::kMmaK8][4];
        for (int ks = 0; ks < N / fa3::kMmaK8; ++ks) {
            const float* p = &s[ks / 2][16 * (ks % 2)];
            if (permute) {
                fa3::acc_to_a8(p, a[ks]);
            } else {
                // Accumulator order: register r packs the thread's own elements 4r .. 4r + 3.
                for (int r = 0; r < 4; ++r) a[ks][r] = fa3::pack4_e4m3(p[4 * r], p[4 * r + 1], p[4 * r + 2], p[4 * r + 3]);
            }
        }
        fa3::wgmma_fence();
        for (int ks = 0; ks < N / fa3::kMmaK8; ++ks)
            for (int nh = 0; nh < 2; ++nh)
                fa3::wgmma_m64n64k32_rs_e4m3(o[nh], a[ks], fa3::desc_kmajor_sw128(av + nh * 64 * 128 + ks * fa3::kMmaK8Bytes));
        fa3::wgmma_commit();
        fa3::wgmma_wait<0>();
        fa3::fence_regs(o[0]);
        fa3::fence_regs(o[1]);
        int bad = 0;
        for (int nh = 0; nh < 2; ++nh)
            for (int i = 0; i < 32; ++i) {
                const emu::sm90::RowCol rc = emu::sm90::acc_coord(t, i);
                const double want = oref[rc.row * D + nh * 64 + rc.col];
                if (std::fabs(o[nh][i] - want) > 1e-6 * (1.0 + std::fabs(want))) ++bad;
            }
        // Every thread adds its count (fibers run one at a time: no race on the host int).
        bad_total += bad;
    }, seed);
    return bad_total;
}

void qk_pv_chain() {
    for (uint64_t seed = 1; seed <= 3; ++seed) CHECK(qk_pv(true, seed) == 0);
}
void qk_pv_unpermuted() {
    const int bad = qk_pv(false, 1);
    std::printf("  unpermuted P: %d of %d outputs wrong\n", bad, 64 * 128);
    CHECK(bad > 64 * 128 / 2);
}

}  // namespace

int main(int argc, char** argv) {
    const std::vector<std::pair<std::string, void (*)()>> tests = {
        {"a8_permutation", &a8_permutation},
        {"swz_offset8", &swz_offset8},
        {"qk_pv_chain", &qk_pv_chain},
        {"qk_pv_unpermuted", &qk_pv_unpermuted},
    };
    int ok = 0;
    for (const auto& [name, fn] : tests) {
        if (argc == 2 && name != argv[1]) continue;
        fn();  // a failed CHECK or emulator check exits non-zero with its diagnosis
        std::printf("PASS %s\n", name.c_str());
        ++ok;
    }
    std::printf("%d of %d fp8 self-tests as expected\n", ok, ok + g_failures);
    return g_failures ? 1 : 0;
}

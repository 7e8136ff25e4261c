// Self-tests of warp collectives: shuffles and elect.sync, a divergent collective, ldmatrix with
// mma.sync.
#include "harness.h"

namespace selftest {
namespace {

void shfl_and_elect() {
    std::vector<int> elected(4, 0);
    std::set<int> lanes;
    for (uint64_t seed = 1; seed <= 4; ++seed)
        launch(128, 1024, [&] {
            const float v = static_cast<float>(tid());
            for (int m = 1; m < 32; m <<= 1) CHECK(__shfl_xor_sync(0xffffffffu, v, m) == static_cast<float>(tid() ^ m));
            if (fa3::elect_one_sync()) {
                ++elected[tid() / 32];
                if (tid() / 32 == 0) lanes.insert(static_cast<int>(tid() % 32));
            }
        }, seed);
    for (int w = 0; w < 4; ++w) CHECK(elected[w] == 4);  // one lane per warp per launch
    CHECK(lanes.size() >= 2);                            // not always lane 0
}

void divergent_collective() {
    launch(32, 1024, [] {
        if (tid() < 16) __syncwarp();
        else (void)__shfl_xor_sync(0xffffffffu, 1.f, 1);
    });
}

// mma.sync m16n8k16 with ldmatrix (.trans) operands: D = A B for a 16x16 A and a 16x16 B (two n8
// tiles), fragments loaded with the lane -> row maps the FA2 kernel uses (fa2/layout.h).
void ldmatrix_mma() {
    for (int elem = 0; elem < 2; ++elem) {
        launch(32, 4096, [&] {
            uint8_t* base = smem_aligned(128);
            uint16_t* A = reinterpret_cast<uint16_t*>(base);          // [16][16] row-major (m, k)
            uint16_t* B = reinterpret_cast<uint16_t*>(base + 1024);   // [16][16] row-major (k, n)
            auto bits = [&](float x) { return elem ? bf16_bits(x) : f16_bits(x); };
            if (tid() == 0)
                for (int i = 0; i < 16; ++i)
                    for (int j = 0; j < 16; ++j) {
                        A[i * 16 + j] = bits(pat(i, j, 1));
                        B[i * 16 + j] = bits(pat(i, j, 2));
                    }
            __syncwarp();
            const int l = static_cast<int>(tid());
            uint32_t a[4], b[4];
            fa2::ldmatrix_x4(a, saddr(A + fa2::ldsm_q_row(l) * 16 + fa2::ldsm_q_col(l)));
            fa2::ldmatrix_x4_trans(b, saddr(B + fa2::ldsm_v_row(l) * 16 + fa2::ldsm_v_col(l)));
            for (int nt = 0; nt < 2; ++nt) {
                float d[4] = {0, 0, 0, 0};
                if (elem) fa2::Mma<__nv_bfloat16>::run(d, a, b[2 * nt], b[2 * nt + 1]);
                else fa2::Mma<__half>::run(d, a, b[2 * nt], b[2 * nt + 1]);
                for (int i = 0; i < 4; ++i) {
                    const int r = fa2::acc_row(l, i), c = 8 * nt + fa2::acc_col(l, i);
                    float ref = 0;
                    for (int k = 0; k < 16; ++k) ref += pat(r, k, 1) * pat(k, c, 2);
                    CHECK(d[i] == ref);
                }
            }
        });
    }
}

}  // namespace

std::vector<Test> collectives_tests() {
    return {
        {"shfl_and_elect", nullptr, shfl_and_elect},
        {"divergent_collective", "divergent warp collective", divergent_collective},
        {"ldmatrix_mma", nullptr, ldmatrix_mma},
    };
}

}  // namespace selftest

// Self-tests of the CPU emulator (tests/emulator/forward.rs runs them): small kernels that use each
// emulated primitive correctly (and must pass, with results checked against host arithmetic)
// or break one of its rules (and must fail with the expected diagnosis). Each test runs in a
// forked child, so a failing emulator check (which exits) is observed from outside.
//
//   selftest            run every test, print PASS/FAIL per test, exit 1 if any is unexpected
//   selftest <name>     run one test in-process (for debugging)
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "fa2/layout.h"
#include "guarded_buffers.h"
#include "sm80/mma.cuh"
#include "sm100_layouts.h"
#include "sm90_layouts.h"
#include "sm100/tcgen05.cuh"

namespace {

[[noreturn]] void check_failed(const char* what, int line) {
    std::fprintf(stderr, "SELFTEST CHECK FAILED (line %d): %s\n", line, what);
    std::_Exit(1);
}
#define CHECK(c)                                \
    do {                                        \
        if (!(c)) check_failed(#c, __LINE__);   \
    } while (0)

// The kernel body of the current launch (one per test, set before launching).
std::function<void()> g_body;
void trampoline(void*) { g_body(); }

// The land policy of every copy (emu::LaunchConfig::land_policy); -1: the seed's (seed 1 lands
// as late as possible, seed 2 at once, seed 3 soon), which the timing tests below rely on.
int g_land_policy = -1;

void launch(unsigned threads, unsigned smem, std::function<void()> body, uint64_t seed = 1, unsigned regs = 0,
            emu::Dim3 grid = {1, 1, 1}) {
    g_body = std::move(body);
    emu::LaunchConfig cfg;
    static const int kSeedPolicy[3] = {0, 2, 1};
    cfg.land_policy = g_land_policy >= 0 ? g_land_policy : kSeedPolicy[(seed + 2) % 3];
    cfg.grid = grid;
    cfg.block = emu::Dim3{threads, 1, 1};
    cfg.smem_bytes = smem;
    cfg.entry_regs = regs;
    cfg.seed = seed;
    emu::launch(cfg, &trampoline, nullptr);
}

unsigned tid() { return threadIdx.x; }
uint8_t* smem() { return emu_shared_window; }  // the first byte of the dynamic shared memory
uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
// First 1024-aligned byte of the dynamic smem (its base is deliberately not aligned).
uint8_t* smem_aligned(uint32_t align = 1024) {
    const uint32_t a = saddr(smem());
    return smem() + (align - a % align) % align;
}

uint16_t bf16_bits(float x) { return __float2bfloat16_rn(x).__x; }
uint16_t f16_bits(float x) { return __float2half_rn(x).__x; }

// A deterministic small-integer pattern (exact in bf16/f16/e4m3 and in products).
float pat(int i, int j, int salt) { return static_cast<float>(((i * 7 + j * 13 + salt * 5) % 9) - 4); }

// The wgmma fragment maps as the PTX ISA's figures draw them, written out here independently of
// sm90_layouts.h (warp w, g = lane / 4, q = lane % 4): accumulator register i holds
// (16w + g + 8 ((i / 2) % 2), 8 (i / 4) + 2q + i % 2); A register r, half h holds
// (16w + g + 8 (r % 2), 2q + h + 8 (r / 2)).
int acc_row(int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + ((i & 2) ? 8 : 0); }
int acc_col(int t, int i) { return 8 * (i / 4) + 2 * (t % 4) + (i % 2); }
int a_row(int t, int r) { return 16 * (t / 32) + (t % 32) / 4 + ((r & 1) ? 8 : 0); }
int a_col(int t, int r, int h) { return 2 * (t % 4) + h + ((r & 2) ? 8 : 0); }

// ---------------------------------------------------------------- scheduling

void sched_orders_differ() {
    std::set<std::vector<int>> orders;
    for (uint64_t seed = 1; seed <= 3; ++seed) {
        std::vector<int> log;
        launch(64, 1024, [&] {
            for (int i = 0; i < 3; ++i) {
                log.push_back(static_cast<int>(tid()));
                fa3::fence_proxy_async_smem();  // a scheduling point
            }
        }, seed);
        CHECK(log.size() == 192);
        orders.insert(log);
    }
    CHECK(orders.size() >= 2);
}

void smem_not_1024_aligned() {
    std::set<uint32_t> bases;
    for (uint64_t seed = 1; seed <= 8; ++seed)
        launch(32, 2048, [&] {
            const uint32_t a = saddr(smem());
            CHECK(a % 16 == 0 && a % 1024 != 0);
            CHECK(smem()[100] == 0xFF);  // poisoned
            if (tid() == 0) bases.insert(a);
        }, seed);
    CHECK(bases.size() >= 2);
}

void smem_redzone() {
    launch(32, 1024, [] {
        if (tid() == 0) smem()[1024 + 5] = 1;
    });
}

void syncthreads_after_exit() {
    launch(64, 1024, [] {
        if (tid() < 32) return;
        __syncthreads();
    });
}

void deadlock_report() {
    launch(64, 1024, [] {
        if (tid() < 32) fa3::named_bar_sync<1, 64>();
        else fa3::named_bar_sync<2, 64>();
    });
}

// ---------------------------------------------------------------- named barriers

void named_bar_pingpong_ok() {
    std::vector<int> order;
    launch(256, 1024, [&] {
        const int wg = static_cast<int>(tid() / 128);
        if (wg == 1) fa3::named_bar_arrive<2, 256>();  // the first token goes to warpgroup 0
        for (int round = 0; round < 4; ++round) {
            if (wg == 0) fa3::named_bar_sync<2, 256>();
            else fa3::named_bar_sync<1, 256>();
            if (tid() % 128 == 0) order.push_back(wg);
            if (wg == 0) fa3::named_bar_arrive<1, 256>();
            else fa3::named_bar_arrive<2, 256>();
        }
        if (wg == 0) fa3::named_bar_sync<2, 256>();  // absorb the last pass
    });
    CHECK(order == (std::vector<int>{0, 1, 0, 1, 0, 1, 0, 1}));
}

void named_bar_count_mismatch() {
    launch(128, 1024, [] {
        if (tid() < 64) fa3::named_bar_arrive<3, 128>();
        else fa3::named_bar_sync<3, 96>();
    });
}

void named_bar_partial_warp() {
    launch(128, 1024, [] {
        if (tid() < 48 || (tid() >= 64 && tid() < 80)) fa3::named_bar_sync<1, 64>();
    });
}

void named_bar_twice() {
    launch(128, 1024, [] {
        if (tid() >= 64) return;
        fa3::named_bar_arrive<4, 128>();
        fa3::named_bar_arrive<4, 128>();
    });
}

// ---------------------------------------------------------------- warp collectives

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

void cp_async_ok() {
    static uint8_t global[512];
    for (int i = 0; i < 512; ++i) global[i] = static_cast<uint8_t>(i * 3);
    for (uint64_t seed = 1; seed <= 3; ++seed)
        launch(32, 4096, [] {
            uint8_t* dst = smem_aligned(128);
            fa2::cp_async_16(saddr(dst + 16 * tid()), global + 16 * tid(), tid() == 5 ? 7 : 16);
            fa2::cp_async_commit();
            fa2::cp_async_wait<0>();
            __syncwarp();
            for (int i = 0; i < 16; ++i) {
                const uint8_t want = tid() == 5 && i >= 7 ? 0 : global[16 * tid() + i];
                CHECK(dst[16 * tid() + i] == want);
            }
        }, seed);
}

// Every lane's copy, waited for, then a __syncwarp: each lane may read every lane's row
// (ldmatrix), under every land policy.
void cp_async_warp_ok() {
    static uint8_t global[512];
    for (int i = 0; i < 512; ++i) global[i] = static_cast<uint8_t>(i * 5);
    for (int policy = 0; policy < 3; ++policy) {
        g_land_policy = policy;
        launch(32, 4096, [] {
            uint8_t* dst = smem_aligned(128);
            fa2::cp_async_16(saddr(dst + 16 * tid()), global + 16 * tid(), 16);
            fa2::cp_async_commit();
            fa2::cp_async_wait<0>();
            __syncwarp();
            uint32_t r[4];
            fa2::ldmatrix_x4(r, saddr(dst + 16 * tid()));
            uint16_t want;
            std::memcpy(&want, global + 16 * (tid() / 4) + 4 * (tid() % 4), 2);
            CHECK((r[0] & 0xFFFF) == want);
        });
    }
}

// Waited for by each lane, but no barrier between the lanes: a lane reads other lanes' rows
// (happens-before, whatever the land policy: `policy`).
void cp_async_no_barrier(int policy) {
    static uint8_t global[1024];
    g_land_policy = policy;
    launch(32, 4096, [] {
        uint8_t* dst = smem_aligned(128);
        fa2::cp_async_16(saddr(dst + 16 * tid()), global + 16 * tid(), 16);
        fa2::cp_async_commit();
        fa2::cp_async_wait<0>();
        uint32_t r[4];
        fa2::ldmatrix_x4(r, saddr(dst + 16 * tid()));
    });
}

// A TMA box read (ldmatrix) without waiting on its mbarrier, or (wait_first) after the wait: the
// read fails by happens-before whatever the land policy.
void tma_read_before_wait(int policy, bool wait_first) {
    alignas(128) static unsigned char map[128];
    static uint16_t g[64 * 8];
    const uint64_t dims[2] = {64, 8}, strides[1] = {128};
    const uint32_t box[2] = {64, 8}, es[2] = {1, 1};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, strides, box, es, 0, 0, 0, 0, nullptr) == 0);
    g_land_policy = policy;
    launch(32, 8192, [wait_first] {
        uint8_t* base = smem_aligned();
        uint64_t* bar = reinterpret_cast<uint64_t*>(base + 4096);
        if (tid() == 0) {
            fa3::mbar_init(bar, 1);
            fa3::mbar_init_fence();
        }
        __syncthreads();
        if (tid() == 0) {
            fa3::mbar_arrive_expect_tx(bar, 1024);
            const int32_t c[2] = {0, 0};
            emu::tma_load(saddr(base), map, saddr(bar), c, 2);
        }
        if (wait_first) fa3::mbar_wait(bar, 0);
        uint32_t r[4];
        fa2::ldmatrix_x4(r, saddr(base + 16 * (tid() % 8) + 128 * (tid() / 8)));
        if (!wait_first) fa3::mbar_wait(bar, 0);
    });
}

void cp_async_read_before_wait() {
    static uint8_t global[1024];
    launch(32, 4096, [] {
        uint8_t* dst = smem_aligned(128);
        fa2::cp_async_16(saddr(dst + 16 * tid()), global + 16 * tid(), 16);
        fa2::cp_async_commit();
        uint32_t r[4];
        fa2::ldmatrix_x4(r, saddr(dst + 16 * tid()));  // no wait: the copy may not have landed
        fa2::cp_async_wait<0>();
    }, 1);
}

// ---------------------------------------------------------------- mbarrier

void mbar_arrival_underflow() {
    launch(32, 1024, [] {
        uint64_t* bar = reinterpret_cast<uint64_t*>(smem_aligned(8));
        if (tid() == 0) {
            fa3::mbar_init(bar, 1);
            fa3::mbar_init_fence();
            fa3::mbar_arrive_expect_tx(bar, 128);  // all arrivals in, 128 bytes expected
            fa3::mbar_arrive(bar);                 // one arrival too many
        }
    });
}

void mbar_tx_pending_at_exit() {
    launch(32, 1024, [] {
        uint64_t* bar = reinterpret_cast<uint64_t*>(smem_aligned(8));
        if (tid() == 0) {
            fa3::mbar_init(bar, 1);
            fa3::mbar_init_fence();
            fa3::mbar_arrive_expect_tx(bar, 64);
        }
    });
}

void mbar_never_completes() {
    launch(64, 1024, [] {
        uint64_t* bar = reinterpret_cast<uint64_t*>(smem_aligned(8));
        if (tid() == 0) {
            fa3::mbar_init(bar, 2);
            fa3::mbar_init_fence();
        }
        __syncthreads();
        if (tid() == 0) fa3::mbar_arrive(bar);
        fa3::mbar_wait(bar, 0);
    });
}

void mbar_uninitialised() {
    launch(32, 1024, [] { fa3::mbar_arrive(reinterpret_cast<uint64_t*>(smem_aligned(8))); });
}

void mbar_overwritten() {
    launch(32, 1024, [] {
        uint64_t* bar = reinterpret_cast<uint64_t*>(smem_aligned(8));
        if (tid() == 0) {
            fa3::mbar_init(bar, 32);
            fa3::mbar_init_fence();
            *bar = 0;
        }
        __syncwarp();
        fa3::mbar_arrive(bar);
    });
}

void mbar_phases_ok() {
    for (uint64_t seed = 1; seed <= 3; ++seed)
        launch(128, 1024, [] {
            uint64_t* full = reinterpret_cast<uint64_t*>(smem_aligned(8));
            uint64_t* empty = full + 1;
            int* slot = reinterpret_cast<int*>(full + 2);
            if (tid() == 0) {
                fa3::mbar_init(full, 1);
                fa3::mbar_init(empty, 127);
                fa3::mbar_init_fence();
            }
            __syncthreads();
            for (int u = 0; u < 6; ++u) {
                if (tid() == 0) {
                    if (u > 0) fa3::mbar_wait(empty, (u - 1) & 1);
                    *slot = 100 + u;
                    fa3::mbar_arrive(full);
                } else {
                    fa3::mbar_wait(full, u & 1);
                    CHECK(*slot == 100 + u);
                    fa3::mbar_arrive(empty);
                }
            }
        }, seed);
}

// ---------------------------------------------------------------- TMA

// A [rows x 64] bf16 tensor in global memory, boxes of {64, 64} with the 128B swizzle: a box
// partly past the end is zero-filled, one starting at a negative row too; the bytes complete
// the mbarrier phase.
void tma_box_oob_swizzle() {
    static std::vector<uint16_t> g(100 * 64);
    for (int r = 0; r < 100; ++r)
        for (int c = 0; c < 64; ++c) g[r * 64 + c] = bf16_bits(pat(r, c, 3));
    alignas(128) static unsigned char map[128];
    const uint64_t dims[2] = {64, 100}, strides[1] = {128};
    const uint32_t box[2] = {64, 64}, es[2] = {1, 1};
    std::string why;
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g.data(), dims, strides, box, es, 0, 3, 0, 0, &why) == 0);
    for (uint64_t seed = 1; seed <= 3; ++seed)
        launch(128, 40000, [&] {
            uint8_t* base = smem_aligned();
            uint64_t* bar = reinterpret_cast<uint64_t*>(base + 3 * 8192);
            if (tid() == 0) {
                fa3::mbar_init(bar, 1);
                fa3::mbar_init_fence();
            }
            __syncthreads();
            const int rows0[3] = {0, 64, -10};
            if (tid() == 0) {
                fa3::mbar_arrive_expect_tx(bar, 3 * 8192);
                for (int b = 0; b < 3; ++b) {
                    const int32_t c[2] = {0, rows0[b]};
                    emu::tma_load(saddr(base + b * 8192), map, saddr(bar), c, 2);
                }
            }
            fa3::mbar_wait(bar, 0);
            // Element (r, c) of box b: 128-byte rows, 16-byte chunk index XOR (row % 8).
            for (int b = 0; b < 3; ++b)
                for (int r = static_cast<int>(tid()) % 64; r < 64; r += 64)
                    for (int c = 0; c < 64; ++c) {
                        const int gr = rows0[b] + r;
                        const uint16_t want = gr >= 0 && gr < 100 ? g[gr * 64 + c] : 0;
                        const int off = r * 128 + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2;
                        uint16_t got;
                        std::memcpy(&got, base + b * 8192 + off, 2);
                        CHECK(got == want);
                    }
        }, seed);
}

void tma_dst_misaligned() {
    alignas(128) static unsigned char map[128];
    static uint16_t g[64 * 8];
    const uint64_t dims[2] = {64, 8}, strides[1] = {128};
    const uint32_t box[2] = {64, 8}, es[2] = {1, 1};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, strides, box, es, 0, 0, 0, 0, nullptr) == 0);
    launch(32, 8192, [] {
        uint8_t* base = smem_aligned();
        uint64_t* bar = reinterpret_cast<uint64_t*>(base + 4096);
        if (tid() == 0) {
            fa3::mbar_init(bar, 1);
            fa3::mbar_init_fence();
            const int32_t c[2] = {0, 0};
            emu::tma_load(saddr(base + 64), map, saddr(bar), c, 2);
        }
    });
}

void tma_bad_map() {
    launch(32, 8192, [] {
        alignas(128) unsigned char junk[128] = {};
        if (tid() == 0) fa3::tma_prefetch_desc(reinterpret_cast<const fa3::TmaDesc*>(junk));
    });
}

void tma_dst_written_in_flight() {
    alignas(128) static unsigned char map[128];
    static uint16_t g[64 * 8];
    const uint64_t dims[2] = {64, 8}, strides[1] = {128};
    const uint32_t box[2] = {64, 8}, es[2] = {1, 1};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, strides, box, es, 0, 3, 0, 0, nullptr) == 0);
    launch(32, 8192, [] {
        uint8_t* base = smem_aligned();
        uint64_t* bar = reinterpret_cast<uint64_t*>(base + 4096);
        if (tid() == 0) {
            fa3::mbar_init(bar, 1);
            fa3::mbar_init_fence();
        }
        __syncthreads();
        if (tid() == 0) {
            fa3::mbar_arrive_expect_tx(bar, 1024);
            const int32_t c[2] = {0, 0};
            emu::tma_load(saddr(base), map, saddr(bar), c, 2);
            base[10] = 1;  // an ordinary store into the destination before the copy landed
        }
        fa3::mbar_wait(bar, 0);
    }, 1);
}

void encode_rejects() {
    alignas(128) static unsigned char map[128];
    static uint16_t g[64 * 64];
    const uint64_t dims[2] = {64, 64};
    const uint32_t es[2] = {1, 1};
    std::string why;
    const uint64_t bad_stride[1] = {120};
    const uint32_t box[2] = {64, 64};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, bad_stride, box, es, 0, 3, 0, 0, &why) == 1);
    CHECK(why.find("globalStrides") != std::string::npos);
    const uint64_t stride[1] = {128};
    const uint32_t big_box[2] = {64, 300};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, stride, big_box, es, 0, 3, 0, 0, &why) == 1);
    CHECK(why.find("boxDim[1]") != std::string::npos);
    const uint32_t wide[2] = {128, 8};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, stride, wide, es, 0, 3, 0, 0, &why) == 1);
    CHECK(why.find("swizzle span") != std::string::npos);
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g + 1, dims, stride, box, es, 0, 3, 0, 0, &why) == 1);
    CHECK(why.find("16-byte aligned") != std::string::npos);
}

// ---------------------------------------------------------------- wgmma

// A 64 x K operand (K-major) or a K x N one (MN-major) stored in smem, each element placed by
// an explicit formula written here from the canonical layouts (not through sm90_layouts.h).
struct Placed {
    uint32_t start, lbo, sbo;
};
// K-major, swizzle width w (16: none), element size e: rows of w bytes (8 per atom, SBO = 8w),
// or for none core matrices of 8 rows x 16 bytes (SBO = 128) with the second K chunk LBO away.
Placed place_kmajor(uint8_t* base, int rows, int kelems, int w, int e, const std::function<float(int, int)>& val,
                    bool e4m3) {
    const uint32_t b = saddr(base);
    const int lbo = w == 16 ? rows / 8 * 128 : 0;
    for (int r = 0; r < rows; ++r)
        for (int k = 0; k < kelems; ++k) {
            uint32_t off;
            if (w == 16) {
                off = (r % 8) * 16 + (r / 8) * 128 + (k * e % 16) + (k * e / 16) * lbo;
            } else {
                const uint32_t lin = (r % 8) * w + (r / 8) * 8 * w + k * e;
                const uint32_t a = b + lin;
                const uint32_t chunk = (a >> 4) & (w / 16 - 1), row = (a >> 7) & (w / 16 - 1);
                off = lin - chunk * 16 + ((chunk ^ row) * 16);
            }
            const float x = val(r, k);
            if (e == 2) {
                const uint16_t bits = bf16_bits(x);
                std::memcpy(base + off, &bits, 2);
            } else {
                // e4m3 of a small integer in [-4, 4]: exponent bias 7, 3 mantissa bits.
                uint8_t v = 0;
                if (x != 0) {
                    const float ax = std::fabs(x);
                    const int ex = static_cast<int>(std::floor(std::log2(ax)));
                    const int m = static_cast<int>((ax / std::ldexp(1.f, ex) - 1.f) * 8.f + 0.5f);
                    v = static_cast<uint8_t>(((ex + 7) << 3) | m);
                    if (x < 0) v |= 0x80;
                }
                (void)e4m3;
                base[off] = v;
            }
        }
    return Placed{b, static_cast<uint32_t>(lbo), static_cast<uint32_t>(w == 16 ? 128 : 8 * w)};
}
// MN-major (N contiguous), swizzle width w (16: none), 16-bit: for swizzled modes rows of w
// bytes hold w/2 consecutive N; 8 K-rows per atom (SBO = 8w between K groups); the next w/2 N
// are LBO away. For none: 8-element (16-byte) N chunks, K-rows 16 bytes apart, 8 K-rows = one
// core matrix (LBO = 128 between K groups), the next N chunk SBO away.
Placed place_mnmajor(uint8_t* base, int kelems, int n, int w, const std::function<float(int, int)>& val) {
    const uint32_t b = saddr(base);
    const int per_row = w / 2;
    const int lbo = w == 16 ? 128 * (kelems / 8) : kelems / 8 * 8 * w;  // none: K-group stride; else N-block stride
    const int sbo = w == 16 ? 128 * (kelems / 8) * 0 + 256 : 8 * w;
    for (int k = 0; k < kelems; ++k)
        for (int j = 0; j < n; ++j) {
            uint32_t off;
            if (w == 16) {
                // none: chunk j/8 at SBO = 256 (two K groups of 128 bytes), K group at LBO = 128.
                off = (j % 8) * 2 + (j / 8) * 256 + (k % 8) * 16 + (k / 8) * 128;
            } else {
                const uint32_t lin = (j % per_row) * 2 + (j / per_row) * lbo + (k % 8) * w + (k / 8) * sbo;
                const uint32_t a = b + lin;
                const uint32_t chunk = (a >> 4) & (w / 16 - 1), row = (a >> 7) & (w / 16 - 1);
                off = lin - chunk * 16 + ((chunk ^ row) * 16);
            }
            const uint16_t bits = bf16_bits(val(k, j));
            std::memcpy(base + off, &bits, 2);
        }
    if (w == 16) return Placed{b, 128, 256};
    return Placed{b, static_cast<uint32_t>(lbo), static_cast<uint32_t>(sbo)};
}

emu::sm90::Swizzle mode_of(int w) {
    using emu::sm90::Swizzle;
    return w == 128 ? Swizzle::B128 : w == 64 ? Swizzle::B64 : w == 32 ? Swizzle::B32 : Swizzle::None;
}

// D(64 x 64) = A(64 x K) B(K x 64) in one wgmma: A K-major in smem; B K-major or MN-major
// (trans-b), every swizzle width; 16-bit (K = 16) or e4m3 (K = 32, K-major only).
void wgmma_case(int w, bool b_mn, bool e4m3, bool a_regs) {
    const int K = e4m3 ? 32 : 16, e = e4m3 ? 1 : 2;
    auto av = [](int m, int k) { return pat(m, k, 4); };
    auto bv = [](int k, int n) { return pat(k, n, 5); };
    launch(128, 60000, [&] {
        uint8_t* base = smem_aligned();
        uint8_t* sa = base;
        uint8_t* sb = base + 16384;
        Placed pa{}, pb{};
        if (tid() == 0) {
            pa = place_kmajor(sa, 64, K, w, e, av, e4m3);
            if (b_mn) pb = place_mnmajor(sb, K, 64, w, bv);
            else pb = place_kmajor(sb, 64, K, w, e, [&](int n, int k) { return bv(k, n); }, e4m3);
            // Publish the descriptors' fields to the other threads through smem.
            std::memcpy(base + 40000, &pa, sizeof pa);
            std::memcpy(base + 40064, &pb, sizeof pb);
        }
        fa3::fence_proxy_async_smem();
        __syncthreads();
        std::memcpy(&pa, base + 40000, sizeof pa);
        std::memcpy(&pb, base + 40064, sizeof pb);
        const auto m = mode_of(w);
        const uint64_t da = emu::sm90::encode_desc(pa.start, pa.lbo, pa.sbo, 0, m);
        const uint64_t db = emu::sm90::encode_desc(pb.start, pb.lbo, pb.sbo, 0, m);
        float d[32];
        for (float& x : d) x = 100.f;  // scale_d = 0 ignores it
        uint32_t a[4] = {0, 0, 0, 0};
        if (a_regs)
            for (int r = 0; r < 4; ++r) {
                const int t = static_cast<int>(tid());
                a[r] = bf16_bits(av(a_row(t, r), a_col(t, r, 0))) |
                       (static_cast<uint32_t>(bf16_bits(av(a_row(t, r), a_col(t, r, 1)))) << 16);
            }
        const emu::Elem el = e4m3 ? emu::Elem::E4M3 : emu::Elem::BF16;
        fa3::wgmma_fence();
        emu::wgmma_issue(emu::WgmmaInstr{64, 64, K, el, el, a_regs, da, db, 0, 1, 1, 0, b_mn ? 1 : 0}, d, a_regs ? a : nullptr);
        fa3::wgmma_commit();
        fa3::wgmma_wait<0>();
        fa3::fence_regs(d);
        for (int i = 0; i < 32; ++i) {
            const emu::sm90::RowCol rc{acc_row(static_cast<int>(tid()), i), acc_col(static_cast<int>(tid()), i)};
            float ref = 0;
            for (int k = 0; k < K; ++k) ref += av(rc.row, k) * bv(k, rc.col);
            CHECK(d[i] == ref);
        }
    });
}
void wgmma_layouts() {
    for (int w : {16, 32, 64, 128}) {
        wgmma_case(w, false, false, false);  // SS, both K-major
        wgmma_case(w, true, false, false);   // SS, B MN-major
        wgmma_case(w, true, false, true);    // RS, B MN-major (the PV form)
        wgmma_case(w, false, true, false);   // SS e4m3, K = 32
    }
}

// Two chained instructions in one group accumulate; a second group with scale_d = 0 overwrites.
void wgmma_chain_and_groups() {
    launch(128, 60000, [] {
        uint8_t* base = smem_aligned();
        if (tid() == 0) {
            place_kmajor(base, 64, 16, 128, 2, [](int m, int k) { return pat(m, k, 1); }, false);
            place_kmajor(base + 8192, 64, 16, 128, 2, [](int n, int k) { return pat(k, n, 2); }, false);
        }
        fa3::fence_proxy_async_smem();
        __syncthreads();
        const uint32_t b = saddr(base);
        const uint64_t da = emu::sm90::encode_desc(b, 16, 1024, 0, emu::sm90::Swizzle::B128);
        const uint64_t db = emu::sm90::encode_desc(b + 8192, 16, 1024, 0, emu::sm90::Swizzle::B128);
        float d[32], d2[32];
        for (int i = 0; i < 32; ++i) d[i] = 1.f;
        fa3::wgmma_fence();
        fa3::wgmma_m64n64k16_ss<__nv_bfloat16>(d, da, db, 1);  // d = 1 + AB
        fa3::wgmma_m64n64k16_ss<__nv_bfloat16>(d, da, db, 1);  // d = 1 + 2AB
        fa3::wgmma_commit();
        fa3::wgmma_m64n64k16_ss<__nv_bfloat16>(d2, da, db, 0);  // d2 = AB
        fa3::wgmma_commit();
        fa3::wgmma_wait<1>();
        fa3::fence_regs(d);
        fa3::wgmma_wait<0>();
        fa3::fence_regs(d2);
        for (int i = 0; i < 32; ++i) {
            const emu::sm90::RowCol rc{acc_row(static_cast<int>(tid()), i), acc_col(static_cast<int>(tid()), i)};
            float ab = 0;
            for (int k = 0; k < 16; ++k) ab += pat(rc.row, k, 1) * pat(k, rc.col, 2);
            CHECK(d[i] == 1.f + 2.f * ab);
            CHECK(d2[i] == ab);
        }
    });
}

// A minimal correct wgmma sequence with one rule broken by `breakage` (0 = none).
void wgmma_rule(int breakage) {
    launch(128, 60000, [breakage] {
        uint8_t* base = smem_aligned();
        if (tid() == 0) {
            place_kmajor(base, 64, 16, 128, 2, [](int m, int k) { return pat(m, k, 1); }, false);
            place_kmajor(base + 8192, 64, 16, 128, 2, [](int n, int k) { return pat(k, n, 2); }, false);
        }
        if (breakage != 6) fa3::fence_proxy_async_smem();
        __syncthreads();
        const uint32_t b = saddr(base);
        uint64_t da = emu::sm90::encode_desc(b, 16, 1024, 0, emu::sm90::Swizzle::B128);
        const uint64_t db = emu::sm90::encode_desc(b + 8192, 16, 1024, 0, emu::sm90::Swizzle::B128);
        if (breakage == 4 && tid() == 77) da = emu::sm90::encode_desc(b + 32, 16, 1024, 0, emu::sm90::Swizzle::B128);
        if (breakage == 7) da = emu::sm90::encode_desc(b + 58 * 1024, 16, 1024, 0, emu::sm90::Swizzle::B128);
        if (breakage == 8) da = emu::sm90::encode_desc(b + 128, 16, 1024, 0, emu::sm90::Swizzle::B128);
        float d[32] = {};
        uint32_t a[4] = {1, 2, 3, 4};
        if (breakage != 1) fa3::wgmma_fence();
        if (breakage == 5) {
            fa3::wgmma_m64n64k16_rs_tb<__nv_bfloat16>(d, a, db);
            a[2] = 7;  // an A register changed while in flight
        } else {
            fa3::wgmma_m64n64k16_ss<__nv_bfloat16>(d, da, db, 0);
        }
        if (breakage == 9) return;  // uncommitted at exit
        fa3::wgmma_commit();
        if (breakage == 10) return;  // never waited
        if (breakage == 2) fa3::fence_regs(d);  // read while in flight
        if (breakage == 3) d[5] = 0.f;          // written while in flight
        fa3::wgmma_wait<0>();
        fa3::fence_regs(d);
    });
}

// One thread of warp 1 stores both wgmma operands with ordinary stores and fences them; every
// thread then issues the wgmma, after a __syncthreads (barrier: must pass) or without one (the
// other warps' reads race with the stores: must fail by happens-before whatever the order the
// seed gives, either at the issue or at the store).
void wgmma_operands_of_another_warp(bool barrier, uint64_t seed) {
    launch(128, 60000, [barrier] {
        fa3::fence_proxy_async_smem();  // the launch uses the async proxy from here on
        uint8_t* base = smem_aligned();
        if (tid() == 32) {
            place_kmajor(base, 64, 16, 128, 2, [](int m, int k) { return pat(m, k, 1); }, false);
            place_kmajor(base + 8192, 64, 16, 128, 2, [](int n, int k) { return pat(k, n, 2); }, false);
            fa3::fence_proxy_async_smem();
        }
        if (barrier) __syncthreads();
        const uint32_t b = saddr(base);
        const uint64_t da = emu::sm90::encode_desc(b, 16, 1024, 0, emu::sm90::Swizzle::B128);
        const uint64_t db = emu::sm90::encode_desc(b + 8192, 16, 1024, 0, emu::sm90::Swizzle::B128);
        float d[32] = {};
        fa3::wgmma_fence();
        fa3::wgmma_m64n64k16_ss<__nv_bfloat16>(d, da, db, 0);
        fa3::wgmma_commit();
        fa3::wgmma_wait<0>();
        fa3::fence_regs(d);
        for (int i = 0; i < 32; ++i) {
            float want = 0;
            for (int k = 0; k < 16; ++k) want += pat(acc_row(tid(), i), k, 1) * pat(k, acc_col(tid(), i), 2);
            CHECK(d[i] == want);
        }
    }, seed);
}

// ---------------------------------------------------------------- tcgen05 (sm_100a)

// D(128 x 64) = A(128 x 16) B(16 x 64) in one tcgen05.mma (M = 128, N = 64, bf16): A K-major SW128
// from smem, or (a_tmem) from tensor memory written by tcgen05.st (row i in lane i, k in column
// k / 2, low half for even k); B K-major or MN-major. Every thread checks its row (lane) of D,
// loaded with tcgen05.ld 32x32b, against host arithmetic. `breakage` (0 = none) breaks one rule.
void tcgen05_case(bool b_mn, bool a_tmem, int breakage) {
    auto av = [](int m, int k) { return pat(m, k, 6); };
    auto bv = [](int k, int n) { return pat(k, n, 7); };
    launch(128, 60000, [&] {
        uint8_t* base = smem_aligned();
        uint8_t* sa = base;
        uint8_t* sb = base + 16384;  // A: 128 rows of 128 bytes
        uint64_t* bar = reinterpret_cast<uint64_t*>(base + 40000);
        uint32_t* slot = reinterpret_cast<uint32_t*>(base + 40016);
        Placed pa{}, pb{};
        const unsigned t = tid(), warp = t / 32;
        if (warp == 0) {
            fa4::tmem_alloc(slot, 128);
            fa4::tmem_relinquish();
        }
        if (t == 0) {
            pa = place_kmajor(sa, 128, 16, 128, 2, av, false);
            if (b_mn) pb = place_mnmajor(sb, 16, 64, 128, bv);
            else pb = place_kmajor(sb, 64, 16, 128, 2, [&](int n, int k) { return bv(k, n); }, false);
            std::memcpy(base + 40100, &pa, sizeof pa);
            std::memcpy(base + 40200, &pb, sizeof pb);
            fa3::mbar_init(bar, 1);
            fa3::mbar_init_fence();
        }
        fa3::fence_proxy_async_smem();
        fa4::tcgen05_fence_before();
        __syncthreads();
        fa4::tcgen05_fence_after();
        if (breakage == 4 && warp == 0) fa4::tmem_alloc(slot + 1, 32);  // after relinquish
        std::memcpy(&pa, base + 40100, sizeof pa);
        std::memcpy(&pb, base + 40200, sizeof pb);
        const uint32_t tmem = *slot;
        const uint32_t lane0 = 32 * (warp % 4);
        if (a_tmem) {  // A into columns 64..71 of this thread's lane
            uint32_t r[16] = {};
            for (int c = 0; c < 8; ++c)
                r[c] = bf16_bits(av(static_cast<int>(t), 2 * c)) |
                       (static_cast<uint32_t>(bf16_bits(av(static_cast<int>(t), 2 * c + 1))) << 16);
            fa4::tmem_st_32x32b_x16(fa4::tmem_addr(tmem, static_cast<int>(lane0), 64), r);
            if (breakage != 6) fa4::tmem_wait_st();
            fa4::tcgen05_fence_before();
            __syncthreads();
        }
        if (t == 0) {
            fa4::tcgen05_fence_after();
            using emu::sm100::Layout;
            const uint64_t da = emu::sm100::encode_umma_desc(pa.start, pa.lbo, pa.sbo, 0, Layout::B128);
            const uint64_t db = emu::sm100::encode_umma_desc(pb.start, pb.lbo, pb.sbo, 0, Layout::B128);
            const uint32_t idesc = emu::sm100::encode_idesc(1, 1, 1, 0, b_mn ? 1 : 0, 128, 64);
            // 3: a long queue of MMAs (the first overwrites, the rest accumulate), so that loads
            // of other threads meet some of them still in flight whatever the interleaving.
            for (int i = 0; i < (breakage == 3 ? 32 : 1); ++i) {
                if (a_tmem) fa4::umma_f16_ts(tmem, fa4::tmem_addr(tmem, 0, 64), db, idesc, i > 0);
                else fa4::umma_f16_ss(tmem, da, db, idesc, i > 0);
            }
            fa4::umma_commit(bar);
        }
        if (breakage == 3) {  // every thread reads D without waiting for the commit
            uint32_t r[32];
            fa4::tmem_ld_32x32b_x32(fa4::tmem_addr(tmem, static_cast<int>(lane0), 0), r);
            fa4::tmem_wait_ld(r);
        }
        if (breakage != 3) fa3::mbar_wait(bar, 0);
        __syncwarp();
        fa4::tcgen05_fence_after();
        const uint32_t lane_field = breakage == 2 && warp == 1 ? 0 : lane0;  // 2: warp 1 names lanes 0..31
        for (int h = 0; h < 2 && breakage != 3; ++h) {
            uint32_t r[32];
            fa4::tmem_ld_32x32b_x32(fa4::tmem_addr(tmem, static_cast<int>(lane_field), 32 * h), r);
            if (breakage == 5) r[3] = 1;  // written before wait::ld
            fa4::tmem_wait_ld(r);
            for (int n = 0; n < 32; ++n) {
                float ref = 0;
                for (int k = 0; k < 16; ++k) ref += av(static_cast<int>(t), k) * bv(k, 32 * h + n);
                CHECK(__uint_as_float(r[n]) == ref);
            }
        }
        if (breakage == 3) fa3::mbar_wait(bar, 0);  // late, so the phase is not left incomplete
        fa4::tcgen05_fence_before();
        __syncthreads();
        if (warp == 0 && breakage != 1) {
            fa4::tcgen05_fence_after();
            fa4::tmem_dealloc(tmem, 128);
        }
    });
}
void tcgen05_layouts() {
    for (bool b_mn : {false, true})
        for (bool a_tmem : {false, true}) tcgen05_case(b_mn, a_tmem, 0);
}

// ---------------------------------------------------------------- setmaxnreg

void setmaxnreg_ok() {
    launch(384, 1024, [] {
        if (tid() < 128) fa3::setmaxnreg_dec<24>();
        else fa3::setmaxnreg_inc<240>();
    }, 1, 168);
}
void setmaxnreg_nonuniform() {
    launch(256, 1024, [] {
        if (tid() < 64) fa3::setmaxnreg_dec<24>();
        else if (tid() < 128) fa3::setmaxnreg_dec<32>();
    }, 1, 168);
}
void setmaxnreg_pool_exhausted() {
    launch(384, 1024, [] {
        if (tid() >= 128) fa3::setmaxnreg_inc<240>();  // nobody gives registers back
    }, 1, 168);
}

// ---------------------------------------------------------------- the drivers' buffers

// guarded_buffers.h: a write into the rounding slack on either side of a buffer is reported, a
// read past the slack faults on the guard page, and a buffer survives a move.
void report_overwrite(const emu_buffers::Guarded& g) {
    if (const char* where = g.overwritten()) {
        std::fprintf(stderr, "a write %s of the buffer\n", where);
        std::_Exit(3);
    }
}
void buffer_guards_ok() {
    emu_buffers::Guarded g(100, "t");
    for (int i = 0; i < 100; ++i) g.data()[i] = static_cast<unsigned char>(i);
    emu_buffers::Guarded moved = std::move(g);
    CHECK(g.data() == nullptr && moved.bytes() == 100 && moved.data()[99] == 99);
    report_overwrite(moved);
}
void buffer_written_past_end() {
    emu_buffers::Guarded g(100, "t");
    g.data()[100] = 0;
    report_overwrite(g);
}
void buffer_written_before_start() {
    emu_buffers::Guarded g(100, "t");
    g.data()[-1] = 0;
    report_overwrite(g);
}
void buffer_read_past_guard() {
    std::signal(SIGSEGV, [](int) {
        const char msg[] = "fault on the guard page\n";
        (void)!write(2, msg, sizeof msg - 1);
        std::_Exit(3);
    });
    emu_buffers::Guarded g(100, "t");
    const volatile unsigned char* p = g.data();
    std::printf("%d\n", p[256]);  // the rounding slack ends at 256: the next byte is the guard page
}

// A store onto a buffer's guard page by one thread of a launch: the fault report names the
// thread and the buffer.
void fault_is_diagnosed() {
    emu_buffers::Buffer b;
    b.name = "o";
    b.dev = 0x4000;
    b.mem = emu_buffers::Guarded(100, "o");
    emu_buffers::g_buffers.push_back(std::move(b));
    emu::set_fault_describer(&emu_buffers::describe_host_address);
    unsigned char* p = emu_buffers::g_buffers.back().mem.data();
    launch(64, 1024, [p] {
        if (tid() == 33) {
            volatile unsigned char* q = p;
            q[300] = 1;
        }
    });
}

struct Test {
    const char* name;
    const char* expect;  // nullptr: must pass; else a substring of the failure message
    std::function<void()> run;
};

const std::vector<Test>& tests() {
    static const std::vector<Test> t = {
        {"sched_orders_differ", nullptr, sched_orders_differ},
        {"smem_not_1024_aligned", nullptr, smem_not_1024_aligned},
        {"smem_redzone", "past the end of the dynamic allocation", smem_redzone},
        {"syncthreads_after_exit", "__syncthreads", syncthreads_after_exit},
        {"deadlock_report", "warp 1 (warpgroup 0), lanes 0xffffffff: waits in bar.sync", deadlock_report},
        {"named_bar_pingpong_ok", nullptr, named_bar_pingpong_ok},
        {"named_bar_count_mismatch", "while its current phase expects", named_bar_count_mismatch},
        {"named_bar_partial_warp", "part of warp", named_bar_partial_warp},
        {"named_bar_twice", "arrives twice at barrier 4", named_bar_twice},
        {"shfl_and_elect", nullptr, shfl_and_elect},
        {"divergent_collective", "divergent warp collective", divergent_collective},
        {"ldmatrix_mma", nullptr, ldmatrix_mma},
        {"cp_async_ok", nullptr, cp_async_ok},
        {"cp_async_read_before_wait", "cp.async copy of thread", cp_async_read_before_wait},
        {"cp_async_warp_ok", nullptr, cp_async_warp_ok},
        {"cp_async_no_barrier_late", "has not synchronised with thread", [] { cp_async_no_barrier(0); }},
        {"cp_async_no_barrier_soon", "has not synchronised with thread", [] { cp_async_no_barrier(1); }},
        {"cp_async_no_barrier_at_once", "has not synchronised with thread", [] { cp_async_no_barrier(2); }},
        {"tma_read_after_wait_ok", nullptr, [] { for (int p = 0; p < 3; ++p) tma_read_before_wait(p, true); }},
        {"tma_read_before_wait_late", "happens-before: ldmatrix.x4 by thread", [] { tma_read_before_wait(0, false); }},
        {"tma_read_before_wait_soon", "the missing acquire: mbarrier.try_wait.parity(0)", [] { tma_read_before_wait(1, false); }},
        {"tma_read_before_wait_at_once", "the missing acquire: mbarrier.try_wait.parity(0)", [] { tma_read_before_wait(2, false); }},
        {"mbar_phases_ok", nullptr, mbar_phases_ok},
        {"mbar_arrival_underflow", "arrival underflow", mbar_arrival_underflow},
        {"mbar_tx_pending_at_exit", "incomplete at exit (0 of 1 arrivals missing, 64 tx bytes", mbar_tx_pending_at_exit},
        {"mbar_never_completes", "awaited parity 0; barrier: phase 0 (parity 0) in progress: 1 of 2 arrivals", mbar_never_completes},
        {"mbar_uninitialised", "not an initialised mbarrier", mbar_uninitialised},
        {"mbar_overwritten", "overwritten by an ordinary store", mbar_overwritten},
        {"tma_box_oob_swizzle", nullptr, tma_box_oob_swizzle},
        {"tma_dst_misaligned", "not 128-byte aligned", tma_dst_misaligned},
        {"tma_bad_map", "not a tensor map", tma_bad_map},
        {"tma_dst_written_in_flight", "were written before it landed", tma_dst_written_in_flight},
        {"encode_rejects", nullptr, encode_rejects},
        {"wgmma_layouts", nullptr, wgmma_layouts},
        {"wgmma_chain_and_groups", nullptr, wgmma_chain_and_groups},
        {"wgmma_ok", nullptr, [] { wgmma_rule(0); }},
        {"wgmma_no_fence", "without a wgmma.fence", [] { wgmma_rule(1); }},
        {"wgmma_read_in_flight", "is read (fence_regs) while wgmma", [] { wgmma_rule(2); }},
        {"wgmma_write_in_flight", "written by the thread while wgmma", [] { wgmma_rule(3); }},
        {"wgmma_desc_mismatch", "must issue the same descriptors", [] { wgmma_rule(4); }},
        {"wgmma_a_reg_changed", "changed A register 2", [] { wgmma_rule(5); }},
        {"wgmma_unfenced_generic_store", "after the last fence.proxy.async", [] { wgmma_rule(6); }},
        {"wgmma_operands_of_another_warp_ok", nullptr, [] { for (uint64_t s = 1; s <= 3; ++s) wgmma_operands_of_another_warp(true, s); }},
        {"wgmma_operands_of_another_warp_seed1", "happens-before", [] { wgmma_operands_of_another_warp(false, 1); }},
        {"wgmma_operands_of_another_warp_seed2", "happens-before", [] { wgmma_operands_of_another_warp(false, 2); }},
        {"wgmma_operands_of_another_warp_seed3", "happens-before", [] { wgmma_operands_of_another_warp(false, 3); }},
        {"wgmma_operand_outside_smem", "outside the dynamic shared memory", [] { wgmma_rule(7); }},
        {"wgmma_base_offset", "base_offset does not equal", [] { wgmma_rule(8); }},
        {"wgmma_uncommitted_at_exit", "never committed", [] { wgmma_rule(9); }},
        {"wgmma_unwaited_at_exit", "never waited for", [] { wgmma_rule(10); }},
        {"tcgen05_layouts", nullptr, tcgen05_layouts},
        {"tcgen05_not_deallocated", "not freed by tcgen05.dealloc at exit", [] { tcgen05_case(false, false, 1); }},
        {"tcgen05_ld_other_lanes", "may only access lanes 32..63", [] { tcgen05_case(false, false, 2); }},
        {"tcgen05_ld_before_commit", "has not written yet", [] { tcgen05_case(false, false, 3); }},
        {"tcgen05_alloc_after_relinquish", "after tcgen05.relinquish_alloc_permit", [] { tcgen05_case(false, false, 4); }},
        {"tcgen05_ld_register_written", "before tcgen05.wait::ld", [] { tcgen05_case(false, false, 5); }},
        {"tcgen05_mma_over_unwaited_st", "has not completed", [] { tcgen05_case(false, true, 6); }},
        {"setmaxnreg_ok", nullptr, setmaxnreg_ok},
        {"setmaxnreg_nonuniform", "must be warpgroup-uniform", setmaxnreg_nonuniform},
        {"setmaxnreg_pool_exhausted", "the CTA pool has 0 free", setmaxnreg_pool_exhausted},
        {"buffer_guards_ok", nullptr, buffer_guards_ok},
        {"buffer_written_past_end", "a write past the end of the buffer", buffer_written_past_end},
        {"buffer_written_before_start", "a write before the start of the buffer", buffer_written_before_start},
        {"buffer_read_past_guard", "fault on the guard page", buffer_read_past_guard},
        {"fault_is_diagnosed", "thread 33 (warpgroup 0, warp 1, lane 1)\n  the address: 200 bytes past the end of buffer o (device 0x4000",
         fault_is_diagnosed},
    };
    return t;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc == 2) {
        for (const Test& t : tests())
            if (argv[1] == std::string(t.name)) {
                t.run();
                std::printf("%s: returned normally\n", t.name);
                return 0;
            }
        std::fprintf(stderr, "no test %s\n", argv[1]);
        return 2;
    }
    int bad = 0;
    for (const Test& t : tests()) {
        int fds[2];
        if (pipe(fds) != 0) return 2;
        std::fflush(stdout);
        const pid_t pid = fork();
        if (pid == 0) {
            dup2(fds[1], 1);
            dup2(fds[1], 2);
            close(fds[0]);
            t.run();
            std::fflush(stdout);
            std::_Exit(0);
        }
        close(fds[1]);
        std::string out;
        char buf[4096];
        for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
        close(fds[0]);
        int status = 0;
        waitpid(pid, &status, 0);
        const bool exited_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        bool ok;
        if (!t.expect) ok = exited_ok;
        else ok = !exited_ok && out.find("SELFTEST CHECK FAILED") == std::string::npos && out.find(t.expect) != std::string::npos;
        std::printf("%s %s%s%s%s\n", ok ? "PASS" : "FAIL", t.name, t.expect ? " (must fail: " : "", t.expect ? t.expect : "",
                    t.expect ? ")" : "");
        if (!ok) {
            ++bad;
            std::printf("---- output of %s (status %d):\n%s----\n", t.name, status, out.c_str());
        }
    }
    std::printf("%d of %zu emulator self-tests as expected\n", static_cast<int>(tests().size()) - bad, tests().size());
    return bad ? 1 : 0;
}

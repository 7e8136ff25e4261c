// The emulator self-tests' harness (selftest/): a test is a small kernel body launched on the
// emulator that must pass (results checked against host arithmetic) or fail with an expected
// diagnosis; each topic's file lists its tests, main.cpp runs them all.
#pragma once
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

namespace selftest {

[[noreturn]] inline void check_failed(const char* what, const char* file, int line) {
    std::fprintf(stderr, "SELFTEST CHECK FAILED (%s:%d): %s\n", file, line, what);
    std::_Exit(1);
}
#define CHECK(c)                                          \
    do {                                                  \
        if (!(c)) check_failed(#c, __FILE__, __LINE__);   \
    } while (0)

// The kernel body of the current launch (one per test, set before launching).
inline std::function<void()> g_body;
inline void trampoline(void*) { g_body(); }

// The land policy of every copy (emu::LaunchConfig::land_policy); -1: the seed's (seed 1 lands
// as late as possible, seed 2 at once, seed 3 soon), which the timing tests rely on.
inline int g_land_policy = -1;

inline void launch(unsigned threads, unsigned smem, std::function<void()> body, uint64_t seed = 1, unsigned regs = 0,
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

inline unsigned tid() { return threadIdx.x; }
inline uint8_t* smem() { return emu_shared_window; }  // the first byte of the dynamic shared memory
inline uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
// First 1024-aligned byte of the dynamic smem (its base is deliberately not aligned).
inline uint8_t* smem_aligned(uint32_t align = 1024) {
    const uint32_t a = saddr(smem());
    return smem() + (align - a % align) % align;
}

inline uint16_t bf16_bits(float x) { return __float2bfloat16_rn(x).__x; }
inline uint16_t f16_bits(float x) { return __float2half_rn(x).__x; }

// A deterministic small-integer pattern (exact in bf16/f16/e4m3 and in products).
inline float pat(int i, int j, int salt) { return static_cast<float>(((i * 7 + j * 13 + salt * 5) % 9) - 4); }

struct Test {
    const char* name;
    const char* expect;  // nullptr: must pass; else a substring of the failure message
    std::function<void()> run;
};

// The tests of each topic (one file each), in the order main.cpp runs them.
std::vector<Test> scheduling_tests();
std::vector<Test> barriers_tests();
std::vector<Test> collectives_tests();
std::vector<Test> cp_async_tests();
std::vector<Test> tma_tests();
std::vector<Test> mbarrier_tests();
std::vector<Test> wgmma_tests();
std::vector<Test> tcgen05_tests();
std::vector<Test> setmaxnreg_tests();
std::vector<Test> buffers_tests();

}  // namespace selftest

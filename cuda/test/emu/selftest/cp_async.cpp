// Self-tests of cp.async: copies with zero fill, and the happens-before of reading them across
// lanes (with and without a barrier, under each land policy) or before the wait.
#include "harness.h"

namespace selftest {
namespace {

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

}  // namespace

std::vector<Test> cp_async_tests() {
    return {
        {"cp_async_ok", nullptr, cp_async_ok},
        {"cp_async_read_before_wait", "cp.async copy of thread", cp_async_read_before_wait},
        {"cp_async_warp_ok", nullptr, cp_async_warp_ok},
        {"cp_async_no_barrier_late", "has not synchronised with thread", [] { cp_async_no_barrier(0); }},
        {"cp_async_no_barrier_soon", "has not synchronised with thread", [] { cp_async_no_barrier(1); }},
        {"cp_async_no_barrier_at_once", "has not synchronised with thread", [] { cp_async_no_barrier(2); }},
    };
}

}  // namespace selftest

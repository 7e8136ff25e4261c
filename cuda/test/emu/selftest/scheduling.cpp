// Self-tests of the scheduler and the CTA: seeds give different interleavings, the dynamic shared
// memory's placement and redzone, __syncthreads after an exit, the deadlock report.
#include "harness.h"

namespace selftest {
namespace {

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

}  // namespace

std::vector<Test> scheduling_tests() {
    return {
        {"sched_orders_differ", nullptr, sched_orders_differ},
        {"smem_not_1024_aligned", nullptr, smem_not_1024_aligned},
        {"smem_redzone", "past the end of the dynamic allocation", smem_redzone},
        {"syncthreads_after_exit", "__syncthreads", syncthreads_after_exit},
        {"deadlock_report", "warp 1 (warpgroup 0), lanes 0xffffffff: waits in bar.sync", deadlock_report},
    };
}

}  // namespace selftest

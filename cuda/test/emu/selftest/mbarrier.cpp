// Self-tests of mbarriers: phases and parity, and each misuse.
#include "harness.h"

namespace selftest {
namespace {

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

}  // namespace

std::vector<Test> mbarrier_tests() {
    return {
        {"mbar_phases_ok", nullptr, mbar_phases_ok},
        {"mbar_arrival_underflow", "arrival underflow", mbar_arrival_underflow},
        {"mbar_tx_pending_at_exit", "incomplete at exit (0 of 1 arrivals missing, 64 tx bytes", mbar_tx_pending_at_exit},
        {"mbar_never_completes", "awaited parity 0; barrier: phase 0 (parity 0) in progress: 1 of 2 arrivals", mbar_never_completes},
        {"mbar_uninitialised", "not an initialised mbarrier", mbar_uninitialised},
        {"mbar_overwritten", "overwritten by an ordinary store", mbar_overwritten},
    };
}

}  // namespace selftest

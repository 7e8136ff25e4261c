// Self-tests of named barriers (bar.sync/bar.arrive): a ping-pong, and each misuse.
#include "harness.h"

namespace selftest {
namespace {

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

}  // namespace

std::vector<Test> barriers_tests() {
    return {
        {"named_bar_pingpong_ok", nullptr, named_bar_pingpong_ok},
        {"named_bar_count_mismatch", "while its current phase expects", named_bar_count_mismatch},
        {"named_bar_partial_warp", "part of warp", named_bar_partial_warp},
        {"named_bar_twice", "arrives twice at barrier 4", named_bar_twice},
    };
}

}  // namespace selftest

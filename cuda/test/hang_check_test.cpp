// Host run of the hang-check build's wait policy and report text (cuda/sm90/hang_check.cuh),
// no GPU: the very wait_loop / print_timeout / print_wait the kernels use, with a fake clock and a
// probe standing in for mbarrier.try_wait (tests/emulator/hang_check.rs builds it with g++ and checks).
//   hang_check_test          a never-completing wait: prints the report, then the trap report,
//                            exits 3 (where the GPU executes trap)
//   hang_check_test done     a wait completing after a few polls inside the limit: silent, exit 0
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "sm90/hang_check.cuh"

int main(int argc, char** argv) {
    const bool completes = argc > 1 && std::strcmp(argv[1], "done") == 0;
    const uint64_t limit = 1000000000ull;  // the default FA_HANG_CHECK_NS
    uint64_t clock = 0, probes = 0;
    auto probe = [&] {
        ++probes;
        return completes && probes == 5;
    };
    auto now = [&] { return clock += 7000000; };  // 7 ms per poll
    // What a consumer of stage 4 waiting on k_full[1] would report (offsets of Fa3Traits<4, 64>).
    const fa_hang::Wait w{fa_hang::kMbarrier, 0x14010, 1};
    int reports = 0;
    const uint64_t polls = fa_hang::wait_loop(
        probe, now, limit,
        [&](uint64_t waited, uint64_t n) {
            ++reports;
            fa_hang::print_timeout(3, 1, 0, 4, 130, w, "k_full", 1, waited, n, false);
            // The board lines of the CTA: the producer on k_empty[0], a consumer in bar.sync.
            fa_hang::print_wait("flash_attn hang check:   board:", 3, 1, 0, 0, -1,
                                fa_hang::Wait{fa_hang::kMbarrier, 0x14028, 0}, "k_empty", 0);
            fa_hang::print_wait("flash_attn hang check:   board:", 3, 1, 0, 8, -1,
                                fa_hang::Wait{fa_hang::kNamedBarrier, 2, 256}, nullptr, -1);
        },
        [&](uint64_t waited, uint64_t n) {
            fa_hang::print_timeout(3, 1, 0, 4, 130, w, "k_full", 1, waited, n, true);
            std::printf("hang_check_test: trap after %d report(s), %llu polls\n", reports,
                        static_cast<unsigned long long>(n));
            std::fflush(stdout);
            std::exit(3);
        });
    std::printf("hang_check_test: completed after %llu polls, %d report(s)\n", static_cast<unsigned long long>(polls),
                reports);
    return reports == 0 ? 0 : 1;
}

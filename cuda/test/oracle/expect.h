// The tally of the sm_80 and sm_90 layout checks against CuTe (check_sm80.cpp, check_sm90.cpp):
// checks counted, the first 20 mismatches printed with their line, one summary line per section.
#pragma once
#include <cstdio>

namespace cute_oracle {

struct Expect {
    const char* arch;  // "sm80", "sm90": the summary lines' prefix
    int bad = 0;
    long cases = 0;
    // The summary of the checks since (cases_before, bad_before).
    void section(const char* what, long cases_before, int bad_before) const {
        std::printf("cute-oracle %s: %s: %ld checks, %s\n", arch, what, cases - cases_before,
                    bad == bad_before ? "equal to CuTe" : "MISMATCH");
    }
};

}  // namespace cute_oracle

// Counts one check of `tally` (a cute_oracle::Expect); prints the first 20 that fail.
#define CUTE_ORACLE_EXPECT(tally, cond, ...)                                \
    do {                                                                    \
        ++(tally).cases;                                                    \
        if (!(cond) && (tally).bad++ < 20) {                                \
            std::printf("  MISMATCH %s:%d: ", __FILE__, __LINE__);          \
            std::printf(__VA_ARGS__);                                       \
            std::printf("\n");                                              \
        }                                                                   \
    } while (0)

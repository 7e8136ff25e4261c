// The CuTe oracle's test program (tests/cute_oracle.rs builds and runs it): our sm_90a and sm_80
// layouts against NVIDIA's CuTe definitions (cute_maps.h). One line per checked group; exit 1 on
// any mismatch.
#include <cstdio>

#include "cute_maps.h"

int check_sm90();
int check_sm80();

int main() {
    std::printf("cute-oracle: CUTLASS %s\n", cute_oracle::cutlass_version());
    const int bad = check_sm90() + check_sm80();
    if (bad) {
        std::printf("cute-oracle: %d MISMATCHES\n", bad);
        return 1;
    }
    std::printf("cute-oracle: every checked layout equals CuTe's\n");
    return 0;
}

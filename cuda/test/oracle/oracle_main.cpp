// The CuTe oracle's test program (tests/toolchain/cute_oracle.rs builds and runs it): our sm_90a and sm_80
// layouts (the kernels' helpers: check_sm90.cpp, check_sm80.cpp; the emulator's decoders:
// check_emu.cpp; the sm_100a encodings: check_sm100.cpp) against NVIDIA's CuTe definitions (cute_maps.h). One line per checked group; exit 1 on
// any mismatch.
#include <cstdio>

#include "cute_maps.h"

int check_sm90();
int check_sm80();
int check_emu();
int check_sm100();

int main() {
    std::printf("cute-oracle: CUTLASS %s\n", cute_oracle::cutlass_version());
    const int bad = check_sm90() + check_sm80() + check_emu() + check_sm100();
    if (bad) {
        std::printf("cute-oracle: %d MISMATCHES\n", bad);
        return 1;
    }
    std::printf("cute-oracle: every checked layout equals CuTe's\n");
    return 0;
}

// The e4m3 codec of cuda/common/fp8.cuh as the emulator compiles it (through the host
// cuda/test/emu/include/cuda_fp8.h), for tests/emulator/fp8.rs to compare with the Rust codec.
// Writes to stdout: the decode of every code (f32, little endian), then the code of each f32 bit
// pattern of the sweep: every 4099th pattern, then for sign 0 and 1 every 61st pattern of
// [2^-12, 1024) (e4m3's range and its neighbourhood). The test enumerates the same sweep.
#include <cstdio>

#include "common/fp8.cuh"

int main() {
    for (int c = 0; c < 256; ++c) {
        const uint32_t u = fa_f2u(fa_e4m3_decode(static_cast<uint8_t>(c)));
        std::fwrite(&u, 4, 1, stdout);
    }
    for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 4099) std::putchar(fa_e4m3_encode(fa_u2f(static_cast<uint32_t>(b))));
    const uint32_t lo = fa_f2u(1.0f / 4096.0f), hi = fa_f2u(1024.0f);
    for (uint32_t sign : {0u, 0x80000000u})
        for (uint32_t b = lo; b < hi; b += 61) std::putchar(fa_e4m3_encode(fa_u2f(b | sign)));
    return 0;
}

// Operands of the matrix self-tests (wgmma, tcgen05) stored in shared memory, each element placed
// by an explicit formula written from the canonical layouts (not through sm90_layouts.h).
#pragma once
#include "harness.h"

namespace selftest {

struct Placed {
    uint32_t start, lbo, sbo;
};
// K-major, swizzle width w (16: none), element size e: rows of w bytes (8 per atom, SBO = 8w),
// or for none core matrices of 8 rows x 16 bytes (SBO = 128) with the second K chunk LBO away.
inline Placed place_kmajor(uint8_t* base, int rows, int kelems, int w, int e, const std::function<float(int, int)>& val,
                           bool e4m3) {
    const uint32_t b = saddr(base);
    const int lbo = w == 16 ? rows / 8 * 128 : 0;
    for (int r = 0; r < rows; ++r)
        for (int k = 0; k < kelems; ++k) {
            uint32_t off;
            if (w == 16) {
                off = (r % 8) * 16 + (r / 8) * 128 + (k * e % 16) + (k * e / 16) * lbo;
            } else {
                const uint32_t lin = (r % 8) * w + (r / 8) * 8 * w + k * e;
                const uint32_t a = b + lin;
                const uint32_t chunk = (a >> 4) & (w / 16 - 1), row = (a >> 7) & (w / 16 - 1);
                off = lin - chunk * 16 + ((chunk ^ row) * 16);
            }
            const float x = val(r, k);
            if (e == 2) {
                const uint16_t bits = bf16_bits(x);
                std::memcpy(base + off, &bits, 2);
            } else {
                // e4m3 of a small integer in [-4, 4]: exponent bias 7, 3 mantissa bits.
                uint8_t v = 0;
                if (x != 0) {
                    const float ax = std::fabs(x);
                    const int ex = static_cast<int>(std::floor(std::log2(ax)));
                    const int m = static_cast<int>((ax / std::ldexp(1.f, ex) - 1.f) * 8.f + 0.5f);
                    v = static_cast<uint8_t>(((ex + 7) << 3) | m);
                    if (x < 0) v |= 0x80;
                }
                (void)e4m3;
                base[off] = v;
            }
        }
    return Placed{b, static_cast<uint32_t>(lbo), static_cast<uint32_t>(w == 16 ? 128 : 8 * w)};
}
// MN-major (N contiguous), swizzle width w (16: none), 16-bit: for swizzled modes rows of w
// bytes hold w/2 consecutive N; 8 K-rows per atom (SBO = 8w between K groups); the next w/2 N
// are LBO away. For none: 8-element (16-byte) N chunks, K-rows 16 bytes apart, 8 K-rows = one
// core matrix (LBO = 128 between K groups), the next N chunk SBO away.
inline Placed place_mnmajor(uint8_t* base, int kelems, int n, int w, const std::function<float(int, int)>& val) {
    const uint32_t b = saddr(base);
    const int per_row = w / 2;
    const int lbo = w == 16 ? 128 * (kelems / 8) : kelems / 8 * 8 * w;  // none: K-group stride; else N-block stride
    const int sbo = w == 16 ? 128 * (kelems / 8) * 0 + 256 : 8 * w;
    for (int k = 0; k < kelems; ++k)
        for (int j = 0; j < n; ++j) {
            uint32_t off;
            if (w == 16) {
                // none: chunk j/8 at SBO = 256 (two K groups of 128 bytes), K group at LBO = 128.
                off = (j % 8) * 2 + (j / 8) * 256 + (k % 8) * 16 + (k / 8) * 128;
            } else {
                const uint32_t lin = (j % per_row) * 2 + (j / per_row) * lbo + (k % 8) * w + (k / 8) * sbo;
                const uint32_t a = b + lin;
                const uint32_t chunk = (a >> 4) & (w / 16 - 1), row = (a >> 7) & (w / 16 - 1);
                off = lin - chunk * 16 + ((chunk ^ row) * 16);
            }
            const uint16_t bits = bf16_bits(val(k, j));
            std::memcpy(base + off, &bits, 2);
        }
    if (w == 16) return Placed{b, 128, 256};
    return Placed{b, static_cast<uint32_t>(lbo), static_cast<uint32_t>(sbo)};
}

}  // namespace selftest

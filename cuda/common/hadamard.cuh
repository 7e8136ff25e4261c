// Incoherent processing (FlashAttention-3 §3.3): x -> H·D·x / sqrt(d), the same steps as
// src/numerics/hadamard.rs. D is a ±1 diagonal from SplitMix64 (counter based: entry i uses the
// i-th output of the stream seeded with `seed`, so any thread can compute its own sign), H the
// Sylvester-order Walsh–Hadamard matrix applied by the butterfly, d a power of two.
#pragma once

#include <math.h>
#include "common/numerics.cuh"

#define FA_SPLITMIX64_GAMMA 0x9E3779B97F4A7C15ull

FA_HD uint64_t fa_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The i-th (0-based) output of SplitMix64 seeded with `seed`.
FA_HD uint64_t fa_splitmix64_nth(uint64_t seed, uint64_t i) {
    return fa_mix64(seed + (i + 1) * FA_SPLITMIX64_GAMMA);
}

// Sign of entry i of the random diagonal: the top bit of the i-th output.
FA_HD float fa_hadamard_sign(uint64_t seed, int i) {
    return (fa_splitmix64_nth(seed, (uint64_t)i) >> 63) ? -1.0f : 1.0f;
}

// 1/sqrt(d): a correctly rounded sqrt, then a correctly rounded division.
FA_HD float fa_hadamard_norm(int d) { return fa_div_rn(1.0f, fa_sqrt_rn((float)d)); }

// In-place unnormalised transform x <- H x: stages h = 1, 2, 4, ...; pair (x[j], x[j+h]) becomes
// (a + b, a - b). The same stage and pair order as the Rust butterfly.
FA_HD void fa_fwht(float* x, int d) {
    for (int h = 1; h < d; h *= 2) {
        for (int i = 0; i < d; i += 2 * h) {
            for (int j = i; j < i + h; ++j) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
    }
}

// Rotates one row of d values in place: signs, butterfly, normalisation.
FA_HD void fa_hadamard_rotate(float* x, int d, uint64_t seed) {
    for (int i = 0; i < d; ++i) x[i] *= fa_hadamard_sign(seed, i);
    fa_fwht(x, d);
    float norm = fa_hadamard_norm(d);
    for (int i = 0; i < d; ++i) x[i] *= norm;
}

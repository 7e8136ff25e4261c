//! FP8 codecs with NVIDIA's semantics (round to nearest even, saturate to the largest finite
//! value, NaN stays NaN), shared with `cuda/common/fp8.cuh`.
//!
//! The codecs are `float8` 0.7's, a port of CUDA's `__nv_cvt_double_to_fp8` with `SatFinite`;
//! it matches CUDA 13.0's host conversion bit for bit except for the NaN encoding (float8 keeps
//! NaN's sign, CUDA gives 0x7F), so compare NaN-ness, never NaN bits. [`round_e4m3`] is a fast
//! bit-level rounding for the hot loop (P in e4m3), tested against the codec.

use float8::{F8E4M3, F8E5M2};

/// Largest finite e4m3 value (`S.1111.110`): everything larger saturates here.
pub const E4M3_MAX: f32 = 448.0;
/// Largest finite e5m2 value (`S.11110.11`).
pub const E5M2_MAX: f32 = 57344.0;
/// Smallest normal e4m3 value, `2^-6`; below it the spacing is the subnormal step.
pub const E4M3_MIN_NORMAL: f32 = 1.0 / 64.0;
/// e4m3's subnormal step (and smallest positive value), `2^-9`.
pub const E4M3_SUBNORMAL_STEP: f32 = 1.0 / 512.0;
/// Mantissa bits an f32 has beyond e4m3's 3: they are rounded away.
const E4M3_DROPPED_BITS: u32 = 23 - 3;

/// Encodes `x` as e4m3 (satfinite, round to nearest even).
#[inline]
pub fn e4m3_from_f32(x: f32) -> u8 {
    F8E4M3::from_f32(x).to_bits()
}

/// Decodes an e4m3 code (exact in f32).
#[inline]
pub fn e4m3_to_f32(code: u8) -> f32 {
    F8E4M3::from_bits(code).to_f32()
}

/// Decodes an e4m3 code from its bits, with no table and no branch, so that a loop over codes
/// vectorises (the FP8 KV cache's inner loop): exponent and mantissa shift into an f32's (bias
/// 7 → 127); an exponent-0 code (subnormal, `m · 2^-9`) is read as the normal `2^-6 · (1 +
/// m/8)` minus `2^-6`, exact and never an f32 subnormal; `S.1111.111` is NaN. Equal to
/// [`e4m3_to_f32`] for every code.
#[inline(always)]
pub fn e4m3_decode(code: u8) -> f32 {
    let c = code as u32;
    let em = c & 0x7F;
    let subnormal = em < 8;
    let biased = (em << E4M3_DROPPED_BITS) + if subnormal { (127 - 6) << 23 } else { (127 - 7) << 23 };
    let mag = f32::from_bits(biased) - if subnormal { E4M3_MIN_NORMAL } else { 0.0 };
    let mag = if em == 0x7F { f32::NAN } else { mag };
    f32::from_bits(mag.to_bits() | ((c & 0x80) << 24))
}

/// Encodes `x` as e5m2 (satfinite, round to nearest even).
#[inline]
pub fn e5m2_from_f32(x: f32) -> u8 {
    F8E5M2::from_f32(x).to_bits()
}

/// Decodes an e5m2 code (exact in f32).
#[inline]
pub fn e5m2_to_f32(code: u8) -> f32 {
    F8E5M2::from_bits(code).to_f32()
}

/// `x` rounded to the nearest e4m3 value (satfinite, ties to even), returned in f32: the same
/// value as `e4m3_to_f32(e4m3_from_f32(x))`, computed on the f32 bits.
#[inline(always)]
pub fn round_e4m3(x: f32) -> f32 {
    let a = x.abs();
    let r = if a >= E4M3_MAX {
        E4M3_MAX // satfinite, +inf included
    } else if a >= E4M3_MIN_NORMAL {
        // Normal range: keep 3 mantissa bits, round to nearest even on the dropped 20 bits. A carry
        // into the exponent is the correct next binade; a < 448 cannot round past 448.
        let bits = a.to_bits();
        let lsb = (bits >> E4M3_DROPPED_BITS) & 1;
        let half = (1u32 << (E4M3_DROPPED_BITS - 1)) - 1;
        f32::from_bits((bits + half + lsb) & !((1u32 << E4M3_DROPPED_BITS) - 1))
    } else if a >= 0.0 {
        // Subnormal range: a multiple of 2^-9; scaling by 512 is exact.
        (a * 512.0).round_ties_even() * E4M3_SUBNORMAL_STEP
    } else {
        return x; // NaN
    };
    r.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_decode_matches_codec() {
        for code in 0..=255u8 {
            let (want, got) = (e4m3_to_f32(code), e4m3_decode(code));
            if want.is_nan() {
                assert!(got.is_nan(), "code {code:#x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "code {code:#x}");
            }
        }
    }

    #[test]
    fn fast_rounding_matches_codec_on_a_dense_sweep() {
        // Every 97th f32 bit pattern (44M inputs, both signs, all exponents) plus the whole
        // neighbourhood of e4m3's range, where the interesting cases are.
        let check = |bits: u32| {
            let x = f32::from_bits(bits);
            let want = e4m3_to_f32(e4m3_from_f32(x));
            let got = round_e4m3(x);
            if want.is_nan() {
                assert!(got.is_nan(), "{x:e}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "x = {x:e} ({bits:#x})");
            }
        };
        let mut b = 0u32;
        while let Some(n) = b.checked_add(97) {
            check(b);
            b = n;
        }
        for lo in [(2.0f32.powi(-12)).to_bits(), (2.0f32.powi(-12)).to_bits() | 0x8000_0000] {
            for bits in (lo..lo + (22 << 23)).step_by(17) {
                check(bits);
            }
        }
    }
}

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

/// The value of every e4m3 code, `E4M3_VALUES[code] == e4m3_to_f32(code)` (NaN for the two NaN
/// codes): the decoder of an FP8 KV cache's inner loop, one load per element.
pub static E4M3_VALUES: [f32; 256] = e4m3_values();

/// Builds [`E4M3_VALUES`] from the format's fields: sign, 4 exponent bits (bias 7), 3 mantissa
/// bits; exponent 0 is subnormal (`m · 2^-9`), `S.1111.111` is NaN.
const fn e4m3_values() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        let (sign, e, m) = ((code as u32 >> 7) << 31, (code as u32 >> 3) & 0xF, code as u32 & 0x7);
        let mag = if e == 0xF && m == 0x7 {
            f32::NAN.to_bits()
        } else if e == 0 {
            (m as f32 * E4M3_SUBNORMAL_STEP).to_bits()
        } else {
            ((e + 127 - 7) << 23) | (m << E4M3_DROPPED_BITS)
        };
        t[code] = f32::from_bits(sign | mag);
        code += 1;
    }
    t
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
    fn value_table_matches_codec() {
        for code in 0..=255u8 {
            let (want, got) = (e4m3_to_f32(code), E4M3_VALUES[code as usize]);
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

//! The native arithmetic of the CPU backend: exp2 by a degree-5 polynomial that vectorises.

use crate::numerics::exp2::{poly_frac, EXP2_CLAMP_LOW};
use crate::numerics::softmax_math::Exp2Math;

/// Native arithmetic: exp2 by the degree-5 polynomial (max relative error 8.5e-8, about one f32
/// ulp), vectorisable, no P rounding, eager rescaling.
#[derive(Clone, Copy)]
pub(crate) struct Native;

impl Exp2Math for Native {
    const NATIVE: bool = true;
    #[inline(always)]
    fn p_offset(&self) -> f32 {
        0.0
    }
    #[inline(always)]
    fn exp2(&self, x: f32) -> f32 {
        exp2_fast(x)
    }
    #[inline(always)]
    fn round_p(&self, p: f32) -> f32 {
        p
    }
    #[inline(always)]
    fn lazy_threshold(&self) -> Option<f32> {
        None
    }
}

/// `1.5 * 2^23`: adding it to a float in `[-2^22, 2^22)` leaves the integer in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// The f32 exponent bias.
const EXP_BIAS: f32 = 127.0;

/// The native CPU `exp2` for `x <= 0` (every argument of the native softmax: `(x − m)·c` with
/// `x <= m`, and the rescale factor's `−growth`): the same split and degree-5 polynomial as
/// [`crate::numerics::exp2::exp2_poly`], but `2^floor(x)` is built as a float from the bits of
/// `floor(x) + 127 + 1.5·2^23` and multiplied in, so the whole function vectorises (a float→int
/// conversion would not: Rust's saturating `as i32` is scalarised). NaN propagates through the
/// product; x < −126 gives 0 (below f32's normal range, irrelevant to a softmax). Positive
/// arguments are clamped to 0 (never reached; the clamp keeps the exponent bits in range).
#[inline(always)]
#[allow(clippy::manual_clamp)] // `f32::clamp` asserts its bounds; the `if` chain is what vectorises (and passes NaN)
pub(crate) fn exp2_fast(x: f32) -> f32 {
    // `if` chains rather than min/max so that NaN passes through.
    let x = if x < EXP2_CLAMP_LOW { EXP2_CLAMP_LOW } else if x > 0.0 { 0.0 } else { x };
    let n = x.floor();
    let p = poly_frac::<5>(x - n);
    // n + 127 is in [0, 127]: it sits in the low 8 mantissa bits; << 23 moves it to the exponent.
    let two_n = f32::from_bits((n + (ROUND_MAGIC + EXP_BIAS)).to_bits() << 23);
    p * two_n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_fast_on_its_domain() {
        assert_eq!(exp2_fast(0.0), 1.0);
        assert_eq!(exp2_fast(-1.0), 0.5);
        assert_eq!(exp2_fast(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2_fast(-200.0), 0.0);
        assert!(exp2_fast(f32::NAN).is_nan());
        assert_eq!(exp2_fast(5.0), 1.0, "positive arguments never occur; clamped to 0");
        for i in 0..2000 {
            let x = -126.0 * i as f32 / 2000.0;
            let rel = (exp2_fast(x) as f64 / (x as f64).exp2() - 1.0).abs();
            assert!(rel < 2e-7, "{x}: {rel}");
        }
    }
}

//! The softmax arithmetic of a kernel, reproduced by the CPU backend: which exp2 (FA4's polynomial of
//! a chosen degree), lazy rescaling, and P in e4m3 offset by `2^FP8_P_SCALE_LOG2` (FA3).
//!
//! P's row sum is accumulated in f32 from the *unrounded* P, as FA3 does; only the P that enters
//! the second product is rounded to e4m3. The `2^8` offset cancels in `O / l` and is removed
//! from the LSE by `finalize`.

use super::exp2::exp2_poly_deg;
use super::fp8::round_e4m3;
use super::FP8_P_SCALE_LOG2;

/// The score-to-probability arithmetic: which exp2, the P offset, and P's rounding.
pub trait Exp2Math: Copy + Send + Sync {
    /// The native arithmetic (`cpu::Native`: `exp2_fast`, no offset, no P rounding, eager
    /// rescaling), which vector kernels (`cpu::simd::native_softmax`) reproduce bit for bit.
    const NATIVE: bool = false;
    /// Probabilities are computed as `exp2(s - m + P_OFFSET)` (FA3's FP8 `Max_offset`); the
    /// offset cancels in `O / l` and is removed from the LSE.
    fn p_offset(&self) -> f32;
    fn exp2(&self, x: f32) -> f32;
    /// The value P takes into the second product (identity, or e4m3 rounding).
    fn round_p(&self, p: f32) -> f32;
    /// Lazy rescaling threshold in log2 units (`None`: rescale whenever the max grows).
    fn lazy_threshold(&self) -> Option<f32>;
}

/// Degree the CPU uses for `Exp2::Accurate` (max relative error 8.5e-8, about one f32 ulp).
pub const ACCURATE_DEGREE: u8 = 5;

/// A kernel's softmax arithmetic, chosen at run time from the problem's options
/// (`SoftmaxMath::for_problem`, in problem.rs: the numerics sit below the problem).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoftmaxMath {
    /// Polynomial degree of exp2 (2..=5).
    pub degree: u8,
    /// `Some(τ)`: rescale only when the row max grows by more than τ (log2 units).
    pub lazy: Option<f32>,
    /// P in e4m3 with the `2^FP8_P_SCALE_LOG2` offset.
    pub fp8_p: bool,
}

impl SoftmaxMath {
    /// Whether the backend's plain arithmetic (degree-5 exp2, eager rescale, P in f32) is
    /// exactly this one, so no emulation is needed.
    pub fn is_native(&self) -> bool {
        self.degree == ACCURATE_DEGREE && self.lazy.is_none() && !self.fp8_p
    }
}

impl Exp2Math for SoftmaxMath {
    #[inline(always)]
    fn p_offset(&self) -> f32 {
        if self.fp8_p {
            FP8_P_SCALE_LOG2
        } else {
            0.0
        }
    }
    #[inline(always)]
    fn exp2(&self, x: f32) -> f32 {
        exp2_poly_deg(x, self.degree)
    }
    #[inline(always)]
    fn round_p(&self, p: f32) -> f32 {
        if self.fp8_p {
            round_e4m3(p)
        } else {
            p
        }
    }
    #[inline(always)]
    fn lazy_threshold(&self) -> Option<f32> {
        self.lazy
    }
}

//! The softmax arithmetic of a kernel, reproduced by the CPU backend: which exp2 (FA4's polynomial of
//! a chosen degree), lazy rescaling, and P in e4m3 offset by `2^FP8_P_SCALE_LOG2` (FA3).
//!
//! P's row sum is accumulated in f32 from the *unrounded* P, as FA3 does; only the P that enters
//! the second product is rounded to e4m3. The `2^8` offset cancels in `O / l` and is removed
//! from the LSE by `finalize`.

use super::exp2::exp2_poly_deg;
use super::fp8::round_e4m3;
use super::FP8_P_SCALE_LOG2;
use crate::cpu::softmax::Exp2Math;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::forward_with;
    use crate::options::ForwardOptions;
    use crate::problem::Problem;
    use crate::reference::{attention_f64, rmse};
    use crate::tensor::Tensor;

    /// Why `validate` refuses `τ + 8 >= log2(448)` with FP8: with FA4's τ = 8 on a growing row
    /// max, P reaches 2^16, saturates at 448 in e4m3, and the f32 row sum still counts the
    /// unsaturated value, so the output shrinks (reported upstream as
    /// Dao-AILab/flash-attention#2131 and #2716). This runs the kernel arithmetic directly, past
    /// the validation.
    #[test]
    fn fp8_p_with_tau_8_saturates_and_loses_accuracy() {
        let (sq, sk, d) = (8, 1024, 64);
        let q: Vec<f32> = vec![1.0; sq * d];
        // Scores rise by 20 log2 units over the keys, 2.5 per 128-key tile.
        let per_key = 20.0 * std::f32::consts::LN_2 / (sk as f32 * (d as f32).sqrt());
        let k: Vec<f32> = (0..sk * d).map(|i| per_key * (i / d) as f32).collect();
        let v: Vec<f32> = (0..sk * d).map(|i| 1.0 + ((i * 7) % 13) as f32 / 13.0).collect();
        let q = Tensor::from_vec(q, [1, sq, 1, d]).unwrap();
        let k = Tensor::from_vec(k, [1, sk, 1, d]).unwrap();
        let v = Tensor::from_vec(v, [1, sk, 1, d]).unwrap();
        let p = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default()).unwrap();
        let r = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
        let err = |lazy: Option<f32>| {
            let math = SoftmaxMath { degree: ACCURATE_DEGREE, lazy, fp8_p: true };
            let out = forward_with(&p, &q.view(), &k.view(), &v.view(), math, 1).unwrap();
            let o: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
            rmse(&o, &r.o)
        };
        let (eager, legal, fa4) = (err(None), err(Some(0.8)), err(Some(8.0)));
        assert!(legal <= eager * 1.5 + 1e-4, "τ 0.8: {legal} vs {eager}");
        assert!(fa4 > 10.0 * eager && fa4 > 0.05, "τ 8 with FP8 P: {fa4} vs {eager}");
    }
}

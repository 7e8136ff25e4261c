//! Numerics shared by the CPU backend and the CUDA kernels: software exp2, FP8 (e4m3) with
//! per-block scales, the Hadamard rotation, the lazy-rescale rule, and the merge of attention
//! states (the split-KV combine; public as `serving::merge_states`). Each lives here once in Rust
//! and once in a header under `cuda/common/` with the same steps (`exp2_poly.cuh`, `fp8.cuh`,
//! `hadamard.cuh`, `softmax.cuh`); the constants reach CUDA through a header build.rs generates from
//! these Rust ones (`build/numerics_header.rs`).

pub(crate) mod softmax_math;
pub mod exp2;
pub mod fp8;
pub mod hadamard;
pub(crate) mod merge;
pub mod quant;
pub mod rng;

use crate::error::{Error, Result};
use crate::options::{Exp2, Fp8Scaling, Precision, Rescale};

/// P is multiplied by `2^FP8_P_SCALE_LOG2` before its e4m3 cast (FA3's `Max_offset = 8`), so the
/// largest probability, 1, lands at 256, well inside e4m3's range (448) and far from its
/// subnormals.
pub const FP8_P_SCALE_LOG2: f32 = 8.0;

/// Largest lazy-rescale threshold accepted (log2 units). With a stale max, P reaches at most
/// `2^(τ + offset) <= 2^72`, so the running sum and output overflow f32 (~2^128) only when
/// `n_keys·max|v| >= 2^56`; it also keeps exp2's argument inside the polynomial's exponent-add
/// range (< 128). See the proof at `cpu::softmax::max_get_scale`.
pub const LAZY_THRESHOLD_MAX: f32 = 64.0;

/// `log2(448)`: with P in e4m3, `τ + FP8_P_SCALE_LOG2` must stay below it, or P saturates while
/// the f32 row sum still counts the unsaturated value (reported upstream as
/// Dao-AILab/flash-attention#2131 and #2716).
pub fn fp8_lazy_limit() -> f32 {
    fp8::E4M3_MAX.log2() - FP8_P_SCALE_LOG2
}

/// The lazy-rescale rule: a tile may keep the stale running max when the max grew by at most
/// `tau`; `growth` is `(tile_max - m) · c`, the growth in log2 units (formed from the difference
/// in score units, never from maxima converted to log2 units on their own, see
/// `cpu::softmax`). Used by `cpu::softmax::max_get_scale`; mirrored by `fa_lazy_keeps_max` in
/// `cuda/common/softmax.cuh`.
#[inline(always)]
pub fn lazy_keeps_max(growth: f32, tau: f32) -> bool {
    growth <= tau
}

/// Checks the numerics options before anything runs.
pub fn validate(precision: Precision, exp2: Exp2, rescale: Rescale, head_dim: usize) -> Result<()> {
    if let Exp2::Poly(d) = exp2 {
        if !exp2::POLY_DEGREES.contains(&d) {
            return Err(Error::InvalidOption {
                option: "exp2 polynomial degree",
                got: d.to_string(),
                expected: "2, 3, 4 or 5".into(),
            });
        }
    }
    if let Rescale::Lazy { threshold } = rescale {
        if !(threshold.is_finite() && (0.0..=LAZY_THRESHOLD_MAX).contains(&threshold)) {
            return Err(Error::InvalidOption {
                option: "lazy rescale threshold",
                got: threshold.to_string(),
                expected: format!("a value in [0, {LAZY_THRESHOLD_MAX}] (log2 units; FA4 uses 8 for 16-bit inputs)"),
            });
        }
    }
    if let Precision::Fp8 { scaling, hadamard } = precision {
        if let Fp8Scaling::PerBlock { rows: 0 } = scaling {
            return Err(Error::InvalidOption {
                option: "FP8 block rows",
                got: "0".into(),
                expected: "at least 1 sequence position per scale block (64 or 128 are typical)".into(),
            });
        }
        if hadamard.is_some() && !hadamard::supported(head_dim) {
            return Err(Error::InvalidOption {
                option: "FP8 Hadamard rotation",
                got: format!("head_dim {head_dim}"),
                expected: "a power-of-two head_dim (the fast Walsh-Hadamard transform needs one); \
                           use hadamard: None for this head_dim"
                    .into(),
            });
        }
        if let Rescale::Lazy { threshold } = rescale {
            let limit = fp8_lazy_limit();
            if threshold >= limit {
                return Err(Error::InvalidOption {
                    option: "lazy rescale threshold with FP8",
                    got: threshold.to_string(),
                    expected: format!(
                        "below {limit:.4}: threshold + {FP8_P_SCALE_LOG2} (the P scale) must stay below log2(448), \
                         or P saturates in e4m3 while the f32 row sum still counts it"
                    ),
                });
            }
        }
    }
    Ok(())
}

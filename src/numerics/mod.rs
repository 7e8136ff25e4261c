//! Numerics shared by the CPU backend and the CUDA kernels: software exp2, FP8 (e4m3) with
//! per-block scales, the Hadamard rotation, and the lazy-rescale rule. Each lives here once in Rust
//! and once in a header under `cuda/include/` with the same constants and steps.

pub mod exp2;

use crate::error::{Error, Result};
use crate::options::{Exp2, Precision, Rescale};

/// P is multiplied by `2^FP8_P_SCALE_LOG2` before its e4m3 cast (FA3's `Max_offset = 8`), so the
/// largest probability, 1, lands at 256, well inside e4m3's range (448) and far from its
/// subnormals.
pub const FP8_P_SCALE_LOG2: f32 = 8.0;

/// Checks the numerics options before anything runs.
pub fn validate(precision: Precision, exp2: Exp2, rescale: Rescale, head_dim: usize) -> Result<()> {
    let _ = head_dim;
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
        if !(threshold.is_finite() && threshold >= 0.0) {
            return Err(Error::InvalidOption {
                option: "lazy rescale threshold",
                got: threshold.to_string(),
                expected: "a finite value >= 0 (log2 units; FA4 uses 8)".into(),
            });
        }
    }
    if let Precision::Fp8 { .. } = precision {
        return Err(Error::InvalidOption {
            option: "precision",
            got: "Fp8".into(),
            expected: "Native (FP8 is not implemented yet)".into(),
        });
    }
    Ok(())
}

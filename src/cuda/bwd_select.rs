//! Which backward kernel runs a problem on a device: FA2's (`fa2_bwd`, sm_80+) or the
//! FA3-style one (`fa3_bwd`, sm_90a, head dims 64/128, no softcap or ALiBi), by the requested
//! variant. `Variant::Auto` follows the forward's rule for families nobody ran on a GPU: it picks
//! neither until `BACKWARD_AUTO` (build/instances.rs) records a verified GPU run, and says so.

use super::fa3_bwd;
use super::select::Gpu;
use super::table::{Image, Standalone, BACKWARD_AUTO, STANDALONE, STANDALONE_HEAD_DIM};
use crate::error::{Error, Result};
use crate::options::{Precision, Variant};
use crate::problem::Problem;
use crate::DType;

/// The backward kernel families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BwdFamily {
    Fa2,
    Fa3,
}

/// A chosen backward: its family, the standalone image row and the image that loads here.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BwdChoice {
    pub family: BwdFamily,
    pub row: &'static Standalone,
    pub image: &'static Image,
}

impl BwdFamily {
    /// The image row's name in build/instances.rs `STANDALONE`.
    pub(crate) fn row_name(self) -> &'static str {
        match self {
            BwdFamily::Fa2 => "fa2_bwd",
            BwdFamily::Fa3 => "fa3_bwd",
        }
    }
    fn variant(self) -> Variant {
        match self {
            BwdFamily::Fa2 => Variant::Fa2,
            BwdFamily::Fa3 => Variant::Fa3,
        }
    }
}

/// The standalone row of a backward family.
pub(crate) fn row(family: BwdFamily) -> &'static Standalone {
    STANDALONE
        .iter()
        .find(|s| s.name == family.row_name())
        .expect("build/instances.rs has the fa2_bwd and fa3_bwd rows")
}

/// Why `Variant::Auto` does not run the backward on a GPU (while `BACKWARD_AUTO` is false).
pub(crate) const AUTO_REFUSAL: &str = "no GPU run has verified the backward kernels (fa2_bwd, fa3_bwd: they ran in the \
     emulator and were compile-checked), so Variant::Auto does not pick them; name Variant::Fa2 or Variant::Fa3, or \
     run the CPU backward (Backend::Cpu or Backend::Auto)";

/// The backward kernel of `p` on `dev` for `variant`.
///
/// # Errors
/// [`Error::UnsupportedDType`] for f32; [`Error::InvalidOption`] for an FP8 precision or sinks;
/// [`Error::VariantUnavailable`] for Auto (until verified), FA1/FA4 (no backward kernel), a
/// family this device cannot run, or a problem its kernel lacks (FA3: head dim, softcap, ALiBi);
/// [`Error::BackendUnavailable`] when no image of the family loads here.
pub(crate) fn choose(dev: &impl Gpu, p: &Problem, variant: Variant) -> Result<BwdChoice> {
    if p.dtype == DType::F32 {
        return Err(Error::UnsupportedDType {
            dtype: p.dtype,
            backend: format!("cuda:{} backward", dev.ordinal()),
            supported: "F16, BF16 (convert f32 inputs, or run the CPU backward)".into(),
        });
    }
    if p.precision != Precision::Native {
        return Err(Error::InvalidOption {
            option: "precision",
            got: format!("{:?}", p.precision),
            expected: "Precision::Native (the backward has no FP8 path)".into(),
        });
    }
    if let Some(s) = &p.sinks {
        return Err(Error::InvalidOption {
            option: "sinks",
            got: format!("{} sink logits", s.len()),
            expected: "no sinks (the GPU backward kernels have no sink gradient)".into(),
        });
    }
    let family = match variant {
        Variant::Fa2 => BwdFamily::Fa2,
        Variant::Fa3 => BwdFamily::Fa3,
        Variant::Auto if BACKWARD_AUTO => {
            if dev.sm() == 90 && fa3_bwd::supports(p).is_ok() {
                BwdFamily::Fa3
            } else {
                BwdFamily::Fa2
            }
        }
        Variant::Auto => return Err(Error::VariantUnavailable { variant, reason: AUTO_REFUSAL.into() }),
        other => {
            return Err(Error::VariantUnavailable {
                variant: other,
                reason: "no backward kernel of this family (the backward has Variant::Fa2 and Variant::Fa3)".into(),
            })
        }
    };
    let unavailable = |reason: String| Error::VariantUnavailable { variant: family.variant(), reason };
    match family {
        BwdFamily::Fa2 if dev.sm() < 80 => {
            return Err(unavailable(format!("the FA2 backward needs sm_80 or newer; {} is sm_{}", dev.name(), dev.sm())))
        }
        BwdFamily::Fa3 if dev.sm() != 90 => {
            return Err(unavailable(format!(
                "the FA3 backward is built for sm_90a (wgmma, TMA) only; {} is sm_{}",
                dev.name(),
                dev.sm()
            )))
        }
        BwdFamily::Fa3 => fa3_bwd::supports(p)?,
        BwdFamily::Fa2 => {}
    }
    let image = dev.image_for(family.row_name(), STANDALONE_HEAD_DIM).ok_or_else(|| Error::BackendUnavailable {
        backend: format!("cuda:{}", dev.ordinal()),
        reason: format!("no {} image loads on sm_{} (built without nvcc, or without this target)", family.row_name(), dev.sm()),
    })?;
    Ok(BwdChoice { family, row: row(family), image })
}

/// The Dispatch reason of a backward `c` on `dev` for `variant`, `deterministic` or not.
pub(crate) fn reason(dev: &impl Gpu, c: &BwdChoice, variant: Variant, deterministic: bool) -> String {
    let dq = if deterministic {
        "dq deterministic: per-key-block f32 partials summed in key-block order (bit-identical run to run)"
    } else {
        "dq summed with f32 atomics (faster; not bit-identical run to run: opts.deterministic(true) for that)"
    };
    let verified = if BACKWARD_AUTO {
        ""
    } else {
        "; this backward is not yet verified on a GPU (it ran in the emulator and was compile-checked)"
    };
    format!("{variant:?} requested: {} on {} sm_{}, {} image; {dq}{verified}", c.row.name, dev.name(), dev.sm(), c.image.target.name())
}

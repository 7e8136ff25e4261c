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
/// [`Error::UnsupportedDType`] for f32; [`Error::InvalidOption`] for an FP8 precision;
/// [`Error::VariantUnavailable`] for Auto (until verified), FA1/FA4 (no backward kernel), a
/// family this device cannot run, a V head_dim other than Q/K's, or a problem its kernel lacks
/// (FA3: head dim, softcap, ALiBi);
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
    if p.head_dim_v != p.head_dim {
        return Err(Error::VariantUnavailable {
            variant,
            reason: format!(
                "the backward kernels take one head_dim for q, k and v, and v's is {} where q/k's is {} (the CPU \
                 backward takes it)",
                p.head_dim_v, p.head_dim
            ),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::device::pick_image;
    use crate::cuda::table::Target;
    use crate::ForwardOptions;

    const fn image(family: &'static str, target: Target) -> Image {
        Image { family, head_dim: STANDALONE_HEAD_DIM, target, bytes: &[], report: "" }
    }
    static IMAGES: &[Image] =
        &[image("fa2_bwd", Target::Sm80), image("fa2_bwd", Target::Sm90a), image("fa3_bwd", Target::Sm90a)];

    struct Fake(u32, &'static [Image]);
    impl Gpu for Fake {
        fn ordinal(&self) -> usize {
            0
        }
        fn name(&self) -> &str {
            "fake"
        }
        fn sm(&self) -> u32 {
            self.0
        }
        fn max_smem_optin(&self) -> u32 {
            227 * 1024
        }
        fn image_for(&self, family: &str, head_dim: u32) -> Option<&'static Image> {
            pick_image(self.1, family, head_dim, ((self.0 / 10) as i32, (self.0 % 10) as i32))
        }
    }
    const H100: Fake = Fake(90, IMAGES);
    const A100: Fake = Fake(80, IMAGES);

    fn problem(dtype: DType, head_dim: usize, opts: &ForwardOptions) -> Problem {
        Problem::from_shapes([1, 100, 4, head_dim], [1, 130, 2, head_dim], [1, 130, 2, head_dim], dtype, opts).unwrap()
    }
    fn pick(gpu: &Fake, dtype: DType, head_dim: usize, opts: ForwardOptions) -> Result<BwdChoice> {
        let variant = opts.variant;
        choose(gpu, &problem(dtype, head_dim, &opts), variant)
    }
    fn unavailable(r: Result<BwdChoice>, variant: Variant, needle: &str) {
        match r {
            Err(Error::VariantUnavailable { variant: v, reason }) if v == variant && reason.contains(needle) => {}
            other => panic!("expected {variant:?} refused with {needle:?}: {other:?}"),
        }
    }

    #[test]
    fn explicit_variants_reach_their_kernels() {
        let o = ForwardOptions::default;
        let c = pick(&A100, DType::BF16, 128, o().variant(Variant::Fa2).softcap(5.0)).unwrap();
        assert_eq!((c.family, c.row.name, c.image.target), (BwdFamily::Fa2, "fa2_bwd", Target::Sm80));
        let c = pick(&H100, DType::F16, 64, o().variant(Variant::Fa3).causal(true)).unwrap();
        assert_eq!((c.family, c.row.name, c.image.target), (BwdFamily::Fa3, "fa3_bwd", Target::Sm90a));
        let why = reason(&H100, &c, Variant::Fa3, false);
        assert!(why.contains("f32 atomics") && why.contains("not yet verified on a GPU"), "{why}");
        assert!(reason(&H100, &c, Variant::Fa3, true).contains("dq deterministic"));
    }

    /// Auto is refused while no GPU run verified the kernels; what a device or a kernel cannot
    /// run is a typed error naming why, never a fallback.
    #[test]
    fn refusals_are_typed() {
        let o = ForwardOptions::default;
        const { assert!(!BACKWARD_AUTO, "flip this test with the table once a GPU run verified the backward") };
        unavailable(pick(&H100, DType::BF16, 64, o()), Variant::Auto, "no GPU run has verified");
        unavailable(pick(&A100, DType::BF16, 64, o().variant(Variant::Fa3)), Variant::Fa3, "sm_90a");
        unavailable(pick(&Fake(75, IMAGES), DType::BF16, 64, o().variant(Variant::Fa2)), Variant::Fa2, "sm_80");
        unavailable(pick(&H100, DType::BF16, 64, o().variant(Variant::Fa3).softcap(5.0)), Variant::Fa3, "softcap");
        unavailable(pick(&H100, DType::BF16, 64, o().variant(Variant::Fa3).alibi_slopes(vec![0.5f32; 4])), Variant::Fa3, "ALiBi");
        unavailable(pick(&H100, DType::BF16, 96, o().variant(Variant::Fa3)), Variant::Fa3, "head_dim 96");
        for v in [Variant::Fa1, Variant::Fa4] {
            unavailable(pick(&H100, DType::BF16, 64, o().variant(v)), v, "no backward kernel");
        }
        let e = pick(&H100, DType::F32, 64, o().variant(Variant::Fa2)).unwrap_err();
        assert!(matches!(e, Error::UnsupportedDType { .. }), "{e:?}");
        // Sinks run on both families (dq, dk, dv as without them, plus the sink launch).
        for v in [Variant::Fa2, Variant::Fa3] {
            let c = pick(&H100, DType::BF16, 64, o().variant(v).sinks(vec![0.5f32; 4])).unwrap();
            assert_eq!(c.family.variant(), v);
        }
        let mut mla = problem(DType::BF16, 192, &o());
        mla.head_dim_v = 128;
        unavailable(choose(&H100, &mla, Variant::Fa2), Variant::Fa2, "one head_dim");
        let e = pick(&Fake(90, &[]), DType::BF16, 64, o().variant(Variant::Fa2)).unwrap_err();
        assert!(matches!(e, Error::BackendUnavailable { .. }), "{e:?}");
    }
}

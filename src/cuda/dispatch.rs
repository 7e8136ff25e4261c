//! Dispatch: (GPU's SM, dtype, head_dim, options, requested variant) -> one kernel instance,
//! read from the one table in build/instances.rs and the images build.rs actually built.
//!
//! - `Variant::Auto` picks the highest-`rank` family that is `auto`-eligible and can run the
//!   problem here. A fast family stays out of Auto until it is verified on a GPU (FA3 on
//!   Hopper: Auto keeps FA2 until then), and the reason says so.
//! - An explicit variant that cannot run is an error naming why, never a silent fallback.

use super::device::Device;
use super::kernels::{Family, Image, Tile, FAMILIES};
use crate::error::{Error, Result};
use crate::options::{Exp2, Precision, Rescale, Variant};
use crate::problem::Problem;
use crate::tensor::DType;

/// The chosen instance. Plain references into the static table: choosing allocates nothing.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Choice {
    pub family: &'static Family,
    pub tile: &'static Tile,
    pub dtype: &'static str,
    pub image: &'static Image,
}

/// The kernel-symbol suffix of a dtype the GPU kernels take.
pub(crate) fn dtype_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F16 => Some("f16"),
        DType::BF16 => Some("bf16"),
        _ => None,
    }
}

fn variant_name(v: Variant) -> &'static str {
    match v {
        Variant::Auto => "Auto",
        Variant::Fa1 => "Fa1",
        Variant::Fa2 => "Fa2",
        Variant::Fa3 => "Fa3",
        Variant::Fa4 => "Fa4",
    }
}

/// The options beyond the plain forward that a problem needs, by the names `Family::options`
/// uses ("fp8", "exp2_poly", "lazy_rescale").
fn needed_options(p: &Problem) -> [Option<&'static str>; 3] {
    [
        matches!(p.precision, Precision::Fp8 { .. }).then_some("fp8"),
        matches!(p.exp2, Exp2::Poly(_)).then_some("exp2_poly"),
        matches!(p.rescale, Rescale::Lazy { .. }).then_some("lazy_rescale"),
    ]
}

/// Whether `fam` can run `p` on `dev`; `Err` says why not.
fn fit(fam: &'static Family, dev: &Device, p: &Problem) -> std::result::Result<Choice, String> {
    if dev.sm() < fam.min_sm {
        return Err(format!("needs sm_{} or newer, this GPU is sm_{}", fam.min_sm, dev.sm()));
    }
    let dtype = dtype_name(p.dtype).ok_or_else(|| format!("takes f16/bf16, not {:?}", p.dtype))?;
    for opt in needed_options(p).into_iter().flatten() {
        if !fam.options.contains(&opt) {
            return Err(format!("does not implement {opt}"));
        }
    }
    // The smallest instantiated (and built) head dim that holds this one; the tail is masked.
    let mut too_big = true;
    for tile in fam.tiles.iter().filter(|t| t.head_dim as usize >= p.head_dim) {
        too_big = false;
        let Some(image) = dev.image_for(fam.name, tile.head_dim) else { continue };
        let smem = (fam.smem_bytes)(tile);
        if smem > dev.max_smem_optin() {
            return Err(format!(
                "head_dim {} needs {smem} B of shared memory, this GPU allows {} B",
                tile.head_dim,
                dev.max_smem_optin()
            ));
        }
        return Ok(Choice { family: fam, tile, dtype, image });
    }
    let dims: Vec<u32> = fam.tiles.iter().map(|t| t.head_dim).collect();
    Err(if too_big {
        format!("supports head_dim up to {:?}", dims.last())
    } else {
        format!("has no image built for head_dim {} on sm_{} (FLASH_ATTN_HDIMS/ARCHS pruned it?)", p.head_dim, dev.sm())
    })
}

/// Picks the kernel for `p` on `dev`.
///
/// # Errors
/// [`Error::VariantUnavailable`] for an explicit variant that cannot run here (or that has no
/// family), [`Error::UnsupportedDType`]/[`Error::UnsupportedHeadDim`]/[`Error::BackendUnavailable`]
/// when no family can run the problem under `Auto`.
pub(crate) fn choose(dev: &Device, p: &Problem, variant: Variant) -> Result<Choice> {
    if variant != Variant::Auto {
        let want = variant_name(variant);
        let fam = FAMILIES.iter().find(|f| f.variant == want).ok_or_else(|| Error::VariantUnavailable {
            variant,
            reason: "no kernel of this family is built into this crate".into(),
        })?;
        return fit(fam, dev, p).map_err(|why| Error::VariantUnavailable {
            variant,
            reason: format!("{} on {} (sm_{}): {why}", fam.name, dev.name(), dev.sm()),
        });
    }
    let mut best: Option<Choice> = None;
    for fam in FAMILIES.iter().filter(|f| f.auto) {
        if let Ok(c) = fit(fam, dev, p) {
            if best.is_none_or(|b| c.family.rank > b.family.rank) {
                best = Some(c);
            }
        }
    }
    best.ok_or_else(|| no_kernel_error(dev, p))
}

/// The error when Auto finds nothing: the most specific reason.
fn no_kernel_error(dev: &Device, p: &Problem) -> Error {
    let backend = format!("cuda:{}", dev.ordinal());
    if dtype_name(p.dtype).is_none() {
        return Error::UnsupportedDType {
            dtype: p.dtype,
            backend,
            supported: "F16, BF16 (convert f32 inputs, or use Backend::Cpu)".into(),
        };
    }
    let max_dim = FAMILIES.iter().filter(|f| f.auto).flat_map(|f| f.tiles).map(|t| t.head_dim).max().unwrap_or(0);
    if p.head_dim > max_dim as usize {
        return Error::UnsupportedHeadDim { head_dim: p.head_dim, backend, supported: format!("1..={max_dim}") };
    }
    let why: Vec<String> =
        FAMILIES.iter().filter_map(|f| fit(f, dev, p).err().map(|e| format!("{}: {e}", f.name))).collect();
    Error::BackendUnavailable { backend, reason: format!("no kernel runs this problem: {}", why.join("; ")) }
}

/// The `Dispatch::reason` text of a choice (built only when asked: it allocates).
pub(crate) fn reason(dev: &Device, c: &Choice, requested: Variant) -> String {
    let how = if requested == Variant::Auto {
        let skipped: Vec<&str> = FAMILIES
            .iter()
            .filter(|f| !f.auto && f.rank > c.family.rank)
            .map(|f| f.name)
            .collect();
        let mut s = format!("Auto: {} is the highest-ranked family that runs this problem here", c.family.name);
        if !skipped.is_empty() {
            s += &format!(" ({} not picked by Auto until verified on a GPU)", skipped.join(", "));
        }
        s
    } else {
        format!("{} requested", variant_name(requested))
    };
    format!(
        "{how}; {} sm_{} ({}), head_dim instance {}, {} image{}",
        dev.name(),
        dev.sm(),
        c.dtype,
        c.tile.head_dim,
        c.image.target.name(),
        if c.family.gpu_verified { "" } else { "; this family is not yet verified on a GPU" }
    )
}

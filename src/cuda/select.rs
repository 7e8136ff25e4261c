//! Choosing the kernel: (GPU's SM, dtype, head_dim, options, requested variant) -> one kernel
//! instance, read from the one table in build/instances.rs and the images build.rs actually
//! built, with each family's own refusals (src/cuda/family.rs).
//!
//! - `Variant::Auto` picks the highest-`rank` family that is `auto`-eligible and can run the
//!   problem here. A fast family stays out of Auto until it is verified on a GPU (FA3 on
//!   Hopper: Auto keeps FA2 until then), and the reason says so.
//! - An explicit variant that cannot run is an error naming why, never a silent fallback.

use super::device::Device;
use super::family::LayoutRefusal;
use super::hosts::family_host;
use super::launch::dtype_name;
use super::params::Operands;
use super::table::{targets_for, Family, Image, KernelOptions, Tile, FAMILIES};
use crate::error::{Error, Result};
use crate::options::{Exp2, Precision, Rescale, Variant};
use crate::problem::Problem;

/// What choosing needs to know about a GPU: a trait so the table logic is tested without one.
pub(crate) trait Gpu {
    fn ordinal(&self) -> usize;
    fn name(&self) -> &str;
    /// major * 10 + minor.
    fn sm(&self) -> u32;
    fn max_smem_optin(&self) -> u32;
    fn image_for(&self, family: &str, head_dim: u32) -> Option<&'static Image>;
}

impl Gpu for Device {
    fn ordinal(&self) -> usize {
        Device::ordinal(self)
    }
    fn name(&self) -> &str {
        Device::name(self)
    }
    fn sm(&self) -> u32 {
        Device::sm(self)
    }
    fn max_smem_optin(&self) -> u32 {
        Device::max_smem_optin(self)
    }
    fn image_for(&self, family: &str, head_dim: u32) -> Option<&'static Image> {
        Device::image_for(self, family, head_dim)
    }
}

/// The chosen instance. Plain references into the static table: choosing allocates nothing.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Choice {
    pub family: &'static Family,
    pub tile: &'static Tile,
    pub dtype: &'static str,
    pub image: &'static Image,
    /// A higher-ranked family Auto passed over for its own refusal, and why; shown in
    /// `Dispatch::reason`.
    pub passed_over: Option<(&'static Family, &'static str)>,
    /// Why this rung of a ladder (the FA3 stages) was taken; empty for single-family variants.
    pub pick: &'static str,
}

/// The options beyond the plain forward that a problem needs.
fn needed_options(p: &Problem) -> KernelOptions {
    let mut o = KernelOptions::NONE;
    for (needed, opt) in [
        (matches!(p.precision, Precision::Fp8 { .. }), KernelOptions::FP8),
        (matches!(p.exp2, Exp2::Poly(_)), KernelOptions::EXP2_POLY),
        (matches!(p.rescale, Rescale::Lazy { .. }), KernelOptions::LAZY_RESCALE),
        (p.sinks.is_some(), KernelOptions::SINKS),
        (p.head_dim_v != p.head_dim, KernelOptions::HEAD_DIM_V),
    ] {
        if needed {
            o = o.union(opt);
        }
    }
    o
}

/// Why `fam`'s softmax parameters are not the ones `p` asks for (a degree of `Exp2::Poly`, a
/// threshold of `Rescale::Lazy`), or `None`. Defaults ask for nothing: a row that implements
/// FA4's softmax runs it then too (docs/fa4.md).
fn softmax_mismatch(fam: &Family, p: &Problem) -> Option<String> {
    let s = &fam.softmax;
    if let Some(every) = p.fa4_exp2_share {
        if every != s.poly_every {
            let share = |n: u32| if n == 0 { "none".to_string() } else { format!("1 element in {n}") };
            return Some(format!("implements a software exp2 share of {}, not {}", share(s.poly_every), share(every)));
        }
    }
    if let Exp2::Poly(degree) = p.exp2 {
        if degree != s.poly_degree {
            return Some(format!("implements exp2_poly of degree {}, not {degree}", s.poly_degree));
        }
    }
    if let Rescale::Lazy { threshold } = p.rescale {
        if threshold != s.lazy_tau {
            return Some(format!("implements lazy_rescale with threshold {}, not {threshold}", s.lazy_tau));
        }
    }
    None
}

/// The instance of `fam` that runs `p` on `dev` by the table's own rules (SM, targets, dtype,
/// options, head dim, built image, shared memory); `Err` says why none does.
fn instance_for(fam: &'static Family, dev: &impl Gpu, p: &Problem) -> std::result::Result<Choice, String> {
    if dev.sm() < fam.min_sm {
        return Err(format!("needs sm_{} or newer, this GPU is sm_{}", fam.min_sm, dev.sm()));
    }
    let (major, minor) = ((dev.sm() / 10) as i32, (dev.sm() % 10) as i32);
    if !targets_for(fam.source()).iter().any(|t| t.runs_on(major, minor)) {
        let names: Vec<&str> = targets_for(fam.source()).iter().map(|t| t.name()).collect();
        return Err(format!("is built only for sm_{} (arch-specific features), this GPU is sm_{}", names.join("/sm_"), dev.sm()));
    }
    let dtype = dtype_name(p.dtype).ok_or_else(|| format!("takes f16/bf16, not {:?}", p.dtype))?;
    let needed = needed_options(p);
    if let Some(opt) = fam.options.first_missing(needed) {
        return Err(format!("does not implement {opt}"));
    }
    // An FP8 family takes e4m3 codes, which only a caller asking for Precision::Fp8 gets: it
    // never runs a 16-bit problem, under Auto or an explicit variant.
    if fam.options.contains(KernelOptions::FP8) && !needed.contains(KernelOptions::FP8) {
        return Err("runs only Precision::Fp8 problems".into());
    }
    if let Some(why) = softmax_mismatch(fam, p) {
        return Err(why);
    }
    // The smallest instantiated (and built) head dim that holds this one; the tail is masked.
    let mut too_big = true;
    for tile in fam.tiles.iter().filter(|t| t.head_dim as usize >= p.head_dim) {
        too_big = false;
        let Some(image) = dev.image_for(fam.name, tile.head_dim) else { continue };
        let smem = fam.smem_bytes(tile);
        if smem > dev.max_smem_optin() {
            return Err(format!(
                "head_dim {} needs {smem} B of shared memory, this GPU allows {} B",
                tile.head_dim,
                dev.max_smem_optin()
            ));
        }
        return Ok(Choice { family: fam, tile, dtype, image, passed_over: None, pick: "" });
    }
    let dims: Vec<u32> = fam.tiles.iter().map(|t| t.head_dim).collect();
    Err(if too_big {
        let list: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
        format!("supports head_dim up to {} (instances {}), not {}", dims.last().unwrap_or(&0), list.join(", "), p.head_dim)
    } else {
        format!("has no image built for head_dim {} on sm_{} (FLASH_ATTN_HDIMS/ARCHS pruned it?)", p.head_dim, dev.sm())
    })
}

/// Whether `fam` has a target this GPU runs, at its minimum SM.
fn builds_for(fam: &Family, dev: &impl Gpu) -> bool {
    let (major, minor) = ((dev.sm() / 10) as i32, (dev.sm() % 10) as i32);
    dev.sm() >= fam.min_sm && targets_for(fam.source()).iter().any(|t| t.runs_on(major, minor))
}

/// The family's own problem refusal of a table-admitted choice.
fn refusal(c: &Choice, p: &Problem) -> Option<&'static str> {
    family_host(c.family).refusal(c.family, c.tile, p)
}

/// "fa2 on <GPU> (sm_80)": where a refusal happened, for error messages.
fn on(fam: &Family, dev: &impl Gpu) -> String {
    format!("{} on {} (sm_{})", fam.name, dev.name(), dev.sm())
}

/// Picks the kernel for `p` on `dev`.
///
/// # Errors
/// [`Error::VariantUnavailable`] for an explicit variant that cannot run here (or that has no
/// family), [`Error::UnsupportedDType`]/[`Error::UnsupportedHeadDim`]/[`Error::BackendUnavailable`]
/// when no family can run the problem under `Auto`.
pub(crate) fn choose(dev: &impl Gpu, p: &Problem, variant: Variant) -> Result<Choice> {
    choose_in(FAMILIES, dev, p, variant)
}

/// [`choose`], then the chosen family's layout rules on `ops`: under Auto a refused family is
/// passed over for the best lower-ranked one (recorded in the choice), until one accepts.
///
/// # Errors
/// As [`choose`]; [`Error::InvalidLayout`] naming the operand when an explicit variant's family
/// refuses the layout.
pub(crate) fn choose_for(dev: &impl Gpu, p: &Problem, variant: Variant, ops: &Operands) -> Result<Choice> {
    choose_for_in(FAMILIES, dev, p, variant, ops)
}

fn choose_for_in(
    families: &'static [Family],
    dev: &impl Gpu,
    p: &Problem,
    variant: Variant,
    ops: &Operands,
) -> Result<Choice> {
    let mut c = choose_in(families, dev, p, variant)?;
    while let Some(r) = family_host(c.family).layout_refusal(ops) {
        if variant != Variant::Auto {
            return Err(layout_error(&on(c.family, dev), r));
        }
        let mut lower = auto_below(families, dev, p, c.family.rank)?;
        lower.passed_over = Some((c.family, r.why));
        c = lower;
    }
    Ok(c)
}

/// The error of a layout refusal of an explicitly requested family (`what` names it).
pub(crate) fn layout_error(what: &str, r: LayoutRefusal) -> Error {
    Error::InvalidLayout { operand: r.operand, reason: format!("{what} {}", r.why) }
}

/// `choose` over a given table (the real one, or a test's).
fn choose_in(families: &'static [Family], dev: &impl Gpu, p: &Problem, variant: Variant) -> Result<Choice> {
    if variant != Variant::Auto {
        return choose_explicit(families, dev, p, variant);
    }
    auto_below(families, dev, p, u32::MAX)
}

/// Auto among the families ranked below `rank`: the highest-ranked one that runs `p`, noting a
/// higher-ranked one passed over for its own refusal.
fn auto_below(families: &'static [Family], dev: &impl Gpu, p: &Problem, rank: u32) -> Result<Choice> {
    let mut best: Option<Choice> = None;
    let mut passed: Option<(&'static Family, &'static str)> = None;
    for fam in families.iter().filter(|f| f.auto && f.rank < rank) {
        let Ok(c) = instance_for(fam, dev, p) else { continue };
        if let Some(why) = refusal(&c, p) {
            if passed.is_none_or(|(f, _)| fam.rank > f.rank) {
                passed = Some((fam, why));
            }
        } else if best.is_none_or(|b| c.family.rank > b.family.rank) {
            best = Some(c);
        }
    }
    let mut best = best.ok_or_else(|| no_kernel_error(families, dev, p))?;
    best.passed_over = passed.filter(|(f, _)| f.rank > best.family.rank);
    Ok(best)
}

/// The stage option of a ladder variant: its name and what the problem asks for (`None` for a
/// variant without one).
fn requested_stage(p: &Problem, variant: Variant) -> (&'static str, Option<u8>) {
    match variant {
        Variant::Fa3 => ("the stage fa3_stage asked for", p.fa3_stage),
        Variant::Fa4 => ("the stage fa4_stage asked for", p.fa4_stage),
        _ => ("", None),
    }
}

/// An explicitly requested variant. A variant with several families (the FA3 and FA4 stage
/// ladders, FA4's softmax on the FA2 / FA3 pipelines) runs the stage its option (`fa3_stage`,
/// `fa4_stage`) names, else the highest GPU-verified row that runs the problem (no refusal of
/// its own), else (none verified) the highest-ranked one that does; `Choice::pick` says which.
/// (An FA4 tcgen05 stage's own refusal requires `fa4_stage`, so without it `Variant::Fa4` runs
/// FA4's softmax on the FA3 pipeline on sm_90a and on the FA2 pipeline elsewhere.)
fn choose_explicit(families: &'static [Family], dev: &impl Gpu, p: &Problem, variant: Variant) -> Result<Choice> {
    let unavailable = |reason: String| Error::VariantUnavailable { variant, reason };
    let of_variant = || families.iter().filter(move |f| Variant::from(f.variant) == variant);
    let ladder = of_variant().count() > 1;
    let (asked_for, stage) = requested_stage(p, variant);
    let candidates = || of_variant().filter(move |f| stage.is_none_or(|s| f.ladder_stage() == Some(s)));
    if of_variant().next().is_none() {
        return Err(unavailable("no kernel of this family is built into this crate".into()));
    }
    if candidates().next().is_none() {
        let names: Vec<&str> = of_variant().map(|f| f.name).collect();
        return Err(unavailable(format!("no stage {stage:?} among {}", names.join(", "))));
    }
    // Verified beats unverified; among equals, the higher rank (the higher stage) wins.
    let key = |c: &Choice| (c.family.gpu_verified, c.family.rank);
    let admitted = || candidates().filter_map(|f| instance_for(f, dev, p).ok());
    let Some(best) = admitted().max_by_key(key) else {
        // The table's refusal of the highest-ranked candidate built for this GPU, else of the
        // highest-ranked one (the FA3 stages refuse alike; of the FA4 rows, those of another
        // architecture say least), a row of the problem's precision first (an FP8 row refusing a
        // 16-bit problem for its precision would hide why the 16-bit rows refuse it).
        let fp8 = needed_options(p).contains(KernelOptions::FP8);
        let key = |f: &&Family| (f.options.contains(KernelOptions::FP8) == fp8, f.rank);
        let fam = candidates()
            .filter(|f| builds_for(f, dev))
            .max_by_key(key)
            .or_else(|| candidates().max_by_key(key))
            .expect("checked non-empty above");
        let why = instance_for(fam, dev, p).err().unwrap_or_default();
        return Err(unavailable(format!("{}: {why}", on(fam, dev))));
    };
    let Some(mut c) = admitted().filter(|c| refusal(c, p).is_none()).max_by_key(key) else {
        // Every admitted row refuses: the best one's refusal, then any different one of a
        // lower row (the FA4 rows refuse for different reasons; the FA3 stages alike).
        let mut reasons = vec![(best.family, refusal(&best, p).unwrap_or_default())];
        for c in admitted() {
            let why = refusal(&c, p).unwrap_or_default();
            if reasons.iter().all(|(_, w)| *w != why) {
                reasons.push((c.family, why));
            }
        }
        let text: Vec<String> = reasons.iter().map(|(f, why)| format!("{}: {why}", on(f, dev))).collect();
        return Err(unavailable(text.join("; ")));
    };
    if ladder {
        c.pick = if stage.is_some() {
            asked_for
        } else if variant == Variant::Fa4 {
            "the highest-ranked FA4 row that runs this problem here (the tcgen05 stages run only when fa4_stage names one)"
        } else if c.family.gpu_verified {
            "the highest GPU-verified stage that runs this problem"
        } else if candidates().any(|f| f.gpu_verified) {
            "no GPU-verified stage runs this problem: the highest compiled stage that does"
        } else {
            "no stage is GPU-verified yet: the highest compiled stage that runs this problem"
        };
    }
    Ok(c)
}

/// The error when Auto finds nothing: the most specific reason.
fn no_kernel_error(families: &'static [Family], dev: &impl Gpu, p: &Problem) -> Error {
    let backend = format!("cuda:{}", dev.ordinal());
    if dtype_name(p.dtype).is_none() {
        return Error::UnsupportedDType {
            dtype: p.dtype,
            backend,
            supported: "F16, BF16 (convert f32 inputs, or use Backend::Cpu)".into(),
        };
    }
    let max_dim = families.iter().filter(|f| f.auto).flat_map(|f| f.tiles).map(|t| t.head_dim).max().unwrap_or(0);
    if p.head_dim > max_dim as usize {
        return Error::UnsupportedHeadDim { head_dim: p.head_dim, backend, supported: format!("1..={max_dim}") };
    }
    let why: Vec<String> = families
        .iter()
        .filter(|f| f.auto)
        .filter_map(|f| match instance_for(f, dev, p) {
            Err(e) => Some(format!("{}: {e}", f.name)),
            Ok(c) => refusal(&c, p).map(|e| format!("{}: {e}", f.name)),
        })
        .collect();
    let mut reason = format!("no kernel runs this problem: {}", why.join("; "));
    // Families Auto leaves alone until verified on a GPU but that would run the problem here (the
    // FP8 ladder for Precision::Fp8): the highest of each variant, and how to ask for it.
    let mut held_back: Vec<&Family> = Vec::new();
    for f in families.iter().filter(|f| !f.auto) {
        if instance_for(f, dev, p).is_ok_and(|c| refusal(&c, p).is_none()) {
            match held_back.iter_mut().find(|h| h.variant == f.variant) {
                Some(h) if h.rank < f.rank => *h = f,
                Some(_) => {}
                None => held_back.push(f),
            }
        }
    }
    for f in held_back {
        reason += &format!(
            "; {} runs it but is not picked by Auto until verified on a GPU (ask for Variant::{:?})",
            f.name,
            Variant::from(f.variant)
        );
    }
    Error::BackendUnavailable { backend, reason }
}

/// The `Dispatch::reason` text of a choice (built only when asked: it allocates).
pub(crate) fn reason(dev: &impl Gpu, c: &Choice, requested: Variant) -> String {
    reason_in(FAMILIES, dev, c, requested)
}

fn reason_in(families: &'static [Family], dev: &impl Gpu, c: &Choice, requested: Variant) -> String {
    let how = if requested == Variant::Auto {
        let skipped: Vec<&str> = families.iter().filter(|f| !f.auto && f.rank > c.family.rank).map(|f| f.name).collect();
        let mut s = format!("Auto: {} is the highest-ranked family that runs this problem here", c.family.name);
        if !skipped.is_empty() {
            s += &format!(" ({} not picked by Auto until verified on a GPU)", skipped.join(", "));
        }
        if let Some((f, why)) = c.passed_over {
            s += &format!("; {} passed over: {why}", f.name);
        }
        s
    } else if c.pick.is_empty() {
        format!("{requested:?} requested")
    } else {
        format!("{requested:?} requested: {}, {}", c.family.name, c.pick)
    };
    format!(
        "{how}; {} sm_{} ({}), head_dim instance {}, {} image{}{}",
        dev.name(),
        dev.sm(),
        c.dtype,
        c.tile.head_dim,
        c.image.target.name(),
        fa4_softmax_note(c.family),
        if c.family.gpu_verified { "" } else { "; this family is not yet verified on a GPU" }
    )
}

/// "; FA4's softmax (...) in the FA3 pipeline (...)" for a row that runs FA4's softmax (which
/// pipeline ran, and the row's knobs), else nothing.
fn fa4_softmax_note(f: &Family) -> String {
    let s = &f.softmax;
    if *s == super::table::SoftmaxParams::NONE {
        return String::new();
    }
    let share = match s.poly_every {
        0 => "every exp2 on MUFU".to_string(),
        n => format!("degree-{} software exp2 for 1 element in {n}", s.poly_degree),
    };
    let rescale =
        if s.lazy_tau >= 0.0 { format!("lazy rescale, tau {}", s.lazy_tau) } else { "eager rescale".to_string() };
    // A row on the FA3 pipeline compiles one of its stages (`stage`, not a rung of FA4's ladder).
    let stage = match (f.ladder_stage(), f.stage) {
        (None, Some(s)) => format!(" at stage {s}"),
        _ => String::new(),
    };
    format!("; FA4's softmax ({share}, {rescale}) in {}{stage}", f.pipeline.describe())
}

#[cfg(test)]
mod tests;

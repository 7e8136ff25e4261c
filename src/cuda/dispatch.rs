//! Dispatch: (GPU's SM, dtype, head_dim, options, requested variant) -> one kernel instance,
//! read from the one table in build/instances.rs and the images build.rs actually built.
//!
//! - `Variant::Auto` picks the highest-`rank` family that is `auto`-eligible and can run the
//!   problem here. A fast family stays out of Auto until it is verified on a GPU (FA3 on
//!   Hopper: Auto keeps FA2 until then), and the reason says so.
//! - An explicit variant that cannot run is an error naming why, never a silent fallback.

use super::device::Device;
use super::kernels::{fa3_stage, fa4_stage, targets_for, Family, Image, Tile, FAMILIES};

/// What dispatch needs to know about a GPU: a trait so the table logic is tested without one.
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
    /// A higher-ranked family Auto passed over because one of its own preconditions failed
    /// (src/cuda/<family>.rs), and why; shown in `Dispatch::reason`.
    pub passed_over: Option<(&'static Family, &'static str)>,
    /// Why this rung of a ladder (the FA3 stages) was taken; empty for single-family variants.
    pub pick: &'static str,
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
fn fit(fam: &'static Family, dev: &impl Gpu, p: &Problem) -> std::result::Result<Choice, String> {
    if dev.sm() < fam.min_sm {
        return Err(format!("needs sm_{} or newer, this GPU is sm_{}", fam.min_sm, dev.sm()));
    }
    let (major, minor) = ((dev.sm() / 10) as i32, (dev.sm() % 10) as i32);
    if !targets_for(fam.source).iter().any(|t| t.runs_on(major, minor)) {
        let names: Vec<&str> = targets_for(fam.source).iter().map(|t| t.name()).collect();
        return Err(format!("is built only for sm_{} (arch-specific features), this GPU is sm_{}", names.join("/sm_"), dev.sm()));
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
        if fa3_stage(fam.name).is_some() {
            if let Some(why) = super::fa3::refusal(p, tile) {
                return Err(why);
            }
        }
        if fa4_stage(fam.name).is_some() {
            if let Some(why) = super::fa4::refusal(p, tile) {
                return Err(why);
            }
        }
        let Some(image) = dev.image_for(fam.name, tile.head_dim) else { continue };
        let smem = (fam.smem_bytes)(tile);
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
        format!("supports head_dim up to {:?}", dims.last())
    } else {
        format!("has no image built for head_dim {} on sm_{} (FLASH_ATTN_HDIMS/ARCHS pruned it?)", p.head_dim, dev.sm())
    })
}

/// A family's own problem-level preconditions (its host module), checked after `fit`.
fn precondition(fam: &Family, tile: &Tile, p: &Problem) -> Option<&'static str> {
    match fam.name {
        "fa2" => super::fa2::problem_unmet(tile, p),
        _ => None,
    }
}

/// A family's own launch-level preconditions on the device addresses and element strides of
/// q, k, v, o (its host module); `None` when it can run them.
pub(crate) fn layout_unmet(fam: &Family, ptrs: [u64; 4], strides: [[usize; 3]; 4]) -> Option<&'static str> {
    match fam.name {
        "fa2" => super::fa2::layout_unmet(ptrs, strides),
        _ => None,
    }
}

/// After `c` turned out unable to run the launch (`why`, from `layout_unmet`): under Auto the
/// best lower-ranked family, recording what was passed over; an explicit variant is an error.
pub(crate) fn fall_back(dev: &impl Gpu, p: &Problem, variant: Variant, c: &Choice, why: &'static str) -> Result<Choice> {
    fall_back_in(FAMILIES, dev, p, variant, c, why)
}

fn fall_back_in(
    families: &'static [Family],
    dev: &impl Gpu,
    p: &Problem,
    variant: Variant,
    c: &Choice,
    why: &'static str,
) -> Result<Choice> {
    if variant != Variant::Auto {
        return Err(Error::VariantUnavailable {
            variant,
            reason: format!("{} on {} (sm_{}): {why}", c.family.name, dev.name(), dev.sm()),
        });
    }
    let mut lower = auto_below(families, dev, p, c.family.rank)?;
    lower.passed_over = Some((c.family, why));
    Ok(lower)
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

/// `choose` over a given table (the real one, or a test's).
fn choose_in(families: &'static [Family], dev: &impl Gpu, p: &Problem, variant: Variant) -> Result<Choice> {
    if variant != Variant::Auto {
        return choose_explicit(families, dev, p, variant);
    }
    auto_below(families, dev, p, u32::MAX)
}

/// Auto among the families ranked below `rank`: the highest-ranked one that runs `p`, noting a
/// higher-ranked one passed over for its own precondition.
fn auto_below(families: &'static [Family], dev: &impl Gpu, p: &Problem, rank: u32) -> Result<Choice> {
    let mut best: Option<Choice> = None;
    let mut passed: Option<(&'static Family, &'static str)> = None;
    for fam in families.iter().filter(|f| f.auto && f.rank < rank) {
        if let Ok(c) = fit(fam, dev, p) {
            if let Some(why) = precondition(fam, c.tile, p) {
                if passed.is_none_or(|(f, _)| fam.rank > f.rank) {
                    passed = Some((fam, why));
                }
                continue;
            }
            if best.is_none_or(|b| c.family.rank > b.family.rank) {
                best = Some(c);
            }
        }
    }
    let mut best = best.ok_or_else(|| no_kernel_error(families, dev, p))?;
    best.passed_over = passed.filter(|(f, _)| f.rank > best.family.rank);
    Ok(best)
}

/// An explicitly requested variant. A variant with several families (the FA3 stage ladder)
/// runs the stage `p.fa3_stage` names, else the highest GPU-verified stage that runs the
/// problem, else (none verified) the highest-ranked one that does; `Choice::pick` says which.
fn choose_explicit(families: &'static [Family], dev: &impl Gpu, p: &Problem, variant: Variant) -> Result<Choice> {
    let want = variant_name(variant);
    let unavailable = |reason: String| Error::VariantUnavailable { variant, reason };
    let of_variant = || families.iter().filter(move |f| f.variant == want);
    let ladder = of_variant().count() > 1;
    // An FA4 (tcgen05) rung runs only when fa4_stage names it: none has run on a GPU.
    let wanted_stage = |f: &Family| {
        p.fa3_stage.is_none_or(|s| fa3_stage(f.name) == Some(u32::from(s)))
            && fa4_stage(f.name).is_none_or(|s| p.fa4_stage.map(u32::from) == Some(s))
    };
    let candidates = || of_variant().filter(move |f| wanted_stage(f));
    if of_variant().next().is_none() {
        return Err(unavailable("no kernel of this family is built into this crate".into()));
    }
    if candidates().next().is_none() {
        let names: Vec<&str> = of_variant().map(|f| f.name).collect();
        if variant == Variant::Fa4 && p.fa4_stage.is_none() {
            return Err(unavailable(format!(
                "the FA4 tcgen05 kernels ({}) are not GPU-verified and run only when fa4_stage names a stage",
                names.join(", ")
            )));
        }
        let stage = if variant == Variant::Fa4 { p.fa4_stage } else { p.fa3_stage };
        return Err(unavailable(format!("no stage {stage:?} among {}", names.join(", "))));
    }
    // Verified beats unverified; among equals, the higher rank (the higher stage) wins.
    let key = |c: &Choice| (c.family.gpu_verified, c.family.rank);
    let best = candidates().filter_map(|f| fit(f, dev, p).ok()).max_by_key(key);
    match best {
        Some(mut c) => {
            if let Some(why) = precondition(c.family, c.tile, p) {
                return Err(unavailable(format!("{} on {} (sm_{}): {why}", c.family.name, dev.name(), dev.sm())));
            }
            if ladder || fa4_stage(c.family.name).is_some() {
                c.pick = if p.fa4_stage.is_some() {
                    "the stage fa4_stage asked for"
                } else if p.fa3_stage.is_some() {
                    "the stage fa3_stage asked for"
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
        None => {
            // The refusal of the highest-ranked candidate (all stages refuse alike).
            let fam = candidates().max_by_key(|f| f.rank).expect("checked non-empty above");
            let why = fit(fam, dev, p).err().unwrap_or_default();
            Err(unavailable(format!("{} on {} (sm_{}): {why}", fam.name, dev.name(), dev.sm())))
        }
    }
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
        .filter_map(|f| match fit(f, dev, p) {
            Err(e) => Some(format!("{}: {e}", f.name)),
            Ok(c) => precondition(f, c.tile, p).map(|e| format!("{}: {e}", f.name)),
        })
        .collect();
    Error::BackendUnavailable { backend, reason: format!("no kernel runs this problem: {}", why.join("; ")) }
}

/// The `Dispatch::reason` text of a choice (built only when asked: it allocates).
pub(crate) fn reason(dev: &impl Gpu, c: &Choice, requested: Variant) -> String {
    reason_in(FAMILIES, dev, c, requested)
}

fn reason_in(families: &'static [Family], dev: &impl Gpu, c: &Choice, requested: Variant) -> String {
    let how = if requested == Variant::Auto {
        let skipped: Vec<&str> = families
            .iter()
            .filter(|f| !f.auto && f.rank > c.family.rank)
            .map(|f| f.name)
            .collect();
        let mut s = format!("Auto: {} is the highest-ranked family that runs this problem here", c.family.name);
        if !skipped.is_empty() {
            s += &format!(" ({} not picked by Auto until verified on a GPU)", skipped.join(", "));
        }
        if let Some((f, why)) = c.passed_over {
            s += &format!("; {} passed over: {why}", f.name);
        }
        s
    } else if c.pick.is_empty() {
        format!("{} requested", variant_name(requested))
    } else {
        format!("{} requested: {}, {}", variant_name(requested), c.family.name, c.pick)
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

#[cfg(test)]
mod tests {
    use super::super::device::pick_image;
    use super::super::kernels::Target;
    use super::*;
    use crate::options::{ForwardOptions, Variant};

    const fn tile(head_dim: u32) -> Tile {
        Tile { head_dim, block_m: 64, block_n: 64, threads: 128 }
    }
    fn smem(t: &Tile) -> u32 {
        t.head_dim * 512
    }
    const TILES: &[Tile] = &[tile(64), tile(128), tile(256)];
    const fn family(name: &'static str, variant: &'static str, min_sm: u32, auto: bool, rank: u32) -> Family {
        Family {
            name,
            variant,
            source: "",
            tiles: TILES,
            min_sm,
            gpu_verified: false,
            auto,
            sass_expect: &[],
            options: &[],
            rank,
            cpu_emulation: None,
            smem_bytes: smem,
        }
    }
    /// An FA3 ladder row as the real table has them (sm_90a-only source, not in Auto).
    const fn fa3_row(name: &'static str, stage: u32, gpu_verified: bool) -> Family {
        Family {
            source: "cuda/fa3_fwd_sm90.cu",
            gpu_verified,
            ..family(name, "Fa3", 90, false, 30 + stage)
        }
    }
    /// A table as it will look with FA2 and FA3 merged: FA3 (three stages here) not yet
    /// allowed in Auto.
    static TABLE: &[Family] = &[
        family("fa1", "Fa1", 80, true, 1),
        family("fa2", "Fa2", 80, true, 2),
        fa3_row("fa3s1", 1, false),
        fa3_row("fa3s2", 2, false),
        fa3_row("fa3s3", 3, false),
    ];
    /// The same after stage 2 passed on a GPU.
    static TABLE_S2_VERIFIED: &[Family] = &[
        family("fa1", "Fa1", 80, true, 1),
        family("fa2", "Fa2", 80, true, 2),
        fa3_row("fa3s1", 1, true),
        fa3_row("fa3s2", 2, true),
        fa3_row("fa3s3", 3, false),
    ];

    const fn image(family: &'static str, head_dim: u32, target: Target) -> Image {
        Image { family, head_dim, target, bytes: &[], report: "" }
    }
    static IMAGES: &[Image] = &[
        image("fa1", 64, Target::Sm80),
        image("fa1", 128, Target::Sm80),
        image("fa1", 256, Target::Sm80),
        image("fa1", 64, Target::Ptx80),
        image("fa1", 128, Target::Ptx80),
        image("fa1", 256, Target::Ptx80),
        image("fa1", 64, Target::Sm90a),
        image("fa1", 128, Target::Sm90a),
        image("fa1", 256, Target::Sm90a),
        // fa2: head_dim 64 pruned from the build
        image("fa2", 128, Target::Sm80),
        image("fa2", 256, Target::Sm80),
        image("fa2", 128, Target::Sm90a),
        image("fa2", 256, Target::Sm90a),
        image("fa3s1", 64, Target::Sm90a),
        image("fa3s1", 128, Target::Sm90a),
        image("fa3s1", 256, Target::Sm90a),
        image("fa3s2", 64, Target::Sm90a),
        image("fa3s2", 128, Target::Sm90a),
        image("fa3s2", 256, Target::Sm90a),
        // stage 3: head_dim 256 pruned from the build
        image("fa3s3", 64, Target::Sm90a),
        image("fa3s3", 128, Target::Sm90a),
        // a build that (wrongly) had an sm_100a image of the sm_90a-only source
        image("fa3s3", 128, Target::Sm100a),
        image("fa4s1", 128, Target::Sm100a),
    ];
    /// FA1/FA2 plus the FA4 tcgen05 rung as the real table has it (sm_100a only, not in Auto).
    static TABLE_FA4: &[Family] = &[
        family("fa1", "Fa1", 80, true, 1),
        family("fa2", "Fa2", 80, true, 2),
        Family { source: "cuda/fa4_fwd_sm100.cu", ..family("fa4s1", "Fa4", 100, false, 41) },
    ];

    struct FakeGpu {
        cc: (i32, i32),
        smem: u32,
    }
    impl Gpu for FakeGpu {
        fn ordinal(&self) -> usize {
            0
        }
        fn name(&self) -> &str {
            "fake"
        }
        fn sm(&self) -> u32 {
            (self.cc.0 * 10 + self.cc.1) as u32
        }
        fn max_smem_optin(&self) -> u32 {
            self.smem
        }
        fn image_for(&self, family: &str, head_dim: u32) -> Option<&'static Image> {
            pick_image(IMAGES, family, head_dim, self.cc)
        }
    }
    const H100: FakeGpu = FakeGpu { cc: (9, 0), smem: 227 * 1024 };
    const A100: FakeGpu = FakeGpu { cc: (8, 0), smem: 163 * 1024 };
    const RTX5090: FakeGpu = FakeGpu { cc: (12, 0), smem: 99 * 1024 };
    const B200: FakeGpu = FakeGpu { cc: (10, 0), smem: 227 * 1024 };

    fn problem(dtype: DType, head_dim: usize, opts: &ForwardOptions) -> Problem {
        Problem::from_shapes([1, 100, 4, head_dim], [1, 100, 2, head_dim], [1, 100, 2, head_dim], dtype, opts).unwrap()
    }
    fn pick(gpu: &FakeGpu, head_dim: usize, variant: Variant) -> Result<Choice> {
        choose_in(TABLE, gpu, &problem(DType::BF16, head_dim, &ForwardOptions::default()), variant)
    }

    #[test]
    fn fa4_runs_only_when_fa4_stage_names_it() {
        let fa4 = |gpu: &FakeGpu, opts: ForwardOptions| {
            let opts = opts.variant(Variant::Fa4);
            choose_in(TABLE_FA4, gpu, &problem(DType::BF16, 128, &opts), Variant::Fa4)
        };
        // Auto never picks it.
        let auto = choose_in(TABLE_FA4, &B200, &problem(DType::BF16, 128, &ForwardOptions::default()), Variant::Auto);
        assert_ne!(auto.unwrap().family.name, "fa4s1");
        // Variant::Fa4 alone does not run an unverified tcgen05 kernel.
        let e = fa4(&B200, ForwardOptions::default()).unwrap_err();
        assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("fa4_stage")), "{e:?}");
        // With the stage, on an sm_100 GPU, it runs, and the reason says so.
        let c = fa4(&B200, ForwardOptions::default().fa4_stage(1)).unwrap();
        assert_eq!((c.family.name, c.image.target), ("fa4s1", Target::Sm100a));
        let why = reason_in(TABLE_FA4, &B200, &c, Variant::Fa4);
        assert!(why.contains("fa4s1, the stage fa4_stage asked for") && why.contains("not yet verified"), "{why}");
        // Elsewhere it is refused with the reason.
        for gpu in [&H100, &RTX5090] {
            let e = fa4(gpu, ForwardOptions::default().fa4_stage(1)).unwrap_err();
            assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("sm_100")), "{e:?}");
        }
        // The option is validated with the problem.
        let check = |o: ForwardOptions| Problem::from_shapes([1, 8, 1, 128], [1, 8, 1, 128], [1, 8, 1, 128], DType::BF16, &o);
        let e = check(ForwardOptions::default().variant(Variant::Fa4).fa4_stage(9)).unwrap_err();
        assert!(matches!(e, Error::InvalidOption { option: "fa4_stage", .. }), "{e:?}");
        let e = check(ForwardOptions::default().variant(Variant::Fa3).fa4_stage(1)).unwrap_err();
        assert!(matches!(e, Error::InvalidOption { option: "fa4_stage", .. }), "{e:?}");
        assert_eq!(crate::problem::FA4_MAX_STAGE as u32, super::super::kernels::FA4_MAX_STAGE);
    }

    #[test]
    fn auto_keeps_unverified_fa3_out_on_hopper() {
        let c = pick(&H100, 128, Variant::Auto).unwrap();
        assert_eq!((c.family.name, c.image.target), ("fa2", Target::Sm90a));
        let why = reason_in(TABLE, &H100, &c, Variant::Auto);
        assert!(why.contains("fa3s1, fa3s2, fa3s3 not picked by Auto"), "{why}");
        // Explicitly requested, FA3 runs.
        assert_eq!(pick(&H100, 128, Variant::Fa3).unwrap().family.name, "fa3s3");
    }

    #[test]
    fn explicit_variant_the_gpu_cannot_run_is_an_error() {
        let e = pick(&A100, 128, Variant::Fa3).unwrap_err();
        assert!(matches!(&e, Error::VariantUnavailable { variant: Variant::Fa3, reason } if reason.contains("sm_90")), "{e:?}");
        let e = pick(&H100, 128, Variant::Fa4).unwrap_err();
        assert!(matches!(e, Error::VariantUnavailable { variant: Variant::Fa4, .. }), "{e:?}");
        let e = pick(&H100, 200, Variant::Fa3).unwrap_err();
        assert!(matches!(e, Error::VariantUnavailable { .. }), "{e:?}");
    }

    fn fa3(table: &'static [Family], gpu: &FakeGpu, head_dim: usize, opts: &ForwardOptions) -> Result<Choice> {
        let opts = opts.clone().variant(Variant::Fa3);
        choose_in(table, gpu, &problem(DType::BF16, head_dim, &opts), Variant::Fa3)
    }

    #[test]
    fn fa3_without_a_stage_runs_the_highest_verified_else_the_highest_compiled() {
        let none = ForwardOptions::default();
        let c = fa3(TABLE, &H100, 128, &none).unwrap();
        assert_eq!((c.family.name, c.tile.head_dim, c.image.target), ("fa3s3", 128, Target::Sm90a));
        let why = reason_in(TABLE, &H100, &c, Variant::Fa3);
        assert!(why.contains("Fa3 requested: fa3s3, no stage is GPU-verified yet"), "{why}");
        assert!(why.contains("not yet verified on a GPU"), "{why}");
        // Stage 3 has no hd256 image: the highest compiled stage that runs it is 2.
        assert_eq!(fa3(TABLE, &H100, 256, &none).unwrap().family.name, "fa3s2");
        // Once stage 2 is verified it wins over the unverified stage 3.
        let c = fa3(TABLE_S2_VERIFIED, &H100, 128, &none).unwrap();
        assert_eq!(c.family.name, "fa3s2");
        let why = reason_in(TABLE_S2_VERIFIED, &H100, &c, Variant::Fa3);
        assert!(why.contains("the highest GPU-verified stage"), "{why}");
        assert!(!why.contains("not yet verified"), "{why}");
    }

    #[test]
    fn fa3_stage_selects_the_rung() {
        let c = fa3(TABLE, &H100, 64, &ForwardOptions::default().fa3_stage(1)).unwrap();
        assert_eq!(c.family.name, "fa3s1");
        assert!(reason_in(TABLE, &H100, &c, Variant::Fa3).contains("fa3s1, the stage fa3_stage asked for"));
        // Explicit beats verified.
        assert_eq!(fa3(TABLE_S2_VERIFIED, &H100, 64, &ForwardOptions::default().fa3_stage(3)).unwrap().family.name, "fa3s3");
        // A valid stage this table lacks, and a stage whose image was pruned.
        let e = fa3(TABLE, &H100, 64, &ForwardOptions::default().fa3_stage(5)).unwrap_err();
        assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("no stage Some(5)")), "{e:?}");
        let e = fa3(TABLE, &H100, 256, &ForwardOptions::default().fa3_stage(3)).unwrap_err();
        assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("no image built")), "{e:?}");
    }

    #[test]
    fn fa3_stage_is_validated() {
        let shapes = ([1, 10, 2, 64], [1, 10, 2, 64]);
        let check = |opts: ForwardOptions| Problem::from_shapes(shapes.0, shapes.1, shapes.1, DType::BF16, &opts);
        for bad in [0, 6, 255] {
            let e = check(ForwardOptions::default().variant(Variant::Fa3).fa3_stage(bad)).unwrap_err();
            assert!(matches!(e, Error::InvalidOption { option: "fa3_stage", .. }), "{e:?}");
        }
        for other in [Variant::Auto, Variant::Fa2] {
            let e = check(ForwardOptions::default().variant(other).fa3_stage(2)).unwrap_err();
            assert!(matches!(e, Error::InvalidOption { option: "fa3_stage", .. }), "{e:?}");
        }
        assert_eq!(check(ForwardOptions::default().variant(Variant::Fa3).fa3_stage(5)).unwrap().fa3_stage, Some(5));
    }

    #[test]
    fn fa3_refusals() {
        let none = ForwardOptions::default();
        let refused = |r: Result<Choice>, what: &str| match r {
            Err(Error::VariantUnavailable { variant: Variant::Fa3, reason }) => assert!(reason.contains(what), "{reason}"),
            other => panic!("expected a refusal naming {what:?}, got {other:?}"),
        };
        refused(fa3(TABLE, &H100, 128, &none.clone().alibi_slopes(vec![0.25; 4])), "ALiBi");
        refused(fa3(TABLE, &H100, 96, &none), "exactly");
        refused(fa3(TABLE, &H100, 32, &none), "exactly");
        refused(fa3(TABLE, &H100, 512, &none), "head_dim up to");
        refused(fa3(TABLE, &A100, 128, &none), "sm_90");
        refused(fa3(TABLE, &B200, 128, &none), "built only for sm_90a");
        refused(fa3(TABLE, &RTX5090, 128, &none), "built only for sm_90a");
        let f32p = problem(DType::F32, 128, &none.clone().variant(Variant::Fa3));
        let e = choose_in(TABLE, &H100, &f32p, Variant::Fa3).unwrap_err();
        assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("F32")), "{e:?}");
        // Auto never routes to FA3 (unverified) and still runs ALiBi on Hopper.
        let alibi = none.clone().alibi_slopes(vec![0.25; 4]);
        let c = choose_in(TABLE, &H100, &problem(DType::BF16, 128, &alibi), Variant::Auto).unwrap();
        assert_eq!(c.family.name, "fa2");
    }

    #[test]
    fn head_dim_runs_on_the_smallest_built_instance_that_holds_it() {
        let c = pick(&A100, 40, Variant::Fa1).unwrap();
        assert_eq!((c.tile.head_dim, c.image.target), (64, Target::Sm80));
        // fa2 runs only its exact head dims (src/cuda/fa2.rs): 40 is refused when forced, and
        // Auto takes fa1.
        assert!(matches!(pick(&A100, 40, Variant::Fa2), Err(Error::VariantUnavailable { .. })));
        assert_eq!(pick(&A100, 40, Variant::Auto).unwrap().family.name, "fa1");
        let e = pick(&A100, 300, Variant::Auto).unwrap_err();
        assert!(matches!(e, Error::UnsupportedHeadDim { head_dim: 300, .. }), "{e:?}");
    }

    #[test]
    fn gpus_without_own_sass_use_the_ptx() {
        let c = pick(&RTX5090, 128, Variant::Auto).unwrap();
        assert_eq!((c.family.name, c.image.target), ("fa1", Target::Ptx80));
    }

    #[test]
    fn f32_and_unimplemented_options_find_no_kernel() {
        let e = choose_in(TABLE, &H100, &problem(DType::F32, 64, &ForwardOptions::default()), Variant::Auto).unwrap_err();
        assert!(matches!(e, Error::UnsupportedDType { dtype: DType::F32, .. }), "{e:?}");
        let poly = ForwardOptions::default().exp2(crate::options::Exp2::Poly(3));
        let e = choose_in(TABLE, &H100, &problem(DType::F16, 64, &poly), Variant::Auto).unwrap_err();
        assert!(matches!(&e, Error::BackendUnavailable { reason, .. } if reason.contains("exp2_poly")), "{e:?}");
    }

    #[test]
    fn shared_memory_beyond_the_gpu_is_refused() {
        let small = FakeGpu { cc: (8, 6), smem: 100_000 };
        assert!(pick(&small, 128, Variant::Fa1).is_ok()); // 65536 B
        let e = pick(&small, 256, Variant::Fa1).unwrap_err(); // 131072 B
        assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("shared memory")), "{e:?}");
    }

    /// The real table with every image it builds present: SASS where a target runs on the GPU,
    /// else the compute_80 PTX (as build.rs produces with no FLASH_ATTN_ARCHS/HDIMS pruning).
    struct Built(FakeGpu);
    impl Gpu for Built {
        fn ordinal(&self) -> usize {
            0
        }
        fn name(&self) -> &str {
            "fake-built"
        }
        fn sm(&self) -> u32 {
            self.0.sm()
        }
        fn max_smem_optin(&self) -> u32 {
            self.0.smem
        }
        fn image_for(&self, family: &str, head_dim: u32) -> Option<&'static Image> {
            let fam = FAMILIES.iter().find(|f| f.name == family)?;
            fam.tiles.iter().find(|t| t.head_dim == head_dim)?;
            let (major, minor) = self.0.cc;
            let targets = super::super::kernels::targets_for(fam.source);
            let target = targets
                .iter()
                .copied()
                .find(|t| *t != Target::Ptx80 && t.runs_on(major, minor))
                .or_else(|| targets.iter().copied().find(|t| t.runs_on(major, minor)))?;
            Some(Box::leak(Box::new(image(fam.name, head_dim, target))))
        }
    }
    const FA2_DIMS: [usize; 6] = [32, 64, 96, 128, 192, 256];
    /// (GPU, expected SASS target): A100, RTX 3090 (sm_86, 99 KB opt-in), RTX 4090, H100/H200.
    const FA2_GPUS: [(Built, Target); 4] = [
        (Built(FakeGpu { cc: (8, 0), smem: 163 * 1024 }), Target::Sm80),
        (Built(FakeGpu { cc: (8, 6), smem: 99 * 1024 }), Target::Sm80),
        (Built(FakeGpu { cc: (8, 9), smem: 99 * 1024 }), Target::Sm80),
        (Built(FakeGpu { cc: (9, 0), smem: 227 * 1024 }), Target::Sm90a),
    ];
    fn real(gpu: &Built, dtype: DType, head_dim: usize, variant: Variant) -> Result<Choice> {
        choose_in(FAMILIES, gpu, &problem(dtype, head_dim, &ForwardOptions::default()), variant)
    }

    #[test]
    fn auto_picks_fa2_on_ampere_ada_and_hopper() {
        for (gpu, target) in &FA2_GPUS {
            for d in FA2_DIMS {
                for dtype in [DType::F16, DType::BF16] {
                    let c = real(gpu, dtype, d, Variant::Auto).unwrap();
                    assert_eq!((c.family.name, c.tile.head_dim as usize, c.image.target), ("fa2", d, *target), "sm_{} hd{d}", gpu.sm());
                    assert!(c.passed_over.is_none());
                    // Masks, softcap, ALiBi and LSE are run-time flags: still fa2.
                    let opts = ForwardOptions::default().causal(true).softcap(30.0).return_lse(true);
                    let c = choose_in(FAMILIES, gpu, &problem(dtype, d, &opts), Variant::Auto).unwrap();
                    assert_eq!(c.family.name, "fa2");
                }
            }
        }
    }

    #[test]
    fn variant_fa2_is_forced_on_any_sm80_plus_and_refused_below() {
        let newer = [Built(FakeGpu { cc: (10, 0), smem: 227 * 1024 }), Built(FakeGpu { cc: (12, 0), smem: 99 * 1024 })];
        for gpu in FA2_GPUS.iter().map(|(g, _)| g).chain(&newer) {
            for d in FA2_DIMS {
                assert_eq!(real(gpu, DType::BF16, d, Variant::Fa2).unwrap().family.name, "fa2", "sm_{} hd{d}", gpu.sm());
            }
        }
        // sm_120 has no SASS of its own: the compute_80 PTX.
        assert_eq!(real(&newer[1], DType::F16, 128, Variant::Fa2).unwrap().image.target, Target::Ptx80);
        let turing = Built(FakeGpu { cc: (7, 5), smem: 64 * 1024 });
        let e = real(&turing, DType::F16, 64, Variant::Fa2).unwrap_err();
        assert!(matches!(&e, Error::VariantUnavailable { variant: Variant::Fa2, reason } if reason.contains("sm_80")), "{e:?}");
        let e = real(&FA2_GPUS[0].0, DType::F32, 64, Variant::Fa2).unwrap_err();
        assert!(matches!(e, Error::VariantUnavailable { variant: Variant::Fa2, .. }), "{e:?}");
    }

    #[test]
    fn head_dims_fa2_lacks_fall_back_to_fa1_under_auto_and_fail_when_forced() {
        let a100 = &FA2_GPUS[0].0;
        for d in [8, 40, 72, 100, 160, 200] {
            let c = real(a100, DType::F16, d, Variant::Auto).unwrap();
            assert_eq!(c.family.name, "fa1", "hd{d}");
            assert_eq!(c.passed_over.map(|(f, _)| f.name), Some("fa2"), "hd{d}");
            let why = reason_in(FAMILIES, a100, &c, Variant::Auto);
            assert!(why.contains("fa2 passed over") && why.contains("exact head dims"), "{why}");
            let e = real(a100, DType::F16, d, Variant::Fa2).unwrap_err();
            assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("exact head dims")), "{e:?}");
        }
    }

    #[test]
    fn fa2_layout_refusal_falls_back_under_auto_and_fails_when_forced() {
        let a100 = &FA2_GPUS[0].0;
        let p = problem(DType::BF16, 128, &ForwardOptions::default());
        let c = choose_in(FAMILIES, a100, &p, Variant::Auto).unwrap();
        assert_eq!(c.family.name, "fa2");
        let contiguous = [100 * 4 * 128, 4 * 128, 128];
        assert_eq!(layout_unmet(c.family, [256; 4], [contiguous; 4]), None);
        let why = layout_unmet(c.family, [256, 258, 256, 256], [contiguous; 4]).unwrap();
        let fb = fall_back_in(FAMILIES, a100, &p, Variant::Auto, &c, why).unwrap();
        assert_eq!((fb.family.name, fb.passed_over.map(|(f, _)| f.name)), ("fa1", Some("fa2")));
        assert!(reason_in(FAMILIES, a100, &fb, Variant::Auto).contains("16-byte aligned"));
        let e = fall_back_in(FAMILIES, a100, &p, Variant::Fa2, &c, why).unwrap_err();
        assert!(matches!(&e, Error::VariantUnavailable { variant: Variant::Fa2, reason } if reason.contains("aligned")), "{e:?}");
        // FA1 has no such precondition.
        let fa1 = FAMILIES.iter().find(|f| f.name == "fa1").unwrap();
        assert_eq!(layout_unmet(fa1, [258; 4], [[3, 5, 7]; 4]), None);
    }

    /// The real table: unique names, known variants, ascending tiles within the largest
    /// shared memory any supported GPU offers (227 KB, sm_90/sm_100; a GPU with less refuses
    /// the instance at dispatch, as tested above).
    #[test]
    fn the_table_is_well_formed() {
        for (i, f) in FAMILIES.iter().enumerate() {
            assert!(FAMILIES[..i].iter().all(|g| g.name != f.name), "duplicate family {}", f.name);
            assert!(["Fa1", "Fa2", "Fa3", "Fa4"].contains(&f.variant), "{}: unknown variant {}", f.name, f.variant);
            assert!(!f.sass_expect.is_empty(), "{}: no SASS expectation", f.name);
            assert!(f.tiles.windows(2).all(|w| w[0].head_dim < w[1].head_dim), "{}: tiles not ascending", f.name);
            for t in f.tiles {
                assert!(t.threads % 32 == 0 && t.block_m > 0 && t.block_n > 0, "{}: bad tile {t:?}", f.name);
                assert!((f.smem_bytes)(t) <= 227 * 1024, "{} hd{}: {} B of shared memory", f.name, t.head_dim, (f.smem_bytes)(t));
            }
        }
    }
}

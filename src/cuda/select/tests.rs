//! The choice logic on fake GPUs and tables, and the real table on every GPU it targets.

use super::super::device::pick_image;
use super::super::table::{targets_for, KernelVariant, Pipeline, SoftmaxParams, Target};
use super::*;
use crate::options::{ForwardOptions, Variant};
use crate::tensor::DType;

const fn tile(head_dim: u32) -> Tile {
    Tile { head_dim, head_dim_v: head_dim, block_m: 64, block_n: 64, threads: 128 }
}
fn smem(_stage: Option<u8>, t: &Tile) -> u32 {
    t.head_dim * 512
}
const TILES: &[Tile] = &[tile(64), tile(128), tile(256)];
const fn family(name: &'static str, variant: KernelVariant, min_sm: u32, auto: bool, rank: u32, pipeline: Pipeline) -> Family {
    Family {
        name,
        variant,
        stage: None,
        pipeline,
        tiles: TILES,
        min_sm,
        gpu_verified: false,
        auto,
        sass_expect: &[],
        options: KernelOptions::NONE,
        softmax: SoftmaxParams::NONE,
        rank,
        cpu_emulation: None,
        smem,
    }
}
const FA1: Family = family("fa1", KernelVariant::Fa1, 80, true, 1, Pipeline::Fa1);
const FA2: Family = family("fa2", KernelVariant::Fa2, 80, true, 2, Pipeline::Fa2);
/// An FA3 ladder row as the real table has them (sm_90a-only source, not in Auto).
const fn fa3_row(name: &'static str, stage: u8, gpu_verified: bool) -> Family {
    Family {
        stage: Some(stage),
        gpu_verified,
        ..family(name, KernelVariant::Fa3, 90, false, 30 + stage as u32, Pipeline::Fa3)
    }
}
/// A table shaped like the real one: FA1, FA2 and an FA3 ladder (three stages here) that is not
/// allowed in Auto.
static TABLE: &[Family] = &[
    FA1,
    FA2,
    fa3_row("fa3s1", 1, false),
    fa3_row("fa3s2", 2, false),
    fa3_row("fa3s3", 3, false),
];
/// The same after stage 2 passed on a GPU.
static TABLE_S2_VERIFIED: &[Family] = &[
    FA1,
    FA2,
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
    image("fa4s2", 128, Target::Sm100a),
    image("fa4s3", 128, Target::Sm100a),
];
/// An FA4 ladder row as the real table has them (sm_100a-only source, not in Auto, unverified).
const fn fa4_row(name: &'static str, stage: u8) -> Family {
    Family {
        stage: Some(stage),
        ..family(name, KernelVariant::Fa4, 100, false, 40 + stage as u32, Pipeline::Fa4)
    }
}
/// The FA4 rung that runs FA4's softmax (degree-3 exp2 on 1 element in 8, lazy tau 8).
const FA4_S3: Family = Family {
    options: KernelOptions::EXP2_POLY.union(KernelOptions::LAZY_RESCALE),
    softmax: SoftmaxParams { poly_degree: 3, poly_every: 8, lazy_tau: 8.0 },
    ..fa4_row("fa4s3", 3)
};
static TABLE_FA4_S3: &[Family] = &[FA1, FA2, fa4_row("fa4s1", 1), FA4_S3];
/// FA1/FA2 plus two FA4 tcgen05 rungs.
static TABLE_FA4: &[Family] = &[FA1, FA2, fa4_row("fa4s1", 1), fa4_row("fa4s2", 2)];

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
    refused(fa3(TABLE, &H100, 512, &none), "head_dim up to 256 (instances 64, 128, 256), not 512");
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
        let targets = targets_for(fam.source());
        let target = targets
            .iter()
            .copied()
            .find(|t| *t != Target::Ptx80 && t.runs_on(major, minor))
            .or_else(|| targets.iter().copied().find(|t| t.runs_on(major, minor)))?;
        Some(Box::leak(Box::new(image(fam.name, head_dim, target))))
    }
}
const FA2_DIMS: [usize; 7] = [32, 64, 96, 128, 192, 256, 512];
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

/// head_dim 512 is FA2's alone: Auto takes it on every sm_80+ GPU (99840 B fits sm_86/89's
/// 99 KiB, `auto_picks_fa2_on_ampere_ada_and_hopper`), a forced FA1 or FA3 is refused with the
/// head dims it has; 257..=511 has no kernel.
#[test]
fn head_dim_512_runs_on_fa2_only() {
    let (a100, h100) = (&FA2_GPUS[0].0, &FA2_GPUS[3].0);
    let e = real(a100, DType::F16, 512, Variant::Fa1).unwrap_err();
    assert!(
        matches!(&e, Error::VariantUnavailable { variant: Variant::Fa1, reason }
            if reason.contains("up to 256") && reason.contains("32, 64, 96, 128, 192, 256")),
        "{e:?}"
    );
    let e = real(h100, DType::BF16, 512, Variant::Fa3).unwrap_err();
    assert!(
        matches!(&e, Error::VariantUnavailable { variant: Variant::Fa3, reason }
            if reason.contains("fa3s5") && reason.contains("up to 256 (instances 64, 128, 192, 256), not 512")),
        "{e:?}"
    );
    for d in [300, 511] {
        let e = real(a100, DType::F16, d, Variant::Fa2).unwrap_err();
        assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("512")), "{e:?}");
        assert!(real(a100, DType::F16, d, Variant::Auto).is_err(), "hd{d}");
    }
}

fn operands(ptrs: [u64; 4], strides: [[usize; 3]; 4]) -> Operands {
    Operands { ptrs, strides, lse: 0, alibi: 0, sinks: 0 }
}

#[test]
fn fa2_layout_refusal_falls_back_under_auto_and_fails_when_forced() {
    let a100 = &FA2_GPUS[0].0;
    let p = problem(DType::BF16, 128, &ForwardOptions::default());
    let contiguous = [100 * 4 * 128, 4 * 128, 128];
    let aligned = operands([256; 4], [contiguous; 4]);
    let c = choose_for_in(FAMILIES, a100, &p, Variant::Auto, &aligned).unwrap();
    assert_eq!((c.family.name, c.passed_over.map(|(f, _)| f.name)), ("fa2", None));
    let misaligned = operands([256, 258, 256, 256], [contiguous; 4]);
    let fb = choose_for_in(FAMILIES, a100, &p, Variant::Auto, &misaligned).unwrap();
    assert_eq!((fb.family.name, fb.passed_over.map(|(f, _)| f.name)), ("fa1", Some("fa2")));
    assert!(reason_in(FAMILIES, a100, &fb, Variant::Auto).contains("16-byte aligned"));
    let e = choose_for_in(FAMILIES, a100, &p, Variant::Fa2, &misaligned).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidLayout { operand: crate::Operand::K, reason } if reason.contains("aligned")),
        "{e:?}"
    );
    // FA1 has no layout rule.
    let e = choose_for_in(FAMILIES, a100, &p, Variant::Fa1, &operands([258; 4], [[3, 5, 7]; 4]));
    assert_eq!(e.unwrap().family.name, "fa1");
}

/// The real table: unique names, ascending tiles within the largest
/// shared memory any supported GPU offers (227 KB, sm_90/sm_100; a GPU with less refuses
/// the instance at dispatch, as tested above).
#[test]
fn the_table_is_well_formed() {
    for (i, f) in FAMILIES.iter().enumerate() {
        assert!(FAMILIES[..i].iter().all(|g| g.name != f.name), "duplicate family {}", f.name);
        assert!(!f.sass_expect.is_empty(), "{}: no SASS expectation", f.name);
        assert!(f.tiles.windows(2).all(|w| w[0].head_dim < w[1].head_dim), "{}: tiles not ascending", f.name);
        for t in f.tiles {
            assert!(t.threads % 32 == 0 && t.block_m > 0 && t.block_n > 0, "{}: bad tile {t:?}", f.name);
            assert!(f.smem_bytes(t) <= 227 * 1024, "{} hd{}: {} B of shared memory", f.name, t.head_dim, f.smem_bytes(t));
        }
    }
}

#[test]
fn fa4_runs_only_when_fa4_stage_names_it() {
    let fa4 = |gpu: &FakeGpu, opts: ForwardOptions| {
        let opts = opts.variant(Variant::Fa4);
        choose_in(TABLE_FA4, gpu, &problem(DType::BF16, 128, &opts), Variant::Fa4)
    };
    // Auto never picks it.
    let auto = choose_in(TABLE_FA4, &B200, &problem(DType::BF16, 128, &ForwardOptions::default()), Variant::Auto);
    assert_eq!(auto.unwrap().family.variant, KernelVariant::Fa1); // the PTX image: no fa2 sm_100a one here
    // Variant::Fa4 alone does not run an unverified tcgen05 kernel.
    let e = fa4(&B200, ForwardOptions::default()).unwrap_err();
    assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("FA4 needs fa4_stage")), "{e:?}");
    // With the stage, on an sm_100 GPU, that stage runs (not the highest), and the reason says so.
    for (stage, name) in [(1, "fa4s1"), (2, "fa4s2")] {
        let c = fa4(&B200, ForwardOptions::default().fa4_stage(stage)).unwrap();
        assert_eq!((c.family.name, c.image.target), (name, Target::Sm100a));
        let why = reason_in(TABLE_FA4, &B200, &c, Variant::Fa4);
        assert!(why.contains(&format!("{name}, the stage fa4_stage asked for")) && why.contains("not yet verified"), "{why}");
    }
    // A valid stage this table lacks.
    let e = fa4(&B200, ForwardOptions::default().fa4_stage(3)).unwrap_err();
    assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("no stage Some(3)")), "{e:?}");
    // Elsewhere it is refused with the reason.
    for gpu in [&H100, &RTX5090] {
        let e = fa4(gpu, ForwardOptions::default().fa4_stage(1)).unwrap_err();
        assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("sm_100")), "{e:?}");
    }
}

#[test]
fn fa4_stage_is_validated() {
    let check = |o: ForwardOptions| Problem::from_shapes([1, 8, 1, 128], [1, 8, 1, 128], [1, 8, 1, 128], DType::BF16, &o);
    for bad in [0, 4, 255] {
        let e = check(ForwardOptions::default().variant(Variant::Fa4).fa4_stage(bad)).unwrap_err();
        assert!(matches!(e, Error::InvalidOption { option: "fa4_stage", .. }), "{e:?}");
    }
    for other in [Variant::Auto, Variant::Fa3] {
        let e = check(ForwardOptions::default().variant(other).fa4_stage(1)).unwrap_err();
        assert!(matches!(e, Error::InvalidOption { option: "fa4_stage", .. }), "{e:?}");
    }
    assert_eq!(check(ForwardOptions::default().variant(Variant::Fa4).fa4_stage(3)).unwrap().fa4_stage, Some(3));
    assert_eq!(crate::problem::FA4_MAX_STAGE, super::super::table::FA4_MAX_STAGE);
}

#[test]
fn fa4_softmax_options_route_to_the_stage_that_implements_them() {
    use crate::options::{Exp2, Rescale};
    let fa4 = |stage: u8, exp2: Exp2, rescale: Rescale| {
        let opts = ForwardOptions::default().variant(Variant::Fa4).fa4_stage(stage).exp2(exp2).rescale(rescale);
        choose_in(TABLE_FA4_S3, &B200, &problem(DType::BF16, 128, &opts), Variant::Fa4)
    };
    let lazy = |threshold: f32| Rescale::Lazy { threshold };
    // Asked for explicitly, with the row's parameters: stage 3 runs it (and by default too).
    for (exp2, rescale) in [(Exp2::Poly(3), lazy(8.0)), (Exp2::Poly(3), Rescale::Always), (Exp2::Accurate, lazy(8.0))] {
        assert_eq!(fa4(3, exp2, rescale).unwrap().family.name, "fa4s3", "{exp2:?} {rescale:?}");
    }
    assert_eq!(fa4(3, Exp2::Accurate, Rescale::Always).unwrap().family.name, "fa4s3");
    // Other parameters than the row's are refused, naming what the row has.
    let refused = |r: Result<Choice>, what: &str| {
        assert!(matches!(&r, Err(Error::VariantUnavailable { reason, .. }) if reason.contains(what)), "{what}: {r:?}");
    };
    refused(fa4(3, Exp2::Poly(5), Rescale::Always), "exp2_poly of degree 3, not 5");
    refused(fa4(3, Exp2::Poly(3), lazy(4.0)), "lazy_rescale with threshold 8, not 4");
    // A stage without FA4's softmax refuses the options.
    refused(fa4(1, Exp2::Poly(3), Rescale::Always), "does not implement exp2_poly");
    refused(fa4(1, Exp2::Accurate, lazy(8.0)), "does not implement lazy_rescale");
    // Auto never takes FA4's softmax to the FA4 row (it is not in Auto): no family runs it.
    let auto = ForwardOptions::default().exp2(Exp2::Poly(3));
    let e = choose_in(TABLE_FA4_S3, &B200, &problem(DType::BF16, 128, &auto), Variant::Auto).unwrap_err();
    assert!(matches!(e, Error::BackendUnavailable { .. }), "{e:?}");
}

fn fp8_opts(scaling: crate::options::Fp8Scaling) -> ForwardOptions {
    ForwardOptions::default().precision(crate::options::Precision::Fp8 { scaling, hadamard: Some(0x5EED) })
}

/// `Precision::Fp8` on a (faked) sm_90 device: `Variant::Fa3` runs the top FP8 row (stage 5),
/// `fa3_stage` 3-5 its rungs; a 16-bit problem never does; Auto leaves the unverified FP8 rows
/// alone and says which one would run it and how to ask (then `forward`'s Backend::Auto runs the
/// CPU FP8 path with that reason); what the consumer does not run is a typed refusal naming the rule.
#[test]
fn fp8_problems_choose_the_fp8_family_on_hopper() {
    use crate::options::Fp8Scaling;
    let h200 = &FA2_GPUS[3].0;
    let block = fp8_opts(Fp8Scaling::PerBlock { rows: 128 });
    let c = choose_in(FAMILIES, h200, &problem(DType::BF16, 128, &block), Variant::Fa3).unwrap();
    assert_eq!((c.family.name, c.tile.head_dim, c.image.target), ("fa3fp8s5", 128, Target::Sm90a));
    assert!(c.pick.contains("highest compiled stage"), "{}", c.pick);
    let c =
        choose_in(FAMILIES, h200, &problem(DType::F16, 128, &fp8_opts(Fp8Scaling::PerTensor)), Variant::Fa3).unwrap();
    assert_eq!(c.family.name, "fa3fp8s5");
    // fa3_stage 3-5 names an FP8 row's rung; stages 1-2 have no FP8 row.
    for (stage, name) in [(3, "fa3fp8s3"), (4, "fa3fp8s4"), (5, "fa3fp8s5")] {
        let o = fp8_opts(Fp8Scaling::PerTensor).variant(Variant::Fa3).fa3_stage(stage);
        let c = choose_in(FAMILIES, h200, &problem(DType::BF16, 128, &o), Variant::Fa3).unwrap();
        assert_eq!((c.family.name, c.pick), (name, "the stage fa3_stage asked for"));
    }
    for stage in [1, 2] {
        let o = fp8_opts(Fp8Scaling::PerTensor).variant(Variant::Fa3).fa3_stage(stage);
        let e = choose_in(FAMILIES, h200, &problem(DType::BF16, 128, &o), Variant::Fa3).unwrap_err();
        assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("fp8")), "{e:?}");
    }
    // 16-bit problems never land on the FP8 row, explicit or Auto.
    for d in [64, 128, 256] {
        let c = real(h200, DType::BF16, d, Variant::Fa3).unwrap();
        assert!(c.family.name.starts_with("fa3s"), "hd{d}: {}", c.family.name);
        assert_eq!(real(h200, DType::BF16, d, Variant::Auto).unwrap().family.name, "fa2");
    }
    // Auto: no GPU-verified family implements FP8, so no GPU kernel (the CPU runs it); the
    // reason names the FP8 row that would run it and the explicit request.
    let e = choose_in(FAMILIES, h200, &problem(DType::BF16, 128, &block), Variant::Auto).unwrap_err();
    assert!(
        matches!(&e, Error::BackendUnavailable { reason, .. }
            if reason.contains("fa3fp8s5 runs it but is not picked by Auto") && reason.contains("Variant::Fa3")
                && !reason.contains("fa3fp8s3 runs")),
        "{e:?}"
    );
    // Where no FP8 row runs the problem (head_dim 96: not a power of two, so no Hadamard), no
    // such hint.
    let unrotated = ForwardOptions::default()
        .precision(crate::options::Precision::Fp8 { scaling: Fp8Scaling::PerBlock { rows: 128 }, hadamard: None });
    let e = choose_in(FAMILIES, h200, &problem(DType::BF16, 96, &unrotated), Variant::Auto).unwrap_err();
    assert!(matches!(&e, Error::BackendUnavailable { reason, .. } if !reason.contains("not picked by Auto")), "{e:?}");
    // Typed refusals of what the consumer does not run.
    for (d, opts, why) in [
        (96, unrotated.clone(), "head_dim 64, 128 or 256"),
        (128, fp8_opts(Fp8Scaling::PerBlock { rows: 32 }), "64 rows"),
        (128, block.clone().alibi_slopes(vec![0.5; 4]), "ALiBi"),
    ] {
        let e = choose_in(FAMILIES, h200, &problem(DType::BF16, d, &opts), Variant::Fa3).unwrap_err();
        assert!(
            matches!(&e, Error::VariantUnavailable { variant: Variant::Fa3, reason } if reason.contains("fa3fp8s5") && reason.contains(why)),
            "hd{d}: {e:?}"
        );
    }
    // head_dim 64 and 256 (SW64 e4m3 tiles; 64-key tiles at 256) run on their own tiles, every rung.
    for d in [64, 256] {
        let c = choose_in(FAMILIES, h200, &problem(DType::BF16, d, &block), Variant::Fa3).unwrap();
        assert_eq!((c.family.name, c.tile.head_dim as usize), ("fa3fp8s5", d));
        for (stage, name) in [(3, "fa3fp8s3"), (4, "fa3fp8s4")] {
            let o = fp8_opts(Fp8Scaling::PerTensor).variant(Variant::Fa3).fa3_stage(stage);
            let c = choose_in(FAMILIES, h200, &problem(DType::BF16, d, &o), Variant::Fa3).unwrap();
            assert_eq!((c.family.name, c.tile.head_dim as usize), (name, d));
        }
    }
    // head_dim past the instances, and an Ampere GPU: the table's own refusals.
    let e = choose_in(FAMILIES, h200, &problem(DType::BF16, 512, &block), Variant::Fa3).unwrap_err();
    assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("head_dim up to")), "{e:?}");
    let a100 = &FA2_GPUS[0].0;
    let e = choose_in(FAMILIES, a100, &problem(DType::BF16, 128, &block), Variant::Fa3).unwrap_err();
    assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("sm_90")), "{e:?}");
}

/// FA4's softmax on the FA2 / FA3 pipelines (docs/fa4.md "Part 1") in the real
/// table: `Variant::Fa4` without `fa4_stage` runs the FA3-pipeline row on sm_90a, the
/// FA2-pipeline row on sm_80, sm_120 (PTX) and sm_100 (where the tcgen05 stages need
/// `fa4_stage`); the reason names the pipeline and the knobs; Auto never picks them.
#[test]
fn fa4_softmax_runs_on_the_fa2_and_fa3_pipelines() {
    let fa4 = |gpu: &Built, d: usize, opts: ForwardOptions| {
        choose_in(FAMILIES, gpu, &problem(DType::BF16, d, &opts.variant(Variant::Fa4)), Variant::Fa4)
    };
    let b200 = Built(FakeGpu { cc: (10, 0), smem: 227 * 1024 });
    let rtx5090 = Built(FakeGpu { cc: (12, 0), smem: 99 * 1024 });
    let (a100, rtx3090, h200) = (&FA2_GPUS[0].0, &FA2_GPUS[1].0, &FA2_GPUS[3].0);
    for d in [64, 128] {
        for (gpu, name, target, pipeline) in [
            (a100, "fa4_fa2", Target::Sm80, "FA2 pipeline"),
            (rtx3090, "fa4_fa2", Target::Sm80, "FA2 pipeline"),
            (h200, "fa4_fa3s5", Target::Sm90a, "FA3 pipeline (wgmma, TMA, warp specialisation) at stage 5"),
            (&b200, "fa4_fa2", Target::Sm100a, "FA2 pipeline"),
            (&rtx5090, "fa4_fa2", Target::Ptx80, "FA2 pipeline"),
        ] {
            let c = fa4(gpu, d, ForwardOptions::default().causal(true)).unwrap();
            assert_eq!((c.family.name, c.tile.head_dim as usize, c.image.target), (name, d, target), "sm_{}", gpu.sm());
            let why = reason_in(FAMILIES, gpu, &c, Variant::Fa4);
            assert!(
                why.contains(pipeline)
                    && why.contains("degree-3 software exp2 for 1 element in 8, lazy rescale, tau 8")
                    && why.contains("tcgen05 stages run only when fa4_stage names one")
                    && why.contains("not yet verified"),
                "{why}"
            );
            // Auto never picks a row of FA4's softmax (none is verified on a GPU).
            let auto = choose_in(FAMILIES, gpu, &problem(DType::BF16, d, &ForwardOptions::default()), Variant::Auto);
            assert!(!auto.unwrap().family.name.starts_with("fa4"));
        }
    }
    // fa4_stage names a tcgen05 rung only: on sm_100 it runs; on sm_90 it is refused (the FA3
    // pipeline row is not a rung of that ladder).
    let c = fa4(&b200, 128, ForwardOptions::default().fa4_stage(3)).unwrap();
    assert_eq!(c.family.name, "fa4s3");
    let e = fa4(h200, 128, ForwardOptions::default().fa4_stage(3)).unwrap_err();
    assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("fa4s3") && reason.contains("sm_100")), "{e:?}");
    // FA4's head dims only; ALiBi runs on the FA2 pipeline (the FA3 one refuses it), on sm_90a
    // too (its sm_90a SASS).
    let e = fa4(a100, 96, ForwardOptions::default()).unwrap_err();
    assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("fa4_fa2") && reason.contains("exact head dims")), "{e:?}");
    let c = fa4(h200, 128, ForwardOptions::default().alibi_slopes(vec![0.5; 4])).unwrap();
    assert_eq!((c.family.name, c.image.target), ("fa4_fa2", Target::Sm90a));
    // On sm_100 every tcgen05 stage refuses without fa4_stage and the FA2 pipeline refuses
    // hd 96: the error names both reasons.
    let e = fa4(&b200, 96, ForwardOptions::default()).unwrap_err();
    assert!(
        matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("FA4 needs fa4_stage") && reason.contains("exact head dims")),
        "{e:?}"
    );
}

/// The benchmark's sweep (share 0 / 1 in 8 / 1 in 4 x tau 0 / 8) on sm_90a: `fa4_exp2_share`
/// and `Rescale::Lazy { threshold }` name one row; (0, 0) is fa3s5 itself (Variant::Fa3).
#[test]
fn fa4_softmax_sweep_rows_are_reached_by_their_knobs() {
    use crate::options::Rescale;
    let h200 = &FA2_GPUS[3].0;
    let fa4 = |share: Option<u32>, tau: Option<f32>| {
        let mut o = ForwardOptions::default().variant(Variant::Fa4);
        if let Some(n) = share {
            o = o.fa4_exp2_share(n);
        }
        if let Some(threshold) = tau {
            o = o.rescale(Rescale::Lazy { threshold });
        }
        choose_in(FAMILIES, h200, &problem(DType::BF16, 128, &o), Variant::Fa4)
    };
    for (share, tau, name) in [
        (None, None, "fa4_fa3s5"),
        (Some(8), Some(8.0), "fa4_fa3s5"),
        (Some(8), None, "fa4_fa3s5"),
        (Some(0), Some(8.0), "fa4_fa3s5_p0t8"),
        (Some(8), Some(0.0), "fa4_fa3s5_p8t0"),
        (Some(4), Some(0.0), "fa4_fa3s5_p4t0"),
        (Some(4), Some(8.0), "fa4_fa3s5_p4t8"),
    ] {
        let c = fa4(share, tau).unwrap_or_else(|e| panic!("{share:?} {tau:?}: {e:?}"));
        assert_eq!(c.family.name, name, "{share:?} {tau:?}");
        let s = c.family.softmax;
        assert_eq!((s.poly_every, s.lazy_tau), (share.unwrap_or(8), tau.unwrap_or(8.0)), "{name}");
    }
    // A share or tau no row has is refused, naming what the best row implements.
    let e = fa4(Some(0), Some(0.0)).unwrap_err();
    assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("share of 1 element in 8, not none")), "{e:?}");
    let e = fa4(Some(16), None).unwrap_err();
    assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("not 1 element in 16")), "{e:?}");
    // hd 64 has only the default row.
    let o = ForwardOptions::default().variant(Variant::Fa4).fa4_exp2_share(4);
    assert!(choose_in(FAMILIES, h200, &problem(DType::BF16, 64, &o), Variant::Fa4).is_err());
    // The option needs Variant::Fa4.
    let check = |o: ForwardOptions| Problem::from_shapes([1, 8, 1, 128], [1, 8, 1, 128], [1, 8, 1, 128], DType::BF16, &o);
    let e = check(ForwardOptions::default().variant(Variant::Fa3).fa4_exp2_share(8)).unwrap_err();
    assert!(matches!(e, Error::InvalidOption { option: "fa4_exp2_share", .. }), "{e:?}");
}

/// Attention sinks run on the families whose rows have `SINKS` (FA1, FA2, every 16-bit FA3
/// stage, every FA4 row: its tcgen05 stages and FA4's softmax in the FA2 / FA3 pipelines): Auto
/// picks what it picks without sinks, on every GPU of the real table; an explicit FA1 / FA2 /
/// FA3 (any `fa3_stage`) / FA4 (any `fa4_stage`) runs them. A sinks list of only −inf is no sink.
#[test]
fn sinks_run_on_every_family_but_fp8() {
    let blackwell = Built(FakeGpu { cc: (10, 0), smem: 227 * 1024 });
    let opts = ForwardOptions::default().sinks(vec![0.5f32, -1.0, 2.0, f32::NEG_INFINITY]);
    for gpu in FA2_GPUS.iter().map(|(g, _)| g).chain([&blackwell]) {
        for dtype in [DType::F16, DType::BF16] {
            let p = problem(dtype, 128, &opts);
            let plain = choose_in(FAMILIES, gpu, &problem(dtype, 128, &ForwardOptions::default()), Variant::Auto).unwrap();
            let auto = choose_in(FAMILIES, gpu, &p, Variant::Auto).unwrap();
            assert_eq!(auto.family.name, plain.family.name, "sm_{}", gpu.sm());
            for variant in [Variant::Fa1, Variant::Fa2] {
                let c = choose_in(FAMILIES, gpu, &p, variant).unwrap();
                assert!(c.family.options.contains(KernelOptions::SINKS), "{}", c.family.name);
            }
            match choose_in(FAMILIES, gpu, &p, Variant::Fa3) {
                Ok(c) => assert_eq!((gpu.sm(), c.family.name), (90, "fa3s5")),
                Err(e) => assert_ne!(gpu.sm(), 90, "{e:?}"),
            }
            let c = choose_in(FAMILIES, gpu, &p, Variant::Fa4).unwrap();
            assert!(c.family.options.contains(KernelOptions::SINKS), "{}", c.family.name);
        }
        let none = ForwardOptions::default().sinks(vec![f32::NEG_INFINITY; 4]);
        assert!(choose_in(FAMILIES, gpu, &problem(DType::BF16, 128, &none), Variant::Auto).is_ok());
    }
    let hopper = &FA2_GPUS[3].0;
    for stage in 1..=5u8 {
        let o = opts.clone().variant(Variant::Fa3).fa3_stage(stage);
        let c = choose_in(FAMILIES, hopper, &problem(DType::BF16, 128, &o), Variant::Fa3).unwrap();
        assert_eq!(c.family.stage, Some(stage));
    }
    for stage in 1..=3u8 {
        let o = opts.clone().variant(Variant::Fa4).fa4_stage(stage);
        let c = choose_in(FAMILIES, &blackwell, &problem(DType::BF16, 128, &o), Variant::Fa4).unwrap();
        assert_eq!(c.family.name, format!("fa4s{stage}"));
    }
}

/// A V head_dim different from Q/K's runs on FA2's fa2v row at MLA's pairs (192, 128) and
/// (576, 512), under `Auto` and `Variant::Fa2`, on every GPU of the real table, and on FA3 stage
/// 5's (192, 128) instance with `Variant::Fa3` on sm_90a; FA1 and FA4 refuse it. Any other pair is
/// refused by every variant, FA2's error naming the pairs that run, and `Auto` finds no kernel (so
/// `Backend::Auto` runs the call on the CPU); equal head dims still pick a kernel. Sinks run on
/// fa2v too.
#[test]
fn a_v_head_dim_unlike_qk_runs_on_fa2v_at_the_mla_pairs_only() {
    let blackwell = Built(FakeGpu { cc: (10, 0), smem: 227 * 1024 });
    let opts = ForwardOptions::default();
    let mla = |d: usize, dv: usize| Problem::from_shapes([1, 100, 4, d], [1, 100, 2, d], [1, 100, 2, dv], DType::BF16, &opts).unwrap();
    for gpu in FA2_GPUS.iter().map(|(g, _)| g).chain([&blackwell]) {
        for (d, dv) in [(192, 128), (576, 512)] {
            let p = mla(d, dv);
            for variant in [Variant::Auto, Variant::Fa2] {
                let c = choose_in(FAMILIES, gpu, &p, variant).unwrap();
                assert_eq!((c.family.name, c.tile.head_dim, c.tile.head_dim_v), ("fa2v", d as u32, dv as u32));
            }
            match choose_in(FAMILIES, gpu, &p, Variant::Fa3) {
                Ok(c) => assert_eq!((gpu.sm(), (d, dv), c.family.name, c.tile.head_dim_v), (90, (192, 128), "fa3s5", 128)),
                Err(e) => {
                    assert!(matches!(&e, Error::VariantUnavailable { .. }), "sm_{} Fa3: {e:?}", gpu.sm());
                    assert!(!(gpu.sm() == 90 && (d, dv) == (192, 128)), "{e:?}");
                }
            }
            for variant in [Variant::Fa1, Variant::Fa4] {
                let e = choose_in(FAMILIES, gpu, &p, variant).unwrap_err();
                assert!(matches!(&e, Error::VariantUnavailable { .. }), "sm_{} {variant:?}: {e:?}", gpu.sm());
            }
        }
        for (d, dv) in [(128, 64), (64, 128), (192, 64)] {
            let p = mla(d, dv);
            let e = choose_in(FAMILIES, gpu, &p, Variant::Auto).unwrap_err();
            assert!(matches!(&e, Error::BackendUnavailable { reason, .. } if reason.contains("head_dim_v")), "{e:?}");
            let e = choose_in(FAMILIES, gpu, &p, Variant::Fa2).unwrap_err();
            assert!(matches!(&e, Error::VariantUnavailable { reason, .. } if reason.contains("(192, 128), (576, 512)")), "{e:?}");
            for variant in [Variant::Fa1, Variant::Fa3, Variant::Fa4] {
                let e = choose_in(FAMILIES, gpu, &p, variant).unwrap_err();
                assert!(matches!(&e, Error::VariantUnavailable { .. }), "sm_{} {variant:?}: {e:?}", gpu.sm());
            }
        }
        let c = choose_in(FAMILIES, gpu, &problem(DType::BF16, 192, &opts), Variant::Auto).unwrap();
        assert_ne!(c.family.name, "fa2v", "equal head dims run on their own rows");
        // With sinks too (the row's epilogue is fa2's).
        let sinks = ForwardOptions::default().sinks(vec![0.5, -1.0, 2.0, f32::NEG_INFINITY]);
        let p = Problem::from_shapes([1, 1, 4, 576], [1, 100, 2, 576], [1, 100, 2, 512], DType::BF16, &sinks).unwrap();
        assert_eq!(choose_in(FAMILIES, gpu, &p, Variant::Auto).unwrap().family.name, "fa2v");
    }
}

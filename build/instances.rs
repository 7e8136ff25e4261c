// THE table of CUDA kernel instances. `include!`d by build.rs (which compiles exactly these
// instances) and by src/cuda/table.rs (from which the crate picks among exactly these
// instances), so the list of kernels exists once. Plain data, const fns and string building
// only: it must compile in both crates.
//
// A family is one `.cu` file under cuda/. The build generates one compile unit per
// (family, head_dim) (`unit_source` below): it `#define`s FA_STAGE, FA_HEAD_DIM, FA_BLOCK_M,
// FA_BLOCK_N, FA_THREADS and FA_SMEM_BYTES from the family's row, `#include`s the family's source
// and then writes `FA_INSTANCE(f16)` and `FA_INSTANCE(bf16)`. The source's `FA_INSTANCE(DT)`
// macro must define the kernel
// `extern "C" __global__ void <family>_fwd_hd<FA_HEAD_DIM>_<DT>(const __grid_constant__ FwdParams)`,
// the name `kernel_symbol` below gives.
//
// Options that do not change the hot loop (causal/window, softcap, ALiBi, LSE) are run-time
// parameters (FwdParams), so instances are templated on (dtype, head_dim) only.
//
// To add a family: add one `Family` row here, its kernel file under cuda/, and (for a new
// `Pipeline`) its host module under src/cuda/ implementing `FamilyHost`, mapped from the
// pipeline in src/cuda/hosts.rs. docs/cuda.md, "Adding a family".

/// A compile target of nvcc.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// SASS for sm_80 (runs on every 8.x GPU: SASS is compatible within a major version).
    Sm80,
    /// SASS for sm_90a (only CC 9.0: the `a` features — wgmma, setmaxnreg — are not forward compatible).
    Sm90a,
    /// SASS for sm_100a (only CC 10.0).
    Sm100a,
    /// compute_80 PTX, JIT-compiled by the driver on any GPU with no matching SASS (CC 9.x without
    /// an sm_90a image, 10.x other than 10.0, 12.x, ...).
    Ptx80,
}

impl Target {
    /// Every target, in build order.
    pub const ALL: [Target; 4] = [Target::Sm80, Target::Sm90a, Target::Sm100a, Target::Ptx80];

    /// The short name used in file names and in FLASH_ATTN_ARCHS ("80", "90a", "100a", "ptx").
    pub const fn name(self) -> &'static str {
        match self {
            Target::Sm80 => "80",
            Target::Sm90a => "90a",
            Target::Sm100a => "100a",
            Target::Ptx80 => "ptx",
        }
    }

    /// The file extension of the image: SASS cubins or PTX text.
    pub const fn ext(self) -> &'static str {
        match self {
            Target::Ptx80 => "ptx",
            _ => "cubin",
        }
    }

    /// nvcc's arguments that select this target.
    pub const fn nvcc_args(self) -> &'static [&'static str] {
        match self {
            Target::Sm80 => &["-cubin", "-gencode=arch=compute_80,code=sm_80"],
            Target::Sm90a => &["-cubin", "-gencode=arch=compute_90a,code=sm_90a"],
            Target::Sm100a => &["-cubin", "-gencode=arch=compute_100a,code=sm_100a"],
            Target::Ptx80 => &["-ptx", "-arch=compute_80"],
        }
    }

    /// Whether a GPU of compute capability (major, minor) can load this image directly (SASS)
    /// or by JIT (PTX).
    pub const fn runs_on(self, major: i32, minor: i32) -> bool {
        match self {
            Target::Sm80 => major == 8,
            Target::Sm90a => major == 9 && minor == 0,
            Target::Sm100a => major == 10 && minor == 0,
            Target::Ptx80 => major >= 8,
        }
    }
}

/// Element types of the instances. The name is the suffix of the kernel symbol.
pub const DTYPE_NAMES: [&str; 2] = ["f16", "bf16"];

/// The tile of one (family, head_dim) instance. The build passes it to the kernel as
/// FA_BLOCK_M / FA_BLOCK_N / FA_THREADS, and the host launches with it, so both sides agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    /// The head dim of the instance: any head_dim up to it runs on it (the tail is masked).
    pub head_dim: u32,
    /// V's (and O's) head dim: `head_dim` but in a row with `KernelOptions::HEAD_DIM_V`, whose
    /// unit gets it as FA_HEAD_DIM_V.
    pub head_dim_v: u32,
    /// Query rows per thread block.
    pub block_m: u32,
    /// Keys per main-loop iteration.
    pub block_n: u32,
    /// Threads per block.
    pub threads: u32,
}

/// The algorithm a family implements. `Variant` (src/options.rs) names the same algorithms
/// plus `Auto`; the one conversion between them is in src/cuda/table.rs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelVariant {
    Fa1,
    Fa2,
    Fa3,
    Fa4,
}

/// The pipeline a row's kernel runs: the kernel source it compiles and, in the crate, the host
/// rules its launches follow (`FamilyHost`, mapped in src/cuda/hosts.rs). The row names it as
/// data, so the table depends on no module of the crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pipeline {
    /// FA1 on CUDA cores.
    Fa1,
    /// FA2: mma.sync, a cp.async ring.
    Fa2,
    /// FA3 on Hopper: wgmma, TMA, warp specialisation.
    Fa3,
    /// FA3's pipeline on e4m3 codes, with the bf16/f16 -> e4m3 pre-pass in its image.
    Fa3Fp8,
    /// FA4 on Blackwell: tcgen05, tensor memory.
    Fa4,
}

impl Pipeline {
    /// The kernel source, relative to the crate root.
    pub const fn source(self) -> &'static str {
        match self {
            Pipeline::Fa1 => "cuda/fa1_fwd.cu",
            Pipeline::Fa2 => "cuda/fa2_fwd.cu",
            Pipeline::Fa3 => "cuda/fa3_fwd_sm90.cu",
            Pipeline::Fa3Fp8 => "cuda/fa3_fp8_fwd_sm90.cu",
            Pipeline::Fa4 => "cuda/fa4_fwd_sm100.cu",
        }
    }

    /// What the pipeline is, for `Dispatch::reason`.
    pub const fn describe(self) -> &'static str {
        match self {
            Pipeline::Fa1 => "the FA1 pipeline (CUDA cores)",
            Pipeline::Fa2 => "the FA2 pipeline (mma.sync, cp.async ring)",
            Pipeline::Fa3 | Pipeline::Fa3Fp8 => "the FA3 pipeline (wgmma, TMA, warp specialisation)",
            Pipeline::Fa4 => "the FA4 pipeline (tcgen05, tensor memory)",
        }
    }
}

/// Options beyond the plain forward that a family implements (a set). A problem asking for one
/// its family lacks does not run on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KernelOptions(u8);

impl KernelOptions {
    pub const NONE: KernelOptions = KernelOptions(0);
    /// Q, K, V (and P) in e4m3 with per-block scales.
    pub const FP8: KernelOptions = KernelOptions(1);
    /// FA4's polynomial exp2.
    pub const EXP2_POLY: KernelOptions = KernelOptions(2);
    /// FA4's conditional (lazy) rescaling.
    pub const LAZY_RESCALE: KernelOptions = KernelOptions(4);
    /// Attention sinks (`ForwardOptions::sinks`): a logit per query head in the softmax
    /// denominator (`FwdParams::sinks`, folded by the epilogue, or by the combine kernel after
    /// split-KV). The FA1, FA2 and FA3 (stages 1-5) rows have it.
    pub const SINKS: KernelOptions = KernelOptions(8);
    /// A V head_dim different from Q/K's (DeepSeek's MLA): the row's tiles carry their
    /// `head_dim_v`, and a problem runs on a tile of its exact pair (the fa2v row: (192, 128) and
    /// (576, 512); FA3 stage 5: (192, 128)). Every other family refuses such a problem
    /// (`Variant::Auto` runs it on the CPU).
    pub const HEAD_DIM_V: KernelOptions = KernelOptions(16);
    /// Every option with the name errors and docs use.
    pub const NAMED: [(KernelOptions, &'static str); 5] = [
        (Self::FP8, "fp8"),
        (Self::EXP2_POLY, "exp2_poly"),
        (Self::LAZY_RESCALE, "lazy_rescale"),
        (Self::SINKS, "sinks"),
        (Self::HEAD_DIM_V, "head_dim_v != head_dim"),
    ];

    pub const fn union(self, other: KernelOptions) -> KernelOptions {
        KernelOptions(self.0 | other.0)
    }

    pub const fn contains(self, other: KernelOptions) -> bool {
        self.0 & other.0 == other.0
    }

    /// The name of the first option of `needed` this set lacks.
    pub fn first_missing(self, needed: KernelOptions) -> Option<&'static str> {
        Self::NAMED.iter().find(|(o, _)| needed.contains(*o) && !self.contains(*o)).map(|(_, name)| *name)
    }
}

/// The parameters of FA4's softmax in a row that implements `EXP2_POLY` / `LAZY_RESCALE`
/// (`SoftmaxParams::NONE` elsewhere). The build passes them to the kernel as
/// FA_EXP2_POLY_DEGREE / FA_EXP2_POLY_EVERY (rows with `EXP2_POLY`) and FA_LAZY_TAU (rows with
/// `LAZY_RESCALE`); a problem that asks for `Exp2::Poly(d)` or `Rescale::Lazy { threshold }`
/// runs only on a row with that degree / threshold (src/cuda/select.rs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoftmaxParams {
    /// Degree of the software exp2 polynomial (cuda/common/exp2_poly.cuh); 0: none.
    pub poly_degree: u8,
    /// The share of the software exp2: one element in `poly_every` of a tile takes the
    /// polynomial (FMA units), the rest MUFU.EX2; 0: none.
    pub poly_every: u32,
    /// The lazy-rescaling threshold, log2 units: the running max is kept unless a tile's max
    /// exceeds it by more; negative: none (rescale whenever the max grows).
    pub lazy_tau: f32,
}

impl SoftmaxParams {
    /// Exact MUFU exp2, rescale whenever the max grows (every family but FA4 stage 3).
    pub const NONE: SoftmaxParams = SoftmaxParams { poly_degree: 0, poly_every: 0, lazy_tau: -1.0 };
}

/// One kernel family: one source file and the head dims it is instantiated for.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    /// "fa1", "fa2", "fa3s1", ...: the prefix of file names and kernel symbols.
    pub name: &'static str,
    /// The algorithm this family implements.
    pub variant: KernelVariant,
    /// The rung of a ladder of families of one variant (FA3 stages 1..=5), `None` for a single
    /// family. The build passes it to the kernel as FA_STAGE (0 for `None`).
    pub stage: Option<u8>,
    /// The pipeline its kernel runs: its source ([`Family::source`]) and host rules. Rows of one
    /// pipeline share its source; the row's stage, tiles and options tell their units apart.
    pub pipeline: Pipeline,
    /// One row per instantiated head dim, ascending.
    pub tiles: &'static [Tile],
    /// Lowest compute capability (major * 10 + minor) it runs on.
    pub min_sm: u32,
    /// Whether this family's GPU run was verified (scripts/check/gpu.sh passed on a GPU). Shown
    /// in `Dispatch::reason`.
    pub gpu_verified: bool,
    /// Whether `Variant::Auto` may pick it. A new fast family stays `false` until verified on a
    /// GPU (e.g. FA3 on Hopper: Auto keeps FA2 there until then); an explicit variant still runs it.
    pub auto: bool,
    /// SASS opcodes the family claims to use, checked in every built cubin by tests/toolchain/sass.rs
    /// (e.g. FA1 "FFMA"; FA2 "HMMA", "LDSM"; FA3 "HGMMA").
    pub sass_expect: &'static [&'static str],
    /// Options beyond the plain forward that the family implements.
    pub options: KernelOptions,
    /// The parameters of the softmax options it implements (`SoftmaxParams::NONE`: none).
    pub softmax: SoftmaxParams,
    /// Auto preference: higher wins among the families that can run a problem.
    pub rank: u32,
    /// The test of the emulator's `forward` module (`fp8` for an FP8 family: tests/emulator/) that
    /// runs this family's kernel source, unchanged, in the CPU emulator (cuda/test/emu,
    /// docs/emulator.md); `None` for a family the emulator cannot run yet
    /// (tests/emulator/forward/emulator.rs requires every row to name its test).
    pub cpu_emulation: Option<&'static str>,
    /// Dynamic shared memory of a tile's launch, in bytes, given the row's stage (use
    /// [`Family::smem_bytes`]). The build passes it to the kernel as FA_SMEM_BYTES, which
    /// static_asserts it against its own layout; the host launches with it.
    pub smem: fn(Option<u8>, &Tile) -> u32,
}

impl Family {
    /// The kernel source, relative to the crate root: its pipeline's.
    pub const fn source(&self) -> &'static str {
        self.pipeline.source()
    }

    /// Dynamic shared memory of a launch of `tile`, in bytes.
    pub fn smem_bytes(&self, tile: &Tile) -> u32 {
        (self.smem)(self.stage, tile)
    }

    /// The rung of its variant's ladder that `fa3_stage` / `fa4_stage` name: `stage`, except
    /// for the FA4-softmax rows on the FA2 / FA3 pipelines (variant Fa4, another pipeline), whose
    /// `stage` is the FA3 stage they compile (FA_STAGE), not a rung of the tcgen05 ladder.
    pub fn ladder_stage(&self) -> Option<u8> {
        match self.variant {
            KernelVariant::Fa4 if self.pipeline != Pipeline::Fa4 => None,
            _ => self.stage,
        }
    }
}

/// The targets a source is compiled for, from its file name: `*_sm90.cu` only for sm_90a,
/// `*_sm100.cu` only for sm_100a, anything else for sm_80, sm_90a, sm_100a and compute_80 PTX.
pub fn targets_for(source: &str) -> &'static [Target] {
    if source.ends_with("_sm90.cu") {
        &[Target::Sm90a]
    } else if source.ends_with("_sm100.cu") {
        &[Target::Sm100a]
    } else {
        &Target::ALL
    }
}

/// The kernel symbol of (family, head_dim, dtype name).
pub fn kernel_symbol(family: &str, head_dim: u32, dtype: &str) -> String {
    format!("{family}_fwd_hd{head_dim}_{dtype}")
}

/// The stem of the image of (family, head_dim) for a target, e.g. "fa1_hd128.90a".
pub fn image_stem(family: &str, head_dim: u32, target: Target) -> String {
    format!("{family}_hd{head_dim}.{}", target.name())
}

/// The compile unit of (family, tile): the row as macros, optionally the hang-check define (in
/// the text, so anything keyed on the unit tells the two builds apart), the family's source at
/// `source_path`, then one instance per dtype. build.rs compiles it with nvcc; the emulator
/// (tests/support/emu/build.rs) and tests/emulator/hang_check.rs compile the same text.
pub fn unit_source(fam: &Family, tile: &Tile, source_path: &str, hang_check: bool) -> String {
    let mut s = format!("// Generated from build/instances.rs: {} head_dim {}.\n", fam.name, tile.head_dim);
    let mut defines = vec![
        // The family's name as a bare token, and its ladder stage (0: not a ladder).
        ("FA_FAMILY", fam.name.to_string()),
        ("FA_STAGE", fam.stage.unwrap_or(0).to_string()),
        ("FA_HEAD_DIM", tile.head_dim.to_string()),
        ("FA_BLOCK_M", tile.block_m.to_string()),
        ("FA_BLOCK_N", tile.block_n.to_string()),
        ("FA_THREADS", tile.threads.to_string()),
        ("FA_SMEM_BYTES", fam.smem_bytes(tile).to_string()),
    ];
    // V's head dim, only in the units of a row whose V head dim differs (the others' text, and
    // so their cached images, stay as they are).
    if tile.head_dim_v != tile.head_dim {
        defines.push(("FA_HEAD_DIM_V", tile.head_dim_v.to_string()));
    }
    // FA4's softmax parameters, only in the units of rows that implement them.
    if fam.options.contains(KernelOptions::EXP2_POLY) {
        defines.push(("FA_EXP2_POLY_DEGREE", fam.softmax.poly_degree.to_string()));
        defines.push(("FA_EXP2_POLY_EVERY", fam.softmax.poly_every.to_string()));
    }
    if fam.options.contains(KernelOptions::LAZY_RESCALE) {
        defines.push(("FA_LAZY_TAU", format!("{:?}f", fam.softmax.lazy_tau)));
    }
    // The serving KV append kernel, in one family's images only (never built twice).
    if fam.name == APPEND_KV_FAMILY {
        defines.push(("FA_WITH_APPEND_KV", "1".to_string()));
    }
    for (name, value) in defines {
        s += &format!("#define {name} {value}\n");
    }
    if hang_check {
        s += "#define FA_HANG_CHECK 1\n";
    }
    s += &format!("#include \"{source_path}\"\n");
    for dt in DTYPE_NAMES {
        s += &format!("FA_INSTANCE({dt})\n");
    }
    s
}

/// FA1's shared memory: f32 tiles of Q (block_m rows) and K (block_n rows), each row padded by
/// one float, V (block_n rows) and P (block_m rows of block_n + 1). Mirrors cuda/fa1_fwd.cu.
fn fa1_smem_bytes(_stage: Option<u8>, t: &Tile) -> u32 {
    let floats = t.block_m * (t.head_dim + 1) + t.block_n * (t.head_dim + 1) + t.block_n * t.head_dim + t.block_m * (t.block_n + 1);
    floats * 4
}

/// FA1 threads: 8 lanes share a query row (each owns every 8th column), 16 row groups.
const FA1_THREADS: u32 = 128;

/// FA2's shared memory: Q (block_m rows, reused to stage O) plus a two-stage ring of K and V
/// tiles (block_n rows each; V's rows head_dim_v wide), f16/bf16 rows padded by 8 elements (16
/// bytes) so ldmatrix is bank-conflict free. Mirrors `Fa2Traits::kSmemBytes` in cuda/fa2/traits.cuh.
fn fa2_smem_bytes(_stage: Option<u8>, t: &Tile) -> u32 {
    const STAGES: u32 = 2;
    const PAD: u32 = 8;
    const ELEM_BYTES: u32 = 2;
    ((t.block_m + STAGES * t.block_n) * (t.head_dim + PAD) + STAGES * t.block_n * (t.head_dim_v + PAD)) * ELEM_BYTES
}

/// FA2 threads: 4 warps, for every head dim (split-Q; at hd 512 two row groups x two column halves).
const FA2_THREADS: u32 = 128;

/// The highest stage of the FA3 ladder (docs/fa3.md).
pub const FA3_MAX_STAGE: u8 = 5;

/// FA3: one warpgroup (128 threads) issues each wgmma; stages 1-2 run one consumer warpgroup,
/// stages 3-5 a producer warpgroup plus two consumers.
const FA3_WARPGROUP: u32 = 128;
/// FA3 query rows per consumer warpgroup (the M of wgmma m64nNk16).
const FA3_ROWS_PER_CONSUMER: u32 = 64;
/// FA3 dynamic shared memory slack: the kernel rounds its base up to a 1024-byte swizzle atom.
const FA3_SMEM_SLACK: u32 = 1024;
/// FA3 mbarriers are 8 bytes.
const FA3_MBARRIER_BYTES: u32 = 8;

/// DeepSeek MLA prefill's (Q/K, V) head dims: the FA3 pipeline's head_dim-192 tile is built for
/// V head_dim 128 (`FA_HEAD_DIM_V`), the one FA3 instance whose V head dim differs from Q/K's.
pub const FA3_MLA_PREFILL: (u32, u32) = (192, 128);

/// V's head dim in the FA3 pipeline's instance of Q/K head dim `head_dim`.
pub const fn fa3_head_dim_v(head_dim: u32) -> u32 {
    if head_dim == FA3_MLA_PREFILL.0 {
        FA3_MLA_PREFILL.1
    } else {
        head_dim
    }
}

/// The FA3 tile of (stage, head_dim): 64 query rows per consumer warpgroup; 128 keys per K/V
/// tile up to V head_dim 128 (with (192, 128) too: Q/K's head dim only lengthens the QK^T
/// reduction), 64 at 256 (the O accumulator then takes 128 registers).
const fn fa3_tile(stage: u8, head_dim: u32) -> Tile {
    let consumers = if stage >= 3 { 2 } else { 1 };
    let producers = if stage >= 3 { 1 } else { 0 };
    Tile {
        head_dim,
        head_dim_v: fa3_head_dim_v(head_dim),
        block_m: FA3_ROWS_PER_CONSUMER * consumers,
        block_n: if fa3_head_dim_v(head_dim) <= 128 { 128 } else { 64 },
        threads: FA3_WARPGROUP * (consumers + producers),
    }
}

/// FA3 shared memory of a stage's tile: Q (block_m rows), a K and a V ring of `slots` tiles
/// (1 in stage 1, 2 from stage 2; V's rows of the tile's `head_dim_v`), the mbarriers (stages 2-3: q_full + kv_full/kv_empty per
/// slot; stages 4-5: q_full, q_empty + k_full/v_full/k_empty/v_empty per slot; stage 1 still
/// reserves the stage-2/3 set: the traits share one layout), the FP8 cache's scale slots of the
/// instances that serve the batch layouts (stages 3-5 at V head_dim <= 128: 2 * slots of a K and
/// a V f32 per key, from a 16-byte boundary) and the alignment slack. Mirrors `Fa3Traits::kSmemBytes`
/// (cuda/fa3/traits.cuh), which the kernel static_asserts equal to FA_SMEM_BYTES.
fn fa3_smem_bytes(stage: Option<u8>, t: &Tile) -> u32 {
    let stage = stage.unwrap_or(1);
    let elem = 2; // f16 / bf16
    let slots = if stage >= 2 { 2 } else { 1 };
    let barriers = if stage >= 4 { 2 + 4 * slots } else { 1 + 2 * slots };
    let kv_row = t.head_dim + t.head_dim_v;
    let (barrier_bytes, scales) = if stage >= 3 && t.head_dim_v <= 128 {
        // The scale slots start at a 16-byte boundary after the barriers.
        ((FA3_MBARRIER_BYTES * barriers).next_multiple_of(16), 2 * slots * 2 * t.block_n * 4)
    } else {
        (FA3_MBARRIER_BYTES * barriers, 0)
    };
    t.block_m * t.head_dim * elem + slots * t.block_n * kv_row * elem + barrier_bytes + scales + FA3_SMEM_SLACK
}

/// One row of the FA3 ladder: cuda/fa3_fwd_sm90.cu (sm_90a only, by its file name) for head
/// dims 64/128/256, and at stage 5 DeepSeek MLA prefill's (192, 128) (`FA3_MLA_PREFILL`: the row
/// then has `HEAD_DIM_V`). Not `gpu_verified` and not `auto` until a stage passes scripts/check/gpu.sh
/// on a GPU (docs/fa3.md has the status). Ranked above FA1 and FA2, higher stages higher, so an
/// explicit `Variant::Fa3` takes the highest stage.
const fn fa3_family(
    name: &'static str,
    stage: u8,
    cpu_emulation: &'static str,
    sass_expect: &'static [&'static str],
    tiles: &'static [Tile],
) -> Family {
    Family {
        name,
        variant: KernelVariant::Fa3,
        stage: Some(stage),
        pipeline: Pipeline::Fa3,
        tiles,
        min_sm: 90,
        gpu_verified: false,
        auto: false,
        sass_expect,
        options: if has_tile(tiles, FA3_MLA_PREFILL.0) {
            KernelOptions::SINKS.union(KernelOptions::HEAD_DIM_V)
        } else {
            KernelOptions::SINKS
        },
        softmax: SoftmaxParams::NONE,
        rank: 30 + stage as u32,
        cpu_emulation: Some(cpu_emulation),
        smem: fa3_smem_bytes,
    }
}
const FA3_S1_TILES: &[Tile] = &[fa3_tile(1, 64), fa3_tile(1, 128), fa3_tile(1, 256)];
const FA3_S2_TILES: &[Tile] = &[fa3_tile(2, 64), fa3_tile(2, 128), fa3_tile(2, 256)];
const FA3_S345_TILES: &[Tile] = &[fa3_tile(3, 64), fa3_tile(3, 128), fa3_tile(3, 256)];
/// Stage 5 (what `Variant::Fa3` runs) adds MLA prefill's (192, 128).
const FA3_S5_TILES: &[Tile] = &[fa3_tile(5, 64), fa3_tile(5, 128), fa3_tile(5, 192), fa3_tile(5, 256)];
/// Whether `tiles` has an instance of `head_dim`.
const fn has_tile(tiles: &[Tile], head_dim: u32) -> bool {
    let mut i = 0;
    while i < tiles.len() {
        if tiles[i].head_dim == head_dim {
            return true;
        }
        i += 1;
    }
    false
}
/// SASS of the warp-specialised stages: wgmma, TMA, mbarriers, setmaxnreg.
const FA3_WS_SASS: &[&str] = &["HGMMA", "UTMALDG", "SYNCS", "USETMAXREG"];

/// The FP8 consumer's tiles at stages 3-5 (cuda/fa3_fp8_fwd_sm90.cu, `Fp8Traits<S, D>`): two
/// consumer warpgroups of 64 query rows and a producer; 128 keys per K/Vᵀ tile, 64 at head_dim
/// 256 (128-key tiles spill there: O alone is 128 f32 registers).
const FA3_FP8_TILES: &[Tile] = &[
    Tile { head_dim: 64, head_dim_v: 64, block_m: 128, block_n: 128, threads: 384 },
    Tile { head_dim: 128, head_dim_v: 128, block_m: 128, block_n: 128, threads: 384 },
    Tile { head_dim: 256, head_dim_v: 256, block_m: 128, block_n: 64, threads: 384 },
];

/// The FP8 consumer's shared memory (stages 3-5): e4m3 (1-byte) Q of the CTA's rows, a 2-slot
/// K / Vᵀ ring, the mbarriers (stage 3: q_full, kv_full and kv_empty per slot; stages 4-5: q_full,
/// k_full, v_full, k_empty, v_empty per slot, q_empty) and the alignment slack. Mirrors
/// `Fp8Traits<S, D>::kSmemBytes`, which the unit static_asserts equal to FA_SMEM_BYTES.
fn fa3_fp8_smem_bytes(stage: Option<u8>, t: &Tile) -> u32 {
    const SLOTS: u32 = 2;
    let barriers = if stage.unwrap_or(3) >= 4 { 2 + 4 * SLOTS } else { 1 + 2 * SLOTS };
    t.block_m * t.head_dim + 2 * SLOTS * t.block_n * t.head_dim + FA3_MBARRIER_BYTES * barriers + FA3_SMEM_SLACK
}

/// One row of the FP8 ladder (docs/fp8.md, "On Hopper"): the FP8 consumer of `stage` (e4m3
/// wgmma, TMA ring, warp specialisation; 4: + ping-pong and intra-warpgroup overlap; 5: + the
/// persistent grid) and, in the same image, its bf16/f16 -> e4m3 pre-pass. It runs only
/// `Precision::Fp8` problems (src/cuda/select.rs) and never ran on a GPU, so Auto leaves it
/// alone; `Variant::Fa3` with `Precision::Fp8` runs the highest stage, `fa3_stage` picks another.
const fn fa3_fp8_family(name: &'static str, stage: u8) -> Family {
    Family {
        name,
        variant: KernelVariant::Fa3,
        stage: Some(stage),
        pipeline: Pipeline::Fa3Fp8,
        tiles: FA3_FP8_TILES,
        min_sm: 90,
        gpu_verified: false,
        auto: false,
        // QGMMA: e4m3 wgmma; the rest as the 16-bit stages 3-5 (checked on the forward kernels;
        // the pre-pass in the same image is checked for spills and local memory only).
        sass_expect: &["QGMMA", "UTMALDG", "SYNCS", "USETMAXREG"],
        options: KernelOptions::FP8,
        softmax: SoftmaxParams::NONE,
        rank: 37 + stage as u32,
        cpu_emulation: Some(if stage == 3 { "fp8_consumer_matches_cpu_fp8_path" } else { "fp8_consumer_stages_4_5" }),
        smem: fa3_fp8_smem_bytes,
    }
}

/// The FP8 pre-pass kernel a family with the `FP8` option carries in its image beside its
/// forward kernels (cuda/fp8_prepass.cu): `fa_fp8_prepass_e<E>_<dtype>`, E = elements per lane,
/// head_dim <= 32·E.
pub fn fp8_prepass_symbol(head_dim: u32, dtype: &str) -> String {
    let e = head_dim.div_ceil(32).max(1).next_power_of_two();
    format!("fa_fp8_prepass_e{e}_{dtype}")
}

/// SASS opcodes the FP8 pre-pass claims (tests/toolchain/sass.rs): the saturating e4m3 conversion and
/// the cross-lane butterfly of the Hadamard rotation.
pub const FP8_PREPASS_SASS: &[&str] = &["F2FP.SATFINITE.E4M3", "SHFL.BFLY"];

/// Every kernel the image of (family, head_dim) holds for `dtype`: the forward kernel, then (an
/// FP8 family) its pre-pass.
pub fn image_kernel_symbols(fam: &Family, head_dim: u32, dtype: &str) -> Vec<String> {
    let mut v = vec![kernel_symbol(fam.name, head_dim, dtype)];
    if fam.options.contains(KernelOptions::FP8) {
        v.push(fp8_prepass_symbol(head_dim, dtype));
    }
    if fam.name == APPEND_KV_FAMILY {
        v.push(append_kv_symbol(head_dim, dtype));
    }
    v
}

/// The family whose images carry the serving KV append kernel (cuda/common/append_kv.cuh): FA2,
/// whose sm_80 SASS and compute_80 PTX load on every GPU the crate runs on, so every family's
/// append runs this one.
pub const APPEND_KV_FAMILY: &str = "fa2";

/// The KV append kernel of (head_dim unit, dtype) in the `APPEND_KV_FAMILY` images. It copies
/// `FwdParams::head_dim` elements per row, so any unit serves any head dim.
pub fn append_kv_symbol(head_dim: u32, dtype: &str) -> String {
    format!("fa_append_kv_hd{head_dim}_{dtype}")
}

/// What the append kernel's SASS must contain (tests/toolchain/sass.rs): global loads and stores of the
/// rows it copies (none of its family's tensor-core instructions).
pub const APPEND_KV_SASS: &[&str] = &["LDG", "STG"];

/// A standalone kernel: one source compiled once per target (`targets_for` its name), with no
/// head-dim instances and no `FA_INSTANCE` (the source defines its own kernels, by name); its
/// images carry head_dim [`STANDALONE_HEAD_DIM`]. The split-KV combine and the device
/// `merge_states` are one (cuda/combine.cu, src/cuda/combine.rs).
#[derive(Clone, Copy, Debug)]
pub struct Standalone {
    /// The image's name ("combine"), as `Family::name` for the families' images.
    pub name: &'static str,
    /// The source, relative to the crate root.
    pub source: &'static str,
    /// Every kernel symbol the image holds (checked by tests/toolchain/sass.rs).
    pub kernels: &'static [&'static str],
    /// SASS opcodes every kernel of it claims (tests/toolchain/sass.rs).
    pub sass_expect: &'static [&'static str],
    /// The test that runs its source, unchanged, in the CPU emulator.
    pub cpu_emulation: &'static str,
}

/// The head_dim a standalone kernel's image is recorded with (it serves every head_dim).
pub const STANDALONE_HEAD_DIM: u32 = 0;

/// The compile unit of a standalone kernel: its source at `source_path`, nothing else.
pub fn standalone_unit_source(s: &Standalone, source_path: &str) -> String {
    format!("// Generated from build/instances.rs: standalone {}.\n#include \"{source_path}\"\n", s.name)
}

/// The standalone kernels.
pub const STANDALONE: &[Standalone] = &[Standalone {
    name: "combine",
    source: "cuda/combine.cu",
    // fa_combine_<input>_<output>: f32 partials into every output dtype, 16-bit states into
    // their own (src/cuda/combine.rs picks one).
    kernels: &["fa_combine_f32_f32", "fa_combine_f32_f16", "fa_combine_f32_bf16", "fa_combine_f16_f16", "fa_combine_bf16_bf16"],
    // expf (MUFU.EX2 after its range reduction) and the weighted sum (FFMA); logf is a
    // polynomial in FFMAs, no MUFU.LG2.
    sass_expect: &["MUFU.EX2", "FFMA"],
    cpu_emulation: "combine_matches_host_merge",
}, Standalone {
    name: "fa2_bwd",
    source: "cuda/fa2_bwd.cu",
    // The FA2 backward (docs/fa2-backward.md, src/cuda/fa2_bwd.rs plans the three launches):
    // fa2_bwd_preprocess_<dt> (D = rowsum(dO o O)), fa2_bwd_hd<D>_<dt> (the main kernel),
    // fa2_bwd_convert_dq_<dt>, and fa2_bwd_sink_grad (the attention sinks' gradient, any
    // dtype). Ran in the emulator and compile-checked only.
    kernels: &[
        "fa2_bwd_preprocess_f16", "fa2_bwd_convert_dq_f16", "fa2_bwd_hd32_f16", "fa2_bwd_hd64_f16", "fa2_bwd_hd96_f16",
        "fa2_bwd_hd128_f16", "fa2_bwd_hd192_f16", "fa2_bwd_hd256_f16",
        "fa2_bwd_preprocess_bf16", "fa2_bwd_convert_dq_bf16", "fa2_bwd_hd32_bf16", "fa2_bwd_hd64_bf16", "fa2_bwd_hd96_bf16",
        "fa2_bwd_hd128_bf16", "fa2_bwd_hd192_bf16", "fa2_bwd_hd256_bf16", "fa2_bwd_sink_grad",
    ],
    // Every kernel reads and writes global rows; the main kernels' tensor-core and ldmatrix
    // instructions are checked by tests/toolchain/sass.rs `fa2_backward_uses_mma_and_ldmatrix`.
    sass_expect: &["LDG", "STG"],
    cpu_emulation: "fa2_backward_matches_f64_reference",
}, Standalone {
    name: "fa3_bwd",
    source: "cuda/fa3_bwd_sm90.cu",
    // The FA3-style backward main kernel (sm_90a: TMA, mbarrier ring, wgmma, warp-specialised),
    // launched between fa2_bwd's preprocess and dq conversion (docs/fa3.md, "Backward"). Ran in
    // the emulator and compile-checked only.
    kernels: &["fa3_bwd_hd64_f16", "fa3_bwd_hd64_bf16", "fa3_bwd_hd128_f16", "fa3_bwd_hd128_bf16"],
    sass_expect: &["HGMMA", "UTMALDG"],
    cpu_emulation: "fa3_backward_matches_f64_reference",
}];

/// Whether `Variant::Auto` may pick a backward kernel (the "fa2_bwd" and "fa3_bwd" rows) on the
/// GPU, as `Family::auto` does for a forward family: `false` until a GPU run of
/// tests/gpu/backward.rs (scripts/check/gpu.sh) verifies them. Until then an explicit
/// `Variant::Fa2` / `Variant::Fa3` reaches them and `Variant::Auto` runs the CPU backward.
pub const BACKWARD_AUTO: bool = false;

/// The highest stage of the FA4 ladder built so far (docs/fa4.md).
pub const FA4_MAX_STAGE: u8 = 3;

/// FA4 (Blackwell tcgen05) rows per TMEM lane: the M of one cta_group::1 MMA, the query rows of
/// one Q tile, and the keys of one K/V tile.
const FA4_TILE_ROWS: u32 = 128;
/// FA4 dynamic shared memory slack: the kernel rounds its base up to a 1024-byte swizzle atom.
const FA4_SMEM_SLACK: u32 = 1024;

/// The FA4 tile of a stage: 128 query rows (one Q tile; stage 3 takes two, ping-pong) and 128
/// keys per tile; stage 1 runs one warpgroup, stages 2-3 four (two softmax, correction,
/// load/MMA warps). Mirrors `Fa4Traits` (cuda/fa4_fwd_sm100.cu).
const fn fa4_tile(stage: u8, head_dim: u32) -> Tile {
    Tile {
        head_dim,
        head_dim_v: head_dim,
        block_m: if stage >= 3 { 2 * FA4_TILE_ROWS } else { FA4_TILE_ROWS },
        block_n: FA4_TILE_ROWS,
        threads: if stage == 1 { 128 } else { 512 },
    }
}

/// FA4 shared memory of a stage's tile (16-bit tiles; mbarriers are 8 bytes, the TMEM address
/// word 8, the f32 exchange buffers one float per row of a 128-row Q tile):
/// - stage 1: Q, K, V, P, four mbarriers (q_full, kv_full, s_full, o_full);
/// - stage 2: Q, a 2-slot K/V ring, 14 mbarriers, the softmax/correction exchange (partial maxima
///   [2][2], factors [2], partial sums [2], max); P lives in tensor memory;
/// - stage 3: two Q tiles, the 2-slot K/V ring, 16 mbarriers, factors, partial sums and maxima
///   per Q tile.
///
/// Mirrors `Fa4Traits<S, D>::kSmemBytes`, which the kernel static_asserts equal to FA_SMEM_BYTES.
fn fa4_smem_bytes(stage: Option<u8>, t: &Tile) -> u32 {
    let elem = 2;
    let q = t.block_m * t.head_dim * elem;
    let kv_tile = t.block_n * t.head_dim * elem;
    let row_f32 = FA4_TILE_ROWS * 4;
    let tmem_addr = 8;
    match stage.unwrap_or(1) {
        1 => q + 2 * kv_tile + t.block_m * t.block_n * elem + 8 * 4 + tmem_addr + FA4_SMEM_SLACK,
        2 => q + 4 * kv_tile + 8 * 14 + tmem_addr + (4 + 2 + 2 + 1) * row_f32 + FA4_SMEM_SLACK,
        _ => q + 4 * kv_tile + 8 * 16 + tmem_addr + 3 * 2 * row_f32 + FA4_SMEM_SLACK,
    }
}

/// One row of the FA4 ladder: cuda/fa4_fwd_sm100.cu (sm_100a only, by its file name) for head
/// dims 64/128. No Blackwell GPU has run it: not `gpu_verified`, never `auto`, and an explicit
/// `Variant::Fa4` runs a stage only when `fa4_stage` names it (src/cuda/select.rs). Every stage
/// uses tcgen05.mma into tensor memory (UTCHMMA), tcgen05.ld/st (LDTM/STTM), TMA (UTMALDG) and
/// mbarriers (SYNCS).
const fn fa4_family(
    name: &'static str,
    stage: u8,
    cpu_emulation: &'static str,
    sass_expect: &'static [&'static str],
    options: KernelOptions,
    tiles: &'static [Tile],
) -> Family {
    Family {
        name,
        variant: KernelVariant::Fa4,
        stage: Some(stage),
        pipeline: Pipeline::Fa4,
        tiles,
        min_sm: 100,
        gpu_verified: false,
        auto: false,
        sass_expect,
        options,
        softmax: if options.contains(KernelOptions::EXP2_POLY) || options.contains(KernelOptions::LAZY_RESCALE) {
            FA4_SOFTMAX
        } else {
            SoftmaxParams::NONE
        },
        rank: 40 + stage as u32,
        cpu_emulation: Some(cpu_emulation),
        smem: fa4_smem_bytes,
    }
}
const FA4_S1_TILES: &[Tile] = &[fa4_tile(1, 64), fa4_tile(1, 128)];
const FA4_S2_TILES: &[Tile] = &[fa4_tile(2, 64), fa4_tile(2, 128)];
const FA4_S3_TILES: &[Tile] = &[fa4_tile(3, 64), fa4_tile(3, 128)];
/// FA4's softmax (stage 3; docs/fa4.md): the degree-3 software exp2 for one element in 8
/// (12.5% of the exponentials on the FMA units), lazy rescaling with tau = 8 (log2 units, a
/// factor of 256).
const FA4_SOFTMAX: SoftmaxParams = SoftmaxParams { poly_degree: 3, poly_every: 8, lazy_tau: 8.0 };
/// The options of a stage that runs FA4's softmax.
const FA4_SOFTMAX_OPTIONS: KernelOptions = KernelOptions::EXP2_POLY.union(KernelOptions::LAZY_RESCALE);
const FA4_SASS: &[&str] = &["UTCHMMA", "LDTM", "STTM", "UTMALDG", "SYNCS"];
/// Stage 3 adds the FMA-pipe exp2 (FFMA next to MUFU.EX2).
const FA4_S3_SASS: &[&str] = &["UTCHMMA", "LDTM", "STTM", "UTMALDG", "SYNCS", "MUFU.EX2", "FFMA"];

/// FA4's softmax (docs/fa4.md "Part 1") in an existing pipeline: the share of
/// the software exp2 (`poly_every`) and the lazy threshold (`lazy_tau`) are the row's parameters,
/// passed to the unit as FA_EXP2_POLY_EVERY / FA_EXP2_POLY_DEGREE / FA_LAZY_TAU (the kernel's
/// `FaRowPolicy`, cuda/common/softmax.cuh); the options follow from them (a share of 0 has no
/// EXP2_POLY, a negative tau no LAZY_RESCALE).
const fn fa4_softmax_options(s: SoftmaxParams) -> KernelOptions {
    let poly = if s.poly_every > 0 { KernelOptions::EXP2_POLY } else { KernelOptions::NONE };
    let lazy = if s.lazy_tau >= 0.0 { KernelOptions::LAZY_RESCALE } else { KernelOptions::NONE };
    poly.union(lazy)
}

/// FA4's softmax in the FA2 pipeline (cuda/fa2_fwd.cu, FA2's tiles, its epilogue's sink fold
/// included): `Variant::Fa4` on sm_80,
/// sm_120 (PTX) and, without `fa4_stage`, on sm_100 (the tcgen05 stages need it). Ranked below
/// the FA3-pipeline rows, so sm_90a takes those.
const fn fa4_fa2_family(name: &'static str, softmax: SoftmaxParams, cpu_emulation: &'static str, tiles: &'static [Tile]) -> Family {
    Family {
        name,
        variant: KernelVariant::Fa4,
        stage: None,
        pipeline: Pipeline::Fa2,
        tiles,
        min_sm: 80,
        gpu_verified: false,
        auto: false,
        sass_expect: FA4_FA2_SASS,
        options: fa4_softmax_options(softmax).union(KernelOptions::SINKS),
        softmax,
        rank: 36,
        cpu_emulation: Some(cpu_emulation),
        smem: fa2_smem_bytes,
    }
}

/// FA4's softmax in the FA3 pipeline at its top stage (cuda/fa3_fwd_sm90.cu stage 5: TMA ring,
/// warp specialisation, ping-pong, intra-warpgroup overlap, persistent grid, the shared epilogue's
/// sink fold): `Variant::Fa4` on
/// sm_90a. `rank` 38 for the default row, 37 for the benchmark's sweep rows (which a problem
/// reaches by naming their share / tau: src/cuda/select.rs).
const fn fa4_fa3_family(
    name: &'static str,
    softmax: SoftmaxParams,
    rank: u32,
    cpu_emulation: &'static str,
    tiles: &'static [Tile],
) -> Family {
    Family {
        name,
        variant: KernelVariant::Fa4,
        stage: Some(FA4_FA3_STAGE),
        pipeline: Pipeline::Fa3,
        tiles,
        min_sm: 90,
        gpu_verified: false,
        auto: false,
        sass_expect: FA4_FA3_SASS,
        options: fa4_softmax_options(softmax).union(KernelOptions::SINKS),
        softmax,
        rank,
        cpu_emulation: Some(cpu_emulation),
        smem: fa3_smem_bytes,
    }
}
/// The FA3 stage the FA4-softmax rows run (the top of the ladder, what `Variant::Fa3` runs).
pub const FA4_FA3_STAGE: u8 = 5;
/// Head dims of the FA4-softmax rows in the FA2 / FA3 pipelines: FlashAttention-4's (64, 128).
const FA4_FA2_TILES: &[Tile] = &[
    Tile { head_dim: 64, head_dim_v: 64, block_m: 128, block_n: 64, threads: FA2_THREADS },
    Tile { head_dim: 128, head_dim_v: 128, block_m: 128, block_n: 32, threads: FA2_THREADS },
];
const FA4_FA3_TILES: &[Tile] = &[fa3_tile(FA4_FA3_STAGE, 64), fa3_tile(FA4_FA3_STAGE, 128)];
/// The benchmark's sweep rows: head dim 128 only (the H200 comparison beside FA3, docs/fa4.md).
const FA4_FA3_SWEEP_TILES: &[Tile] = &[fa3_tile(FA4_FA3_STAGE, 128)];
/// The software exp2 (FFMA) beside MUFU.EX2 in the FA2 / FA3 pipelines (tests/toolchain/sass.rs also
/// compares the MUFU.EX2 count with the pipeline's own row).
const FA4_FA2_SASS: &[&str] = &["HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS", "MUFU.EX2", "FFMA"];
const FA4_FA3_SASS: &[&str] = &["HGMMA", "UTMALDG", "SYNCS", "USETMAXREG", "MUFU.EX2", "FFMA"];
/// FA4's softmax with a share of one element in `every` (0: none) and threshold `tau` (log2
/// units; negative: eager), the degree-3 polynomial.
const fn fa4_softmax(every: u32, tau: f32) -> SoftmaxParams {
    SoftmaxParams { poly_degree: if every > 0 { 3 } else { 0 }, poly_every: every, lazy_tau: tau }
}

/// The families.
pub const FAMILIES: &[Family] = &[
    Family {
        name: "fa1",
        variant: KernelVariant::Fa1,
        stage: None,
        pipeline: Pipeline::Fa1,
        // Tiles sized so Q, K, V and P (f32 in shared memory) stay under 99 KB, the opt-in limit of
        // sm_86/sm_89, and the per-thread f32 accumulator stays at most 64 registers.
        tiles: &[
            Tile { head_dim: 32, head_dim_v: 32, block_m: 64, block_n: 64, threads: FA1_THREADS },
            Tile { head_dim: 64, head_dim_v: 64, block_m: 64, block_n: 64, threads: FA1_THREADS },
            Tile { head_dim: 96, head_dim_v: 96, block_m: 64, block_n: 32, threads: FA1_THREADS },
            Tile { head_dim: 128, head_dim_v: 128, block_m: 64, block_n: 32, threads: FA1_THREADS },
            Tile { head_dim: 192, head_dim_v: 192, block_m: 32, block_n: 32, threads: FA1_THREADS },
            Tile { head_dim: 256, head_dim_v: 256, block_m: 32, block_n: 16, threads: FA1_THREADS },
        ],
        min_sm: 80,
        // Set once scripts/check/gpu.sh passes on a GPU (docs/cuda.md has the status).
        gpu_verified: false,
        // The fallback of last resort: Auto may always pick it.
        auto: true,
        sass_expect: &["FFMA", "MUFU.EX2"],
        options: KernelOptions::SINKS,
        softmax: SoftmaxParams::NONE,
        rank: 1,
        cpu_emulation: Some("fa1_all_instances"),
        smem: fa1_smem_bytes,
    },
    Family {
        name: "fa2",
        variant: KernelVariant::Fa2,
        stage: None,
        pipeline: Pipeline::Fa2,
        // Mirrors fa2::Fa2Traits<D> (the unit static_asserts it). 128 rows = 4 warps x 2 m16 tiles
        // up to hd 128 (each K/V fragment feeds two mma); hd 128 takes 32-key tiles (64 spilled at
        // 255 registers); hd 192/256 take 64x32 (4 warps x 1 m-tile) to fit 99 KB with the K/V ring;
        // hd 512 splits O's columns over two warps per 16 rows (docs/fa2.md "Head dim 512").
        // The kernel runs only its exact head dims (no tail masking, 16-byte row chunks): its host
        // module refuses the rest (src/cuda/fa2.rs).
        tiles: &[
            Tile { head_dim: 32, head_dim_v: 32, block_m: 128, block_n: 64, threads: FA2_THREADS },
            Tile { head_dim: 64, head_dim_v: 64, block_m: 128, block_n: 64, threads: FA2_THREADS },
            Tile { head_dim: 96, head_dim_v: 96, block_m: 128, block_n: 64, threads: FA2_THREADS },
            Tile { head_dim: 128, head_dim_v: 128, block_m: 128, block_n: 32, threads: FA2_THREADS },
            Tile { head_dim: 192, head_dim_v: 192, block_m: 64, block_n: 32, threads: FA2_THREADS },
            Tile { head_dim: 256, head_dim_v: 256, block_m: 64, block_n: 32, threads: FA2_THREADS },
            // 2 row groups x 2 column halves of O (Fa2Traits kColSplit): 99840 B, every sm_80+ part.
            Tile { head_dim: 512, head_dim_v: 512, block_m: 32, block_n: 16, threads: FA2_THREADS },
        ],
        min_sm: 80,
        // Set once scripts/check/gpu.sh passes on a GPU (docs/fa2.md has the status).
        gpu_verified: false,
        // Auto picks it over FA1 wherever it runs the problem (sm_80+, and Hopper until FA3 is verified).
        auto: true,
        // Tensor-core mma.sync, ldmatrix (and its .trans form for V), cp.async global->shared.
        sass_expect: &["HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS"],
        options: KernelOptions::SINKS,
        softmax: SoftmaxParams::NONE,
        rank: 2,
        cpu_emulation: Some("fa2_all_instances"),
        smem: fa2_smem_bytes,
    },
    // The FA3 ladder (docs/fa3.md): stage N adds one Hopper mechanism to stage N-1.
    // 1 wgmma; 2 + TMA/mbarrier ring; 3 + warp specialisation (setmaxnreg); 4 + ping-pong and
    // intra-warpgroup overlap; 5 + persistent grid (min(SMs, tiles) CTAs).
    fa3_family("fa3s1", 1, "fa3_stage1", &["HGMMA"], FA3_S1_TILES),
    fa3_family("fa3s2", 2, "fa3_stage2", &["HGMMA", "UTMALDG", "SYNCS"], FA3_S2_TILES),
    fa3_family("fa3s3", 3, "fa3_stage3", FA3_WS_SASS, FA3_S345_TILES),
    fa3_family("fa3s4", 4, "fa3_stage4", FA3_WS_SASS, FA3_S345_TILES),
    fa3_family("fa3s5", 5, "fa3_stage5", FA3_WS_SASS, FA3_S5_TILES),
    // The FP8 forward (docs/fp8.md, "On Hopper"): the FP8 consumer at stages 3-5 of the FA3
    // ladder, each image with its bf16/f16 -> e4m3 pre-pass (fa3_fp8_family).
    fa3_fp8_family("fa3fp8s3", 3),
    fa3_fp8_family("fa3fp8s4", 4),
    fa3_fp8_family("fa3fp8s5", 5),
    // The FA4 ladder (docs/fa4.md), Blackwell tcgen05. 1 tcgen05.mma into tensor memory, one
    // warpgroup; 2 + FA4's warp roles (load warp, MMA warp, two softmax warpgroups, a correction
    // warpgroup), P in tensor memory (A operand from TMEM); 3 + two Q tiles in ping-pong and
    // FA4's softmax: the degree-3 software exp2 (exp2_poly.cuh) for 1 element in 8, conditional
    // rescaling with tau = 8 (common/softmax.cuh). Every stage folds attention sinks in its
    // epilogue (fa_softmax_finalize_sink).
    fa4_family("fa4s1", 1, "fa4_stage1", FA4_SASS, KernelOptions::SINKS, FA4_S1_TILES),
    fa4_family("fa4s2", 2, "fa4_stage2", FA4_SASS, KernelOptions::SINKS, FA4_S2_TILES),
    fa4_family("fa4s3", 3, "fa4_stage3", FA4_S3_SASS, FA4_SOFTMAX_OPTIONS.union(KernelOptions::SINKS), FA4_S3_TILES),
    // FA4's softmax in the FA2 and FA3 pipelines (docs/fa4.md "Part 1"): the
    // default rows (1 element in 8 on the FMA units, tau = 8, FA4_SOFTMAX), then the benchmark's
    // sweep of the share (0, 1 in 8, 1 in 4) x tau (0, 8) in the FA3 pipeline at head dim 128
    // (`_p<every>t<tau>`). Two points need no row: (1 in 8, 8) is the default row, and (0, 0) is
    // fa3s5 itself (tau = 0 keeps the max only when it did not grow, and the factor of a growth
    // is the same MUFU exp2 of the same product: the same numbers as the eager rescale).
    fa4_fa2_family("fa4_fa2", FA4_SOFTMAX, "fa4_softmax_fa2", FA4_FA2_TILES),
    fa4_fa3_family("fa4_fa3s5", FA4_SOFTMAX, 38, "fa4_softmax_fa3", FA4_FA3_TILES),
    fa4_fa3_family("fa4_fa3s5_p0t8", fa4_softmax(0, 8.0), 37, "fa4_softmax_sweep", FA4_FA3_SWEEP_TILES),
    fa4_fa3_family("fa4_fa3s5_p8t0", fa4_softmax(8, 0.0), 37, "fa4_softmax_sweep", FA4_FA3_SWEEP_TILES),
    fa4_fa3_family("fa4_fa3s5_p4t0", fa4_softmax(4, 0.0), 37, "fa4_softmax_sweep", FA4_FA3_SWEEP_TILES),
    fa4_fa3_family("fa4_fa3s5_p4t8", fa4_softmax(4, 8.0), 37, "fa4_softmax_sweep", FA4_FA3_SWEEP_TILES),
    // FA2 with V's head dim below Q/K's (DeepSeek's MLA, docs/fa2.md "V's head dim"): the
    // prefill pair on hd 192's tile, the absorbed decode pair (576, 512) with 16 rows per CTA and
    // O's columns split over the 4 warps (89344 B: every sm_80+ part). Each tile runs its exact
    // pair only (src/cuda/fa2.rs); its units define FA_HEAD_DIM_V.
    Family {
        name: "fa2v",
        variant: KernelVariant::Fa2,
        stage: None,
        pipeline: Pipeline::Fa2,
        tiles: &[
            Tile { head_dim: 192, head_dim_v: 128, block_m: 64, block_n: 32, threads: FA2_THREADS },
            Tile { head_dim: 576, head_dim_v: 512, block_m: 16, block_n: 16, threads: FA2_THREADS },
        ],
        min_sm: 80,
        gpu_verified: false,
        // As the fa2 row: Auto runs the pairs on it wherever FA2 runs.
        auto: true,
        sass_expect: &["HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS"],
        options: KernelOptions::SINKS.union(KernelOptions::HEAD_DIM_V),
        softmax: SoftmaxParams::NONE,
        rank: 2,
        cpu_emulation: Some("fa2v_pairs"),
        smem: fa2_smem_bytes,
    },
];

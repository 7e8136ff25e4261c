// THE table of CUDA kernel instances. `include!`d by build.rs (which compiles exactly these
// instances) and by src/cuda/dispatch.rs (which picks among exactly these instances), so the
// list of kernels exists once. Plain data and const fns only: it must compile in both crates.
//
// A family is one `.cu` file under cuda/. The build generates one compile unit per
// (family, head_dim): it `#define`s FA_HEAD_DIM, FA_BLOCK_M, FA_BLOCK_N and FA_THREADS from the
// family's `tiles` row, `#include`s the family's source and then writes `FA_INSTANCE(f16)` and
// `FA_INSTANCE(bf16)`. The source's `FA_INSTANCE(DT)` macro must define the kernel
// `extern "C" __global__ void <family>_fwd_hd<FA_HEAD_DIM>_<DT>(const __grid_constant__ FwdParams)`,
// the name `kernel_symbol` below gives.
//
// Options that do not change the hot loop (causal/window, softcap, ALiBi, LSE) are run-time
// parameters (FwdParams), so instances are templated on (dtype, head_dim) only.
//
// To add a family: add one `Family` row (and its host module under src/cuda/), nothing else.

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
    /// Query rows per thread block.
    pub block_m: u32,
    /// Keys per main-loop iteration.
    pub block_n: u32,
    /// Threads per block.
    pub threads: u32,
}

/// One kernel family: one source file and the head dims it is instantiated for.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    /// "fa1", "fa2", ...: the prefix of file names and kernel symbols.
    pub name: &'static str,
    /// The `Variant` this family implements, by name ("Fa1", ...).
    pub variant: &'static str,
    /// The source, relative to the crate root.
    pub source: &'static str,
    /// One row per instantiated head dim, ascending.
    pub tiles: &'static [Tile],
    /// Lowest compute capability (major * 10 + minor) it runs on.
    pub min_sm: u32,
    /// Whether this family's GPU run was verified (scripts/gpu-check.sh passed on a GPU). Shown
    /// in `Dispatch::reason`.
    pub gpu_verified: bool,
    /// Whether `Variant::Auto` may pick it. A new fast family stays `false` until verified on a
    /// GPU (e.g. FA3 on Hopper: Auto keeps FA2 there until then); an explicit variant still runs it.
    pub auto: bool,
    /// SASS opcodes the family claims to use, checked in every built cubin by tests/sass.rs
    /// (e.g. FA1 "FFMA"; an FA2 row would say "HMMA", "LDSM"; FA3 "HGMMA").
    pub sass_expect: &'static [&'static str],
    /// Options beyond the plain forward that the family implements: "fp8", "exp2_poly",
    /// "lazy_rescale". A problem asking for one it lacks does not run on it.
    pub options: &'static [&'static str],
    /// Auto preference: higher wins among the families that can run a problem.
    pub rank: u32,
    /// The test of tests/emulator.rs that runs this family's kernel source, unchanged, in the
    /// CPU emulator (cuda/test/emu, docs/emulator.md); `None` for a family the emulator cannot
    /// run yet (tests/emulator.rs requires every row to name its test).
    pub cpu_emulation: Option<&'static str>,
    /// Dynamic shared memory of a tile's launch, in bytes. The build passes it to the kernel as
    /// FA_SMEM_BYTES, which static_asserts it against its own layout; the host launches with it.
    pub smem_bytes: fn(&Tile) -> u32,
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

/// FA1's shared memory: f32 tiles of Q (block_m rows) and K (block_n rows), each row padded by
/// one float, V (block_n rows) and P (block_m rows of block_n + 1). Mirrors cuda/fa1_fwd.cu.
fn fa1_smem_bytes(t: &Tile) -> u32 {
    let floats = t.block_m * (t.head_dim + 1) + t.block_n * (t.head_dim + 1) + t.block_n * t.head_dim + t.block_m * (t.block_n + 1);
    floats * 4
}

/// FA1 threads: 8 lanes share a query row (each owns every 8th column), 16 row groups.
const FA1_THREADS: u32 = 128;

/// FA2's shared memory: Q (block_m rows, reused to stage O) plus a two-stage ring of K and V
/// tiles (block_n rows each), f16/bf16 rows padded by 8 elements (16 bytes) so ldmatrix is
/// bank-conflict free. Mirrors `Fa2Traits::kSmemBytes` in cuda/include/fa2_traits.cuh.
fn fa2_smem_bytes(t: &Tile) -> u32 {
    const STAGES: u32 = 2;
    const PAD: u32 = 8;
    const ELEM_BYTES: u32 = 2;
    (t.block_m + 2 * STAGES * t.block_n) * (t.head_dim + PAD) * ELEM_BYTES
}

/// FA2 threads: 4 warps split the query rows (split-Q), for every head dim.
const FA2_THREADS: u32 = 128;


/// The stage of an FA3 ladder family ("fa3s1" .. "fa3s5" -> 1 .. 5); `None` for every other
/// family. The family name is the single record of the stage: cuda/fa3_fwd_sm90.cu reads it
/// from the FA_FAMILY token build.rs defines, the host (src/cuda/fa3.rs) from the name.
pub fn fa3_stage(family: &str) -> Option<u32> {
    let stage: u32 = family.strip_prefix("fa3s")?.parse().ok()?;
    (1..=FA3_MAX_STAGE).contains(&stage).then_some(stage)
}

/// The highest stage of the FA3 ladder (docs/fa3.md).
pub const FA3_MAX_STAGE: u32 = 5;

/// FA3: one warpgroup (128 threads) issues each wgmma; stages 1-2 run one consumer warpgroup,
/// stages 3-5 a producer warpgroup plus two consumers.
const FA3_WARPGROUP: u32 = 128;
/// FA3 query rows per consumer warpgroup (the M of wgmma m64nNk16).
const FA3_ROWS_PER_CONSUMER: u32 = 64;
/// FA3 dynamic shared memory slack: the kernel rounds its base up to a 1024-byte swizzle atom.
const FA3_SMEM_SLACK: u32 = 1024;
/// FA3 mbarriers are 8 bytes.
const FA3_MBARRIER_BYTES: u32 = 8;

/// The FA3 tile of (stage, head_dim): 64 query rows per consumer warpgroup; 128 keys per K/V
/// tile up to head_dim 128, 64 at 256 (the O accumulator then takes 128 registers).
const fn fa3_tile(stage: u32, head_dim: u32) -> Tile {
    let consumers = if stage >= 3 { 2 } else { 1 };
    let producers = if stage >= 3 { 1 } else { 0 };
    Tile {
        head_dim,
        block_m: FA3_ROWS_PER_CONSUMER * consumers,
        block_n: if head_dim <= 128 { 128 } else { 64 },
        threads: FA3_WARPGROUP * (consumers + producers),
    }
}

/// FA3 shared memory of a stage's tile: Q (block_m rows), a K and a V ring of `slots` tiles
/// (1 in stage 1, 2 from stage 2), the mbarriers (stages 2-3: q_full + kv_full/kv_empty per
/// slot; stages 4-5: q_full, q_empty + k_full/v_full/k_empty/v_empty per slot; stage 1 still
/// reserves the stage-2/3 set: the traits share one layout) and the alignment slack. Mirrors
/// `Fa3Traits::kSmemBytes` (cuda/include/fa3_traits.cuh), which the kernel static_asserts
/// equal to FA_SMEM_BYTES.
const fn fa3_smem(stage: u32, t: &Tile) -> u32 {
    let elem = 2; // f16 / bf16
    let slots = if stage >= 2 { 2 } else { 1 };
    let barriers = if stage >= 4 { 2 + 4 * slots } else { 1 + 2 * slots };
    t.block_m * t.head_dim * elem + 2 * slots * t.block_n * t.head_dim * elem + FA3_MBARRIER_BYTES * barriers + FA3_SMEM_SLACK
}
fn fa3s1_smem(t: &Tile) -> u32 {
    fa3_smem(1, t)
}
fn fa3s2_smem(t: &Tile) -> u32 {
    fa3_smem(2, t)
}
fn fa3s3_smem(t: &Tile) -> u32 {
    fa3_smem(3, t)
}
fn fa3s4_smem(t: &Tile) -> u32 {
    fa3_smem(4, t)
}
fn fa3s5_smem(t: &Tile) -> u32 {
    fa3_smem(5, t)
}

/// One row of the FA3 ladder: cuda/fa3_fwd_sm90.cu (sm_90a only, by its file name) for head
/// dims 64/128/256. No stage has run on a GPU yet: not `gpu_verified`, and not `auto` (Auto
/// keeps FA2/FA1 on Hopper until a stage passes scripts/gpu-check.sh there). Ranked above FA1
/// and FA2, higher stages higher, so an explicit `Variant::Fa3` takes the highest stage.
const fn fa3_family(
    name: &'static str,
    stage: u32,
    cpu_emulation: Option<&'static str>,
    sass_expect: &'static [&'static str],
    tiles: &'static [Tile],
    smem_bytes: fn(&Tile) -> u32,
) -> Family {
    Family {
        name,
        variant: "Fa3",
        source: "cuda/fa3_fwd_sm90.cu",
        tiles,
        min_sm: 90,
        gpu_verified: false,
        auto: false,
        sass_expect,
        options: &[],
        rank: 30 + stage,
        cpu_emulation,
        smem_bytes,
    }
}
const FA3_S1_TILES: &[Tile] = &[fa3_tile(1, 64), fa3_tile(1, 128), fa3_tile(1, 256)];
const FA3_S2_TILES: &[Tile] = &[fa3_tile(2, 64), fa3_tile(2, 128), fa3_tile(2, 256)];
const FA3_S345_TILES: &[Tile] = &[fa3_tile(3, 64), fa3_tile(3, 128), fa3_tile(3, 256)];

/// The stage of an FA4 (tcgen05, sm_100a) ladder family ("fa4s1" .. -> 1 ..); `None` for every
/// other family. As for FA3, the family name is the single record of the stage
/// (cuda/fa4_fwd_sm100.cu reads FA_FAMILY, src/cuda/fa4.rs the name).
pub fn fa4_stage(family: &str) -> Option<u32> {
    let stage: u32 = family.strip_prefix("fa4s")?.parse().ok()?;
    (1..=FA4_MAX_STAGE).contains(&stage).then_some(stage)
}

/// The highest stage of the FA4 ladder built so far (docs/fa4.md).
pub const FA4_MAX_STAGE: u32 = 3;

/// The FA4 tile: 128 query rows (one per tensor-memory lane, M of one cta_group::1 MMA) and 128
/// keys per tile; stage 1 runs one warpgroup, stage 2 four (two softmax, correction, load/MMA
/// warps). Mirrors `Fa4Traits` (cuda/fa4_fwd_sm100.cu).
/// Stage 3 takes two 128-row Q tiles (ping-pong).
const fn fa4_tile(stage: u32, head_dim: u32) -> Tile {
    Tile {
        head_dim,
        block_m: if stage >= 3 { 256 } else { 128 },
        block_n: 128,
        threads: if stage == 1 { 128 } else { 512 },
    }
}

/// FA4 shared memory: Q, K, V and P tiles (16-bit), four mbarriers (q_full, kv_full, s_full,
/// o_full), the tensor-memory address word (8 bytes) and 1024 bytes of alignment slack.
/// Mirrors `Fa4Traits::kSmemBytes`, which the kernel static_asserts equal to FA_SMEM_BYTES.
fn fa4s1_smem(t: &Tile) -> u32 {
    let elem = 2;
    t.block_m * t.head_dim * elem + 2 * t.block_n * t.head_dim * elem + t.block_m * t.block_n * elem + 8 * 4 + 8 + 1024
}

/// FA4 stage 2 shared memory: Q, a 2-slot K/V ring, 14 mbarriers, the TMEM address word, the
/// softmax/correction exchange (partial maxima [2][2], factors [2], partial sums [2], max: f32 per
/// row) and the slack; P lives in tensor memory. Mirrors `Fa4Traits<2, D>::kSmemBytes`.
fn fa4s2_smem(t: &Tile) -> u32 {
    let elem = 2;
    let rows = t.block_m * 4; // one f32 per row
    t.block_m * t.head_dim * elem + 4 * t.block_n * t.head_dim * elem + 8 * 14 + 8 + (4 + 2 + 2 + 1) * rows + 1024
}

/// FA4 stage 3 shared memory: two Q tiles, the 2-slot K/V ring, 16 mbarriers, the TMEM address
/// word, the correction factors, partial sums and maxima (f32 per row of each Q tile) and the
/// slack. Mirrors `Fa4Traits<3, D>::kSmemBytes`.
fn fa4s3_smem(t: &Tile) -> u32 {
    let elem = 2;
    t.block_m * t.head_dim * elem + 4 * t.block_n * t.head_dim * elem + 8 * 16 + 8 + 3 * t.block_m * 4 + 1024
}

const FA4_S1_TILES: &[Tile] = &[fa4_tile(1, 64), fa4_tile(1, 128)];
const FA4_S3_TILES: &[Tile] = &[fa4_tile(3, 64), fa4_tile(3, 128)];
const FA4_S2_TILES: &[Tile] = &[fa4_tile(2, 64), fa4_tile(2, 128)];

/// The families.
pub const FAMILIES: &[Family] = &[Family {
    name: "fa1",
    variant: "Fa1",
    source: "cuda/fa1_fwd.cu",
    // Tiles sized so Q, K, V and P (f32 in shared memory) stay under 99 KB, the opt-in limit of
    // sm_86/sm_89, and the per-thread f32 accumulator stays at most 64 registers.
    tiles: &[
        Tile { head_dim: 32, block_m: 64, block_n: 64, threads: FA1_THREADS },
        Tile { head_dim: 64, block_m: 64, block_n: 64, threads: FA1_THREADS },
        Tile { head_dim: 96, block_m: 64, block_n: 32, threads: FA1_THREADS },
        Tile { head_dim: 128, block_m: 64, block_n: 32, threads: FA1_THREADS },
        Tile { head_dim: 192, block_m: 32, block_n: 32, threads: FA1_THREADS },
        Tile { head_dim: 256, block_m: 32, block_n: 16, threads: FA1_THREADS },
    ],
    min_sm: 80,
    // Not yet run on a GPU (written where none was available). Set to true once
    // scripts/gpu-check.sh passes on a GPU.
    gpu_verified: false,
    // The fallback of last resort: Auto may always pick it.
    auto: true,
    sass_expect: &["FFMA", "MUFU.EX2"],
    options: &[],
    rank: 1,
    cpu_emulation: Some("fa1_all_instances"),
    smem_bytes: fa1_smem_bytes,
},
Family {
    name: "fa2",
    variant: "Fa2",
    source: "cuda/fa2_fwd.cu",
    // Mirrors fa2::Fa2Traits<D> (the unit static_asserts it). 128 rows = 4 warps x 2 m16 tiles
    // up to hd 128 (each K/V fragment feeds two mma); hd 128 takes 32-key tiles (64 spilled at
    // 255 registers); hd 192/256 take 64x32 (4 warps x 1 m-tile) to fit 99 KB with the K/V ring.
    // The kernel runs only its exact head dims (no tail masking, 16-byte row chunks): dispatch
    // checks that (src/cuda/fa2.rs).
    tiles: &[
        Tile { head_dim: 32, block_m: 128, block_n: 64, threads: FA2_THREADS },
        Tile { head_dim: 64, block_m: 128, block_n: 64, threads: FA2_THREADS },
        Tile { head_dim: 96, block_m: 128, block_n: 64, threads: FA2_THREADS },
        Tile { head_dim: 128, block_m: 128, block_n: 32, threads: FA2_THREADS },
        Tile { head_dim: 192, block_m: 64, block_n: 32, threads: FA2_THREADS },
        Tile { head_dim: 256, block_m: 64, block_n: 32, threads: FA2_THREADS },
    ],
    min_sm: 80,
    // Compile-checked and run in the emulator (tests/emulator.rs) only; set to true once
    // scripts/gpu-check.sh passes on a GPU.
    gpu_verified: false,
    // Auto picks it over FA1 wherever it runs the problem (sm_80+, and Hopper until FA3 is verified).
    auto: true,
    // Tensor-core mma.sync, ldmatrix (and its .trans form for V), cp.async global->shared.
    sass_expect: &["HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS"],
    options: &[],
    rank: 2,
    cpu_emulation: Some("fa2_all_instances"),
    smem_bytes: fa2_smem_bytes,
},
    // The FA3 ladder (docs/fa3.md): stage N adds one Hopper mechanism to stage N-1.
    // 1 wgmma; 2 + TMA/mbarrier ring; 3 + warp specialisation (setmaxnreg); 4 + ping-pong and
    // intra-warpgroup overlap; 5 + persistent grid (min(SMs, tiles) CTAs).
    fa3_family("fa3s1", 1, Some("fa3_stage1"), &["HGMMA"], FA3_S1_TILES, fa3s1_smem),
    fa3_family("fa3s2", 2, Some("fa3_stage2"), &["HGMMA", "UTMALDG", "SYNCS"], FA3_S2_TILES, fa3s2_smem),
    fa3_family("fa3s3", 3, Some("fa3_stage3"), &["HGMMA", "UTMALDG", "SYNCS", "USETMAXREG"], FA3_S345_TILES, fa3s3_smem),
    fa3_family("fa3s4", 4, Some("fa3_stage4"), &["HGMMA", "UTMALDG", "SYNCS", "USETMAXREG"], FA3_S345_TILES, fa3s4_smem),
    fa3_family("fa3s5", 5, Some("fa3_stage5"), &["HGMMA", "UTMALDG", "SYNCS", "USETMAXREG"], FA3_S345_TILES, fa3s5_smem),
    // The FA4 ladder (docs/fa4.md), Blackwell tcgen05 (sm_100a only, by its file name). No
    // Blackwell GPU has been available: never GPU-verified, never picked by Auto, and run only
    // when `fa4_stage` names the stage (src/cuda/dispatch.rs). Stage 1: tcgen05.mma into tensor
    // memory (UTCHMMA), tcgen05.ld/st (LDTM/STTM), TMA (UTMALDG), mbarriers (SYNCS).
    Family {
        name: "fa4s1",
        variant: "Fa4",
        source: "cuda/fa4_fwd_sm100.cu",
        tiles: FA4_S1_TILES,
        min_sm: 100,
        gpu_verified: false,
        auto: false,
        sass_expect: &["UTCHMMA", "LDTM", "STTM", "UTMALDG", "SYNCS"],
        options: &[],
        rank: 41,
        cpu_emulation: Some("fa4_stage1"),
        smem_bytes: fa4s1_smem,
    },
    // Stage 2: + FA4's warp roles (load warp, MMA warp, two softmax warpgroups, a correction
    // warpgroup) and P written to tensor memory for the PV product (tcgen05.mma with A from TMEM).
    Family {
        name: "fa4s2",
        variant: "Fa4",
        source: "cuda/fa4_fwd_sm100.cu",
        tiles: FA4_S2_TILES,
        min_sm: 100,
        gpu_verified: false,
        auto: false,
        sass_expect: &["UTCHMMA", "LDTM", "STTM", "UTMALDG", "SYNCS"],
        options: &[],
        rank: 42,
        cpu_emulation: Some("fa4_stage2"),
        smem_bytes: fa4s2_smem,
    },
    // Stage 3: + two Q tiles in ping-pong (one per softmax warpgroup) and FA4's softmax: the
    // degree-3 software exp2 (exp2_poly.cuh) for 1 element in 8, conditional rescaling with
    // tau = 8 (online_softmax.cuh). The FMA-pipe exp2 shows up as FFMA next to MUFU.EX2.
    Family {
        name: "fa4s3",
        variant: "Fa4",
        source: "cuda/fa4_fwd_sm100.cu",
        tiles: FA4_S3_TILES,
        min_sm: 100,
        gpu_verified: false,
        auto: false,
        sass_expect: &["UTCHMMA", "LDTM", "STTM", "UTMALDG", "SYNCS", "MUFU.EX2", "FFMA"],
        options: &[],
        rank: 43,
        cpu_emulation: Some("fa4_stage3"),
        smem_bytes: fa4s3_smem,
    },
];

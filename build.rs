//! Compiles the CUDA kernels listed in build/instances.rs and embeds them.
//!
//! - Finds nvcc: `$NVCC`, `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, `PATH`, then the PyPI
//!   toolchain `scripts/install-cuda-toolchain.sh` puts in `.cuda-toolchain/`.
//! - One compile unit per (family, head_dim, target), nvcc jobs in parallel; each `-Xptxas -v`
//!   report is kept next to the image in OUT_DIR; spills are warned about; PTX must say
//!   `.version 9.0` (driver 580 rejects newer PTX).
//! - Writes OUT_DIR/kernels.rs: the images (`include_bytes!`) and their reports.
//! - No nvcc (or the `cuda` feature off): a CPU-only crate, one `cargo:warning`, an empty
//!   image list; `Backend::Cuda` then returns an error saying so.
//!
//! Env vars: FLASH_ATTN_ARCHS ("80,90a,100a,ptx", default all) and FLASH_ATTN_HDIMS
//! ("64,128", default all) prune the build; FLASH_ATTN_REQUIRE_NVCC=1 makes a missing nvcc an
//! error (CI sets it where the toolchain is installed); FLASH_ATTN_HANG_CHECK=1 builds the
//! hang-diagnosis variant of the kernels (see `hang_check`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

include!("build/instances.rs");

/// The PTX ISA version of CUDA 13.0, the newest the GPU machine's driver (580) loads.
const PTX_VERSION_LINE: &str = ".version 9.0";

const ENV_VARS: &[&str] = &[
    "NVCC",
    "CUDA_HOME",
    "CUDA_PATH",
    "PATH",
    "FLASH_ATTN_ARCHS",
    "FLASH_ATTN_HDIMS",
    "FLASH_ATTN_REQUIRE_NVCC",
    "FLASH_ATTN_HANG_CHECK",
];

/// One nvcc invocation.
struct Job {
    family: &'static str,
    head_dim: u32,
    target: Target,
    unit: PathBuf,
    image: PathBuf,
    report: PathBuf,
}

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed=build.rs");
    for dir in ["build", "cuda"] {
        // The directory itself (a new file changes it) and every file in it: Cargo takes no globs.
        println!("cargo:rerun-if-changed={dir}");
        for f in files_under(&root.join(dir)) {
            println!("cargo:rerun-if-changed={}", f.display());
        }
    }
    for v in ENV_VARS {
        println!("cargo:rerun-if-env-changed={v}");
    }
    println!("cargo:rustc-check-cfg=cfg(fa_kernels)");
    println!("cargo:rustc-check-cfg=cfg(fa_hang_check)");
    if hang_check() {
        println!("cargo:rustc-cfg=fa_hang_check");
    }
    let require = std::env::var("FLASH_ATTN_REQUIRE_NVCC").is_ok_and(|v| v == "1");

    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        write_kernels_rs(&out, &[], None, "the `cuda` feature is off", "", "");
        return;
    }
    let Some(nvcc) = find_nvcc(&root) else {
        let why = "nvcc not found (looked at $NVCC, $CUDA_HOME, $CUDA_PATH, PATH, .cuda-toolchain/)";
        if require {
            panic!("FLASH_ATTN_REQUIRE_NVCC=1 but {why}; run scripts/install-cuda-toolchain.sh");
        }
        println!(
            "cargo:warning=flash_attn: {why}; building CPU-only (run scripts/install-cuda-toolchain.sh for the GPU kernels)"
        );
        write_kernels_rs(&out, &[], None, why, "", "");
        return;
    };

    let archs = env_list("FLASH_ATTN_ARCHS");
    let hdims = env_list("FLASH_ATTN_HDIMS");
    if let Some(a) = &archs {
        for name in a {
            assert!(
                Target::ALL.iter().any(|t| t.name() == name),
                "FLASH_ATTN_ARCHS: unknown target {name:?}; expected some of 80, 90a, 100a, ptx"
            );
        }
    }
    let gen_dir = out.join("gen");
    std::fs::create_dir_all(&gen_dir).unwrap();
    let mut jobs = Vec::new();
    for fam in FAMILIES {
        for tile in fam.tiles {
            if hdims.as_ref().is_some_and(|h| !h.contains(&tile.head_dim.to_string())) {
                continue;
            }
            let unit = gen_dir.join(format!("{}_hd{}.cu", fam.name, tile.head_dim));
            std::fs::write(&unit, unit_source(&root, fam, tile)).unwrap();
            for &target in targets_for(fam.source) {
                if archs.as_ref().is_some_and(|a| !a.iter().any(|n| n == target.name())) {
                    continue;
                }
                let stem = image_stem(fam.name, tile.head_dim, target);
                jobs.push(Job {
                    family: fam.name,
                    head_dim: tile.head_dim,
                    target,
                    unit: unit.clone(),
                    image: out.join(format!("{stem}.{}", target.ext())),
                    report: out.join(format!("{stem}.ptxas.txt")),
                });
            }
        }
    }

    let start = Instant::now();
    let threads: usize = std::env::var("NUM_JOBS").ok().and_then(|n| n.parse().ok()).unwrap_or(2).max(1);
    let next = AtomicUsize::new(0);
    let errors = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.min(jobs.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                if let Err(e) = compile(&nvcc, &root, job) {
                    errors.lock().unwrap().push(e);
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap();
    if !errors.is_empty() {
        panic!("nvcc failed:\n{}", errors.join("\n\n"));
    }
    let secs = start.elapsed().as_secs_f64();
    std::fs::write(
        out.join("kernels-build.txt"),
        format!("{} nvcc jobs on {threads} threads in {secs:.1} s\n", jobs.len()),
    )
    .unwrap();
    for job in &jobs {
        let report = std::fs::read_to_string(&job.report).unwrap_or_default();
        if report_spills(&report) {
            println!(
                "cargo:warning=flash_attn: {} spills registers to local memory (see {})",
                image_stem(job.family, job.head_dim, job.target),
                job.report.display()
            );
        }
    }
    println!("cargo:rustc-cfg=fa_kernels");
    let filter = |v: &str| std::env::var(v).unwrap_or_default();
    write_kernels_rs(&out, &jobs, Some(&nvcc), "", &filter("FLASH_ATTN_ARCHS"), &filter("FLASH_ATTN_HDIMS"));
}

/// Every file under `dir`, sorted (recursively).
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else { return out };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// FLASH_ATTN_HANG_CHECK=1: the opt-in hang-diagnosis build (cuda/include/hang_check.cuh,
/// docs/fa3.md "Hang check"): every generated unit defines FA_HANG_CHECK, so each mbarrier wait
/// of the kernels reports block, warp, barrier and parity and traps instead of hanging. Unset,
/// empty or "0": the normal build (the waits are the plain loops).
fn hang_check() -> bool {
    match std::env::var("FLASH_ATTN_HANG_CHECK") {
        Ok(v) if v == "1" => true,
        Ok(v) if v.is_empty() || v == "0" => false,
        Ok(v) => panic!("FLASH_ATTN_HANG_CHECK={v:?}: expected 1 (hang-check build) or 0 / unset"),
        Err(_) => false,
    }
}

/// A comma-separated env var, `None` when unset or empty.
fn env_list(name: &str) -> Option<Vec<String>> {
    let v = std::env::var(name).ok()?;
    let items: Vec<String> = v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    (!items.is_empty()).then_some(items)
}

fn find_nvcc(root: &Path) -> Option<PathBuf> {
    let is_file = |p: &Path| p.is_file();
    if let Some(p) = std::env::var_os("NVCC") {
        let p = PathBuf::from(p);
        return is_file(&p).then_some(p);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            let p = PathBuf::from(home).join("bin/nvcc");
            if is_file(&p) {
                return Some(p);
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("nvcc");
            if is_file(&p) {
                return Some(p);
            }
        }
    }
    let lib = root.join(".cuda-toolchain/lib");
    let mut pythons: Vec<PathBuf> = std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("python3")))
        .collect();
    pythons.sort();
    pythons
        .into_iter()
        .map(|py| py.join("site-packages/nvidia/cu13/bin/nvcc"))
        .find(|p| is_file(p))
}

/// The generated compile unit of one (family, head_dim): the tile as macros, the family's
/// source, then one instance per dtype.
fn unit_source(root: &Path, fam: &Family, tile: &Tile) -> String {
    let mut s = String::new();
    writeln!(s, "// Generated by build.rs from build/instances.rs: {} head_dim {}.", fam.name, tile.head_dim).unwrap();
    // The family's name as a bare token (e.g. fa3s3: cuda/fa3_fwd_sm90.cu derives its stage from it).
    writeln!(s, "#define FA_FAMILY {}", fam.name).unwrap();
    writeln!(s, "#define FA_HEAD_DIM {}", tile.head_dim).unwrap();
    writeln!(s, "#define FA_BLOCK_M {}", tile.block_m).unwrap();
    writeln!(s, "#define FA_BLOCK_N {}", tile.block_n).unwrap();
    writeln!(s, "#define FA_THREADS {}", tile.threads).unwrap();
    writeln!(s, "#define FA_SMEM_BYTES {}", (fam.smem_bytes)(tile)).unwrap();
    if hang_check() {
        // In the unit text, so anything keyed on the unit (a kernel cache) tells the variants apart.
        writeln!(s, "#define FA_HANG_CHECK 1").unwrap();
    }
    writeln!(s, "#include \"{}\"", root.join(fam.source).display()).unwrap();
    for dt in DTYPE_NAMES {
        writeln!(s, "FA_INSTANCE({dt})").unwrap();
    }
    s
}

fn compile(nvcc: &Path, root: &Path, job: &Job) -> Result<(), String> {
    let mut cmd = Command::new(nvcc);
    cmd.args(job.target.nvcc_args()).args(["-std=c++17", "-O3", "-lineinfo"]);
    if job.target != Target::Ptx80 {
        // ptxas runs only for SASS targets: its report gives registers, shared memory and spills.
        cmd.args(["-Xptxas=-v", "-Xptxas=-warn-spills"]);
    }
    cmd.arg("-I").arg(root.join("cuda/include")).arg("-o").arg(&job.image).arg(&job.unit);
    let what = image_stem(job.family, job.head_dim, job.target);
    let out = cmd.output().map_err(|e| format!("{what}: cannot run {}: {e}", nvcc.display()))?;
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    std::fs::write(&job.report, &report).map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("{what}: {:?} failed:\n{report}", cmd));
    }
    if job.target == Target::Ptx80 {
        let ptx = std::fs::read_to_string(&job.image).map_err(|e| e.to_string())?;
        if !ptx.lines().any(|l| l.trim() == PTX_VERSION_LINE) {
            let got = ptx.lines().find(|l| l.starts_with(".version")).unwrap_or("none");
            return Err(format!(
                "{what}: PTX says {got:?}, expected {PTX_VERSION_LINE:?}: the nvvm/crt pieces are newer than CUDA 13.0 \
                 (driver 580 rejects it); reinstall with scripts/install-cuda-toolchain.sh"
            ));
        }
    }
    Ok(())
}

/// Whether a ptxas report shows any spill (stores or loads).
fn report_spills(report: &str) -> bool {
    report.lines().any(|l| {
        ["bytes spill stores", "bytes spill loads"].iter().any(|key| {
            l.split(',').any(|part| {
                let part = part.trim();
                part.ends_with(key) && part.split_whitespace().next() != Some("0")
            })
        })
    })
}

/// OUT_DIR/kernels.rs: `IMAGES` (one per job) and the tool paths the compile-only tests use.
fn write_kernels_rs(out: &Path, jobs: &[Job], nvcc: Option<&Path>, why_none: &str, archs: &str, hdims: &str) {
    let mut s = String::from("// Generated by build.rs. Do not edit.\n");
    let nvcc_s = nvcc.map(|p| p.display().to_string()).unwrap_or_default();
    let cuobjdump = nvcc
        .map(|p| p.with_file_name("cuobjdump"))
        .filter(|p| p.is_file())
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    writeln!(s, "/// The nvcc that built the images (empty when none was found).").unwrap();
    writeln!(s, "pub const NVCC: &str = {nvcc_s:?};").unwrap();
    writeln!(s, "/// cuobjdump next to that nvcc (empty when absent).").unwrap();
    writeln!(s, "pub const CUOBJDUMP: &str = {cuobjdump:?};").unwrap();
    writeln!(s, "/// Why no image was built (empty when some were).").unwrap();
    writeln!(s, "pub const WHY_NO_KERNELS: &str = {why_none:?};").unwrap();
    writeln!(s, "/// FLASH_ATTN_ARCHS / FLASH_ATTN_HDIMS as the build saw them (empty: everything built).").unwrap();
    writeln!(s, "pub const ARCHS_FILTER: &str = {archs:?};").unwrap();
    writeln!(s, "pub const HDIMS_FILTER: &str = {hdims:?};").unwrap();
    writeln!(s, "/// Every built image.").unwrap();
    writeln!(s, "pub static IMAGES: &[Image] = &[").unwrap();
    for j in jobs {
        let image = j.image.display().to_string();
        let report = j.report.display().to_string();
        writeln!(
            s,
            "    Image {{ family: {:?}, head_dim: {}, target: Target::{:?}, bytes: include_bytes!({image:?}), report: include_str!({report:?}) }},",
            j.family, j.head_dim, j.target
        )
        .unwrap();
    }
    writeln!(s, "];").unwrap();
    std::fs::write(out.join("kernels.rs"), s).unwrap();
}

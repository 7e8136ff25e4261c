//! Compiles the CUDA kernels listed in build/instances.rs and embeds them.
//!
//! - Finds nvcc (`nvcc.exe` on Windows): `$NVCC`, `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, `PATH`,
//!   then the PyPI toolchain `scripts/install-cuda-toolchain.sh` puts in
//!   `$FLASH_ATTN_CUDA_TOOLCHAIN` or (in a checkout of this repository, never inside the cargo
//!   registry) `.cuda-toolchain/`.
//! - Any nvcc of CUDA 12.4 or newer: it builds the targets that version can (sm_100a needs
//!   12.8) and warns about the rest. The compute_80 PTX is lowered to the oldest PTX ISA of the
//!   toolkit's major version (8.0 for 12.x, 9.0 for 13.x) and re-assembled by ptxas to prove it
//!   still is valid there, so it loads on every driver that version supports.
//! - One compile unit per (family, head_dim, target), and one per (standalone kernel, target)
//!   (build/instances.rs `STANDALONE`: the combine). Compiled images are cached by content
//!   (the unit, the sources and headers it includes, the nvcc flags, the toolchain's version
//!   and binaries; paths relative to the crate's root, so other checkouts and `cargo package`'s
//!   copy hit the same entries) in a directory shared by every profile and tool (`<target-dir>/
//!   flash-attn-kernels/`, or `$FLASH_ATTN_KERNEL_CACHE`): a second profile, `cargo clippy` or
//!   `cargo doc` compiles nothing, and editing one `.cu` file recompiles only its units.
//! - nvcc jobs run in parallel within cargo's jobserver (one job on the build script's own
//!   token, each further one on a token it acquires), so `cargo -jN` is respected.
//! - Each `-Xptxas -v` report is kept next to its image in OUT_DIR; spills are warned about.
//! - Writes OUT_DIR/kernels.rs: the images (`include_bytes!`), their reports, and what the
//!   build used (nvcc version, PTX ISA, driver requirement, targets skipped).
//! - No nvcc (or the `cuda` feature off): a CPU-only crate, one `cargo:warning` saying how to
//!   get the kernels, an empty image list; `Backend::Cuda` then returns an error saying the same.
//!
//! Env vars: FLASH_ATTN_ARCHS ("80,90a,100a,ptx", default all) and FLASH_ATTN_HDIMS
//! ("64,128", default all) prune the build; FLASH_ATTN_REQUIRE_NVCC=1 makes a missing or
//! unusable nvcc an error (CI sets it where the toolchain is installed);
//! FLASH_ATTN_KERNEL_CACHE moves the cache; FLASH_ATTN_HANG_CHECK=1 builds the hang-diagnosis
//! variant of the kernels (see `hang_check`; the define is in the unit text, so the cache keeps
//! the two variants apart).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

include!("build/instances.rs");

#[path = "build/numerics_header.rs"]
mod numerics_header;

/// The oldest CUDA whose nvcc builds the kernels (FA3's sm_90a code and the headers need it).
const MIN_CUDA: (u32, u32) = (12, 4);

/// Bumped when anything the cache key does not cover changes (the post-processing of images).
const CACHE_FORMAT: &str = "flash_attn kernel cache 1";

const ENV_VARS: &[&str] = &[
    "NVCC",
    "CUDA_HOME",
    "CUDA_PATH",
    "PATH",
    "FLASH_ATTN_CUDA_TOOLCHAIN",
    "FLASH_ATTN_ARCHS",
    "FLASH_ATTN_HDIMS",
    "FLASH_ATTN_REQUIRE_NVCC",
    "FLASH_ATTN_KERNEL_CACHE",
    "FLASH_ATTN_HANG_CHECK",
    // nvcc reads these itself; they change what it builds.
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
];

/// Flags of every nvcc job besides the target's.
const COMMON_FLAGS: &[&str] = &["-std=c++17", "-O3", "-lineinfo"];

/// How a dependent crate gets the kernels; said by the warning and by the run-time error.
const HOW_TO_GET_KERNELS: &str = "To build the GPU kernels, point the build at an nvcc of CUDA 12.4 or newer: \
     set NVCC=/path/to/bin/nvcc (or CUDA_HOME / CUDA_PATH to a CUDA install, or put nvcc on PATH) and build again; \
     cargo rebuilds flash_attn when these change";

/// One nvcc invocation, or its cached result.
struct Job {
    family: &'static str,
    head_dim: u32,
    target: Target,
    unit: PathBuf,
    /// Where the image and report go in OUT_DIR (what kernels.rs includes).
    image: PathBuf,
    report: PathBuf,
    /// The cache entry of this exact input.
    cached_image: PathBuf,
    cached_report: PathBuf,
}

/// The nvcc in use.
struct Toolchain {
    nvcc: PathBuf,
    version: (u32, u32),
    /// What the cache key takes from the toolchain: version text, binaries' sizes and dates.
    fingerprint: String,
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
    // The numerics constants shared with Rust, generated even without nvcc: the CPU emulator and
    // the C++ test programs compile the kernel sources with g++.
    let generated_include = numerics_header::write(&root, &out);
    println!("cargo:rustc-check-cfg=cfg(fa_kernels)");
    println!("cargo:rustc-check-cfg=cfg(fa_hang_check)");
    if hang_check() {
        println!("cargo:rustc-cfg=fa_hang_check");
    }
    let require = std::env::var("FLASH_ATTN_REQUIRE_NVCC").is_ok_and(|v| v == "1");

    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        write_kernels_rs(&out, &[], None, "the `cuda` feature is off", &BuildInfo::default());
        return;
    }
    let toolchain_dirs = toolchain_dirs(&root);
    watch_toolchain_dirs(&toolchain_dirs);
    let cpu_only = |why: String| {
        if require {
            panic!("FLASH_ATTN_REQUIRE_NVCC=1 but {why}; run scripts/install-cuda-toolchain.sh");
        }
        let local = if is_dependency_source(&root) {
            String::new()
        } else {
            " (in this repository: scripts/install-cuda-toolchain.sh installs CUDA 13.0 from PyPI into .cuda-toolchain/)"
                .to_string()
        };
        let msg = format!("{why}; building CPU-only. {HOW_TO_GET_KERNELS}{local}");
        println!("cargo:warning=flash_attn: {msg}");
        write_kernels_rs(&out, &[], None, &msg, &BuildInfo::default());
    };
    let Some(nvcc) = find_nvcc(&toolchain_dirs) else {
        let mut looked = "$NVCC, $CUDA_HOME, $CUDA_PATH, PATH".to_string();
        for d in &toolchain_dirs {
            write!(looked, ", {}", d.display()).unwrap();
        }
        return cpu_only(format!("nvcc not found (looked at {looked})"));
    };
    println!("cargo:rerun-if-changed={}", nvcc.display());
    let tc = match inspect(&nvcc) {
        Ok(tc) => tc,
        Err(why) => return cpu_only(why),
    };
    if tc.version < MIN_CUDA {
        return cpu_only(format!(
            "{} is CUDA {}.{}, older than the {}.{} the kernels need",
            nvcc.display(),
            tc.version.0,
            tc.version.1,
            MIN_CUDA.0,
            MIN_CUDA.1
        ));
    }

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
    let wanted = |t: Target| archs.as_ref().is_none_or(|a| a.iter().any(|n| n == t.name()));
    let skipped: Vec<Target> = Target::ALL.into_iter().filter(|&t| wanted(t) && tc.version < min_cuda(t)).collect();
    for &t in &skipped {
        let (maj, min) = min_cuda(t);
        println!(
            "cargo:warning=flash_attn: nvcc {}.{} cannot build sm_{} (needs CUDA {maj}.{min}+); those GPUs run the compute_80 PTX instead",
            tc.version.0,
            tc.version.1,
            t.name()
        );
    }
    let cache = cache_dir(&out);
    std::fs::create_dir_all(&cache)
        .unwrap_or_else(|e| panic!("cannot create the kernel cache {}: {e}", cache.display()));
    let gen_dir = out.join("gen");
    std::fs::create_dir_all(&gen_dir).unwrap();
    // Kernel headers, then the generated ones (the numerics constants).
    let include_dirs = [root.join("cuda"), generated_include];
    let env_flags: String = ["NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"]
        .iter()
        .map(|v| format!("{v}={}\n", std::env::var(v).unwrap_or_default()))
        .collect();
    // Paths in the key are relative to OUT_DIR (which differs per profile) and to the crate's
    // root (which differs per checkout, and for `cargo package`'s copy): every file's content is
    // keyed, so one cache serves every checkout of the same sources. The `-lineinfo` of an image
    // names the paths of the build that compiled it first.
    let (out_s, root_s) = (out.display().to_string(), root.display().to_string());
    let portable = |s: &str| s.replace(&out_s, "$OUT_DIR").replace(&root_s, "$ROOT");
    let mut jobs = Vec::new();
    // (image name, head_dim, source, unit file name, unit text): every family's (family,
    // head_dim) units as pruned by FLASH_ATTN_HDIMS, then the standalone kernels (no head dim).
    let mut units: Vec<(&'static str, u32, &'static str, String, String)> = Vec::new();
    for fam in FAMILIES {
        for tile in fam.tiles {
            if hdims.as_ref().is_some_and(|h| !h.contains(&tile.head_dim.to_string())) {
                continue;
            }
            let text = unit_source(fam, tile, &root.join(fam.source).display().to_string(), hang_check());
            units.push((fam.name, tile.head_dim, fam.source, format!("{}_hd{}.cu", fam.name, tile.head_dim), text));
        }
    }
    for s in STANDALONE {
        let text = standalone_unit_source(s, &root.join(s.source).display().to_string());
        units.push((s.name, STANDALONE_HEAD_DIM, s.source, format!("{}.cu", s.name), text));
    }
    for (name, head_dim, source, unit_name, text) in units {
        let unit = gen_dir.join(unit_name);
        write_if_changed(&unit, &text);
        // Everything the unit reads but the toolkit's own headers (covered by its version).
        let mut deps = BTreeMap::new();
        collect_includes(&root.join(source), &include_dirs, &mut deps);
        for &target in targets_for(source) {
            if !wanted(target) || skipped.contains(&target) {
                continue;
            }
            let mut key = Fnv128::new();
            key.add(CACHE_FORMAT.as_bytes());
            key.add(tc.fingerprint.as_bytes());
            key.add(env_flags.as_bytes());
            let args = nvcc_args(target, &include_dirs).join(" ");
            key.add(portable(&args).as_bytes());
            key.add(portable(&text).as_bytes());
            // In the order of the portable paths, which does not depend on where root is.
            let mut files: Vec<(String, &Vec<u8>)> = deps.iter().map(|(p, c)| (portable(p), c)).collect();
            files.sort();
            for (path, content) in files {
                key.add(path.as_bytes());
                key.add(content);
            }
            let stem = image_stem(name, head_dim, target);
            let entry = format!("{stem}-{:032x}", key.finish());
            jobs.push(Job {
                family: name,
                head_dim,
                target,
                unit: unit.clone(),
                image: out.join(format!("{stem}.{}", target.ext())),
                report: out.join(format!("{stem}.ptxas.txt")),
                cached_image: cache.join(format!("{entry}.{}", target.ext())),
                cached_report: cache.join(format!("{entry}.ptxas.txt")),
            });
        }
    }

    let start = Instant::now();
    let misses: Vec<&Job> = jobs.iter().filter(|j| !(j.cached_image.is_file() && j.cached_report.is_file())).collect();
    let threads = compile_all(&tc, &include_dirs, &misses);
    let secs = start.elapsed().as_secs_f64();
    for job in &jobs {
        for (from, to) in [(&job.cached_image, &job.image), (&job.cached_report, &job.report)] {
            link_or_copy(from, to);
        }
    }
    let summary = format!(
        "{} images: {} compiled by nvcc ({} jobs at most at once, {secs:.1} s), {} reused from {}\n",
        jobs.len(),
        misses.len(),
        threads,
        jobs.len() - misses.len(),
        cache.display()
    );
    std::fs::write(out.join("kernels-build.txt"), &summary).unwrap();
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
    let ptx_isa = embedded_ptx_isa(&jobs);
    if let (Some(got), Some(want)) = (&ptx_isa, oldest_ptx_isa(tc.version.0)) {
        if *got != want {
            println!(
                "cargo:warning=flash_attn: the compute_80 PTX keeps ISA {got} (ptxas refused it at {want}), so it loads only \
                 on drivers newer than CUDA {}.0's; the SASS images are not affected",
                tc.version.0
            );
        }
    }
    println!("cargo:rustc-cfg=fa_kernels");
    let info = BuildInfo {
        nvcc_version: format!("{}.{}", tc.version.0, tc.version.1),
        ptx_isa: ptx_isa.unwrap_or_default(),
        min_driver: min_driver(tc.version.0).to_string(),
        skipped,
        summary,
        archs: std::env::var("FLASH_ATTN_ARCHS").unwrap_or_default(),
        hdims: std::env::var("FLASH_ATTN_HDIMS").unwrap_or_default(),
    };
    write_kernels_rs(&out, &jobs, Some(&nvcc), "", &info);
}

/// The first CUDA version whose nvcc builds a target.
fn min_cuda(t: Target) -> (u32, u32) {
    match t {
        Target::Sm80 | Target::Ptx80 => (11, 0),
        Target::Sm90a => (12, 0),
        Target::Sm100a => (12, 8),
    }
}

/// The oldest PTX ISA the drivers of a CUDA major version load (the ISA of its x.0 release).
fn oldest_ptx_isa(cuda_major: u32) -> Option<String> {
    match cuda_major {
        12 => Some("8.0".into()),
        13 => Some("9.0".into()),
        _ => None,
    }
}

/// The oldest driver that runs what a CUDA major version builds (minor version compatibility
/// for the cubins; the PTX is lowered to that driver's ISA).
fn min_driver(cuda_major: u32) -> &'static str {
    match cuda_major {
        12 => "R525 (CUDA 12.0) or newer",
        13 => "R580 (CUDA 13.0) or newer",
        _ => "a driver of this CUDA version or newer",
    }
}

/// The toolkit's PyPI venvs to look in, in order: `$FLASH_ATTN_CUDA_TOOLCHAIN`, then this
/// checkout's `.cuda-toolchain/`; never a directory inside the cargo registry or a git
/// dependency's checkout (a dependent crate's users cannot install there).
fn toolchain_dirs(root: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("FLASH_ATTN_CUDA_TOOLCHAIN") {
        dirs.push(PathBuf::from(d));
    }
    if !is_dependency_source(root) {
        dirs.push(root.join(".cuda-toolchain"));
    }
    dirs
}

/// Whether the crate is built from cargo's own copy of a dependency (registry or git), where
/// nothing should be installed next to it.
fn is_dependency_source(root: &Path) -> bool {
    let parts: Vec<String> = root.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    parts.windows(2).any(|w| (w[0] == "registry" && w[1] == "src") || (w[0] == "git" && w[1] == "checkouts"))
}

/// Makes cargo rerun this script when a toolchain is installed or reinstalled: the stamp
/// `scripts/install-cuda-toolchain.sh` writes last, or (not installed yet) the directory the
/// install fills. A path that does not exist is not watched: cargo would rerun every build.
fn watch_toolchain_dirs(dirs: &[PathBuf]) {
    for d in dirs {
        let stamp = d.join(".installed");
        if stamp.is_file() {
            println!("cargo:rerun-if-changed={}", stamp.display());
        } else if d.is_dir() {
            println!("cargo:rerun-if-changed={}", d.display());
        }
    }
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

/// FLASH_ATTN_HANG_CHECK=1: the opt-in hang-diagnosis build (cuda/sm90/hang_check.cuh,
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

/// A CUDA tool's file name on the build host (`nvcc`, or `nvcc.exe` on Windows).
fn exe(tool: &str) -> String {
    format!("{tool}{}", std::env::consts::EXE_SUFFIX)
}

fn find_nvcc(toolchain_dirs: &[PathBuf]) -> Option<PathBuf> {
    let is_file = |p: &Path| p.is_file();
    let nvcc = exe("nvcc");
    if let Some(p) = std::env::var_os("NVCC") {
        let p = PathBuf::from(p);
        return is_file(&p).then_some(p);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            let p = PathBuf::from(home).join("bin").join(&nvcc);
            if is_file(&p) {
                return Some(p);
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join(&nvcc);
            if is_file(&p) {
                return Some(p);
            }
        }
    }
    // A PyPI venv, once its install finished (the stamp is written last): its packages are in
    // lib/python3.X/site-packages, or Lib/site-packages on Windows.
    for d in toolchain_dirs.iter().filter(|d| d.join(".installed").is_file()) {
        let mut site_packages: Vec<PathBuf> = std::fs::read_dir(d.join("lib"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("python3")))
            .map(|py| py.join("site-packages"))
            .collect();
        site_packages.sort();
        site_packages.push(d.join("Lib").join("site-packages"));
        let found = site_packages.into_iter().map(|sp| sp.join("nvidia/cu13/bin").join(&nvcc)).find(|p| is_file(p));
        if found.is_some() {
            return found;
        }
    }
    None
}

/// Runs `nvcc --version` and fingerprints the toolchain for the cache key.
fn inspect(nvcc: &Path) -> Result<Toolchain, String> {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {} --version: {e}", nvcc.display()))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!("{} --version failed: {}", nvcc.display(), String::from_utf8_lossy(&out.stderr).trim()));
    }
    let version = text
        .split("release ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .and_then(|v| {
            let (maj, min) = v.trim().split_once('.')?;
            Some((maj.parse().ok()?, min.parse().ok()?))
        })
        .ok_or_else(|| format!("cannot read the CUDA version from `{} --version`: {text:?}", nvcc.display()))?;
    let mut fingerprint = format!("{}\n{text}\n", std::fs::canonicalize(nvcc).unwrap_or(nvcc.to_path_buf()).display());
    let bin = nvcc.parent().unwrap_or(Path::new("."));
    // The pieces nvcc drives: a reinstall with other versions (PyPI ships them separately)
    // changes their size or date even where nvcc's own version text stays the same.
    let tools =
        [nvcc.to_path_buf(), bin.join(exe("ptxas")), bin.join("../nvvm/bin").join(exe("cicc")), bin.join(exe("fatbinary"))];
    for tool in tools {
        if let Ok(m) = std::fs::metadata(&tool) {
            let mtime =
                m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).unwrap_or_default();
            writeln!(fingerprint, "{} {} {}", tool.display(), m.len(), mtime.as_nanos()).unwrap();
        }
    }
    Ok(Toolchain { nvcc: nvcc.to_path_buf(), version, fingerprint })
}

/// Where compiled images are kept across profiles and tools: `$FLASH_ATTN_KERNEL_CACHE`, else
/// `flash-attn-kernels/` in cargo's target directory (found from OUT_DIR,
/// `<target>/[<triple>/]<profile>/build/<pkg>-<hash>/out`), so `cargo clean` clears it and a
/// dependent crate's build (whose own directory is read-only in the registry) writes only into
/// its own target directory.
fn cache_dir(out: &Path) -> PathBuf {
    if let Some(d) = std::env::var_os("FLASH_ATTN_KERNEL_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let build = out.ancestors().nth(2);
    match (build, out.ancestors().nth(4)) {
        (Some(b), Some(target)) if b.file_name().is_some_and(|n| n == "build") => target.join("flash-attn-kernels"),
        _ => out.join("kernel-cache"),
    }
}

/// `file` and every file it `#include "..."`s, recursively (resolved next to the including
/// file, then in each of `include_dirs`), with their contents. Conditional includes count too: a
/// superset only costs a rebuild more.
fn collect_includes(file: &Path, include_dirs: &[PathBuf], seen: &mut BTreeMap<String, Vec<u8>>) {
    let key = file.display().to_string();
    if seen.contains_key(&key) {
        return;
    }
    let Ok(bytes) = std::fs::read(file) else { return };
    let text = String::from_utf8_lossy(&bytes).into_owned();
    seen.insert(key, bytes);
    for line in text.lines() {
        let l = line.trim_start();
        let Some(rest) = l.strip_prefix('#') else { continue };
        let Some(rest) = rest.trim_start().strip_prefix("include") else { continue };
        let Some(name) = rest.trim().strip_prefix('"').and_then(|r| r.split('"').next()) else { continue };
        let here = file.parent().unwrap_or(Path::new(".")).join(name);
        let found = std::iter::once(here).chain(include_dirs.iter().map(|d| d.join(name))).find(|f| f.is_file());
        if let Some(found) = found {
            collect_includes(&found, include_dirs, seen);
        }
    }
}

fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap();
    }
}

/// A hard link of the cache entry into OUT_DIR (a copy across file systems).
fn link_or_copy(from: &Path, to: &Path) {
    let _ = std::fs::remove_file(to);
    if std::fs::hard_link(from, to).is_err() {
        std::fs::copy(from, to).unwrap_or_else(|e| panic!("cannot copy {} to {}: {e}", from.display(), to.display()));
    }
}

/// FNV-1a, 128 bits: a stable content hash with no dependency (collisions among a cache's few
/// hundred entries are out of reach; nothing adversarial writes into the cache).
struct Fnv128(u128);

impl Fnv128 {
    fn new() -> Self {
        Fnv128(0x6c62272e07bb014262b821756295c58d)
    }
    /// Adds one field; its length is added first, so fields cannot run into each other.
    fn add(&mut self, bytes: &[u8]) {
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            self.0 ^= *b as u128;
            self.0 = self.0.wrapping_mul(0x0000000001000000000000000000013B);
        }
    }
    fn finish(&self) -> u128 {
        self.0
    }
}

/// nvcc's arguments for a target, without the output and the unit.
fn nvcc_args(target: Target, include_dirs: &[PathBuf]) -> Vec<String> {
    let mut args: Vec<String> = target.nvcc_args().iter().chain(COMMON_FLAGS).map(|s| s.to_string()).collect();
    if target != Target::Ptx80 {
        // ptxas runs only for SASS targets: its report gives registers, shared memory and spills.
        args.extend(["-Xptxas=-v".to_string(), "-Xptxas=-warn-spills".to_string()]);
    }
    for d in include_dirs {
        args.extend(["-I".to_string(), d.display().to_string()]);
    }
    args
}

/// Compiles `jobs` into the cache, in parallel within cargo's jobserver: the build script's own
/// token runs one job; each further worker acquires a token per job. Without a jobserver (run
/// outside cargo), NUM_JOBS workers. Returns the number of workers.
fn compile_all(tc: &Toolchain, include_dirs: &[PathBuf], jobs: &[&Job]) -> usize {
    if jobs.is_empty() {
        return 0;
    }
    // SAFETY: the jobserver's file descriptors come from cargo (CARGO_MAKEFLAGS) and are used
    // only through this client, for this build script's lifetime.
    let client = unsafe { jobserver::Client::from_env() };
    let workers: usize = std::env::var("NUM_JOBS").ok().and_then(|n| n.parse().ok()).unwrap_or(2).max(1);
    let workers = workers.min(jobs.len());
    let next = AtomicUsize::new(0);
    let errors = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for w in 0..workers {
            let (client, next, errors) = (client.as_ref(), &next, &errors);
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let _token = match (w, client) {
                    (0, _) | (_, None) => None,
                    (_, Some(c)) => match c.acquire() {
                        Ok(t) => Some(t),
                        Err(e) => {
                            errors.lock().unwrap().push(format!("jobserver: {e}"));
                            break;
                        }
                    },
                };
                if let Err(e) = compile(tc, include_dirs, job) {
                    errors.lock().unwrap().push(e);
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap();
    if !errors.is_empty() {
        panic!("nvcc failed:\n{}", errors.join("\n\n"));
    }
    workers
}

/// A path in the cache directory no other process writes (renamed into place when complete).
fn temp_path(final_path: &Path) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let name = final_path.file_name().unwrap().to_string_lossy();
    final_path.with_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()))
}

fn compile(tc: &Toolchain, include_dirs: &[PathBuf], job: &Job) -> Result<(), String> {
    let tmp_image = temp_path(&job.cached_image);
    let mut cmd = Command::new(&tc.nvcc);
    cmd.args(nvcc_args(job.target, include_dirs)).arg("-o").arg(&tmp_image).arg(&job.unit);
    let what = image_stem(job.family, job.head_dim, job.target);
    let out = cmd.output().map_err(|e| format!("{what}: cannot run {}: {e}", tc.nvcc.display()))?;
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp_image);
        return Err(format!("{what}: {:?} failed:\n{report}", cmd));
    }
    if job.target == Target::Ptx80 {
        lower_ptx(tc, &tmp_image).map_err(|e| format!("{what}: {e}"))?;
    }
    let tmp_report = temp_path(&job.cached_report);
    std::fs::write(&tmp_report, &report).map_err(|e| e.to_string())?;
    // The image first, the report last: an entry counts as present only with both.
    std::fs::rename(&tmp_image, &job.cached_image).map_err(|e| e.to_string())?;
    std::fs::rename(&tmp_report, &job.cached_report).map_err(|e| e.to_string())?;
    Ok(())
}

/// The `.version` of a PTX text ("8.4").
fn ptx_version(ptx: &str) -> Option<String> {
    ptx.lines().find_map(|l| l.trim().strip_prefix(".version ").map(|v| v.trim().to_string()))
}

fn parse_isa(v: &str) -> Option<(u32, u32)> {
    let (a, b) = v.split_once('.')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// Lowers a PTX image to the oldest ISA of its CUDA major version, so every driver of that
/// version loads it, when ptxas confirms the lowered text is valid at that ISA. nvcc writes
/// its own release's ISA (12.4: 8.4), and the only construct newer than 8.0 its compute_80
/// output holds here is the `used_bytes_mask` hint pragma (ISA 8.3), which is dropped: it
/// tells the JIT which bytes of a load are used and changes no result. If ptxas refuses the
/// lowered text, the image keeps nvcc's ISA (and the build warns).
fn lower_ptx(tc: &Toolchain, path: &Path) -> Result<(), String> {
    let ptx = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let got = ptx_version(&ptx).ok_or("the PTX has no .version line")?;
    let (maj, min) = parse_isa(&got).ok_or_else(|| format!("unreadable PTX .version {got:?}"))?;
    // PyPI ships nvcc, nvvm (cicc) and crt separately: an nvvm newer than nvcc writes a newer
    // ISA than nvcc's ptxas and driver accept (CUDA 13.x writes ISA 9.x with x <= its minor).
    let expected_major = tc.version.0.checked_sub(4);
    if expected_major != Some(maj) || (tc.version.0 >= 13 && min > tc.version.1) {
        return Err(format!(
            "the PTX says .version {got}, newer than nvcc {}.{} writes: its nvvm (cicc) or crt pieces come from a newer \
             CUDA release; install matching versions (scripts/install-cuda-toolchain.sh pins them)",
            tc.version.0, tc.version.1
        ));
    }
    let Some(want) = oldest_ptx_isa(tc.version.0) else { return Ok(()) };
    if got == want {
        return Ok(());
    }
    let lowered: String = ptx
        .lines()
        .filter(|l| !(l.trim_start().starts_with(".pragma \"used_bytes_mask ") && l.trim_end().ends_with("\";")))
        .map(|l| if l.trim() == format!(".version {got}") { format!(".version {want}") } else { l.to_string() })
        .fold(String::with_capacity(ptx.len()), |mut s, l| {
            s.push_str(&l);
            s.push('\n');
            s
        });
    let candidate = temp_path(path);
    std::fs::write(&candidate, &lowered).map_err(|e| e.to_string())?;
    // ptxas's output is only proof that it accepts the text: a temporary file in OUT_DIR (no
    // `/dev/null`, which Windows lacks), removed after.
    let ptxas = tc.nvcc.with_file_name(exe("ptxas"));
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?);
    let scratch = temp_path(&out_dir.join("ptx-check.cubin"));
    let check = Command::new(&ptxas).arg("-arch=sm_80").arg("-o").arg(&scratch).arg(&candidate).output();
    let _ = std::fs::remove_file(&scratch);
    match check {
        Ok(o) if o.status.success() => std::fs::rename(&candidate, path).map_err(|e| e.to_string()),
        _ => {
            let _ = std::fs::remove_file(&candidate);
            Ok(())
        }
    }
}

/// The PTX ISA of the built PTX images (the highest, should they differ), if any was built.
fn embedded_ptx_isa(jobs: &[Job]) -> Option<String> {
    jobs.iter()
        .filter(|j| j.target == Target::Ptx80)
        .filter_map(|j| std::fs::read_to_string(&j.image).ok().and_then(|t| ptx_version(&t)))
        .max_by_key(|v| parse_isa(v))
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

/// What kernels.rs records about the build besides the images.
#[derive(Default)]
struct BuildInfo {
    nvcc_version: String,
    ptx_isa: String,
    min_driver: String,
    skipped: Vec<Target>,
    summary: String,
    archs: String,
    hdims: String,
}

/// OUT_DIR/kernels.rs: `IMAGES` (one per job) and the tool paths the compile-only tests use.
fn write_kernels_rs(out: &Path, jobs: &[Job], nvcc: Option<&Path>, why_none: &str, info: &BuildInfo) {
    let mut s = String::from("// Generated by build.rs. Do not edit.\n");
    let nvcc_s = nvcc.map(|p| p.display().to_string()).unwrap_or_default();
    let cuobjdump = nvcc
        .map(|p| p.with_file_name(exe("cuobjdump")))
        .filter(|p| p.is_file())
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    writeln!(s, "/// The nvcc that built the images (empty when none was found).").unwrap();
    writeln!(s, "pub const NVCC: &str = {nvcc_s:?};").unwrap();
    writeln!(s, "/// Its CUDA version, \"major.minor\" (empty when none was found).").unwrap();
    writeln!(s, "pub const NVCC_VERSION: &str = {:?};", info.nvcc_version).unwrap();
    writeln!(s, "/// The PTX ISA of the embedded compute_80 PTX (empty when none was built).").unwrap();
    writeln!(s, "pub const PTX_ISA: &str = {:?};", info.ptx_isa).unwrap();
    writeln!(s, "/// The oldest driver the images load on.").unwrap();
    writeln!(s, "pub const MIN_DRIVER: &str = {:?};", info.min_driver).unwrap();
    writeln!(s, "/// Targets this nvcc is too old to build (their GPUs run the PTX).").unwrap();
    let skipped: Vec<String> = info.skipped.iter().map(|t| format!("Target::{t:?}")).collect();
    writeln!(s, "pub const TARGETS_SKIPPED: &[Target] = &[{}];", skipped.join(", ")).unwrap();
    writeln!(s, "/// How many images nvcc compiled and how many came from the kernel cache.").unwrap();
    writeln!(s, "pub const BUILD_SUMMARY: &str = {:?};", info.summary.trim()).unwrap();
    writeln!(s, "/// cuobjdump next to that nvcc (empty when absent).").unwrap();
    writeln!(s, "pub const CUOBJDUMP: &str = {cuobjdump:?};").unwrap();
    writeln!(s, "/// Why no image was built, and how to get them (empty when some were).").unwrap();
    writeln!(s, "pub const WHY_NO_KERNELS: &str = {why_none:?};").unwrap();
    writeln!(s, "/// FLASH_ATTN_ARCHS / FLASH_ATTN_HDIMS as the build saw them (empty: everything built).").unwrap();
    writeln!(s, "pub const ARCHS_FILTER: &str = {:?};", info.archs).unwrap();
    writeln!(s, "pub const HDIMS_FILTER: &str = {:?};", info.hdims).unwrap();
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
    write_if_changed(&out.join("kernels.rs"), &s);
}

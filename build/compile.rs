//! The nvcc jobs: one per (unit, target), run in parallel within cargo's jobserver; the PTX is
//! lowered to the oldest ISA of its CUDA major version; spills are read from the ptxas report.

use crate::cache::{self, collect_includes, link_or_copy, write_if_changed};
use crate::toolchain::{exe, min_cuda, oldest_ptx_isa, Toolchain};
use crate::{image_stem, standalone_unit_source, targets_for, unit_source, Target, FAMILIES, STANDALONE, STANDALONE_HEAD_DIM};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// The targets to build: those FLASH_ATTN_ARCHS names (all when unset), less those this nvcc is
/// too old for (`skipped`, each warned about: their GPUs run the compute_80 PTX).
pub(crate) struct Targets {
    archs: Option<Vec<String>>,
    pub(crate) skipped: Vec<Target>,
}

impl Targets {
    pub(crate) fn from_env(tc: &Toolchain) -> Targets {
        let archs = env_list("FLASH_ATTN_ARCHS");
        if let Some(a) = &archs {
            for name in a {
                assert!(
                    Target::ALL.iter().any(|t| t.name() == name),
                    "FLASH_ATTN_ARCHS: unknown target {name:?}; expected some of 80, 90a, 100a, ptx"
                );
            }
        }
        let mut t = Targets { archs, skipped: Vec::new() };
        t.skipped = Target::ALL.into_iter().filter(|&x| t.named(x) && tc.version < min_cuda(x)).collect();
        for &x in &t.skipped {
            let (maj, min) = min_cuda(x);
            println!(
                "cargo:warning=flash_attn: nvcc {}.{} cannot build sm_{} (needs CUDA {maj}.{min}+); those GPUs run the compute_80 PTX instead",
                tc.version.0,
                tc.version.1,
                x.name()
            );
        }
        t
    }

    fn named(&self, t: Target) -> bool {
        self.archs.as_ref().is_none_or(|a| a.iter().any(|n| n == t.name()))
    }

    fn wanted(&self, t: Target) -> bool {
        self.named(t) && !self.skipped.contains(&t)
    }
}

/// One job per (unit, wanted target): every family's (family, head_dim) units as pruned by
/// FLASH_ATTN_HDIMS, then the standalone kernels (no head dim); each unit is written to
/// OUT_DIR/gen and keyed into the cache with everything it includes.
pub(crate) fn jobs(
    root: &Path,
    out: &Path,
    tc: &Toolchain,
    include_dirs: &[PathBuf],
    targets: &Targets,
    hang_check: bool,
) -> Vec<Job> {
    let cache = cache::cache_dir(out);
    std::fs::create_dir_all(&cache).unwrap_or_else(|e| panic!("cannot create the kernel cache {}: {e}", cache.display()));
    let gen_dir = out.join("gen");
    std::fs::create_dir_all(&gen_dir).unwrap();
    let hdims = env_list("FLASH_ATTN_HDIMS");
    // Paths in the key are relative to OUT_DIR (which differs per profile) and to the crate's
    // root (which differs per checkout, and for `cargo package`'s copy): every file's content is
    // keyed, so one cache serves every checkout of the same sources. The `-lineinfo` of an image
    // names the paths of the build that compiled it first.
    let (out_s, root_s) = (out.display().to_string(), root.display().to_string());
    let portable = |s: &str| s.replace(&out_s, "$OUT_DIR").replace(&root_s, "$ROOT");
    // (image name, head_dim, source, unit file name, unit text).
    let mut units: Vec<(&'static str, u32, &'static str, String, String)> = Vec::new();
    for fam in FAMILIES {
        for tile in fam.tiles {
            if hdims.as_ref().is_some_and(|h| !h.contains(&tile.head_dim.to_string())) {
                continue;
            }
            let text = unit_source(fam, tile, &root.join(fam.source()).display().to_string(), hang_check);
            units.push((fam.name, tile.head_dim, fam.source(), format!("{}_hd{}.cu", fam.name, tile.head_dim), text));
        }
    }
    for s in STANDALONE {
        let text = standalone_unit_source(s, &root.join(s.source).display().to_string());
        units.push((s.name, STANDALONE_HEAD_DIM, s.source, format!("{}.cu", s.name), text));
    }
    let mut jobs = Vec::new();
    for (name, head_dim, source, unit_name, text) in units {
        let unit = gen_dir.join(unit_name);
        write_if_changed(&unit, &text);
        // Everything the unit reads but the toolkit's own headers (covered by its version).
        let mut deps = BTreeMap::new();
        collect_includes(&root.join(source), include_dirs, &mut deps);
        for &target in targets_for(source).iter().filter(|&&t| targets.wanted(t)) {
            let args = nvcc_args(target, include_dirs).join(" ");
            let key = cache::key(tc, &args, &text, &deps, &portable);
            let stem = image_stem(name, head_dim, target);
            let entry = format!("{stem}-{key:032x}");
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
    jobs
}

/// Compiles the jobs the cache misses, links every image into OUT_DIR, warns about spills, and
/// returns the summary (written to OUT_DIR/kernels-build.txt).
pub(crate) fn run(out: &Path, tc: &Toolchain, include_dirs: &[PathBuf], jobs: &[Job]) -> String {
    let start = Instant::now();
    let misses: Vec<&Job> = jobs.iter().filter(|j| !(j.cached_image.is_file() && j.cached_report.is_file())).collect();
    let threads = compile_all(tc, include_dirs, &misses);
    let secs = start.elapsed().as_secs_f64();
    for job in jobs {
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
        cache::cache_dir(out).display()
    );
    std::fs::write(out.join("kernels-build.txt"), &summary).unwrap();
    for job in jobs {
        let report = std::fs::read_to_string(&job.report).unwrap_or_default();
        if report_spills(&report) {
            println!(
                "cargo:warning=flash_attn: {} spills registers to local memory (see {})",
                image_stem(job.family, job.head_dim, job.target),
                job.report.display()
            );
        }
    }
    summary
}

/// A comma-separated env var, `None` when unset or empty.
fn env_list(name: &str) -> Option<Vec<String>> {
    let v = std::env::var(name).ok()?;
    let items: Vec<String> = v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    (!items.is_empty()).then_some(items)
}

/// Flags of every nvcc job besides the target's.
const COMMON_FLAGS: &[&str] = &["-std=c++17", "-O3", "-lineinfo"];

/// One nvcc invocation, or its cached result.
pub(crate) struct Job {
    pub(crate) family: &'static str,
    pub(crate) head_dim: u32,
    pub(crate) target: Target,
    pub(crate) unit: PathBuf,
    /// Where the image and report go in OUT_DIR (what kernels.rs includes).
    pub(crate) image: PathBuf,
    pub(crate) report: PathBuf,
    /// The cache entry of this exact input.
    pub(crate) cached_image: PathBuf,
    pub(crate) cached_report: PathBuf,
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
pub(crate) fn ptx_version(ptx: &str) -> Option<String> {
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
             CUDA release; install matching versions (scripts/toolchain/install-cuda.sh pins them)",
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
pub(crate) fn embedded_ptx_isa(jobs: &[Job]) -> Option<String> {
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

//! Finding and inspecting nvcc: `$NVCC`, `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, `PATH`, then the
//! PyPI toolchain `scripts/toolchain/install-cuda.sh` installs; its version, the targets and PTX
//! ISA it can build, and the fingerprint the cache key takes from it.

use crate::Target;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The nvcc to build with: found, run, and at least `MIN_CUDA` (`Err`: why there is none).
pub(crate) fn locate(root: &Path) -> Result<Toolchain, String> {
    let dirs = toolchain_dirs(root);
    watch_toolchain_dirs(&dirs);
    let Some(nvcc) = find_nvcc(&dirs) else {
        let mut looked = "$NVCC, $CUDA_HOME, $CUDA_PATH, PATH".to_string();
        for d in &dirs {
            write!(looked, ", {}", d.display()).unwrap();
        }
        return Err(format!("nvcc not found (looked at {looked})"));
    };
    println!("cargo:rerun-if-changed={}", nvcc.display());
    let tc = inspect(&nvcc)?;
    if tc.version < MIN_CUDA {
        return Err(format!(
            "{} is CUDA {}.{}, older than the {}.{} the kernels need",
            nvcc.display(),
            tc.version.0,
            tc.version.1,
            MIN_CUDA.0,
            MIN_CUDA.1
        ));
    }
    Ok(tc)
}

/// The oldest CUDA whose nvcc builds the kernels (FA3's sm_90a code and the headers need it).
const MIN_CUDA: (u32, u32) = (12, 4);

/// How a dependent crate gets the kernels; said by the warning and by the run-time error.
pub(crate) const HOW_TO_GET_KERNELS: &str = "To build the GPU kernels, point the build at an nvcc of CUDA 12.4 or newer: \
     set NVCC=/path/to/bin/nvcc (or CUDA_HOME / CUDA_PATH to a CUDA install, or put nvcc on PATH) and build again; \
     cargo rebuilds flash_attn when these change";

/// The nvcc in use.
pub(crate) struct Toolchain {
    pub(crate) nvcc: PathBuf,
    pub(crate) version: (u32, u32),
    /// What the cache key takes from the toolchain: version text, binaries' sizes and dates.
    pub(crate) fingerprint: String,
}

/// The first CUDA version whose nvcc builds a target.
pub(crate) fn min_cuda(t: Target) -> (u32, u32) {
    match t {
        Target::Sm80 | Target::Ptx80 => (11, 0),
        Target::Sm90a => (12, 0),
        Target::Sm100a => (12, 8),
    }
}

/// The oldest PTX ISA the drivers of a CUDA major version load (the ISA of its x.0 release).
pub(crate) fn oldest_ptx_isa(cuda_major: u32) -> Option<String> {
    match cuda_major {
        12 => Some("8.0".into()),
        13 => Some("9.0".into()),
        _ => None,
    }
}

/// The oldest driver that runs what a CUDA major version builds (minor version compatibility
/// for the cubins; the PTX is lowered to that driver's ISA).
pub(crate) fn min_driver(cuda_major: u32) -> &'static str {
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
pub(crate) fn is_dependency_source(root: &Path) -> bool {
    let parts: Vec<String> = root.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    parts.windows(2).any(|w| (w[0] == "registry" && w[1] == "src") || (w[0] == "git" && w[1] == "checkouts"))
}

/// Makes cargo rerun this script when a toolchain is installed or reinstalled: the stamp
/// `scripts/toolchain/install-cuda.sh` writes last, or (not installed yet) the directory the
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

/// A CUDA tool's file name on the build host (`nvcc`, or `nvcc.exe` on Windows).
pub(crate) fn exe(tool: &str) -> String {
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

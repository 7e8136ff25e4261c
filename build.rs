//! Compiles the CUDA kernels listed in build/instances.rs and embeds them. `main` below is the
//! order of the steps; each file under build/ has one job: `toolchain.rs` (find and inspect
//! nvcc), `cache.rs` (the content-keyed kernel cache), `compile.rs` (the nvcc jobs),
//! `emit.rs` (OUT_DIR/kernels.rs), `instances.rs` (the kernel table, shared with
//! src/cuda/table.rs), `numerics_header.rs` (the constants shared with the kernels).
//!
//! - Finds nvcc (`nvcc.exe` on Windows): `$NVCC`, `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, `PATH`,
//!   then the PyPI toolchain `scripts/toolchain/install-cuda.sh` puts in
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

use std::path::{Path, PathBuf};

include!("build/instances.rs");

#[path = "build/cache.rs"]
mod cache;
#[path = "build/compile.rs"]
mod compile;
#[path = "build/emit.rs"]
mod emit;
#[path = "build/numerics_header.rs"]
mod numerics_header;
#[path = "build/toolchain.rs"]
mod toolchain;

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
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        emit::no_kernels(&out, "the `cuda` feature is off");
        return;
    }
    let tc = match toolchain::locate(&root) {
        Ok(tc) => tc,
        Err(why) => return cpu_only(&root, &out, why),
    };
    let targets = compile::Targets::from_env(&tc);
    // Kernel headers, then the generated ones (the numerics constants).
    let include_dirs = [root.join("cuda"), generated_include];
    let jobs = compile::jobs(&root, &out, &tc, &include_dirs, &targets, hang_check());
    let summary = compile::run(&out, &tc, &include_dirs, &jobs);
    println!("cargo:rustc-cfg=fa_kernels");
    emit::kernels(&out, &jobs, &tc, targets.skipped, summary);
}

/// No kernels: a CPU-only crate with one warning saying why and how to get them, or (with
/// FLASH_ATTN_REQUIRE_NVCC=1) a failed build.
fn cpu_only(root: &Path, out: &Path, why: String) {
    if std::env::var("FLASH_ATTN_REQUIRE_NVCC").is_ok_and(|v| v == "1") {
        panic!("FLASH_ATTN_REQUIRE_NVCC=1 but {why}; run scripts/toolchain/install-cuda.sh");
    }
    let local = if toolchain::is_dependency_source(root) {
        String::new()
    } else {
        " (in this repository: scripts/toolchain/install-cuda.sh installs CUDA 13.0 from PyPI into .cuda-toolchain/)"
            .to_string()
    };
    let msg = format!("{why}; building CPU-only. {}{local}", toolchain::HOW_TO_GET_KERNELS);
    println!("cargo:warning=flash_attn: {msg}");
    emit::no_kernels(out, &msg);
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

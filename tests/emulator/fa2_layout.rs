//! Host checks of the FA2 kernel (cuda/fa2_fwd.cu) with g++, no GPU and no CUDA headers needed:
//!
//! - `fa2_fragment_layout`: cuda/test/fa2_layout_test.cpp models ldmatrix (.x4, .trans) and
//!   mma.m16n8k16 from the PTX ISA, checks every fragment map of cuda/fa2/layout.h
//!   against it, replays the kernel's warp loops on integer tiles for every head dim, and checks
//!   ldmatrix bank conflicts and load coverage (about 0.1 s to run).
//!
//! It shares one reading of the PTX ISA with the kernel: it checks the index math, not the hardware
//! (docs/fa2.md, "Known risks"). The whole kernel runs in the CPU emulator: tests/emulator/forward.rs,
//! `fa2_all_instances`. g++ is required (nvcc needs it too): a missing g++ fails this test with a
//! message saying so.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs g++ with `args`, failing the test clearly when g++ is absent or the compile fails.
fn gxx(args: &[&str], sources: &[PathBuf], exe: &Path) {
    let out = Command::new("g++")
        .args(args)
        .arg("-I")
        .arg(root().join("cuda"))
        .args(sources)
        .arg("-o")
        .arg(exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run g++ ({e}): these host checks of the FA2 kernel need g++ on PATH"));
    assert!(out.status.success(), "g++ failed on {sources:?}:\n{}", String::from_utf8_lossy(&out.stderr));
}

fn run(exe: &Path, args: &[&str]) -> (Output, String) {
    let out = Command::new(exe).args(args).output().unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    let log = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out, log)
}

#[test]
fn fa2_fragment_layout() {
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fa2_layout_test");
    gxx(&["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror"], &[root().join("cuda/test/fa2_layout_test.cpp")], &exe);
    let (out, log) = run(&exe, &[]);
    println!("{log}");
    assert!(out.status.success(), "fa2_layout_test failed:\n{log}");
}

//! The opt-in hang-check build (FLASH_ATTN_HANG_CHECK=1, cuda/sm90/hang_check.cuh, docs/fa3.md
//! "Hang check"), without a GPU or nvcc: `wait_policy_reports_then_traps` runs the kernels' own
//! wait loop and report text on the host (cuda/test/hang_check_test.cpp, g++) with a fake clock: a
//! wait that never completes prints block, warp, barrier (name, smem offset) and parity after the
//! limit, then traps; a wait that completes in time prints nothing. The nvcc-built side is
//! tests/toolchain/hang_check.rs.

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn wait_policy_reports_then_traps() {
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hang_check_test");
    let built = Command::new("g++")
        .args([
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-D__host__=",
            "-D__device__=",
        ])
        .arg("-I")
        .arg(root().join("cuda"))
        .arg(root().join("cuda/test/hang_check_test.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run g++ ({e}): this host check needs g++ on PATH"));
    assert!(
        built.status.success(),
        "g++ failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );

    let hung = Command::new(&exe).output().expect("run hang_check_test");
    let log = String::from_utf8_lossy(&hung.stdout).into_owned();
    println!("{log}");
    assert_eq!(
        hung.status.code(),
        Some(3),
        "a never-completing wait must end in the trap:\n{log}"
    );
    let lines: Vec<&str> = log.lines().collect();
    let want = [
        "flash_attn hang check: HANG: block (3,1,0) warp 4 thread 130: mbarrier k_full[1] (smem +0x14010) parity 1",
        "flash_attn hang check:   not complete after 1001 ms (144 polls)",
        "flash_attn hang check:   board: block (3,1,0) warp 0: mbarrier k_empty[0] (smem +0x14028) parity 0",
        "flash_attn hang check:   board: block (3,1,0) warp 8: named barrier 2 (bar.sync, 256 threads)",
        "flash_attn hang check: TRAP: block (3,1,0) warp 4 thread 130: mbarrier k_full[1] (smem +0x14010) parity 1",
        "flash_attn hang check:   not complete after 2002 ms (287 polls); trapping",
        "hang_check_test: trap after 1 report(s), 287 polls",
    ];
    assert_eq!(lines, want, "report text");

    let done = Command::new(&exe)
        .arg("done")
        .output()
        .expect("run hang_check_test done");
    let log = String::from_utf8_lossy(&done.stdout).into_owned();
    assert!(done.status.success(), "{log}");
    assert_eq!(log.trim(), "hang_check_test: completed after 5 polls, 0 report(s)");
}

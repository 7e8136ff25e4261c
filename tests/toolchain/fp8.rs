//! The FP8 kernels as nvcc compiles them (compile-checked only; docs/fp8.md "On Hopper"; their
//! arithmetic runs in the emulator, tests/emulator/fp8.rs):
//!
//! * `fp8_kernels_sass`: the pre-pass and the consumers for sm_90a have no local memory and use
//!   the instructions they claim (QGMMA e4m3, the saturating e4m3 conversion, TMA, setmaxnreg);
//! * `cute_e4m3_forms`: our e4m3 wgmma wrappers compile to the same QGMMA instructions as CuTe's.
//!
//! Both are `#[ignore]`d (they need nvcc, and the second the CuTe headers):
//! `cargo test --test toolchain -- --ignored` runs them, and a missing nvcc is then a failure.

use crate::support::emu::{generated_include, root};
use crate::support::{cutlass_include, find_nvcc};
use std::path::PathBuf;
use std::process::Command;

fn work_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fp8_toolchain").join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compiles `src` for sm_90a with `ptxas -v` and returns (ptxas report, SASS).
fn sm90a_sass(src: &str) -> (String, String) {
    let nvcc = find_nvcc().expect("nvcc not found (set NVCC or run scripts/toolchain/install-cuda.sh)");
    let dir = work_dir("sass");
    let cubin = dir.join(format!("{}.cubin", src.replace('/', "_")));
    let root = root();
    let out = Command::new(&nvcc)
        .args(["-std=c++17", "-O3", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-I"])
        .arg(root.join("cuda"))
        .arg("-I")
        .arg(generated_include())
        .arg("-o")
        .arg(&cubin)
        .arg(root.join(src))
        .output()
        .expect("run nvcc");
    let report = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "nvcc failed on {src}:\n{report}");
    let cuobjdump = nvcc.with_file_name("cuobjdump");
    let sass = Command::new(&cuobjdump).arg("--dump-sass").arg(&cubin).output().expect("run cuobjdump");
    assert!(sass.status.success(), "cuobjdump failed: {}", String::from_utf8_lossy(&sass.stderr));
    (report, String::from_utf8_lossy(&sass.stdout).into_owned())
}

/// Compile-only (no GPU): the FP8 kernels for sm_90a have no local memory (ptxas: 0 bytes stack
/// frame and spills for every kernel; SASS: no LDL/STL), the consumer's products are QGMMA
/// e4m3 instructions, and both convert to e4m3 with the saturating hardware conversion.
/// `#[ignore]`d: needs nvcc (`cargo test --test toolchain -- --ignored`); a missing nvcc is
/// then a failure, never a skip.
#[test]
#[ignore = "needs nvcc (CUDA 13): cargo test --test toolchain -- --ignored"]
fn fp8_kernels_sass() {
    for (src, kernels, expect) in [
        ("cuda/fp8_prepass.cu", 8, &["F2FP.SATFINITE.E4M3.F32", "SHFL.BFLY"][..]),
        (
            "cuda/fa3_fp8_fwd_sm90.cu",
            30, // stages 1-5 x head_dim 64 / 128 / 256 x f16 / bf16
            &[
                "QGMMA.64x64x32.F32.E4M3.E4M3",
                "F2FP.SATFINITE.E4M3.F32",
                "SHFL.IDX",
                "PRMT",
                "UTMALDG.4D",
                "SYNCS",
                "USETMAXREG",
                "BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", // stages 4-5: the ping-pong's named barriers
                "BAR.ARV 0x2, 0x100",
            ][..],
        ),
    ] {
        let (report, sass) = sm90a_sass(src);
        let props = report.matches("Function properties for").count();
        assert_eq!(props, kernels, "{src}: kernels in the ptxas report:\n{report}");
        assert_eq!(
            report.matches("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads").count(),
            kernels,
            "{src}: local memory:\n{report}"
        );
        for bad in ["LDL", "STL"] {
            assert!(!sass.contains(bad), "{src}: {bad} in the SASS");
        }
        for want in expect {
            assert!(sass.contains(want), "{src}: no {want} in the SASS");
        }
        println!("{src}: {kernels} kernels, no local memory, {expect:?} present");
    }
}

/// The QGMMA / WARPGROUP instructions of each kernel of a SASS dump, register numbers dropped.
fn qgmma_instructions(sass: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for line in sass.lines() {
        if let Some(name) = line.trim().strip_prefix("Function : ") {
            out.push((name.trim().to_string(), Vec::new()));
            continue;
        }
        let Some(code) = line.trim().strip_prefix("/*").and_then(|l| l.split_once("*/")).map(|(_, c)| c) else {
            continue;
        };
        let code = code.split(';').next().unwrap_or("").trim();
        if !(code.starts_with("QGMMA") || code.starts_with("WARPGROUP")) {
            continue;
        }
        let mut norm = String::new();
        let mut chars = code.chars().peekable();
        while let Some(c) = chars.next() {
            norm.push(c);
            // A register name: R<digits> or UR<digits> starting a word.
            let before = &norm[..norm.len() - 1];
            let word_start = |s: &str| !s.ends_with(|p: char| p.is_ascii_alphanumeric());
            if c == 'R' && (word_start(before) || before.strip_suffix('U').is_some_and(word_start)) {
                while chars.peek().is_some_and(|d| d.is_ascii_digit()) {
                    chars.next();
                }
            }
        }
        if let Some((_, v)) = out.last_mut() {
            v.push(norm);
        }
    }
    out
}

/// Compile-only: our e4m3 wgmma wrappers become the same QGMMA instructions as CuTe's
/// MMA_64x64x32_F32E4M3E4M3_{SS,RS}_TN (cuda/test/oracle/gmma_forms_fp8.cu), register numbers
/// aside: operand kinds, K-major forms, accumulate / overwrite.
#[test]
#[ignore = "needs the CuTe headers (scripts/toolchain/install-cutlass.sh) and nvcc"]
fn cute_e4m3_forms() {
    let nvcc = find_nvcc().expect("nvcc not found (set NVCC or run scripts/toolchain/install-cuda.sh)");
    let dir = work_dir("cute");
    let cubin = dir.join("gmma_forms_fp8.cubin");
    let root = root();
    let out = Command::new(&nvcc)
        .args(["-std=c++17", "-O3", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-isystem"])
        .arg(cutlass_include())
        .arg("-I")
        .arg(root.join("cuda"))
        .arg("-I")
        .arg(generated_include())
        .arg(root.join("cuda/test/oracle/gmma_forms_fp8.cu"))
        .arg("-o")
        .arg(&cubin)
        .output()
        .expect("run nvcc");
    assert!(out.status.success(), "nvcc failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let dump =
        Command::new(nvcc.with_file_name("cuobjdump")).arg("--dump-sass").arg(&cubin).output().expect("cuobjdump");
    assert!(dump.status.success(), "cuobjdump failed");
    let kernels = qgmma_instructions(&String::from_utf8_lossy(&dump.stdout));
    for form in ["ss_acc", "ss_zero", "rs"] {
        let find = |imp: &str| {
            let name = format!("{imp}_e4m3_{form}");
            kernels.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone()).unwrap_or_else(|| panic!("no {name}"))
        };
        let (ours, cute) = (find("ours"), find("cute"));
        println!("{form}: ours {ours:?}\n{form}: CuTe {cute:?}");
        assert!(ours.iter().any(|i| i.starts_with("QGMMA.64x64x32.F32.E4M3.E4M3")), "{form}: no QGMMA");
        assert_eq!(ours, cute, "{form}: our e4m3 wgmma differs from CuTe's");
    }
}

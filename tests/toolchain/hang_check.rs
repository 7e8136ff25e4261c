//! The opt-in hang-check build (FLASH_ATTN_HANG_CHECK=1, cuda/sm90/hang_check.cuh, docs/fa3.md
//! "Hang check") as nvcc compiles it (compile-checked only; the wait policy itself runs on the host
//! in tests/emulator/hang_check.rs):
//! - `hang_check_build_bounds_every_wait`: build.rs's FA3 units for stages 2-5 compiled with
//!   FA_HANG_CHECK: in the PTX every `mbarrier.try_wait` of a kernel is either followed by the
//!   call to the bounded wait or inside it, the bounded wait reads %globaltimer, printf's and
//!   traps; the SASS has BPT.TRAP;
//! - `embedded_images_match_the_build`: the kernels embedded by this build have the bounded waits
//!   (BPT.TRAP in every FA3 stage 2-5 cubin) exactly when build.rs saw FLASH_ATTN_HANG_CHECK=1;
//!   the normal build has none (its wait loop is the plain one).

use crate::support::emu::root;
use flash_attn::cuda::table::{unit_source, KernelOptions, Target, CUOBJDUMP, FAMILIES, IMAGES, NVCC};
use std::path::Path;
use std::process::Command;

/// The unit build.rs generates for (family, head dim), with the hang check on or off.
fn unit(family: &str, head_dim: u32, hang: bool) -> String {
    let fam = FAMILIES.iter().find(|f| f.name == family).expect("family in the table");
    let tile = fam.tiles.iter().find(|t| t.head_dim == head_dim).expect("tile");
    unit_source(fam, tile, &root().join(fam.source()).display().to_string(), hang)
}

fn nvcc(args: &[&str], input: &Path, output: &Path) {
    let out = Command::new(NVCC)
        .args(["-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a"])
        .args(args)
        .arg("-I")
        .arg(root().join("cuda"))
        .arg("-I")
        .arg(Path::new(env!("OUT_DIR")).join("include")) // the generated numerics constants
        .arg(input)
        .arg("-o")
        .arg(output)
        .output()
        .expect("run nvcc");
    assert!(
        out.status.success(),
        "nvcc failed on {}:\n{}",
        input.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn sass(cubin: &Path) -> String {
    assert!(!CUOBJDUMP.is_empty(), "no cuobjdump next to nvcc");
    let out = Command::new(CUOBJDUMP)
        .arg("--dump-sass")
        .arg(cubin)
        .output()
        .expect("run cuobjdump");
    assert!(
        out.status.success(),
        "cuobjdump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// PTX of one unit split into (name, body) per `.entry` / `.func`.
fn functions(ptx: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in ptx.lines() {
        let t = line.trim_start();
        let head = t.strip_prefix(".visible ").unwrap_or(t);
        // Definitions open their parameter list on the name's line; declarations do not.
        if (head.starts_with(".entry ") || head.starts_with(".func ")) && t.ends_with('(') {
            let name = head
                .split_whitespace()
                .last()
                .unwrap_or("")
                .trim_end_matches('(')
                .to_string();
            out.push((name, String::new()));
        } else if let Some((_, body)) = out.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    out
}

#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time")]
fn hang_check_build_bounds_every_wait() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hang-check");
    std::fs::create_dir_all(&dir).unwrap();
    for stage in 2..=5 {
        let family = format!("fa3s{stage}");
        let cu = dir.join(format!("{family}_hd64.cu"));
        let ptx = dir.join(format!("{family}_hd64.ptx"));
        std::fs::write(&cu, unit(&family, 64, true)).unwrap();
        nvcc(&["-ptx"], &cu, &ptx);
        let text = std::fs::read_to_string(&ptx).unwrap();
        let funcs = functions(&text);
        let checked = funcs
            .iter()
            .find(|(n, _)| n.contains("mbar_wait_checked"))
            .unwrap_or_else(|| panic!("{family}: no out-of-line bounded wait in the PTX"));
        // The bounded wait: a clock, a report (printf through the report function), a trap.
        assert!(
            checked.1.contains("%globaltimer"),
            "{family}: the bounded wait reads no clock"
        );
        assert!(checked.1.contains("trap;"), "{family}: the bounded wait never traps");
        assert!(
            checked.1.contains("mbarrier.try_wait"),
            "{family}: the bounded wait does not poll"
        );
        let report = funcs
            .iter()
            .find(|(n, _)| n.contains("fa_hang6report"))
            .expect("report function");
        assert!(report.1.contains("vprintf"), "{family}: the report prints nothing");
        let entries: Vec<_> = funcs
            .iter()
            .filter(|(n, _)| n.starts_with(&format!("{family}_fwd_hd64_")))
            .collect();
        assert_eq!(entries.len(), 2, "{family}: bf16 and f16 kernels");
        for (name, body) in entries {
            let tries = body.matches("mbarrier.try_wait").count();
            let calls = body.matches("mbar_wait_checked").count(); // the callee line of each call
            assert!(tries > 0, "{name}: no mbarrier wait at all?");
            assert_eq!(
                tries, calls,
                "{name}: {tries} mbarrier probes but {calls} bounded waits"
            );
            assert!(!body.contains("trap;") || body.contains("mbar_wait_checked"), "{name}");
        }
        if stage == 5 {
            // ptxas keeps the trap (compile-checked only: nothing has run on a GPU).
            let cubin = dir.join(format!("{family}_hd64.cubin"));
            nvcc(&["-cubin"], &cu, &cubin);
            let s = sass(&cubin);
            assert!(s.contains("BPT.TRAP"), "{family}: no BPT.TRAP in the SASS");
            assert!(s.contains("GLOBALTIMER"), "{family}: no clock read in the SASS");
        }
    }
}

#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time: no kernels embedded")]
fn embedded_images_match_the_build() {
    let hang = cfg!(fa_hang_check);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hang-check-images");
    std::fs::create_dir_all(&dir).unwrap();
    let mut checked = 0;
    for img in IMAGES
        .iter()
        .filter(|i| i.target == Target::Sm90a && FAMILIES.iter().any(|f| f.name == i.family && f.stage.is_some_and(|s| s >= 2)))
    {
        let cubin = dir.join(format!("{}_hd{}.cubin", img.family, img.head_dim));
        std::fs::write(&cubin, img.bytes).unwrap();
        let s = sass(&cubin);
        // An FP8 family's image also holds its pre-pass, whose parameter guard traps in every
        // build (cuda/fp8_prepass.cu): there the clock read alone tells the builds apart.
        let fp8 = FAMILIES.iter().any(|f| f.name == img.family && f.options.contains(KernelOptions::FP8));
        assert_eq!(
            s.contains("BPT.TRAP"),
            hang || fp8,
            "{} hd{}: trap present = {hang} expected",
            img.family,
            img.head_dim
        );
        assert_eq!(
            s.contains("GLOBALTIMER"),
            hang,
            "{} hd{}: clock read",
            img.family,
            img.head_dim
        );
        checked += 1;
    }
    println!("{checked} FA3 sm_90a images checked (hang-check build: {hang})");
    if IMAGES.iter().any(|i| i.target == Target::Sm90a) {
        assert!(checked > 0, "sm_90a was built but no FA3 stage 2-5 image found");
    }
}

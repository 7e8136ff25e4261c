//! The FA3 host layout model (cuda/test/fa3_layout_sim.cpp, docs/fa3.md): compiled with g++
//! against the kernel's own `__host__ __device__` offset, descriptor and fragment helpers, it
//! models TMA's SWIZZLE_128B placement and wgmma's operand fetch and accumulator layout, checks
//! S = QKᵀ and O = S·V exactly for every stage and head dim, and brute-forces the tile-range
//! and mask-skip predicates against the visibility rule. About 5 s (g++ ~4 s, run < 1 s).
//!
//! It proves the layouts consistent with the documented model, not with the silicon: only a
//! GPU run can (tests/gpu/, fa3_stage*). Needs the CUDA headers (cuda_bf16.h) of
//! the toolchain build.rs used: ignored, with the reason, when none was found.
use flash_attn::cuda::table::{FAMILIES, NVCC};
use std::path::Path;
use std::process::Command;

#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time: no CUDA headers for the FA3 layout model")]
fn fa3_layouts_match_the_tma_and_wgmma_model() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fa3-layout-sim");
    let toolkit = Path::new(NVCC).parent().and_then(Path::parent).expect("nvcc lives in <toolkit>/bin");
    let built = Command::new("g++")
        .args(["-std=c++17", "-O2", "-D__host__=", "-D__device__=", "-D__forceinline__=inline"])
        .arg("-isystem")
        .arg(toolkit.join("include"))
        .arg("-I")
        .arg(root.join("cuda"))
        .arg(root.join("cuda/test/fa3_layout_sim.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run g++");
    assert!(built.status.success(), "g++ failed:\n{}", String::from_utf8_lossy(&built.stderr));
    let run = Command::new(&exe).output().expect("run the layout model");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "layout model failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("consistent with key_visible"), "no predicate brute force:\n{stdout}");
    // Every row of the table's FA3 ladder was modelled with the table's tile, and came out exact.
    for stage in 1..=5 {
        let fam = FAMILIES.iter().find(|f| f.name == format!("fa3s{stage}")).expect("FA3 ladder row");
        for t in fam.tiles {
            let line = format!("stage {stage} hd {:>3} (BM {:>3}, BN {:>3}): S and O exact", t.head_dim, t.block_m, t.block_n);
            assert!(stdout.lines().any(|l| l.ends_with(&line)), "no {line:?} in:\n{stdout}");
        }
    }
}

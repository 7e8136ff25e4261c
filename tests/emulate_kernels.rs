//! Kernel logic on the CPU, no GPU needed: for each family with a `cpu_emulation` harness in
//! build/instances.rs (FA1), compile its kernel source with g++ and cuda/emu/cuda_host_shim.h
//! (one std::thread per CUDA thread, barriers for __syncthreads and warp shuffles) once per
//! instantiated tile, run the harness's cases (causal with empty rows, windows, softcap, ALiBi,
//! GQA/MQA, head-dim tails, LSE) and require every output within rounding of its float64
//! reference, with outputs and shared memory poisoned with NaN.
//!
//! This checks indexing, masking, the online softmax and synchronization logic; it cannot check
//! timing, memory-model subtleties or anything the GPU compiler does differently. Needs the CUDA
//! headers of the toolchain build.rs used (ignored, with the reason, when none was found).
#![cfg(feature = "cuda")]

use flash_attn::cuda::kernels::{FAMILIES, NVCC};
use std::path::{Path, PathBuf};
use std::process::Command;

/// `-I` dirs of the CUDA headers next to the nvcc build.rs used.
fn cuda_includes() -> Vec<PathBuf> {
    let top = Path::new(NVCC).parent().and_then(Path::parent).expect("nvcc lives in <toolkit>/bin");
    [top.join("include"), top.join("include/cccl")].into_iter().filter(|p| p.is_dir()).collect()
}

#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time: no CUDA headers to emulate the kernels with")]
fn kernels_on_cpu_emulation() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let mut jobs = Vec::new();
    for fam in FAMILIES {
        let Some(harness) = fam.cpu_emulation else { continue };
        for tile in fam.tiles {
            jobs.push((fam, tile, harness));
        }
    }
    assert!(!jobs.is_empty(), "no family has a CPU emulation harness");
    let results: Vec<(String, bool, String)> = std::thread::scope(|s| {
        // Two at a time: each block already runs 128 threads.
        jobs.chunks(2)
            .flat_map(|pair| {
                let handles: Vec<_> = pair
                    .iter()
                    .map(|&(fam, tile, harness)| {
                        s.spawn(move || {
                            let name = format!("{}_hd{}", fam.name, tile.head_dim);
                            let exe = tmp.join(format!("emu_{name}"));
                            let mut cc = Command::new("g++");
                            cc.args(["-std=c++20", "-O2", "-pthread"])
                                .arg(format!("-DFA_HEAD_DIM={}", tile.head_dim))
                                .arg(format!("-DFA_BLOCK_M={}", tile.block_m))
                                .arg(format!("-DFA_BLOCK_N={}", tile.block_n))
                                .arg(format!("-DFA_THREADS={}", tile.threads))
                                .arg(format!("-DFA_SMEM_BYTES={}", (fam.smem_bytes)(tile)))
                                .arg("-I")
                                .arg(root.join("cuda/include"));
                            for inc in cuda_includes() {
                                cc.arg("-isystem").arg(inc);
                            }
                            cc.arg(root.join(harness)).arg("-o").arg(&exe);
                            let built = cc.output().expect("run g++ (nvcc needs it too)");
                            if !built.status.success() {
                                return (name, false, String::from_utf8_lossy(&built.stderr).into_owned());
                            }
                            let run = Command::new(&exe).output().expect("run the emulation");
                            let log = String::from_utf8_lossy(&run.stdout).into_owned()
                                + &String::from_utf8_lossy(&run.stderr);
                            (name, run.status.success(), log)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
            })
            .collect()
    });
    let mut failed = Vec::new();
    for (name, ok, log) in &results {
        println!("== {name}: {}\n{log}", if *ok { "ok" } else { "FAILED" });
        if !ok {
            failed.push(name.as_str());
        }
    }
    assert!(failed.is_empty(), "CPU emulation failed for {failed:?} (logs above)");
}

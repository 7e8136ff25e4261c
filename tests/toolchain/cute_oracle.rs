//! The CuTe oracle (cuda/test/oracle/): our sm_90a and sm_80 layouts against NVIDIA's own
//! definitions in CUTLASS/CuTe, compiled on the host with g++ (no GPU):
//! - every wgmma descriptor the FA3 mainloop issues (Q and K K-major, V MN-major, 128B swizzle,
//!   every stage and head dim) equals, bit for bit, CuTe's `make_gmma_desc` for the same
//!   instruction block of the same tile (only LBO of the N = 64 MN-major V descriptor differs:
//!   unused there, CuTe writes 0), with the k-step start offsets derived from CuTe's layout;
//! - the tile storage (plain loads and the TMA placement model), the 128B swizzle, the wgmma
//!   operand fetch of cuda/test/fa3_layout_sim.cpp, the accumulator map and the P -> A register
//!   reuse equal CuTe's layouts / `CLayout_64xN` / `ALayout_64x16`;
//! - the sm_80 mma.m16n8k16 A/B/C maps and ldmatrix(.trans) maps of cuda/fa2/layout.h and
//!   cuda/test/fa2_layout_test.cpp equal CuTe's SM80 MMA traits and SM75 LDSM copy traits;
//! - e4m3 (FP8) K-major descriptors, and deliberate mutations are detected;
//! - the emulator's layout decoders (cuda/test/emu/sm90_layouts.h, sm80_layouts.h; checked by
//!   cuda/test/oracle/check_emu.cpp): descriptor fields against CuTe's `GmmaDescriptor` bitfield,
//!   the operand fetch through CuTe's own descriptors for every oracle tile (every swizzle mode,
//!   K- and MN-major, 16- and 8-bit), LBO ignored where unused (the N = 64 V), the swizzles, TMA
//!   box placement, the wgmma accumulator / A16 / A8 maps, mma.sync and ldmatrix(.trans) maps,
//!   and 25 deliberately wrong decoders are caught;
//! - the sm_100a (tcgen05) encodings (cuda/test/oracle/check_sm100.cpp): the FA4 kernels' UMMA
//!   shared-memory and instruction descriptors and the emulator's decoders (sm100_layouts.h)
//!   against CuTe's `UMMA::SmemDescriptor`, `InstrDescriptor`, `make_instr_desc` and
//!   `make_umma_desc` of the same tiles, and the operand fetch against CuTe's layouts;
//! - `our_wgmma_instructions_equal_cutes` (compile-checked only): our wgmma wrappers and CuTe's
//!   MMA_64x64x16 SS / RS ops, compiled for sm_90a (cuda/test/oracle/gmma_forms.cu), become the same
//!   HGMMA instructions (operand kinds, `.tnspB`, accumulate vs overwrite), bf16 and f16.
//!
//! CuTe is a test-only dependency installed by scripts/toolchain/install-cutlass.sh (nvidia-cutlass from
//! PyPI, pinned); it needs the CUDA toolkit's headers too. Hence `#[ignore]`: scripts/test.sh
//! installs both and runs it with `--ignored` (FLASH_ATTN_CUTLASS_INCLUDE names the headers; else
//! `.cutlass/` of this checkout is used). About 30 s, almost all of it compiling CuTe.
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::cutlass_include;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The CUDA toolkit's include directories (cuda_bf16.h; CUDA 13 keeps cuda/std in include/cccl).
fn cuda_includes() -> Vec<PathBuf> {
    let nvcc = [
        flash_attn::cuda::table::NVCC.to_string(),
        std::env::var("NVCC").unwrap_or_default(),
    ]
    .into_iter()
    .find(|p| !p.is_empty() && Path::new(p).is_file())
    .expect("no nvcc (build.rs found none and $NVCC is unset): the oracle needs the CUDA toolkit's headers");
    let toolkit = Path::new(&nvcc)
        .parent()
        .and_then(Path::parent)
        .expect("nvcc lives in <toolkit>/bin")
        .to_path_buf();
    [toolkit.join("include"), toolkit.join("include/cccl")]
        .into_iter()
        .filter(|p| p.is_dir())
        .collect()
}

fn compile(args: &[&str], includes: &[(&str, &Path)], source: &Path, object: &Path) -> std::process::Child {
    let mut cmd = Command::new("g++");
    cmd.args(["-std=c++17", "-O1", "-c"]).args(args);
    for (flag, dir) in includes {
        cmd.arg(flag).arg(dir);
    }
    cmd.arg(source).arg("-o").arg(object);
    cmd.stderr(std::process::Stdio::piped());
    cmd.spawn().unwrap_or_else(|e| panic!("cannot run g++ ({e})"))
}

#[test]
#[ignore = "needs the CuTe headers (scripts/toolchain/install-cutlass.sh) and the CUDA headers; scripts/test.sh runs it"]
fn our_layouts_equal_cute() {
    let cutlass = cutlass_include();
    let cuda = cuda_includes();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cute-oracle");
    std::fs::create_dir_all(&dir).unwrap();
    let src = root().join("cuda/test/oracle");
    let kernel_inc = root().join("cuda");
    let cuda_sys: Vec<(&str, &Path)> = cuda.iter().map(|p| ("-isystem", p.as_path())).collect();
    let cute_incs: Vec<(&str, &Path)> = [("-isystem", cutlass.as_path())]
        .into_iter()
        .chain(cuda_sys.iter().copied())
        .collect();
    let sm90_incs: Vec<(&str, &Path)> = cuda_sys.iter().copied().chain([("-I", kernel_inc.as_path())]).collect();
    let sm80_incs = vec![("-I", kernel_inc.as_path())];
    let emu_inc = root().join("cuda/test/emu");
    let emu_incs = vec![("-I", emu_inc.as_path())];
    let sm100_incs = vec![("-I", kernel_inc.as_path()), ("-I", emu_inc.as_path())];
    let warn = vec!["-Wall", "-Wextra"];
    // The kernel headers' __host__ __device__ helpers as plain host functions.
    let host = vec![
        "-Wall",
        "-Wextra",
        "-D__host__=",
        "-D__device__=",
        "-D__forceinline__=inline",
    ];
    let jobs = [
        ("cute_maps", &warn, &cute_incs),
        ("check_sm90", &host, &sm90_incs),
        ("check_sm80", &warn, &sm80_incs),
        ("check_emu", &warn, &emu_incs),
        ("cute_maps_sm100", &warn, &cute_incs),
        ("check_sm100", &host, &sm100_incs),
        ("oracle_main", &warn, &vec![]),
    ];
    // Two at a time: the CuTe unit dominates (about 20 s of g++), the rest is a few seconds.
    let mut objects = Vec::new();
    let mut running = Vec::new();
    for (name, args, incs) in &jobs {
        let obj = dir.join(format!("{name}.o"));
        running.push((name, compile(args, incs, &src.join(format!("{name}.cpp")), &obj)));
        objects.push(obj);
        if running.len() == 2 {
            let (n, child) = running.remove(0);
            wait_ok(n, child);
        }
    }
    for (n, child) in running {
        wait_ok(n, child);
    }
    let exe = dir.join("cute-oracle");
    let link = Command::new("g++")
        .args(&objects)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run g++");
    assert!(
        link.status.success(),
        "link failed:\n{}",
        String::from_utf8_lossy(&link.stderr)
    );

    let run = Command::new(&exe).output().expect("run the oracle");
    let log = String::from_utf8_lossy(&run.stdout).into_owned() + &String::from_utf8_lossy(&run.stderr);
    println!("{log}");
    assert!(run.status.success(), "our layouts differ from CuTe's:\n{log}");
    // Every group ran and agreed (a group that silently checked nothing would not print).
    let mut expected: Vec<String> = vec![
        "cute-oracle: CUTLASS 4.2.0".into(),
        "cute-oracle sm90: 128B swizzle".into(),
        "cute-oracle sm90: canonical atoms = swizzle(linear offset)".into(),
        "cute-oracle sm90: MN-major LBO with N = 128, 256 instructions".into(),
        "cute-oracle sm90: wgmma accumulator and P->A register fragments".into(),
        "cute-oracle sm90: e4m3 K-major SW128 / SW64 descriptors".into(),
        "cute-oracle sm90: mutations (SBO, swizzle mode, k step, V key step, A registers, C halves): 6 of 6 detected"
            .into(),
        "cute-oracle sm80: mma.m16n8k16 A/B/C fragments".into(),
        "cute-oracle sm80: ldmatrix .x4 / .x4.trans".into(),
        "cute-oracle sm80: FA2 ldmatrix addressing -> mma fragments, P reuse".into(),
        "cute-oracle sm80: mutations (A halves, B registers, V without .trans): 3 of 3 detected".into(),
        "cute-oracle emu: descriptor fields".into(),
        "cute-oracle emu: swizzle_addr".into(),
        "cute-oracle emu: operand_addr through CuTe's descriptors".into(),
        "cute-oracle emu: tma_smem_addr".into(),
        "cute-oracle emu: wgmma fragments".into(),
        "cute-oracle emu: sm_80 mma_a/b/c_coord".into(),
        "cute-oracle emu: operand_addr ignores LBO where the layout does not use it".into(),
        "cute-oracle emu: mutations (operand addressing x6, LBO use, descriptor fields x4, desc_problem, swizzle x2, \
         TMA, accumulator x2, A16, A8 x2, mma A/B/C, ldmatrix x2): 25 of 25 detected"
            .into(),
        "cute-oracle sm100: UMMA descriptor fields (decode_umma_desc, encode_umma_desc)".into(),
        "cute-oracle sm100: instruction descriptor (umma_idesc_f16, decode_idesc)".into(),
        "cute-oracle sm100: FA4 descriptors and operand fetch (Q/K/P K-major slab, V MN-major N = 64 / 128)".into(),
        "cute-oracle sm100: mutations (MN-major LBO/SBO swapped, layout field at the sm_90 position): 2 of 2 detected"
            .into(),
    ];
    for stage in 1..=5 {
        expected.push(format!(
            "cute-oracle sm90: stage {stage} storage (hd 64/128/256, Q/K/V)"
        ));
        expected.push(format!(
            "cute-oracle sm90: stage {stage} descriptors and operand fetch (hd 64/128/256, Q/K/V)"
        ));
    }
    for want in &expected {
        let line = log.lines().find(|l| l.starts_with(want.as_str()));
        assert!(line.is_some(), "no line starting {want:?} in:\n{log}");
        let line = line.unwrap();
        assert!(
            line.contains("equal to CuTe") || line.contains("detected") || line.contains("CUTLASS"),
            "{line}"
        );
        // "N checks" (after the last ": "): at least one element was compared.
        if let Some(n) = line
            .rsplit(": ")
            .next()
            .and_then(|s| s.split(' ').next())
            .and_then(|n| n.parse::<u64>().ok())
        {
            assert!(n > 0, "{line}");
        }
    }
}

/// nvcc (build.rs's, else $NVCC) and the cuobjdump next to it.
fn nvcc_and_cuobjdump() -> (PathBuf, PathBuf) {
    let nvcc = [
        flash_attn::cuda::table::NVCC.to_string(),
        std::env::var("NVCC").unwrap_or_default(),
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
    .expect("no nvcc (build.rs found none and $NVCC is unset)");
    let cuobjdump = nvcc.with_file_name("cuobjdump");
    assert!(cuobjdump.is_file(), "no cuobjdump next to {}", nvcc.display());
    (nvcc, cuobjdump)
}

/// The HGMMA / WARPGROUP instructions of each kernel of a SASS dump, register numbers and
/// encodings dropped: (kernel, instructions).
fn gmma_instructions(sass: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for line in sass.lines() {
        if let Some(name) = line.trim().strip_prefix("Function : ") {
            out.push((name.trim().to_string(), Vec::new()));
            continue;
        }
        let Some(code) = line
            .trim()
            .strip_prefix("/*")
            .and_then(|l| l.split_once("*/"))
            .map(|(_, c)| c)
        else {
            continue;
        };
        let code = code.split(';').next().unwrap_or("").trim();
        if !(code.starts_with("HGMMA") || code.starts_with("WARPGROUP")) {
            continue;
        }
        let normalised: Vec<String> = code
            .split_inclusive(|c: char| !c.is_ascii_alphanumeric())
            .map(|tok| {
                let (word, sep) = tok.split_at(tok.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()).len());
                let reg = |p: &str| {
                    word.strip_prefix(p)
                        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                };
                let word = if reg("UR") {
                    "UR"
                } else if reg("R") {
                    "R"
                } else {
                    word
                };
                format!("{word}{sep}")
            })
            .collect();
        if let Some((_, v)) = out.last_mut() {
            v.push(normalised.concat());
        }
    }
    out
}

#[test]
#[ignore = "needs the CuTe headers (scripts/toolchain/install-cutlass.sh) and nvcc; scripts/test.sh runs it"]
fn our_wgmma_instructions_equal_cutes() {
    let cutlass = cutlass_include();
    let (nvcc, cuobjdump) = nvcc_and_cuobjdump();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cute-oracle");
    std::fs::create_dir_all(&dir).unwrap();
    let cubin = dir.join("gmma_forms.cubin");
    let out = Command::new(&nvcc)
        .args([
            "-std=c++17",
            "-O3",
            "-cubin",
            "-gencode=arch=compute_90a,code=sm_90a",
            "-isystem",
        ])
        .arg(&cutlass)
        .arg("-I")
        .arg(root().join("cuda"))
        .arg(root().join("cuda/test/oracle/gmma_forms.cu"))
        .arg("-o")
        .arg(&cubin)
        .output()
        .expect("run nvcc");
    assert!(
        out.status.success(),
        "nvcc failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dump = Command::new(&cuobjdump)
        .arg("--dump-sass")
        .arg(&cubin)
        .output()
        .expect("run cuobjdump");
    assert!(dump.status.success(), "cuobjdump failed");
    let kernels = gmma_instructions(&String::from_utf8_lossy(&dump.stdout));
    let mut pairs = 0;
    for dt in ["bf16", "f16"] {
        for form in ["ss_acc", "ss_zero", "rs"] {
            let find = |imp: &str| {
                let name = format!("{imp}_{dt}_{form}");
                kernels
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.clone())
                    .unwrap_or_else(|| panic!("no {name}"))
            };
            let (ours, cute) = (find("ours"), find("cute"));
            println!("{dt} {form}: ours {ours:?}\n{dt} {form}: CuTe {cute:?}");
            assert!(ours.iter().any(|i| i.starts_with("HGMMA")), "{dt} {form}: no HGMMA");
            assert_eq!(ours, cute, "{dt} {form}: our wgmma differs from CuTe's");
            pairs += 1;
        }
    }
    assert_eq!(pairs, 6);
}

fn wait_ok(name: &str, child: std::process::Child) {
    let out = child.wait_with_output().expect("wait for g++");
    assert!(
        out.status.success(),
        "g++ failed on {name}.cpp:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

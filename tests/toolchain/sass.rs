//! Compile-only checks of the embedded kernels (no GPU needed): from each cubin's SASS
//! (cuobjdump --dump-sass) and its `ptxas -v` report, every kernel
//! - exists for every dtype of the table,
//! - spills nothing (report: 0 bytes stack frame / spill stores / spill loads; SASS: no LDL/STL),
//! - uses the instructions its family claims (`Family::sass_expect` in build/instances.rs:
//!   one row per family, so a new family adds its own expectations there);
//!
//! and every PTX image says the oldest PTX ISA of the nvcc's CUDA major version (8.0 for a
//! 12.x nvcc, 9.0 for 13.x), so every driver of that version loads it.
//!
//! When build.rs found no nvcc there is nothing to check: these tests are then `#[ignore]`d
//! (shown as ignored, with the reason) instead of passing silently, and `toolchain_present_when_required`
//! fails if FLASH_ATTN_REQUIRE_NVCC=1 (set by scripts/test.sh, which installs the toolchain).
use flash_attn::cuda::table::{
    append_kv_symbol, fp8_prepass_symbol, image_kernel_symbols, kernel_symbol, targets_for, Family, Image, KernelVariant, Target,
    Standalone, APPEND_KV_SASS, ARCHS_FILTER, BUILD_SUMMARY, CUOBJDUMP, DTYPE_NAMES, FAMILIES, FP8_PREPASS_SASS, HDIMS_FILTER,
    IMAGES, NVCC_VERSION, PTX_ISA, STANDALONE, STANDALONE_HEAD_DIM, TARGETS_SKIPPED, WHY_NO_KERNELS,
};
use std::process::Command;
use std::sync::OnceLock;

fn family(name: &str) -> &'static flash_attn::cuda::table::Family {
    FAMILIES.iter().find(|f| f.name == name).expect("image of a family in the table")
}

/// The standalone row of an image (the combine), if it is one.
fn standalone(img: &Image) -> Option<&'static Standalone> {
    STANDALONE.iter().find(|s| s.name == img.family && img.head_dim == STANDALONE_HEAD_DIM)
}

/// Every kernel symbol an image holds: a family's per dtype, or a standalone row's list.
fn image_kernels(img: &Image) -> Vec<String> {
    match standalone(img) {
        Some(s) => s.kernels.iter().map(|k| k.to_string()).collect(),
        None => DTYPE_NAMES.iter().flat_map(|dt| image_kernel_symbols(family(img.family), img.head_dim, dt)).collect(),
    }
}

fn cubins() -> impl Iterator<Item = &'static Image> {
    IMAGES.iter().filter(|i| i.target != Target::Ptx80)
}

/// SASS of one cubin, split per kernel: (kernel name, its SASS text). Disassembled once per
/// test binary (cuobjdump takes about a second per cubin) and shared by the tests.
fn sass_by_kernel(img: &'static Image) -> Vec<(String, String)> {
    type Kernels = Vec<(String, String)>;
    static CACHE: OnceLock<Vec<(usize, Kernels)>> = OnceLock::new();
    let all = CACHE.get_or_init(|| {
        IMAGES.iter().enumerate().filter(|(_, i)| i.target != Target::Ptx80).map(|(n, i)| (n, disassemble(i))).collect()
    });
    let n = IMAGES.iter().position(|i| std::ptr::eq(i, img)).expect("an image of IMAGES");
    all.iter().find(|(m, _)| *m == n).map(|(_, k)| k.clone()).unwrap_or_default()
}

fn disassemble(img: &Image) -> Vec<(String, String)> {
    assert!(!CUOBJDUMP.is_empty(), "no cuobjdump next to nvcc: the SASS cannot be checked");
    let dir = std::env::temp_dir().join(format!("flash_attn_sass_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{}_hd{}.{}.cubin", img.family, img.head_dim, img.target.name()));
    std::fs::write(&path, img.bytes).unwrap();
    let out = Command::new(CUOBJDUMP).arg("--dump-sass").arg(&path).output().expect("run cuobjdump");
    assert!(out.status.success(), "cuobjdump failed: {}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_file(&path);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut kernels: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if let Some(name) = line.trim().strip_prefix("Function : ") {
            kernels.push((name.trim().to_string(), String::new()));
        } else if let Some((_, body)) = kernels.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    kernels
}

/// The opcodes of a SASS listing (the first token after the `/*addr*/` column and any predicate).
fn opcodes(sass: &str) -> Vec<&str> {
    sass.lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("/*")?.split_once("*/")?.1.trim();
            let rest = if rest.starts_with('@') { rest.split_once(' ')?.1.trim() } else { rest };
            rest.split(|c: char| c.is_whitespace() || c == ';').next().filter(|s| !s.is_empty())
        })
        .collect()
}

/// Per-kernel (registers, stack, spill stores, spill loads) from a ptxas -v report.
fn report_stats(report: &str) -> Vec<(String, u32, u32, u32, u32)> {
    let num_before = |line: &str, key: &str| -> Option<u32> {
        let i = line.find(key)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    let mut out = Vec::new();
    let mut name = String::new();
    let (mut stack, mut st, mut ld) = (0, 0, 0);
    for line in report.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            name = rest.trim().to_string();
        } else if line.contains("bytes stack frame") {
            stack = num_before(line, "bytes stack frame").unwrap_or(u32::MAX);
            st = num_before(line, "bytes spill stores").unwrap_or(u32::MAX);
            ld = num_before(line, "bytes spill loads").unwrap_or(u32::MAX);
        } else if let Some(regs) = num_before(line, "registers") {
            out.push((name.clone(), regs, stack, st, ld));
        }
    }
    out
}

#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time, so no kernel was built (run scripts/toolchain/install-cuda.sh)")]
fn every_kernel_of_the_table_is_built() {
    assert!(!IMAGES.is_empty(), "{WHY_NO_KERNELS}");
    for img in cubins() {
        let names: Vec<String> = sass_by_kernel(img).into_iter().map(|(n, _)| n).collect();
        for sym in image_kernels(img) {
            assert!(names.contains(&sym), "{sym} missing from {}_hd{}.{}: {names:?}", img.family, img.head_dim, img.target.name());
        }
    }
    // Exactly the table's (family, head_dim, target) triples, as pruned by FLASH_ATTN_* and by
    // what this nvcc can build (sm_100a needs CUDA 12.8).
    let keep = |filter: &str, x: &str| filter.trim().is_empty() || filter.split(',').any(|f| f.trim() == x);
    let mut expected: Vec<(&str, u32, Target)> = Vec::new();
    for fam in FAMILIES {
        for tile in fam.tiles.iter().filter(|t| keep(HDIMS_FILTER, &t.head_dim.to_string())) {
            for &t in targets_for(fam.source()).iter().filter(|t| keep(ARCHS_FILTER, t.name()) && !TARGETS_SKIPPED.contains(t)) {
                expected.push((fam.name, tile.head_dim, t));
            }
        }
    }
    // The standalone kernels: no head dim, so FLASH_ATTN_HDIMS keeps them.
    for st in STANDALONE {
        for &t in targets_for(st.source).iter().filter(|t| keep(ARCHS_FILTER, t.name()) && !TARGETS_SKIPPED.contains(t)) {
            expected.push((st.name, STANDALONE_HEAD_DIM, t));
        }
    }
    let mut built: Vec<(&str, u32, Target)> = IMAGES.iter().map(|i| (i.family, i.head_dim, i.target)).collect();
    let key = |x: &(&str, u32, Target)| (x.0.to_string(), x.1, x.2.name());
    expected.sort_by_key(key);
    built.sort_by_key(key);
    assert_eq!(built, expected, "built images differ from build/instances.rs");
}

#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time, so no kernel was built (run scripts/toolchain/install-cuda.sh)")]
fn no_kernel_spills() {
    for img in cubins() {
        let stats = report_stats(img.report);
        let kernels = image_kernels(img).len();
        assert_eq!(stats.len(), kernels, "{}_hd{}.{}: report {:?}", img.family, img.head_dim, img.target.name(), img.report);
        for (name, regs, stack, st, ld) in stats {
            println!("{name:28} {:>4}  {regs:3} registers, {stack} B stack, {st}/{ld} B spill st/ld", img.target.name());
            assert!(stack == 0 && st == 0 && ld == 0, "{name} on {}: {stack} B stack, {st} B spill stores, {ld} B spill loads", img.target.name());
        }
        for (name, sass) in sass_by_kernel(img) {
            let local: Vec<&str> = opcodes(&sass).into_iter().filter(|op| op.starts_with("LDL") || op.starts_with("STL")).collect();
            assert!(local.is_empty(), "{name} on {} uses local memory: {local:?}", img.target.name());
        }
    }
}

#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time, so no kernel was built (run scripts/toolchain/install-cuda.sh)")]
fn families_use_the_instructions_they_claim() {
    for img in cubins() {
        let (row, row_expect) = match standalone(img) {
            Some(s) => (s.name, s.sass_expect),
            None => (family(img.family).name, family(img.family).sass_expect),
        };
        for (name, sass) in sass_by_kernel(img) {
            let ops = opcodes(&sass);
            // An FP8 family's image also holds its pre-pass, which claims its own instructions.
            let prepass = standalone(img).is_none() && DTYPE_NAMES.iter().any(|dt| name == fp8_prepass_symbol(img.head_dim, dt));
            // The FA2 images also hold the serving KV append kernel: a row copy (build/instances.rs).
            let append = standalone(img).is_none() && DTYPE_NAMES.iter().any(|dt| name == append_kv_symbol(img.head_dim, dt));
            let expect = if prepass {
                FP8_PREPASS_SASS
            } else if append {
                APPEND_KV_SASS
            } else {
                row_expect
            };
            for want in expect {
                assert!(
                    ops.iter().any(|op| op == want || op.starts_with(&format!("{want}."))),
                    "{name} on {}: no {want} (row {row} claims it)",
                    img.target.name(),
                );
            }
        }
    }
}

#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time, so no kernel was built (run scripts/toolchain/install-cuda.sh)")]
fn ptx_fallback_has_the_oldest_isa_of_its_cuda_version() {
    let major: u32 = NVCC_VERSION.split('.').next().and_then(|m| m.parse().ok()).expect("nvcc version recorded");
    let want = match major {
        12 => "8.0",
        13 => "9.0",
        other => panic!("no PTX ISA rule for CUDA {other}"),
    };
    assert!(TARGETS_SKIPPED.iter().all(|&t| t == Target::Sm100a), "only sm_100a may be skipped (CUDA < 12.8): {TARGETS_SKIPPED:?}");
    let ptx: Vec<&Image> = IMAGES.iter().filter(|i| i.target == Target::Ptx80).collect();
    if !ptx.is_empty() {
        assert_eq!(PTX_ISA, want, "nvcc {NVCC_VERSION}");
    }
    for img in ptx {
        let text = std::str::from_utf8(img.bytes).expect("PTX is text");
        let line = format!(".version {want}");
        assert!(text.lines().any(|l| l.trim() == line), "{}_hd{}: not PTX ISA {want}", img.family, img.head_dim);
        let entries: Vec<String> = match standalone(img) {
            Some(s) => s.kernels.iter().map(|k| k.to_string()).collect(),
            None => DTYPE_NAMES.iter().map(|dt| kernel_symbol(img.family, img.head_dim, dt)).collect(),
        };
        for sym in entries {
            assert!(text.contains(&format!(".entry {sym}(")), "{sym} missing from the PTX");
        }
    }
}

/// CI installs the toolchain and sets FLASH_ATTN_REQUIRE_NVCC=1: then the checks above must
/// have run, not been ignored.
#[test]
fn toolchain_present_when_required() {
    println!("nvcc {NVCC_VERSION}: {BUILD_SUMMARY}; PTX ISA {PTX_ISA}; skipped targets {TARGETS_SKIPPED:?}");
    if std::env::var("FLASH_ATTN_REQUIRE_NVCC").is_ok_and(|v| v == "1") {
        assert!(!IMAGES.is_empty(), "FLASH_ATTN_REQUIRE_NVCC=1 but no kernel was built: {WHY_NO_KERNELS}");
        assert!(!CUOBJDUMP.is_empty(), "FLASH_ATTN_REQUIRE_NVCC=1 but cuobjdump was not found next to nvcc");
    } else {
        println!("FLASH_ATTN_REQUIRE_NVCC is not 1: kernels built: {}", IMAGES.len());
    }
}

/// FA3 stages 3-5 move registers with setmaxnreg inside the CTA's launch allocation: 384
/// threads × 168 = 128 × 24 (producer) + 256 × 240 (consumers). If ptxas allocated fewer than
/// 168 at entry the consumers' `setmaxnreg.inc` would wait forever (docs/fa3.md, risk 6).
#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time, so no kernel was built (run scripts/toolchain/install-cuda.sh)")]
fn fa3_warp_specialised_stages_enter_with_168_registers() {
    const ENTRY_REGISTERS: u32 = 168;
    let mut checked = 0;
    // The FA3 ladder's rows and those that run FA4's softmax on its pipeline (variant Fa4).
    let ws_stage = |f: &Family| f.source().starts_with("cuda/fa3") && f.stage.is_some_and(|s| s >= 3);
    for img in cubins().filter(|i| standalone(i).is_none() && ws_stage(family(i.family))) {
        // The forward kernels (not the FP8 pre-pass an FP8 family's image also holds).
        let forward: Vec<String> = DTYPE_NAMES.iter().map(|dt| kernel_symbol(img.family, img.head_dim, dt)).collect();
        for (name, regs, ..) in report_stats(img.report).into_iter().filter(|(n, ..)| forward.contains(n)) {
            assert_eq!(regs, ENTRY_REGISTERS, "{name}: {regs} registers at entry");
            checked += 1;
        }
    }
    let fa3s3 = FAMILIES.iter().find(|f| f.name == "fa3s3").expect("the FA3 ladder is in the table");
    let built = keep_filter(ARCHS_FILTER, "90a") && fa3s3.tiles.iter().any(|t| keep_filter(HDIMS_FILTER, &t.head_dim.to_string()));
    if built {
        assert!(checked > 0, "no FA3 stage 3-5 cubin was checked");
    }
}

fn keep_filter(filter: &str, x: &str) -> bool {
    filter.trim().is_empty() || filter.split(',').any(|f| f.trim() == x)
}

/// FA3 stages 4-5 overlap: the ping-pong token travels through named barriers (`bar.arrive`:
/// BAR.ARV) and each consumer waits for S_j while PV_j-1 may still run (`wgmma.wait_group 1`:
/// WARPGROUP.DEPBAR.LE gsb0, 0x1). Without either, the stage would still compute the right
/// numbers, serialised, so only the SASS shows it (formerly checked by scripts/check-fa3.sh).
#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time, so no kernel was built (run scripts/toolchain/install-cuda.sh)")]
fn fa3_overlapped_stages_pass_the_token_and_keep_one_gemm_in_flight() {
    let mut checked = 0;
    // The 16-bit stages 4-5 (FA3's own rows and the FA4-softmax rows compiled at stage 5) and the
    // FP8 consumer's (its image also holds the pre-pass: skipped).
    let overlapped = |f: &Family| {
        (f.source() == "cuda/fa3_fwd_sm90.cu" || f.source() == "cuda/fa3_fp8_fwd_sm90.cu") && f.stage.is_some_and(|s| s >= 4)
    };
    for img in cubins().filter(|i| standalone(i).is_none() && overlapped(family(i.family))) {
        for (name, sass) in sass_by_kernel(img).into_iter().filter(|(n, _)| !n.starts_with("fa_fp8_prepass")) {
            assert!(opcodes(&sass).iter().any(|op| op.starts_with("BAR.ARV")), "{name}: no BAR.ARV (ping-pong)");
            assert!(
                sass.lines().any(|l| l.contains("WARPGROUP.DEPBAR.LE gsb0, 0x1")),
                "{name}: no WARPGROUP.DEPBAR.LE gsb0, 0x1 (a wait leaving one wgmma group in flight)"
            );
            checked += 1;
        }
    }
    let built = keep_filter(ARCHS_FILTER, "90a") && family("fa3s4").tiles.iter().any(|t| keep_filter(HDIMS_FILTER, &t.head_dim.to_string()));
    if built {
        assert!(checked > 0, "no FA3 stage 4-5 kernel was checked");
    }
}

/// FA4's softmax on the FA2 / FA3 pipelines (docs/fa4.md, "Part 1"): every kernel of a row with
/// a software-exp2 share of 1 in E takes exactly that share of the score exponentials off MUFU,
/// counted against the pipeline's own row (share 0, eager rescale) of the same head dim and
/// target. Per kernel, with R rows and C score elements per row per thread (FA2: R = block_m /
/// 32, C = block_n / 4; FA3: R = 2, C = block_n / 4), S places the tile softmax is compiled (FA2:
/// 1, the tile loop; FA3 stage 5: 2, the first tile and the overlapped loop), L of them with a
/// possibly finite running max (1: the first tile of FA3 starts from -inf, where the lazy rule
/// returns 1 with no exponential), T other MUFU.EX2 per score element (FA2's softcap tanhf:
/// 1; FA3's tanh.approx is MUFU.TANH: 0), and 2 R in the epilogue of both rows (the attention
/// sink's fold, `fa_softmax_finalize_sink`: exp2 of the softplus's argument and of its result):
///   pipeline row  MUFU.EX2 = S R C (1 + T) + S R + 2 R    (the factor on MUFU at every place)
///   FA4 row       MUFU.EX2 = S R (C - C/E) + S R C T + [factor on MUFU] L R + 2 R
///                 FADD.RM  = S R C/E + [factor by the polynomial] L R
/// FADD.RM is the software exp2's floor (add.rm of 2^23 + 2^22), one per polynomial exp2 and in
/// no pipeline row; FFMA (its Horner steps) must be there too. The lazy factor uses the
/// polynomial where the row has a share, MUFU where it has none (share 0).
#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time, so no kernel was built (run scripts/toolchain/install-cuda.sh)")]
fn fa4_softmax_rows_take_their_share_off_mufu() {
    let count = |sass: &str, op: &str| opcodes(sass).iter().filter(|o| **o == op).count();
    let mut checked = 0;
    for img in cubins().filter(|i| standalone(i).is_none()) {
        let fam = family(img.family);
        let (base, s, t) = match fam.source() {
            _ if fam.variant != KernelVariant::Fa4 => continue,
            "cuda/fa2_fwd.cu" => ("fa2", 1, 1),
            "cuda/fa3_fwd_sm90.cu" => ("fa3s5", 2, 0),
            _ => continue, // the tcgen05 ladder (docs/fa4.md: its loops are not unrolled)
        };
        let Some(base_img) = cubins().find(|i| i.family == base && i.head_dim == img.head_dim && i.target == img.target) else {
            continue;
        };
        let tile = fam.tiles.iter().find(|t| t.head_dim == img.head_dim).unwrap();
        let r = if base == "fa2" { tile.block_m as usize / 32 } else { 2 };
        let c = tile.block_n as usize / 4;
        let e = fam.softmax.poly_every as usize;
        let poly = c.checked_div(e).unwrap_or(0); // elements on the polynomial (E = 0: none)
        let lazy = fam.softmax.lazy_tau >= 0.0;
        let (mufu_factor, poly_factor) = match (lazy, e > 0) {
            (true, true) => (0, r),
            (true, false) => (r, 0),
            (false, _) => (s * r, 0),
        };
        let base_kernels = sass_by_kernel(base_img);
        for (name, sass) in sass_by_kernel(img) {
            let dt = name.rsplit('_').next().unwrap();
            // The pipeline row's forward kernel (an FA2 image also holds the append kernel).
            let base_name = kernel_symbol(base, img.head_dim, dt);
            let (_, base_sass) = base_kernels.iter().find(|(n, _)| *n == base_name).unwrap();
            let sink = 2 * r;
            let want_base = s * r * c * (1 + t) + s * r + sink;
            let want = s * r * (c - poly) + s * r * c * t + mufu_factor + sink;
            let want_floor = s * r * poly + poly_factor;
            let got = (count(base_sass, "MUFU.EX2"), count(&sass, "MUFU.EX2"), count(&sass, "FADD.RM"));
            println!(
                "{name:30} {}: MUFU.EX2 {} (pipeline row {}), FADD.RM {}; R {r} C {c} E {e} S {s}",
                img.target.name(),
                got.1,
                got.0,
                got.2
            );
            assert_eq!(got, (want_base, want, want_floor), "{name} on {}: (pipeline row MUFU.EX2, MUFU.EX2, FADD.RM)", img.target.name());
            assert_eq!(count(base_sass, "FADD.RM"), 0, "{base}: no software exp2");
            if e > 0 {
                assert!(count(&sass, "FFMA") > count(base_sass, "FFMA"), "{name}: the polynomial's FFMAs");
            }
            checked += 1;
        }
    }
    let built = keep_filter(ARCHS_FILTER, "80") && keep_filter(HDIMS_FILTER, "128");
    if built && !IMAGES.is_empty() {
        assert!(checked > 0, "no FA4-softmax kernel was checked");
    }
}

/// The FA2 backward's main kernels (the standalone row "fa2_bwd", docs/fa2-backward.md) run on
/// the tensor cores: mma.sync (HMMA.16816.F32), ldmatrix with and without .trans, cp.async
/// loads and (the default dq accumulation) f32 reductions into global memory; spills are
/// `no_kernel_spills`'s (every cubin).
#[test]
#[cfg_attr(not(fa_kernels), ignore = "nvcc was not found at build time, so no kernel was built (run scripts/toolchain/install-cuda.sh)")]
fn fa2_backward_uses_mma_and_ldmatrix() {
    let mut checked = 0;
    for img in cubins().filter(|i| i.family == "fa2_bwd" && i.head_dim == STANDALONE_HEAD_DIM) {
        for (name, sass) in sass_by_kernel(img).into_iter().filter(|(n, _)| n.starts_with("fa2_bwd_hd")) {
            let ops = opcodes(&sass);
            for want in ["HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS"] {
                assert!(
                    ops.iter().any(|op| *op == want || op.starts_with(&format!("{want}."))),
                    "{name} on {}: no {want}",
                    img.target.name()
                );
            }
            // red.global.add.f32: RED.E.ADD.F32... on sm_80, REDG.E.ADD.F32... on sm_90a.
            assert!(
                ops.iter().any(|op| (op.starts_with("RED.") || op.starts_with("REDG.")) && op.contains(".ADD.F32")),
                "{name} on {}: no f32 global reduction (dq accumulation)",
                img.target.name()
            );
            checked += 1;
        }
    }
    assert!(checked > 0, "no fa2_bwd cubin was built");
}

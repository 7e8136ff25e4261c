//! The emulator itself: its self-tests, its layout functions, the instruction wrappers against the
//! headers, tensor maps, and every family of the kernel table naming its emulator test.

use super::*;
use super::mutations::kernel_sources;

#[test]
fn emulator_self_tests() {
    let exe = tool_exe("selftest").unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(&exe).output().unwrap();
    let log = String::from_utf8_lossy(&out.stdout);
    println!("{log}");
    assert!(out.status.success(), "emulator self-tests failed:\n{log}{}", String::from_utf8_lossy(&out.stderr));
    assert!(log.contains("65 of 65 emulator self-tests as expected"), "{log}");
}

#[test]
fn layout_functions() {
    let exe = tool_exe("layouts_test.cpp").unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(&exe).output().unwrap();
    let log = String::from_utf8_lossy(&out.stdout);
    println!("{log}");
    assert!(out.status.success() && log.contains(", 0 failed"), "layout checks failed:\n{log}");
}

/// The emulator supplies host versions of exactly the inline-PTX wrappers of the instruction
/// headers (those inside their `!defined(FA_HOST_EMULATION)` blocks), and no inline PTX lives
/// anywhere else in the kernel sources.
#[test]
fn wrappers_match_the_instruction_headers() {
    let emu_h = std::fs::read_to_string(root().join("cuda/test/emu/emu.h")).unwrap();
    let mut wrappers = Vec::new();
    for (path, text) in &kernel_sources() {
        let mut depth = 0usize; // #if nesting
        let mut guard_at: Option<usize> = None; // depth of the open FA_HOST_EMULATION guard
        for (n, line) in text.lines().enumerate() {
            let t = line.trim_start();
            if t.starts_with("#if") {
                depth += 1;
                if t.contains("!defined(FA_HOST_EMULATION)") || t.starts_with("#ifndef FA_HOST_EMULATION") {
                    guard_at = Some(depth);
                }
            } else if t.starts_with("#endif") {
                if guard_at == Some(depth) {
                    guard_at = None;
                }
                depth -= 1;
            } else if (t.starts_with("#else") || t.starts_with("#elif")) && guard_at == Some(depth) {
                guard_at = None;
            }
            let code = line.split("//").next().unwrap();
            if (code.contains("asm(") || code.contains("asm volatile")) && guard_at.is_none() {
                panic!("{path}:{}: inline asm outside an instruction header's FA_HOST_EMULATION guard", n + 1);
            }
            if guard_at.is_some() && code.contains("__device__") && code.contains('(') {
                let before = &code[..code.find('(').unwrap()];
                let name = before.split_whitespace().last().unwrap().trim_start_matches(['*', '&']);
                let name = name.rsplit("::").next().unwrap().split('<').next().unwrap().to_string();
                if !name.is_empty() && name != "__launch_bounds__" {
                    wrappers.push((path.rsplit('/').next().unwrap().to_string(), name));
                }
            }
        }
    }
    assert!(wrappers.len() >= 25, "found only {wrappers:?}");
    for (file, name) in &wrappers {
        assert!(
            emu_h.contains(&format!(" {name}(")) || emu_h.contains(&format!(" {name}<")),
            "{file}: wrapper `{name}` has no host version in cuda/test/emu/emu.h"
        );
    }
    println!("{} wrappers, each with a host version: {wrappers:?}", wrappers.len());
}

/// The tensor maps the kernel receives decode to exactly the arguments the crate's launch plan
/// passes to cuTensorMapEncodeTiled (the same `fa3_tma::tma_specs` the GPU launch uses).
#[test]
fn tensor_maps_reach_the_kernel_unchanged() {
    let mut c = Case::new("fa3s2", DType::F16, [2, 65, 4, 128], [2, 130, 2, 128], ForwardOptions::default().causal(true));
    c.bhsd = true;
    c.seeds = vec![1];
    let pass = run_case(&c, None).unwrap_or_else(|e| panic!("{e}"));
    let pl = &pass.plan;
    assert_eq!(pl.tensor_maps.len(), 3);
    for (i, m) in pl.tensor_maps.iter().enumerate() {
        let s = &m.spec;
        let j = |v: &[u64]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" ");
        let j32 = |v: &[u32]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" ");
        let want = format!(
            "tmap {i}: data_type {} rank {} address {:#x} dims {} strides {} box {} elem_strides {} interleave {} swizzle {} l2 {} oob {}",
            s.data_type,
            s.rank,
            m.global_address,
            j(&s.dims),
            j(&s.strides),
            j32(&s.box_dims),
            j32(&s.elem_strides),
            s.interleave,
            s.swizzle,
            s.l2_promotion,
            s.oob_fill
        );
        assert!(pass.log.lines().any(|l| l == want), "missing {want:?} in:\n{}", pass.log);
    }
    // [b, h, s, d] storage: the head stride is s * d elements, the row stride d.
    assert_eq!(pl.tensor_maps[1].spec.strides, [130 * 128 * 2, 128 * 2, 130 * 2 * 128 * 2]);
}

/// Every family of the kernel table names a test of the forward or fp8 module that runs it
/// (build/instances.rs, `cpu_emulation`).
#[test]
fn every_family_runs_in_the_emulator() {
    // FP8 families' emulator tests live in the fp8 module, the fa2v row's in head_dim_v.
    let head_dim_v = std::fs::read_to_string(root().join("tests/emulator/head_dim_v.rs")).unwrap();
    let me = module_text("forward") + &module_text("fp8") + &head_dim_v;
    for f in FAMILIES {
        let t = f.cpu_emulation.unwrap_or_else(|| panic!("{}: no emulator test (cpu_emulation is None)", f.name));
        assert!(me.contains(&format!("fn {t}()")), "{}: cpu_emulation names {t:?}, which is not a test here", f.name);
    }
}

/// The source of emulator test module `name`: tests/emulator/NAME.rs and its submodules' files
/// (tests/emulator/NAME/*.rs).
fn module_text(name: &str) -> String {
    let dir = root().join("tests/emulator");
    let mut files: Vec<_> = std::fs::read_dir(dir.join(name)).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files.insert(0, dir.join(format!("{name}.rs")));
    files.iter().map(|f| std::fs::read_to_string(f).unwrap()).collect()
}

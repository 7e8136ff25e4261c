//! The header build.rs generates for the kernels (build/numerics_header.rs) against the Rust
//! constants it is generated from, read back with g++ (the CUDA side's copy of the numerics).

use flash_attn::numerics::fp8::E4M3_MAX;
use flash_attn::numerics::FP8_P_SCALE_LOG2;

/// The header build.rs generates for the kernels (build/numerics_header.rs) holds exactly the
/// Rust constants: g++ reads it and prints every value's bits.
#[test]
fn generated_header_matches_rust() {
    use flash_attn::numerics::exp2::{EXP2_CLAMP_LOW, POLY_EX2};
    use flash_attn::numerics::LAZY_THRESHOLD_MAX;
    let include = std::path::Path::new(env!("OUT_DIR")).join("include");
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("numerics_header");
    std::fs::create_dir_all(&dir).unwrap();
    let mut prog = String::from(
        "#include <stdio.h>\n#include <string.h>\n#include \"fa_numerics_constants.h\"\n\
         static void out(const char* n, float x) { unsigned u; memcpy(&u, &x, 4); printf(\"%s %08x\\n\", n, u); }\n\
         int main() {\n",
    );
    let mut want = Vec::new();
    for (name, v) in [
        ("FA_E4M3_MAX", E4M3_MAX),
        ("FA_FP8_P_SCALE_LOG2", FP8_P_SCALE_LOG2),
        ("FA_LAZY_THRESHOLD_MAX", LAZY_THRESHOLD_MAX),
        ("FA_EXP2_CLAMP_LOW", EXP2_CLAMP_LOW),
        ("FA_LOG2E", std::f32::consts::LOG2_E), // src/problem.rs LOG2E is this constant
        ("FA_LN2", std::f32::consts::LN_2),
    ] {
        prog.push_str(&format!("out(\"{name}\", {name});\n"));
        want.push(format!("{name} {:08x}", v.to_bits()));
    }
    prog.push_str("printf(\"degree %d\\n\", FA_EXP2_POLY_MAX_DEGREE);\n");
    want.push(format!("degree {}", POLY_EX2.len() - 1));
    for (d, row) in POLY_EX2.iter().enumerate() {
        prog.push_str(&format!("{{ const float c[] = {{FA_EXP2_POLY_COEFFS_{d}}}; for (unsigned i = 0; i < sizeof c / 4; ++i) out(\"poly{d}\", c[i]); }}\n"));
        want.extend(row.iter().map(|c| format!("poly{d} {:08x}", c.to_bits())));
    }
    prog.push_str("return 0;\n}\n");
    let src = dir.join("header.cpp");
    let exe = dir.join("header");
    std::fs::write(&src, prog).unwrap();
    let out = std::process::Command::new("g++")
        .args(["-std=c++17", "-I"])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("g++ is needed to read the generated header");
    assert!(out.status.success(), "g++: {}", String::from_utf8_lossy(&out.stderr));
    let got = std::process::Command::new(&exe).output().unwrap();
    let got: Vec<String> = String::from_utf8_lossy(&got.stdout).lines().map(str::to_string).collect();
    assert_eq!(got, want);
}

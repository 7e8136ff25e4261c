//! One definition, two languages: the host side of the CUDA numerics headers (compiled by nvcc)
//! against the Rust versions, bit for bit, over many inputs.
//!
//! Needs nvcc (CUDA 13; `scripts/toolchain/install-cuda.sh` installs it into `.cuda-toolchain/`),
//! found through `$NVCC`, `$FLASH_ATTN_CUDA_TOOLCHAIN`, `.cuda-toolchain/`, then `PATH`. The test
//! is `#[ignore]`d so that a plain `cargo test` on a machine without the toolchain reports it as
//! ignored instead of passing without checking anything; run it with
//! `cargo test --test toolchain -- --ignored` (CI does). When run, a missing nvcc is a
//! failure, never a skip.
//!
//! What is compared: the host path of the headers (floorf where the device uses add.rm, the
//! cuda_fp8.h host conversion where sm_89+ uses F2FP.SATFINITE). The device paths compute the
//! same values by construction but are only compile-checked here (no GPU).

use flash_attn::numerics::exp2::exp2_poly_deg;
use flash_attn::numerics::fp8::{e4m3_from_f32, e4m3_to_f32, round_e4m3};
use flash_attn::numerics::hadamard::Rotation;
use flash_attn::numerics::quant::block_scale;
use flash_attn::numerics::rng::SplitMix64;
use flash_attn::numerics::{fp8_lazy_limit, lazy_keeps_max};
use crate::support::find_nvcc;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The host program: reads commands on stdin, prints results as hex bits, one line each.
const PROGRAM: &str = r#"
#include <stdio.h>
#include <string.h>
#include "common/exp2_poly.cuh"
#include "common/fp8.cuh"
#include "common/hadamard.cuh"
#include "common/softmax.cuh"

static float rd() { unsigned u; if (scanf("%x", &u) != 1) return 0; return fa_u2f(u); }
int main() {
    char cmd[16];
    while (scanf("%15s", cmd) == 1) {
        if (!strcmp(cmd, "exp2")) { int d; scanf("%d", &d); float x = rd(); printf("%08x\n", fa_f2u(fa_exp2_poly_deg(x, d))); }
        else if (!strcmp(cmd, "enc")) { float x = rd(); printf("%02x %08x\n", fa_e4m3_encode(x), fa_f2u(fa_e4m3_round(x))); }
        else if (!strcmp(cmd, "dec")) { unsigned c; scanf("%x", &c); printf("%08x\n", fa_f2u(fa_e4m3_decode((uint8_t)c))); }
        else if (!strcmp(cmd, "scale")) { float a = rd(); float x = rd(); float s = fa_block_scale(a); printf("%08x %02x\n", fa_f2u(s), fa_quantize_e4m3(x, s)); }
        else if (!strcmp(cmd, "lazy")) { float m = rd(); float t = rd(); float c = rd(); float tau = rd(); printf("%d %d\n", (int)fa_lazy_keeps_max((t - m) * c, tau), (int)fa_fp8_lazy_threshold_ok(tau)); }
        else if (!strcmp(cmd, "had")) {
            int d; unsigned long long seed; scanf("%d %llx", &d, &seed);
            float x[1024]; for (int i = 0; i < d; ++i) x[i] = rd();
            fa_hadamard_rotate(x, d, seed);
            for (int i = 0; i < d; ++i) printf("%08x%c", fa_f2u(x[i]), i + 1 == d ? '\n' : ' ');
        }
        else { fprintf(stderr, "unknown command %s\n", cmd); return 1; }
    }
    return 0;
}
"#;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn build() -> PathBuf {
    let nvcc = find_nvcc().unwrap_or_else(|| {
        panic!(
            "nvcc not found (set NVCC, or run scripts/toolchain/install-cuda.sh): \
             this parity test cannot check the CUDA headers without it"
        )
    });
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("numerics_cuda_parity");
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("parity.cu");
    std::fs::write(&src, PROGRAM).unwrap();
    let exe = dir.join("parity");
    let out = Command::new(&nvcc)
        .args(["-x", "c++", "-std=c++17", "-O2", "-cudart", "none", "-Xcompiler", "-ffp-contract=off", "-I"])
        .arg(repo().join("cuda"))
        .arg("-I")
        .arg(Path::new(env!("OUT_DIR")).join("include")) // the generated numerics constants
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
    assert!(out.status.success(), "nvcc failed:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

fn run(exe: &Path, input: &str) -> Vec<String> {
    let mut child = Command::new(exe).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()).unwrap());
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap().lines().map(str::to_owned).collect()
}

fn same_float(got: &str, want: f32, what: &str) {
    let g = f32::from_bits(u32::from_str_radix(got, 16).unwrap());
    if want.is_nan() {
        assert!(g.is_nan(), "{what}: CUDA {g:e}, Rust NaN");
    } else {
        assert_eq!(g.to_bits(), want.to_bits(), "{what}: CUDA {g:e}, Rust {want:e}");
    }
}

/// Inputs: special values, a dense sweep of P's exponent range, and random bit patterns.
fn floats(g: &mut SplitMix64, n_random: usize) -> Vec<f32> {
    let mut v = vec![0.0, -0.0, 1.0, -1.0, 448.0, 464.0, 1e6, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -127.0, -126.5, -200.0];
    let mut x = -130.0f32;
    while x < 20.0 {
        v.push(x);
        x += 1.0 / 1024.0 + 1e-7;
    }
    v.extend((0..n_random).map(|_| f32::from_bits(g.next_u64() as u32)));
    v
}

#[test]
#[ignore = "needs nvcc (CUDA 13): cargo test --test toolchain -- --ignored (CI runs it)"]
fn cuda_headers_match_rust_bit_for_bit() {
    let exe = build();
    let mut g = SplitMix64::new(2024);
    let xs = floats(&mut g, 100_000);
    // exp2's domain: below 128 (P's exponent never exceeds τ + 8 <= 72); above, the exponent add
    // overflows in both languages and the results are meaningless.
    let xs_exp2: Vec<f32> = xs.iter().copied().filter(|x| x.is_nan() || *x < 128.0).collect();
    let mut input = String::new();
    // exp2 for every degree.
    for d in 2..=5u8 {
        for &x in &xs_exp2 {
            input += &format!("exp2 {d} {:08x}\n", x.to_bits());
        }
    }
    // e4m3 encode/round of every input, decode of every code.
    for &x in &xs {
        input += &format!("enc {:08x}\n", x.to_bits());
    }
    for c in 0..=255u32 {
        input += &format!("dec {c:02x}\n");
    }
    // Block scales and quantised codes.
    let pairs: Vec<(f32, f32)> = (0..20_000)
        .map(|i| {
            let amax = if i % 100 == 0 { 0.0 } else { (g.normal() * 10.0).abs() as f32 };
            (amax, (g.normal() as f32) * amax)
        })
        // The edges: non-finite amax, one whose amax / 448 underflows, infinite inputs.
        .chain([
            (f32::INFINITY, 1.0),
            (f32::NAN, 1.0),
            (1e-45, 1e-45),
            (1e-43, -1e-43),
            (f32::MAX, f32::MAX),
            (3.0, f32::INFINITY),
            (3.0, f32::NEG_INFINITY),
        ])
        .collect();
    for &(a, x) in &pairs {
        input += &format!("scale {:08x} {:08x}\n", a.to_bits(), x.to_bits());
    }
    // The lazy rule.
    let lazy: Vec<(f32, f32, f32, f32)> = (0..20_000)
        .map(|i| {
            let m = (g.normal() * 20.0) as f32;
            let taus = [0.0, 0.5, 0.8, 0.807, 0.81, 1.0, 8.0];
            let cs = [1.0, std::f32::consts::LOG2_E, 0.125 * std::f32::consts::LOG2_E, 1e-30, 1e30];
            (m, m + (g.normal() * 4.0) as f32, cs[i % cs.len()], taus[i % taus.len()])
        })
        .collect();
    for &(m, t, c, tau) in &lazy {
        input += &format!("lazy {:08x} {:08x} {:08x} {:08x}\n", m.to_bits(), t.to_bits(), c.to_bits(), tau.to_bits());
    }
    // Hadamard rotations.
    let mut rows = Vec::new();
    for d in [1usize, 2, 8, 64, 128, 256, 512] {
        for _ in 0..20 {
            let seed = g.next_u64();
            let x: Vec<f32> = (0..d).map(|_| (g.normal() * if g.bernoulli(0.01) { 10.0 } else { 1.0 }) as f32).collect();
            input += &format!("had {d} {seed:x}");
            for v in &x {
                input += &format!(" {:08x}", v.to_bits());
            }
            input += "\n";
            rows.push((d, seed, x));
        }
    }

    let out = run(&exe, &input);
    let mut it = out.iter();
    let mut next = || it.next().expect("the program printed too few lines").as_str();
    for d in 2..=5u8 {
        for &x in &xs_exp2 {
            same_float(next(), exp2_poly_deg(x, d), &format!("exp2 degree {d} at {x:e}"));
        }
    }
    for &x in &xs {
        let line = next();
        let (code, rounded) = line.split_once(' ').unwrap();
        let code = u8::from_str_radix(code, 16).unwrap();
        let want = e4m3_from_f32(x);
        if x.is_nan() {
            assert!(e4m3_to_f32(code).is_nan() && e4m3_to_f32(want).is_nan());
        } else {
            assert_eq!(code, want, "e4m3 code of {x:e}");
        }
        same_float(rounded, round_e4m3(x), &format!("e4m3 rounding of {x:e}"));
    }
    for c in 0..=255u8 {
        same_float(next(), e4m3_to_f32(c), &format!("e4m3 decode of {c:#x}"));
    }
    for &(a, x) in &pairs {
        let line = next();
        let (s, code) = line.split_once(' ').unwrap();
        let sc = block_scale(a);
        same_float(s, sc, &format!("block scale of {a:e}"));
        assert_eq!(u8::from_str_radix(code, 16).unwrap(), e4m3_from_f32(x / sc), "code of {x:e} / {sc:e}");
    }
    for &(m, t, c, tau) in &lazy {
        let want = format!("{} {}", lazy_keeps_max((t - m) * c, tau) as i32, (tau < fp8_lazy_limit()) as i32);
        assert_eq!(next(), want, "lazy rule at m {m}, tile max {t}, c {c}, τ {tau}");
    }
    for (d, seed, x) in &rows {
        let mut r = x.clone();
        Rotation::new(*d, *seed).unwrap().apply(&mut r);
        for (got, want) in next().split(' ').zip(&r) {
            same_float(got, *want, &format!("Hadamard d {d} seed {seed:#x}"));
        }
    }
    assert!(it.next().is_none(), "the program printed too many lines");
}

/// A kernel using every helper, compiled for the crate's targets: the device paths (add.rm floor,
/// hardware e4m3 conversion) at least build, and sm_90a's SASS shows the instructions we rely on.
const KERNEL: &str = r#"
#include "common/exp2_poly.cuh"
#include "common/fp8.cuh"
#include "common/hadamard.cuh"
#include "common/softmax.cuh"
extern "C" __global__ void numerics_probe(float* x, unsigned char* c, int n, unsigned long long seed) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float m = -INFINITY;
    float s = fa_max_get_scale<3>(&m, x[i], 1.4426950f, 8.0f);
    float p = fa_exp2_poly<3>(x[i] - 1.0f) * s;
    c[i] = fa_quantize_e4m3(p, fa_block_scale(x[0]));
    float r[64];
    for (int j = 0; j < 64; ++j) r[j] = x[(i + j) % n];
    fa_hadamard_rotate(r, 64, seed);
    x[i] = fa_e4m3_round(p) + r[i % 64];
}
"#;

#[test]
#[ignore = "needs nvcc (CUDA 13): cargo test --test toolchain -- --ignored (CI runs it)"]
fn cuda_headers_compile_for_every_target() {
    let nvcc = find_nvcc().expect("nvcc not found (set NVCC, or run scripts/toolchain/install-cuda.sh)");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("numerics_cuda_probe");
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("probe.cu");
    std::fs::write(&src, KERNEL).unwrap();
    for arch in ["80", "90a", "100a"] {
        let cubin = dir.join(format!("probe_sm{arch}.cubin"));
        let out = Command::new(&nvcc)
            .args(["-std=c++17", "-cubin", &format!("-gencode=arch=compute_{arch},code=sm_{arch}"), "-I"])
            .arg(repo().join("cuda"))
            .arg("-I")
            .arg(Path::new(env!("OUT_DIR")).join("include"))
            .arg("-o")
            .arg(&cubin)
            .arg(&src)
            .output()
            .unwrap();
        assert!(out.status.success(), "sm_{arch}:\n{}", String::from_utf8_lossy(&out.stderr));
        if arch == "90a" {
            let sass = Command::new(nvcc.with_file_name("cuobjdump")).arg("-sass").arg(&cubin).output().unwrap();
            let sass = String::from_utf8_lossy(&sass.stdout);
            assert!(sass.contains("F2FP.SATFINITE.E4M3"), "hardware satfinite e4m3 conversion");
            assert!(sass.contains("FADD.RM"), "the add.rm floor of exp2");
        }
    }
}

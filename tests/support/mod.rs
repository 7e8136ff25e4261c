//! What the test groups share (each group's `main.rs` includes it with `#[path]`): deterministic
//! inputs, FlashAttention's tolerance rule, the proptest configuration (`props`), the serving
//! checks (`serving`), the emulator driver (`emu`) and where nvcc and the CuTe headers are.
//! Not every group uses every helper, hence `dead_code` is allowed.
#![allow(dead_code)]

pub mod props;
pub mod serving;

use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff};
use flash_attn::{DType, ForwardOptions, Output, Problem, Tensor, TensorView};

/// The crate's deterministic generator (SplitMix64), so tests need no RNG crate.
pub use flash_attn::numerics::rng::SplitMix64 as Rng;

/// A `[b, s, h, d]` tensor of N(0, 1) values in `dtype`.
pub fn randn(rng: &mut Rng, dtype: DType, shape: [usize; 4]) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    Tensor::from_f32(&v, dtype, shape).unwrap()
}

/// The margins observed by one check.
#[derive(Debug, Clone, Copy)]
pub struct Check {
    pub err: f64,
    pub naive_err: f64,
    pub bound: f64,
    pub lse_err: f64,
}

/// FlashAttention's `cu_seqlens` of a varlen batch: 0, then the running sum of `lens`.
pub fn cu_seqlens(lens: &[usize]) -> Vec<i32> {
    std::iter::once(0).chain(lens.iter().scan(0i32, |sum, &n| {
        *sum += n as i32;
        Some(*sum)
    }))
    .collect()
}

/// Absolute floor of the tolerance: a few ulps of the output type at the outputs' scale (|o| ≤ max|v|).
pub fn floor_for(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        _ => 1e-2,
    }
}

/// Runs `forward` and checks it against the float64 reference with FlashAttention's rule:
/// `max|out - ref| <= 2 * max|naive_in_dtype - ref| + floor`. LSE is checked too when returned.
pub fn check_forward(q: &Tensor, k: &Tensor, v: &Tensor, opts: &ForwardOptions) -> (Output, Check) {
    check_views(&q.view(), &k.view(), &v.view(), opts)
}

/// [`check_forward`] on views (strided ones included).
pub fn check_views(q: &TensorView, k: &TensorView, v: &TensorView, opts: &ForwardOptions) -> (Output, Check) {
    let out = flash_attn::forward(q, k, v, opts).expect("forward");
    let p = Problem::new(q, k, v, opts).unwrap();
    let r = attention_f64(&p, q, k, v).unwrap();
    let naive = attention_naive(&p, q, k, v, q.dtype()).unwrap();
    let ours: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
    let err = max_abs_diff(&ours, &r.o);
    let naive_err = max_abs_diff(&naive, &r.o);
    let bound = 2.0 * naive_err + floor_for(q.dtype());
    let lse_err = match &out.lse {
        Some(l) => {
            let l64: Vec<f64> = l.iter().map(|&x| x as f64).collect();
            max_abs_diff(&l64, &r.lse)
        }
        None => 0.0,
    };
    (out, Check { err, naive_err, bound, lse_err })
}

/// The CPU emulator of the kernel sources (cuda/test/emu), for tests/emulator/.
#[cfg(feature = "cuda")]
pub mod emu;

/// nvcc for the checks that compile with it themselves: `$NVCC`, the PyPI toolchain under
/// `$FLASH_ATTN_CUDA_TOOLCHAIN` or this checkout's `.cuda-toolchain/`
/// (scripts/toolchain/install-cuda.sh), then `PATH`.
pub fn find_nvcc() -> Option<std::path::PathBuf> {
    use std::path::{Path, PathBuf};
    if let Some(p) = std::env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let roots = [std::env::var_os("FLASH_ATTN_CUDA_TOOLCHAIN").map(PathBuf::from), Some(repo.join(".cuda-toolchain"))];
    for root in roots.into_iter().flatten() {
        for py in std::fs::read_dir(root.join("lib")).into_iter().flatten().flatten() {
            let nvcc = py.path().join("site-packages/nvidia/cu13/bin/nvcc");
            if nvcc.is_file() {
                return Some(nvcc);
            }
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("nvcc")).find(|p| p.is_file())
}

/// The include directory holding CuTe's cute/ and cutlass/ (scripts/toolchain/install-cutlass.sh into
/// .cutlass/, or FLASH_ATTN_CUTLASS_INCLUDE), for the oracles that compile against NVIDIA's own
/// layouts.
pub fn cutlass_include() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("FLASH_ATTN_CUTLASS_INCLUDE") {
        return std::path::PathBuf::from(p);
    }
    let lib = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".cutlass/lib");
    std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("site-packages/cutlass_library/source/include"))
        .find(|p| p.join("cute/tensor.hpp").is_file())
        .unwrap_or_else(|| {
            panic!(
                "no CuTe headers: set FLASH_ATTN_CUTLASS_INCLUDE or run scripts/toolchain/install-cutlass.sh (looked in {})",
                lib.display()
            )
        })
}

/// Runs every case in turn, printing `ok    NAME (SECS s): SUMMARY` or `FAIL  NAME: ERROR`, then
/// fails naming every case that failed (`what`: what the cases are, for that message). The
/// emulator tests' one loop over their cases.
pub fn check_each<C>(
    what: &str,
    cases: &[C],
    name: impl Fn(&C) -> String,
    run: impl Fn(&C) -> Result<String, String>,
) {
    let mut failed = Vec::new();
    for c in cases {
        let t0 = std::time::Instant::now();
        match run(c) {
            Ok(s) => println!("ok    {} ({:.1} s): {s}", name(c), t0.elapsed().as_secs_f64()),
            Err(e) => {
                println!("FAIL  {}: {e}", name(c));
                failed.push(name(c));
            }
        }
    }
    assert!(failed.is_empty(), "{} of {} {what} failed: {failed:#?}", failed.len(), cases.len());
}

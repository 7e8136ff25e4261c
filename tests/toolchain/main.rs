//! Tests that need the CUDA compiler (or the CuTe headers): the embedded images' SASS and ptxas
//! reports, the CUDA numerics headers bit for bit against Rust, the kernels' layouts against
//! CuTe, the FP8 and hang-check builds. Compile-checked only: nothing here runs a kernel.
//!
//! Two kinds, by what a plain `cargo test --test toolchain` does without the toolchain:
//! - checks of the kernels build.rs embedded are `#[ignore]`d when build.rs found no nvcc
//!   (`cfg(fa_kernels)` unset) and run whenever it did;
//! - checks that run nvcc or need the CuTe headers themselves are always `#[ignore]`d:
//!   `cargo test --test toolchain -- --ignored` (scripts/test.sh) runs them, and a missing tool
//!   is then a failure, never a skip.

#[path = "../support/mod.rs"]
mod support;

/// The kernels' and the emulator's layouts against CUTLASS/CuTe (ignored: CuTe headers, nvcc).
#[cfg(feature = "cuda")]
mod cute_oracle;
/// The FP8 kernels' SASS and e4m3 wgmma forms (ignored: nvcc, CuTe headers).
#[cfg(feature = "cuda")]
mod fp8;
/// The hang-check build bounds every wait; the embedded images match the build.
#[cfg(feature = "cuda")]
mod hang_check;
/// The CUDA numerics headers bit for bit against Rust (ignored: nvcc).
mod numerics_cuda_parity;
/// Every kernel of the table built, no spills, the instructions each family claims.
#[cfg(feature = "cuda")]
mod sass;

#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs the pinned CUDA 13.0 compiler from PyPI (so every
# kernel is compiled and the SASS/ptxas checks run) and the pinned CUTLASS/CuTe headers (the
# test-only oracle of tests/cute_oracle.rs), then `cargo test`, clippy, and the two integration
# crates. GPU tests are #[ignore]d and reported as ignored; run them on a GPU machine with
# scripts/gpu-check.sh.
#
# Needs python3 with venv and pip, access to PyPI and crates.io, ~300 MB for the toolchain
# (.cuda-toolchain/) and a few GB for target/ directories.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
section() { echo "== [${SECONDS}s] $*"; }
bin="$(scripts/install-cuda-toolchain.sh)"
export NVCC="$bin/nvcc"
cutlass_include="$(scripts/install-cutlass.sh)"
export FLASH_ATTN_CUTLASS_INCLUDE="$cutlass_include"
# With the toolchain present, compile-only checks must run: a missing nvcc is then a failure.
export FLASH_ATTN_REQUIRE_NVCC=1
# One kernel cache for this crate and the integration crates (their own target dirs): each
# kernel is compiled once (build.rs keys it by content).
export FLASH_ATTN_KERNEL_CACHE="$root/target/flash-attn-kernels"
export CARGO_TERM_COLOR=never
section "cargo test"
cargo test "$@"
# Checks that need nvcc or the CuTe headers (ignored in a plain `cargo test`, required here).
section "nvcc-only checks"
cargo test --test numerics_cuda_parity --test cute_oracle --test fp8_emulator "$@" -- --ignored
# Benches must build too (running them is `cargo bench`, not a test).
section "benches build"
cargo test --benches --no-run "$@"
# No clippy warning in any target, with the kernels and CPU-only.
section "clippy"
cargo clippy --all-targets "$@" -- -D warnings
cargo clippy --all-targets --no-default-features "$@" -- -D warnings
cat target/debug/build/flash_attn-*/out/kernels-build.txt 2>/dev/null | sort | uniq -c || true
# A dependent crate as an engine next to candle has it: cudarc with `dynamic-linking`, flash_attn
# with the bare `cuda` feature. Linking needs libcuda (absent here), so `cargo check` is the proof
# that the features unify and that the crate type-checks against CUDA 12.4's bindings.
section "downstream check (cudarc dynamic-linking + flash_attn bare cuda)"
(cd integrations/downstream-check && cargo check)
# The candle integration: CPU storage only (candle-core's CUDA build needs a CUDA install).
section "candle integration (CPU)"
(cd integrations/candle && cargo test && cargo build --examples)
section "done"

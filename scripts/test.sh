#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs the pinned CUDA 13.0 compiler from PyPI (so every
# kernel is compiled and the SASS/ptxas checks run) and the pinned CUTLASS/CuTe headers (the
# test-only oracle of tests/cute_oracle.rs), then `cargo test`. GPU tests are #[ignore]d and
# reported as ignored; run them on a GPU machine with scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$(scripts/install-cuda-toolchain.sh)"
export NVCC="$bin/nvcc"
cutlass_include="$(scripts/install-cutlass.sh)"
export FLASH_ATTN_CUTLASS_INCLUDE="$cutlass_include"
# With the toolchain present, compile-only checks must run: a missing nvcc is then a failure.
export FLASH_ATTN_REQUIRE_NVCC=1
export CARGO_TERM_COLOR=never
cargo test "$@"
# Checks that need nvcc or the CuTe headers (ignored in a plain `cargo test`, required here).
cargo test --test numerics_cuda_parity --test cute_oracle "$@" -- --ignored
# Benches must build too (running them is `cargo bench`, not a test).
cargo test --benches --no-run "$@"

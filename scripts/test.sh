#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs the pinned CUDA 13.0 compiler from PyPI (so every
# kernel is compiled and the SASS/ptxas checks run) and the pinned CUTLASS/CuTe headers (the
# test-only oracle of tests/toolchain/cute_oracle.rs); packages the crate (`cargo publish --dry-run`) and
# runs every test from the packaged copy, so a file missing from the tarball fails here; then the
# nvcc-only checks, clippy (with the kernels and CPU-only), `cargo doc` with warnings denied, the
# MSRV check and the two integration crates. GPU tests are #[ignore]d and reported as ignored;
# run them on a GPU machine with scripts/check/gpu.sh. The emulator's full matrix is
# scripts/emulate.sh.
#
# Needs python3 with venv and pip, access to PyPI and crates.io, ~300 MB for the toolchain
# (.cuda-toolchain/) and a few GB for target/ directories. Arguments go to each `cargo test`.
#
# CI (CI=true) runs in a fresh clone each time: the toolchains, the kernel cache and the build
# directories then live in a cache directory outside the clone ($FLASH_ATTN_TEST_CACHE, default
# ~/.cache/flash_attn-test), so a run after the first reuses them. Setting FLASH_ATTN_TEST_CACHE
# does the same outside CI.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
section() { echo "== [${SECONDS}s] $*"; }

cache="${FLASH_ATTN_TEST_CACHE:-}"
if [ -z "$cache" ] && [ "${CI:-}" = true ]; then
  cache="${XDG_CACHE_HOME:-$HOME/.cache}/flash_attn-test"
fi
if [ -n "$cache" ]; then
  mkdir -p "$cache"
  export FLASH_ATTN_CUDA_TOOLCHAIN="${FLASH_ATTN_CUDA_TOOLCHAIN:-$cache/cuda-toolchain}"
  export FLASH_ATTN_CUTLASS="${FLASH_ATTN_CUTLASS:-$cache/cutlass}"
  target="$cache/target"
else
  target="$root/target"
fi
# The crate's own builds (the repository's and the packaged copy's) share one target directory.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$target}"
target="$CARGO_TARGET_DIR"
# The integration crates keep their own (their dependency trees differ).
integration_target() { if [ -n "$cache" ]; then echo "$cache/target-$1"; else echo "$root/integrations/$1/target"; fi; }

bin="$(scripts/toolchain/install-cuda.sh)"
export NVCC="$bin/nvcc"
cutlass_include="$(scripts/toolchain/install-cutlass.sh)"
export FLASH_ATTN_CUTLASS_INCLUDE="$cutlass_include"
# With the toolchain present, compile-only checks must run: a missing nvcc is then a failure.
export FLASH_ATTN_REQUIRE_NVCC=1
# One kernel cache for every build here (build.rs keys it by content, not by checkout path, so
# the packaged copy and the integration crates reuse what the first build compiled).
export FLASH_ATTN_KERNEL_CACHE="${FLASH_ATTN_KERNEL_CACHE:-$target/flash-attn-kernels}"
export CARGO_TERM_COLOR=never

# The crate as crates.io would get it: `cargo package` writes the tarball, `cargo publish
# --dry-run` checks the manifest and the dependencies against the registry. Neither builds it
# (--no-verify): the test run below builds the tarball's contents.
section "package, publish --dry-run"
cargo package --allow-dirty --no-verify --quiet
cargo publish --dry-run --allow-dirty --no-verify --quiet
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
pkg="$target/package-test/flash_attn-$version"
# The tarball stores one fixed mtime for every file, and cargo decides what to rebuild by mtime:
# extracted over a previous copy, a changed build.rs or source would look older than its last
# build and be skipped. So the copy is updated file by file: a file whose content changed is
# rewritten (its mtime is now), an unchanged one keeps its mtime (and its build is reused).
staging="$target/package-staging"
rm -rf "$staging"
# A copy extracted whole (by an older version of this script) may hold builds older than their
# sources: start that one afresh.
[ -f "$target/package-test/.copied-by-content" ] || rm -rf "$pkg"
mkdir -p "$staging" "$pkg"
tar -xzf "$target/package/flash_attn-$version.crate" -C "$staging"
python3 - "$staging/flash_attn-$version" "$pkg" <<'PY'
import filecmp, os, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
for root, _, files in os.walk(src):
    for f in files:
        a = os.path.join(root, f)
        b = os.path.join(dst, os.path.relpath(a, src))
        if not (os.path.isfile(b) and filecmp.cmp(a, b, shallow=False)):
            os.makedirs(os.path.dirname(b), exist_ok=True)
            shutil.copyfile(a, b)
for root, _, files in os.walk(dst, topdown=False):
    for f in files:
        b = os.path.join(root, f)
        if not os.path.exists(os.path.join(src, os.path.relpath(b, dst))):
            os.remove(b)
    if root != dst and not os.listdir(root):
        os.rmdir(root)
PY
touch "$target/package-test/.copied-by-content"
rm -rf "$staging"

# Every test, from the packaged copy. Publishing strips the self dev-dependency that turns on
# `bench` in the repository, so the copy asks for the feature itself. --all-targets --no-run
# builds the benches too (running them is `cargo bench`); the run then builds nothing.
section "cargo test (packaged crate)"
(cd "$pkg" && cargo test --features bench --all-targets --no-run "$@" && cargo test --features bench "$@")
# Checks that need nvcc or the CuTe headers (ignored in a plain `cargo test`, required here).
section "nvcc-only checks"
(cd "$pkg" && cargo test --features bench --test toolchain "$@" -- --ignored)
cat "$(ls -td "$target"/debug/build/flash_attn-*/out | head -1)/kernels-build.txt" 2>/dev/null || true

# No clippy warning in any target, with the kernels and CPU-only. rust-version in Cargo.toml
# makes clippy's incompatible_msrv lint refuse any standard-library item newer than it.
section "clippy"
cargo clippy --all-targets -- -D warnings
cargo clippy --all-targets --no-default-features -- -D warnings
section "doc"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet
# The MSRV: no toolchain of that version can be installed here, so the check is clippy's lint
# above plus this: no dependency in the lock file asks for a newer Rust than the crate declares.
section "MSRV (dependencies' rust-version)"
cargo metadata --format-version 1 --locked | python3 -c '
import json, sys
m = json.load(sys.stdin)
v = lambda s: tuple(int(x) for x in s.split(".")[:2])
ours = next(p for p in m["packages"] if p["name"] == "flash_attn" and p["source"] is None)["rust_version"]
newer = ["%s %s asks for %s" % (p["name"], p["version"], p["rust_version"])
         for p in m["packages"] if p.get("rust_version") and v(p["rust_version"]) > v(ours)]
print("rust-version %s; %s" % (ours, "; ".join(newer) or "no dependency asks for a newer one"))
sys.exit(1 if newer else 0)'

# A dependent crate as an engine next to candle has it: cudarc with `dynamic-linking`, flash_attn
# with the bare `cuda` feature. Linking needs libcuda (absent here), so `cargo check` is the proof
# that the features unify and that the crate type-checks against CUDA 12.4's bindings.
section "downstream check (cudarc dynamic-linking + flash_attn bare cuda)"
(cd integrations/downstream-check && CARGO_TARGET_DIR="$(integration_target downstream-check)" cargo check)
# The candle integration: CPU storage only (candle-core's CUDA build needs a CUDA install).
section "candle integration (CPU)"
(cd integrations/candle && export CARGO_TARGET_DIR="$(integration_target candle)" && cargo test && cargo build --examples)
section "done"

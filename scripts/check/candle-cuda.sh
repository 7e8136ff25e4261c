#!/usr/bin/env bash
# Type-checks integrations/candle with its `cuda` feature: the CustomOp3's CUDA path against
# candle-core's real CUDA backend (cudarc with `dynamic-linking` and
# `cuda-version-from-build-system`, as candle sets them) next to flash_attn's bare `cuda` feature.
#
# candle-kernels' build script compiles candle's own CUDA kernels (PTX plus a static library of
# quantized-matmul instances: far beyond a CI budget on 2 cores). For a type check only their
# build step matters, so this script runs on a scratch copy of the integration crate whose
# [patch] points candle-kernels at a copy of the registry's candle-kernels with a build script
# that writes empty PTX files. Nothing in the repository changes; nothing is linked or run.
#
# Needs nvcc on PATH (cudarc reads its version): NVCC=... or the .cuda-toolchain install.
# Usage: scripts/check/candle-cuda.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="${WORK:-$(mktemp -d /tmp/flash-attn-candle-cuda.XXXXXX)}"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
nvcc="${NVCC:-$("$root/scripts/toolchain/install-cuda.sh")/nvcc}"
export PATH="$(dirname "$nvcc"):$PATH"
export FLASH_ATTN_KERNEL_CACHE="${FLASH_ATTN_KERNEL_CACHE:-$root/target/flash-attn-kernels}"

(cd "$root/integrations/candle" && cargo fetch -q)
version="$(grep -A1 '^name = "candle-kernels"' "$root/integrations/candle/Cargo.lock" | sed -n 's/^version = "\(.*\)"/\1/p')"
if [ -z "$version" ]; then
  # The CPU-only lock does not list it: resolve with the feature once.
  (cd "$root/integrations/candle" && cargo metadata -q --features cuda --format-version 1 >/dev/null)
  version="$(grep -A1 '^name = "candle-kernels"' "$root/integrations/candle/Cargo.lock" | sed -n 's/^version = "\(.*\)"/\1/p')"
fi
src="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-kernels-"$version" | head -1)"
cp -r "$src" "$work/candle-kernels"
{
  echo 'fn main() {'
  echo '    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());'
  sed -n 's/.*concat!(env!("OUT_DIR"), "\/\([A-Za-z0-9_]*\)\.ptx").*/    std::fs::write(out.join("\1.ptx"), "").unwrap();/p' "$src/src/ptx.rs"
  echo '    std::fs::write(out.join("ptx.rs"), include_str!("src/ptx.rs")).unwrap();'
  echo '}'
} > "$work/candle-kernels/build.rs"
sed -i '/^\[build-dependencies/,/^\[/{/^\[build-dependencies/d;/^\[/!d}' "$work/candle-kernels/Cargo.toml"

mkdir -p "$work/crate"
cp -r "$root/integrations/candle/src" "$root/integrations/candle/Cargo.toml" "$root/integrations/candle/Cargo.lock" "$work/crate/"
sed -i "s#path = \"../..\"#path = \"$root\"#" "$work/crate/Cargo.toml"
printf '\n[patch.crates-io]\ncandle-kernels = { path = "%s" }\n' "$work/candle-kernels" >> "$work/crate/Cargo.toml"
cd "$work/crate"
CARGO_TERM_COLOR=never cargo check --features cuda --all-targets
echo "check/candle-cuda: the CUDA path of integrations/candle type-checks against candle-core $(sed -n '/^name = "candle-core"/{n;p}' Cargo.lock)"

#!/usr/bin/env bash
# Installs NVIDIA's CUTLASS/CuTe headers from PyPI (nvidia-cutlass, pinned) into .cutlass/
# (git-ignored): a test-only dependency of the CuTe oracle (cuda/test/oracle/, tests/toolchain/cute_oracle.rs),
# never vendored into the repository. Only the headers are used, so the wheel is installed without
# its Python dependencies (cuda-python, numpy, ...).
# Idempotent: a second run only checks the stamp file and exits.
# Env: FLASH_ATTN_CUTLASS = install directory (default <repo>/.cutlass; point several worktrees at
# one copy to share it).
# Prints the include directory (the one holding cute/ and cutlass/).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${FLASH_ATTN_CUTLASS:-$root/.cutlass}"
pkg="nvidia-cutlass==4.2.0.0"
stamp="$dest/.installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pkg" ]; then
  :
else
  rm -rf "$dest"
  python3 -m venv "$dest" >&2
  "$dest/bin/pip" install --quiet --no-cache-dir --no-deps "$pkg" >&2
  printf '%s\n' "$pkg" > "$stamp"
fi
inc="$(echo "$dest"/lib/python3*/site-packages/cutlass_library/source/include)"
[ -f "$inc/cute/tensor.hpp" ] || { echo "install-cutlass: cute/tensor.hpp missing under $inc" >&2; exit 1; }
echo "$inc"

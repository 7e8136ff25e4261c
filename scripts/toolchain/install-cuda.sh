#!/usr/bin/env bash
# Installs the CUDA 13.0 compiler from PyPI into .cuda-toolchain/ (git-ignored).
#
# Every piece is pinned to 13.0: an unpinned `nvidia-cuda-nvcc==13.0.88` pulls nvvm/crt 13.5,
# whose PTX (.version 9.5) ptxas 13.0 rejects and driver 580 cannot load.
# Idempotent: a second run only checks the stamp file and exits. The stamp is written last:
# build.rs uses the toolchain only once it is there, and reruns when it changes.
# Prints the path of the bin/ directory holding nvcc, ptxas, cuobjdump and nvdisasm.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${FLASH_ATTN_CUDA_TOOLCHAIN:-$root/.cuda-toolchain}"
pkgs=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-cuda-runtime==13.0.*"
  "nvidia-cuda-crt==13.0.*"
  "nvidia-cuda-cccl==13.0.*"
  "nvidia-nvvm==13.0.*"
  "nvidia-cuda-nvdisasm==13.5.*"
  "nvidia-cuda-cuobjdump==13.2.86"
)
stamp="$dest/.installed"
want="$(printf '%s\n' "${pkgs[@]}")"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  :
else
  # Keep the committed README (the directory cargo watches); remove a previous install.
  mkdir -p "$dest"
  find "$dest" -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
  python3 -m venv "$dest" >&2
  "$dest/bin/pip" install --quiet --no-cache-dir "${pkgs[@]}" >&2
  printf '%s\n' "$want" > "$stamp"
fi
bin="$(echo "$dest"/lib/python3*/site-packages/nvidia/cu13/bin)"
[ -x "$bin/nvcc" ] || { echo "install-cuda-toolchain: nvcc missing under $bin" >&2; exit 1; }
echo "$bin"

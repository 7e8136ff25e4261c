#!/usr/bin/env bash
# Builds every kernel with a CUDA 12.4 nvcc and runs the compile-only checks (tests/toolchain/sass.rs) on
# what it built: the proof that the crate builds with a CUDA 12.x toolchain, not only the
# pinned 13.0 one scripts/test.sh installs.
#
# Where the 12.4 toolchain comes from: PyPI's 12.x wheels (nvidia-cuda-nvcc-cu12 & co.) ship
# ptxas, libnvvm and headers but neither the nvcc driver nor cicc, so the compiler binaries come
# from Debian's nvidia-cuda-toolkit 12.4.131 (trixie, non-free; fetched with apt-get into a
# private apt state under $WORK and unpacked with dpkg-deb: nothing is installed system-wide)
# and the headers from the PyPI 12.4 wheels (nvidia-cuda-runtime-cu12, nvidia-cuda-nvcc-cu12 for
# crt/, nvidia-cuda-cccl-cu12). They are assembled into the standard layout (bin/, nvvm/,
# include/) with an nvcc.profile of our own.
#
# Needs apt-get and dpkg-deb, python3 with venv and pip, network access to Debian's mirror and
# PyPI: ~90 MB of .deb and ~60 MB of wheels, ~600 MB unpacked under $WORK (default: a temp dir,
# removed afterwards unless KEEP=1). The cargo build uses the repository's target/ (its kernel
# cache keys include the toolchain, so nothing mixes with the 13.0 images; the next plain build
# takes those back from the cache).
#
# Usage: scripts/check/cuda12.sh [extra cargo test args]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="${WORK:-$(mktemp -d /tmp/flash-attn-cuda12.XXXXXX)}"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
deb_version="12.4.131~12.4.1-2"
pypi=("nvidia-cuda-runtime-cu12==12.4.127" "nvidia-cuda-nvcc-cu12==12.4.131" "nvidia-cuda-cccl-cu12==12.4.127.post1")

echo "== Debian nvidia-cuda-toolkit $deb_version (trixie non-free) into $work" >&2
apt_dir="$work/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie non-free" \
  > "$apt_dir/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o Dir::State::status=/dev/null
  -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" -qq update
(cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" -qq download "nvidia-cuda-toolkit=$deb_version")
deb_root="$work/deb-root"
dpkg-deb -x "$apt_dir"/debs/nvidia-cuda-toolkit_*.deb "$deb_root"

echo "== PyPI headers: ${pypi[*]}" >&2
python3 -m venv "$work/venv" >&2
"$work/venv/bin/pip" install --quiet --no-cache-dir "${pypi[@]}" >&2
nv="$(echo "$work"/venv/lib/python3*/site-packages/nvidia)"

cuda="$work/cuda-12.4"
mkdir -p "$cuda/bin" "$cuda/nvvm/bin" "$cuda/nvvm/libdevice" "$cuda/include"
tk="$deb_root/usr/lib/nvidia-cuda-toolkit"
cp "$tk/bin/nvcc" "$cuda/bin/"           # the real driver (/usr/bin/nvcc is a wrapper script)
cp "$deb_root"/usr/bin/{ptxas,fatbinary,cudafe++,nvlink,cuobjdump,nvdisasm,bin2c} "$cuda/bin/"
cp "$tk/bin/cicc" "$cuda/nvvm/bin/"
cp "$tk"/libdevice/* "$cuda/nvvm/libdevice/"
cp -r "$nv/cuda_runtime/include/." "$nv/cuda_nvcc/include/." "$nv/cuda_cccl/include/." "$cuda/include/"
cat > "$cuda/bin/nvcc.profile" <<'PROFILE'
TOP                = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
PATH              += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES          += "-I$(TOP)/include" $(_SPACE_)
LIBRARIES          =+ $(_SPACE_) "-L$(TOP)/lib64"
CUDAFE_FLAGS      +=
PTXAS_FLAGS       +=
PROFILE
"$cuda/bin/nvcc" --version | tail -2 >&2

echo "== cargo test --test toolchain sass:: with NVCC=$cuda/bin/nvcc" >&2
cd "$root"
NVCC="$cuda/bin/nvcc" FLASH_ATTN_REQUIRE_NVCC=1 CARGO_TERM_COLOR=never \
  cargo test --test toolchain sass:: "$@" -- --nocapture 2>&1 | grep -vE '^ptxas info|^    [0-9]+ bytes stack|^\s*$' | grep -vE '^(fa|cpu)[0-9a-z_]+ +(80|90a|100a) ' 

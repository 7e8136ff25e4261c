#!/usr/bin/env bash
# One-command GPU check, build half (here, with Rust and the CUDA toolchain, no GPU needed):
# builds the release GPU test binary and bench binaries with every kernel, plus the GPU tests
# once more with the hang-check kernels (FLASH_ATTN_HANG_CHECK=1, in target/hang-check: the run
# half reruns a timed-out FA3 stage with it to get a message instead of a timeout), strips them
# and gathers them with a run script in gpu-check/ (git-ignored, < 64 MiB, what the device tool's
# `carry` takes). On the GPU machine (no Rust there) run the other half:
#     bash gpu-check/run.sh          # logs and summary under $OUT (or gpu-check/out)
# With the device tool: run(command="bash gpu-check/run.sh", carry=["gpu-check"], timeout_s=420).
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
dest="$root/gpu-check"
limit_mib=60  # the device tool carries at most 64 MiB with the working tree

if [ -z "${NVCC:-}" ]; then
  bin="$(scripts/toolchain/install-cuda.sh)"
  export NVCC="$bin/nvcc"
fi
export FLASH_ATTN_REQUIRE_NVCC=1   # a GPU check without kernels would be meaningless
# Every binary embeds every kernel image (all targets: ~24 MB), and several binaries must fit in
# the device tool's 64 MiB: build only the lent GPU's target, sm_90a for the H200 (set
# FLASH_ATTN_ARCHS=80 for an Ampere/Ada GPU, or 80,90a,100a,ptx for all).
export FLASH_ATTN_ARCHS="${FLASH_ATTN_ARCHS:-90a}"
export CARGO_TERM_COLOR=never

rm -rf "$dest"
mkdir -p "$dest/bin"
json="$(mktemp)"
hang_json="$(mktemp)"
trap 'rm -f "$json" "$hang_json"' EXIT

echo "== cargo test --release --no-run" >&2
cargo test --release --no-run --message-format=json-render-diagnostics >"$json"
echo "== cargo bench --no-run" >&2
cargo bench --no-run --message-format=json-render-diagnostics >>"$json"
echo "== cargo build --release --examples" >&2
cargo build --release --examples >&2
# The hang-check variant of the GPU tests (its own target dir, so neither build invalidates the
# other's kernels).
echo "== FLASH_ATTN_HANG_CHECK=1 cargo test --release --no-run --test gpu" >&2
FLASH_ATTN_HANG_CHECK=1 CARGO_TARGET_DIR="$root/target/hang-check" \
  cargo test --release --no-run --test gpu --message-format=json-render-diagnostics >"$hang_json"

# The GPU test binary (tests/gpu/) and the GPU bench binary.
python3 - "$json" "$dest/bin" <<'PY'
import json, shutil, sys, os
src, dst = sys.argv[1], sys.argv[2]
seen = set()
for line in open(src):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") != "compiler-artifact" or not exe:
        continue
    kind, name = m["target"]["kind"], m["target"]["name"]
    # GPU tests and the GPU bench (the CPU bench has no business on the GPU machine).
    if (kind == ["test"] and name == "gpu") or (kind == ["bench"] and name == "gpu"):
        out = os.path.join(dst, ("bench-" if kind == ["bench"] else "") + name)
        if out not in seen:
            seen.add(out)
            shutil.copy2(exe, out)
            print(f"gathered {out}", file=sys.stderr)
PY
mkdir -p "$dest/bin/hang-check"
python3 - "$hang_json" "$dest/bin/hang-check" <<'PY'
import json, shutil, sys, os
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu" and m["target"]["kind"] == ["test"]:
        shutil.copy2(m["executable"], os.path.join(sys.argv[2], "gpu"))
        print(f"gathered {sys.argv[2]}/gpu (hang-check kernels)", file=sys.stderr)
PY
[ -x "$dest/bin/hang-check/gpu" ] || { echo "no hang-check GPU test binary was built" >&2; exit 1; }
# The one-shape bench (JSON lines for the short performance run) and the torch peers script
# (with the GPU table it parses).
cp target/release/examples/bench "$dest/bin/fa-bench"
cp scripts/bench/gpu-peers-torch.py src/bench/roofline.rs "$dest/"
find "$dest/bin" -type f -exec strip {} + 2>/dev/null || true
cp scripts/check/gpu-run.sh "$dest/run.sh"
chmod +x "$dest/run.sh"
git -C "$root" rev-parse --short HEAD > "$dest/COMMIT" 2>/dev/null || echo unknown > "$dest/COMMIT"

size_mib=$(( $(du -sk "$dest" | cut -f1) / 1024 ))
ls -l "$dest/bin" >&2
echo "gpu-check/: ${size_mib} MiB (limit ${limit_mib})" >&2
if [ "$size_mib" -gt "$limit_mib" ]; then
  echo "gpu-check/ is too large to carry" >&2
  exit 1
fi
echo "next, on the GPU machine: bash gpu-check/run.sh" >&2

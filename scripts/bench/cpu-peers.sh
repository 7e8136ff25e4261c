#!/usr/bin/env bash
# Our CPU backend and the CPU peers (torch SDPA, onnxruntime MHA and Attention) side by side:
# one table with an `ours / best` column, into docs/bench-data/cpu-peers.md (+ .jsonl).
#
#   scripts/bench/cpu-peers.sh            # 3 alternating rounds, median: about 3-5 minutes on 2 cores
#   scripts/bench/cpu-peers.sh --quick    # 1 short round: a smoke run (under a minute)
#   scripts/bench/cpu-peers.sh --rounds 5 --out /tmp/table.md
#   scripts/bench/cpu-peers.sh --sweep    # also head_dim 256, 16x128, 8192 causal, GQA, bf16/f16 rows:
#                                   # about 6-9 minutes at --rounds 1 on 2 cores (estimated)
#   scripts/bench/cpu-peers.sh --quick --only decode,gqa-decode   # a smoke run of named rows
#   scripts/bench/cpu-peers.sh --alloc    # ours through `forward` (a new output per call) instead of
#                                   # `forward_into` a reused buffer
#   scripts/bench/cpu-peers.sh --backward # the backward pass beside torch's and jax's (the three prefill
#                                   # rows; needs torch and jax only), into docs/bench-data/cpu-peers-backward.md
#
# Needs: the peers' venv (PEERS_PYTHON, default /tmp/peers-venv/bin/python; set it up as
# ../shared/peers/README.md says: one pip install, under a minute) and cpu_peers.py
# (PEERS_DIR, default ../shared/peers next to this repository, else /work/shared/peers).
# Each round also measures the machine's read rate (examples/read_bw and torch's), the ceiling of
# the decode rows. Builds examples/bench and examples/read_bw in release first (CPU-only unless
# NVCC is set: the GPU kernels do not matter here). Run it on a quiet machine: the table notes
# the load average it saw.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
py="${PEERS_PYTHON:-/tmp/peers-venv/bin/python}"
dir="${PEERS_DIR:-}"
if [ -z "$dir" ]; then
  for c in "$repo/../shared/peers" /work/shared/peers; do
    if [ -f "$c/cpu_peers.py" ]; then dir="$c"; break; fi
  done
fi
if [ -z "$dir" ] || [ ! -f "$dir/cpu_peers.py" ]; then
  echo "cpu-peers: cpu_peers.py not found: set PEERS_DIR to the folder holding it" >&2
  exit 2
fi
mods="torch, onnxruntime, onnx"
case " $* " in *" --backward "*) mods="torch, jax" ;; esac
if ! "$py" -c "import $mods" 2>/dev/null; then
  echo "cpu-peers: $py lacks $mods: set PEERS_PYTHON, or create the venv as $dir/README.md says" >&2
  exit 2
fi
cargo build --release --quiet --example bench --example read_bw --example bench_backward
exec python3 "$repo/scripts/bench/cpu-peers-table.py" --bench "$repo/target/release/examples/bench" \
  --read-bw "$repo/target/release/examples/read_bw" \
  --bench-backward "$repo/target/release/examples/bench_backward" \
  --python "$py" --peers-script "$dir/cpu_peers.py" "$@"

#!/usr/bin/env bash
# The performance part of the GPU check: our kernels and the torch SDPA peers on the same
# shapes, one JSON line per run, into $OUT (or ./gpu-bench-out). Runs on the GPU machine (no
# network); the report and the plot are made afterwards on any machine:
#   python3 scripts/bench/report.py OUT/*.jsonl --md OUT/report.md --png-dir OUT/plots
#
#   scripts/bench/gpu-peers.sh            short version (hdim 64/128, seqlen 4K, 16K tokens; FP8 at
#                                   hdim 64/128/256): ~2 min
#   scripts/bench/gpu-peers.sh --full     the full sweep (seqlen 512..16K, hdim 64/128/256; FP8 at
#                                   seqlen 4K-16K)
#
# Without a GPU every step says "no CUDA GPU present" and the script exits 0.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu-bench-out}"
mkdir -p "$out"
quick=1
[[ "${1:-}" == "--full" ]] && quick=0

if [[ $quick == 1 ]]; then seqlens="4096"; dims="64 128"; else seqlens="512 1024 2048 4096 8192 16384"; dims="64 128 256"; fi
tokens=16384
hidden=2048

cargo build --release --example bench
bench=target/release/examples/bench

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit --format=csv 2>/dev/null \
    || echo "nvidia-smi not available"
} | tee "$out/gpu-info.txt"

# Ours: every variant on every shape (a variant the GPU lacks prints a note and no line).
: > "$out/ours.jsonl"
for d in $dims; do
  heads=$((hidden / d))
  for s in $seqlens; do
    b=$((tokens / s))
    for causal in "" "--causal"; do
      for variant in fa1 fa2 fa3 fa4; do
        $bench --backend cuda --variant "$variant" --dtype bf16 --batch "$b" --seqlen "$s" \
          --heads "$heads" --head-dim "$d" $causal --runs 20 --check-rows 16 >> "$out/ours.jsonl" \
          || echo "ours: $variant b$b s$s d$d $causal failed" >&2
      done
    done
  done
done

# FP8 (docs/fp8.md, "On Hopper"): Variant::Fa3 with Precision::Fp8 on bf16 inputs, timed end to
# end (scratch, pre-pass of Q+K and of V into Vᵀ, the top FP8 consumer stage), beside the bf16
# lines above and the torch SDPA peers below; head dims 64/128/256 at seqlen 4K (short) or
# 4K-16K (--full), causal and not. Per-block (64) scales + Hadamard (the accuracy table's
# setting); --full adds per-tensor scales without rotation (FA3's released granularity). The FP8
# rows cover head dims 64, 128 and 256 (a head dim they lacked would print the dispatch's
# refusal and no line). Never ran on a GPU yet.
if [[ $quick == 1 ]]; then fp8_seqlens="4096"; fp8_modes="block:64"; else fp8_seqlens="4096 8192 16384"; fp8_modes="block:64 tensor"; fi
: > "$out/fp8.jsonl"
for d in 64 128 256; do
  heads=$((hidden / d))
  for s in $fp8_seqlens; do
    b=$(( tokens / s > 0 ? tokens / s : 1 ))
    for causal in "" "--causal"; do
      for mode in $fp8_modes; do
        rot=""; [[ $mode == block:* ]] && rot="--hadamard 1"
        $bench --backend cuda --variant fa3 --fp8 "$mode" $rot --dtype bf16 --batch "$b" --seqlen "$s" \
          --heads "$heads" --head-dim "$d" $causal --runs 20 --check-rows 16 >> "$out/fp8.jsonl" \
          || echo "fp8: $mode b$b s$s d$d $causal failed" >&2
      done
    done
  done
done

# Peers: torch SDPA flash and cuDNN on the same sweep.
if python3 -c "import torch" 2>/dev/null; then
  if [[ $quick == 1 ]]; then
    python3 scripts/bench/gpu-peers-torch.py --quick --tokens $tokens > "$out/peers.jsonl"
  else
    python3 scripts/bench/gpu-peers-torch.py --tokens $tokens > "$out/peers.jsonl"
  fi
else
  echo "torch not importable: no peers" >&2
fi

# The criterion bench (short sweep) for its own log.
FA_BENCH_QUICK=$quick cargo bench --bench gpu 2>&1 | tail -n 40 | tee "$out/criterion-gpu.txt"
echo "JSON lines in $out; report: python3 scripts/bench/report.py $out/*.jsonl --md $out/report.md --png-dir $out/plots"

#!/usr/bin/env bash
# One GPU window for the FA3 stage ladder (docs/fa3.md, "What to run first").
# Here (no GPU): scripts/check-fa3.sh builds target/fa3-check/{fa3_hd*.sm90a.cubin,fa3-gpu-smoke}.
# There (device `run` tool, carry ["target/fa3-check"]): scripts/fa3-gpu-window.sh [budget_s]
# Runs each stage alone under a timeout (a hang names its rung), then compute-sanitizer on the
# passing stages if it is installed, then the benchmark of the passing stages.
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bin=target/fa3-check/fa3-gpu-smoke
[ -x "$bin" ] || { echo "missing $bin: run scripts/check-fa3.sh first and carry target/fa3-check"; exit 2; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>/dev/null || true
passed=""
for s in 1 2 3 4 5; do
  echo "== stage $s"
  timeout 90 "$bin" --stages "$s"
  rc=$?
  case $rc in
    0) passed="$passed$s" ;;
    124) echo "stage $s: TIMEOUT after 90 s (hang: see the last case line above)" ;;
    *) echo "stage $s: FAILED (exit $rc)" ;;
  esac
done
case $passed in
  *5*)
    for n in 1 3; do
      echo "== stage 5 with $n CTA(s)"
      timeout 120 "$bin" --stages 5 --ctas "$n" || echo "stage 5 with $n CTA(s): FAILED or TIMEOUT"
    done ;;
esac
echo "== passing stages: ${passed:-none}"
if [ -n "$passed" ] && command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck synccheck; do
    echo "== compute-sanitizer --tool $tool (stages $passed)"
    timeout 180 compute-sanitizer --tool "$tool" --error-exitcode 3 "$bin" --stages "$passed" | tail -5
  done
fi
if [ -n "$passed" ]; then
  echo "== bench (hd128, bf16, b2 s8192 h16)"
  timeout 180 "$bin" --stages "$passed" --bench | grep -E "bench|FATAL"
fi

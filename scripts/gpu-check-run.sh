#!/usr/bin/env bash
# One-command GPU check, run half (on the GPU machine: needs no Rust; uses nvidia-smi,
# compute-sanitizer when present). Copied to gpu-check/run.sh by scripts/gpu-check.sh.
#   1. every GPU test binary with --include-ignored (the #[ignore]d GPU tests and the rest),
#   2. compute-sanitizer memcheck (and racecheck) on the short `sanitizer_subset` test,
#   3. each bench binary briefly (criterion: 0.5 s warm-up, 1 s measurement),
# then a summary table, printed last. Full logs go to $OUT (at most 8 files: the device tool's
# limit), or gpu-check/out when OUT is unset. Budget: well under 5 minutes.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$here/out}"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
export CRITERION_HOME="${TMPDIR:-/tmp}/flash_attn_criterion"
export RUST_BACKTRACE=1

# cudarc dlopens libcuda.so.1: make sure the driver's folder is on the search path.
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so'; then
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/local/cuda/compat; do
    [ -e "$d/libcuda.so.1" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
fi

{
  echo "commit: $(cat "$here/COMMIT" 2>/dev/null)"
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  command -v compute-sanitizer || echo "compute-sanitizer: not found"
} >"$out/env.log" 2>&1

rows=()
row() { rows+=("$(printf '%-34s %-6s %6ss  %s' "$1" "$2" "$3" "$4")"); }

# 1. GPU tests.
: >"$out/tests.log"
for b in "$here"/bin/gpu_*; do
  [ -x "$b" ] || continue
  name="$(basename "$b")"
  t0=$SECONDS
  timeout 200 "$b" --include-ignored --test-threads=4 >>"$out/tests.log" 2>&1
  rc=$?
  res="$(grep -E '^test result:' "$out/tests.log" | tail -1 | sed 's/test result: //')"
  row "$name (--include-ignored)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc ${res}"
done
grep -E '^test .* FAILED|panicked' "$out/tests.log" | head -20 >>"$summary"

# 2. memcheck on the short subset.
if command -v compute-sanitizer >/dev/null && [ -x "$here/bin/gpu_forward" ]; then
  t0=$SECONDS
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    "$here/bin/gpu_forward" --ignored --exact sanitizer_subset --test-threads=1 >"$out/memcheck.log" 2>&1
  rc=$?
  errs="$(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tail -1)"
  row "memcheck sanitizer_subset" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc ${errs:-no summary}"
else
  row "memcheck sanitizer_subset" "SKIP" 0 "compute-sanitizer or gpu_forward missing"
fi

# 2b. racecheck (shared-memory hazards) on the same subset.
if command -v compute-sanitizer >/dev/null && [ -x "$here/bin/gpu_forward" ]; then
  t0=$SECONDS
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 20 \
    "$here/bin/gpu_forward" --ignored --exact sanitizer_subset --test-threads=1 >"$out/racecheck.log" 2>&1
  rc=$?
  errs="$(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$out/racecheck.log" | tail -1)"
  row "racecheck sanitizer_subset" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc ${errs:-no summary}"
fi

# 3. Short benchmarks.
: >"$out/bench.log"
for b in "$here"/bin/bench-*; do
  [ -x "$b" ] || continue
  name="$(basename "$b")"
  t0=$SECONDS
  timeout 60 "$b" --bench --warm-up-time 0.5 --measurement-time 1 >>"$out/bench.log" 2>&1
  rc=$?
  row "$name" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc (numbers in bench.log)"
done
[ ${#rows[@]} -gt 0 ] || row "(nothing ran)" FAIL 0 "no binaries under $here/bin"

{
  echo
  echo "== flash_attn GPU check ($(head -1 "$out/env.log"); $(sed -n 4p "$out/env.log" | cut -d, -f1-2))"
  printf '%-34s %-6s %7s  %s\n' step result time detail
  printf '%s\n' "${rows[@]}"
  echo "logs: $out/{env,tests,memcheck,racecheck,bench}.log, summary.txt"
} | tee -a "$summary"
printf '%s\n' "${rows[@]}" | grep -q ' FAIL ' && exit 1
exit 0

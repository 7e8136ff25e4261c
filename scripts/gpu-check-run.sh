#!/usr/bin/env bash
# One-command GPU check, run half (on the GPU machine: needs no Rust; uses nvidia-smi,
# compute-sanitizer when present). Copied to gpu-check/run.sh by scripts/gpu-check.sh.
#   1. every GPU test binary with --include-ignored (the #[ignore]d GPU tests and the rest),
#      except the FA3 stage ladder, which runs next:
#   1b. FA3 stages 1..5 in ascending order, one test each (gpu_forward fa3_stage<N>) under its
#      own timeout, so a hang in stage N names its rung and leaves the window to the rest,
#   2. compute-sanitizer memcheck (and racecheck) on the short `sanitizer_subset` test, and
#      memcheck on `fa3_sanitizer_subset` for each FA3 stage that passed (own timeout each),
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
  timeout 200 "$b" --include-ignored --test-threads=4 --skip fa3_ >>"$out/tests.log" 2>&1
  rc=$?
  res="$(grep -E '^test result:' "$out/tests.log" | tail -1 | sed 's/test result: //')"
  row "$name (--include-ignored)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc ${res}"
done

# 1b. The FA3 stage ladder (docs/fa3.md), lowest rung first, each stage alone under a timeout.
fa3_passed=""
: >"$out/fa3.log"
if [ -x "$here/bin/gpu_forward" ]; then
  for s in 1 2 3 4 5; do
    t0=$SECONDS
    echo "== fa3_stage$s" >>"$out/fa3.log"
    timeout "${FA3_STAGE_TIMEOUT:-45}" "$here/bin/gpu_forward" --ignored --exact "fa3_stage$s" --nocapture \
      >>"$out/fa3.log" 2>&1
    rc=$?
    case $rc in
      0) res=PASS; fa3_passed="$fa3_passed$s"; detail="$(grep -E "^fa3 stage $s: passed" "$out/fa3.log" | tail -1)" ;;
      124) res=FAIL; detail="TIMEOUT (hang? the last case line in fa3.log names the shape)" ;;
      *) res=FAIL; detail="rc=$rc $(sed -n "/^== fa3_stage$s\$/,\$p" "$out/fa3.log" | grep -A1 -E 'panicked' | tail -1 | cut -c1-120)" ;;
    esac
    row "fa3 stage $s" "$res" $((SECONDS - t0)) "$detail"
  done
fi
grep -E '^test .* FAILED|panicked' "$out/tests.log" "$out/fa3.log" | head -20 >>"$summary"

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

# 2c. memcheck on each FA3 stage that passed (a stage that failed or hung would only waste time).
if command -v compute-sanitizer >/dev/null && [ -x "$here/bin/gpu_forward" ] && [ -n "$fa3_passed" ]; then
  : >"$out/fa3-memcheck.log"
  for s in $(echo "$fa3_passed" | grep -o .); do
    t0=$SECONDS
    FA3_SANITIZE_STAGE=$s timeout 40 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
      "$here/bin/gpu_forward" --ignored --exact fa3_sanitizer_subset --test-threads=1 >>"$out/fa3-memcheck.log" 2>&1
    rc=$?
    errs="$(grep -E 'ERROR SUMMARY' "$out/fa3-memcheck.log" | tail -1)"
    row "memcheck fa3 stage $s" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc ${errs:-no summary}"
  done
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
  echo "fa3 stages passed: ${fa3_passed:-none} (mark them gpu_verified in build/instances.rs, docs/fa3.md)"
  echo "logs: $out/{env,tests,fa3,memcheck,racecheck,fa3-memcheck,bench}.log, summary.txt"
} | tee -a "$summary"
printf '%s\n' "${rows[@]}" | grep -q ' FAIL ' && exit 1
exit 0

#!/usr/bin/env bash
# One-command GPU check, run half (on the GPU machine: needs no Rust; uses nvidia-smi,
# compute-sanitizer when present). Copied to gpu-check/run.sh by scripts/check/gpu.sh.
#   1. every GPU test binary with --include-ignored (the #[ignore]d GPU tests and the rest),
#      except the FA3 stage ladder, which runs next:
#   1b. FA3 stages 1..5 in ascending order, one test each (gpu fa3_stage<N>) under its
#      own timeout, so a hang in stage N names its rung and leaves the window to the rest; a stage
#      that timed out is rerun once with bin/hang-check/gpu (kernels built with
#      FLASH_ATTN_HANG_CHECK=1: a wait stuck for 1 s prints block, warp, barrier and parity, then
#      traps after 2 s), so the window yields a message instead of only a timeout,
#   1c. the backward kernels (gpu backward::: FA2 and the FA3-style kernel against the float64
#      reference gradient, deterministic and atomic dq) under their own timeout, into tests.log,
#   1d. FA3's serving tests (gpu fa3_serving_*: the FP8 KV cache, the rotary append) once stage 5
#      passed, under their own timeout, into fa3.log,
#   2. compute-sanitizer memcheck (and racecheck) on the short `sanitizer_subset` test, and
#      memcheck on `fa3_sanitizer_subset` for each FA3 stage that passed (own timeout each),
#   3. each bench binary briefly (criterion: 0.5 s warm-up, 1 s measurement; the GPU one on
#      its short sweep, FA_BENCH_QUICK=1),
#   4. the short performance run: bin/fa-bench (one JSON line per shape and variant: hdim 64
#      and 128 at seqlen 4K, 16K tokens, causal and not, bf16; then FP8 through Variant::Fa3 at
#      hdim 64/128/256) and gpu-peers-torch.py (torch SDPA flash and cuDNN) on the same shapes, into
#      $OUT/perf.jsonl (~130 s at most),
# then a summary table with the performance lines, printed last. Full logs go to $OUT (at most 8 files: the device tool's
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
for b in "$here"/bin/gpu; do
  [ -x "$b" ] || continue
  name="$(basename "$b")"
  t0=$SECONDS
  timeout 200 "$b" --include-ignored --test-threads=4 --skip fa3_ --skip backward:: >>"$out/tests.log" 2>&1
  rc=$?
  res="$(grep -E '^test result:' "$out/tests.log" | tail -1 | sed 's/test result: //')"
  row "$name (--include-ignored)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc ${res}"
done

# 1b. The FA3 stage ladder (docs/fa3.md), lowest rung first, each stage alone under a timeout.
fa3_passed=""
hang_lines=""
: >"$out/fa3.log"
if [ -x "$here/bin/gpu" ]; then
  for s in 1 2 3 4 5; do
    t0=$SECONDS
    echo "== fa3_stage$s" >>"$out/fa3.log"
    timeout "${FA3_STAGE_TIMEOUT:-45}" "$here/bin/gpu" --ignored --exact "fa3_stage$s" --nocapture \
      >>"$out/fa3.log" 2>&1
    rc=$?
    case $rc in
      0) res=PASS; fa3_passed="$fa3_passed$s"; detail="$(grep -E "^fa3 stage $s: passed" "$out/fa3.log" | tail -1)" ;;
      124) res=FAIL; detail="TIMEOUT (hang? the last case line in fa3.log names the shape)" ;;
      *) res=FAIL; detail="rc=$rc $(sed -n "/^== fa3_stage$s\$/,\$p" "$out/fa3.log" | grep -A1 -E 'panicked' | tail -1 | cut -c1-120)" ;;
    esac
    row "fa3 stage $s" "$res" $((SECONDS - t0)) "$detail"
    if [ $rc = 124 ] && [ -x "$here/bin/hang-check/gpu" ]; then
      # The hang-check kernels report the stuck wait and trap: the test then fails fast.
      t0=$SECONDS
      echo "== fa3_stage$s hang-check rerun" >>"$out/fa3.log"
      timeout "${FA3_HANG_RERUN_TIMEOUT:-40}" "$here/bin/hang-check/gpu" --ignored --exact "fa3_stage$s" \
        --nocapture >>"$out/fa3.log" 2>&1
      rc=$?
      diag="$(sed -n "/^== fa3_stage$s hang-check rerun\$/,\$p" "$out/fa3.log" | grep -m1 'flash_attn hang check: HANG:' \
        | sed 's/^flash_attn hang check: HANG: //' | cut -c1-110)"
      case $rc in
        0) res=DIAG; detail="rerun passed: hang not reproduced with the hang-check kernels" ;;
        124) res=DIAG; detail="rerun timed out too: ${diag:-no wait reported (all stuck in bar.sync, or a loop?)}" ;;
        *) res=DIAG; detail="${diag:-rc=$rc, no hang report (see fa3.log)}" ;;
      esac
      row "fa3 stage $s hang-check rerun" "$res" $((SECONDS - t0)) "$detail"
      hang_lines+="$(sed -n "/^== fa3_stage$s hang-check rerun\$/,\$p" "$out/fa3.log" | grep 'flash_attn hang check' \
        | head -12 | sed "s/^/fa3 stage $s: /")"$'\n'
    fi
  done
fi

# 1c. The backward kernels (never run on a GPU before this check): their own timeout, same log.
if [ -x "$here/bin/gpu" ]; then
  t0=$SECONDS
  echo "== backward::" >>"$out/tests.log"
  timeout "${BACKWARD_TIMEOUT:-150}" "$here/bin/gpu" --ignored --test-threads=4 backward:: --nocapture >>"$out/tests.log" 2>&1
  rc=$?
  res="$(sed -n '/^== backward::$/,$p' "$out/tests.log" | grep -E '^test result:' | tail -1 | sed 's/test result: //')"
  row "gpu backward:: (fa2, fa3 bwd)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc ${res}"
fi
# 1d. FA3's serving paths (the stage-5 kernel, gathered FP8 tiles and the rotary append's cache),
# only once stage 5 passed alone.
if [ -x "$here/bin/gpu" ] && [[ "$fa3_passed" == *5* ]]; then
  t0=$SECONDS
  echo "== fa3_serving_" >>"$out/fa3.log"
  timeout "${FA3_SERVING_TIMEOUT:-60}" "$here/bin/gpu" --ignored --test-threads=2 fa3_serving_ --nocapture >>"$out/fa3.log" 2>&1
  rc=$?
  res="$(sed -n '/^== fa3_serving_$/,$p' "$out/fa3.log" | grep -E '^test result:' | tail -1 | sed 's/test result: //')"
  row "gpu fa3_serving_ (fp8 cache, rotary append)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc ${res}"
fi
grep -E '^test .* FAILED|panicked' "$out/tests.log" "$out/fa3.log" | head -20 >>"$summary"

# 2. memcheck on the short subset.
if command -v compute-sanitizer >/dev/null && [ -x "$here/bin/gpu" ]; then
  t0=$SECONDS
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    "$here/bin/gpu" --ignored --exact sanitizer_subset --test-threads=1 >"$out/memcheck.log" 2>&1
  rc=$?
  errs="$(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tail -1)"
  row "memcheck sanitizer_subset" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc ${errs:-no summary}"
else
  row "memcheck sanitizer_subset" "SKIP" 0 "compute-sanitizer or bin/gpu missing"
fi

# 2b. racecheck (shared-memory hazards) on the same subset.
if command -v compute-sanitizer >/dev/null && [ -x "$here/bin/gpu" ]; then
  t0=$SECONDS
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 20 \
    "$here/bin/gpu" --ignored --exact sanitizer_subset --test-threads=1 >"$out/racecheck.log" 2>&1
  rc=$?
  errs="$(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$out/racecheck.log" | tail -1)"
  row "racecheck sanitizer_subset" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc ${errs:-no summary}"
fi

# 2c. memcheck on each FA3 stage that passed (a stage that failed or hung would only waste time).
if command -v compute-sanitizer >/dev/null && [ -x "$here/bin/gpu" ] && [ -n "$fa3_passed" ]; then
    for s in $(echo "$fa3_passed" | grep -o .); do
    t0=$SECONDS
    FA3_SANITIZE_STAGE=$s timeout 40 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
      "$here/bin/gpu" --ignored --exact fa3_sanitizer_subset --test-threads=1 >>"$out/memcheck.log" 2>&1
    rc=$?
    errs="$(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tail -1)"
    row "memcheck fa3 stage $s" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc ${errs:-no summary}"
  done
fi

# 3. Short benchmarks.
: >"$out/bench.log"
for b in "$here"/bin/bench-*; do
  [ -x "$b" ] || continue
  name="$(basename "$b")"
  t0=$SECONDS
  FA_BENCH_QUICK=1 timeout 60 "$b" --bench --warm-up-time 0.5 --measurement-time 1 >>"$out/bench.log" 2>&1
  rc=$?
  row "$name" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc (numbers in bench.log)"
done
# 4. Short performance run: ours per variant, then the torch peers, same shapes, one JSON line
# each into perf.jsonl (notes and skipped variants go to bench.log). A variant the GPU's
# dispatch refuses prints why and no line.
perf="$out/perf.jsonl"
: >"$perf"
if [ -x "$here/bin/fa-bench" ]; then
  t0=$SECONDS
  n_fail=0
  for d in 64 128; do
    for causal in "" "--causal"; do
      for variant in fa1 fa2 fa3; do  # no FA4 kernel family exists yet (benches/gpu.rs still tries it)
        if [ $((SECONDS - t0)) -ge 60 ]; then
          echo "perf: time budget spent, skipping $variant d$d $causal" >>"$out/bench.log"
          continue
        fi
        echo "== fa-bench $variant d$d $causal" >>"$out/bench.log"
        # 16K tokens: batch 4 x seqlen 4096, hidden 2048 (heads = 2048 / head_dim).
        timeout 20 "$here/bin/fa-bench" --backend cuda --variant "$variant" --dtype bf16 --batch 4 \
          --seqlen 4096 --heads $((2048 / d)) --head-dim "$d" $causal --warmup 1 --runs 7 --launches 5 \
          --check-rows 16 --copy-mib 256 >>"$perf" 2>>"$out/bench.log" || n_fail=$((n_fail + 1))
      done
    done
  done
  # FP8 (docs/fp8.md): Variant::Fa3 + Precision::Fp8 (per-block 64 + Hadamard), end to end from
  # bf16 (pre-pass + consumer), hdim 64/128/256 on the same 16K tokens, causal and not; its own
  # 40 s budget. A head dim without an FP8 row prints the refusal and no line (not a failure).
  t8=$SECONDS
  for d in 64 128 256; do
    for causal in "" "--causal"; do
      if [ $((SECONDS - t8)) -ge 40 ]; then
        echo "perf: FP8 time budget spent, skipping d$d $causal" >>"$out/bench.log"
        continue
      fi
      echo "== fa-bench fp8 d$d $causal" >>"$out/bench.log"
      timeout 20 "$here/bin/fa-bench" --backend cuda --variant fa3 --fp8 block:64 --hadamard 1 --dtype bf16 \
        --batch 4 --seqlen 4096 --heads $((2048 / d)) --head-dim "$d" $causal --warmup 1 --runs 7 --launches 5 \
        --check-rows 16 --copy-mib 256 >>"$perf" 2>>"$out/bench.log" || n_fail=$((n_fail + 1))
    done
  done
  ours=$(grep -c '"impl":"flash_attn"' "$perf")
  row "perf: fa-bench (short)" "$([ $n_fail = 0 ] && [ "$ours" -gt 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) \
    "$ours JSON lines, $n_fail failed runs (refused variants: no line, reason in bench.log)"
else
  row "perf: fa-bench (short)" FAIL 0 "bin/fa-bench missing"
fi
if python3 -c "import torch" 2>/dev/null && [ -f "$here/gpu-peers-torch.py" ]; then
  t0=$SECONDS
  PYTHONUNBUFFERED=1 timeout 60 python3 "$here/gpu-peers-torch.py" --quick --reps 7 --launches 10 >>"$perf" 2>>"$out/bench.log"
  rc=$?
  peers=$(grep -c '"impl":"torch-sdpa' "$perf")
  row "perf: gpu-peers-torch.py --quick" "$([ $rc = 0 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "rc=$rc, $peers JSON lines"
else
  row "perf: gpu-peers-torch.py --quick" SKIP 0 "torch not importable or gpu-peers-torch.py missing"
fi

[ ${#rows[@]} -gt 0 ] || row "(nothing ran)" FAIL 0 "no binaries under $here/bin"

{
  echo
  echo "== flash_attn GPU check ($(head -1 "$out/env.log"); $(sed -n 4p "$out/env.log" | cut -d, -f1-2))"
  printf '%-34s %-6s %7s  %s\n' step result time detail
  printf '%s\n' "${rows[@]}"
  echo "fa3 stages passed: ${fa3_passed:-none} (mark them gpu_verified in build/instances.rs, docs/fa3.md)"
  if [ -n "${hang_lines//$'\n'/}" ]; then
    echo
    echo "hang-check reports (first lines per timed-out stage; all in fa3.log):"
    printf '%s' "$hang_lines"
  fi
  if [ -s "$perf" ]; then
    echo
    echo "short performance run (bf16, 16K tokens; ms = median per launch; all fields in perf.jsonl):"
    python3 - "$perf" <<'PY' 2>&1 || cat "$perf"
import json, sys
num = lambda x, spec: format(x, spec) if isinstance(x, (int, float)) else "-"
print(f"{'impl':<17} {'kernel':<28} {'shape':<24} {'ms':>8} {'TFLOP/s':>8} {'%roof':>6} {'max_err':>9}")
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    shape = f"b{r['batch']} s{r['seqlen_q']} h{r['heads_q']} d{r['head_dim']}{' causal' if r['causal'] else ''}"
    print(f"{r['impl']:<17} {str(r['kernel'])[:28]:<28} {shape:<24} {num(r['ms'], '8.3f')} {num(r['tflops'], '8.1f')} "
          f"{num(r.get('pct_roofline'), '6.1f')} {num(r.get('max_err'), '9.2e')}")
PY
  fi
  echo "logs: $out/{env,tests,fa3,memcheck,racecheck,bench}.log, perf.jsonl, summary.txt"
} | tee -a "$summary"
printf '%s\n' "${rows[@]}" | grep -q ' FAIL ' && exit 1
exit 0

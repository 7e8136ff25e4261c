#!/usr/bin/env bash
# The fuzz command: every property test of the CPU backend and the serving API (the same
# properties CI runs with a fixed seed) with a random seed and SCALE times their case counts,
# in an optimised build with overflow checks and debug assertions on (a panic is a failure).
#
#   scripts/fuzz.sh [SCALE] [cargo test filter and options...]
#   scripts/fuzz.sh --emulator
#
# SCALE defaults to 100. Each property prints its seed and case count; a failing case is saved
# in tests/NAME.proptest-regressions (commit it: CI replays every saved case first) and
# `FLASH_ATTN_PROPTEST_SEED=<seed> scripts/fuzz.sh SCALE` reruns the same draw. Set
# FLASH_ATTN_PROPTEST_SEED yourself to replay a given seed instead of a random one.
#
# --emulator: the kernels' full emulator matrices (FLASH_ATTN_EMU=full) with their random
# configurations drawn from a fresh seed (FLASH_ATTN_EMU_SEED=random; each matrix prints its
# seed, and FLASH_ATTN_EMU_SEED=<seed> replays it). Needs only g++; tens of minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--emulator" ]; then
    shift
    export FLASH_ATTN_EMU=full FLASH_ATTN_EMU_SEED="${FLASH_ATTN_EMU_SEED:-random}"
    start=$SECONDS
    mkdir -p target
    set +e
    cargo test --release --test emulator --test emulator_serving --test emulator_serving_fa3 \
        --test fa1_serving_emulator --test combine_emulator "$@" -- --nocapture 2>&1 |
        tee target/fuzz-emulator.log | grep --line-buffered -E 'random configurations|test result|panicked|FAILED|failed'
    status=${PIPESTATUS[0]}
    set -e
    echo "fuzz --emulator: $((SECONDS - start)) s, log in target/fuzz-emulator.log"
    exit "$status"
fi
scale="${1:-100}"
shift || true
export FLASH_ATTN_PROPTEST_SEED="${FLASH_ATTN_PROPTEST_SEED:-random}"
export FLASH_ATTN_PROPTEST_SCALE="$scale"
export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true
export CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true
# Every test binary that uses tests/props, unless the arguments name some with --test.
tests=()
if ! printf '%s\n' "$@" | grep -qx -- --test; then
    for f in $(grep -l 'props::' tests/*.rs); do
        tests+=(--test "$(basename "$f" .rs)")
    done
fi
start=$SECONDS
mkdir -p target
set +e
cargo test --release --no-default-features --features bench "${tests[@]}" "$@" -- --nocapture 2>&1 |
    tee target/fuzz.log | grep --line-buffered -E '^proptest |cases passed|test result|panicked|FAILED|failed'
status=${PIPESTATUS[0]}
set -e
echo "fuzz: scale $scale, $((SECONDS - start)) s, log in target/fuzz.log"
exit "$status"

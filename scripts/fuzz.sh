#!/usr/bin/env bash
# The fuzz command: every property test of the CPU backend and the serving API (the same
# properties CI runs with a fixed seed) with a random seed and SCALE times their case counts,
# in an optimised build with overflow checks and debug assertions on (a panic is a failure).
#
#   scripts/fuzz.sh [SCALE] [cargo test filter and options...]
#
# SCALE defaults to 100. Each property prints its seed and case count; a failing case is saved
# in tests/NAME.proptest-regressions (commit it: CI replays every saved case first) and
# `FLASH_ATTN_PROPTEST_SEED=<seed> scripts/fuzz.sh SCALE` reruns the same draw. Set
# FLASH_ATTN_PROPTEST_SEED yourself to replay a given seed instead of a random one.
set -euo pipefail
cd "$(dirname "$0")/.."
scale="${1:-100}"
shift || true
export FLASH_ATTN_PROPTEST_SEED="${FLASH_ATTN_PROPTEST_SEED:-random}"
export FLASH_ATTN_PROPTEST_SCALE="$scale"
export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true
export CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true
tests=()
for f in $(grep -l 'props::' tests/*.rs); do
    tests+=(--test "$(basename "$f" .rs)")
done
start=$SECONDS
mkdir -p target
set +e
cargo test --release --no-default-features --features bench "${tests[@]}" "$@" -- --nocapture 2>&1 |
    tee target/fuzz.log | grep --line-buffered -E '^proptest |cases passed|test result|panicked|FAILED|failed'
status=${PIPESTATUS[0]}
set -e
echo "fuzz: scale $scale, $((SECONDS - start)) s, log in target/fuzz.log"
exit "$status"

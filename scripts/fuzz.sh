#!/usr/bin/env bash
# The fuzz command: every property test of the CPU backend and the serving API (the same
# properties CI runs with a fixed seed) with a random seed and SCALE times their case counts,
# in an optimised build with overflow checks and debug assertions on (a panic is a failure).
#
#   scripts/fuzz.sh [SCALE] [FILTER... | -CARGO_OPTION...]   e.g. scripts/fuzz.sh 500 domain_edges::
#   scripts/fuzz.sh --emulator [FILTER... | -CARGO_OPTION...]
#
# SCALE defaults to 100. Each property prints its seed and case count; a failing case is saved
# beside its source, in tests/cpu/MODULE.proptest-regressions (commit it: CI replays every saved
# case first) and `FLASH_ATTN_PROPTEST_SEED=<seed> scripts/fuzz.sh SCALE` reruns the same draw.
# Set FLASH_ATTN_PROPTEST_SEED yourself to replay a given seed instead of a random one.
#
# --emulator: the kernels' full emulator matrices (FLASH_ATTN_EMU=full) with their random
# configurations drawn from a fresh seed (FLASH_ATTN_EMU_SEED=random; each matrix prints its
# seed, and FLASH_ATTN_EMU_SEED=<seed> replays it). Needs only g++; tens of minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
# The arguments: those starting with `-` go to cargo (write values joined: -j2), the others are
# test filters (module paths such as domain_edges::), which replace the default selection.
cargo_args=()
filters=()
split_args() {
    local a
    for a in "$@"; do
        case "$a" in
            -*) cargo_args+=("$a") ;;
            *) filters+=("$a") ;;
        esac
    done
}
if [ "${1:-}" = "--emulator" ]; then
    shift
    split_args "$@"
    # The emulator modules whose full matrices draw random configurations.
    [ ${#filters[@]} -gt 0 ] || filters=(forward:: serving_fa1:: serving_fa2:: serving_fa3:: combine::)
    export FLASH_ATTN_EMU=full FLASH_ATTN_EMU_SEED="${FLASH_ATTN_EMU_SEED:-random}"
    start=$SECONDS
    mkdir -p target
    set +e
    cargo test --release --test emulator "${cargo_args[@]}" -- --nocapture "${filters[@]}" 2>&1 |
        tee target/fuzz-emulator.log | grep --line-buffered -E 'random configurations|test result|panicked|FAILED|failed'
    status=${PIPESTATUS[0]}
    set -e
    echo "fuzz --emulator: $((SECONDS - start)) s, log in target/fuzz-emulator.log"
    exit "$status"
fi
scale="${1:-100}"
shift || true
split_args "$@"
# By default every module of tests/cpu/ that uses support/props.rs.
if [ ${#filters[@]} -eq 0 ]; then
    for f in $(grep -l 'props::' tests/cpu/*.rs); do
        filters+=("$(basename "$f" .rs)::")
    done
fi
export FLASH_ATTN_PROPTEST_SEED="${FLASH_ATTN_PROPTEST_SEED:-random}"
export FLASH_ATTN_PROPTEST_SCALE="$scale"
export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true
export CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true
start=$SECONDS
mkdir -p target
set +e
cargo test --release --no-default-features --features bench --test cpu "${cargo_args[@]}" -- --nocapture "${filters[@]}" 2>&1 |
    tee target/fuzz.log | grep --line-buffered -E '^proptest |cases passed|test result|panicked|FAILED|failed'
status=${PIPESTATUS[0]}
set -e
echo "fuzz: scale $scale, $((SECONDS - start)) s, log in target/fuzz.log"
exit "$status"

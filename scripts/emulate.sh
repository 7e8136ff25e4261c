#!/usr/bin/env bash
# The whole emulator matrix (docs/emulator.md): every kernel family's source run on the CPU under
# cuda/test/emu against the float64 reference: FA1 and FA2 (every instance), FA3 stages 1-5 x
# bf16/f16 x head_dim 64/128/256 x 10 shapes (stage 5 on 1, 2 and 3 persistent CTAs), the
# emulator's self-tests and layout checks, the kernel mutations that must fail, and every other
# module's seeded random matrix: serving (FA1, FA2, FA3), split-KV's combine, attention sinks,
# head_dim 512, V head dims of their own (FA2, FA3), the rotary and cache rows, the FP8 KV cache,
# the backward (FA2, FA3). `scripts/emulate.sh --features bench` adds the FP8 forward's matrix.
# A plain `cargo test --test emulator` (part of scripts/test.sh) runs a representative subset.
#
# Usage: scripts/emulate.sh [extra cargo test args]   (FLASH_ATTN_EMU_THREADS=N cases in parallel
# per test, default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
export FLASH_ATTN_EMU=full
export FLASH_ATTN_EMU_THREADS="${FLASH_ATTN_EMU_THREADS:-2}"
cargo test --release --test emulator "$@" -- --nocapture

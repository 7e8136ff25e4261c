#!/usr/bin/env bash
# Compile-only checks of the FA3-style sm_90a kernels (cuda/fa3_fwd_sm90.cu); no GPU needed.
#
# For each head dim (one nvcc job each, -DFA3_ONLY_HDIM=<D>, at most FA3_JOBS in parallel):
#   * builds the sm_90a cubin with ptxas -v and records registers / spills / compile time;
#   * dumps SASS and requires, per kernel: HGMMA (every stage); UTMALDG + SYNCS (stage 2+);
#     USETMAXREG and exactly 168 entry registers (stage 3+); BAR.ARV (named-barrier ping-pong)
#     and WARPGROUP.DEPBAR.LE gsb0, 0x1 (a wait leaving one wgmma group in flight: the
#     intra-warpgroup overlap) for stages 4-5; no LDL/STL (local memory), 0 spill bytes, 0 stack;
#   * checks the PTX is .version 9.0 / .target sm_90a, and that the file still compiles (to empty
#     kernels) for sm_80;
#   * builds and runs scripts/fa3-layout-sim.cpp (host g++): the kernel's layout helpers against a
#     software model of TMA placement and wgmma operand/fragment layouts (exact integer S and O),
#     and the tile-range / mask-skip predicates brute-forced against the visibility rule;
#   * builds target/fa3-check/fa3-gpu-smoke (scripts/fa3-gpu-smoke.cpp), the no-Rust GPU test,
#     and runs it against a fake libcuda (scripts/fa3-fake-libcuda.cpp) as a harness self-test.
# Prints one table row per kernel; exits non-zero if any rule is violated.
# Usage: scripts/check-fa3.sh [head_dim ...]   (default: 64 128 256)
# Env: FA3_JOBS (default 2), FA3_OUT (default target/fa3-check).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bin="$("$root/scripts/install-cuda-toolchain.sh")"
export PATH="$bin:$PATH"
out="${FA3_OUT:-$root/target/fa3-check}"
jobs="${FA3_JOBS:-2}"
hdims=("$@")
[ ${#hdims[@]} -gt 0 ] || hdims=(64 128 256)
mkdir -p "$out"
src=cuda/fa3_fwd_sm90.cu
flags=(-std=c++17 -O3 -Icuda/include)

build_one() {  # $1 = head dim
  local d=$1 t0 t1
  t0=$(date +%s.%N)
  nvcc -cubin "${flags[@]}" -Xptxas=-v -gencode=arch=compute_90a,code=sm_90a \
    -DFA3_ONLY_HDIM="$d" "$src" -o "$out/fa3_hd$d.sm90a.cubin" > "$out/fa3_hd$d.ptxas.txt" 2>&1
  t1=$(date +%s.%N)
  echo "$t0 $t1" | awk '{printf "%.1f\n", $2 - $1}' > "$out/fa3_hd$d.seconds"
  cuobjdump --dump-sass "$out/fa3_hd$d.sm90a.cubin" > "$out/fa3_hd$d.sass"
}

pids=()
for d in "${hdims[@]}"; do
  build_one "$d" &
  pids+=($!)
  if [ ${#pids[@]} -ge "$jobs" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p"; done

fail=0
printf '%-24s %5s %6s %6s %6s %7s %5s %7s %6s %6s %s\n' kernel regs spillB stackB hgmma utmaldg syncs setmaxr bararv wait1 ldl/stl
for d in "${hdims[@]}"; do
  [ -s "$out/fa3_hd$d.sass" ] || { echo "hd$d: no cubin (see $out/fa3_hd$d.ptxas.txt)"; exit 1; }
  if grep -q "error" "$out/fa3_hd$d.ptxas.txt"; then cat "$out/fa3_hd$d.ptxas.txt"; exit 1; fi
  # ptxas -v: "Compiling entry function 'X'", then "N bytes stack frame, S bytes spill stores,
  # L bytes spill loads", then "Used R registers".
  awk '
    /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); fn = substr($0, RSTART + 1, RLENGTH - 2) }
    /bytes stack frame/ { stack[fn] = $1; spill[fn] = $5 + $9 }
    /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) if ($i == "Used") regs[fn] = $(i + 1) }
    END { for (f in regs) print f, regs[f], spill[f], stack[f] }
  ' "$out/fa3_hd$d.ptxas.txt" | sort > "$out/fa3_hd$d.regs"
  awk '
    /Function :/ { fn = $3 }
    / HGMMA/ { h[fn]++ } / UTMALDG/ { u[fn]++ } / SYNCS/ { s[fn]++ } / USETMAXREG/ { m[fn]++ }
    / LDL| STL/ { l[fn]++ } / BAR\.ARV/ { a[fn]++ } /WARPGROUP\.DEPBAR\.LE gsb0, 0x1/ { w[fn]++ }
    END { for (f in h) print f, h[f] + 0, u[f] + 0, s[f] + 0, m[f] + 0, a[f] + 0, w[f] + 0, l[f] + 0 }
  ' "$out/fa3_hd$d.sass" | sort > "$out/fa3_hd$d.ops"
  n=$(wc -l < "$out/fa3_hd$d.regs")
  [ "$n" -eq 10 ] || { echo "hd$d: expected 10 kernels (5 stages x 2 dtypes), ptxas reported $n"; fail=1; }
  while read -r fn regs spill stack; do
    read -r _ hg ut sy mx ar w1 ls < <(grep "^$fn " "$out/fa3_hd$d.ops" || echo "$fn 0 0 0 0 0 0 0")
    stage=${fn#fa3s}; stage=${stage%%_*}
    printf '%-24s %5s %6s %6s %6s %7s %5s %7s %6s %6s %s\n' "$fn" "$regs" "$spill" "$stack" "$hg" "$ut" "$sy" "$mx" "$ar" "$w1" "$ls"
    bad=()
    [ "$spill" -eq 0 ] || bad+=("spills")
    [ "$stack" -eq 0 ] || bad+=("stack frame")
    [ "$ls" -eq 0 ] || bad+=("LDL/STL")
    [ "$hg" -gt 0 ] || bad+=("no HGMMA")
    if [ "$stage" -ge 2 ]; then
      [ "$ut" -gt 0 ] || bad+=("no UTMALDG")
      [ "$sy" -gt 0 ] || bad+=("no SYNCS")
    fi
    if [ "$stage" -ge 3 ]; then
      [ "$mx" -gt 0 ] || bad+=("no USETMAXREG")
      # setmaxnreg only moves registers inside the CTA's launch allocation: 384 threads x 168 =
      # 128 x 24 (producer) + 256 x 240 (consumers). Fewer at entry and the consumers' inc
      # would wait forever.
      [ "$regs" -eq 168 ] || bad+=("entry registers $regs != 168 (setmaxnreg budget)")
    fi
    if [ "$stage" -ge 4 ]; then
      [ "$ar" -gt 0 ] || bad+=("no BAR.ARV")
      [ "$w1" -gt 0 ] || bad+=("no wgmma wait leaving a group in flight")
    fi
    if [ ${#bad[@]} -gt 0 ]; then echo "  FAIL $fn: ${bad[*]}"; fail=1; fi
  done < "$out/fa3_hd$d.regs"
  if grep -q "serialized" "$out/fa3_hd$d.ptxas.txt"; then
    echo "  WARN hd$d: ptxas serialises some wgmma:"; grep "serialized" "$out/fa3_hd$d.ptxas.txt"
  fi
  echo "  hd$d: nvcc wall time $(cat "$out/fa3_hd$d.seconds") s"
done

# PTX version/target, and the non-sm_90a build (empty kernels) still compiles.
nvcc -ptx "${flags[@]}" -arch=compute_90a -DFA3_ONLY_HDIM=64 "$src" -o "$out/fa3_hd64.compute90a.ptx"
grep -q '^\.version 9\.0' "$out/fa3_hd64.compute90a.ptx" || { echo "FAIL: PTX is not .version 9.0"; fail=1; }
grep -q '^\.target sm_90a' "$out/fa3_hd64.compute90a.ptx" || { echo "FAIL: PTX target is not sm_90a"; fail=1; }
nvcc -cubin "${flags[@]}" -gencode=arch=compute_80,code=sm_80 -DFA3_ONLY_HDIM=64 "$src" \
  -o "$out/fa3_hd64.sm80.cubin" || { echo "FAIL: does not compile for sm_80"; fail=1; }

# Layout model check on the host: the kernel's offset/descriptor/fragment helpers against a
# software model of TMA placement and wgmma operand fetch (scripts/fa3-layout-sim.cpp).
cuda_inc="$(cd "$bin/../include" && pwd)"
g++ -std=c++17 -O2 -D__host__= -D__device__= -D__forceinline__=inline -I"$cuda_inc" \
  -Icuda/include scripts/fa3-layout-sim.cpp -o "$out/fa3-layout-sim" || { echo "FAIL: layout sim build"; fail=1; }
"$out/fa3-layout-sim" || { echo "FAIL: layout sim"; fail=1; }

# The GPU smoke test (runs only where a GPU is): build it so a GPU window can start at once with
#   timeout 300 target/fa3-check/fa3-gpu-smoke [--stages 12345] [--bench]
g++ -std=c++17 -O2 -Wall -static-libstdc++ -static-libgcc -I"$cuda_inc" -Icuda/include \
  -D__host__= -D__device__= -D__forceinline__=inline scripts/fa3-gpu-smoke.cpp -ldl \
  -o "$out/fa3-gpu-smoke" || { echo "FAIL: fa3-gpu-smoke build"; fail=1; }

# Harness self-test: the smoke test against a fake libcuda.so.1 that validates each launch
# (grid/block/smem vs Fa3Traits, tensor-map arguments) and computes attention on the CPU from the
# FwdParams it receives (scripts/fa3-fake-libcuda.cpp). Proves the harness, not the kernels.
mkdir -p "$out/fake"
g++ -std=c++17 -O2 -Wall -shared -fPIC -I"$cuda_inc" -Icuda/include -D__host__= -D__device__= \
  -D__forceinline__=inline scripts/fa3-fake-libcuda.cpp -o "$out/fake/libcuda.so.1" \
  || { echo "FAIL: fake libcuda build"; fail=1; }
LD_LIBRARY_PATH="$out/fake" "$out/fa3-gpu-smoke" --hd 64 --ctas 3 > "$out/fake-smoke.txt" 2>&1 \
  && echo "fa3-gpu-smoke vs fake libcuda (harness self-test, hd 64, all stages): $(tail -1 "$out/fake-smoke.txt")" \
  || { cat "$out/fake-smoke.txt"; echo "FAIL: smoke harness self-test"; fail=1; }

if [ "$fail" -ne 0 ]; then echo "check-fa3: FAILED"; exit 1; fi
echo "check-fa3: OK (compile-checked only; nothing here ran on a GPU)"

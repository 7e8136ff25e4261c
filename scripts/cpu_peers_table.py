#!/usr/bin/env python3
"""Our CPU backend beside the CPU peers, same shapes, same run: the table of issue 16.

    scripts/cpu-peers.sh [--rounds 3] [--quick] [--out docs/bench-data/cpu-peers.md]

(the shell wrapper builds `examples/bench` and finds the peers' venv; this file only needs the
standard library). Each round runs every shape once for every implementation: ours
(`target/release/examples/bench --backend cpu`, all cores) and each peer
(`cpu_peers.py --shape ... --peers X`, one subprocess per peer so thread pools never share the
cores). The order of the implementations rotates from round to round so that none is always
first after a quiet spell; the table gives the median over rounds of each one's median time.

Rates: GFLOP/s = 4·b·h·sq·sk·d / time (square causal: only the n(n+1)/2 visible pairs, the same
count in `flash_attn::flops` and in `cpu_peers.py`); for decode rows (sq == 1) also GB/s of K/V
read = 2·b·h·sk·d·4 bytes / time. `ours / best` divides our rate by the best peer's in the same
run. Raw records (one JSON line per run) go next to the table as `<out>.jsonl`.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

SHAPES = [  # (b, h, sq, sk, d, causal): the rows of issue 16
    (1, 8, 2048, 2048, 128, False),
    (1, 8, 2048, 2048, 128, True),
    (4, 8, 512, 512, 64, False),
    (1, 32, 1, 4096, 128, False),
]
PEERS = ["torch_sdpa", "ort_mha", "ort_attention"]
GOAL = 1.10


def flops(b, h, sq, sk, d, causal):
    if causal:
        return 4 * b * h * d * sq * (sq + 1) // 2
    return 4 * b * h * sq * sk * d


def kv_bytes(b, h, sq, sk, d, causal):
    return 2 * b * h * sk * d * 4


def machine():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
            else:
                name = platform.processor()
    except OSError:
        name = platform.processor()
    return f"{name}, {os.cpu_count()} logical CPUs"


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return float("nan")


def run_ours(bench, shape, a):
    b, h, sq, sk, d, causal = shape
    argv = [bench, "--backend", "cpu", "--dtype", "f32", "--batch", str(b), "--heads", str(h),
            "--seqlen-q", str(sq), "--seqlen-k", str(sk), "--head-dim", str(d), "--no-gemm",
            "--warmup", "2", "--runs", str(a.runs if sq > 1 else 5 * a.runs), "--max-seconds",
            str(a.min_time), "--check-rows", "8"]
    if causal:
        argv.append("--causal")
    p = subprocess.run(argv, capture_output=True, text=True)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"rc={p.returncode}: {p.stderr.strip()[-300:]}"}
    r = json.loads(lines[-1])
    return {"ms": r["ms"], "max_abs_err": r.get("max_err"), "impl": r.get("kernel")}


def run_peer(py, peers_script, peer, shape, a):
    b, h, sq, sk, d, causal = shape
    argv = [py, peers_script, "--shape", str(b), str(h), str(sq), str(sk), str(d), "--peers", peer,
            "--min-reps", "5", "--min-time", str(a.min_time), "--warmup", "2"]
    if causal:
        argv.append("--causal")
    p = subprocess.run(argv, capture_output=True, text=True)
    for l in p.stdout.splitlines():
        if l.startswith("{") and '"peer"' in l:
            r = json.loads(l)
            if "ms" in r:
                return {"ms": r["ms"], "max_abs_err": r.get("max_abs_err"), "impl": r.get("impl"),
                        "version": r.get("version")}
            return {"error": r.get("error") or r.get("skipped") or "no time"}
    return {"error": f"rc={p.returncode}: {p.stderr.strip()[-300:]}"}


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", required=True, help="path of the built examples/bench binary")
    ap.add_argument("--python", required=True, help="the peers' python (with torch, onnxruntime)")
    ap.add_argument("--peers-script", required=True, help="path of cpu_peers.py")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=10, help="our timed runs per round (decode: 5x)")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds timed per run and round")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--quick", action="store_true", help="one round, shorter timing (a smoke run)")
    ap.add_argument("--out", default="docs/bench-data/cpu-peers.md")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.runs, a.min_time = 1, 3, 0.3
    peers = [p for p in a.peers.split(",") if p]
    impls = ["ours"] + peers
    load0, t0 = loadavg(), time.time()
    recs = []
    for rnd in range(a.rounds):
        order = impls[rnd % len(impls):] + impls[:rnd % len(impls)]
        for shape in SHAPES:
            for impl in order:
                r = run_ours(a.bench, shape, a) if impl == "ours" else \
                    run_peer(a.python, a.peers_script, impl, shape, a)
                r.update(impl_name=impl, shape=list(shape[:5]), causal=shape[5], round=rnd)
                recs.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    load1 = loadavg()

    head = ["shape b×h×sq×sk×d", "causal", "ours"] + peers + ["ours / best", "ours K/V GB/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    verdicts = []
    for shape in SHAPES:
        b, h, sq, sk, d, causal = shape
        rate, gbs, errs = {}, {}, []
        for impl in impls:
            ms = [r["ms"] for r in recs if r["impl_name"] == impl and r["shape"] == list(shape[:5])
                  and r["causal"] == causal and "ms" in r]
            errs += [r["error"] for r in recs if r["impl_name"] == impl and r["shape"] == list(shape[:5])
                     and r["causal"] == causal and "error" in r][:1]
            if ms:
                med = statistics.median(ms) / 1e3
                rate[impl] = flops(*shape) / med / 1e9
                gbs[impl] = kv_bytes(*shape) / med / 1e9
        best = max((rate[p] for p in peers if p in rate), default=None)
        ratio = rate["ours"] / best if best and "ours" in rate else None
        decode = sq == 1
        cells = [f"{b}×{h}×{sq}×{sk}×{d}" + (" (decode)" if decode else ""), "yes" if causal else "no"]
        for impl in impls:
            c = fmt(rate.get(impl), 2 if decode else 0)
            if decode and impl in gbs:
                c += f" ({gbs[impl]:.1f} GB/s)"
            cells.append(c)
        mark = "" if ratio is None or ratio >= GOAL else "**"
        cells.append(f"{mark}{fmt(ratio, 2)}{mark}")
        cells.append(fmt(gbs.get("ours")) if decode else "")
        lines.append("| " + " | ".join(cells) + " |")
        ok = ratio is not None and ratio >= GOAL and (not decode or gbs.get("ours", 0) >= 28)
        verdicts.append((cells[0] + (" causal" if causal else ""), ok, errs))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0))
    note = [
        f"Measured {stamp} on {machine()}, f32, all cores for every implementation; median of "
        f"{a.rounds} alternating round(s); GFLOP/s (decode: also GB/s of K/V read). Load average "
        f"{load0:.1f} at the start, {load1:.1f} at the end ({time.time() - t0:.0f} s)"
        + (": a loaded machine, absolute figures unreliable." if max(load0, load1) > 0.5 * (os.cpu_count() or 1)
           else "."),
        f"Goal (issue 16): ours / best ≥ {GOAL:.2f} on every row, decode ≥ 28 GB/s of K/V read; "
        "rows below it in bold.",
    ]
    for name, ok, errs in verdicts:
        if errs:
            note.append(f"- {name}: errors: {'; '.join(errs)}")
    text = "\n".join(lines) + "\n\n" + "\n".join(note) + "\n"
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(a.out)[0] + ".jsonl", "w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        print(f"written: {a.out} and {os.path.splitext(a.out)[0]}.jsonl", file=sys.stderr)


if __name__ == "__main__":
    main()

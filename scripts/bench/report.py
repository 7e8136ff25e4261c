#!/usr/bin/env python3
"""Turn bench JSON lines into a markdown report and one roofline plot (PNG) per machine.

Inputs are the lines printed by `examples/bench.rs`, written by `benches/cpu.rs`
(target/bench/cpu.jsonl) and by `scripts/bench/gpu-peers-torch.py`; lines that are not JSON objects
are ignored, so whole logs can be passed.

    python3 scripts/bench/report.py target/bench/cpu.jsonl gpu-run/*.jsonl --md report.md --png-dir plots/

The table has one row per shape: our rate (best kernel, named), % of the roofline, the sampled
max error against float64, then each peer's rate and ours ÷ peer. On a CPU (no peers) the
comparison is the f32 GEMM rate measured in the same run. The plot puts every run at its
arithmetic intensity (FLOPs / minimum bytes) under the compute and bandwidth ceilings.

The markdown needs only the standard library; the PNG needs matplotlib
(`pip install matplotlib`); without it the report says so and skips the plots.
"""

import argparse
import json
import math
import os
import re
import sys
from collections import OrderedDict

OURS = "flash_attn"


def load(paths):
    recs = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "impl" in r and "tflops" in r:
                    recs.append(r)
    return recs


def best_of(recs):
    """Fastest-sample rates, and the best record per (machine, impl, kernel, shape)."""
    out = OrderedDict()
    for r in recs:
        r = dict(r)
        if r.get("ms_min"):
            r["tflops"] = r["flops"] / (r["ms_min"] * 1e-3) / 1e12
        if r.get("gemm_tflops_best"):
            r["gemm_tflops"] = r["gemm_tflops_best"]
        if r.get("gemm_tflops") and r.get("peak_tflops"):
            r["peak_tflops"] = r["gemm_tflops"]  # the CPU ceiling is the GEMM rate
        if r.get("peak_tflops") and r.get("bandwidth_tbs"):
            r["pct_roofline"] = 100 * r["tflops"] / min(r["peak_tflops"], r["bandwidth_tbs"] * r["intensity"])
        key = (r["machine"], r["impl"], r["kernel"], r.get("variant"), shape_key(r))
        old = out.get(key)
        if old is None:
            out[key] = r
        else:
            # Best rate, and the best GEMM seen beside any repeat (the unloaded machine's).
            best = r if r["tflops"] > old["tflops"] else old
            for k in ("gemm_tflops", "peak_tflops"):
                vals = [x[k] for x in (r, old) if x.get(k)]
                if vals:
                    best[k] = max(vals)
            # The paired and CPU-time ratios of all repeats; their medians are shown.
            best["_paired"] = old.get("_paired", [old.get("gemm_ratio_paired")]) + [r.get("gemm_ratio_paired")]
            best["_cpu"] = old.get("_cpu", [cpu_ratio(old)]) + [cpu_ratio(r)]
            for k in ("tflops_cputime", "gemm_tflops_cputime"):
                vals = [x[k] for x in (r, old) if x.get(k)]
                if vals:
                    best[k] = max(vals)
            if best.get("peak_tflops") and best.get("bandwidth_tbs"):
                best["pct_roofline"] = 100 * best["tflops"] / min(best["peak_tflops"], best["bandwidth_tbs"] * best["intensity"])
            out[key] = best
    for r in out.values():
        vals = sorted(v for v in r.pop("_paired", [r.get("gemm_ratio_paired")]) if v is not None)
        r["gemm_ratio_paired"] = vals[len(vals) // 2] if vals else None
        vals = sorted(v for v in r.pop("_cpu", [cpu_ratio(r)]) if v is not None)
        r["cpu_ratio"] = vals[len(vals) // 2] if vals else None
    return list(out.values())


def cpu_ratio(r):
    """Attention ÷ GEMM in work per CPU-second (the same run's two rates), or None."""
    if r.get("cpu_ratio") is not None:
        return r["cpu_ratio"]
    a, g = r.get("tflops_cputime"), r.get("gemm_tflops_cputime")
    return a / g if a and g else None


def shape_key(r):
    win = ""
    if r.get("window_left") is not None:
        win = f" win({r['window_left']},{r['window_right']})"
    heads = f"{r['heads_q']}" if r["heads_q"] == r["heads_kv"] else f"{r['heads_q']}/{r['heads_kv']}"
    seq = f"{r['seqlen_q']}" if r["seqlen_q"] == r["seqlen_k"] else f"{r['seqlen_q']}x{r['seqlen_k']}"
    mask = "causal" if r["causal"] else "full"
    prec = r["dtype"] if r.get("precision", "native") == "native" else r["precision"]
    return f"{r['batch']}×{seq}×{heads}h×d{r['head_dim']} {prec} {mask}{win}"


def sort_key(r):
    return (r["dtype"] != "f32", r["dtype"], r.get("precision", ""), r["head_dim"], r["seqlen_q"], r["causal"], r["batch"])


def unit_for(recs):
    top = max((r["tflops"] or 0) for r in recs) if recs else 0
    return ("GFLOP/s", 1e3) if top < 1.0 else ("TFLOP/s", 1.0)


def fmt(x, nd=1):
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def machine_table(machine, recs):
    unit, mul = unit_for(recs)
    peers = sorted({r["impl"] for r in recs if r["impl"] != OURS})
    by_shape = OrderedDict()
    for r in sorted(recs, key=sort_key):
        by_shape.setdefault(shape_key(r), []).append(r)
    out = [f"### {machine}", ""]
    first = recs[0]
    notes = []
    for k in ("gpu", "driver", "clocks", "torch"):
        if first.get(k):
            notes.append(f"{k}: {first[k]}")
    roofs = [r for r in recs if r.get("peak_tflops") and r.get("bandwidth_tbs")]
    if roofs:
        pks = sorted(r["peak_tflops"] for r in roofs)
        bws = sorted(r["bandwidth_tbs"] for r in roofs)
        varied = pks[0] != pks[-1]
        notes.append(
            f"roofline: compute {pks[len(pks) // 2] * mul:.1f} {unit}"
            + (f" (median; per run {pks[0] * mul:.1f}–{pks[-1] * mul:.1f})" if varied else "")
            + f", bandwidth {bws[len(bws) // 2] * 1e3:.1f} GB/s; sources: {roofs[0].get('roofline_source') or 'not given'}"
        )
    out += [f"- {n}" for n in notes] + ([""] if notes else [])
    gemm = any(r.get("gemm_tflops") for r in recs if r["impl"] == OURS)
    head = ["shape", "ours: kernel", f"ours {unit}", "% roofline", "max err"]
    paired = any(r.get("gemm_ratio_paired") for r in recs if r["impl"] == OURS)
    if gemm:
        head += [f"GEMM {unit}", "ours ÷ GEMM"]
    if paired:
        head += ["paired ÷ GEMM"]
    cputime = any(r.get("tflops_cputime") for r in recs if r["impl"] == OURS)
    if cputime:
        head += [f"ours per CPU-s {unit}", f"GEMM per CPU-s {unit}", "ratio per CPU-s"]
    for p in peers:
        head += [f"{p} {unit}", f"ours ÷ {p}"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|")
    for key, rs in by_shape.items():
        ours = [r for r in rs if r["impl"] == OURS]
        best = max(ours, key=lambda r: r["tflops"] or 0) if ours else None
        row = [key]
        if best:
            row += [
                f"{best['kernel']}" + (f" ({best['variant']})" if best.get("variant") not in (None, "auto") else ""),
                fmt(best["tflops"] * mul),
                fmt(best.get("pct_roofline"), 0),
                "–" if best.get("max_err") is None else f"{best['max_err']:.1e}",
            ]
        else:
            row += ["–"] * 4
        if gemm:
            g = best.get("gemm_tflops") if best else None
            row += [fmt(g * mul) if g else "–", fmt(best["tflops"] / g, 2) if (best and g) else "–"]
        if paired:
            row += [fmt(best.get("gemm_ratio_paired"), 2) if best else "–"]
        if cputime:
            a, g = (best.get("tflops_cputime"), best.get("gemm_tflops_cputime")) if best else (None, None)
            row += [fmt(a * mul) if a else "–", fmt(g * mul) if g else "–", fmt(cpu_ratio(best), 2) if best else "–"]
        for p in peers:
            pr = [r for r in rs if r["impl"] == p]
            if pr:
                rate = max(r["tflops"] for r in pr)
                row += [fmt(rate * mul), fmt(best["tflops"] / rate, 2) if best else "–"]
            else:
                row += ["–", "–"]
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


def slug(s):
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_")[:60] or "machine"


def plot(machine, recs, path, note=""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, mul = unit_for(recs)
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    ais = [r["intensity"] for r in recs if r.get("intensity")]
    # One ceiling per math (f32, bf16, fp8): the median of the records' ceilings, since a CPU
    # run measures its GEMM beside every case and a GPU run may refine the bandwidth per run.
    by_math = OrderedDict()
    for r in recs:
        if r.get("peak_tflops") and r.get("bandwidth_tbs"):
            by_math.setdefault(r.get("math", r["dtype"]), []).append((r["peak_tflops"], r["bandwidth_tbs"]))
    roofs = OrderedDict()
    for m, vals in by_math.items():
        pk = sorted(v[0] for v in vals)[len(vals) // 2]
        bw = sorted(v[1] for v in vals)[len(vals) // 2]
        varied = len({v[0] for v in vals}) > 1
        roofs.setdefault((round(pk, 9), round(bw, 9)), []).append(m + (" (median of runs)" if varied else ""))
    ridges = [pk / bw for pk, bw in roofs]
    lo = min(ais + ridges) / 4
    hi = max(ais + ridges) * 4
    for (pk, bw), ms in roofs.items():
        ridge = pk / bw
        xs = [lo, ridge, hi]
        ys = [min(pk, bw * x) * mul for x in xs]
        ax.plot(xs, ys, "-", lw=2, alpha=0.6,
                label=f"ceiling {', '.join(ms)}: {pk * mul:.1f} {unit}, {bw * 1e3:.0f} GB/s")
    markers = OrderedDict()
    for r in recs:
        label = r["impl"] if r["impl"] != OURS else f"{OURS} {r['kernel']}"
        label += f" {r['dtype'] if r.get('precision', 'native') == 'native' else r['precision']}"
        label += " causal" if r["causal"] else ""
        markers.setdefault(label, []).append(r)
    shapes = "os^vD<>ps*hX"
    for i, (label, rs) in enumerate(markers.items()):
        ax.scatter(
            [r["intensity"] for r in rs],
            [r["tflops"] * mul for r in rs],
            marker=shapes[i % len(shapes)],
            s=36,
            label=label,
            alpha=0.85,
        )
        if len(recs) <= 40:
            for r in rs:
                ax.annotate(f"d{r['head_dim']} s{r['seqlen_q']}", (r["intensity"], r["tflops"] * mul),
                            fontsize=5, xytext=(3, 2), textcoords="offset points", alpha=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte of q, k, v read + o written)")
    ax.set_ylabel(f"achieved {unit}")
    ax.set_title(f"Attention forward roofline: {machine}{note}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="JSON-lines files (logs are fine)")
    ap.add_argument("--md", help="write the markdown here (default: stdout)")
    ap.add_argument("--png-dir", help="write one roofline PNG per machine here")
    ap.add_argument(
        "--best",
        action="store_true",
        help="shared machine: rate each run by its fastest sample (ms_min) and its GEMM by the fastest "
        "GEMM (gemm_tflops_best), and keep the best of repeated runs of a shape",
    )
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="CPU runs: plot and rate by work per CPU-second x threads (tflops_cputime) against the "
        "GEMM's (gemm_tflops_cputime), where the records have them",
    )
    args = ap.parse_args()
    recs = load(args.inputs)
    if args.cpu_time:
        for r in recs:
            if r.get("tflops_cputime") and r.get("gemm_tflops_cputime"):
                r["cpu_ratio"] = r["tflops_cputime"] / r["gemm_tflops_cputime"]
                r["tflops"] = r["tflops_cputime"]
                r["ms_min"] = None
                r["gemm_tflops"] = r["gemm_tflops_best"] = r["peak_tflops"] = r["gemm_tflops_cputime"]
                r["pct_roofline"] = 100 * r["tflops"] / min(r["peak_tflops"], r["bandwidth_tbs"] * r["intensity"])
                r["roofline_source"] = "work per CPU-second x threads; " + (r.get("roofline_source") or "")
    if args.best:
        recs = best_of(recs)
    if not recs:
        sys.exit("no bench records found in " + ", ".join(args.inputs))
    machines = OrderedDict()
    for r in recs:
        machines.setdefault(r["machine"], []).append(r)
    md = []
    for m, rs in machines.items():
        md.append(machine_table(m, rs))
        if args.png_dir:
            os.makedirs(args.png_dir, exist_ok=True)
            path = os.path.join(args.png_dir, f"roofline_{slug(m)}.png")
            try:
                plot(m, rs, path, " (work per CPU-second × threads)" if args.cpu_time else "")
                md.append(f"![roofline {m}]({path})\n")
            except ImportError:
                md.append("(roofline plot skipped: matplotlib is not installed; `pip install matplotlib`)\n")
    text = "\n".join(md)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.md}", file=sys.stderr)
    else:
        print(text)


if __name__ == "__main__":
    main()

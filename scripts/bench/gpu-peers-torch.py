#!/usr/bin/env python3
"""The peers on the GPU machine: torch SDPA with the flash and cuDNN backends, same shapes,
same JSON line per run as `examples/bench.rs` (read by scripts/bench/report.py).

    python3 scripts/bench/gpu-peers-torch.py [--quick] [--backward] [--tokens 16384] [--dtype bf16] > peers.jsonl

Timing as our GPU bench: inputs in our [batch, seqlen, heads, head_dim] layout (torch sees the
[b, h, s, d] transpose, last dim contiguous), enough rotating input sets that one pass is at
least twice the L2, warm-up, then repetitions of CUDA-event-bracketed batches of launches;
the median per-launch time is reported. FLOPs count only unmasked pairs (square causal:
n(n+1)/2 per head), as flash_attn::flops. The max error is against a float64 reference on
sampled (batch, head, row) triples. The roofline comes from the table in src/bench/roofline.rs
(parsed, so there is one table) with the bandwidth measured by a device-to-device copy here.

`--backward` times SDPA's backward instead (`torch.autograd.grad` of the output against q, k,
v with a random output gradient, the forward's graph kept), FLOPs 2.5x the forward's
(FlashAttention's convention, as benches/gpu.rs and benches/cpu_backward.rs), "direction":
"backward" in each line and no error check (max_err null).

torch's is_causal is top-left aligned, so only square causal shapes are compared (the sweep
has only those); sliding windows and FP8 are not SDPA features and are not run.
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HIDDEN = 2048
BACKENDS = {"torch-sdpa-flash": SDPBackend.FLASH_ATTENTION, "torch-sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


def sweep(tokens, quick):
    seqlens = [4096] if quick else [512, 1024, 2048, 4096, 8192, 16384]
    dims = [64, 128] if quick else [64, 128, 256]
    for d in dims:
        for s in seqlens:
            for causal in (False, True):
                yield max(tokens // s, 1), s, HIDDEN // d, d, causal


def gpu_table():
    """(names, bf16 FLOP/s, fp8 FLOP/s or None, bandwidth B/s, model, source) from src/bench/roofline.rs."""
    here = os.path.dirname(os.path.abspath(__file__))
    # scripts/../src/bench/roofline.rs in the repository; gpu-check/roofline.rs beside the copy the
    # one-command GPU check gathers.
    for path in (os.path.join(here, "..", "src", "bench", "roofline.rs"), os.path.join(here, "roofline.rs")):
        try:
            src = open(path, encoding="utf-8").read()
            break
        except OSError:
            continue
    else:
        return []
    rows = []
    for block in re.findall(r"GpuSpec \{(.*?)\n    \}", src, re.S):
        if 'model: "' not in block:
            continue  # the struct definition, not an entry
        def field(name):
            m = re.search(rf"\b{name}: (.*?),(?:\n|$)", block, re.S)
            return m.group(1).strip() if m else None

        def value(expr):
            if expr is None or expr == "None":
                return None
            expr = expr.replace("Some(", "").replace(")", "")
            num, _, unit = expr.partition("*")
            return float(num) * 1e12 if unit.strip() in ("T", "TB") else float(num)

        names = re.findall(r'"([^"]+)"', field("names") or "")
        model = (re.findall(r'"([^"]+)"', field("model") or "") or ["?"])[0]
        source = "".join(re.findall(r'"([^"]*)"', re.sub(r"\\\n\s*", "", field("source") or "")))
        rows.append((names, value(field("bf16")), value(field("fp8")), value(field("bandwidth")), model, source))
    return rows


def lookup(name):
    for names, bf16, fp8, bw, model, source in gpu_table():
        if any(n in name for n in names):
            return bf16, bw, f"{model}: {source}"
    return None


def smi(query):
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-i", "0"],
            capture_output=True, text=True, timeout=20,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def copy_bandwidth(nbytes=1 << 30, reps=5):
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    del src, dst
    return 2 * nbytes / (best * 1e-3)


def visible_pairs(s, causal):
    return s * (s + 1) // 2 if causal else s * s


def sampled_error(q, k, v, o, causal, n, gen):
    """Max |o - ref64| over n sampled (b, h, row) triples; q, k, v, o in [b, s, h, d]."""
    b, s, h, d = q.shape
    scale = 1.0 / math.sqrt(d)
    err = 0.0
    picks = [(0, 0, 0), (b - 1, h - 1, s - 1)]
    picks += [tuple(int(torch.randint(0, m, (1,), generator=gen)) for m in (b, h, s)) for _ in range(max(n - 2, 0))]
    for bi, hi, i in picks:
        qi = q[bi, i, hi].double()
        keys = k[bi, :, hi].double()
        vals = v[bi, :, hi].double()
        sc = keys @ qi * scale
        if causal:
            sc[i + 1:] = -math.inf
        p = torch.softmax(sc, dim=0)
        ref = p @ vals
        err = max(err, (o[bi, i, hi].double() - ref).abs().max().item())
    return err


def bench(name, backend, b, s, h, d, causal, dtype, args, l2, roof, meta):
    per_set = 4 * b * s * h * d * torch.finfo(dtype).bits // 8
    sets = max(2, -(-2 * l2 // per_set) + 1)
    gen = torch.Generator(device="cpu").manual_seed(1)  # for the sampled rows
    dev_gen = torch.Generator(device="cuda").manual_seed(1)
    data = [
        tuple(torch.randn(b, s, h, d, generator=dev_gen, device="cuda", dtype=dtype) for _ in range(3))
        for _ in range(sets)
    ]

    def forward(i):
        q, k, v = data[i % sets]
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)

    graphs = []

    def backward(i):
        x, out, d_o = graphs[i % sets]
        return torch.autograd.grad(out, x, d_o, retain_graph=True)

    launch = backward if args.backward else forward
    try:
        with sdpa_kernel([backend]):
            if args.backward:
                for q, k, v in data:
                    x = tuple(t.requires_grad_(True) for t in (q, k, v))
                    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in x), is_causal=causal)
                    graphs.append((x, out, torch.randn(out.shape, generator=dev_gen, device="cuda", dtype=dtype)))
            out = forward(0).transpose(1, 2).detach()
            for i in range(args.warmup):
                launch(i)
            torch.cuda.synchronize()
            times = []
            for _ in range(args.reps):
                a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for i in range(args.launches):
                    launch(i)
                e.record()
                e.synchronize()
                times.append(a.elapsed_time(e) / args.launches)
    except RuntimeError as ex:
        print(f"skip {name} b{b} s{s} h{h} d{d} causal={causal}: {str(ex).splitlines()[0]}", file=sys.stderr)
        return None
    times.sort()
    ms = times[len(times) // 2] if len(times) % 2 else 0.5 * (times[len(times) // 2 - 1] + times[len(times) // 2])
    q, k, v = (t.detach() for t in data[0])
    err = None if args.backward else sampled_error(q, k, v, out, causal, args.check_rows, gen)
    elem = torch.finfo(dtype).bits // 8
    flops = 4 * d * b * h * visible_pairs(s, causal)
    nbytes = 4 * b * s * h * d * elem
    if args.backward:
        # q, k, v, o, dO read; dq, dk, dv written.
        flops, nbytes = int(2.5 * flops), 8 * b * s * h * d * elem
    ai = flops / nbytes
    rate = flops / (ms * 1e-3)
    rec = {
        "impl": name, "machine": meta["gpu"], "backend": "cuda:0", "kernel": name.replace("torch-sdpa-", "sdpa-"),
        "variant": "auto", "dtype": args.dtype, "precision": "native", "math": args.dtype,
        "batch": b, "seqlen_q": s, "seqlen_k": s, "heads_q": h, "heads_kv": h, "head_dim": d, "causal": causal,
        "window_left": None, "window_right": None, "flops": flops, "bytes": nbytes, "intensity": ai, "ms": ms,
        "runs": len(times), "tflops": rate / 1e12, "peak_tflops": None, "bandwidth_tbs": None,
        "pct_roofline": None, "roofline_source": None, "gemm_tflops": None, "max_err": err,
        "err_rows": 0 if args.backward else args.check_rows, "rotating_sets": sets,
        "direction": "backward" if args.backward else "forward",
    }
    rec.update(meta)
    if roof:
        pk, bw, src = roof
        rec.update(peak_tflops=pk / 1e12, bandwidth_tbs=bw / 1e12, roofline_source=src,
                   pct_roofline=100 * rate / min(pk, bw * ai))
    del data, graphs
    return rec


def main():
    ap = argparse.ArgumentParser(description="torch SDPA peers, one JSON line per run")
    ap.add_argument("--quick", action="store_true", help="hdim 64 and 128 at seqlen 4K only (the GPU check's shapes)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--launches", type=int, default=20, help="launches between two events")
    ap.add_argument("--check-rows", type=int, default=16)
    ap.add_argument("--backward", action="store_true", help="time SDPA's backward (FLOPs 2.5x the forward's)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU present: nothing to benchmark", file=sys.stderr)
        return
    props = torch.cuda.get_device_properties(0)
    meta = {
        "gpu": torch.cuda.get_device_name(0),
        "driver": smi("driver_version") or "unknown",
        "clocks": smi("clocks.sm,clocks.mem,clocks.max.sm") or "unknown",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})",
        "sm": f"{props.major}.{props.minor}",
    }
    l2 = getattr(props, "L2_cache_size", 64 << 20)
    bw = copy_bandwidth()
    spec = lookup(meta["gpu"])
    roof = None
    if spec:
        roof = (spec[0], bw, f"{spec[2]} | measured: device-to-device copy {bw / 1e12:.2f} TB/s (spec {spec[1] / 1e12:.2f})")
    print(f"{meta['gpu']}: copy {bw / 1e12:.2f} TB/s; {meta['torch']}; driver {meta['driver']}; clocks {meta['clocks']}",
          file=sys.stderr)
    dtype = DTYPES[args.dtype]
    for b, s, h, d, causal in sweep(args.tokens, args.quick):
        for name, backend in BACKENDS.items():
            rec = bench(name, backend, b, s, h, d, causal, dtype, args, l2, roof, meta)
            if rec:
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()

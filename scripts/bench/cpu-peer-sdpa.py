#!/usr/bin/env python3
"""torch SDPA on the sweep's rows that the shared cpu_peers.py does not cover: GQA (fewer kv heads
than query heads, `enable_gqa=True`) and 16-bit inputs (bf16 / f16 tensors), one shape per process.

    PY scripts/bench/cpu-peer-sdpa.py --shape B HQ HKV SQ SK D [--causal] [--dtype bf16] [--threads N]

Run by scripts/bench/cpu-peers-table.py under the peers' venv. The method is cpu_peers.py's: thread
counts fixed before torch is imported (`OMP_NUM_THREADS` and `torch.set_num_threads`, all cores by
default), `--warmup` untimed calls, then timed calls until `--min-reps` and `--min-time` seconds
(at most `--max-reps`), wall-clock median. Inputs are standard normal f32 rounded once to the
dtype, layout (B, H, S, D); the error is the largest |difference| from a float64 reference
computed from the same rounded inputs, on `--check-rows` query rows of every head (causal
aligned as torch's `is_causal`: top-left, the same as bottom-right for SQ == SK). One JSON line on
stdout: the fields of cpu_peers.py's records (`peer`, `shape`, `causal`, `dtype`, `ms`, `gflops`,
`max_abs_err`, `ms_min`, `reps`, `version`, `impl`, `threads`) plus `heads_kv`.
"""
import argparse
import json
import os
import sys
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--shape", nargs=6, type=int, required=True, metavar=("B", "HQ", "HKV", "SQ", "SK", "D"))
ap.add_argument("--causal", action="store_true")
ap.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
ap.add_argument("--threads", type=int, default=os.cpu_count())
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--min-reps", type=int, default=5)
ap.add_argument("--max-reps", type=int, default=200)
ap.add_argument("--min-time", type=float, default=1.0)
ap.add_argument("--check-rows", type=int, default=8)
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()
for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(v, str(args.threads))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def main():
    b, hq, hkv, sq, sk, d = args.shape
    causal = args.causal
    rec = {"peer": "torch_sdpa", "runner": "scripts/bench/cpu-peer-sdpa.py", "shape": [b, hq, sq, sk, d],
           "heads_kv": hkv, "causal": causal, "dtype": args.dtype}
    if hq % hkv:
        rec["error"] = f"heads {hq} not a multiple of kv heads {hkv}"
        print(json.dumps(rec))
        return
    if causal and sq != sk:
        rec["error"] = "causal is only defined here for seqlen_q == seqlen_k"
        print(json.dumps(rec))
        return
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    g = torch.Generator().manual_seed(args.seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(dt)
    k = torch.randn(b, hkv, sk, d, generator=g).to(dt)
    v = torch.randn(b, hkv, sk, d, generator=g).to(dt)
    gqa = hq != hkv
    res = {}

    def run():
        if gqa:
            res["o"] = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        else:
            res["o"] = F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    impl = "unknown"
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        names = [e.key for e in prof.key_averages()]
        impl = ",".join(sorted(n for n in names if "_scaled_dot_product" in n)) or ",".join(sorted(names))[:200]
    except Exception as e:  # the profiler is only diagnostics
        impl = f"profiler failed: {e!r}"[:200]
    for _ in range(args.warmup):
        run()
    times = []
    while len(times) < args.min_reps or (sum(times) < args.min_time and len(times) < args.max_reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]

    # float64 reference on a sample of query rows of every head (spread over the sequence).
    o = res["o"].float().numpy().astype(np.float64)
    qn, kn, vn = (x.float().numpy().astype(np.float64) for x in (q, k, v))
    rows = sorted(set(np.linspace(0, sq - 1, min(args.check_rows, sq)).astype(int).tolist()))
    err = 0.0
    for bi in range(b):
        for h in range(hq):
            hk = h // (hq // hkv)
            s = qn[bi, h, rows] @ kn[bi, hk].T / np.sqrt(d)
            if causal:
                s[np.arange(sk)[None, :] > np.array(rows)[:, None]] = -np.inf
            s -= s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            ref = (p / p.sum(axis=-1, keepdims=True)) @ vn[bi, hk]
            err = max(err, float(np.max(np.abs(o[bi, h, rows] - ref))))
    flops = 4 * b * hq * d * sq * (sq + 1) // 2 if causal else 4 * b * hq * sq * sk * d
    rec.update(ms=round(med * 1e3, 4), gflops=round(flops / med / 1e9, 2), max_abs_err=float(f"{err:.3g}"),
               ms_min=round(times[0] * 1e3, 4), reps=len(times), version=torch.__version__, impl=impl,
               threads=torch.get_num_threads())
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one line the table can show, never a silent gap
        print(json.dumps({"peer": "torch_sdpa", "error": repr(e)[:400]}), flush=True)
        sys.exit(1)

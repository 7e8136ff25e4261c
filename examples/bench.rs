//! One shape, one JSON line: `cargo run --release --example bench -- [options]`.
//!
//! ```text
//! --backend cpu|auto|cuda[:N]   where to run (default auto: the GPU if usable, else the CPU)
//! --variant auto|fa1|fa2|fa3|fa4
//! --dtype f32|f16|bf16          (default f32 on the CPU, bf16 on a GPU)
//! --fp8 tensor|block:ROWS       FP8 precision (per-tensor or per-block scales)
//! --hadamard SEED               with --fp8: the random Hadamard rotation
//! --batch B --seqlen S (or --seqlen-q / --seqlen-k) --heads H --heads-kv HKV --head-dim D
//! --causal | --window LEFT,RIGHT
//! --lse                          also return the LSE (counted in the bytes)
//! --page-size N                  CPU: K/V in a paged cache of N-key blocks, shuffled, through
//!                                `serving::forward_kvcache` (the decode/paged path)
//! --splits N  --threads N        CPU: force the split-KV count / the worker threads
//! --warmup N (2)  --runs N (10)  --max-seconds T (20: stop early after 3 runs past T)
//! --launches N (10)              GPU: launches between two CUDA events (one repetition);
//!                                the warm-up is `warmup` such batches, `runs` repetitions
//! --copy-mib N (512)             GPU: bytes of the device-to-device copy timed for bandwidth
//! --check-rows N (32)            rows checked against the float64 reference (0: none)
//! --no-gemm                      CPU: skip measuring the GEMM rate (no % of roofline)
//! --peak-tflops X --bandwidth-tbs Y   override the roofline
//! --layout bshd|bhsd            CPU: the inputs' memory layout (default bshd, FlashAttention's
//!                                [batch, seqlen, heads, head_dim]; bhsd: each head's rows
//!                                contiguous, as torch SDPA and onnxruntime's Attention take
//!                                them, passed as strided views; the output is bshd either way)
//! --into                         CPU: time `forward_into` writing into one output (and LSE)
//!                                buffer reused across calls, as an engine's activation buffer
//!                                (and as the peers script runs onnxruntime, its output bound
//!                                once), instead of `forward` allocating the output per call
//! --seed N
//! ```
//! Prints one JSON line (fields in `flash_attn::bench::support::Record::json`) on stdout; notes go
//! to stderr. Asked for a GPU where none is usable, it says so on stderr and exits 0; a variant
//! or dtype the GPU's dispatch refuses also exits 0 with the reason and no line.
//!
//! On a GPU (`support::gpu::GpuHarness`): the inputs are uploaded once into enough rotating sets
//! to exceed twice the L2, timed with CUDA events around batches of launches after a warm-up,
//! median per-launch time reported; the roofline is the GPU table's peak with the bandwidth
//! measured by a device-to-device copy; the output of set 0 is downloaded once and sampled
//! rows are compared with the float64 reference.

use flash_attn::bench::support;

use flash_attn::bench::roofline::{lookup_gpu, Math, Roofline};
use flash_attn::bench::flops;
use serde_json::json;
use flash_attn::{forward, Backend, DType, ForwardOptions, Fp8Scaling, Mask, Output, OwnedData, Precision};
use flash_attn::{Tensor, TensorView, Variant};
use support::{Case, Gemm, Record};

struct Args {
    backend: Backend,
    variant: Variant,
    dtype: Option<DType>,
    precision: Precision,
    batch: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    heads: usize,
    heads_kv: Option<usize>,
    head_dim: usize,
    mask: Mask,
    lse: bool,
    warmup: usize,
    runs: usize,
    max_seconds: f64,
    check_rows: usize,
    gemm: bool,
    peak_tflops: Option<f64>,
    bandwidth_tbs: Option<f64>,
    seed: u64,
    launches: usize,
    copy_mib: usize,
    page_size: Option<usize>,
    splits: Option<usize>,
    threads: Option<usize>,
    heads_major: bool,
    into: bool,
}

const USAGE: &str = "usage: bench [--backend cpu|auto|cuda[:N]] [--variant auto|fa1|fa2|fa3|fa4] \
[--dtype f32|f16|bf16] [--fp8 tensor|block:ROWS] [--hadamard SEED] [--batch B] [--seqlen S] \
[--seqlen-q SQ] [--seqlen-k SK] [--heads H] [--heads-kv HKV] [--head-dim D] [--causal] \
[--window L,R] [--lse] [--warmup N] [--runs N] [--max-seconds T] [--check-rows N] [--no-gemm] \
[--peak-tflops X] [--bandwidth-tbs Y] [--seed N] [--launches N] [--copy-mib N] [--page-size N] \
[--splits N] [--threads N] [--layout bshd|bhsd] [--into]";

fn parse() -> Result<Args, String> {
    let mut a = Args {
        backend: Backend::Auto,
        variant: Variant::Auto,
        dtype: None,
        precision: Precision::Native,
        batch: 1,
        seqlen_q: 2048,
        seqlen_k: 2048,
        heads: 8,
        heads_kv: None,
        head_dim: 128,
        mask: Mask::None,
        lse: false,
        warmup: 2,
        runs: 10,
        max_seconds: 20.0,
        check_rows: 32,
        gemm: true,
        peak_tflops: None,
        bandwidth_tbs: None,
        seed: 1,
        launches: 10,
        copy_mib: 512,
        page_size: None,
        splits: None,
        threads: None,
        heads_major: false,
        into: false,
    };
    let mut hadamard = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        fn num<T: std::str::FromStr>(flag: &str, s: String) -> Result<T, String> {
            s.parse().map_err(|_| format!("{flag}: not a number: {s}"))
        }
        match flag.as_str() {
            "--backend" => a.backend = val()?.parse().map_err(|e| format!("--backend: {e}"))?,
            "--variant" => a.variant = val()?.parse().map_err(|e| format!("--variant: {e}"))?,
            "--dtype" => a.dtype = Some(val()?.parse().map_err(|e| format!("--dtype: {e}"))?),
            "--fp8" => {
                let v = val()?;
                let scaling = match v.as_str() {
                    "tensor" => Fp8Scaling::PerTensor,
                    s if s.starts_with("block:") => Fp8Scaling::PerBlock { rows: num("--fp8", s[6..].to_string())? },
                    _ => return Err(format!("--fp8: unknown {v} (tensor or block:ROWS)")),
                };
                a.precision = Precision::Fp8 { scaling, hadamard: None };
            }
            "--hadamard" => hadamard = Some(num::<u64>(&flag, val()?)?),
            "--batch" => a.batch = num(&flag, val()?)?,
            "--seqlen" => {
                a.seqlen_q = num(&flag, val()?)?;
                a.seqlen_k = a.seqlen_q;
            }
            "--seqlen-q" => a.seqlen_q = num(&flag, val()?)?,
            "--seqlen-k" => a.seqlen_k = num(&flag, val()?)?,
            "--heads" => a.heads = num(&flag, val()?)?,
            "--heads-kv" => a.heads_kv = Some(num(&flag, val()?)?),
            "--head-dim" => a.head_dim = num(&flag, val()?)?,
            "--causal" => a.mask = Mask::Causal,
            "--window" => {
                let v = val()?;
                let (l, r) = v.split_once(',').ok_or(format!("--window: expected LEFT,RIGHT, got {v}"))?;
                a.mask = Mask::window(num(&flag, l.to_string())?, num(&flag, r.to_string())?);
            }
            "--lse" => a.lse = true,
            "--warmup" => a.warmup = num(&flag, val()?)?,
            "--runs" => a.runs = num::<usize>(&flag, val()?)?.max(1),
            "--max-seconds" => a.max_seconds = num(&flag, val()?)?,
            "--check-rows" => a.check_rows = num(&flag, val()?)?,
            "--no-gemm" => a.gemm = false,
            "--peak-tflops" => a.peak_tflops = Some(num(&flag, val()?)?),
            "--bandwidth-tbs" => a.bandwidth_tbs = Some(num(&flag, val()?)?),
            "--seed" => a.seed = num(&flag, val()?)?,
            "--launches" => a.launches = num::<usize>(&flag, val()?)?.max(1),
            "--copy-mib" => a.copy_mib = num(&flag, val()?)?,
            "--page-size" => a.page_size = Some(num::<usize>(&flag, val()?)?.max(1)),
            "--splits" => a.splits = Some(num(&flag, val()?)?),
            "--threads" => a.threads = Some(num(&flag, val()?)?),
            "--into" => a.into = true,
            "--layout" => {
                a.heads_major = match val()?.as_str() {
                    "bshd" => false,
                    "bhsd" => true,
                    v => return Err(format!("--layout: unknown {v} (bshd or bhsd)")),
                }
            }
            "-h" | "--help" => return Err(USAGE.into()),
            // `cargo bench`/`cargo run` may pass this through.
            "--bench" => {}
            _ => return Err(format!("unknown argument {flag}\n{USAGE}")),
        }
    }
    if let (Some(seed), Precision::Fp8 { scaling, .. }) = (hadamard, a.precision) {
        a.precision = Precision::Fp8 { scaling, hadamard: Some(seed) };
    }
    Ok(a)
}

fn precision_name(p: Precision) -> String {
    match p {
        Precision::Fp8 { scaling, hadamard } => {
            let s = match scaling {
                Fp8Scaling::PerBlock { rows } => format!("block{rows}"),
                _ => "tensor".into(),
            };
            format!("fp8-{s}{}", if hadamard.is_some() { "-hadamard" } else { "" })
        }
        _ => "native".into(),
    }
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    // The GPU path: asked for (`--backend cuda[:N]`), or `auto` with a usable GPU.
    match a.backend {
        Backend::Cuda(dev) => match support::gpu::open(dev) {
            Ok(h) => return gpu_main(&a, h),
            Err(why) => {
                eprintln!("no CUDA GPU present: nothing to benchmark ({why})");
                return;
            }
        },
        Backend::Auto => {
            if let Ok(h) = support::gpu::open(0) {
                return gpu_main(&a, h);
            }
        }
        _ => {}
    }
    let threads = support::gemm_use_all_cores();
    let case = a.case(DType::F32);
    let (q, k, v) = case.inputs(a.seed);
    // `--layout bhsd`: the same values, each head's rows contiguous, read through strided views.
    let permuted = a.heads_major.then(|| [&q, &k, &v].map(support::HeadMajor::new));
    let views: [TensorView<'_>; 3] = match &permuted {
        Some(hm) => [0, 1, 2].map(|i| hm[i].view()),
        None => [q.view(), k.view(), v.view()],
    };
    let mut opts = ForwardOptions::default()
        .mask(case.mask)
        .backend(a.backend)
        .variant(a.variant)
        .precision(a.precision)
        .return_lse(a.lse);
    if let Some(n) = a.splits {
        opts = opts.num_splits(n);
    }
    if let Some(n) = a.threads {
        opts = opts.cpu_threads(n);
    }
    let p = match flash_attn::Problem::new(&q.view(), &k.view(), &v.view(), &opts) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("invalid shape/options: {e}");
            std::process::exit(2);
        }
    };
    let cost = flops::cost(&p);
    // The paged layout holds the same keys as k and v, so the dense reference checks it.
    let paged = a.page_size.map(|ps| support::PagedKv::new(&k, &v, ps, a.seed + 7));

    // `--into`: the output (and LSE) buffers, allocated once and written by every call.
    let into = std::cell::RefCell::new(
        a.into.then(|| (OwnedData::zeros(q.dtype(), q.numel()), vec![0.0f32; p.batch * p.heads_q * p.seqlen_q])),
    );
    let run = || -> Result<(Output, f64), flash_attn::Error> {
        let mut out = None;
        let mut bufs = into.borrow_mut();
        let ms = support::time_ms(|| {
            out = Some(match (&paged, bufs.as_mut()) {
                (Some(pk), _) => flash_attn::serving::forward_kvcache(&q, &pk.cache(), &opts),
                (None, None) => forward(&views[0], &views[1], &views[2], &opts),
                (None, Some((Ok(o), lse))) => {
                    let lse = a.lse.then_some(&mut lse[..]);
                    let [vq, vk, vv] = &views;
                    match o {
                        OwnedData::F32(o) => flash_attn::forward_into(vq, vk, vv, o, lse, &opts),
                        OwnedData::F16(o) => flash_attn::forward_into(vq, vk, vv, o, lse, &opts),
                        OwnedData::BF16(o) => flash_attn::forward_into(vq, vk, vv, o, lse, &opts),
                    }
                    .map(|dispatch| Output { o: Tensor::zeros(q.dtype(), [0; 4]).expect("empty"), lse: None, dispatch })
                }
                (None, Some((Err(e), _))) => Err(e.clone()),
            })
        });
        let mut out = out.expect("set by the closure")?;
        // Outside the timed part: the result as `forward` returns it, for the checks below.
        if let Some((Ok(o), lse)) = bufs.as_ref() {
            let shape = q.shape();
            out.o = match o {
                OwnedData::F32(o) => Tensor::from_vec(o.clone(), shape),
                OwnedData::F16(o) => Tensor::from_vec(o.clone(), shape),
                OwnedData::BF16(o) => Tensor::from_vec(o.clone(), shape),
            }?;
            out.lse = a.lse.then(|| lse.clone());
        }
        Ok((out, ms))
    };
    let mut first = None;
    for _ in 0..a.warmup {
        match run() {
            Ok((o, _)) => first = Some(o),
            Err(e) => {
                eprintln!("forward failed: {e}");
                std::process::exit(1);
            }
        }
    }
    // On the CPU the GEMM reference rate is timed in blocks alternating with the runs, each block
    // as long as the previous run, so both see the same load on a shared machine.
    let interleave_gemm = a.gemm && first.as_ref().is_some_and(|o| o.dispatch.backend == "cpu");
    let mut gemm = interleave_gemm.then(|| Gemm::new(2048, 2048, 128));
    if let Some(g) = gemm.as_mut() {
        g.run(); // warm-up
    }
    let mut gemm_rates = Vec::new();
    let mut times = Vec::new();
    // CPU seconds (all threads) spent in the timed attention runs and in the GEMM blocks.
    let (mut att_cpu, mut gemm_cpu, mut gemm_flop_total) = (0.0f64, 0.0f64, 0u64);
    let cpu_now = || support::process_cpu_seconds().unwrap_or(f64::NAN);
    let mut last_ms = 100.0;
    let started = std::time::Instant::now();
    for i in 0..a.runs {
        if let Some(g) = gemm.as_mut() {
            let (c0, r0) = (cpu_now(), g.runs_done);
            let rate = g.rate_for(last_ms);
            gemm_cpu += cpu_now() - c0;
            gemm_flop_total += (g.runs_done - r0) * g.flops();
            gemm_rates.push(rate);
        }
        let c0 = cpu_now();
        let (o, ms) = run().unwrap_or_else(|e| {
            eprintln!("forward failed: {e}");
            std::process::exit(1);
        });
        att_cpu += cpu_now() - c0;
        times.push(ms);
        last_ms = ms;
        first.get_or_insert(o);
        if i >= 2 && started.elapsed().as_secs_f64() > a.max_seconds {
            eprintln!("stopped after {} runs (--max-seconds {})", i + 1, a.max_seconds);
            break;
        }
    }
    if let Some(g) = gemm.as_mut() {
        gemm_rates.push(g.rate_for(last_ms)); // the block after the last run
    }
    let out = first.expect("at least one run");
    let ms = support::median(&times);

    let on_cpu = out.dispatch.backend == "cpu";
    let math = Math::of(case.dtype, a.precision);
    let gemm_flops = gemm.is_some().then(|| support::median(&gemm_rates));
    let gemm_flops_best = gemm.is_some().then(|| gemm_rates.iter().copied().fold(0.0, f64::max));
    let att_rates: Vec<f64> = times.iter().map(|ms| flops::flops_per_second(cost.flops, *ms)).collect();
    let gemm_ratio_paired = gemm.is_some().then(|| support::paired_ratio(&gemm_rates, &att_rates));
    // Work per CPU-second times the threads: the rate with the cores to ourselves. Needs enough
    // CPU time for the 10 ms tick of /proc/self/stat to be negligible.
    let cpu_time_rates = (gemm.is_some() && att_cpu > 0.5 && gemm_cpu > 0.5).then(|| {
        let t = threads as f64;
        (cost.flops as f64 * times.len() as f64 * t / att_cpu, gemm_flop_total as f64 * t / gemm_cpu)
    });
    let roofline = match (a.peak_tflops, a.bandwidth_tbs) {
        (Some(pk), Some(bw)) => Some(Roofline {
            machine: "given".into(),
            math,
            peak_flops: pk * 1e12,
            peak_source: "--peak-tflops".into(),
            bandwidth: bw * 1e12,
            bandwidth_source: "--bandwidth-tbs".into(),
        }),
        _ if on_cpu && gemm_flops.is_some() => {
            // The CPU's compute ceiling: the f32 GEMM rate measured beside the runs.
            let g = gemm_flops.expect("checked");
            let mut r = support::cpu_roofline(
                g,
                "sgemm 2048x2048x128 on all cores, in blocks alternating with the runs (median)",
            );
            if let Some(pk) = a.peak_tflops {
                r.peak_flops = pk * 1e12;
                r.peak_source = "--peak-tflops".into();
            }
            if let Some(bw) = a.bandwidth_tbs {
                r.bandwidth = bw * 1e12;
                r.bandwidth_source = "--bandwidth-tbs".into();
            }
            Some(r)
        }
        _ => None,
    };

    let max_err =
        (a.check_rows > 0).then(|| support::sampled_max_error(&p, &q, &k, &v, &out, a.check_rows, a.seed + 1));
    let rec = Record {
        impl_name: "flash_attn".into(),
        machine: if on_cpu { flash_attn::bench::roofline::cpu_name() } else { out.dispatch.backend.clone() },
        backend: out.dispatch.backend.clone(),
        kernel: out.dispatch.kernel.clone(),
        variant: a.variant.to_string(),
        case,
        precision: precision_name(a.precision),
        cost,
        ms,
        ms_min: Some(times.iter().copied().fold(f64::INFINITY, f64::min)),
        runs: times.len(),
        roofline,
        max_err,
        err_rows: a.check_rows,
        gemm_flops,
        gemm_flops_best,
        gemm_ratio_paired,
        cpu_time_rates,
    };
    if let Some((a, g)) = cpu_time_rates {
        eprintln!(
            "per CPU-second x {threads} threads: attention {:.1}, GEMM {:.1} GFLOP/s, ratio {:.2}",
            a / 1e9,
            g / 1e9,
            a / g
        );
    }
    eprintln!(
        "{} on {} ({threads} GEMM threads): {:.2} ms, {:.1} GFLOP/s{}",
        rec.kernel,
        rec.machine,
        ms,
        rec.flops_per_s() / 1e9,
        gemm_ratio_paired.map_or(String::new(), |r| format!(
            ", {r:.2}x the GEMM rate (paired); best {:.1} vs GEMM best {:.1} GFLOP/s",
            att_rates.iter().copied().fold(0.0, f64::max) / 1e9,
            gemm_flops_best.unwrap_or(f64::NAN) / 1e9
        ))
    );
    // Decode is bound by reading K and V: their bytes over the median time.
    let kv_gbs = support::kv_bytes(&rec.case) as f64 / (ms * 1e-3) / 1e9;
    eprintln!(
        "K/V read: {kv_gbs:.1} GB/s ({}; {})",
        a.page_size.map_or("dense".to_string(), |ps| format!("paged, {ps}-key blocks, shuffled")),
        out.dispatch.reason
    );
    println!(
        "{}",
        rec.json_with([
            ("kv_layout", json!(if a.page_size.is_some() { "paged" } else { "dense" })),
            ("page_size", json!(a.page_size)),
            ("kv_gbs", json!(kv_gbs)),
            ("dispatch_reason", json!(out.dispatch.reason)),
        ])
    );
}

impl Args {
    /// The run's shape and mask, in `default_dtype` unless `--dtype` was given.
    fn case(&self, default_dtype: DType) -> Case {
        Case {
            batch: self.batch,
            seqlen_q: self.seqlen_q,
            seqlen_k: self.seqlen_k,
            heads_q: self.heads,
            heads_kv: self.heads_kv.unwrap_or(self.heads),
            head_dim: self.head_dim,
            dtype: self.dtype.unwrap_or(default_dtype),
            mask: self.mask,
        }
    }
}

/// `--backend cuda` (or auto with a GPU): one shape through the harness, one JSON line.
fn gpu_main(a: &Args, mut h: Box<dyn support::gpu::GpuHarness>) {
    let info = h.info().clone();
    let case = a.case(DType::BF16);
    let (q, k, v) = case.inputs(a.seed);
    let opts = ForwardOptions::default()
        .mask(case.mask)
        .backend(Backend::Cuda(info.ordinal))
        .variant(a.variant)
        .precision(a.precision)
        .return_lse(a.lse);
    let p = match flash_attn::Problem::new(&q.view(), &k.view(), &v.view(), &opts) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("invalid shape/options: {e}");
            std::process::exit(2);
        }
    };
    if a.lse {
        eprintln!("note: the GPU timing runs without the LSE output (the harness launches with lse = None)");
    }
    let cost = flops::cost(&p);
    let sets = support::gpu::rotating_sets(cost.bytes, info.l2_bytes);
    let dispatch = match h.prepare(&q, &k, &v, &opts, sets) {
        Ok(d) => d,
        Err(why) => {
            // A variant/dtype this GPU does not run: a note, no line (scripts loop over variants).
            eprintln!("skip {:?} {} on {}: {why}", a.variant, case.id(), info.name);
            return;
        }
    };
    let timing = match h.time(a.warmup.max(1) * a.launches, a.runs, a.launches) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{} failed after a successful probe: {e}", dispatch.kernel);
            std::process::exit(1);
        }
    };
    let times = &timing.ms_per_launch;
    let ms = support::median(times);
    let bw = if a.copy_mib > 0 { h.copy_bandwidth(a.copy_mib << 20).ok() } else { None };
    let math = Math::of(case.dtype, a.precision);
    let mut roofline = lookup_gpu(&info.name, info.sm).and_then(|(g, m)| Roofline::gpu(g, m, math)).map(|r| match bw {
        Some(bw) => r.with_measured_bandwidth(bw, &format!("device-to-device copy of {} MiB, CUDA events", a.copy_mib)),
        None => r,
    });
    if roofline.is_none() {
        eprintln!(
            "{} (sm_{}{}) is not in flash_attn::bench::roofline::GPUS: no % of roofline",
            info.name, info.sm.0, info.sm.1
        );
    }
    if let (Some(pk), Some(bwt)) = (a.peak_tflops, a.bandwidth_tbs) {
        roofline = Some(Roofline {
            machine: "given".into(),
            math,
            peak_flops: pk * 1e12,
            peak_source: "--peak-tflops".into(),
            bandwidth: bwt * 1e12,
            bandwidth_source: "--bandwidth-tbs".into(),
        });
    } else if let Some(r) = roofline.as_mut() {
        if let Some(pk) = a.peak_tflops {
            r.peak_flops = pk * 1e12;
            r.peak_source = "--peak-tflops".into();
        }
        if let Some(bwt) = a.bandwidth_tbs {
            r.bandwidth = bwt * 1e12;
            r.bandwidth_source = "--bandwidth-tbs".into();
        }
    }
    let max_err = if a.check_rows > 0 {
        match h.output() {
            Ok(out) => Some(support::sampled_max_error(&p, &q, &k, &v, &out, a.check_rows, a.seed + 1)),
            Err(e) => {
                eprintln!("downloading the output failed: {e}");
                std::process::exit(1);
            }
        }
    } else {
        None
    };
    let rec = Record {
        impl_name: "flash_attn".into(),
        machine: info.name.clone(),
        backend: dispatch.backend.clone(),
        kernel: dispatch.kernel.clone(),
        variant: a.variant.to_string(),
        case,
        precision: precision_name(a.precision),
        cost,
        ms,
        ms_min: Some(times.iter().copied().fold(f64::INFINITY, f64::min)),
        runs: times.len(),
        roofline,
        max_err,
        err_rows: a.check_rows,
        gemm_flops: None,
        gemm_flops_best: None,
        gemm_ratio_paired: None,
        cpu_time_rates: None,
    };
    eprintln!(
        "{} on {} (sm_{}{}, {} SMs, L2 {} MiB; {}; clocks {}): {:.3} ms, {:.1} TFLOP/s, {sets} rotating sets, {} x {} launches{}",
        rec.kernel,
        info.name,
        info.sm.0,
        info.sm.1,
        info.sm_count,
        info.l2_bytes >> 20,
        info.driver,
        info.clocks(),
        ms,
        rec.flops_per_s() / 1e12,
        times.len(),
        a.launches,
        bw.map_or(String::new(), |b| format!(", copy {:.2} TB/s", b / 1e12)),
    );
    println!(
        "{}",
        rec.json_with([
            ("gpu", json!(info.name)),
            ("driver", json!(info.driver)),
            ("clocks", json!(info.clocks())),
            ("sm", json!(format!("{}.{}", info.sm.0, info.sm.1))),
            ("sm_count", json!(info.sm_count)),
            ("l2_bytes", json!(info.l2_bytes)),
            ("rotating_sets", json!(sets)),
            ("launches_per_rep", json!(a.launches)),
            ("dispatch_reason", json!(dispatch.reason)),
        ])
    );
}

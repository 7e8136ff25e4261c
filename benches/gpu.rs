//! GPU benchmarks: every available kernel family on the GPU sweep (`bench::support::gpu::sweep`),
//! timed with CUDA events around batches of launches over rotating input sets larger than L2,
//! median reported, throughput in FLOP/s (criterion "elements" = FLOPs); then the backward
//! kernels (FA2, FA3-style; atomic and deterministic dq) on the same sweep, FLOPs = 2.5 × the
//! forward's.
//!
//! Without a usable GPU it prints "no CUDA GPU present: nothing to benchmark" and exits 0.
//! `FA_BENCH_QUICK=1` runs the short sweep of the one-command GPU check; `FA_BENCH_TOKENS`
//! changes the 16K tokens per launch.

use flash_attn::bench::support;

use criterion::{Criterion, SamplingMode, Throughput};
use flash_attn::bench::roofline::{lookup_gpu, Math, Roofline};
use flash_attn::bench::flops;
use flash_attn::{Backend, DType, ForwardOptions, Fp8Scaling, Precision, Rescale, Variant};
use std::time::Duration;
use support::gpu::{self, GpuHarness};

const SAMPLES: usize = 10;
/// Launches between two events: long enough that event resolution (~0.5 µs) is negligible.
const LAUNCHES_PER_REP: usize = 20;
/// Launches before each timed batch (criterion's own warm-up phase does the long warm-up; these
/// only refill the queue after criterion's pause between samples).
const WARMUP_LAUNCHES: usize = 2;
/// Bytes of the device-to-device copy that measures bandwidth (far beyond any L2).
const COPY_BYTES: usize = 1 << 30;

fn main() {
    let mut harness = match gpu::open(0) {
        Ok(h) => h,
        Err(why) => {
            println!("no CUDA GPU present: nothing to benchmark ({why})");
            return;
        }
    };
    let info = harness.info().clone();
    println!(
        "GPU: {} (sm_{}{}, {} SMs, L2 {} MiB), {}, clocks SM {:?} MHz / mem {:?} MHz",
        info.name,
        info.sm.0,
        info.sm.1,
        info.sm_count,
        info.l2_bytes >> 20,
        info.driver,
        info.sm_clock_mhz,
        info.mem_clock_mhz
    );
    let measured_bw = harness.copy_bandwidth(COPY_BYTES).ok();
    if let Some(bw) = measured_bw {
        println!("device-to-device copy: {:.2} TB/s (read + write)", bw / 1e12);
    }
    let spec = lookup_gpu(&info.name, info.sm);
    if spec.is_none() {
        println!("{} is not in flash_attn::bench::roofline::GPUS: no % of roofline", info.name);
    }

    let quick = std::env::var("FA_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let tokens = std::env::var("FA_BENCH_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(16 * 1024);
    let mut c = Criterion::default()
        .sample_size(SAMPLES)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(if quick { 1 } else { 2 }))
        .configure_from_args();
    let mut group = c.benchmark_group(format!("attention_{}", info.name.replace(' ', "_")));
    group.sampling_mode(SamplingMode::Flat);

    // Every variant in bf16, then FP8 through Variant::Fa3 (docs/fp8.md: per-block 64 scales +
    // Hadamard, timed end to end from the bf16 inputs: pre-pass + consumer); `prepare` returning
    // Err skips what this GPU does not run (FP8: sm_90a, the FP8 rows' head dims).
    let fp8 = Precision::Fp8 { scaling: Fp8Scaling::PerBlock { rows: 64 }, hadamard: Some(1) };
    let runs = [
        ("Fa1", Variant::Fa1, Precision::Native),
        ("Fa2", Variant::Fa2, Precision::Native),
        ("Fa3", Variant::Fa3, Precision::Native),
        ("Fa4", Variant::Fa4, Precision::Native),
        ("Fa3-fp8", Variant::Fa3, fp8),
    ];
    for case in gpu::sweep(DType::BF16, tokens, quick) {
        let (q, k, v) = case.inputs(1);
        let base = ForwardOptions::default().mask(case.mask).backend(Backend::Cuda(info.ordinal));
        let p = case.problem(&q, &k, &v, &base);
        let cost = flops::cost(&p);
        let sets = gpu::rotating_sets(cost.bytes, info.l2_bytes);
        let mut runs: Vec<(String, ForwardOptions)> = runs
            .iter()
            .map(|&(label, variant, precision)| (label.to_string(), base.clone().variant(variant).precision(precision)))
            .collect();
        if case.head_dim == 128 {
            runs.extend(fa4_softmax_sweep(&base));
        }
        for (label, opts) in runs {
            // Ask the dispatch, upload and probe once: a variant this GPU does not run is
            // skipped with the dispatch's reason.
            match harness.prepare(&q, &k, &v, &opts, sets) {
                Ok(d) => println!("{label} {}: {} ({})", case.id(), d.kernel, d.reason),
                Err(why) => {
                    println!("skip {label} {}: {why}", case.id());
                    continue;
                }
            }
            group.throughput(Throughput::Elements(cost.flops));
            group.bench_function(format!("{label}/{}", case.id()), |b| {
                b.iter_custom(|iters| {
                    let t = bench_launches(harness.as_mut(), &case, iters);
                    Duration::from_secs_f64(t * 1e-3)
                })
            });
        }
    }
    group.finish();

    // The backward (Engine::backward) on the same sweep, FLOPs = 2.5 x the forward's
    // (FlashAttention's convention: five products of the forward's size, none of them skipped by
    // recomputation), beside torch SDPA's backward (scripts/bench/gpu-peers-torch.py --backward).
    // The kernels ran in the emulator and were compile-checked; a GPU run of this bench is their
    // first timing.
    let mut group = c.benchmark_group(format!("backward_{}", info.name.replace(' ', "_")));
    group.sampling_mode(SamplingMode::Flat);
    let bwd_runs = [("Fa2", Variant::Fa2, false), ("Fa2-det", Variant::Fa2, true), ("Fa3", Variant::Fa3, false), ("Fa3-det", Variant::Fa3, true)];
    for case in gpu::sweep(DType::BF16, tokens, quick) {
        let (q, k, v) = case.inputs(1);
        let base = ForwardOptions::default().mask(case.mask).backend(Backend::Cuda(info.ordinal));
        let p = case.problem(&q, &k, &v, &base);
        let cost = flops::cost(&p);
        let bwd_flops = (2.5 * cost.flops as f64) as u64;
        // q, k, v, o, dO read and dq, dk, dv written: about twice the forward's bytes.
        let sets = gpu::rotating_sets(2 * cost.bytes, info.l2_bytes);
        for &(label, variant, deterministic) in &bwd_runs {
            let opts = base.clone().variant(variant).deterministic(deterministic);
            match harness.prepare_backward(&q, &k, &v, &opts, sets) {
                Ok(d) => println!("backward {label} {}: {} ({})", case.id(), d.kernel, d.reason),
                Err(why) => {
                    println!("skip backward {label} {}: {why}", case.id());
                    continue;
                }
            }
            group.throughput(Throughput::Elements(bwd_flops));
            group.bench_function(format!("{label}/{}", case.id()), |b| {
                b.iter_custom(|iters| {
                    let t = bench_launches(harness.as_mut(), &case, iters);
                    Duration::from_secs_f64(t * 1e-3)
                })
            });
        }
    }
    group.finish();
    c.final_summary();
    if let Some((g, m)) = spec {
        if let Some(r) = Roofline::gpu(g, m, Math::BF16) {
            let r = match measured_bw {
                Some(bw) => r.with_measured_bandwidth(bw, "device-to-device copy, CUDA events"),
                None => r,
            };
            println!(
                "roofline (bf16): {:.0} TFLOP/s, {:.2} TB/s; {}",
                r.peak_flops / 1e12,
                r.bandwidth / 1e12,
                r.peak_source
            );
        }
    }
    println!("per-shape JSON lines with % of roofline and errors: scripts/bench/gpu-peers.sh (examples/bench.rs)");
}

/// FA4's softmax on the FA3 pipeline (docs/fa4.md, "Part 1"), head dim 128: the share of the
/// software exp2 (0, 1 in 8, 1 in 4) x the lazy threshold tau (0, 8), each a kernel row of its
/// own (`fa4_exp2_share` + `Rescale::Lazy` pick it), beside FA3 in bf16 (`Variant::Fa3`: the
/// (0, 0) point) and in FP8 (the `Fa3-fp8` run of every case). Only an sm_90a GPU runs the rows; elsewhere they are skipped with
/// the dispatch's reason (the sm_80 / sm_100 FA2-pipeline row has only the default share).
fn fa4_softmax_sweep(base: &ForwardOptions) -> Vec<(String, ForwardOptions)> {
    let mut runs = Vec::new();
    for share in [0u32, 8, 4] {
        for tau in [0.0f32, 8.0] {
            if share == 0 && tau == 0.0 {
                continue; // fa3s5 itself: the Fa3 run
            }
            let opts = base.clone().variant(Variant::Fa4).fa4_exp2_share(share).rescale(Rescale::Lazy { threshold: tau });
            runs.push((format!("Fa4-share{share}-tau{tau}"), opts));
        }
    }
    runs
}

/// Total milliseconds of `iters` launches, timed in event-bracketed batches.
fn bench_launches(h: &mut dyn GpuHarness, case: &support::Case, iters: u64) -> f64 {
    let iters = iters as usize;
    let per = LAUNCHES_PER_REP.min(iters).max(1);
    let reps = iters.div_ceil(per);
    match h.time(WARMUP_LAUNCHES, reps, per) {
        Ok(t) => t.ms_per_launch.iter().sum::<f64>() * per as f64 * iters as f64 / (reps * per) as f64,
        Err(e) => panic!("{} failed after a successful probe: {e}", case.id()),
    }
}

//! CPU backend benchmarks, against the machine's own f32 GEMM rate measured in the same run.
//!
//! `cargo bench --bench cpu` (a few minutes on 2 cores). Sweep: batch × seqlen = `FA_BENCH_TOKENS`
//! (default 2048, so the headline shape 1×8 heads×2048×128 is in it), seqlen 512/1024/2048,
//! head_dim 64/128/256 at hidden `FA_BENCH_HIDDEN` (default 1024, so 16/8/4 heads), causal and
//! not, f32; bf16 inputs at head_dim 128. Criterion reports throughput in elements/s where one
//! element is one FLOP (so "Gelem/s" reads GFLOP/s). The GEMM group times `matrixmultiply`'s
//! sgemm on all cores at the attention products' shapes and a large square one.
//!
//! The machine is shared (other builds come and go), so a GEMM measured once would be compared
//! with attention measured under another load. Each attention sample is therefore preceded by a
//! block of the 2048×2048×128 sgemm (the shape of S = Q·Kᵀ for a 2048-row block, and
//! matrixmultiply's fastest shape here) lasting `GEMM_MATCH` × the previous sample, timed apart
//! from criterion's measurement. A case's ratios: median over median, best over best, and the
//! paired ratio (median over samples of the sample's rate ÷ the GEMM blocks on either side).
//! Also the rates per CPU-second × threads (process CPU time from /proc/self/stat): what each
//! would do with the cores to itself, the steadiest comparison when the machine is time-sliced.
//!
//! At the end a summary table gives each case's rates and ratios, and the same numbers go to
//! `target/bench/cpu.jsonl` (or `FA_BENCH_JSON`) as one JSON line per run for
//! `scripts/bench/report.py`.
//!
//! A second group, `decode_cpu`, times decode steps (one query row per sequence against a long
//! K/V cache: the in-place path, dense and paged with shuffled blocks) with throughput in bytes
//! of K/V read, the figure that matters for decode; its summary table gives K/V GB/s and its
//! JSON lines go to `target/bench/cpu-decode.jsonl` (or `FA_BENCH_DECODE_JSON`).
//!
//! A third, `decode_fp8_cpu`, times one decode step over an FP8 KV cache (e4m3 codes, per-tensor
//! and per-(token, head) scales) beside the same step over an f16 cache, and prints the ratio
//! (`cargo bench --bench cpu -- decode_fp8`).

use flash_attn::bench::support;

use criterion::{Criterion, SamplingMode, Throughput};
use flash_attn::bench::flops;
use flash_attn::{forward, Backend, DType, ForwardOptions, Mask, Output};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};
use support::{Case, Gemm, Record, GEMM_SHAPES};

/// Criterion's minimum; each sample is one or a few runs (flat sampling).
const SAMPLES: usize = 10;
const WARM_UP: Duration = Duration::from_secs(1);
const MEASURE: Duration = Duration::from_secs(3);
/// Rows of the float64 reference checked per case.
const ERR_ROWS: usize = 16;
/// Length of the GEMM block before each attention sample, relative to the previous sample.
const GEMM_MATCH: f64 = 0.5;
/// The interleaved GEMM: S = Q·Kᵀ of a 2048-row block at head_dim 128.
const ADJ_SHAPE: (usize, usize, usize) = (2048, 2048, 128);

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn cases() -> Vec<Case> {
    let tokens = env_usize("FA_BENCH_TOKENS", 2048);
    let hidden = env_usize("FA_BENCH_HIDDEN", 1024);
    let mut out = Vec::new();
    for d in [64, 128, 256] {
        for s in [512, 1024, 2048] {
            for causal in [false, true] {
                out.push(Case::square((tokens / s).max(1), s, hidden / d, d, DType::F32, causal));
            }
        }
    }
    for s in [512, 1024, 2048] {
        for causal in [false, true] {
            out.push(Case::square((tokens / s).max(1), s, hidden / 128, 128, DType::BF16, causal));
        }
    }
    out
}

/// CPU seconds (all threads, /proc/self/stat) of one GEMM block or one attention sample.
enum CpuEntry {
    Gemm { secs: f64, runs: u64 },
    Attention { secs: f64, runs: u64 },
}

fn cpu_now() -> f64 {
    support::process_cpu_seconds().unwrap_or(f64::NAN)
}

/// Per-iteration times (ms) recorded by each benchmark's routine; the last `SAMPLES` entries are
/// criterion's measurement phase (warm-up calls come first).
type Samples = RefCell<BTreeMap<String, Vec<f64>>>;

fn record(samples: &Samples, id: &str, total: Duration, iters: u64) {
    let ms = total.as_secs_f64() * 1e3 / iters.max(1) as f64;
    samples.borrow_mut().entry(id.to_string()).or_default().push(ms);
}

/// (median ms, fastest ms, count) of the last `n` entries recorded under `id`.
fn measured(samples: &Samples, id: &str, n: usize) -> Option<(f64, f64, usize)> {
    let s = samples.borrow();
    let v = s.get(id)?;
    let tail = &v[v.len().saturating_sub(n)..];
    Some((support::median(tail), tail.iter().copied().fold(f64::INFINITY, f64::min), tail.len()))
}

fn main() {
    let threads = support::gemm_use_all_cores();
    let mut c =
        Criterion::default().sample_size(SAMPLES).warm_up_time(WARM_UP).measurement_time(MEASURE).configure_from_args();
    let samples: Samples = RefCell::new(BTreeMap::new());

    // The reference rate: matrixmultiply's sgemm on all cores.
    let mut gemm_group = c.benchmark_group("gemm_f32");
    gemm_group.sampling_mode(SamplingMode::Flat);
    let mut gemm_ids = Vec::new();
    for (m, n, k) in GEMM_SHAPES {
        let mut g = Gemm::new(m, n, k);
        let id = format!("sgemm_{}", g.id());
        gemm_group.throughput(Throughput::Elements(g.flops()));
        gemm_group.bench_function(&id, |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    g.run();
                }
                let e = t.elapsed();
                record(&samples, &id, e, iters);
                e
            })
        });
        gemm_ids.push((id, g.flops()));
    }
    gemm_group.finish();
    let gemm_rates: Vec<(String, f64)> = gemm_ids
        .iter()
        .filter_map(|(id, f)| {
            measured(&samples, id, SAMPLES).map(|(ms, _, _)| (id.clone(), flops::flops_per_second(*f, ms)))
        })
        .collect();
    let best_gemm = gemm_rates.iter().map(|x| x.1).fold(f64::NAN, f64::max);
    // The bandwidth ceiling, measured once (a copy is far below every case's intensity anyway).
    let roof = support::cpu_roofline(best_gemm, "best of the GEMM group");
    let mut adj = Gemm::new(ADJ_SHAPE.0, ADJ_SHAPE.1, ADJ_SHAPE.2);

    let mut records = Vec::new();
    let mut group = c.benchmark_group("attention_cpu");
    group.sampling_mode(SamplingMode::Flat);
    for case in cases() {
        let (q, k, v) = case.inputs(1);
        let opts = ForwardOptions::default().mask(case.mask).backend(Backend::Cpu);
        let p = case.problem(&q, &k, &v, &opts);
        let cost = flops::cost(&p);
        let id = case.id();
        let adj_id = format!("{id}/adjacent_gemm");
        let cpu: RefCell<Vec<CpuEntry>> = RefCell::new(Vec::new());
        let mut first: Option<Output> = None;
        let mut last_sample_ms = 100.0;
        group.throughput(Throughput::Elements(cost.flops));
        group.bench_function(&id, |b| {
            b.iter_custom(|iters| {
                let (c0, r0) = (cpu_now(), adj.runs_done);
                let rate = adj.rate_for(GEMM_MATCH * last_sample_ms);
                cpu.borrow_mut().push(CpuEntry::Gemm { secs: cpu_now() - c0, runs: adj.runs_done - r0 });
                let per_gemm = Duration::from_secs_f64(adj.flops() as f64 / rate);
                record(&samples, &adj_id, per_gemm, 1);
                let c0 = cpu_now();
                let t = Instant::now();
                for _ in 0..iters {
                    let out = forward(&q, &k, &v, &opts).expect("CPU forward runs");
                    if first.is_none() {
                        first = Some(out);
                    }
                }
                let e = t.elapsed();
                cpu.borrow_mut().push(CpuEntry::Attention { secs: cpu_now() - c0, runs: iters });
                last_sample_ms = e.as_secs_f64() * 1e3;
                record(&samples, &id, e, iters);
                e
            })
        });
        let (Some((ms, ms_min, runs)), Some(out)) = (measured(&samples, &id, SAMPLES), first) else {
            continue; // filtered out on the command line
        };
        let (g_ms, g_min, _) = measured(&samples, &adj_id, SAMPLES).expect("recorded with the case");
        let paired = {
            let s = samples.borrow();
            let tail = |v: &Vec<f64>| v[v.len().saturating_sub(SAMPLES)..].to_vec();
            let g: Vec<f64> = tail(&s[&adj_id]).iter().map(|ms| flops::flops_per_second(adj.flops(), *ms)).collect();
            let a: Vec<f64> = tail(&s[&id]).iter().map(|ms| flops::flops_per_second(cost.flops, *ms)).collect();
            support::paired_ratio(&g, &a)
        };
        // Work per CPU-second × threads over the measured samples (the last SAMPLES of each kind).
        let cpu_time_rates = {
            let entries = cpu.borrow();
            let (mut a_s, mut a_f, mut g_s, mut g_f, mut na, mut ng) = (0.0, 0.0, 0.0, 0.0, 0, 0);
            for e in entries.iter().rev() {
                match *e {
                    CpuEntry::Attention { secs, runs } if na < SAMPLES => {
                        a_s += secs;
                        a_f += (runs * cost.flops) as f64;
                        na += 1;
                    }
                    CpuEntry::Gemm { secs, runs } if ng < SAMPLES => {
                        g_s += secs;
                        g_f += (runs * adj.flops()) as f64;
                        ng += 1;
                    }
                    _ => {}
                }
            }
            let t = threads as f64;
            // Only with enough CPU time for the 10 ms tick of /proc/self/stat to be negligible.
            (a_s > 0.5 && g_s > 0.5 && a_s.is_finite() && g_s.is_finite()).then(|| (a_f * t / a_s, g_f * t / g_s))
        };
        let (gemm, gemm_best) =
            (flops::flops_per_second(adj.flops(), g_ms), flops::flops_per_second(adj.flops(), g_min));
        let mut case_roof = roof.clone();
        case_roof.peak_flops = gemm;
        case_roof.peak_source = format!(
            "matrixmultiply sgemm {}x{}x{} on all cores, interleaved with this case's samples (median)",
            ADJ_SHAPE.0, ADJ_SHAPE.1, ADJ_SHAPE.2
        );
        let err = support::sampled_max_error(&p, &q, &k, &v, &out, ERR_ROWS, 7);
        records.push(Record {
            impl_name: "flash_attn".into(),
            machine: flash_attn::bench::roofline::cpu_name(),
            backend: out.dispatch.backend.clone(),
            kernel: out.dispatch.kernel.clone(),
            variant: "auto".into(),
            case,
            precision: "native".into(),
            cost,
            ms,
            ms_min: Some(ms_min),
            runs,
            roofline: Some(case_roof),
            max_err: Some(err),
            err_rows: ERR_ROWS,
            gemm_flops: Some(gemm),
            gemm_flops_best: Some(gemm_best),
            gemm_ratio_paired: Some(paired),
            cpu_time_rates,
        });
    }
    group.finish();
    let decode = decode_group(&mut c, &samples);
    let fp8 = fp8_decode_group(&mut c, &samples);
    c.final_summary();

    summary(threads, &gemm_rates, &roof, &records);
    decode_summary(&decode);
    fp8_decode_summary(&fp8);
}

/// One decode step (batch 8, 32 query heads on 8 kv heads, head_dim 128, 4096 cached keys, f16
/// queries) over an f16 cache and over FP8 caches of the same values (filled by `append_kv`,
/// which quantises): (id, K/V bytes read, median ms, best ms).
fn fp8_decode_group(c: &mut Criterion, samples: &Samples) -> Vec<(String, u64, f64, f64)> {
    use flash_attn::numerics::quant::{block_scale, finite_amax};
    use flash_attn::serving::{append_kv, forward_kvcache, Fp8KvCache, Fp8KvCacheMut, KvCache, KvScales, KvScalesMut};
    let (batch, sk, hq, hkv, d) = (8, 4096, 32, 8, 128);
    let shape = [batch, sk, hkv, d];
    let n = batch * sk * hkv * d;
    let mut rng = flash_attn::numerics::rng::SplitMix64::new(9);
    let mut randn = |n: usize| (0..n).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
    let (k, v, q) = (randn(n), randn(n), randn(batch * hq * d));
    let tensor = |x: &[f32], dt: DType, s: [usize; 4]| flash_attn::Tensor::from_f32(x, dt, s).expect("consistent shape");
    let (k16, v16, q16) = (tensor(&k, DType::F16, shape), tensor(&v, DType::F16, shape), tensor(&q, DType::F16, [batch, 1, hq, d]));
    let (kt, vt) = (tensor(&k, DType::F32, shape), tensor(&v, DType::F32, shape));
    let seqlens = vec![sk as i32; batch];
    let no_keys = vec![0i32; batch];
    let (ts_k, ts_v) = (block_scale(finite_amax(&k)), block_scale(finite_amax(&v)));
    // Per-tensor and per-(token, head) FP8 caches of the same values.
    let (mut kc1, mut vc1, mut kc2, mut vc2) = (vec![0u8; n], vec![0u8; n], vec![0u8; n], vec![0u8; n]);
    let (mut ks, mut vs) = (vec![0f32; n / d], vec![0f32; n / d]);
    let fill = |k: &mut [u8], v: &mut [u8], scales: KvScalesMut<'_>| {
        let mut cache = Fp8KvCacheMut { k, v, shape, scales, seqlens: &no_keys, block_table: None };
        append_kv(&mut cache, &kt, &vt).expect("the FP8 cache takes the rows");
    };
    fill(&mut kc1, &mut vc1, KvScalesMut::PerTensor { k: ts_k, v: ts_v });
    fill(&mut kc2, &mut vc2, KvScalesMut::PerTokenHead { k: &mut ks, v: &mut vs });
    let caches: [(&str, u64); 3] = [
        ("f16_cache", 2 * 2 * n as u64),
        ("fp8_per_tensor", 2 * n as u64),
        ("fp8_per_token_head", 2 * (n + 4 * n / d) as u64),
    ];
    let opts = ForwardOptions::default().backend(Backend::Cpu);
    let mut out = Vec::new();
    let mut group = c.benchmark_group("decode_fp8_cpu");
    group.sampling_mode(SamplingMode::Flat);
    for (name, bytes) in caches {
        let id = format!("b{batch}_sk{sk}_hq{hq}_hkv{hkv}_d{d}_{name}");
        group.throughput(Throughput::Bytes(bytes));
        group.bench_function(&id, |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    let o = match name {
                        "f16_cache" => forward_kvcache(&q16, &KvCache::dense(k16.view(), v16.view(), &seqlens), &opts),
                        "fp8_per_tensor" => {
                            let scales = KvScales::PerTensor { k: ts_k, v: ts_v };
                            let cache = Fp8KvCache { k: &kc1, v: &vc1, shape, scales, seqlens: &seqlens, block_table: None };
                            forward_kvcache(&q16, &cache, &opts)
                        }
                        _ => {
                            let scales = KvScales::PerTokenHead { k: &ks, v: &vs };
                            let cache = Fp8KvCache { k: &kc2, v: &vc2, shape, scales, seqlens: &seqlens, block_table: None };
                            forward_kvcache(&q16, &cache, &opts)
                        }
                    };
                    std::hint::black_box(o.expect("CPU decode runs"));
                }
                let e = t.elapsed();
                record(samples, &id, e, iters);
                e
            })
        });
        if let Some((ms, ms_min, _)) = measured(samples, &id, SAMPLES) {
            out.push((id, bytes, ms, ms_min));
        }
    }
    group.finish();
    out
}

fn fp8_decode_summary(recs: &[(String, u64, f64, f64)]) {
    let Some(base) = recs.iter().find(|r| r.0.ends_with("f16_cache")).map(|r| r.2) else {
        return;
    };
    println!("\n## CPU decode over an FP8 KV cache beside an f16 cache (median and best of the last {SAMPLES} samples)");
    println!("\n| case | ms (median) | ms (best) | K/V GB/s median | time / f16 cache's |");
    println!("|---|---:|---:|---:|---:|");
    for (id, bytes, ms, best) in recs {
        let gbs = *bytes as f64 / (ms * 1e-3) / 1e9;
        println!("| {id} | {ms:.3} | {best:.3} | {gbs:.1} | {:.2} |", ms / base);
    }
}

/// Decode shapes: one query row per sequence against a long cache, dense (`forward`) or paged
/// with `page_size`-key blocks (`serving::forward_kvcache`). The first is the figure of the CPU
/// speed issue: 4096 keys, 32 query heads on 8 kv heads, head_dim 128, f32.
fn decode_cases() -> Vec<(Case, Option<usize>)> {
    let dec = |batch, seqlen_k, heads_q, heads_kv, dtype| Case {
        batch,
        seqlen_q: 1,
        seqlen_k,
        heads_q,
        heads_kv,
        head_dim: 128,
        dtype,
        mask: Mask::None,
    };
    vec![
        (dec(1, 4096, 32, 8, DType::F32), None),
        (dec(1, 4096, 32, 8, DType::F32), Some(16)),
        (dec(1, 4096, 32, 8, DType::F32), Some(256)),
        (dec(1, 4096, 32, 8, DType::BF16), None),
        (dec(1, 4096, 32, 8, DType::BF16), Some(16)),
        (dec(1, 4096, 32, 32, DType::F32), None),
        (dec(8, 2048, 32, 8, DType::BF16), Some(16)),
        (dec(1, 32768, 32, 8, DType::BF16), Some(256)),
        // One kv head: the split-KV path spreads its keys over the workers.
        (dec(1, 16384, 8, 1, DType::F32), None),
    ]
}

/// One measured decode case: (case, page size, median ms, best ms, kernel and reason, max err).
type DecodeRecord = (Case, Option<usize>, f64, f64, String, f64);

fn decode_group(c: &mut Criterion, samples: &Samples) -> Vec<DecodeRecord> {
    let mut out = Vec::new();
    let mut group = c.benchmark_group("decode_cpu");
    group.sampling_mode(SamplingMode::Flat);
    for (case, page) in decode_cases() {
        let (q, k, v) = case.inputs(1);
        let opts = ForwardOptions::default().backend(Backend::Cpu);
        let p = case.problem(&q, &k, &v, &opts);
        let paged = page.map(|ps| support::PagedKv::new(&k, &v, ps, 7));
        let id = format!("{}_{}", case.id(), page.map_or("dense".to_string(), |ps| format!("page{ps}")));
        let mut first: Option<Output> = None;
        group.throughput(Throughput::Bytes(support::kv_bytes(&case)));
        group.bench_function(&id, |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    let o = match &paged {
                        Some(pk) => flash_attn::serving::forward_kvcache(&q, &pk.cache(), &opts),
                        None => forward(&q, &k, &v, &opts),
                    };
                    first.get_or_insert(o.expect("CPU decode runs"));
                }
                let e = t.elapsed();
                record(samples, &id, e, iters);
                e
            })
        });
        let (Some((ms, ms_min, _)), Some(o)) = (measured(samples, &id, SAMPLES), first) else {
            continue; // filtered out on the command line
        };
        let err = support::sampled_max_error(&p, &q, &k, &v, &o, ERR_ROWS, 7);
        let what = format!("{} ({})", o.dispatch.kernel, o.dispatch.reason);
        out.push((case, page, ms, ms_min, what, err));
    }
    group.finish();
    out
}

fn decode_summary(recs: &[DecodeRecord]) {
    if recs.is_empty() {
        return;
    }
    println!("\n## CPU decode: K/V bytes read per second (median and best of the last {SAMPLES} samples)");
    println!("\n| case | K/V layout | ms (median) | K/V GB/s median | K/V GB/s best | max err |");
    println!("|---|---|---:|---:|---:|---:|");
    let mut lines = Vec::new();
    for (case, page, ms, best, what, err) in recs {
        let gbs = |t: f64| support::kv_bytes(case) as f64 / (t * 1e-3) / 1e9;
        let layout = page.map_or("dense".to_string(), |ps| format!("paged, {ps}-key blocks"));
        println!("| {} | {layout} | {ms:.3} | {:.1} | {:.1} | {err:.1e} |", case.id(), gbs(*ms), gbs(*best));
        lines.push(
            serde_json::json!({
                "impl": "flash_attn",
                "case": case.id(),
                "kv_layout": layout,
                "ms": ms,
                "ms_min": best,
                "kv_gbs": gbs(*ms),
                "kv_gbs_best": gbs(*best),
                "max_err": err,
                "kernel": what,
            })
            .to_string(),
        );
    }
    let path = std::env::var("FA_BENCH_DECODE_JSON").unwrap_or_else(|_| "target/bench/cpu-decode.jsonl".into());
    let write = || -> std::io::Result<()> {
        if let Some(dir) = std::path::Path::new(&path).parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&path, lines.join("\n") + "\n")
    };
    match write() {
        Ok(()) => println!("\nJSON lines: {path}"),
        Err(e) => eprintln!("could not write {path}: {e}"),
    }
}

fn summary(threads: usize, gemm_rates: &[(String, f64)], roof: &flash_attn::bench::roofline::Roofline, records: &[Record]) {
    if records.is_empty() && gemm_rates.is_empty() {
        return;
    }
    println!("\n## CPU summary: {}, {threads} threads; median and best of the last {SAMPLES} samples", roof.machine);
    for (id, r) in gemm_rates {
        println!("GEMM {id}: {:.1} GFLOP/s (median)", r / 1e9);
    }
    println!("copy bandwidth: {:.1} GB/s (read + write)", roof.bandwidth / 1e9);
    println!(
        "\n| case | ms (median) | GFLOP/s median | GFLOP/s best | GEMM {}x{}x{} median / best | ratio median | ratio best | ratio paired | per CPU-s: attn / GEMM / ratio | max err |",
        ADJ_SHAPE.0, ADJ_SHAPE.1, ADJ_SHAPE.2
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for rec in records {
        let rate = rec.flops_per_s();
        let best = rec.ms_min.map_or(f64::NAN, |m| flops::flops_per_second(rec.cost.flops, m));
        let (g, gb) = (rec.gemm_flops.unwrap_or(f64::NAN), rec.gemm_flops_best.unwrap_or(f64::NAN));
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} / {:.1} | {:.2} | {:.2} | {:.2} | {} | {:.1e} |",
            rec.case.id(),
            rec.ms,
            rate / 1e9,
            best / 1e9,
            g / 1e9,
            gb / 1e9,
            rate / g,
            best / gb,
            rec.gemm_ratio_paired.unwrap_or(f64::NAN),
            rec.cpu_time_rates.map_or("-".into(), |(a, g)| format!("{:.1} / {:.1} / {:.2}", a / 1e9, g / 1e9, a / g)),
            rec.max_err.unwrap_or(f64::NAN)
        );
    }
    if let Some(rec) = records.first() {
        println!("kernel: {} ({})", rec.kernel, rec.backend);
    }
    let path = std::env::var("FA_BENCH_JSON").unwrap_or_else(|_| "target/bench/cpu.jsonl".into());
    let write = || -> std::io::Result<()> {
        if let Some(dir) = std::path::Path::new(&path).parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::fs::File::create(&path)?;
        for rec in records {
            writeln!(f, "{}", rec.json())?;
        }
        Ok(())
    };
    match write() {
        Ok(()) => println!("\nJSON lines: {path} (scripts/bench/report.py turns them into a table and a roofline plot)"),
        Err(e) => eprintln!("could not write {path}: {e}"),
    }
}

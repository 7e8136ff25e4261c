//! The CPU backward on one shape, one JSON line: `cargo run --release --example bench_backward
//! --features bench -- [options]` (scripts/bench/cpu-peers.sh `--backward` runs it beside the peers).
//!
//! ```text
//! --dtype f32|f16|bf16 (f32)   --batch B (1)  --heads H (8)  --heads-kv HKV (H)  --head-dim D (128)
//! --seqlen-q S --seqlen-k S (2048)   --causal   --threads N (all)
//! --warmup N (1)  --runs N (5)  --max-seconds T (10: stop after 3 runs past T)
//! ```
//! Times `backward_into` (gradient buffers reused across calls) after one forward for `o` and
//! the LSE, and prints `{"ms": median, "min_ms", "gflops", "kernel", "runs"}` on stdout, FLOPs
//! = 2.5 × the forward's (FlashAttention's convention, `flash_attn::bench::flops`, causal
//! counting visible pairs only).
//!
//! Only the timing: the gradients' accuracy is what tests/cpu/backward_props.rs checks.

use flash_attn::{backward_into, forward, DType, ForwardOptions, Mask, OwnedData, Tensor};
use std::time::Instant;

fn main() {
    if let Err(e) = run() {
        eprintln!("bench_backward: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let (mut dtype, mut b, mut h, mut hkv, mut d, mut sq, mut sk) = (DType::F32, 1usize, 8usize, None, 128usize, 2048usize, 2048usize);
    let (mut causal, mut threads, mut warmup, mut runs, mut max_s) = (false, None, 1usize, 5usize, 10.0f64);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--causal" {
            causal = true;
            continue;
        }
        if flag == "--bench" {
            continue;
        }
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let n = || v.parse::<usize>().map_err(|_| format!("{flag}: not a number: {v}"));
        match flag.as_str() {
            "--dtype" => {
                dtype = match v.as_str() {
                    "f32" => DType::F32,
                    "f16" => DType::F16,
                    "bf16" => DType::BF16,
                    _ => return Err(format!("--dtype: unknown {v}")),
                }
            }
            "--batch" => b = n()?,
            "--heads" => h = n()?,
            "--heads-kv" => hkv = Some(n()?),
            "--head-dim" => d = n()?,
            "--seqlen-q" => sq = n()?,
            "--seqlen-k" => sk = n()?,
            "--seqlen" => (sq, sk) = (n()?, n()?),
            "--threads" => threads = Some(n()?),
            "--warmup" => warmup = n()?,
            "--runs" => runs = n()?.max(1),
            "--max-seconds" => max_s = v.parse().map_err(|_| format!("{flag}: not a number: {v}"))?,
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    let hkv = hkv.unwrap_or(h);
    let mut rng = flash_attn::numerics::rng::SplitMix64::new(1);
    let mut randn = |shape: [usize; 4]| {
        let v: Vec<f32> = (0..shape.iter().product::<usize>()).map(|_| rng.normal() as f32).collect();
        Tensor::from_f32(&v, dtype, shape).map_err(|e| e.to_string())
    };
    let (q, k, v, d_o) = (randn([b, sq, h, d])?, randn([b, sk, hkv, d])?, randn([b, sk, hkv, d])?, randn([b, sq, h, d])?);
    let mut opts = ForwardOptions::default().mask(if causal { Mask::Causal } else { Mask::None }).return_lse(true);
    if let Some(t) = threads {
        opts = opts.cpu_threads(t);
    }
    let out = forward(&q, &k, &v, &opts).map_err(|e| e.to_string())?;
    let lse = out.lse.clone().unwrap_or_default();
    let zeros = |n: usize| OwnedData::zeros(dtype, n).map_err(|e| e.to_string());
    let (mut dq, mut dk, mut dv) = (zeros(q.numel())?, zeros(k.numel())?, zeros(k.numel())?);
    let mut call = || -> Result<String, String> {
        let r = match (dq.as_data_mut(), dk.as_data_mut(), dv.as_data_mut()) {
            (flash_attn::DataMut::F32(a), flash_attn::DataMut::F32(bb), flash_attn::DataMut::F32(c)) => backward_into(&q, &k, &v, &out.o, &d_o, &lse, (a, bb, c), &opts),
            (flash_attn::DataMut::F16(a), flash_attn::DataMut::F16(bb), flash_attn::DataMut::F16(c)) => backward_into(&q, &k, &v, &out.o, &d_o, &lse, (a, bb, c), &opts),
            (flash_attn::DataMut::BF16(a), flash_attn::DataMut::BF16(bb), flash_attn::DataMut::BF16(c)) => backward_into(&q, &k, &v, &out.o, &d_o, &lse, (a, bb, c), &opts),
            _ => return Err("mixed gradient dtypes".into()),
        };
        r.map(|disp| disp.kernel).map_err(|e| e.to_string())
    };
    let mut kernel = String::new();
    for _ in 0..warmup {
        kernel = call()?;
    }
    let (mut times, t0) = (Vec::new(), Instant::now());
    while times.len() < runs && !(times.len() >= 3 && t0.elapsed().as_secs_f64() > max_s) {
        let t = Instant::now();
        kernel = call()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let ms = times[times.len() / 2];
    let p = flash_attn::Problem::new(&q.view(), &k.view(), &v.view(), &opts).map_err(|e| e.to_string())?;
    let fwd = flash_attn::bench::flops::flops(&p) as f64;
    println!(
        "{{\"ms\": {ms:.3}, \"min_ms\": {:.3}, \"gflops\": {:.2}, \"kernel\": \"{kernel}\", \"runs\": {}}}",
        times[0],
        2.5 * fwd / ms / 1e6,
        times.len()
    );
    Ok(())
}

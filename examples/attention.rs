//! The main job: attention on a realistic shape, on the GPU when there is one and on the CPU
//! otherwise; prints the backend, kernel, time, throughput (TFLOP/s on a GPU, GFLOP/s on the
//! CPU), max error against the float64 reference, and why that backend and kernel were chosen.
//!
//! `cargo run --release --example attention [-- --batch 1 --heads 8 --seqlen 2048 --head-dim 128 --causal --dtype f32]`
//!
//! The dtype defaults to bf16 when a CUDA GPU is present (the GPU kernels take f16/bf16) and to
//! f32 otherwise.

use flash_attn::reference::{attention_f64, max_abs_diff};
use flash_attn::{forward, DType, ForwardOptions, Mask, Problem, Tensor};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    #[cfg(feature = "cuda")]
    let gpu = flash_attn::cuda::device_count() > 0;
    #[cfg(not(feature = "cuda"))]
    let gpu = false;
    let default_dtype = if gpu { DType::BF16 } else { DType::F32 };
    let (mut b, mut h, mut s, mut d, mut causal, mut dtype, mut iters) = (1, 8, 2048, 128, false, default_dtype, 5);
    while let Some(a) = args.next() {
        let mut num = || -> Result<usize, Box<dyn std::error::Error>> {
            Ok(args.next().ok_or("missing value")?.parse()?)
        };
        match a.as_str() {
            "--batch" => b = num()?,
            "--heads" => h = num()?,
            "--seqlen" => s = num()?,
            "--head-dim" => d = num()?,
            "--iters" => iters = num()?,
            "--causal" => causal = true,
            "--dtype" => dtype = args.next().ok_or("--dtype needs f32, f16 or bf16")?.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let shape = [b, s, h, d];
    let n = b * s * h * d;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut gen = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let mk = |g: &mut dyn FnMut() -> f32| Tensor::from_f32(&(0..n).map(|_| g()).collect::<Vec<_>>(), dtype, shape);
    let (q, k, v) = (mk(&mut gen)?, mk(&mut gen)?, mk(&mut gen)?);
    let opts = ForwardOptions::default().mask(if causal { Mask::Causal } else { Mask::None });

    let mut out = forward(&q, &k, &v, &opts)?; // warm-up
    let mut times = Vec::new();
    for _ in 0..iters {
        let t = Instant::now();
        out = forward(&q, &k, &v, &opts)?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let p = Problem::new(&q.view(), &k.view(), &v.view(), &opts)?;
    let flops = 4.0 * p.visible_pairs() as f64 * d as f64;
    let r = attention_f64(&p, &q.view(), &k.view(), &v.view())?;
    let ours: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
    // A CPU does tens to hundreds of GFLOP/s; "TFLOP/s=0.0478" would hide the digits that matter.
    let rate = if out.dispatch.backend == "cpu" {
        format!("GFLOP/s={:.1}", flops / med / 1e9)
    } else {
        format!("TFLOP/s={:.1}", flops / med / 1e12)
    };
    println!(
        "backend={} kernel={} shape=[{b},{s},{h},{d}] dtype={dtype} causal={causal} median_ms={:.3} {rate} max_err={:.3e}",
        out.dispatch.backend,
        out.dispatch.kernel,
        med * 1e3,
        max_abs_diff(&ours, &r.o)
    );
    println!("why: {}", if out.dispatch.reason.is_empty() { "-" } else { &out.dispatch.reason });
    Ok(())
}

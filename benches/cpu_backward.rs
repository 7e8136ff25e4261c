//! The CPU backward (`flash_attn::backward_into`) on the shapes of the peers table: `cargo bench
//! --bench cpu_backward --features bench`. Throughput in elements/s where one element is one
//! FLOP (so "Gelem/s" reads GFLOP/s), 2.5 × the forward's FLOPs (FlashAttention's convention:
//! five products against two), causal counting visible pairs only. The side-by-side with torch
//! and jax is `scripts/bench/cpu-peers.sh --backward` (docs/benchmarks.md).

use criterion::{Criterion, SamplingMode, Throughput};
use flash_attn::{backward_into, forward, DType, ForwardOptions, Mask, Problem, Tensor};
use std::time::Duration;

fn main() {
    let mut c = Criterion::default().configure_from_args().sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));
    let mut g = c.benchmark_group("backward_cpu");
    g.sampling_mode(SamplingMode::Flat);
    // (batch, heads, seqlen, head_dim, causal)
    for (b, h, s, d, causal) in [(1, 8, 2048, 128, false), (1, 8, 2048, 128, true), (4, 8, 512, 64, false)] {
        let mut rng = flash_attn::numerics::rng::SplitMix64::new(1);
        let mut randn = |shape: [usize; 4]| {
            let v: Vec<f32> = (0..shape.iter().product::<usize>()).map(|_| rng.normal() as f32).collect();
            Tensor::from_f32(&v, DType::F32, shape).expect("tensor")
        };
        let (q, k, v, d_o) = (randn([b, s, h, d]), randn([b, s, h, d]), randn([b, s, h, d]), randn([b, s, h, d]));
        let opts = ForwardOptions::default().mask(if causal { Mask::Causal } else { Mask::None }).return_lse(true);
        let out = forward(&q, &k, &v, &opts).expect("forward");
        let lse = out.lse.clone().expect("lse");
        let p = Problem::new(&q.view(), &k.view(), &v.view(), &opts).expect("problem");
        g.throughput(Throughput::Elements((2.5 * flash_attn::bench::flops::flops(&p) as f64) as u64));
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; q.numel()], vec![0.0f32; k.numel()], vec![0.0f32; k.numel()]);
        let id = format!("{b}x{h}x{s}x{s}x{d}{}", if causal { "-causal" } else { "" });
        g.bench_function(id, |bench| {
            bench.iter(|| backward_into(&q, &k, &v, &out.o, &d_o, &lse, (&mut dq, &mut dk, &mut dv), &opts).expect("backward"))
        });
    }
    g.finish();
    c.final_summary();
}

//! FlashAttention-3's accuracy claim on our CPU FP8 emulation: on inputs with rare large outliers
//! (`N(0,1) + N(0,100)·Bernoulli(0.001)`, the paper's §4.3), FA3's method (block quantisation
//! plus the Hadamard rotation, in our tiled kernel) beats the straightforward FP8 baseline by more
//! than 1.7x, and beats our own tiled kernel with per-tensor scales clearly (the ablation).
//! `cargo run --release --example fp8_accuracy` prints the full table.

use flash_attn::bench::fp8_baseline::{attention_naive_fp8, attention_naive_fp8_p_scaled, tiled_fp8_with_p_scale};
use flash_attn::numerics::hadamard::Rotation;
use flash_attn::numerics::quant::quantize_e4m3;
use flash_attn::numerics::rng::{fa3_outlier_values, SplitMix64};
use flash_attn::numerics::FP8_P_SCALE_LOG2;
use flash_attn::reference::{attention_f64, rmse};
use flash_attn::{forward, Backend, DType, Fp8Scaling, ForwardOptions, Precision, Problem, Tensor};

/// The example's table shape (`examples/fp8_accuracy.rs`, chosen before the naive baseline
/// existed) and its seed.
const TABLE_SHAPE: [usize; 4] = [1, 1024, 4, 128];
const TABLE_SEED: u64 = 0;

/// Small enough for the test profile: the f64 reference is 4 heads × 256² × 64.
const SHAPE: [usize; 4] = [1, 256, 4, 64];
const SEEDS: std::ops::Range<u64> = 0..4;
const HADAMARD_SEED: u64 = 0x5EED;

struct Case {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    reference: Vec<f64>,
}

fn case(seed: u64) -> Case {
    case_of(SHAPE, seed)
}

fn case_of(shape: [usize; 4], seed: u64) -> Case {
    let n: usize = shape.iter().product();
    let mut g = SplitMix64::new(seed);
    let mut mk = || Tensor::from_f32(&fa3_outlier_values(&mut g, n), DType::F16, shape).unwrap();
    let (q, k, v) = (mk(), mk(), mk());
    let p = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default()).unwrap();
    let reference = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap().o;
    Case { q, k, v, reference }
}

/// Mean squared error of `precision` over the seeds (RMSE² averaged, so one seed's outliers do
/// not decide alone).
fn mse(cases: &[Case], precision: Precision) -> f64 {
    let opts = ForwardOptions::default().backend(Backend::Cpu).precision(precision);
    cases
        .iter()
        .map(|c| {
            let out = forward(&c.q, &c.k, &c.v, &opts).unwrap();
            let o: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
            rmse(&o, &c.reference).powi(2)
        })
        .sum::<f64>()
        / cases.len() as f64
}

/// The ablation inside our tiled kernel (P x 2^8 in both rows): what block scales and Hadamard add
/// over per-tensor scales. Measured on these inputs (4 seeds): per-tensor 2.02e-2, per-block
/// 1.63e-2, Hadamard only 1.32e-2, per-block + Hadamard 1.38e-2, a 1.47x gain (1.44x-1.76x on
/// single draws of other shapes; see docs/fp8.md). FA3's 2.6x is against a naive FP8 baseline,
/// asserted by `fa3_method_beats_the_naive_fp8_baseline`. The bound leaves room for rounding
/// changes, not for losing the effect.
#[test]
fn block_scales_plus_hadamard_beat_per_tensor() {
    let cases: Vec<Case> = SEEDS.map(case).collect();
    let per_tensor = mse(&cases, Precision::Fp8 { scaling: Fp8Scaling::PerTensor, hadamard: None }).sqrt();
    let block = Fp8Scaling::PerBlock { rows: 64 };
    let had_only = mse(&cases, Precision::Fp8 { scaling: Fp8Scaling::PerTensor, hadamard: Some(HADAMARD_SEED) }).sqrt();
    let both = mse(&cases, Precision::Fp8 { scaling: block, hadamard: Some(HADAMARD_SEED) }).sqrt();
    println!("RMSE per-tensor {per_tensor:.3e}, Hadamard only {had_only:.3e}, per-block + Hadamard {both:.3e}");
    assert!(per_tensor / both >= 1.35, "per-block + Hadamard gains only {:.2}x", per_tensor / both);
    assert!(per_tensor / had_only >= 1.35, "Hadamard alone gains only {:.2}x", per_tensor / had_only);
    // FP8 stays a few percent of the output scale (|o| <~ 1): the emulation is not broken.
    assert!(per_tensor < 0.05 && both < 0.02, "{per_tensor} {both}");
}

/// The part Hadamard acts on: the error from quantising Q and K alone (V and P exact), where the
/// rotation's effect is largest (measured 1.6x over these seeds).
#[test]
fn hadamard_cuts_the_qk_quantisation_error() {
    let rot = Rotation::new(SHAPE[3], HADAMARD_SEED).unwrap();
    let (mut plain, mut rotated) = (0.0, 0.0);
    for seed in SEEDS {
        let c = case(seed);
        let p = Problem::new(&c.q.view(), &c.k.view(), &c.v.view(), &ForwardOptions::default()).unwrap();
        let fq = |t: &Tensor, hadamard: bool| {
            let mut x = t.to_f32_vec();
            if hadamard {
                rot.apply_rows(&mut x);
            }
            Tensor::from_vec(quantize_e4m3(&x, SHAPE, SHAPE[1]).unwrap().dequantize().unwrap(), SHAPE).unwrap()
        };
        let err = |hadamard: bool| {
            let (q8, k8) = (fq(&c.q, hadamard), fq(&c.k, hadamard));
            rmse(&attention_f64(&p, &q8.view(), &k8.view(), &c.v.view()).unwrap().o, &c.reference).powi(2)
        };
        plain += err(false);
        rotated += err(true);
    }
    let gain = (plain / rotated).sqrt();
    println!("Q/K quantisation only: Hadamard gain {gain:.2}x");
    assert!(gain >= 1.45, "Hadamard gain on the Q/K error only {gain:.2}x");
}

/// FA3's Table 3 claim against its own kind of baseline: a straightforward FP8 attention
/// ("per-tensor scale, FP32 accumulator, softmax in FP16"; our reading in
/// `bench::fp8_baseline::attention_naive_fp8`, which casts the normalised P to e4m3 as it is).
///
/// Measured on the example's shape and seed: naive baseline 2.24e-2 (paper 2.4e-2), FA3's method
/// 8.79e-3 (paper 9.1e-3), a 2.55x gain (paper 2.6x); seeds 1-3 give 3.02x, 2.67x, 2.65x. The gain
/// shrinks with seqlen_k (1/seqlen_k is the typical normalised probability, so fewer of them fall
/// into e4m3's subnormals): [1, 256, 4, 64] gives 1.5x-1.8x, which is why this test runs the
/// table's shape. The mechanism is asserted too: scaling the naive baseline's P by 2^8 recovers
/// most of the gap to our tiled per-tensor kernel (1.58x), while our tiled kernel does not need
/// the 2^8 here (unnormalised P = exp(s - m) mostly sits above the subnormals: 1.40e-2 vs 1.39e-2).
#[test]
fn fa3_method_beats_the_naive_fp8_baseline() {
    let c = case_of(TABLE_SHAPE, TABLE_SEED);
    let (q, k, v) = (c.q.view(), c.k.view(), c.v.view());
    let err = |o: &[f64]| rmse(o, &c.reference);
    let fp8 = |scaling, hadamard| {
        let opts = ForwardOptions::default().backend(Backend::Cpu).precision(Precision::Fp8 { scaling, hadamard });
        let o = forward(&c.q, &c.k, &c.v, &opts).unwrap();
        err(&o.o.to_f32_vec().iter().map(|&x| x as f64).collect::<Vec<_>>())
    };
    let pt = Problem::new(
        &q,
        &k,
        &v,
        &ForwardOptions::default().precision(Precision::Fp8 { scaling: Fp8Scaling::PerTensor, hadamard: None }),
    )
    .unwrap();
    let naive = err(&attention_naive_fp8(&pt, &q, &k, &v, Fp8Scaling::PerTensor).unwrap());
    let naive_p8 = err(&attention_naive_fp8_p_scaled(&pt, &q, &k, &v, Fp8Scaling::PerTensor, FP8_P_SCALE_LOG2).unwrap());
    let tiled = fp8(Fp8Scaling::PerTensor, None);
    let tiled_p1 = err(&tiled_fp8_with_p_scale(&pt, &q, &k, &v, 0.0).unwrap());
    let fa3 = fp8(Fp8Scaling::PerBlock { rows: 64 }, Some(HADAMARD_SEED));
    println!(
        "RMSE naive FP8 {naive:.3e} (P x 2^8: {naive_p8:.3e}), tiled per-tensor {tiled:.3e} (P unscaled: {tiled_p1:.3e}), \
         FA3 method {fa3:.3e}: {:.2}x over naive, {:.2}x over tiled per-tensor",
        naive / fa3,
        tiled / fa3
    );
    assert!(naive / fa3 >= 1.7, "FA3's method gains only {:.2}x over the naive FP8 baseline", naive / fa3);
    assert!(tiled / fa3 >= 1.35, "FA3's method gains only {:.2}x over our tiled per-tensor kernel", tiled / fa3);
    // Where the baseline loses: the normalised P in e4m3, not the scales or the softmax precision.
    assert!(naive / naive_p8 >= 1.3, "P x 2^8 helps the naive baseline only {:.2}x", naive / naive_p8);
    assert!((tiled_p1 / tiled - 1.0).abs() < 0.05, "tiled kernel, P unscaled {tiled_p1} vs x 2^8 {tiled}");
    // The baseline is in the paper's range (2.4e-2), not broken.
    assert!((0.015..0.035).contains(&naive), "{naive}");
}

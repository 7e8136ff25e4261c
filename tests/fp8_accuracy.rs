//! FlashAttention-3's accuracy claim on our CPU FP8 emulation: on inputs with rare large outliers
//! (`N(0,1) + N(0,100)·Bernoulli(0.001)`, the paper's §4.3), block quantisation plus the Hadamard
//! rotation beats per-tensor FP8 clearly. `cargo run --release --example fp8_accuracy` prints the
//! full table.

use flash_attn::numerics::hadamard::Rotation;
use flash_attn::numerics::quant::quantize_e4m3;
use flash_attn::numerics::rng::{fa3_outlier_values, SplitMix64};
use flash_attn::reference::{attention_f64, rmse};
use flash_attn::{forward, Backend, DType, Fp8Scaling, ForwardOptions, Precision, Problem, Tensor};

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
    let n: usize = SHAPE.iter().product();
    let mut g = SplitMix64::new(seed);
    let mut mk = || Tensor::from_f32(&fa3_outlier_values(&mut g, n), DType::F16, SHAPE).unwrap();
    let (q, k, v) = (mk(), mk(), mk());
    let p = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default()).unwrap();
    let reference = attention_f64(&p, &q.view(), &k.view(), &v.view()).o;
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

/// Measured on these inputs (4 seeds): per-tensor 2.02e-2, per-block 1.63e-2, Hadamard only
/// 1.32e-2, per-block + Hadamard 1.38e-2, a 1.47x gain (1.44x-1.76x on single draws of other
/// shapes; see docs/fp8.md). FA3's paper reports 2.6x against its own baseline, which we do not
/// reproduce: our FA3-method error matches the paper's, but our per-tensor baseline is lower. The
/// bound leaves room for rounding changes, not for losing the effect.
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
            Tensor::from_vec(quantize_e4m3(&x, SHAPE, SHAPE[1]).dequantize(), SHAPE).unwrap()
        };
        let err = |hadamard: bool| {
            let (q8, k8) = (fq(&c.q, hadamard), fq(&c.k, hadamard));
            rmse(&attention_f64(&p, &q8.view(), &k8.view(), &c.v.view()).o, &c.reference).powi(2)
        };
        plain += err(false);
        rotated += err(true);
    }
    let gain = (plain / rotated).sqrt();
    println!("Q/K quantisation only: Hadamard gain {gain:.2}x");
    assert!(gain >= 1.45, "Hadamard gain on the Q/K error only {gain:.2}x");
}

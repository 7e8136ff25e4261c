//! Numerics shared by the CPU backend and the CUDA kernels: FP8 codecs, block quantisation,
//! the Hadamard rotation, software exp2, lazy rescaling, and the FP8 pipeline through `forward`.


use crate::support::{check_forward, randn, Rng};
use flash_attn::numerics::exp2::{exp2_poly_deg, POLY_DEGREES};
use flash_attn::numerics::fp8::*;
use flash_attn::numerics::hadamard::{fwht, Rotation};
use flash_attn::numerics::quant::{block_scale, quantize_e4m3};
use flash_attn::numerics::{fp8_lazy_limit, validate, FP8_P_SCALE_LOG2};
use flash_attn::reference::{attention_f64, max_abs_diff, rmse};
use flash_attn::{
    forward, Backend, DType, Error, Exp2, Fp8Scaling, ForwardOptions, Mask, Precision, Problem, Rescale, Tensor,
};

// ---------------------------------------------------------------- FP8 codecs

#[test]
fn e4m3_all_codes_round_trip() {
    for code in 0..=255u8 {
        let x = e4m3_to_f32(code);
        if code & 0x7F == 0x7F {
            assert!(x.is_nan(), "{code:#x} is e4m3's NaN");
            assert!(e4m3_to_f32(e4m3_from_f32(x)).is_nan());
        } else {
            assert!(x.is_finite() && x.abs() <= E4M3_MAX);
            assert_eq!(e4m3_from_f32(x), code, "{code:#x} -> {x:e}");
            assert_eq!(round_e4m3(x).to_bits(), x.to_bits());
        }
    }
    assert_eq!(e4m3_to_f32(0x7E), 448.0);
    assert_eq!(e4m3_to_f32(0x38), 1.0);
}

#[test]
fn e4m3_rounding_saturation_subnormals_nan() {
    // Ties to even: 1 + 1/16 sits between 1 (mantissa 000) and 1.125 (001) -> 1.
    assert_eq!(e4m3_from_f32(1.0 + 1.0 / 16.0), 0x38);
    // 1 + 3/16 sits between 1.125 (001) and 1.25 (010) -> 1.25.
    assert_eq!(e4m3_to_f32(e4m3_from_f32(1.0 + 3.0 / 16.0)), 1.25);
    assert_eq!(e4m3_to_f32(e4m3_from_f32(1.0 + 1.0 / 16.0 + 1e-6)), 1.125);
    // Satfinite: everything beyond 448 (infinities included) gives ±448.
    for x in [448.0, 449.0, 464.0, 480.0, 1e6, f32::INFINITY, f32::MAX] {
        assert_eq!(e4m3_from_f32(x), 0x7E, "{x}");
        assert_eq!(e4m3_from_f32(-x), 0xFE, "{x}");
        assert_eq!(round_e4m3(x), 448.0);
        assert_eq!(round_e4m3(-x), -448.0);
    }
    // Subnormals: 2^-9 is the smallest, 2^-10 is a tie to 0, 3·2^-10 a tie to 2·2^-9.
    let p = |e: i32| 2.0f32.powi(e);
    assert_eq!(e4m3_from_f32(p(-9)), 0x01);
    assert_eq!(e4m3_from_f32(-p(-9)), 0x81);
    assert_eq!(e4m3_from_f32(p(-10)), 0x00);
    assert_eq!(e4m3_from_f32(3.0 * p(-10)), 0x02);
    assert_eq!(e4m3_from_f32(p(-6)), 0x08, "smallest normal");
    assert_eq!(round_e4m3(p(-10)), 0.0);
    // NaN stays NaN (compare NaN-ness: float8 keeps the sign bit, CUDA gives 0x7F).
    assert!(e4m3_to_f32(e4m3_from_f32(f32::NAN)).is_nan());
    assert!(e4m3_to_f32(e4m3_from_f32(-f32::NAN)).is_nan());
    assert!(round_e4m3(f32::NAN).is_nan());
    // Signed zero survives.
    assert_eq!(e4m3_from_f32(-0.0), 0x80);
}

#[test]
fn e5m2_codes_and_saturation() {
    for code in 0..=255u8 {
        let x = e5m2_to_f32(code);
        match code & 0x7F {
            0x7D..=0x7F => assert!(x.is_nan()),
            0x7C => {
                // ±inf decodes, but satfinite encoding of inf gives ±max.
                assert!(x.is_infinite());
                assert_eq!(e5m2_from_f32(x), (code & 0x80) | 0x7B);
            }
            _ => assert_eq!(e5m2_from_f32(x), code, "{code:#x}"),
        }
    }
    assert_eq!(e5m2_to_f32(0x7B), E5M2_MAX);
    assert_eq!(e5m2_from_f32(1e9), 0x7B);
    assert!(e5m2_to_f32(e5m2_from_f32(f32::NAN)).is_nan());
}

// ---------------------------------------------------------------- block quantisation

#[test]
fn per_block_scales_follow_their_block() {
    let (s, h, d, rows) = (200, 2, 16, 64);
    let shape = [1, s, h, d];
    let mut rng = Rng::new(11);
    let mut x: Vec<f32> = (0..s * h * d).map(|_| rng.normal() as f32).collect();
    // An outlier in block 1 of head 0; a zero block (block 2 of head 1).
    x[(70 * h) * d + 3] = 1000.0;
    for si in 128..192 {
        for i in 0..d {
            x[(si * h + 1) * d + i] = 0.0;
        }
    }
    let qz = quantize_e4m3(&x, shape, rows).unwrap();
    assert_eq!(qz.blocks(), 4);
    assert_eq!(qz.scale(0, 70, 0), 1000.0 / 448.0);
    assert_eq!(qz.scale(0, 128, 1), 1.0, "all-zero guard");
    for hh in 0..h {
        for blk in 0..4 {
            let rs = blk * rows..((blk + 1) * rows).min(s);
            let amax = rs
                .clone()
                .flat_map(|si| x[(si * h + hh) * d..(si * h + hh + 1) * d].iter().copied())
                .fold(0.0f32, |a, v| a.max(v.abs()));
            assert_eq!(qz.scale(0, rs.start, hh), block_scale(amax));
            // The block max maps to the largest code (±448) exactly.
            if amax > 0.0 {
                let hit = rs.clone().any(|si| {
                    (0..d).any(|i| e4m3_to_f32(qz.codes[(si * h + hh) * d + i]).abs() == E4M3_MAX)
                });
                assert!(hit, "head {hh} block {blk}");
            }
        }
    }
    // Dequantised values are within half an e4m3 step (2^-4 relative) or the subnormal step.
    let dq = qz.dequantize().unwrap();
    for (i, (&a, &b)) in x.iter().zip(&dq).enumerate() {
        let sc = qz.scale(0, i / (h * d), (i / d) % h);
        assert!((a - b).abs() <= a.abs() / 16.0 + sc * E4M3_SUBNORMAL_STEP / 2.0 + 1e-7, "{i}: {a} vs {b}");
    }
    // Per-tensor is one block over the whole sequence: the outlier sets head 0's scale everywhere.
    let pt = quantize_e4m3(&x, shape, s).unwrap();
    assert_eq!(pt.blocks(), 1);
    assert_eq!(pt.scale(0, 0, 0), 1000.0 / 448.0);
}

// ---------------------------------------------------------------- Hadamard

#[test]
fn hadamard_is_orthogonal_and_keeps_dot_products() {
    for d in [1, 2, 16, 64, 128, 256] {
        let rot = Rotation::new(d, 42).unwrap();
        // Columns M·e_i.
        let cols: Vec<Vec<f32>> = (0..d)
            .map(|i| {
                let mut e = vec![0.0; d];
                e[i] = 1.0;
                rot.apply(&mut e);
                e
            })
            .collect();
        for i in 0..d {
            for j in 0..d {
                let dot: f64 = cols[i].iter().zip(&cols[j]).map(|(a, b)| (*a as f64) * (*b as f64)).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((dot - want).abs() < 1e-6, "d {d} ({i},{j}): {dot}");
            }
        }
        let mut rng = Rng::new(d as u64 + 1);
        for _ in 0..20 {
            let q: Vec<f32> = (0..d).map(|_| rng.normal() as f32 * 3.0).collect();
            let k: Vec<f32> = (0..d).map(|_| rng.normal() as f32).collect();
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (*x as f64) * (*y as f64)).sum::<f64>();
            let (mut qr, mut kr) = (q.clone(), k.clone());
            rot.apply(&mut qr);
            rot.apply(&mut kr);
            let scale = dot(&q, &q).sqrt() * dot(&k, &k).sqrt();
            assert!((dot(&qr, &kr) - dot(&q, &k)).abs() <= 1e-6 * scale);
        }
    }
    // H·H = d·I.
    let mut x: Vec<f32> = (0..32).map(|i| i as f32 - 7.0).collect();
    let orig = x.clone();
    fwht(&mut x);
    fwht(&mut x);
    assert!(x.iter().zip(&orig).all(|(a, b)| *a == 32.0 * b));
    // Different seeds give different sign patterns; non-power-of-two head dims are refused.
    let (mut a, mut b) = (vec![1.0f32; 64], vec![1.0f32; 64]);
    Rotation::new(64, 1).unwrap().apply(&mut a);
    Rotation::new(64, 2).unwrap().apply(&mut b);
    assert_ne!(a, b);
    assert!(Rotation::new(96, 1).is_none());
}

#[test]
fn hadamard_spreads_an_outlier() {
    let d = 128;
    let mut x = vec![0.0f32; d];
    x[5] = 100.0;
    Rotation::new(d, 3).unwrap().apply(&mut x);
    let want = 100.0 / (d as f32).sqrt();
    assert!(x.iter().all(|v| (v.abs() - want).abs() < 1e-4), "every entry is ±100/sqrt(d)");
}

// ---------------------------------------------------------------- software exp2

/// Maximum relative error of the degree-`deg` exp2 over a dense sweep of `[-126, 16)`, the
/// range P's exponent takes (with FP8's offset 8 and any legal lazy threshold).
fn max_rel_err(deg: u8) -> f64 {
    let step = 1.0 / 8192.0;
    let mut worst = 0.0f64;
    let mut x = -126.0f64;
    while x < 16.0 {
        let xf = x as f32;
        let got = exp2_poly_deg(xf, deg) as f64;
        let want = (xf as f64).exp2();
        worst = worst.max(((got - want) / want).abs());
        x += step;
    }
    worst
}

/// Maximum relative error of the polynomial itself (evaluated in f64) over `f` in `[0, 1)`.
fn poly_math_err(deg: u8) -> f64 {
    let c = flash_attn::numerics::exp2::POLY_EX2[deg as usize];
    let n = 1 << 20;
    (0..n)
        .map(|i| {
            let f = i as f64 / n as f64;
            let p = c.iter().rev().fold(0.0f64, |acc, &ci| acc * f + ci as f64);
            (p / f.exp2() - 1.0).abs()
        })
        .fold(0.0, f64::max)
}

#[test]
fn exp2_poly_relative_error_per_degree() {
    // The polynomials' own maxima (FA4's coefficients; anchors.md).
    let expected = [(2u8, 2.1e-3), (3, 8.76e-5), (4, 3.0e-6), (5, 8.5e-8)];
    for (deg, want) in expected {
        let math = poly_math_err(deg);
        let got = max_rel_err(deg);
        println!("degree {deg}: polynomial {math:.3e} (expected {want:.2e}), f32 implementation {got:.3e}");
        assert!((math / want - 1.0).abs() < 0.05, "degree {deg}: {math:e} vs {want:e}");
        // The f32 evaluation adds at most ~one f32 ulp (2^-23 relative) of rounding.
        assert!(got <= math + 1.5 * f64::from(f32::EPSILON) && got >= 0.9 * math, "degree {deg}: {got:e}");
    }
    assert_eq!(POLY_DEGREES, 2..=5);
}

#[test]
fn exp2_poly_is_fine_for_bf16_and_fp8_p() {
    // bf16 keeps 8 significant bits: half an ulp is 2^-9 relative. Degree 3's error is 22x
    // smaller, so it moves a bf16 rounding only for inputs within 8.8e-5 of a rounding boundary.
    let half_ulp_bf16 = 2.0f64.powi(-9);
    assert!(max_rel_err(3) * 16.0 < half_ulp_bf16);
    // Degree 2 is borderline for bf16 (its error exceeds half a bf16 ulp): FA4 does not use it.
    assert!(max_rel_err(2) > half_ulp_bf16);
    // e4m3 P (offset 2^8): degree 3 and the exact exp2 give the same code, or neighbours.
    let (mut same, mut total) = (0u64, 0u64);
    let mut x = -30.0f32;
    while x < 0.0 {
        let p_poly = round_e4m3(exp2_poly_deg(x + FP8_P_SCALE_LOG2, 3));
        let p_true = round_e4m3((x + FP8_P_SCALE_LOG2).exp2());
        total += 1;
        if p_poly == p_true {
            same += 1;
        } else {
            let step = p_true.abs().max(1e-30) / 8.0; // one e4m3 step or less
            assert!((p_poly - p_true).abs() <= step * 1.01 + E4M3_SUBNORMAL_STEP, "x {x}");
        }
        x += 1.0 / 4096.0;
    }
    let agree = same as f64 / total as f64;
    println!("e4m3(P) agreement, degree 3 vs exact: {:.4} %", 100.0 * agree);
    assert!(agree > 0.999, "{agree}");
}

#[test]
fn exp2_poly_edge_cases() {
    for deg in 2..=5 {
        assert!(exp2_poly_deg(f32::NAN, deg).is_nan());
        assert_eq!(exp2_poly_deg(0.0, deg), 1.0);
        assert_eq!(exp2_poly_deg(f32::NEG_INFINITY, deg).to_bits() >> 23, 0, "clamped to ~2^-127");
        assert!(exp2_poly_deg(-1000.0, deg) < 1e-37);
        for n in -20..20 {
            // Integers are exact: 2^f at f = 0 is the constant term 1.
            assert_eq!(exp2_poly_deg(n as f32, deg), (n as f32).exp2());
        }
    }
}

// ---------------------------------------------------------------- validation

#[test]
fn validate_fp8_rules() {
    let fp8 = |scaling, hadamard| Precision::Fp8 { scaling, hadamard };
    let pt = Fp8Scaling::PerTensor;
    assert!(validate(fp8(pt, None), Exp2::Accurate, Rescale::Always, 96).is_ok());
    assert!(validate(fp8(pt, Some(1)), Exp2::Poly(3), Rescale::Always, 128).is_ok());
    let e = validate(fp8(pt, Some(1)), Exp2::Accurate, Rescale::Always, 96).unwrap_err();
    assert!(matches!(e, Error::InvalidOption { .. }) && e.to_string().contains("power-of-two"), "{e}");
    let e = validate(fp8(Fp8Scaling::PerBlock { rows: 0 }, None), Exp2::Accurate, Rescale::Always, 64).unwrap_err();
    assert!(e.to_string().contains("block"), "{e}");
    // τ + 8 < log2(448) = 8.807.
    let limit = fp8_lazy_limit();
    assert!((limit - (448f32.log2() - 8.0)).abs() < 1e-6);
    assert!(validate(fp8(pt, None), Exp2::Accurate, Rescale::Lazy { threshold: 0.0 }, 64).is_ok());
    assert!(validate(fp8(pt, None), Exp2::Accurate, Rescale::Lazy { threshold: 0.8 }, 64).is_ok());
    for t in [0.81, 1.0, 8.0] {
        let e = validate(fp8(pt, None), Exp2::Accurate, Rescale::Lazy { threshold: t }, 64).unwrap_err();
        assert!(e.to_string().contains("log2(448)"), "{e}");
    }
    // Native: FA4's 8 is fine; the overflow cap and non-finite values are not.
    assert!(validate(Precision::Native, Exp2::Accurate, Rescale::Lazy { threshold: 8.0 }, 64).is_ok());
    for t in [-1.0, 65.0, f32::NAN, f32::INFINITY] {
        assert!(validate(Precision::Native, Exp2::Accurate, Rescale::Lazy { threshold: t }, 64).is_err(), "{t}");
    }
    for d in [0u8, 1, 6] {
        assert!(validate(Precision::Native, Exp2::Poly(d), Rescale::Always, 64).is_err());
    }
    // The same errors come back from `forward`, typed.
    let t = Tensor::zeros(DType::F32, [1, 4, 1, 96]).unwrap();
    let opts = ForwardOptions::default()
        .backend(Backend::Cpu)
        .precision(Precision::Fp8 { scaling: pt, hadamard: Some(7) });
    assert!(matches!(forward(&t, &t, &t, &opts), Err(Error::InvalidOption { .. })));
}

// ---------------------------------------------------------------- through `forward`

fn inputs(seed: u64, dtype: DType, shape: [usize; 4], kv_heads: usize) -> (Tensor, Tensor, Tensor) {
    let mut rng = Rng::new(seed);
    let kv = [shape[0], shape[1], kv_heads, shape[3]];
    (randn(&mut rng, dtype, shape), randn(&mut rng, dtype, kv), randn(&mut rng, dtype, kv))
}

#[test]
fn poly_exp2_and_lazy_rescale_pass_the_flash_rule() {
    let (q, k, v) = inputs(5, DType::F16, [2, 150, 4, 64], 2);
    for exp2 in [Exp2::Accurate, Exp2::Poly(3), Exp2::Poly(5)] {
        for rescale in [Rescale::Always, Rescale::Lazy { threshold: 8.0 }, Rescale::Lazy { threshold: 0.0 }] {
            for mask in [Mask::None, Mask::Causal] {
                let opts = ForwardOptions::default()
                    .backend(Backend::Cpu)
                    .exp2(exp2)
                    .rescale(rescale)
                    .mask(mask)
                    .return_lse(true);
                let (out, c) = check_forward(&q, &k, &v, &opts);
                assert!(c.err <= c.bound, "{exp2:?} {rescale:?} {mask:?}: {c:?}");
                assert!(c.lse_err < 1e-3, "{c:?}");
                // Degree 5 is the CPU's accurate exp2, so Poly(5) + Always runs the native path.
                let emulated = !matches!(exp2, Exp2::Accurate | Exp2::Poly(5)) || rescale != Rescale::Always;
                assert_eq!(out.dispatch.kernel.contains("emulated"), emulated, "{}", out.dispatch.kernel);
            }
        }
    }
}

/// Scores that rise along the keys (about 2.5 log2 units per 128-key tile, 20 in all), so the row
/// max keeps growing and a lazy softmax keeps a stale max for several tiles.
fn growing_max_inputs(sk: usize, d: usize, rise_log2: f32) -> (Tensor, Tensor, Tensor) {
    let sq = 8;
    let q: Vec<f32> = (0..sq * d).map(|i| 1.0 + 0.01 * (i % 7) as f32).collect();
    let per_key = rise_log2 * std::f32::consts::LN_2 / (sk as f32 * (d as f32).sqrt());
    let k: Vec<f32> = (0..sk * d).map(|i| per_key * (i / d) as f32).collect();
    let mut rng = Rng::new(99);
    let v: Vec<f32> = (0..sk * d).map(|_| rng.normal() as f32).collect();
    (
        Tensor::from_vec(q, [1, sq, 1, d]).unwrap(),
        Tensor::from_vec(k, [1, sk, 1, d]).unwrap(),
        Tensor::from_vec(v, [1, sk, 1, d]).unwrap(),
    )
}

fn err_vs_f64(q: &Tensor, k: &Tensor, v: &Tensor, opts: &ForwardOptions) -> (f64, Vec<f32>) {
    let out = forward(q, k, v, opts).unwrap();
    let p = Problem::new(&q.view(), &k.view(), &v.view(), opts).unwrap();
    let r = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
    let o: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
    (rmse(&o, &r.o), out.o.to_f32_vec())
}

#[test]
fn lazy_rescale_matches_always_on_a_growing_max() {
    let (q, k, v) = growing_max_inputs(1024, 64, 20.0);
    let base = ForwardOptions::default().backend(Backend::Cpu);
    let (e_always, o_always) = err_vs_f64(&q, &k, &v, &base.clone());
    for t in [1.0, 4.0, 8.0, 30.0] {
        let (e_lazy, o_lazy) = err_vs_f64(&q, &k, &v, &base.clone().rescale(Rescale::Lazy { threshold: t }));
        let a: Vec<f64> = o_always.iter().map(|&x| x as f64).collect();
        let b: Vec<f64> = o_lazy.iter().map(|&x| x as f64).collect();
        assert!(max_abs_diff(&a, &b) < 1e-5, "τ {t}: {}", max_abs_diff(&a, &b));
        assert!(e_lazy < 1e-6 && e_always < 1e-6, "τ {t}: {e_lazy} {e_always}");
    }
}

#[test]
fn fp8_with_lazy_rescale_on_a_growing_max() {
    let (q, k, v) = growing_max_inputs(1024, 64, 20.0);
    for scaling in [Fp8Scaling::PerTensor, Fp8Scaling::PerBlock { rows: 128 }] {
        let base = ForwardOptions::default()
            .backend(Backend::Cpu)
            .precision(Precision::Fp8 { scaling, hadamard: Some(3) });
        let (e_always, _) = err_vs_f64(&q, &k, &v, &base);
        // The largest legal threshold: P reaches 2^(8 + 0.8) = 446 < 448, no saturation.
        let (e_lazy, _) = err_vs_f64(&q, &k, &v, &base.clone().rescale(Rescale::Lazy { threshold: 0.8 }));
        println!("{scaling:?}: always {e_always:.3e}, lazy(0.8) {e_lazy:.3e}");
        assert!(e_lazy <= 1.3 * e_always + 1e-4, "{e_lazy} vs {e_always}");
        assert!(e_always < 0.05, "{e_always}");
        // The threshold FA4 uses for 16-bit inputs is refused with FP8.
        let bad = base.clone().rescale(Rescale::Lazy { threshold: 8.0 });
        assert!(matches!(forward(&q, &k, &v, &bad), Err(Error::InvalidOption { .. })));
    }
}

#[test]
fn fp8_pipeline_runs_every_option_and_stays_close() {
    let (q, k, v) = inputs(21, DType::BF16, [2, 130, 4, 64], 2);
    let p = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default()).unwrap();
    let r = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
    for scaling in [Fp8Scaling::PerTensor, Fp8Scaling::PerBlock { rows: 64 }, Fp8Scaling::PerBlock { rows: 128 }] {
        for hadamard in [None, Some(9)] {
            for exp2 in [Exp2::Accurate, Exp2::Poly(3)] {
                for mask in [Mask::None, Mask::Causal] {
                    let opts = ForwardOptions::default()
                        .backend(Backend::Cpu)
                        .precision(Precision::Fp8 { scaling, hadamard })
                        .exp2(exp2)
                        .mask(mask)
                        .return_lse(true);
                    let out = forward(&q, &k, &v, &opts).unwrap();
                    assert_eq!(out.dispatch.kernel, "cpu-tiled-emulated-fp8");
                    let pm = Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
                    let rm = if mask == Mask::None { r.clone() } else { attention_f64(&pm, &q.view(), &k.view(), &v.view()).unwrap() };
                    let o: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
                    let e = rmse(&o, &rm.o);
                    // N(0,1) inputs: FP8 costs about 1e-2 RMSE, never more than a few times that.
                    assert!(e < 3e-2, "{scaling:?} {hadamard:?} {exp2:?} {mask:?}: {e}");
                    let lse: Vec<f64> = out.lse.unwrap().iter().map(|&x| x as f64).collect();
                    assert!(max_abs_diff(&lse, &rm.lse) < 0.2, "LSE with the 2^8 offset removed");
                }
            }
        }
    }
}

/// With every key in one tile (seqlen_k <= the CPU's 96-key tile, `cpu::tiled::TILE_KEYS`), the running max is the row
/// max, so the tiled FP8 pipeline must agree with a straightforward implementation of the same
/// recipe: rotate, quantise, scores in f32, P = e4m3(2^(s - m + 8)), l from the unrounded P,
/// O = Σ P·v / l. Leaving out any step (rounding, offset, rotation, scales) moves the result by a
/// sizeable share of FP8's error; f32 summation order moves it by almost nothing.
#[test]
fn fp8_pipeline_matches_a_straightforward_oracle() {
    use flash_attn::numerics::quant::fake_quantize;
    use flash_attn::numerics::rng::{fa3_outlier_values, SplitMix64};
    let (b_n, sq, sk, h_n, d) = (1, 96, 96, 2, 64);
    let mut g = SplitMix64::new(77);
    let q = Tensor::from_vec(fa3_outlier_values(&mut g, b_n * sq * h_n * d), [b_n, sq, h_n, d]).unwrap();
    let k = Tensor::from_vec(fa3_outlier_values(&mut g, b_n * sk * h_n * d), [b_n, sk, h_n, d]).unwrap();
    let v = Tensor::from_vec(fa3_outlier_values(&mut g, b_n * sk * h_n * d), [b_n, sk, h_n, d]).unwrap();
    for (scaling, hadamard) in [(Fp8Scaling::PerTensor, None), (Fp8Scaling::PerBlock { rows: 32 }, Some(5))] {
        let opts = ForwardOptions::default()
            .backend(Backend::Cpu)
            .precision(Precision::Fp8 { scaling, hadamard })
            .return_lse(true);
        let out = forward(&q, &k, &v, &opts).unwrap();
        let tiled: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
        let lse = out.lse.unwrap();

        let rot = hadamard.map(|s| Rotation::new(d, s).unwrap());
        let q8 = fake_quantize(&q.view(), scaling, rot.as_ref()).unwrap().to_f32_vec();
        let k8 = fake_quantize(&k.view(), scaling, rot.as_ref()).unwrap().to_f32_vec();
        let v8 = fake_quantize(&v.view(), scaling, None).unwrap().to_f32_vec();
        let mul = (d as f32).sqrt().recip() * flash_attn::LOG2E;
        let mut oracle = vec![0.0f64; tiled.len()];
        for h in 0..h_n {
            for i in 0..sq {
                let qi = &q8[(i * h_n + h) * d..][..d];
                let s: Vec<f32> = (0..sk)
                    .map(|j| qi.iter().zip(&k8[(j * h_n + h) * d..][..d]).map(|(a, b)| a * mul * b).sum())
                    .collect();
                let m = s.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                let p: Vec<f32> = s.iter().map(|&x| exp2_poly_deg(x - m + FP8_P_SCALE_LOG2, 5)).collect();
                let l: f32 = p.iter().sum();
                for x in 0..d {
                    let acc: f32 = (0..sk).map(|j| round_e4m3(p[j]) * v8[(j * h_n + h) * d + x]).sum();
                    oracle[(i * h_n + h) * d + x] = (acc / l) as f64;
                }
                let want_lse = (m - FP8_P_SCALE_LOG2 + l.log2()) * std::f32::consts::LN_2;
                assert!((lse[h * sq + i] - want_lse).abs() < 1e-4, "LSE row {i}");
            }
        }
        let pr = Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
        let exact = attention_f64(&pr, &q.view(), &k.view(), &v.view()).unwrap().o;
        let fp8_err = rmse(&oracle, &exact);
        let gap = rmse(&tiled, &oracle);
        println!("{scaling:?} {hadamard:?}: FP8 error {fp8_err:.3e}, tiled vs oracle {gap:.3e}");
        assert!(gap < 0.02 * fp8_err, "{gap} vs {fp8_err}");
    }
}

// ---------------------------------------------------------------- naive FP8 baseline

/// The naive FP8 baseline casts the *normalised* P to e4m3 as it is: with all scores equal,
/// P = 1/seqlen_k exactly, which e4m3 keeps at 512 keys (2^-9, its smallest subnormal), rounds to
/// 0 at 1024 keys (2^-10, a tie, to even) and 2048 keys (2^-11). Scaling P by 2^8 first keeps it.
#[test]
fn naive_fp8_baseline_casts_normalised_p_as_is() {
    use flash_attn::bench::fp8_baseline::{attention_naive_fp8, attention_naive_fp8_p_scaled};
    let d = 8;
    for (sk, survives) in [(512, true), (1024, false), (2048, false)] {
        // Q = 0: every score is 0. V alternates rows of 1 and 2 (exact in e4m3 after scaling).
        let q = Tensor::from_vec(vec![0.0f32; 4 * d], [1, 4, 1, d]).unwrap();
        let k = Tensor::from_vec((0..sk * d).map(|i| (i % 7) as f32 - 3.0).collect(), [1, sk, 1, d]).unwrap();
        let v =
            Tensor::from_vec((0..sk * d).map(|i| if (i / d) % 2 == 0 { 1.0 } else { 2.0 }).collect(), [1, sk, 1, d])
                .unwrap();
        let p = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default()).unwrap();
        let o = attention_naive_fp8(&p, &q.view(), &k.view(), &v.view(), Fp8Scaling::PerTensor).unwrap();
        let want = if survives { 1.5 } else { 0.0 };
        assert!(o.iter().all(|&x| (x - want).abs() < 1e-3), "{sk} keys: {:?}", &o[..d]);
        let o8 =
            attention_naive_fp8_p_scaled(&p, &q.view(), &k.view(), &v.view(), Fp8Scaling::PerTensor, FP8_P_SCALE_LOG2).unwrap();
        assert!(o8.iter().all(|&x| (x - 1.5).abs() < 1e-3), "{sk} keys, P x 2^8: {:?}", &o8[..d]);
    }
}

/// The P-scale ablation hook runs the same pipeline as `forward` (bit for bit at 2^8), and
/// refuses scales at which P = 1 would saturate.
#[test]
fn tiled_fp8_with_p_scale_matches_forward() {
    use flash_attn::bench::fp8_baseline::tiled_fp8_with_p_scale;
    let mut rng = Rng::new(3);
    let shape = [1, 100, 2, 64];
    let (q, k, v) =
        (randn(&mut rng, DType::F16, shape), randn(&mut rng, DType::F16, shape), randn(&mut rng, DType::F16, shape));
    let opts = ForwardOptions::default()
        .backend(Backend::Cpu)
        .precision(Precision::Fp8 { scaling: Fp8Scaling::PerBlock { rows: 64 }, hadamard: Some(9) });
    let p = Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
    let want: Vec<f64> = forward(&q, &k, &v, &opts).unwrap().o.to_f32_vec().iter().map(|&x| x as f64).collect();
    let got = tiled_fp8_with_p_scale(&p, &q.view(), &k.view(), &v.view(), FP8_P_SCALE_LOG2).unwrap();
    assert_eq!(max_abs_diff(&got, &want), 0.0);
    assert!(tiled_fp8_with_p_scale(&p, &q.view(), &k.view(), &v.view(), 0.0).is_ok());
    for bad in [-1.0, 448f32.log2(), 9.0, f32::NAN] {
        assert!(matches!(
            tiled_fp8_with_p_scale(&p, &q.view(), &k.view(), &v.view(), bad),
            Err(Error::InvalidOption { .. })
        ));
    }
    let native = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default()).unwrap();
    assert!(tiled_fp8_with_p_scale(&native, &q.view(), &k.view(), &v.view(), 8.0).is_err());
}

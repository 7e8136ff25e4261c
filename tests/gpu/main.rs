//! GPU tests: every kernel family in build/instances.rs against the float64 reference, with
//! FlashAttention's tolerance `max|out - ref| <= 2 * max|naive_same_dtype - ref| + floor`.
//! The output and LSE buffers are poisoned with NaN before each launch, so an element the kernel
//! does not write fails the comparison.
//!
//! All `#[ignore]`d: a CPU run lists them as ignored. On a GPU:
//! `cargo test --release --test gpu -- --ignored` (scripts/check/gpu.sh runs them).
#![cfg(feature = "cuda")]

//!
//! | module | concern |
//! |---|---|
//! | `backward` | the backward kernels (`Engine::backward`, FA2 and FA3-style) against the float64 reference gradient, sinks' `d_sinks` included |
//! | `matrix` | FA1/FA2 and Auto: random matrix, edge shapes, strided inputs, host path, dispatch |
//! | `edges` | the edges of the input domain (huge bounds, scores near f32::MAX, infinite V) |
//! | `streams` | engines' own streams and contexts, CUDA graph capture |
//! | `fp8` | the Hopper FP8 forward (fa3fp8s3..fa3fp8s5) against the CPU FP8 path and float64 |
//! | `merge` | the device `merge_states` (combine kernel) against the host merge, sharded forward merged on the device |
//! | `serving` | varlen, paged and FP8 KV caches, the rotary append through cache rows, through `Backend::Cuda` (the FA2 serving kernels; FA3's on Hopper for the FP8 cache and the append), per sequence |
//! | here | the sanitizer subsets and the FA3 and FA4 ladders, which scripts/check/gpu-run.sh runs by exact name |

#[path = "../support/mod.rs"]
mod support;
mod backward;
mod edges;
mod fp8;
mod matrix;
mod merge;
mod serving;
mod streams;
mod util;

use support::*;
use flash_attn::cuda::{table::FAMILIES, Engine};
use flash_attn::{DType, Error, ForwardOptions, Mask, Variant};
use cudarc::driver::CudaStream;
use half::bf16;
use std::sync::Arc;
use util::*;

/// The short subset scripts/check/gpu.sh runs under `compute-sanitizer --tool memcheck`: every
/// instantiated head dim and one tail dim, seqlens off every tile size, causal and window, GQA,
/// LSE, both dtypes, every variant. Small, so memcheck's slowdown stays affordable.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sanitizer_subset() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(13);
    // The head dims of the instances whose V head dim is Q/K's (not the fa2v pairs).
    let mut dims: Vec<usize> =
        FAMILIES.iter().flat_map(|f| f.tiles.iter().filter(|t| t.head_dim == t.head_dim_v).map(|t| t.head_dim as usize)).collect();
    dims.push(40);
    dims.sort_unstable();
    dims.dedup();
    for dtype in [DType::F16, DType::BF16] {
        for &d in &dims {
            for mask in [Mask::Causal, Mask::window(7, 2)] {
                let q = randn(&mut rng, dtype, [1, 37, 4, d]);
                let k = randn(&mut rng, dtype, [1, 45, 2, d]);
                let v = randn(&mut rng, dtype, [1, 45, 2, d]);
                for var in variants(&engine) {
                    let opts = ForwardOptions::default().mask(mask).return_lse(true).alibi_slopes(vec![0.25f32; 4]).variant(var);
                    check(&engine, &stream, [q.view(), k.view(), v.view()], &opts, &format!("{dtype:?} d{d} {mask:?} {var:?}"));
                }
            }
        }
    }
}

// ---------------------------------------------------------------- FA3 stage ladder
// One test per stage (scripts/check/gpu-run.sh runs them in ascending order, each under its
// own timeout, so a hang in stage N names its rung and leaves the window to the others).

/// A stage ladder (FA3, FA4): its name in kernel symbols, the options that select a stage, the
/// compute capability its SASS runs on, and its head dims.
#[derive(Clone, Copy)]
struct Ladder {
    name: &'static str,
    stage: fn(u8) -> ForwardOptions,
    cc: (i32, i32),
    dims: &'static [usize],
}
const FA3: Ladder = Ladder {
    name: "fa3",
    stage: |s| ForwardOptions::default().variant(Variant::Fa3).fa3_stage(s),
    cc: (9, 0),
    dims: &[64, 128, 256],
};
const FA4: Ladder = Ladder {
    name: "fa4",
    stage: |s| ForwardOptions::default().variant(Variant::Fa4).fa4_stage(s),
    cc: (10, 0),
    dims: &[64, 128],
};

/// Whether this GPU runs the ladder's kernels (sm_90a / sm_100a SASS: that compute capability
/// only). Elsewhere the stage must be refused with VariantUnavailable, which is checked.
fn runs_here(engine: &Engine, ladder: Ladder, stage: u8) -> bool {
    let name = ladder.name;
    let d = engine.dispatch([1, 64, 1, 64], [1, 64, 1, 64], DType::BF16, &(ladder.stage)(stage));
    if engine.device().compute_capability() == ladder.cc {
        let d = d.unwrap_or_else(|e| panic!("{name} stage {stage} on its GPU: {e}"));
        assert_eq!(d.kernel, format!("{name}s{stage}_fwd_hd64_bf16"));
        true
    } else {
        assert!(matches!(d, Err(Error::VariantUnavailable { .. })), "{name} stage {stage} elsewhere: {d:?}");
        false
    }
}

/// One stage of a ladder against the float64 reference with FlashAttention's tolerance, outputs
/// NaN-poisoned: bf16/f16 × the ladder's head dims × (plain; GQA + causal with sq < sk; a sliding
/// window; sq > sk causal: rows with no key give O = 0, LSE = -inf; softcap; several K/V tiles
/// (ring wrap); odd seqlens with GQA 7:1 and a causal window), then the edges of the input domain
/// (huge windows, scores up to near f32::MAX, softcap f32::MAX, infinite and NaN V with
/// rows that see no key). Returns the worst err/bound.
fn ladder_cases(engine: &Engine, stream: &Arc<CudaStream>, rng: &mut Rng, ladder: Ladder, stage: u8) -> f64 {
    let name = ladder.name;
    let base = (ladder.stage)(stage);
    // (batch, sq, sk, hq, hkv, mask, softcap, lse)
    type Case = (usize, usize, usize, usize, usize, Mask, Option<f32>, bool);
    let cases: &[Case] = &[
        (1, 128, 128, 1, 1, Mask::None, None, false),
        (2, 100, 300, 4, 2, Mask::Causal, None, true),
        (1, 257, 257, 2, 2, Mask::window(64, 16), None, true),
        (1, 300, 100, 2, 1, Mask::Causal, None, true),
        (1, 150, 200, 2, 2, Mask::None, Some(30.0), true),
        (1, 70, 520, 1, 1, Mask::None, None, true),
        (2, 77, 333, 7, 1, Mask::causal_window(40), None, true),
    ];
    let mut worst = 0.0f64;
    for dtype in [DType::BF16, DType::F16] {
        for &d in ladder.dims {
            for &(b, sq, sk, hq, hkv, mask, softcap, lse) in cases {
                let q = randn(rng, dtype, [b, sq, hq, d]);
                let k = randn(rng, dtype, [b, sk, hkv, d]);
                let v = randn(rng, dtype, [b, sk, hkv, d]);
                let mut opts = base.clone().mask(mask).return_lse(lse);
                if let Some(c) = softcap {
                    opts = opts.softcap(c);
                }
                let dt = if dtype == DType::BF16 { "bf16" } else { "f16" };
                let chosen = engine.dispatch([b, sq, hq, d], [b, sk, hkv, d], dtype, &opts).unwrap();
                assert_eq!(chosen.kernel, format!("{name}s{stage}_fwd_hd{d}_{dt}"), "{}", chosen.reason);
                let what = format!("{name} stage {stage} {dtype:?} b{b} sq{sq} sk{sk} hq{hq} hkv{hkv} d{d} {mask:?} softcap {softcap:?}");
                worst = worst.max(check(engine, stream, [q.view(), k.view(), v.view()], &opts, &what));
            }
            for ([q, k, v], opts, what) in edge_inputs(rng, dtype, d, true) {
                let mut o = base.clone().mask(opts.mask).return_lse(true);
                o.softmax_scale = opts.softmax_scale;
                o.softcap = opts.softcap;
                check_edges(engine, stream, [&q, &k, &v], &o, &format!("{name} stage {stage} {dtype:?} d{d} {what}"));
            }
        }
    }
    // Refusals are typed errors: ALiBi, head_dim 96.
    let alibi = base.clone().alibi_slopes(vec![0.25f32; 2]);
    let e = engine.dispatch([1, 64, 2, 64], [1, 64, 2, 64], DType::BF16, &alibi);
    assert!(matches!(&e, Err(Error::VariantUnavailable { reason, .. }) if reason.contains("ALiBi")), "{e:?}");
    let e = engine.dispatch([1, 64, 2, 96], [1, 64, 2, 96], DType::BF16, &base);
    assert!(matches!(e, Err(Error::VariantUnavailable { .. })), "{e:?}");
    worst
}

/// The FA3 matrix of one stage: the ladder's cases (ladder_cases), then more query tiles than SMs
/// (stage 5: many tiles per CTA), and strides off the 16-byte rule refused.
fn fa3_matrix(stage: u8) {
    let engine = engine();
    if !runs_here(&engine, FA3, stage) {
        return;
    }
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(0xfa3 + stage as u64);
    let fa3 = (FA3.stage)(stage);
    let mut worst = ladder_cases(&engine, &stream, &mut rng, FA3, stage);
    // More (query tile, head, batch) tiles than any GPU has SMs: stage 5's CTAs take many each.
    for dtype in [DType::BF16, DType::F16] {
        let q = randn(&mut rng, dtype, [4, 520, 16, 64]);
        let k = randn(&mut rng, dtype, [4, 64, 4, 64]);
        let v = randn(&mut rng, dtype, [4, 64, 4, 64]);
        let opts = fa3.clone().causal(true).return_lse(true);
        let what = format!("fa3 stage {stage} {dtype:?} many tiles");
        worst = worst.max(check(&engine, &stream, [q.view(), k.view(), v.view()], &opts, &what));
    }
    let padded = randn(&mut rng, DType::BF16, [1, 64, 1, 68]);
    let data = match padded.view().data() {
        flash_attn::Data::BF16(x) => x.to_vec(),
        _ => unreachable!(),
    };
    let strided = [64 * 68, 68, 64]; // rows 68 elements apart: 136 bytes, not a multiple of 16
    let shape = [1, 64, 1, 64];
    let r = run_typed::<bf16>(&engine, &stream, [(&data, shape, strided), (&data, shape, strided), (&data, shape, strided)], &fa3);
    assert!(matches!(r, Err(Error::InvalidLayout { .. })), "stride 68: {:?}", r.err());
    println!("fa3 stage {stage}: passed; worst err/bound {worst:.3}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_stage1() {
    fa3_matrix(1);
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_stage2() {
    fa3_matrix(2);
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_stage3() {
    fa3_matrix(3);
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_stage4() {
    fa3_matrix(4);
}
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_stage5() {
    fa3_matrix(5);
}

// ---------------------------------------------------------------- FA4 stage ladder
// Compile-checked only: no Blackwell GPU has run it (docs/fa4.md).

/// The FA4 (tcgen05) matrix of one stage: the ladder's cases (ladder_cases, as FA3's), and the
/// refusal of FA4 without a stage.
fn fa4_matrix(stage: u8) {
    let engine = engine();
    if !runs_here(&engine, FA4, stage) {
        return;
    }
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(0xfa4 + stage as u64);
    let worst = ladder_cases(&engine, &stream, &mut rng, FA4, stage);
    // Without a stage, Variant::Fa4 runs FA4's softmax on the FA2 pipeline here (docs/fa4.md,
    // "Part 1"), never a tcgen05 stage.
    let no_stage = ForwardOptions::default().variant(Variant::Fa4);
    let d = engine.dispatch([1, 64, 2, 64], [1, 64, 2, 64], DType::BF16, &no_stage).unwrap();
    assert_eq!(d.kernel, "fa4_fa2_fwd_hd64_bf16", "{}", d.reason);
    println!("fa4 stage {stage}: passed; worst err/bound {worst:.3}");
}

#[test]
#[ignore = "needs a CUDA GPU (a Blackwell sm_100 one to run; elsewhere the refusal is checked)"]
fn fa4_stage1() {
    fa4_matrix(1);
}
#[test]
#[ignore = "needs a CUDA GPU (a Blackwell sm_100 one to run; elsewhere the refusal is checked)"]
fn fa4_stage2() {
    fa4_matrix(2);
}
#[test]
#[ignore = "needs a CUDA GPU (a Blackwell sm_100 one to run; elsewhere the refusal is checked)"]
fn fa4_stage3() {
    fa4_matrix(3);
}

/// FA4's softmax on the FA2 / FA3 pipelines (docs/fa4.md, "Part 1"): `Variant::Fa4` without
/// `fa4_stage` runs `fa4_fa3s5` on sm_90a and `fa4_fa2` on every other sm_80+ GPU; the
/// ladder's case shapes at head dims 64 / 128 in both dtypes, large scores (the lazy rescale
/// must move the max), the domain edges, and on sm_90a each sweep row (share x tau) at hd 128.
#[test]
#[ignore = "needs a CUDA GPU (sm_80 or newer)"]
fn fa4_softmax_pipelines() {
    use flash_attn::Rescale;
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(0xfa41);
    let hopper = engine.device().compute_capability() == (9, 0);
    let row = if hopper { "fa4_fa3s5" } else { "fa4_fa2" };
    let fa4 = ForwardOptions::default().variant(Variant::Fa4);
    let mut runs = vec![(row.to_string(), fa4.clone(), vec![64, 128])];
    if hopper {
        for (share, tau) in [(0u32, 8.0f32), (8, 0.0), (4, 0.0), (4, 8.0)] {
            let o = fa4.clone().fa4_exp2_share(share).rescale(Rescale::Lazy { threshold: tau });
            runs.push((format!("{row}_p{share}t{tau}"), o, vec![128]));
        }
    }
    // (batch, sq, sk, hq, hkv, mask, softcap, input scale)
    type Case = (usize, usize, usize, usize, usize, Mask, Option<f32>, f32);
    let cases: &[Case] = &[
        (2, 100, 300, 4, 2, Mask::Causal, None, 1.0),
        (1, 257, 257, 2, 2, Mask::window(64, 16), None, 1.0),
        (1, 150, 200, 2, 2, Mask::None, Some(30.0), 1.0),
        (1, 70, 520, 1, 1, Mask::None, None, 1.0),
        (1, 300, 300, 2, 1, Mask::Causal, None, 12.0),
    ];
    let mut worst = 0.0f64;
    for (name, base, dims) in &runs {
        for dtype in [DType::BF16, DType::F16] {
            for &d in dims {
                for &(b, sq, sk, hq, hkv, mask, softcap, scale) in cases {
                    let gen = |rng: &mut Rng, s: [usize; 4]| {
                        let t = randn(rng, dtype, s);
                        let x: Vec<f32> = t.to_f32_vec().iter().map(|v| v * scale).collect();
                        flash_attn::Tensor::from_f32(&x, dtype, s).unwrap()
                    };
                    let (q, k, v) = (gen(&mut rng, [b, sq, hq, d]), gen(&mut rng, [b, sk, hkv, d]), gen(&mut rng, [b, sk, hkv, d]));
                    let mut opts = base.clone().mask(mask).return_lse(true);
                    if let Some(c) = softcap {
                        opts = opts.softcap(c);
                    }
                    let chosen = engine.dispatch([b, sq, hq, d], [b, sk, hkv, d], dtype, &opts).unwrap();
                    assert!(chosen.kernel.starts_with(&format!("{row}_")) && chosen.reason.contains("FA4's softmax"), "{}", chosen.reason);
                    let what = format!("{name} {dtype:?} b{b} sq{sq} sk{sk} hq{hq} hkv{hkv} d{d} {mask:?} softcap {softcap:?} x{scale}");
                    worst = worst.max(check(&engine, &stream, [q.view(), k.view(), v.view()], &opts, &what));
                }
                if name == row {
                    for ([q, k, v], opts, what) in edge_inputs(&mut rng, dtype, d, true) {
                        let mut o = base.clone().mask(opts.mask).return_lse(true);
                        o.softmax_scale = opts.softmax_scale;
                        o.softcap = opts.softcap;
                        check_edges(&engine, &stream, [&q, &k, &v], &o, &format!("{name} {dtype:?} d{d} {what}"));
                    }
                }
            }
        }
    }
    println!("fa4 softmax on {row}: passed; worst err/bound {worst:.3}");
}

/// The short FA3 subset scripts/check/gpu-run.sh runs under compute-sanitizer (memcheck,
/// racecheck, synccheck), one stage at a time (`FA3_SANITIZE_STAGE`, default all): every head
/// dim, seqlens off the tiles, causal, GQA, LSE, both dtypes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_sanitizer_subset() {
    let engine = engine();
    let stages: Vec<u8> = match std::env::var("FA3_SANITIZE_STAGE") {
        Ok(s) => vec![s.parse().expect("FA3_SANITIZE_STAGE: 1..=5")],
        Err(_) => (1..=5).collect(),
    };
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(17);
    for stage in stages {
        if !runs_here(&engine, FA3, stage) {
            continue;
        }
        for dtype in [DType::F16, DType::BF16] {
            for d in [64usize, 128, 256] {
                let q = randn(&mut rng, dtype, [1, 100, 4, d]);
                let k = randn(&mut rng, dtype, [1, 300, 2, d]);
                let v = randn(&mut rng, dtype, [1, 300, 2, d]);
                let opts = ForwardOptions::default().variant(Variant::Fa3).fa3_stage(stage).causal(true).return_lse(true);
                check(&engine, &stream, [q.view(), k.view(), v.view()], &opts, &format!("fa3 stage {stage} {dtype:?} d{d}"));
            }
        }
    }
}

/// FA2's fa2v row at DeepSeek MLA's pairs (192, 128) and (576, 512), under `Auto` and
/// `Variant::Fa2`: causal prefill and decode rows against float64 with FlashAttention's rule.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa2v_mla_pairs() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(0x0d0f);
    for dtype in [DType::F16, DType::BF16] {
        for ((d, dv), sq) in [((192, 128), 70), ((576, 512), 1), ((576, 512), 3)] {
            let q = randn(&mut rng, dtype, [2, sq, 8, d]);
            let k = randn(&mut rng, dtype, [2, 150, 2, d]);
            let v = randn(&mut rng, dtype, [2, 150, 2, dv]);
            for var in [Variant::Auto, Variant::Fa2] {
                let opts = ForwardOptions::default().mask(Mask::Causal).return_lse(true).variant(var);
                let what = format!("{dtype:?} {var:?} ({d}, {dv}) sq {sq}");
                let out = run_views(&engine, &stream, [q.view(), k.view(), v.view()], &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(out.kernel.starts_with("fa2v_"), "{what}: ran {}", out.kernel);
                let p = flash_attn::Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
                let r = flash_attn::reference::attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
                let naive = flash_attn::reference::attention_naive(&p, &q.view(), &k.view(), &v.view(), dtype).unwrap();
                let err = flash_attn::reference::max_abs_diff(&out.o, &r.o);
                let bound = 2.0 * flash_attn::reference::max_abs_diff(&naive, &r.o) + floor_for(dtype);
                assert!(err <= bound, "{what}: max err {err:.3e} > bound {bound:.3e}");
            }
        }
    }
}

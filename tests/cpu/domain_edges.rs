//! The edges of the input domain (README): window bounds over all of i64, scores up to the
//! top of f32's range, options whose products overflow, shapes and strides near `usize::MAX`,
//! broadcast views, infinities and NaNs, thread counts. Every public constructor and `forward`
//! must return `Ok` with correct numbers or a typed `Error`: never a panic (this file runs with
//! overflow checks on, `[profile.test]` in Cargo.toml), never a silently wrong answer.

use crate::support::props;
use crate::support::*;
use crate::support::Rng;
use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff};
use flash_attn::*;
use proptest::prelude::*;

#[allow(clippy::too_many_arguments)]
fn qkv(seed: u64, dtype: DType, b: usize, sq: usize, sk: usize, hq: usize, hk: usize, d: usize) -> (Tensor, Tensor, Tensor) {
    let mut rng = Rng::new(seed);
    (randn(&mut rng, dtype, [b, sq, hq, d]), randn(&mut rng, dtype, [b, sk, hk, d]), randn(&mut rng, dtype, [b, sk, hk, d]))
}

fn scaled(t: &Tensor, by: f32) -> Tensor {
    let v: Vec<f32> = t.to_f32_vec().iter().map(|x| x * by).collect();
    Tensor::from_f32(&v, t.dtype(), t.shape()).unwrap()
}

/// What a check of `forward` against the float64 reference measured.
#[derive(Debug)]
struct Measured {
    /// Largest `|ours − ref| − allowance` over the outputs (see [`dot_allowance`]).
    err: f64,
    bound: f64,
    /// Largest plain `|ours − ref|` (shown with a failure).
    #[allow(dead_code)]
    raw_err: f64,
    lse_err: f64,
    lse_scale: f64,
    naive_finite: bool,
    ours_finite: bool,
}

/// q or k with its head_dim reordered by `perm` (`x'[i] = x[perm(i)]`): the same dot products in
/// exact arithmetic, summed in another order by a straightforward implementation.
fn permute_d(t: &Tensor, perm: impl Fn(usize, usize) -> usize) -> Tensor {
    let d = t.shape()[3];
    let x = t.to_f32_vec();
    let y: Vec<f32> = (0..x.len()).map(|i| x[i / d * d + perm(i % d, d)]).collect();
    Tensor::from_f32(&y, t.dtype(), t.shape()).unwrap()
}

/// Per output element, how far an f32 attention may be from the exact one through the rounding
/// of its scores alone, whatever its summation order: a score is a dot product of `d` f32
/// products, within Higham's bound `γ_d · Σ|q·k|` (`γ_d = d·u / (1 − d·u)`, `u = 2^-24`) of the
/// exact one, plus a few roundings of its own size (the scale, softcap, ALiBi, the exponent's
/// argument); score errors `δs_j` move the output by at most `Σ_j p_j · δs_j · |v_j − o|` (to
/// first order; softcap's slope is at most 1). Both our result and the naive yardstick carry
/// such errors: at scores of 1e3 and more they are far above f32's unit roundoff, and the naive
/// sample may have been lucky (two top scores rounded the same way). `[b, sq, hq, d]` like o.
fn dot_allowance(p: &Problem, q: &Tensor, k: &Tensor, v: &Tensor, r: &[f64], lse: &[f64]) -> Vec<f64> {
    let u = 2f64.powi(-24);
    let d = p.head_dim;
    let gamma = d as f64 * u / (1.0 - d as f64 * u);
    let (qv, kv, vv) = (q.to_f32_vec(), k.to_f32_vec(), v.to_f32_vec());
    let mut allow = vec![0.0f64; r.len()];
    for b in 0..p.batch {
        for i in 0..p.seqlen_q {
            for h in 0..p.heads_q {
                let hk = h / p.group();
                let row = (b * p.seqlen_q + i) * p.heads_q + h;
                let l = lse[(b * p.heads_q + h) * p.seqlen_q + i];
                if !l.is_finite() {
                    continue;
                }
                let qi = &qv[row * d..(row + 1) * d];
                let o = &r[row * d..(row + 1) * d];
                let out = &mut allow[row * d..(row + 1) * d];
                for j in (0..p.seqlen_k).filter(|&j| p.visible(i, j)) {
                    let at = ((b * p.seqlen_k + j) * p.heads_kv + hk) * d;
                    let kj = &kv[at..at + d];
                    let (mut dot, mut abs) = (0.0f64, 0.0f64);
                    for (x, y) in qi.iter().zip(kj) {
                        dot += *x as f64 * *y as f64;
                        abs += (*x as f64 * *y as f64).abs();
                    }
                    let scale = p.scale as f64;
                    let mut sj = dot * scale;
                    if let Some(cap) = p.softcap {
                        sj = cap as f64 * (sj / cap as f64).tanh();
                    }
                    sj += p.alibi_bias(h, i, j) as f64;
                    let delta = gamma * abs * scale + 4.0 * u * (sj.abs() + (dot * scale).abs());
                    let pj = (sj - l).exp();
                    for ((a, &oo), &vx) in out.iter_mut().zip(o).zip(&vv[at..at + d]) {
                        *a += pj * delta * (vx as f64 - oo).abs();
                    }
                }
            }
        }
    }
    allow
}

/// `forward` against the float64 reference. The yardstick is the straightforward f32 softmax of
/// the same (already rounded) inputs: "wherever a naive f32 softmax is finite, ours is too, and
/// within FlashAttention's rule of it" (output rounding to a 16-bit dtype is in its floor). At
/// large magnitudes both errors are dominated by the f32 rounding of the dot products, which
/// depends on the summation order: the naive error is the largest of three orders (forward,
/// reversed, rotated by d/2), so that the rule compares with f32's noise level rather than with
/// one lucky draw of it; each output may also differ by its [`dot_allowance`], the rounding of
/// the scores that any f32 order may show. LSEs compare with the reference rounded to f32 (an LSE beyond
/// f32::MAX is ±inf in any f32 result).
fn measure(q: &Tensor, k: &Tensor, v: &Tensor, opts: &ForwardOptions) -> (Output, Measured) {
    let out = forward(q, k, v, opts).unwrap_or_else(|e| panic!("forward refused: {e}"));
    let p = Problem::new(&q.view(), &k.view(), &v.view(), opts).unwrap();
    let r = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
    let naive = attention_naive(&p, &q.view(), &k.view(), &v.view(), DType::F32).unwrap();
    let mut naive_err = max_abs_diff(&naive, &r.o);
    for perm in [|i: usize, d: usize| d - 1 - i, |i: usize, d: usize| (i + d / 2) % d] {
        let (qp, kp) = (permute_d(q, perm), permute_d(k, perm));
        let other = attention_naive(&p, &qp.view(), &kp.view(), &v.view(), DType::F32).unwrap();
        naive_err = naive_err.max(max_abs_diff(&other, &r.o));
    }
    let ours: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
    let allow = dot_allowance(&p, q, k, v, &r.o, &r.lse);
    let beyond = ours.iter().zip(&r.o).zip(&allow).map(|((&a, &b), &w)| match (a.is_nan(), b.is_nan()) {
        (true, true) => 0.0,
        (false, false) => ((a - b).abs() - w).max(0.0),
        _ => f64::INFINITY,
    });
    let lse_err = out.lse.as_ref().map_or(0.0, |l| {
        let l64: Vec<f64> = l.iter().map(|&x| x as f64).collect();
        let r32: Vec<f64> = r.lse.iter().map(|&x| x as f32 as f64).collect();
        max_abs_diff(&l64, &r32)
    });
    let lse_scale = r.lse.iter().filter(|x| x.is_finite()).fold(1.0f64, |a, x| a.max(x.abs()));
    let m = Measured {
        err: beyond.fold(0.0, f64::max),
        raw_err: max_abs_diff(&ours, &r.o),
        bound: 2.0 * naive_err + floor_for(q.dtype()),
        lse_err,
        lse_scale,
        naive_finite: naive.iter().all(|x| x.is_finite()),
        ours_finite: ours.iter().all(|x| x.is_finite()),
    };
    (out, m)
}

fn assert_good(q: &Tensor, k: &Tensor, v: &Tensor, opts: &ForwardOptions, what: &str) -> Output {
    let (out, m) = measure(q, k, v, opts);
    assert!(m.naive_finite, "{what}: the case must be one where a naive f32 softmax is finite: {m:?}");
    assert!(m.ours_finite, "{what}: naive f32 is finite, ours is not: {m:?}");
    assert!(m.err <= m.bound, "{what}: {m:?}");
    assert!(m.lse_err <= 1e-4 * m.lse_scale, "{what}: lse {m:?}");
    out
}

// ---------------------------------------------------------------- 1. window bounds

/// Any bound at least `seqlen_q + seqlen_k` is the same window as an unbounded one: every
/// relative position `j - (i + sk - sq)` lies in `(-sk, sq)`.
fn equivalent_small(bound: i64, sq: usize, sk: usize) -> i64 {
    if bound < 0 {
        bound
    } else {
        bound.min((sq + sk) as i64)
    }
}

#[test]
fn huge_window_bounds_equal_their_small_equivalents() {
    let huge = [i64::MAX, i64::MAX - 1, 1 << 62, 1 << 40, u32::MAX as i64, i32::MAX as i64 + 1, i32::MAX as i64];
    for (sq, sk) in [(40, 17), (17, 40), (33, 33)] {
        let (q, k, v) = qkv(1, DType::F32, 1, sq, sk, 2, 1, 32);
        for &h in &huge {
            for (l, r) in [(-1, h), (h, -1), (h, h), (h, 0), (0, h), (3, h), (h, 3)] {
                let small = Mask::window(equivalent_small(l, sq, sk), equivalent_small(r, sq, sk));
                let opts = ForwardOptions::default().return_lse(true);
                let what = format!("sq {sq} sk {sk} window({l}, {r})");
                let got = forward(&q, &k, &v, &opts.clone().mask(Mask::window(l, r))).unwrap_or_else(|e| panic!("{what}: {e}"));
                let want = assert_good(&q, &k, &v, &opts.clone().mask(small), &what);
                assert_eq!(got.o, want.o, "{what}");
                assert_eq!(got.lse, want.lse, "{what}");
            }
            let got = forward(&q, &k, &v, &ForwardOptions::default().mask(Mask::causal_window(h))).unwrap();
            let want = forward(&q, &k, &v, &ForwardOptions::default().mask(Mask::Causal)).unwrap();
            assert_eq!(got.o, want.o, "causal_window({h})");
        }
    }
}

fn any_bound() -> impl Strategy<Value = i64> {
    prop_oneof![
        Just(-1i64),
        -1i64..80,
        (0u32..63).prop_map(|k| 1i64 << k),
        (0u32..63).prop_map(|k| (1i64 << k) - 1),
        Just(i64::MAX),
        Just(i64::MIN),
        any::<i64>(),
    ]
}

proptest! {
    #![proptest_config(props::config("window_bounds_over_all_of_i64", file!(), 512))]

    /// Window bounds over all of i64: a typed error below -1 (or right != 0 with causal),
    /// otherwise the same result as the equivalent small window, which matches the reference.
    #[test]
    fn window_bounds_over_all_of_i64(
        l in any_bound(), r in any_bound(), causal in prop::bool::weighted(0.25),
        sq in 1usize..70, sk in 1usize..70, seed in any::<u64>(),
    ) {
        let (q, k, v) = qkv(seed, DType::F32, 1, sq, sk, 1, 1, 16);
        let opts = ForwardOptions::default().return_lse(true);
        let got = forward(&q, &k, &v, &opts.clone().mask(Mask::Window { left: l, right: r, causal }));
        if l < -1 || r < -1 {
            prop_assert!(matches!(got, Err(Error::NegativeWindow { .. })), "{got:?}");
        } else if causal && r > 0 {
            prop_assert!(matches!(got, Err(Error::InconsistentWindow(_))), "{got:?}");
        } else {
            let got = got.unwrap();
            let small = Mask::Window { left: equivalent_small(l, sq, sk), right: equivalent_small(r, sq, sk), causal };
            let want = assert_good(&q, &k, &v, &opts.clone().mask(small), &format!("{small:?}"));
            prop_assert_eq!(got.o, want.o);
            prop_assert_eq!(got.lse, want.lse);
        }
    }
}

// ---------------------------------------------------------------- 2. large but finite scores

#[test]
fn large_scores_from_the_issue() {
    // f32 inputs around 1e5 at head_dim 128: |score · log2 e| ~ 2^33.
    let (q, k, v) = qkv(2, DType::F32, 1, 64, 80, 2, 1, 128);
    assert_good(&scaled(&q, 1e5), &scaled(&k, 1e5), &v, &ForwardOptions::default().return_lse(true), "f32 1e5");
    // f16 inputs near the top of their range (1.5e4 ± 10 %, so scores reach 2.5e9: 2^31.7 in
    // log2 units).
    let (q, k, v) = qkv(3, DType::F16, 1, 50, 70, 2, 2, 128);
    let near_top = |t: &Tensor| {
        let x: Vec<f32> = t.to_f32_vec().iter().map(|x| 1.5e4 * (1.0 + 0.1 * x)).collect();
        Tensor::from_f32(&x, DType::F16, t.shape()).unwrap()
    };
    assert_good(&near_top(&q), &near_top(&k), &v, &ForwardOptions::default().return_lse(true), "f16 near 1.5e4");
    // bf16 inputs near 1e18: scores near 1e37, with causal masking.
    let (q, k, v) = qkv(4, DType::BF16, 1, 60, 60, 1, 1, 64);
    let opts = ForwardOptions::default().causal(true).return_lse(true);
    assert_good(&scaled(&q, 1e18), &scaled(&k, 1e18), &v, &opts, "bf16 1e18");
    // A softmax scale of 1e8 with unit inputs.
    let (q, k, v) = qkv(5, DType::F32, 2, 33, 47, 2, 1, 64);
    let opts = ForwardOptions::default().softmax_scale(1e8).return_lse(true);
    assert_good(&q, &k, &v, &opts, "scale 1e8");
    // Scores within a factor 1.5 of f32::MAX (their log2-unit values overflow f32).
    let opts = ForwardOptions::default().softmax_scale(f32::MAX / 2.0 / 64.0).return_lse(true);
    let (q, k, v) = qkv(6, DType::F32, 1, 20, 30, 1, 1, 64);
    assert_good(&scaled(&q, 0.1), &scaled(&k, 0.1), &v, &opts, "scores near f32::MAX / 2");
}

#[test]
fn large_scores_with_small_differences() {
    // Every score is 2^32 plus a small, distinct offset: a naive f32 softmax resolves them
    // (to its rounding), and the running max must not break the fraction of the exponent.
    let (sq, sk, d) = (8, 40, 16);
    let mut q = vec![0.0f32; sq * d];
    let mut k = vec![0.0f32; sk * d];
    for i in 0..sq {
        q[i * d] = 65536.0;
        q[i * d + 1] = 1.0;
    }
    for j in 0..sk {
        k[j * d] = 65536.0;
        k[j * d + 1] = (j % 7) as f32 * 256.0;
    }
    let q = Tensor::from_vec(q, [1, sq, 1, d]).unwrap();
    let k = Tensor::from_vec(k, [1, sk, 1, d]).unwrap();
    let v = randn(&mut Rng::new(7), DType::F32, [1, sk, 1, d]);
    for scale in [1.0f32, 1.0 / 256.0, 1.0 / 4096.0] {
        let opts = ForwardOptions::default().softmax_scale(scale).return_lse(true);
        assert_good(&q, &k, &v, &opts, &format!("scale {scale}"));
        assert_good(&q, &k, &v, &opts.clone().causal(true), &format!("causal scale {scale}"));
    }
}

/// A case the random search found: f32 inputs × 2^24 with a softmax scale of 2^-39 (scores up
/// to 9e3), 10 query rows of 2 heads sharing one kv head (the in-place path's chunked sweep). In
/// one row the two top scores, 4915.19999 and 4911.61600, are 3.6 apart; ours rounds the second
/// 1.5 ulps (7e-4) high, the naive f32 rounds both 0.4 ulp high, so its output is 40 times
/// closer by luck: what [`dot_allowance`] accounts for.
#[test]
fn large_scores_on_the_chunked_in_place_path() {
    let (q, k, v) = qkv(17198522542111627987, DType::F32, 1, 10, 50, 2, 1, 32);
    let amp = 2f32.powi(24);
    let opts = ForwardOptions::default().return_lse(true).softmax_scale(2f32.powi(-39));
    assert_good(&scaled(&q, amp), &scaled(&k, amp), &v, &opts, "f32 x2^24, scale 2^-39");
}

/// Split-KV at scores near 4e4: each split's state is merged with its LSE, which the splits keep
/// in f64 (an f32 LSE there is off by up to 2e-3, a relative error of the split's weight), so
/// every split count gives the unsplit output to f32 rounding. Keys 100, 101, 600 and 601 are
/// near-equal tops of every row (scores a few units apart), two in each half of the keys.
#[test]
fn key_splits_agree_at_large_scores() {
    let (sq, sk, d) = (3, 700, 64);
    let mut rng = Rng::new(11);
    let amp = 2f32.powi(20);
    let q: Vec<f32> = (0..sq * d).map(|_| rng.normal().abs() as f32 * amp).collect();
    let mut k: Vec<f32> = (0..sk * d).map(|_| rng.normal() as f32 * amp).collect();
    for j in [100, 101, 600, 601] {
        for x in 0..d {
            k[j * d + x] = 3.0 * amp + 640.0 * rng.normal() as f32;
        }
    }
    let q = Tensor::from_vec(q, [1, sq, 1, d]).unwrap();
    let k = Tensor::from_vec(k, [1, sk, 1, d]).unwrap();
    let v = randn(&mut rng, DType::F32, [1, sk, 1, d]);
    let opts = ForwardOptions::default().return_lse(true).softmax_scale(2f32.powi(-32));
    let one = forward(&q, &k, &v, &opts.clone().num_splits(1)).unwrap();
    let lse_scale = one.lse.as_ref().unwrap().iter().fold(0.0f32, |a, x| a.max(x.abs()));
    assert!(lse_scale > 1e4, "the case must have large scores: max |LSE| {lse_scale}");
    for splits in [2, 3, 7] {
        let out = forward(&q, &k, &v, &opts.clone().num_splits(splits)).unwrap();
        let diff = out.o.to_f32_vec().iter().zip(one.o.to_f32_vec()).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff <= 1e-6, "{splits} splits: max |o − o_unsplit| {diff}");
    }
}

proptest! {
    #![proptest_config(props::config("scores_up_to_the_f32_range", file!(), 256))]

    /// Scores up to the top of f32's range: wherever the naive f32 softmax is finite, ours is
    /// finite and within FlashAttention's rule of the float64 reference.
    #[test]
    fn scores_up_to_the_f32_range(
        dtype in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
        in_log2 in 0i32..=60, scale_log2 in -100i32..=100,
        sq in 1usize..50, sk in 1usize..90, d in prop::sample::select(vec![8usize, 32, 64]),
        mask in prop::sample::select(vec![Mask::None, Mask::Causal, Mask::window(5, 3)]),
        softcap in prop::option::weighted(0.2, 1.0f32..1e30), alibi in prop::bool::weighted(0.2),
        lazy in prop::bool::weighted(0.25), seed in any::<u64>(),
    ) {
        let max_in = match dtype { DType::F16 => 15, _ => in_log2 };
        let amp = 2f32.powi(in_log2.min(max_in));
        let (q, k, v) = qkv(seed, dtype, 1, sq, sk, 2, 1, d);
        let (q, k) = (scaled(&q, amp), scaled(&k, amp));
        let mut opts = ForwardOptions::default().mask(mask).return_lse(true).softmax_scale(2f32.powi(scale_log2));
        if let Some(c) = softcap {
            opts = opts.softcap(c);
        }
        if alibi {
            opts = opts.alibi_slopes(vec![0.5f32, 1e-3]);
        }
        if lazy {
            // FA4's lazy rescaling (the emulated path): exact up to rounding, same rule.
            opts = opts.rescale(Rescale::Lazy { threshold: 8.0 });
        }
        let (_, m) = measure(&q, &k, &v, &opts);
        if m.naive_finite {
            prop_assert!(m.ours_finite, "{m:?}");
            prop_assert!(m.err <= m.bound, "{m:?}");
            prop_assert!(m.lse_err <= 1e-4 * m.lse_scale, "lse {m:?}");
        }
    }
}

// ---------------------------------------------------------------- 3. options whose products overflow

#[test]
fn softcap_near_f32_max_is_computed() {
    let (q, k, v) = qkv(8, DType::F32, 1, 30, 40, 2, 2, 32);
    let plain = forward(&q, &k, &v, &ForwardOptions::default().causal(true)).unwrap().o.to_f32_vec();
    for cap in [f32::MAX, f32::MAX / 1.4, 1e38, 1e30] {
        let opts = ForwardOptions::default().causal(true).softcap(cap).return_lse(true);
        let out = assert_good(&q, &k, &v, &opts, &format!("softcap {cap}"));
        // A cap far above every score changes nothing beyond rounding.
        let o = out.o.to_f32_vec();
        let diff = o.iter().zip(&plain).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff < 1e-5, "softcap {cap}: {diff}");
    }
    // Small caps, down to the smallest normal f32: every score saturates near ±cap.
    for cap in [1e-3f32, f32::MIN_POSITIVE] {
        assert_good(&q, &k, &v, &ForwardOptions::default().softcap(cap).return_lse(true), &format!("softcap {cap}"));
    }
}

#[test]
fn scale_and_cap_whose_log2_products_overflow_are_refused_or_computed() {
    let (q, k, v) = qkv(9, DType::F32, 1, 8, 8, 1, 1, 16);
    let (q, k) = (scaled(&q, 1e-20), scaled(&k, 1e-20));
    for scale in [f32::MAX, f32::MAX / 1.2, 3e38] {
        match forward(&q, &k, &v, &ForwardOptions::default().softmax_scale(scale).return_lse(true)) {
            Err(Error::InvalidSoftmaxScale(s)) => assert_eq!(s, scale),
            Ok(out) => assert!(out.o.to_f32_vec().iter().all(|x| x.is_finite()), "scale {scale}"),
            Err(e) => panic!("scale {scale}: {e}"),
        }
    }
    // Subnormal softcaps: 1 / cap overflows.
    for cap in [f32::MIN_POSITIVE / 2.0, 1e-45] {
        match forward(&q, &k, &v, &ForwardOptions::default().softcap(cap)) {
            Err(Error::InvalidSoftcap(c)) => assert_eq!(c, cap),
            Ok(out) => assert!(out.o.to_f32_vec().iter().all(|x| x.is_finite()), "cap {cap}"),
            Err(e) => panic!("cap {cap}: {e}"),
        }
    }
}

#[test]
fn alibi_with_huge_slopes() {
    let (q, k, v) = qkv(10, DType::F32, 1, 40, 60, 2, 1, 32);
    // Large but representable biases: the nearest visible key takes all the weight.
    let opts = ForwardOptions::default().alibi_slopes(vec![1e30f32, 1e36]).causal(true).return_lse(true);
    assert_good(&q, &k, &v, &opts, "slopes 1e30, 1e36");
    // A slope whose product with a distance overflows f32 would make every bias -inf and the row
    // look empty (o = 0), which is wrong: refused.
    let opts = ForwardOptions::default().alibi_slopes(vec![1.0f32, f32::MAX / 4.0]);
    let e = forward(&q, &k, &v, &opts).unwrap_err();
    assert!(matches!(e, Error::InvalidAlibi { .. }), "{e}");
}

// ---------------------------------------------------------------- 4, 5. shapes, strides, broadcasts

#[test]
fn shapes_that_overflow_at_allocation_are_typed_errors() {
    let huge = usize::MAX;
    for shape in [[0, huge, huge, 2], [huge / 2, 2, 1, 1], [1 << 40, 1, 1, 1], [1 << 62, 1, 1, 1], [2, huge, 0, huge]] {
        for dtype in [DType::F32, DType::F16] {
            match Tensor::zeros(dtype, shape) {
                Err(Error::TooLarge { .. }) => {}
                Ok(t) => {
                    // Allowed only if usable: view and forward must not panic.
                    assert_eq!(t.view().shape(), shape);
                    assert!(forward(&t, &t, &t, &ForwardOptions::default()).is_err());
                }
                Err(e) => panic!("zeros {shape:?}: unexpected {e}"),
            }
        }
        // from_f32 checks the length before allocating anything.
        let e = Tensor::from_f32(&[1.0, 2.0], DType::F32, shape).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { .. } | Error::TooLarge { .. }), "{e}");
        match Tensor::from_vec(Vec::<f32>::new(), shape) {
            Ok(t) => assert!(forward(&t, &t, &t, &ForwardOptions::default()).is_err()),
            Err(e) => assert!(matches!(e, Error::TooLarge { .. } | Error::ShapeMismatch { .. }), "{e}"),
        }
    }
}

#[test]
fn broadcast_views_with_huge_logical_sizes_are_refused_before_allocating() {
    let d = 16;
    let row = vec![0.25f32; d];
    let small = Tensor::from_vec(vec![0.5f32; 4 * d], [1, 4, 1, d]).unwrap();
    // A q of 2^40 rows, all one row in memory.
    let q = TensorView::with_strides(&row, [1, 1 << 40, 1, d], [0, 0, 0]);
    let e = forward(&q, &small, &small, &ForwardOptions::default()).unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    // k and v of 2^40 keys, for the tiled path (more than 16 query rows), which packs K and V
    // per kv head: refused before packing. (With at most 16 query rows the in-place path streams
    // K and V where they lie, materialising nothing: a broadcast K of any length is computed, in
    // time proportional to its length.)
    let q32 = Tensor::from_vec(vec![0.5f32; 32 * d], [1, 32, 1, d]).unwrap();
    let kv = TensorView::with_strides(&row, [1, 1 << 40, 1, d], [0, 0, 0]);
    let e = forward(&q32, &kv, &kv, &ForwardOptions::default()).unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    // A decode step (one query row: the in-place path) over 2^40 broadcast sequences.
    let qd = TensorView::with_strides(&row, [1 << 40, 1, 1, d], [0, 0, 0]);
    let kd = TensorView::with_strides(&row, [1 << 40, 4, 1, d], [0, 0, 0]);
    let e = forward(&qd, &kd, &kd, &ForwardOptions::default()).unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    // Batch and heads of 2^62 (their product with the rest overflows usize).
    let b = TensorView::with_strides(&row, [1 << 62, 1, 4, d], [0, 0, 0]);
    let e = forward(&b, &b, &b, &ForwardOptions::default()).unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    // A modest broadcast is computed, and equals the materialised one.
    let qb = TensorView::with_strides(&row, [1, 300, 2, d], [0, 0, 0]);
    let qm = Tensor::from_vec(vec![0.25f32; 300 * 2 * d], [1, 300, 2, d]).unwrap();
    let kvm = randn(&mut Rng::new(11), DType::F32, [1, 50, 1, d]);
    let a = forward(&qb, &kvm, &kvm, &ForwardOptions::default().causal(true)).unwrap();
    let b = forward(&qm, &kvm, &kvm, &ForwardOptions::default().causal(true)).unwrap();
    assert_eq!(a.o, b.o);
}

/// Interesting sizes: tiny, and ones no machine can allocate (never the in-between, which a test
/// on a shared machine must not try to allocate).
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        1 => Just(0usize),
        20 => 1usize..6,
        8 => prop::sample::select(vec![8usize, 16, 33]),
        3 => prop::sample::select(vec![1usize << 32, 1 << 40, 1 << 62, usize::MAX / 3, usize::MAX - 1, usize::MAX]),
    ]
}

fn stride() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 0usize..70,
        1 => prop::sample::select(vec![0usize, 1 << 31, 1 << 62, usize::MAX / 2, usize::MAX]),
    ]
}

/// How a view's strides are chosen: contiguous, broadcast (all 0), or arbitrary.
fn strides_for(mode: u8, shape: [usize; 4], free: [usize; 3]) -> [usize; 3] {
    let [_, s, h, d] = shape;
    let contiguous = h.checked_mul(d).and_then(|sh| Some([s.checked_mul(sh)?, sh, d]));
    match (mode, contiguous) {
        (0..=2, Some(c)) => c,
        (0..=4, _) => [0, 0, 0],
        _ => free,
    }
}

fn any_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        3 => 0.01f32..100.0,
        1 => prop::sample::select(vec![
            0.0f32, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN_POSITIVE, 1e-45, 1e-38, 1e38, 3e38
        ]),
        1 => any::<f32>(),
    ]
}

fn any_options() -> impl Strategy<Value = ForwardOptions> {
    (
        (any_bound(), any_bound(), prop::bool::weighted(0.2), 0u8..4),
        (
            prop::option::weighted(0.4, any_f32()),
            prop::option::weighted(0.2, any_f32()),
            prop::option::weighted(0.2, prop::collection::vec(any_f32(), 0..4)),
        ),
        (any::<bool>(), prop::option::of(prop_oneof![Just(0usize), Just(1), Just(3), Just(1_000_000), Just(usize::MAX)])),
        (0u8..3, any::<u8>(), prop::option::weighted(0.2, any_f32()), prop::option::of(0usize..80), any::<u64>()),
    )
        .prop_map(|((l, r, causal, kind), (scale, cap, slopes), (lse, threads), (prec, deg, tau, block, seed))| {
            let mask = match kind {
                0 => Mask::None,
                1 => Mask::Causal,
                _ => Mask::Window { left: l, right: r, causal },
            };
            let mut o = ForwardOptions::default().mask(mask).return_lse(lse).backend(Backend::Cpu);
            o.softmax_scale = scale;
            o.softcap = cap;
            o.alibi_slopes = slopes.map(Into::into);
            o.cpu_threads = threads;
            match prec {
                0 => {}
                1 => o = o.exp2(Exp2::Poly(deg)),
                _ => {
                    let scaling = block.map_or(Fp8Scaling::PerTensor, |rows| Fp8Scaling::PerBlock { rows });
                    o = o.precision(Precision::Fp8 { scaling, hadamard: (seed % 2 == 0).then_some(seed) });
                }
            }
            if let Some(t) = tau {
                o = o.rescale(Rescale::Lazy { threshold: t });
            }
            o
        })
}

/// Bytes a shape addresses logically, in u128 (never overflows here).
fn logical_bytes(shape: [usize; 4], elem: usize) -> u128 {
    shape.iter().fold(elem as u128, |a, &x| a.saturating_mul(x as u128))
}

proptest! {
    #![proptest_config(props::config("constructors_and_forward_never_panic", file!(), 1024))]

    /// Every public constructor and `forward`, fed arbitrary shapes, strides and options, returns
    /// `Ok` (with correct numbers, checked against the reference when small) or a typed error.
    #[test]
    fn constructors_and_forward_never_panic(
        qs in [dim(), dim(), dim(), dim()], ks_free in [dim(), dim(), dim(), dim()], tie in [prop::bool::weighted(0.85); 3],
        qst_free in [stride(), stride(), stride()], kst_free in [stride(), stride(), stride()], modes in [0u8..6, 0u8..6],
        same_kv_shape in prop::bool::weighted(0.9), share_q in prop::bool::weighted(0.3),
        opts in any_options(), dtype in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
    ) {
        // Mostly a k that matches q's batch and head_dim with heads dividing q's (else a typed
        // error, also tested): enough cases get through validation to check numbers.
        let ks = [
            if tie[0] { qs[0] } else { ks_free[0] },
            ks_free[1],
            if tie[1] && (1..=64).contains(&qs[2]) {
                (1..=qs[2]).rev().find(|h| qs[2] % h == 0 && *h <= ks_free[2].max(1)).unwrap_or(1)
            } else {
                ks_free[2]
            },
            if tie[2] { qs[3] } else { ks_free[3] },
        ];
        // The in-between sizes (a few MiB to a few TiB) could really be allocated and computed:
        // a property test on a shared machine keeps to tiny problems and impossible ones.
        for s in [qs, ks] {
            let b = logical_bytes(s, 4);
            prop_assume!(b <= 1 << 22 || b >= 1 << 46 || s.contains(&0));
        }
        // Problems that would be computed must be small. An impossible k is refused (TooLarge,
        // when packed) only on the tiled path; with at most 16 query rows the in-place path
        // streams it without materialising anything, i.e. would really compute it.
        let work = logical_bytes(qs, 1).saturating_mul(ks[1] as u128);
        let q_impossible = logical_bytes(qs, 4) >= 1 << 46;
        let k_impossible_and_packed = logical_bytes(ks, 4) >= 1 << 46 && qs[1] > 16;
        prop_assume!(work <= 1 << 24 || q_impossible || k_impossible_and_packed);
        let (qst, kst) = (strides_for(modes[0], qs, qst_free), strides_for(modes[1], ks, kst_free));
        let buf: Vec<f32> = (0..1 << 16).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
        let data = Tensor::from_f32(&buf, dtype, [1, 1, 1, 1 << 16]).unwrap();
        let vs = if same_kv_shape { ks } else { [ks[0], ks[1].wrapping_add(1), ks[2], ks[3]] };
        let view = |shape, strides| match data.data() {
            OwnedData::F32(x) => TensorView::with_strides(&x[..], shape, strides),
            OwnedData::F16(x) => TensorView::with_strides(&x[..], shape, strides),
            OwnedData::BF16(x) => TensorView::with_strides(&x[..], shape, strides),
        };
        let q = view(qs, qst);
        let k = if share_q { q } else { view(ks, kst) };
        let v = if share_q { q } else { view(vs, kst) };
        // Constructors: never a panic.
        let _ = TensorView::new(&buf, qs).shape();
        for shape in [qs, ks] {
            if logical_bytes(shape, 4) <= 1 << 22 || logical_bytes(shape, 1) >= 1 << 46 || shape.contains(&0) {
                if let Ok(t) = Tensor::zeros(dtype, shape) {
                    prop_assert_eq!(t.view().shape(), shape);
                }
            }
            let _ = Tensor::from_f32(&buf[..3], dtype, shape);
            let _ = Tensor::from_vec(vec![0.0f32; 3], shape);
        }
        match forward(&q, &k, &v, &opts) {
            Err(e) => prop_assert!(!e.to_string().is_empty()),
            Ok(out) => {
                prop_assert_eq!(out.o.shape(), q.shape());
                let p = Problem::new(&q, &k, &v, &opts).unwrap();
                let work = logical_bytes([p.batch, p.heads_q, p.seqlen_q, p.seqlen_k], p.head_dim);
                // Numbers are checked for the native arithmetic (FP8 and low-degree exp2 have their
                // own accuracy, tested in tests/cpu/numerics.rs) and moderate scales: with a scale
                // like 1e16 the softmax is an argmax over dot products that may tie in f32 and
                // differ at 1e-8 in f64, where no f32 result can match the reference (large
                // scores are `scores_up_to_the_f32_range`'s business, on inputs without ties).
                let finite_opts = opts.precision == Precision::Native
                    && opts.exp2 == Exp2::Accurate
                    && opts.softmax_scale.is_none_or(|s| s <= 100.0)
                    && opts.alibi_slopes.as_ref().is_none_or(|s| s.iter().all(|x| x.abs() <= 100.0))
                    && opts.softcap.is_none_or(|c| c < 1e30);
                if work <= 1 << 20 && finite_opts {
                    let r = attention_f64(&p, &q, &k, &v).unwrap();
                    let naive = attention_naive(&p, &q, &k, &v, DType::F32).unwrap();
                    if naive.iter().all(|x| x.is_finite()) {
                        let ours: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
                        let bound = 2.0 * max_abs_diff(&naive, &r.o) + 4.0 * floor_for(dtype);
                        let err = max_abs_diff(&ours, &r.o);
                        prop_assert!(err <= bound, "err {} > bound {}", err, bound);
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------- 6. infinities and NaNs

/// Keys `[lo, hi)` query `i` sees, computed here from the definition in i128.
fn sees(mask: Mask, sq: usize, sk: usize, i: usize) -> (usize, usize) {
    let diag = i as i128 + sk as i128 - sq as i128;
    let (l, r) = match mask {
        Mask::None => (-1, -1),
        Mask::Causal => (-1, 0),
        Mask::Window { left, right, causal } => (left, if causal { 0 } else { right }),
        _ => unreachable!(),
    };
    let lo = if l < 0 { 0 } else { (diag - l as i128).clamp(0, sk as i128) };
    let hi = if r < 0 { sk as i128 } else { (diag + r as i128 + 1).clamp(0, sk as i128) };
    (lo as usize, hi.max(lo) as usize)
}

#[test]
fn infinite_v_at_a_masked_key_leaves_empty_rows_zero() {
    // The edge case: sq > sk causal leaves rows that see no key; V = +inf everywhere.
    let (q, k, _) = qkv(12, DType::F32, 1, 50, 20, 2, 2, 32);
    let v = Tensor::from_vec(vec![f32::INFINITY; 20 * 2 * 32], [1, 20, 2, 32]).unwrap();
    let out = forward(&q, &k, &v, &ForwardOptions::default().causal(true).return_lse(true)).unwrap();
    let (o, lse) = (out.o.to_f32_vec(), out.lse.unwrap());
    for i in 0..30 {
        for h in 0..2 {
            assert!(o[(i * 2 + h) * 32..][..32].iter().all(|&x| x == 0.0), "row {i} head {h} sees no key: must be 0");
            assert_eq!(lse[h * 50 + i], f32::NEG_INFINITY);
        }
    }
}

fn poison(t: &Tensor, at: &[(usize, usize, f32)], heads: usize, d: usize) -> Tensor {
    let mut x = t.to_f32_vec();
    for &(row, col, val) in at {
        let h = row % heads;
        x[((row / heads) * heads + h) * d + col] = val;
    }
    Tensor::from_f32(&x, t.dtype(), t.shape()).unwrap()
}

proptest! {
    #![proptest_config(props::config("non_finite_values_stay_in_the_rows_that_see_them", file!(), 256))]

    /// NaN and ±inf anywhere in q, k, v: a row's output depends only on its own q and the keys
    /// it sees. Rows with finite q that see only finite keys are exactly what they would be with
    /// the non-finite values replaced; rows that see no key are 0 with LSE -inf.
    #[test]
    fn non_finite_values_stay_in_the_rows_that_see_them(
        sq in 1usize..120, sk in 1usize..120, d in prop::sample::select(vec![8usize, 32]),
        mask in prop_oneof![Just(Mask::Causal), (0i64..20, 0i64..20).prop_map(|(l, r)| Mask::window(l, r)),
                            (0i64..30).prop_map(Mask::causal_window)],
        spots in prop::collection::vec((0usize..3, 0usize..1000, 0usize..32,
            prop::sample::select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY])), 1..6),
        dtype in prop::sample::select(vec![DType::F32, DType::BF16]),
        seed in any::<u64>(),
    ) {
        let (q, k, v) = qkv(seed, dtype, 1, sq, sk, 1, 1, d);
        let (mut qp, mut kp, mut vp) = (vec![], vec![], vec![]);
        for &(which, row, col, val) in &spots {
            let col = col % d;
            match which {
                0 => qp.push((row % sq, col, val)),
                1 => kp.push((row % sk, col, val)),
                _ => vp.push((row % sk, col, val)),
            }
        }
        let opts = ForwardOptions::default().mask(mask).return_lse(true);
        let clean = forward(&q, &k, &v, &opts).unwrap();
        let dirty = forward(&poison(&q, &qp, 1, d), &poison(&k, &kp, 1, d), &poison(&v, &vp, 1, d), &opts).unwrap();
        let (co, dout) = (clean.o.to_f32_vec(), dirty.o.to_f32_vec());
        let (cl, dl) = (clean.lse.unwrap(), dirty.lse.unwrap());
        for i in 0..sq {
            let (lo, hi) = sees(mask, sq, sk, i);
            let row = &dout[i * d..][..d];
            if lo >= hi {
                prop_assert!(row.iter().all(|&x| x == 0.0), "row {} sees no key: {:?}", i, row);
                prop_assert_eq!(dl[i], f32::NEG_INFINITY);
                continue;
            }
            let touched = qp.iter().any(|s| s.0 == i)
                || kp.iter().chain(&vp).any(|s| (lo..hi).contains(&s.0));
            if !touched {
                prop_assert_eq!(row, &co[i * d..][..d], "row {} sees keys {}..{} and none is poisoned", i, lo, hi);
                prop_assert_eq!(dl[i], cl[i]);
            }
        }
    }
}

#[test]
fn visible_non_finite_values_reach_their_rows() {
    // q = 0 makes every score equal, so every visible key has weight 1/n (no underflow).
    let (sq, sk, d) = (16, 16, 8);
    let q = Tensor::zeros(DType::F32, [1, sq, 1, d]).unwrap();
    let (_, k, v) = qkv(13, DType::F32, 1, sq, sk, 1, 1, d);
    let v = poison(&v, &[(5, 3, f32::INFINITY)], 1, d);
    let out = forward(&q, &k, &v, &ForwardOptions::default().causal(true)).unwrap().o.to_f32_vec();
    for i in 0..sq {
        let row = &out[i * d..][..d];
        if i >= 5 {
            assert_eq!(row[3], f32::INFINITY, "row {i} sees key 5");
        } else {
            assert!(row.iter().all(|x| x.is_finite()), "row {i} does not see key 5: {row:?}");
        }
        assert!(row.iter().enumerate().all(|(c, x)| c == 3 || x.is_finite()));
    }
}

// ---------------------------------------------------------------- 7. thread counts

#[test]
fn absurd_thread_counts_are_capped_and_change_nothing() {
    let (q, k, v) = qkv(14, DType::F32, 2, 200, 150, 2, 1, 64);
    let opts = ForwardOptions::default().causal(true).return_lse(true);
    let one = forward(&q, &k, &v, &opts.clone().cpu_threads(1)).unwrap();
    for n in [1_000_000, usize::MAX] {
        let many = forward(&q, &k, &v, &opts.clone().cpu_threads(n)).unwrap();
        assert_eq!(one.o, many.o);
        assert_eq!(one.lse, many.lse);
    }
}

//! Named edge cases of the CPU backend against the float64 reference.

use crate::support::*;
use flash_attn::*;

#[allow(clippy::too_many_arguments)] // one positional parameter per dimension reads best in the cases below
fn qkv(seed: u64, dtype: DType, b: usize, sq: usize, sk: usize, hq: usize, hk: usize, d: usize) -> (Tensor, Tensor, Tensor) {
    let mut rng = Rng::new(seed);
    (
        randn(&mut rng, dtype, [b, sq, hq, d]),
        randn(&mut rng, dtype, [b, sk, hk, d]),
        randn(&mut rng, dtype, [b, sk, hk, d]),
    )
}

fn assert_close(q: &Tensor, k: &Tensor, v: &Tensor, opts: &ForwardOptions) -> Output {
    let (out, c) = check_forward(q, k, v, opts);
    assert!(c.err <= c.bound, "{c:?}");
    let lse_scale = out.lse.as_ref().map_or(1.0, |l| l.iter().filter(|x| x.is_finite()).fold(1.0f32, |a, x| a.max(x.abs())));
    assert!(c.lse_err <= 1e-4 * lse_scale as f64, "{c:?}");
    out
}

#[test]
fn decode_seqlen_q_1() {
    for dtype in [DType::F32, DType::BF16] {
        let (q, k, v) = qkv(1, dtype, 2, 1, 777, 8, 2, 128);
        for mask in [Mask::None, Mask::Causal, Mask::causal_window(100)] {
            assert_close(&q, &k, &v, &ForwardOptions::default().mask(mask).return_lse(true));
        }
    }
}

#[test]
fn causal_with_more_queries_than_keys_gives_zero_rows() {
    // Bottom-right alignment: with sq = 50 > sk = 20, query i sees keys j <= i - 30, so rows
    // 0..30 see nothing: output 0, LSE -inf, never NaN.
    let (q, k, v) = qkv(2, DType::F32, 1, 50, 20, 2, 2, 64);
    let out = assert_close(&q, &k, &v, &ForwardOptions::default().causal(true).return_lse(true));
    let o = out.o.to_f32_vec();
    let lse = out.lse.unwrap();
    for i in 0..50 {
        for h in 0..2 {
            let row = &o[(i * 2 + h) * 64..][..64];
            let l = lse[h * 50 + i];
            if i < 30 {
                assert!(row.iter().all(|&x| x == 0.0), "row {i} must be 0");
                assert_eq!(l, f32::NEG_INFINITY);
            } else {
                assert!(row.iter().any(|&x| x != 0.0) && l.is_finite());
            }
        }
    }
}

#[test]
fn causal_bottom_right_alignment_sq_lt_sk() {
    // sq = 3, sk = 5: the last query sees all 5 keys, the first sees 3.
    let (q, k, v) = qkv(3, DType::F32, 1, 3, 5, 1, 1, 32);
    let opts = ForwardOptions::default().causal(true);
    let p = Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
    assert_eq!(p.key_range(0), (0, 3));
    assert_eq!(p.key_range(2), (0, 5));
    assert_close(&q, &k, &v, &opts);
}

#[test]
fn all_equal_scores_average_v() {
    // q = 0 makes every score equal: the output is the mean of the visible V rows.
    let (_, k, v) = qkv(4, DType::F32, 1, 64, 64, 1, 1, 32);
    let q = Tensor::zeros(DType::F32, [1, 64, 1, 32]).unwrap();
    let out = assert_close(&q, &k, &v, &ForwardOptions::default().causal(true));
    let vv = v.to_f32_vec();
    let o = out.o.to_f32_vec();
    for i in [0usize, 10, 63] {
        for x in 0..32 {
            let mean: f32 = (0..=i).map(|j| vv[j * 32 + x]).sum::<f32>() / (i + 1) as f32;
            assert!((o[i * 32 + x] - mean).abs() < 1e-5);
        }
    }
}

#[test]
fn large_magnitude_scores_do_not_overflow() {
    // Scores of a few hundred (std 128 with scale 1): exp(s) overflows f32 (and exp(s) summed
    // overflows f64 past ~709) without the running max.
    let mut rng = Rng::new(5);
    let big: Vec<f32> = (0..200 * 2 * 64).map(|_| rng.normal() as f32 * 4.0).collect();
    let q = Tensor::from_vec(big.clone(), [1, 200, 2, 64]).unwrap();
    let k = Tensor::from_vec(big.iter().rev().cloned().collect(), [1, 200, 2, 64]).unwrap();
    let v = randn(&mut rng, DType::F32, [1, 200, 2, 64]);
    let out = assert_close(&q, &k, &v, &ForwardOptions::default().return_lse(true).softmax_scale(1.0));
    assert!(out.o.to_f32_vec().iter().all(|x| x.is_finite()));
    let lse = out.lse.unwrap();
    assert!(lse.iter().all(|x| x.is_finite()));
    assert!(lse.iter().any(|x| *x > 100.0), "the test must reach scores where exp overflows f32");
}

#[test]
fn window_with_causal() {
    let (q, k, v) = qkv(6, DType::BF16, 2, 257, 300, 4, 2, 96);
    for mask in [Mask::causal_window(0), Mask::causal_window(17), Mask::window(3, 0), Mask::window(0, 5)] {
        assert_close(&q, &k, &v, &ForwardOptions::default().mask(mask).return_lse(true));
    }
}

#[test]
fn window_that_excludes_everything_for_some_rows() {
    // sq > sk with a narrow window: rows whose band lies left of key 0 see nothing.
    let (q, k, v) = qkv(7, DType::F32, 1, 40, 10, 1, 1, 32);
    let out = assert_close(&q, &k, &v, &ForwardOptions::default().mask(Mask::window(2, 2)).return_lse(true));
    let lse = out.lse.unwrap();
    assert_eq!(lse[0], f32::NEG_INFINITY);
    assert!(lse[39].is_finite());
}

#[test]
fn strided_views_into_packed_qkv() {
    // A packed [b, s, 3, h, d] buffer: q, k, v are views with row stride 3·h·d.
    let (b, s, h, d) = (2, 70, 3, 64);
    let mut rng = Rng::new(8);
    let packed: Vec<f32> = (0..b * s * 3 * h * d).map(|_| rng.normal() as f32).collect();
    let strides = [s * 3 * h * d, 3 * h * d, d];
    let view = |which: usize| TensorView::with_strides(&packed[which * h * d..], [b, s, h, d], strides);
    let (qv, kv, vv) = (view(0), view(1), view(2));
    let opts = ForwardOptions::default().causal(true);
    let strided = forward(&qv, &kv, &vv, &opts).unwrap();
    // The same data copied contiguously must give the identical result.
    let copy = |which: usize| {
        let mut out = Vec::with_capacity(b * s * h * d);
        for bb in 0..b {
            for ss in 0..s {
                for hh in 0..h {
                    let off = which * h * d + bb * strides[0] + ss * strides[1] + hh * strides[2];
                    out.extend_from_slice(&packed[off..off + d]);
                }
            }
        }
        Tensor::from_vec(out, [b, s, h, d]).unwrap()
    };
    let (qc, kc, vc) = (copy(0), copy(1), copy(2));
    let contiguous = assert_close(&qc, &kc, &vc, &opts);
    assert_eq!(strided.o, contiguous.o);
}

#[test]
fn gqa_and_mqa_match_reference() {
    for (hq, hk) in [(8, 1), (8, 2), (7, 1), (12, 4)] {
        let (q, k, v) = qkv(9, DType::F16, 1, 65, 129, hq, hk, 64);
        assert_close(&q, &k, &v, &ForwardOptions::default().causal(true).return_lse(true));
    }
}

#[test]
fn nan_in_inputs_propagates_like_the_reference() {
    let (q, k, mut v) = qkv(10, DType::F32, 1, 16, 16, 1, 1, 32);
    let mut vv = v.to_f32_vec();
    vv[5 * 32 + 3] = f32::NAN; // key 5, column 3
    v = Tensor::from_vec(vv, [1, 16, 1, 32]).unwrap();
    let out = forward(&q, &k, &v, &ForwardOptions::default()).unwrap();
    let o = out.o.to_f32_vec();
    for i in 0..16 {
        // Every row sees key 5: NaN in column 3 only, as in the reference.
        assert!(o[i * 32 + 3].is_nan(), "row {i}");
        assert!(o[i * 32 + 4].is_finite());
    }
    // Causal: rows that see key 5 get NaN; rows that do not see it stay finite (the CPU skips
    // P = 0 when V holds a NaN: a row depends only on the keys it sees).
    let out = forward(&q, &k, &v, &ForwardOptions::default().causal(true)).unwrap();
    let o = out.o.to_f32_vec();
    assert!((5..16).all(|i| o[i * 32 + 3].is_nan()));
    assert!(o[..5 * 32].iter().all(|x| x.is_finite()), "rows 0..5 do not see key 5");
    let mut qq = q.to_f32_vec();
    qq[0] = f32::INFINITY;
    let q = Tensor::from_vec(qq, [1, 16, 1, 32]).unwrap();
    let out = forward(&q, &k, &v, &ForwardOptions::default()).unwrap();
    assert!(out.o.to_f32_vec()[..32].iter().all(|x| x.is_nan()), "an infinite query gives a NaN row, as in the reference");
}

#[test]
fn thread_count_does_not_change_the_result() {
    let (q, k, v) = qkv(11, DType::F32, 2, 300, 300, 4, 4, 128);
    let opts = ForwardOptions::default().causal(true);
    let one = forward(&q, &k, &v, &opts.clone().cpu_threads(1)).unwrap();
    let many = forward(&q, &k, &v, &opts.cpu_threads(3)).unwrap();
    assert_eq!(one.o, many.o);
}

//! The naive references: used only by tests, benches and examples to check the fast paths.
//!
//! [`attention_f64`] materialises the score matrix in float64 and is the ground truth.
//! [`attention_naive`] is "a straightforward implementation in the input precision" (as PyTorch
//! would compute it in that dtype): its error against float64 is the yardstick of
//! FlashAttention's tolerance rule, `max|ours - ref64| <= 2 * max|naive - ref64| + floor`.

use crate::problem::Problem;
use crate::tensor::{DType, TensorView};

/// Output of a reference: `o` as `[batch, seqlen_q, heads_q, head_dim]`, `lse` as
/// `[batch, heads_q, seqlen_q]` (natural log; −inf for rows that see no key).
#[derive(Clone, Debug)]
pub struct RefOutput {
    pub o: Vec<f64>,
    pub lse: Vec<f64>,
}

/// The score (natural units, after scale, softcap and ALiBi) of query row `qi` against key row
/// `kj`, or `None` when masked.
fn score64(p: &Problem, h: usize, i: usize, j: usize, q: &[f64], k: &[f64]) -> Option<f64> {
    if !p.visible(i, j) {
        return None;
    }
    let dot: f64 = q.iter().zip(k).map(|(a, b)| a * b).sum();
    let mut s = dot * p.scale as f64;
    if let Some(cap) = p.softcap {
        let cap = cap as f64;
        s = cap * (s / cap).tanh();
    }
    Some(s + p.alibi_bias(h, i, j) as f64)
}

fn row64(t: &TensorView, b: usize, s: usize, h: usize) -> Vec<f64> {
    let d = t.head_dim();
    let off = t.offset(b, s, h);
    (0..d).map(|x| t.data().get_f32(off + x) as f64).collect()
}

/// Float64 attention with the full score matrix per (batch, head).
pub fn attention_f64(p: &Problem, q: &TensorView, k: &TensorView, v: &TensorView) -> RefOutput {
    let d = p.head_dim;
    let mut o = vec![0.0f64; p.batch * p.seqlen_q * p.heads_q * d];
    let mut lse = vec![f64::NEG_INFINITY; p.batch * p.heads_q * p.seqlen_q];
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let hk = h / p.group();
            let ks: Vec<Vec<f64>> = (0..p.seqlen_k).map(|j| row64(k, b, j, hk)).collect();
            let vs: Vec<Vec<f64>> = (0..p.seqlen_k).map(|j| row64(v, b, j, hk)).collect();
            for i in 0..p.seqlen_q {
                let qi = row64(q, b, i, h);
                let s: Vec<Option<f64>> = (0..p.seqlen_k).map(|j| score64(p, h, i, j, &qi, &ks[j])).collect();
                let m = s.iter().flatten().fold(f64::NEG_INFINITY, |a, &x| if x > a || x.is_nan() { x } else { a });
                if m == f64::NEG_INFINITY {
                    continue; // no visible key (or all scores -inf): output 0, LSE -inf
                }
                let e: Vec<f64> = s.iter().map(|x| x.map_or(0.0, |x| (x - m).exp())).collect();
                let l: f64 = e.iter().sum();
                let out = &mut o[((b * p.seqlen_q + i) * p.heads_q + h) * d..][..d];
                for (j, ej) in e.iter().enumerate() {
                    if *ej != 0.0 || ej.is_nan() {
                        for (ox, vx) in out.iter_mut().zip(&vs[j]) {
                            *ox += ej * vx;
                        }
                    }
                }
                for ox in out.iter_mut() {
                    *ox /= l;
                }
                lse[(b * p.heads_q + h) * p.seqlen_q + i] = m + l.ln();
            }
        }
    }
    RefOutput { o, lse }
}

/// The straightforward implementation in `dtype`, as a framework computes it: S = QKᵀ with f32
/// accumulation rounded to `dtype`, the scale applied and rounded, softcap/ALiBi in f32 rounded,
/// softmax in f32 with P rounded to `dtype`, O = PV with f32 accumulation rounded to `dtype`.
/// Returns `o` as f64 for comparison.
pub fn attention_naive(p: &Problem, q: &TensorView, k: &TensorView, v: &TensorView, dtype: DType) -> Vec<f64> {
    let d = p.head_dim;
    let r = |x: f32| dtype.round(x);
    let row32 = |t: &TensorView, b, s, h| -> Vec<f32> {
        let mut out = vec![0.0f32; d];
        t.read_row(b, s, h, &mut out);
        out.iter().map(|&x| r(x)).collect()
    };
    let mut o = vec![0.0f64; p.batch * p.seqlen_q * p.heads_q * d];
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let hk = h / p.group();
            let ks: Vec<Vec<f32>> = (0..p.seqlen_k).map(|j| row32(k, b, j, hk)).collect();
            let vs: Vec<Vec<f32>> = (0..p.seqlen_k).map(|j| row32(v, b, j, hk)).collect();
            for i in 0..p.seqlen_q {
                let qi = row32(q, b, i, h);
                let s: Vec<f32> = (0..p.seqlen_k)
                    .map(|j| {
                        if !p.visible(i, j) {
                            return f32::NEG_INFINITY;
                        }
                        let dot: f32 = qi.iter().zip(&ks[j]).map(|(a, b)| a * b).sum();
                        let mut s = r(r(dot) * p.scale);
                        if let Some(cap) = p.softcap {
                            s = r(cap * (s / cap).tanh());
                        }
                        r(s + p.alibi_bias(h, i, j))
                    })
                    .collect();
                let m = s.iter().fold(f32::NEG_INFINITY, |a, &x| if x > a || x.is_nan() { x } else { a });
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let e: Vec<f32> = s.iter().map(|&x| (x - m).exp()).collect();
                let l: f32 = e.iter().sum();
                let out = &mut o[((b * p.seqlen_q + i) * p.heads_q + h) * d..][..d];
                let mut acc = vec![0.0f32; d];
                for (j, ej) in e.iter().enumerate() {
                    let pj = r(ej / l);
                    for (a, vx) in acc.iter_mut().zip(&vs[j]) {
                        *a += pj * vx;
                    }
                }
                for (ox, a) in out.iter_mut().zip(&acc) {
                    *ox = r(*a) as f64;
                }
            }
        }
    }
    o
}

/// Largest absolute difference, NaN-aware: a NaN on one side only counts as infinite error, a NaN
/// on both sides as none.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| match (x.is_nan(), y.is_nan()) {
            (true, true) => 0.0,
            (false, false) if x == y => 0.0,
            (false, false) => (x - y).abs(),
            _ => f64::INFINITY,
        })
        .fold(0.0, f64::max)
}

/// Root-mean-square difference.
pub fn rmse(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().max(1) as f64;
    (a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>() / n).sqrt()
}

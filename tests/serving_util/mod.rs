//! Helpers of the serving tests: per-sequence checks against the float64 reference.
#![allow(dead_code)]

use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff};
use flash_attn::{DType, ForwardOptions, Problem, Tensor};

/// The crate's deterministic generator (SplitMix64), so tests need no RNG crate.
pub use flash_attn::numerics::rng::SplitMix64 as Rng;

/// `n` normal values rounded to `dtype` (so every copy of them is exact).
pub fn values(rng: &mut Rng, n: usize, dtype: DType) -> Vec<f32> {
    (0..n).map(|_| dtype.round(rng.normal() as f32)).collect()
}

/// Floor of FlashAttention's tolerance rule per dtype (as tests/common).
pub fn floor_for(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

/// The observed margins of one sequence.
#[derive(Clone, Copy, Debug, Default)]
pub struct SeqCheck {
    pub err: f64,
    pub naive_err: f64,
    pub lse_err: f64,
}

/// Checks one sequence: `q` `[sq][hq][d]`, `k`, `v` `[sk][hkv][d]` (values already in `dtype`),
/// against our output rows `o` `[sq][hq][d]` and LSE `lse[h][i]` (when given), with
/// FlashAttention's rule `err <= 2·naive_err + floor` and LSE within 1e-4 relative.
#[allow(clippy::too_many_arguments)]
pub fn check_seq(
    dtype: DType,
    (sq, sk, hq, hkv, d): (usize, usize, usize, usize, usize),
    q: &[f32],
    k: &[f32],
    v: &[f32],
    opts: &ForwardOptions,
    o: &[f32],
    lse: Option<&dyn Fn(usize, usize) -> f32>,
) -> Result<SeqCheck, String> {
    if sq == 0 {
        return Ok(SeqCheck::default());
    }
    if sk == 0 {
        // No key at all: every row is 0 with LSE −inf.
        if o.iter().any(|&x| x != 0.0) {
            return Err("a sequence with no keys must give 0".into());
        }
        if let Some(l) = lse {
            for h in 0..hq {
                for i in 0..sq {
                    if l(h, i) != f32::NEG_INFINITY {
                        return Err(format!("lse[{h}][{i}] = {} for a sequence with no keys", l(h, i)));
                    }
                }
            }
        }
        return Ok(SeqCheck::default());
    }
    let qt = Tensor::from_f32(q, dtype, [1, sq, hq, d]).unwrap();
    let kt = Tensor::from_f32(k, dtype, [1, sk, hkv, d]).unwrap();
    let vt = Tensor::from_f32(v, dtype, [1, sk, hkv, d]).unwrap();
    let p = Problem::new(&qt.view(), &kt.view(), &vt.view(), opts).map_err(|e| e.to_string())?;
    let r = attention_f64(&p, &qt.view(), &kt.view(), &vt.view()).unwrap();
    let naive = attention_naive(&p, &qt.view(), &kt.view(), &vt.view(), dtype).unwrap();
    let ours: Vec<f64> = o.iter().map(|&x| x as f64).collect();
    let c = SeqCheck {
        err: max_abs_diff(&ours, &r.o),
        naive_err: max_abs_diff(&naive, &r.o),
        lse_err: match lse {
            Some(l) => {
                let mut worst = 0.0f64;
                for h in 0..hq {
                    for i in 0..sq {
                        let (got, want) = (l(h, i) as f64, r.lse[h * sq + i]);
                        let e = if got == want { 0.0 } else { (got - want).abs() / want.abs().max(1.0) };
                        worst = worst.max(if e.is_nan() { f64::INFINITY } else { e });
                    }
                }
                worst
            }
            None => 0.0,
        },
    };
    if c.err > 2.0 * c.naive_err + floor_for(dtype) {
        return Err(format!("output error {c:?} above 2·naive + {}", floor_for(dtype)));
    }
    if c.lse_err > 1e-4 {
        return Err(format!("lse error {c:?}"));
    }
    if o.iter().any(|x| !x.is_finite()) {
        return Err("finite inputs must give finite outputs".into());
    }
    Ok(c)
}

/// Rows `r0..r1` of a `[rows][heads][d]` buffer.
pub fn rows(x: &[f32], r0: usize, r1: usize, heads: usize, d: usize) -> Vec<f32> {
    x[r0 * heads * d..r1 * heads * d].to_vec()
}

/// ALiBi slopes for `hq` heads (the usual geometric sequence).
pub fn slopes(hq: usize) -> Vec<f32> {
    (0..hq).map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / hq as f32)).collect()
}

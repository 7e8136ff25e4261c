//! Measurement-only FP8 attentions (tests, examples, docs): the straightforward FP8 baseline of
//! FlashAttention-3's accuracy table, and our tiled FP8 kernel with a chosen P scale (the P-scale
//! ablation). Neither is used by `forward`.
//!
//! FA3's paper (§4.3, Table 3) describes its baseline row only as "Baseline FP8: per-tensor
//! scale, FP32 accumulator, softmax in FP16", next to a "Baseline FP16" row that is a naive
//! (non-FlashAttention) attention. It does not spell out more, so [`attention_naive_fp8`] is our
//! reading of it: what a framework computes when it runs an ordinary attention with FP8 matmuls.
//! Each step and why:
//!
//! 1. **Q, K, V to e4m3** with `quant::quantize_e4m3` and `scale = amax / 448` (round to nearest
//!    even, saturating). "Per-tensor" is [`Fp8Scaling::PerTensor`]: one scale per (batch, head),
//!    the granularity of our tiled per-tensor row, so the two rows differ only in the softmax and
//!    P handling. (One scale for the whole `[b, s, h, d]` tensor would be coarser still.)
//! 2. **S = Q8·K8ᵀ** over the e4m3 codes with an f32 accumulator, multiplied by the two descales
//!    and rounded to f16 (a scaled FP8 matmul with an f16 output), then multiplied by the softmax
//!    scale in f16 (softcap and ALiBi as in [`crate::reference::attention_naive`]).
//! 3. **Softmax in f16** as a framework's f16 softmax: f16 scores in, the row max subtracted,
//!    `exp` and the row sum in f32, `P = exp(s - m) / l` rounded to f16.
//! 4. **P to e4m3 as it is**: no `2^8` offset. P lies in [0, 1], so probabilities below
//!    `2^-6` land in e4m3's subnormals (step `2^-9`) and those below `2^-10` become 0: this is
//!    what a naive FP8 `P·V` matmul does, and the main difference from FA3's kernel, which
//!    multiplies P by `2^8` first (`FP8_P_SCALE_LOG2`).
//! 5. **O = P8·V8** with an f32 accumulator over V's codes, multiplied by V's descale (per block
//!    of V's scales, so per-block scaling is handled too), rounded to f16 (the output dtype).

use crate::numerics::exp2::exp2_poly_deg;
use crate::numerics::fp8::{e4m3_to_f32, round_e4m3};
use crate::numerics::hadamard::Rotation;
use crate::numerics::quant::{block_rows, fake_quantize, quantize_e4m3, QuantizedE4m3};
use crate::numerics::softmax_math::Exp2Math;
use crate::error::{Error, Operand, Result};
use crate::reference::{naive, NaiveSteps};
use crate::options::{Fp8Scaling, Precision};
use crate::problem::Problem;
use crate::tensor::{DType, TensorView};

/// Reads a `[b, s, h, d]` view into a contiguous f32 buffer (fallibly).
fn to_f32(x: &TensorView) -> Result<Vec<f32>> {
    let [b_n, s_n, h_n, d] = x.shape();
    let n = crate::tensor::check_size(x.shape(), 4, "f32 copy of an FP8 baseline operand")?;
    let mut buf = crate::tensor::try_filled(n, 0.0f32, || "f32 copy of an FP8 baseline operand".into())?;
    for b in 0..b_n {
        for s in 0..s_n {
            for h in 0..h_n {
                let at = ((b * s_n + s) * h_n + h) * d;
                x.read_row(b, s, h, &mut buf[at..at + d]);
            }
        }
    }
    Ok(buf)
}

fn quantize(x: &TensorView, scaling: Fp8Scaling) -> Result<QuantizedE4m3> {
    let shape = x.shape();
    quantize_e4m3(&to_f32(x)?, shape, block_rows(scaling, shape[1]))
}

/// The straightforward FP8 attention of FA3's "Baseline FP8" row, as we read it (see the module
/// docs for each step): Q, K, V in e4m3 with `scaling`, f32 accumulators, softmax in f16, P cast
/// to e4m3 unscaled. Returns `o` as f64 `[batch, seqlen_q, heads_q, head_dim]`, like
/// [`crate::reference::attention_naive`]. Rows with no visible key give 0.
///
/// # Errors
/// As [`crate::reference::attention_f64`]: views that do not match `p`, or buffers too large.
pub fn attention_naive_fp8(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    scaling: Fp8Scaling,
) -> Result<Vec<f64>> {
    attention_naive_fp8_p_scaled(p, q, k, v, scaling, 0.0)
}

/// [`attention_naive_fp8`] with P multiplied by `2^p_scale_log2` before its e4m3 cast and the
/// factor divided out of O afterwards (0 is the baseline; FA3's kernel uses 8). An ablation: it
/// separates the P scale from everything else that differs between the baseline and our kernel.
pub fn attention_naive_fp8_p_scaled(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    scaling: Fp8Scaling,
    p_scale_log2: f32,
) -> Result<Vec<f64>> {
    crate::reference::check_views(p, q, k, v)?;
    let steps = Fp8Steps {
        q: quantize(q, scaling)?,
        k: quantize(k, scaling)?,
        v: quantize(v, scaling)?,
        p_mul: p_scale_log2.exp2(),
    };
    naive(p, &steps)
}

/// The baseline's steps 2-5 (module docs) in terms of the one naive loop: e4m3 codes, descaled
/// products, an f16 softmax and P cast to e4m3 after `p_mul`.
struct Fp8Steps {
    q: QuantizedE4m3,
    k: QuantizedE4m3,
    v: QuantizedE4m3,
    p_mul: f32,
}

impl NaiveSteps for Fp8Steps {
    fn dtype(&self) -> DType {
        DType::F16
    }
    fn row(&self, which: Operand, b: usize, s: usize, h: usize) -> Vec<f32> {
        let t = match which {
            Operand::Q => &self.q,
            Operand::K => &self.k,
            _ => &self.v,
        };
        let [_, s_n, h_n, d] = t.shape;
        let at = ((b * s_n + s) * h_n + h) * d;
        t.codes[at..at + d].iter().map(|&c| e4m3_to_f32(c)).collect()
    }
    fn qk_descale(&self, b: usize, i: usize, h: usize, j: usize, hk: usize) -> f32 {
        self.q.scale(b, i, h) * self.k.scale(b, j, hk)
    }
    fn p_cast(&self, p: f32) -> f32 {
        round_e4m3(p * self.p_mul)
    }
    fn v_block_rows(&self) -> usize {
        self.v.block_rows
    }
    fn v_descale(&self, b: usize, j: usize, hk: usize) -> f32 {
        self.v.scale(b, j, hk) / self.p_mul
    }
}

/// Our tiled FP8 kernel's arithmetic (accurate exp2, eager rescale, P in e4m3) with P offset by
/// `2^p_scale_log2` instead of the fixed `2^FP8_P_SCALE_LOG2`.
#[derive(Clone, Copy)]
struct PScaled {
    log2: f32,
}

impl Exp2Math for PScaled {
    fn p_offset(&self) -> f32 {
        self.log2
    }
    fn exp2(&self, x: f32) -> f32 {
        exp2_poly_deg(x, crate::numerics::softmax_math::ACCURATE_DEGREE)
    }
    fn round_p(&self, p: f32) -> f32 {
        round_e4m3(p)
    }
    fn lazy_threshold(&self) -> Option<f32> {
        None
    }
}

/// The CPU backend's tiled FP8 pipeline for `p.precision` (which must be `Fp8`), with P scaled
/// by `2^p_scale_log2` before its e4m3 cast (`0 <= p_scale_log2 < log2(448)`, so P = 1 does not
/// saturate), accurate exp2 and eager rescaling. With 8 it equals `forward`'s FP8 result; 0 is
/// the unscaled-P ablation. Returns `o` as f64 `[batch, seqlen_q, heads_q, head_dim]`.
pub fn tiled_fp8_with_p_scale(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    p_scale_log2: f32,
) -> Result<Vec<f64>> {
    let Precision::Fp8 { scaling, hadamard } = p.precision else {
        return Err(Error::InvalidOption {
            option: "precision of the P-scale ablation",
            got: format!("{:?}", p.precision),
            expected: "Precision::Fp8 { .. }".into(),
        });
    };
    let limit = crate::numerics::fp8::E4M3_MAX.log2();
    if !(0.0..limit).contains(&p_scale_log2) {
        return Err(Error::InvalidOption {
            option: "P scale (log2)",
            got: p_scale_log2.to_string(),
            expected: format!("a value in [0, {limit:.4}): above it P = 1 saturates in e4m3"),
        });
    }
    crate::reference::check_views(p, q, k, v)?;
    let rot = hadamard.and_then(|seed| Rotation::new(p.head_dim, seed));
    let q8 = fake_quantize(q, scaling, rot.as_ref())?;
    let k8 = fake_quantize(k, scaling, rot.as_ref())?;
    let v8 = fake_quantize(v, scaling, None)?;
    let math = PScaled { log2: p_scale_log2 };
    let out = crate::cpu::forward_with(p, &q8.view(), &k8.view(), &v8.view(), math, crate::cpu::threads(None))?;
    Ok(out.o.to_f32_vec().iter().map(|&x| x as f64).collect())
}

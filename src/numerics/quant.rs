//! Quantisation of `[batch, seqlen, heads, head_dim]` tensors to e4m3 with one f32 scale per
//! (batch, head, block of `block_rows` sequence positions): FlashAttention-3's block
//! quantisation. Per-tensor scaling (one scale per batch × head, as FA3's released code) is the
//! same with one block covering the whole sequence. Mirrored by `cuda/common/fp8.cuh`.
//!
//! `scale = amax / 448` so the block's largest magnitude lands on e4m3's largest value; a block
//! of zeros gets scale 1 (its codes are 0 either way) instead of a 0/0. The code of `x` is
//! `e4m3(x / scale)`; the value it stands for is `code * scale`.
//!
//! Infinities and NaNs: `amax` is taken over the block's finite values, so one infinity does not
//! turn the block's scale (and with it every value of the block, `code · inf`) into NaN. A NaN
//! stays NaN (e4m3 has a NaN code); ±inf saturates to ±448 (satfinite, e4m3 has no infinity),
//! i.e. to the block's largest finite magnitude.

use super::fp8::{e4m3_from_f32, e4m3_to_f32, E4M3_MAX};
use super::hadamard::Rotation;
use crate::error::{Error, Result};
use crate::options::Fp8Scaling;
use crate::tensor::{numel, try_filled, Tensor, TensorView};

/// The scale of a block whose largest finite magnitude is `amax`: `amax / 448`, or 1 when that is
/// not a positive finite number (an all-zero block, an `amax` so small that `amax / 448`
/// underflows to 0, or a non-finite `amax`), so that `x / scale` is never a division by 0 or by
/// infinity.
#[inline]
pub fn block_scale(amax: f32) -> f32 {
    let s = amax / E4M3_MAX;
    if s > 0.0 && amax.is_finite() {
        s
    } else {
        1.0
    }
}

/// The largest finite magnitude of `x` (0 when it has none): the `amax` of [`block_scale`]. NaN
/// and ±inf are left out, so that one of them does not decide the scale of every finite value.
#[inline]
pub fn finite_amax(x: &[f32]) -> f32 {
    // NaN fails the comparison; infinity is excluded.
    x.iter().fold(0.0f32, |m, &v| {
        let a = v.abs();
        if a > m && a != f32::INFINITY {
            a
        } else {
            m
        }
    })
}

/// Encodes `x / scale` as e4m3 into `codes` (satfinite: ±inf and anything past ±448 become
/// ±448; NaN stays NaN), the code of each value as [`quantize_e4m3`] makes it.
#[inline]
pub fn encode_e4m3(x: &[f32], scale: f32, codes: &mut [u8]) {
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = e4m3_from_f32(v / scale);
    }
}

/// Rows per scale block for `scaling` over a sequence of `seqlen` positions.
pub fn block_rows(scaling: Fp8Scaling, seqlen: usize) -> usize {
    match scaling {
        Fp8Scaling::PerTensor => seqlen.max(1),
        Fp8Scaling::PerBlock { rows } => rows.max(1),
    }
}

/// An e4m3 tensor with its scales.
#[derive(Clone, Debug)]
pub struct QuantizedE4m3 {
    /// `[batch, seqlen, heads, head_dim]`.
    pub shape: [usize; 4],
    pub block_rows: usize,
    /// e4m3 codes, contiguous `[batch, seqlen, heads, head_dim]`.
    pub codes: Vec<u8>,
    /// `[batch, heads, blocks]`, `blocks = ceil(seqlen / block_rows)`.
    pub scales: Vec<f32>,
}

impl QuantizedE4m3 {
    pub fn blocks(&self) -> usize {
        self.shape[1].div_ceil(self.block_rows)
    }

    /// The scale that applies to position `s` of head `h` in batch `b`.
    pub fn scale(&self, b: usize, s: usize, h: usize) -> f32 {
        self.scales[(b * self.shape[2] + h) * self.blocks() + s / self.block_rows]
    }

    /// The values the codes stand for, `code * scale`, as f32 `[batch, seqlen, heads, head_dim]`.
    ///
    /// A kernel keeps the codes and multiplies the f32 accumulator by the descales instead
    /// (`(Σ qc·kc)·sq·sk`); the two differ only by f32 rounding (relative 2^-24), far below
    /// e4m3's own step (2^-4).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the fields are inconsistent (codes or scales of the wrong
    /// length, `block_rows == 0`), [`Error::TooLarge`] when the output cannot be allocated.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        let [b_n, s_n, h_n, d] = self.shape;
        let n = numel(self.shape, "dequantized tensor")?;
        let n_scales = (self.block_rows > 0)
            .then(|| b_n.checked_mul(h_n)?.checked_mul(self.blocks()))
            .flatten();
        if self.codes.len() != n || n_scales != Some(self.scales.len()) {
            return Err(Error::ShapeMismatch {
                what: "QuantizedE4m3".into(),
                got: format!("{} codes, {} scales, block_rows {}", self.codes.len(), self.scales.len(), self.block_rows),
                expected: format!("{n} codes and [batch, heads, blocks] scales for shape {:?}", self.shape),
            });
        }
        let mut out = try_filled(n, 0.0f32, || "dequantized tensor".into())?;
        for b in 0..b_n {
            for s in 0..s_n {
                for h in 0..h_n {
                    let sc = self.scale(b, s, h);
                    let base = ((b * s_n + s) * h_n + h) * d;
                    for (o, &c) in out[base..base + d].iter_mut().zip(&self.codes[base..base + d]) {
                        *o = e4m3_to_f32(c) * sc;
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Quantises a contiguous `[batch, seqlen, heads, head_dim]` f32 buffer.
///
/// # Errors
/// [`Error::ShapeMismatch`] when `x.len()` is not the shape's element count,
/// [`Error::TooLarge`] when the codes or scales cannot be allocated.
pub fn quantize_e4m3(x: &[f32], shape: [usize; 4], block_rows: usize) -> Result<QuantizedE4m3> {
    let [b_n, s_n, h_n, d] = shape;
    let n = numel(shape, "tensor to quantise")?;
    if x.len() != n {
        return Err(Error::ShapeMismatch {
            what: "quantize_e4m3 input".into(),
            got: format!("{} elements", x.len()),
            expected: format!("{n} elements for shape {shape:?}"),
        });
    }
    let block_rows = block_rows.max(1);
    let blocks = s_n.div_ceil(block_rows);
    // At most one scale per element (blocks <= seqlen), so this product fits when n does.
    let mut codes = try_filled(n, 0u8, || "e4m3 codes".into())?;
    let mut scales = try_filled(b_n * h_n * blocks, 1.0f32, || "e4m3 block scales".into())?;
    for b in 0..b_n {
        for h in 0..h_n {
            for blk in 0..blocks {
                let rows = blk * block_rows..((blk + 1) * block_rows).min(s_n);
                let row_at = |s: usize| ((b * s_n + s) * h_n + h) * d;
                let amax = rows.clone().map(|s| finite_amax(&x[row_at(s)..row_at(s) + d])).fold(0.0, f32::max);
                let sc = block_scale(amax);
                scales[(b * h_n + h) * blocks + blk] = sc;
                for s in rows {
                    encode_e4m3(&x[row_at(s)..row_at(s) + d], sc, &mut codes[row_at(s)..row_at(s) + d]);
                }
            }
        }
    }
    Ok(QuantizedE4m3 { shape, block_rows, codes, scales })
}

/// FP8 preprocessing of one operand as the CPU backend runs it: read to f32, rotate each row (Q
/// and K when Hadamard is on), quantise with `scaling`, and return the dequantised values as an
/// f32 tensor ("fake quantisation": the same values an FP8 kernel multiplies, in f32).
///
/// # Errors
/// The view's layout is checked as `forward` checks q's (errors name the operand `q`);
/// [`Error::TooLarge`] when the operand's f32 copy cannot be allocated (the view is read in full,
/// a broadcast one by its logical size).
pub fn fake_quantize(x: &TensorView, scaling: Fp8Scaling, rotation: Option<&Rotation>) -> Result<Tensor> {
    let shape = x.shape();
    let [b_n, s_n, h_n, d] = shape;
    x.check_layout(crate::error::Operand::Q)?;
    let n = crate::tensor::check_size(shape, 4, "f32 copy of an FP8 operand")?;
    let mut buf = try_filled(n, 0.0f32, || format!("f32 copy of an FP8 operand of shape {shape:?}"))?;
    for b in 0..b_n {
        for s in 0..s_n {
            for h in 0..h_n {
                let at = ((b * s_n + s) * h_n + h) * d;
                x.read_row(b, s, h, &mut buf[at..at + d]);
            }
        }
    }
    if let Some(r) = rotation {
        r.apply_rows(&mut buf);
    }
    let qz = quantize_e4m3(&buf, shape, block_rows(scaling, s_n))?;
    drop(buf);
    Tensor::from_vec(qz.dequantize()?, shape)
}

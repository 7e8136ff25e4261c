//! Quantisation of `[batch, seqlen, heads, head_dim]` tensors to e4m3 with one f32 scale per
//! (batch, head, block of `block_rows` sequence positions): FlashAttention-3's block
//! quantisation. Per-tensor scaling (one scale per batch × head, as FA3's released code) is the
//! same with one block covering the whole sequence. Mirrored by `cuda/include/fp8.cuh`.
//!
//! `scale = amax / 448` so the block's largest magnitude lands on e4m3's largest value; a block
//! of zeros gets scale 1 (its codes are 0 either way) instead of a 0/0. The code of `x` is
//! `e4m3(x / scale)`; the value it stands for is `code * scale`.

use super::fp8::{e4m3_from_f32, e4m3_to_f32, E4M3_MAX};
use super::hadamard::Rotation;
use crate::error::Result;
use crate::options::Fp8Scaling;
use crate::tensor::{Tensor, TensorView};

/// The scale of a block whose largest magnitude is `amax` (1 for an all-zero block; NaN
/// propagates through the codes instead).
#[inline]
pub fn block_scale(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / E4M3_MAX
    } else {
        1.0
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
    pub fn dequantize(&self) -> Vec<f32> {
        let [b_n, s_n, h_n, d] = self.shape;
        let mut out = vec![0.0f32; self.codes.len()];
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
        out
    }
}

/// Quantises a contiguous `[batch, seqlen, heads, head_dim]` f32 buffer.
pub fn quantize_e4m3(x: &[f32], shape: [usize; 4], block_rows: usize) -> QuantizedE4m3 {
    let [b_n, s_n, h_n, d] = shape;
    assert_eq!(x.len(), b_n * s_n * h_n * d, "buffer length must match the shape");
    let block_rows = block_rows.max(1);
    let blocks = s_n.div_ceil(block_rows);
    let mut codes = vec![0u8; x.len()];
    let mut scales = vec![1.0f32; b_n * h_n * blocks];
    for b in 0..b_n {
        for h in 0..h_n {
            for blk in 0..blocks {
                let rows = blk * block_rows..((blk + 1) * block_rows).min(s_n);
                let row_at = |s: usize| ((b * s_n + s) * h_n + h) * d;
                let mut amax = 0.0f32;
                for s in rows.clone() {
                    for &v in &x[row_at(s)..row_at(s) + d] {
                        let a = v.abs();
                        amax = if a > amax { a } else { amax };
                    }
                }
                let sc = block_scale(amax);
                scales[(b * h_n + h) * blocks + blk] = sc;
                for s in rows {
                    for i in row_at(s)..row_at(s) + d {
                        codes[i] = e4m3_from_f32(x[i] / sc);
                    }
                }
            }
        }
    }
    QuantizedE4m3 { shape, block_rows, codes, scales }
}

/// FP8 preprocessing of one operand as the CPU backend runs it: read to f32, rotate each row (Q
/// and K when Hadamard is on), quantise with `scaling`, and return the dequantised values as an
/// f32 tensor ("fake quantisation": the same values an FP8 kernel multiplies, in f32).
pub fn fake_quantize(x: &TensorView, scaling: Fp8Scaling, rotation: Option<&Rotation>) -> Result<Tensor> {
    let shape = x.shape();
    let [b_n, s_n, h_n, d] = shape;
    let mut buf = vec![0.0f32; b_n * s_n * h_n * d];
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
    let qz = quantize_e4m3(&buf, shape, block_rows(scaling, s_n));
    Tensor::from_vec(qz.dequantize(), shape)
}

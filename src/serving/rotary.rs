//! Rotary position embedding in the KV append (FlashAttention's `rotary_cos`, `rotary_sin`,
//! `rotary_interleaved` of `flash_attn_with_kvcache`): the tables, their validation, the
//! positions each row rotates at, and the rotation of one row.

use crate::error::{Error, Result};
use crate::tensor::{Tensor, TensorView};

/// The rotary embedding of an append: `cos`, `sin` are row-major `[seqlen_ro, rotary_dim / 2]`
/// tables; position `p` turns feature pair `t` by the angle whose cosine and sine are
/// `cos[p][t]`, `sin[p][t]`. Only the first `rotary_dim` features of each head rotate (the rest
/// pass through), `rotary_dim` even and at most head_dim.
///
/// `interleaved` pairs adjacent features `(2t, 2t + 1)` (GPT-J; FlashAttention's
/// `rotary_interleaved=True`, its default), otherwise feature `t` with `t + rotary_dim / 2`
/// (GPT-NeoX). FlashAttention takes tables in q's dtype: widened to f32 they are these exact
/// values, and the rotation is computed in f32 and rounded to the dtype once, as its kernels do.
#[derive(Clone, Copy, Debug)]
pub struct Rotary<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub rotary_dim: usize,
    pub interleaved: bool,
}

impl<'a> Rotary<'a> {
    /// Tables `[seqlen_ro, rotary_dim / 2]` (row-major) with the pairing `interleaved`.
    pub fn new(cos: &'a [f32], sin: &'a [f32], rotary_dim: usize, interleaved: bool) -> Self {
        Rotary {
            cos,
            sin,
            rotary_dim,
            interleaved,
        }
    }

    /// Rows of the tables (positions they cover), once [`Rotary::check`] passed.
    pub(super) fn seqlen_ro(&self) -> usize {
        self.cos.len() / (self.rotary_dim / 2)
    }

    /// Checks the tables against the head dimension: `rotary_dim` even, in `2..=head_dim`, both
    /// tables `[seqlen_ro, rotary_dim / 2]`.
    pub(super) fn check(&self, head_dim: usize) -> Result<()> {
        crate::rotary_positions::check_dim(self.rotary_dim, head_dim)?;
        let half = self.rotary_dim / 2;
        for (option, t) in [("rotary_cos", self.cos), ("rotary_sin", self.sin)] {
            if !t.len().is_multiple_of(half) || t.len() != self.cos.len() {
                return Err(Error::InvalidOption {
                    option,
                    got: format!("{} values", t.len()),
                    expected: format!(
                        "[seqlen_ro, rotary_dim / 2 = {half}] row-major, cos and sin of one shape ({} values in cos)",
                        self.cos.len()
                    ),
                });
            }
        }
        Ok(())
    }

    /// Rotates the first `rotary_dim` features of `row` (one head) to position `pos`, in f32.
    pub(crate) fn rotate(&self, row: &mut [f32], pos: usize) {
        let half = self.rotary_dim / 2;
        let (cos, sin) = (&self.cos[pos * half..][..half], &self.sin[pos * half..][..half]);
        for t in 0..half {
            let (a, b) = if self.interleaved { (2 * t, 2 * t + 1) } else { (t, t + half) };
            let (x0, x1, c, s) = (row[a], row[b], cos[t], sin[t]);
            row[a] = x0 * c - x1 * s;
            row[b] = x0 * s + x1 * c;
        }
    }
}

/// A rotated copy of q `[batch, seqlen_q, heads_q, head_dim]` in q's dtype (the caller's
/// buffer is not touched): row `i` of sequence `b` at `seqlens[b] + i` when `advance`, else at
/// `seqlens[b]`.
pub(super) fn rotated_q(q: &TensorView<'_>, rot: &Rotary<'_>, seqlens: &[i32], advance: bool) -> Result<Tensor> {
    let [batch, sq, hq, d] = q.shape();
    let mut vals = crate::tensor::try_filled(batch * sq * hq * d, 0.0f32, || "rotated q".into())?;
    let mut rows = vals.chunks_exact_mut(d);
    for (b, &s) in seqlens.iter().enumerate().take(batch) {
        for i in 0..sq {
            let pos = s as usize + if advance { i } else { 0 };
            for h in 0..hq {
                let Some(row) = rows.next() else { break };
                q.read_row(b, i, h, row);
                rot.rotate(row, pos);
            }
        }
    }
    Tensor::from_f32(&vals, q.dtype(), q.shape())
}

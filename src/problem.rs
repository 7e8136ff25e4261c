//! Validation of a forward call into a [`Problem`]: the resolved shape and options every backend
//! (and the reference) works from. Nothing runs before this succeeds.

use crate::error::{Error, Operand, Result};
use crate::options::{Exp2, ForwardOptions, Mask, Precision, Rescale};
use crate::tensor::{DType, TensorView};
use std::sync::Arc;

/// `log2(e)`: scores are pre-multiplied by it so the softmax uses `exp2`.
pub const LOG2E: f32 = std::f32::consts::LOG2_E;

/// A validated forward problem.
#[derive(Clone, Debug)]
pub struct Problem {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub dtype: DType,
    /// Softmax scale in natural units (multiplies q·k).
    pub scale: f32,
    /// Keys visible to query `i`: `i + off - left ..= i + off + right`, `off = seqlen_k -
    /// seqlen_q`; `None` is unbounded.
    pub left: Option<usize>,
    pub right: Option<usize>,
    pub softcap: Option<f32>,
    pub alibi: Option<Arc<[f32]>>,
    pub return_lse: bool,
    pub precision: Precision,
    pub exp2: Exp2,
    pub rescale: Rescale,
    /// The FA3 stage requested with `Variant::Fa3` (validated: 1..=FA3_MAX_STAGE).
    pub fa3_stage: Option<u8>,
}

/// Stages of the FA3 ladder (cuda/fa3_fwd_sm90.cu); the CUDA dispatch tests check it against
/// the kernel table's `FA3_MAX_STAGE`.
pub(crate) const FA3_MAX_STAGE: u8 = 5;

impl Problem {
    /// Validates q, k, v and the options. Every refusal is a typed error.
    pub fn new(q: &TensorView, k: &TensorView, v: &TensorView, opts: &ForwardOptions) -> Result<Self> {
        q.check_layout(Operand::Q)?;
        k.check_layout(Operand::K)?;
        v.check_layout(Operand::V)?;
        let dtype = q.dtype();
        for (op, t) in [(Operand::K, k), (Operand::V, v)] {
            if t.dtype() != dtype {
                return Err(Error::DTypeMismatch { operand: op, got: t.dtype(), expected: dtype });
            }
        }
        Self::from_shapes(q.shape(), k.shape(), v.shape(), dtype, opts)
    }

    /// Validates shapes and options alone, for callers that checked the memory layout themselves
    /// (the CUDA engine's device tensors). Allocates nothing.
    pub(crate) fn from_shapes(
        q_shape: crate::tensor::Shape,
        k_shape: crate::tensor::Shape,
        v_shape: crate::tensor::Shape,
        dtype: DType,
        opts: &ForwardOptions,
    ) -> Result<Self> {
        let [batch, seqlen_q, heads_q, head_dim] = q_shape;
        let [kb, seqlen_k, heads_kv, kd] = k_shape;
        if kb != batch || kd != head_dim {
            return Err(Error::ShapeMismatch {
                what: "k".into(),
                got: format!("{k_shape:?}"),
                expected: format!("[{batch}, seqlen_k, heads_kv, {head_dim}] (batch and head_dim of q)"),
            });
        }
        if v_shape != k_shape {
            return Err(Error::ShapeMismatch {
                what: "v".into(),
                got: format!("{v_shape:?}"),
                expected: format!("{k_shape:?} (the shape of k)"),
            });
        }
        if heads_q % heads_kv != 0 {
            return Err(Error::HeadsNotDivisible { heads_q, heads_kv });
        }
        let scale = opts.softmax_scale.unwrap_or(1.0 / (head_dim as f32).sqrt());
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::InvalidSoftmaxScale(scale));
        }
        let (left, right) = resolve_mask(opts.mask)?;
        if let Some(cap) = opts.softcap {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(Error::InvalidSoftcap(cap));
            }
        }
        if let Some(slopes) = &opts.alibi_slopes {
            if slopes.len() != heads_q {
                return Err(Error::InvalidAlibi {
                    got: slopes.len(),
                    expected: heads_q,
                    reason: "wrong length".into(),
                });
            }
            if slopes.iter().any(|s| !s.is_finite()) {
                return Err(Error::InvalidAlibi {
                    got: slopes.len(),
                    expected: heads_q,
                    reason: "a slope is not finite".into(),
                });
            }
        }
        crate::numerics::validate(opts.precision, opts.exp2, opts.rescale, head_dim)?;
        if let Some(stage) = opts.fa3_stage {
            if opts.variant != crate::options::Variant::Fa3 {
                return Err(Error::InvalidOption {
                    option: "fa3_stage",
                    got: format!("{stage} with Variant::{:?}", opts.variant),
                    expected: "Variant::Fa3 (a stage of the FA3 ladder runs only when FA3 is requested)".into(),
                });
            }
            if !(1..=FA3_MAX_STAGE).contains(&stage) {
                return Err(Error::InvalidOption {
                    option: "fa3_stage",
                    got: stage.to_string(),
                    expected: format!("1..={FA3_MAX_STAGE}"),
                });
            }
        }
        Ok(Problem {
            batch,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
            dtype,
            scale,
            left,
            right,
            softcap: opts.softcap,
            alibi: opts.alibi_slopes.clone(),
            return_lse: opts.return_lse,
            precision: opts.precision,
            exp2: opts.exp2,
            rescale: opts.rescale,
            fa3_stage: opts.fa3_stage,
        })
    }

    /// Query heads per KV head (1 for MHA).
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// Keys `[lo, hi)` visible to query row `i` (empty when `lo >= hi`).
    pub fn key_range(&self, i: usize) -> (usize, usize) {
        // Positions in i64: seqlens fit (they index memory), and the sums cannot overflow.
        let diag = i as i64 + self.seqlen_k as i64 - self.seqlen_q as i64;
        let lo = match self.left {
            Some(l) => (diag - l as i64).max(0),
            None => 0,
        };
        let hi = match self.right {
            Some(r) => (diag + r as i64 + 1).clamp(0, self.seqlen_k as i64),
            None => self.seqlen_k as i64,
        };
        (lo.min(self.seqlen_k as i64) as usize, hi as usize)
    }

    /// Whether query `i` sees key `j`, written straight from the definition.
    pub fn visible(&self, i: usize, j: usize) -> bool {
        let rel = j as i64 - (i as i64 + self.seqlen_k as i64 - self.seqlen_q as i64);
        self.left.is_none_or(|l| rel >= -(l as i64)) && self.right.is_none_or(|r| rel <= r as i64)
    }

    /// The ALiBi bias of (head, i, j) in natural units (0 without ALiBi).
    pub fn alibi_bias(&self, head: usize, i: usize, j: usize) -> f32 {
        match &self.alibi {
            Some(s) => {
                let rel = (i as i64 + self.seqlen_k as i64 - self.seqlen_q as i64 - j as i64).abs();
                -s[head] * rel as f32
            }
            None => 0.0,
        }
    }

    /// Exact number of visible (query, key) pairs summed over batch and heads.
    pub fn visible_pairs(&self) -> u64 {
        let per_head: u64 = (0..self.seqlen_q)
            .map(|i| {
                let (lo, hi) = self.key_range(i);
                hi.saturating_sub(lo) as u64
            })
            .sum();
        per_head * (self.batch * self.heads_q) as u64
    }
}

/// Turns a [`Mask`] into (left, right) bounds, `None` meaning unbounded.
fn resolve_mask(mask: Mask) -> Result<(Option<usize>, Option<usize>)> {
    let bound = |side: &'static str, value: i64| -> Result<Option<usize>> {
        match value {
            -1 => Ok(None),
            v if v < -1 => Err(Error::NegativeWindow { side, value }),
            v => Ok(Some(v as usize)),
        }
    };
    match mask {
        Mask::None => Ok((None, None)),
        Mask::Causal => Ok((None, Some(0))),
        Mask::Window { left, right, causal } => {
            let l = bound("left", left)?;
            let r = bound("right", right)?;
            if causal {
                match r {
                    None | Some(0) => Ok((l, Some(0))),
                    Some(r) => Err(Error::InconsistentWindow(format!(
                        "causal with right = {r}; a causal window has right = 0 (or -1)"
                    ))),
                }
            } else {
                Ok((l, r))
            }
        }
    }
}

//! Validation of a forward call into a [`Problem`]: the resolved shape and options every backend
//! (and the reference) works from. Nothing runs before this succeeds.

use crate::error::{Error, Operand, Result};
use crate::numerics::softmax_math::{SoftmaxMath, ACCURATE_DEGREE};
use crate::options::{Exp2, ForwardOptions, Mask, Precision, Rescale};
use crate::tensor::{DType, TensorView};
use std::sync::Arc;

/// `log2(e)`: score differences are multiplied by it so the softmax uses `exp2`.
pub const LOG2E: f32 = std::f32::consts::LOG2_E;

/// The smallest softmax scale accepted, `2^-120`. Below it a difference of two f32 dot products
/// that overflows (|q·k| near `f32::MAX`) no longer implies a negligible probability, and the
/// backends take differences of raw dot products (`(x - max) · scale · log2 e`).
pub const MIN_SOFTMAX_SCALE: f32 = f32::from_bits((127 - 120) << 23); // 2^-120

/// A validated forward problem.
#[derive(Clone, Debug)]
pub struct Problem {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    /// head_dim of q and k (the dot products' length).
    pub head_dim: usize,
    /// head_dim of v and of the output o (DeepSeek's MLA: 128 beside a q/k head_dim of 192).
    /// Equal to `head_dim` unless v's last dimension differs.
    pub head_dim_v: usize,
    pub dtype: DType,
    /// Softmax scale in natural units (multiplies q·k).
    pub scale: f32,
    /// Keys visible to query `i`: `i + off - left ..= i + off + right`, `off = seqlen_k -
    /// seqlen_q`; `None` is unbounded. [`Problem::new`] clamps a bound to the sequence
    /// (`left <= seqlen_k`, `right <= seqlen_q`): larger bounds, up to `i64::MAX`, see the same
    /// keys, and every backend then works with positions that fit its integers.
    pub left: Option<usize>,
    pub right: Option<usize>,
    pub softcap: Option<f32>,
    pub alibi: Option<Arc<[f32]>>,
    /// One sink logit per query head (natural units), validated: finite or −inf, `heads_q` of
    /// them; `None` when none was given or every one is −inf (no sink).
    pub sinks: Option<Arc<[f32]>>,
    pub return_lse: bool,
    pub precision: Precision,
    pub exp2: Exp2,
    pub rescale: Rescale,
    /// The FA3 stage requested with `Variant::Fa3` (validated: 1..=FA3_MAX_STAGE).
    pub fa3_stage: Option<u8>,
    /// The FA4 stage requested with `Variant::Fa4` (validated: 1..=FA4_MAX_STAGE).
    pub fa4_stage: Option<u8>,
    /// The software-exp2 share (one element in n) requested with `Variant::Fa4`.
    pub fa4_exp2_share: Option<u32>,
}

/// The units scores are formed in, and the factors out of them: the one statement of the rule
/// every backend follows (the CPU's `cpu::softmax`, the kernels' `softmax_scale_log2`).
///
/// With softcap or ALiBi the score is in natural units (`scale · q·k`, then the cap, then the
/// bias); otherwise it is the raw dot product `q·k`, and the scale is folded into the factors.
/// Exponents are always formed from differences in score units, `(s - max) · to_log2`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ScoreUnits {
    /// Scores are in natural units (softcap or ALiBi on).
    pub natural: bool,
    /// Score units to log2 units: `log2 e` for natural units, `scale · log2 e` for raw q·k.
    pub to_log2: f32,
    /// Score units to natural units (for the LSE): 1, or `scale`.
    pub to_natural: f32,
}

/// Stages of the FA3 ladder (cuda/fa3_fwd_sm90.cu); the CUDA dispatch tests check it against
/// the kernel table's `FA3_MAX_STAGE`.
pub(crate) const FA3_MAX_STAGE: u8 = 5;
/// Stages of the FA4 ladder (cuda/fa4_fwd_sm100.cu) built so far; checked against the kernel
/// table's `FA4_MAX_STAGE` by the CUDA dispatch tests.
pub(crate) const FA4_MAX_STAGE: u8 = 3;

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
        // v may have its own head_dim (the output's); every other dimension is k's.
        let head_dim_v = v_shape[3];
        if v_shape[..3] != k_shape[..3] {
            return Err(Error::ShapeMismatch {
                what: "v".into(),
                got: format!("{v_shape:?}"),
                expected: format!(
                    "{k_shape:?} (the shape of k), or [{kb}, {seqlen_k}, {heads_kv}, head_dim_v] for a head_dim of v's own"
                ),
            });
        }
        if heads_q % heads_kv != 0 {
            return Err(Error::HeadsNotDivisible { heads_q, heads_kv });
        }
        // Every backend materialises (or addresses) q, k, v and o by their logical shapes: a
        // broadcast view whose logical size cannot exist is refused here, before anything runs.
        crate::tensor::check_size(q_shape, dtype.size(), "q")?;
        crate::tensor::check_size([batch, seqlen_q, heads_q, head_dim_v], dtype.size(), "the output o")?;
        crate::tensor::check_size(k_shape, dtype.size(), "k")?;
        crate::tensor::check_size(v_shape, dtype.size(), "v")?;
        let scale = opts.softmax_scale.unwrap_or(1.0 / (head_dim as f32).sqrt());
        if !(scale.is_finite() && scale >= MIN_SOFTMAX_SCALE && (scale * LOG2E).is_finite()) {
            return Err(Error::InvalidSoftmaxScale(scale));
        }
        let (left, right) = resolve_mask(opts.mask)?;
        // A bound past the sequence sees the same keys as the sequence's length (module docs).
        let (left, right) = (left.map(|l| l.min(seqlen_k)), right.map(|r| r.min(seqlen_q)));
        if let Some(cap) = opts.softcap {
            // Normal, so that 1 / cap is finite (the FA2/FA3 kernels multiply by it).
            if !(cap.is_finite() && cap >= f32::MIN_POSITIVE) {
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
            // The bias -slope · |distance| must be a finite f32 at every distance a row can have
            // to a key (at most max(seqlen_q, seqlen_k) - 1): an infinite bias would silently
            // drop keys, or make a row that sees keys look as if it saw none.
            let far = seqlen_q.max(seqlen_k) as f64 - 1.0;
            if let Some(s) = slopes.iter().find(|s| s.abs() as f64 * far > f32::MAX as f64) {
                return Err(Error::InvalidAlibi {
                    got: slopes.len(),
                    expected: heads_q,
                    reason: format!("slope {s:e} times the largest distance {far} overflows f32"),
                });
            }
        }
        let sinks = check_sinks(opts.sinks.as_ref(), heads_q)?;
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
        if let Some(stage) = opts.fa4_stage {
            if opts.variant != crate::options::Variant::Fa4 {
                return Err(Error::InvalidOption {
                    option: "fa4_stage",
                    got: format!("{stage} with Variant::{:?}", opts.variant),
                    expected: "Variant::Fa4 (a stage of the FA4 ladder runs only when FA4 is requested)".into(),
                });
            }
            if !(1..=FA4_MAX_STAGE).contains(&stage) {
                return Err(Error::InvalidOption {
                    option: "fa4_stage",
                    got: stage.to_string(),
                    expected: format!("1..={FA4_MAX_STAGE}"),
                });
            }
        }
        if let Some(n) = opts.fa4_exp2_share {
            if opts.variant != crate::options::Variant::Fa4 {
                return Err(Error::InvalidOption {
                    option: "fa4_exp2_share",
                    got: format!("{n} with Variant::{:?}", opts.variant),
                    expected: "Variant::Fa4 (the share of FA4's software exp2 picks an FA4 kernel row)".into(),
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
            head_dim_v,
            dtype,
            scale,
            left,
            right,
            softcap: opts.softcap,
            alibi: opts.alibi_slopes.clone(),
            sinks,
            return_lse: opts.return_lse,
            precision: opts.precision,
            exp2: opts.exp2,
            rescale: opts.rescale,
            fa3_stage: opts.fa3_stage,
            fa4_stage: opts.fa4_stage,
            fa4_exp2_share: opts.fa4_exp2_share,
        })
    }

    /// The units scores are formed in ([`ScoreUnits`]).
    pub(crate) fn score_units(&self) -> ScoreUnits {
        let natural = self.softcap.is_some() || self.alibi.is_some();
        ScoreUnits {
            natural,
            to_log2: if natural { LOG2E } else { self.scale * LOG2E },
            to_natural: if natural { 1.0 } else { self.scale },
        }
    }

    /// Query heads per KV head (1 for MHA).
    pub fn group(&self) -> usize {
        // heads_kv >= 1 in every validated problem; `max` keeps a hand-built one from dividing by 0.
        self.heads_q / self.heads_kv.max(1)
    }

    /// Keys `[lo, hi)` visible to query row `i` (empty when `lo >= hi`).
    ///
    /// Positions are i128, so any `usize` seqlens and bounds (also in a `Problem` built by hand,
    /// without [`Problem::new`]'s clamping) give the exact range.
    pub fn key_range(&self, i: usize) -> (usize, usize) {
        let sk = self.seqlen_k as i128;
        let diag = i as i128 + sk - self.seqlen_q as i128;
        let lo = self.left.map_or(0, |l| (diag - l as i128).clamp(0, sk));
        let hi = self.right.map_or(sk, |r| (diag + r as i128 + 1).clamp(0, sk));
        (lo as usize, hi as usize)
    }

    /// Whether query `i` sees key `j`, written straight from the definition (in i128).
    pub fn visible(&self, i: usize, j: usize) -> bool {
        let rel = j as i128 - (i as i128 + self.seqlen_k as i128 - self.seqlen_q as i128);
        self.left.is_none_or(|l| rel >= -(l as i128)) && self.right.is_none_or(|r| rel <= r as i128)
    }

    /// The ALiBi bias of (head, i, j) in natural units (0 without ALiBi).
    pub fn alibi_bias(&self, head: usize, i: usize, j: usize) -> f32 {
        match &self.alibi {
            Some(s) => {
                let rel = (i as i128 + self.seqlen_k as i128 - self.seqlen_q as i128 - j as i128).unsigned_abs();
                -s.get(head).copied().unwrap_or(0.0) * rel as f32
            }
            None => 0.0,
        }
    }

    /// The sink logit of query head `head` (natural units), or `None` for no sink there.
    pub fn sink(&self, head: usize) -> Option<f32> {
        self.sinks.as_ref().and_then(|s| s.get(head).copied()).filter(|&s| s != f32::NEG_INFINITY)
    }

    /// Exact number of visible (query, key) pairs summed over batch and heads (saturating at
    /// `u64::MAX`).
    pub fn visible_pairs(&self) -> u64 {
        let per_head = (0..self.seqlen_q).fold(0u64, |acc, i| {
            let (lo, hi) = self.key_range(i);
            acc.saturating_add(hi.saturating_sub(lo) as u64)
        });
        per_head.saturating_mul((self.batch as u64).saturating_mul(self.heads_q as u64))
    }
}

/// Checks the sink logits: one per query head, each finite or −inf (no sink). All −inf is no
/// sink at all (`None`), so that a path without sinks runs it.
fn check_sinks(sinks: Option<&Arc<[f32]>>, heads_q: usize) -> Result<Option<Arc<[f32]>>> {
    let Some(s) = sinks else { return Ok(None) };
    if s.len() != heads_q {
        return Err(Error::InvalidOption {
            option: "sinks",
            got: format!("{} values", s.len()),
            expected: format!("{heads_q} values (one logit per query head)"),
        });
    }
    if let Some((h, x)) = s.iter().enumerate().find(|(_, x)| x.is_nan() || **x == f32::INFINITY) {
        return Err(Error::InvalidOption {
            option: "sinks",
            got: format!("{x} for query head {h}"),
            expected: "a finite logit, or -inf for no sink".into(),
        });
    }
    Ok(s.iter().any(|&x| x != f32::NEG_INFINITY).then(|| s.clone()))
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

/// Checks `num_splits`: every entry point that takes it (dense, serving, the device engine).
pub(crate) fn check_num_splits(opts: &ForwardOptions) -> Result<()> {
    match opts.num_splits {
        Some(n) if !(1..=crate::splits::MAX_SPLITS).contains(&n) => Err(Error::InvalidOption {
            option: "num_splits",
            got: n.to_string(),
            expected: format!("1..={} (or None for the heuristic)", crate::splits::MAX_SPLITS),
        }),
        _ => Ok(()),
    }
}

impl SoftmaxMath {
    /// The softmax arithmetic of `p`'s options. Here rather than in `numerics`, which sits below
    /// the problem (its rules validate the problem's options).
    pub fn for_problem(p: &Problem) -> Self {
        SoftmaxMath {
            degree: match p.exp2 {
                Exp2::Accurate => ACCURATE_DEGREE,
                Exp2::Poly(d) => d,
            },
            lazy: match p.rescale {
                Rescale::Always => None,
                Rescale::Lazy { threshold } => Some(threshold),
            },
            fp8_p: matches!(p.precision, Precision::Fp8 { .. }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    fn problem(sq: usize, sk: usize, mask: Mask) -> Result<Problem> {
        let q = Tensor::zeros(DType::F32, [1, sq, 1, 4])?;
        let k = Tensor::zeros(DType::F32, [1, sk, 1, 4])?;
        Problem::new(&q.view(), &k.view(), &k.view(), &ForwardOptions::default().mask(mask))
    }

    #[test]
    fn min_softmax_scale_is_two_to_the_minus_120() {
        assert_eq!(MIN_SOFTMAX_SCALE, 2f32.powi(-120));
    }

    #[test]
    fn huge_window_bounds_are_clamped_to_the_sequence() {
        let p = problem(7, 5, Mask::window(i64::MAX, i64::MAX)).unwrap();
        assert_eq!((p.left, p.right), (Some(5), Some(7)));
        let p = problem(7, 5, Mask::window(3, 2)).unwrap();
        assert_eq!((p.left, p.right), (Some(3), Some(2)));
        for i in 0..7 {
            let unbounded = problem(7, 5, Mask::None).unwrap();
            assert_eq!(problem(7, 5, Mask::window(i64::MAX, i64::MAX)).unwrap().key_range(i), unbounded.key_range(i));
        }
    }

    #[test]
    fn key_range_and_visible_are_exact_for_any_hand_built_problem() {
        let mut p = problem(3, 4, Mask::None).unwrap();
        let huge = [(usize::MAX, usize::MAX, usize::MAX, usize::MAX), (1, usize::MAX, usize::MAX, 0), (usize::MAX, 1, 0, usize::MAX)];
        for (sq, sk, l, r) in huge {
            p.seqlen_q = sq;
            p.seqlen_k = sk;
            p.left = Some(l);
            p.right = Some(r);
            for i in [0, 1, sq / 2, sq - 1] {
                let (lo, hi) = p.key_range(i);
                assert!(lo <= sk && hi <= sk);
                for j in [0, 1, sk / 2, sk - 1].into_iter().filter(|&j| j < sk) {
                    assert_eq!(p.visible(i, j), lo <= j && j < hi, "sq {sq} sk {sk} i {i} j {j}");
                }
            }
            p.alibi = Some(vec![0.5f32].into());
            assert!(p.alibi_bias(0, sq - 1, 0).is_finite() && p.alibi_bias(0, 0, sk - 1) <= 0.0);
        }
    }
}

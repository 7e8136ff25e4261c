//! Merging attention states: the exact softmax recombination of attention over disjoint key
//! sets (FlashInfer's `merge_state`; FlashAttention's split-KV combine).
//!
//! If `(o_i, lse_i)` is attention of one query over key set `K_i` (o normalised, lse the natural
//! log of its softmax denominator), attention over the union of disjoint `K_i` is
//!
//! ```text
//! lse = log Σ_i exp(lse_i)        o = Σ_i exp(lse_i − lse) · o_i
//! ```
//!
//! computed with the max subtracted (`m = max_i lse_i`). A state with `lse = −inf` saw no key and
//! contributes nothing (its `o` is not read); if every state has `lse = −inf` the row saw no key:
//! `o = 0`, `lse = −inf`, never NaN. NaN in an input propagates to the row's output.
//!
//! The CPU split-KV combine calls [`merge_row`], the same arithmetic as the public operations.
//!
//! Attention sinks are a state too: a sink logit `z` is a "key" with value 0, the state
//! `(o = 0, lse = z)`. Partial states (a split of the keys, [`merge_states`]'s inputs) carry no
//! sink; it is added once, to the merged state ([`fold_sink`]). A caller merging partial states
//! itself adds it the same way: one more state with `o = 0` and `lse = z` in the merge.

use crate::error::{Error, Operand, Result};
use crate::tensor::{numel, AsTensorView, DType, Element, OwnedData, Shape, Tensor, TensorView};

/// Merges one row: `parts` are `(o_i, lse_i)` with every `o_i` of length `out.len()` and each
/// `lse_i` an f32 (the public states) or f64 (the CPU split-KV's own). Writes the merged output
/// and returns the merged LSE. Weights are formed in f64, the sum accumulated in f64 per element.
pub(crate) fn merge_row<'o, L: Copy + Into<f64>>(
    parts: impl Iterator<Item = (&'o [f32], L)> + Clone,
    out: &mut [f32],
) -> f32 {
    let mut m = f64::NEG_INFINITY;
    let mut nan = false;
    let parts = parts.map(|(o, l)| (o, Into::<f64>::into(l)));
    for (_, lse) in parts.clone() {
        nan |= lse.is_nan();
        m = m.max(lse);
    }
    if nan {
        out.iter_mut().for_each(|x| *x = f32::NAN);
        return f32::NAN;
    }
    if m == f64::NEG_INFINITY {
        out.iter_mut().for_each(|x| *x = 0.0);
        return f32::NEG_INFINITY;
    }
    // m = +inf (an overflowed input) gives NaN weights below: the row shows it.
    let sum: f64 = parts
        .clone()
        .filter(|p| p.1 != f64::NEG_INFINITY)
        .map(|(_, l)| (l - m).exp())
        .sum();
    let lse = m + sum.ln();
    let mut acc = [0.0f64; 64];
    for (c, dst) in out.chunks_mut(acc.len()).enumerate() {
        let acc = &mut acc[..dst.len()];
        acc.iter_mut().for_each(|a| *a = 0.0);
        for (o, l) in parts.clone().filter(|p| p.1 != f64::NEG_INFINITY) {
            let w = (l - lse).exp();
            for (a, &x) in acc.iter_mut().zip(&o[c * 64..]) {
                *a += w * x as f64;
            }
        }
        for (d, a) in dst.iter_mut().zip(acc.iter()) {
            *d = *a as f32;
        }
    }
    lse as f32
}

/// Folds a sink logit into a finished row: `lse_keys` is the natural-log softmax denominator of
/// the row's keys (−inf when it saw none), `sink` the logit. Returns the factor the row's
/// normalised output is multiplied by, `exp(lse_keys − lse)`, and the row's new LSE
/// `lse = ln(exp(lse_keys) + exp(sink))`: [`merge_row`] with the state `(0, sink)`, in closed
/// form (`softplus` of the difference), so that a row that saw no key gets `(0, sink)`.
pub(crate) fn fold_sink(lse_keys: f64, sink: f32) -> (f64, f64) {
    let z = sink as f64;
    if lse_keys == f64::NEG_INFINITY {
        return (0.0, z);
    }
    // ln(1 + e^x) without overflow; NaN (from a NaN row) propagates to both results.
    let x = z - lse_keys;
    let softplus = if x > 0.0 { x + (-x).exp().ln_1p() } else { x.exp().ln_1p() };
    ((-softplus).exp(), lse_keys + softplus)
}

/// The checks of every `merge_states` form, host and device ([`merge_states_n`],
/// `cuda::Engine::merge_states_n`), so their errors are the same: `n` states, state `i` with
/// `state(i) = (o shape, o dtype, LSE length)` and `layout(i)` its o's extent check (run only
/// when there are rows). Returns the rows `batch · seqlen · heads` every LSE must hold.
///
/// # Errors
/// [`Error::InvalidOption`] for no state, [`Error::ShapeMismatch`] for another shape or LSE
/// length than state 0's, [`Error::DTypeMismatch`] for another dtype, `layout`'s error.
pub(crate) fn check_states(
    n: usize,
    state: impl Fn(usize) -> (Shape, DType, usize),
    layout: impl Fn(usize) -> Result<()>,
) -> Result<usize> {
    if n == 0 {
        return Err(Error::InvalidOption {
            option: "merge_states_n states",
            got: "an empty list".into(),
            expected: "at least one (o, lse) state".into(),
        });
    }
    let (shape, dtype, _) = state(0);
    let [b, s, h, _] = shape;
    let rows = numel([b, s, h, 1], "merged state")?;
    for i in 0..n {
        let (o_shape, o_dtype, lse_len) = state(i);
        if o_shape != shape {
            return Err(Error::ShapeMismatch {
                what: format!("o of state {i}"),
                got: format!("{o_shape:?}"),
                expected: format!("{shape:?} (the shape of state 0)"),
            });
        }
        if o_dtype != dtype {
            return Err(Error::DTypeMismatch { operand: Operand::O, got: o_dtype, expected: dtype });
        }
        if rows > 0 {
            layout(i)?;
        }
        if lse_len != rows {
            return Err(Error::ShapeMismatch {
                what: format!("lse of state {i}"),
                got: format!("{lse_len} values"),
                expected: format!("{rows} = batch {b} x heads {h} x seqlen {s} ([batch, heads, seqlen])"),
            });
        }
    }
    Ok(rows)
}

/// An attention state: output and LSE of attention over some set of keys.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionState {
    /// `[batch, seqlen, heads, head_dim]`, the dtype of the inputs.
    pub o: Tensor,
    /// `[batch, heads, seqlen]`, natural log, −inf for rows that saw no key.
    pub lse: Vec<f32>,
}

/// Merges two attention states of the same queries over disjoint key sets:
/// `o_a`, `o_b` are `[batch, seqlen, heads, head_dim]` (any dtype, both the same), `lse_a`,
/// `lse_b` are `[batch, heads, seqlen]` (natural log), as [`crate::forward`] returns them
/// (for a varlen call: `[1, total_q, heads, head_dim]` and `[heads, total_q]`).
///
/// The result is in the inputs' dtype, computed in f64; pass f32 states when the merged result
/// is to be exact to f32 rounding. States of a split of the keys carry no attention sink
/// (module docs): to add one, merge one more state with `o = 0` and `lse = sink`.
///
/// # Errors
/// [`Error::ShapeMismatch`] when the states' shapes or LSE lengths disagree,
/// [`Error::DTypeMismatch`] when their dtypes do, [`Error::InvalidLayout`] for a view whose
/// strides leave its buffer.
pub fn merge_states(
    o_a: &impl AsTensorView,
    lse_a: &[f32],
    o_b: &impl AsTensorView,
    lse_b: &[f32],
) -> Result<AttentionState> {
    merge_states_n(&[(o_a.as_view(), lse_a), (o_b.as_view(), lse_b)])
}

/// The n-way [`merge_states`]: one state per disjoint key set, in any order (the result depends
/// on the order only through f64 rounding).
///
/// # Errors
/// As [`merge_states`], and [`Error::InvalidOption`] for an empty list.
pub fn merge_states_n(states: &[(TensorView<'_>, &[f32])]) -> Result<AttentionState> {
    let rows = check_states(
        states.len(),
        |i| (states[i].0.shape(), states[i].0.dtype(), states[i].1.len()),
        |i| states[i].0.check_layout(Operand::O),
    )?;
    let shape = states[0].0.shape();
    let dtype = states[0].0.dtype();
    let [b, s, h, d] = shape;
    let mut o = Tensor::zeros(dtype, shape)?;
    let mut lse = vec![f32::NEG_INFINITY; rows];
    let mut parts: Vec<Vec<f32>> = vec![vec![0.0; d]; states.len()];
    let mut row = vec![0.0f32; d];
    let mut write = |off: usize, src: &[f32]| match o.data_mut() {
        OwnedData::F32(v) => store(&mut v[off..off + d], src),
        OwnedData::F16(v) => store(&mut v[off..off + d], src),
        OwnedData::BF16(v) => store(&mut v[off..off + d], src),
    };
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let li = (bi * h + hi) * s + si;
                for (part, (view, _)) in parts.iter_mut().zip(states) {
                    view.read_row(bi, si, hi, part);
                }
                let it = parts.iter().zip(states).map(|(p, (_, l))| (p.as_slice(), l[li]));
                lse[li] = merge_row(it, &mut row);
                write(((bi * s + si) * h + hi) * d, &row);
            }
        }
    }
    debug_assert!(dtype == o.dtype() || dtype == DType::F32);
    Ok(AttentionState { o, lse })
}

fn store<T: Element>(dst: &mut [T], src: &[f32]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = T::from_f32(x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_halves_make_the_whole() {
        // One query, four keys with scores s and values v: halves {0, 1} and {2, 3}.
        let s = [0.3f64, -1.2, 2.0, 0.7];
        let v = [1.0f64, -2.0, 0.5, 3.0];
        let att = |ks: &[usize]| {
            let m = ks.iter().map(|&j| s[j]).fold(f64::NEG_INFINITY, f64::max);
            let l: f64 = ks.iter().map(|&j| (s[j] - m).exp()).sum();
            let o: f64 = ks.iter().map(|&j| (s[j] - m).exp() * v[j]).sum::<f64>() / l;
            (o as f32, (m + l.ln()) as f32)
        };
        let (oa, la) = att(&[0, 1]);
        let (ob, lb) = att(&[2, 3]);
        let (o, l) = att(&[0, 1, 2, 3]);
        let mut out = [0.0f32];
        let lse = merge_row([(&[oa][..], la), (&[ob][..], lb)].into_iter(), &mut out);
        assert!(
            (out[0] - o).abs() < 1e-6 && (lse - l).abs() < 1e-6,
            "{out:?} {lse} vs {o} {l}"
        );
    }

    #[test]
    fn a_sink_is_a_zero_state() {
        let o = [1.5f32, -2.0];
        for (lse, sink) in [(0.3f32, -1.0f32), (0.3, 4.0), (-50.0, 60.0), (1e4, 1e4), (2.0, -1e30)] {
            let mut want = [0.0f32; 2];
            let want_lse = merge_row([(&o[..], lse), (&[0.0f32; 2][..], sink)].into_iter(), &mut want);
            let (w, l) = fold_sink(lse as f64, sink);
            assert!((l as f32 - want_lse).abs() <= 1e-6 * want_lse.abs().max(1.0), "{lse} {sink}: {l} vs {want_lse}");
            for (x, y) in o.iter().zip(&want) {
                assert!(((*x as f64 * w) as f32 - y).abs() <= 1e-6, "{lse} {sink}: {w}");
            }
        }
        assert_eq!(fold_sink(f64::NEG_INFINITY, 2.5), (0.0, 2.5));
        let (w, l) = fold_sink(f64::NAN, 0.0);
        assert!(w.is_nan() && l.is_nan());
    }

    #[test]
    fn empty_rows_never_nan() {
        let mut out = [7.0f32; 3];
        let nan_o = [f32::NAN; 3];
        let lse = merge_row(
            [(&nan_o[..], f32::NEG_INFINITY), (&nan_o[..], f32::NEG_INFINITY)].into_iter(),
            &mut out,
        );
        assert_eq!((out, lse), ([0.0; 3], f32::NEG_INFINITY));
        let one = [1.0f32, 2.0, 3.0];
        let lse = merge_row([(&nan_o[..], f32::NEG_INFINITY), (&one[..], 0.5)].into_iter(), &mut out);
        assert_eq!((out, lse), (one, 0.5));
    }
}

//! The online softmax, with FlashAttention-3's verbs (`max_get_scale`, `online_softmax`,
//! `rescale_o`, `finalize`), mirrored by the CUDA kernels' softmax headers.
//!
//! The CPU backend holds scores transposed, a panel of `NR` = 16 queries side by side per key
//! (`[keys][16]`), so every verb below is a vertical operation on 16-wide vectors: the per-query
//! max, sum and rescale vectorise with no horizontal reductions.
//!
//! Units. Scores `x` arrive in *score units*: raw dot products `q·k` (no softcap, no ALiBi), or
//! natural units (`scale · q·k`, softcap, ALiBi). The running max `m` is kept in the same units,
//! and every exponent is formed as `(x − m) · c` (`c` = `scale · log2 e` or `log2 e`): the max
//! itself gives exactly `2^0 = 1`, every other key a non-positive exponent, and nothing is ever
//! converted to log2 units on its own. That matters at the edges of f32: `m · c` rounded to f32
//! next to an FMA's exact `x · c` differs by up to half an ulp of `m · c`, which is ±128 in the
//! exponent once `|m · c| >= 2^31`, and `x · c` overflows for scores above `f32::MAX / log2 e`,
//! where a straightforward f32 softmax is still finite. `x − m` cannot overflow towards +inf
//! (x <= m), and when it overflows towards −inf the true exponent is below −127 anyway
//! (`c >= 2^-120 · log2 e`, `MIN_SOFTMAX_SCALE`), so P = 0 is the right answer.
//!
//! The running max `m` starts at −inf; while a query has seen no key, `m` stays −inf and the guard
//! in `online_softmax` keeps `-inf - (-inf)` (NaN) from ever being formed.

use super::gemm::NR;
pub use super::row_state::RowState;
use crate::numerics::softmax_math::Exp2Math;

/// Per-query max of a `[keys][NR]` panel. NaN scores are skipped here and propagated by `exp2`.
#[inline(always)]
pub fn panel_max(panel: &[f32]) -> [f32; NR] {
    let mut acc = [f32::NEG_INFINITY; NR];
    for row in panel.chunks_exact(NR) {
        for q in 0..NR {
            acc[q] = if row[q] > acc[q] { row[q] } else { acc[q] };
        }
    }
    acc
}

/// Folds a tile's max for one query (score units) into its state and returns the factor its
/// output and sum must be multiplied by (1 when nothing changes). `c` converts score units to
/// log2 units.
///
/// Lazy rule (FA4): when the max grows by at most `τ = threshold` (log2 units), keep the stale
/// max `m`.
///
/// Why this is exact and cannot overflow:
/// - In real arithmetic `O = Σ 2^((s_j - m)·c + off)·v_j` and `l = Σ 2^((s_j - m)·c + off)` share
///   the same `m` (and offset `off`), so `O / l` does not depend on which `m` was used; the LSE
///   adds `m` (in natural units) back and removes the offset.
/// - Invariant: every score seen so far satisfies `(s - m)·c <= τ` (a tile whose max exceeds that
///   moves `m` up to its max and rescales O and l by `2^((m_old - m_new)·c) < 1`). Hence each
///   `P = 2^((s - m)·c + off) <= 2^(τ + off)`, so `l <= n_keys·2^(τ + off)` and `|O| <= l·max|v|`.
///   `numerics::validate` caps τ at 64 and off is 0 or 8, so `|O|, l <= 2^72·n_keys·max(1, max|v|)`:
///   f32 (max ~2^128) overflows only if `n_keys·max|v| >= 2^56` (e.g. 2^32 keys with |v| up to
///   2^24 are safe). With FA4's τ = 8 the margin is 2^112, the same order as eager rescaling's.
/// - The exp2 argument is at most `τ + off <= 72`, inside the polynomial's exponent-add range
///   (< 128); eagerly (τ = 0, off = 0) it is at most 0.
/// - With P in e4m3 the bound `2^(τ + off)` must also stay below 448, hence `τ + 8 < log2(448)`
///   for FP8 (checked by `numerics::validate`).
///
/// The final normalisation is exact either way; only rounding differs from eager rescaling.
#[inline(always)]
#[allow(clippy::neg_cmp_op_on_partial_ord)] // `!(a > b)` is meant: it is also true for a NaN tile max
pub fn max_get_scale<M: Exp2Math>(st: &mut RowState, tile_max: f32, c: f32, math: &M) -> f32 {
    if !(tile_max > st.m) {
        // No growth, or a NaN tile max (propagated by `exp2` in `online_softmax`).
        return 1.0;
    }
    if st.m == f32::NEG_INFINITY {
        st.m = tile_max; // first visible key: O and l are still 0, nothing to rescale
        return 1.0;
    }
    // > 0, possibly +inf (then the old terms are negligible: the factor is 0).
    let growth = (tile_max - st.m) * c;
    if let Some(t) = math.lazy_threshold() {
        if crate::numerics::lazy_keeps_max(growth, t) {
            return 1.0;
        }
    }
    let scale = math.exp2(-growth);
    st.m = tile_max;
    scale
}

/// [`max_get_scale`] for each query of a panel. A plain loop: `std::array::from_fn` is not
/// always inlined, and out of line it loses the caller's `#[target_feature]` context, so its
/// `exp2` (a `floor` and `mul_add`) became calls to libm's software `floorf` and `fmaf`.
#[inline(always)]
pub fn panel_scales<M: Exp2Math>(states: &mut [RowState], tile_max: &[f32; NR], c: f32, math: &M) -> [f32; NR] {
    let mut scales = [1.0f32; NR];
    for ((sc, st), &m) in scales.iter_mut().zip(states.iter_mut()).zip(tile_max) {
        *sc = max_get_scale(st, m, c, math);
    }
    scales
}

/// Turns a `[keys][NR]` panel of scores (score units) into probabilities in place,
/// `p = exp2((x − m)·c + offset)` per query (masked scores −inf give 0), scales each query's sum
/// by `scales` and adds the new probabilities, and rounds P for the second product.
///
/// `x − m` is exact near the max (Sterbenz), so the probabilities that matter carry only the
/// rounding of the product by `c`; with `FMA` the offset is added in the same instruction.
#[inline(always)]
pub fn online_softmax<M: Exp2Math, const FMA: bool>(
    states: &mut [RowState],
    scales: &[f32; NR],
    panel: &mut [f32],
    c: f32,
    math: &M,
) {
    // The −inf guard: a query with no visible key so far has m = −inf; use 0 so that masked
    // scores give exp2(−inf) = 0 rather than exp2(NaN).
    let shift: [f32; NR] = std::array::from_fn(|q| {
        let m = states[q].m;
        if m == f32::NEG_INFINITY {
            0.0
        } else {
            m
        }
    });
    let off = math.p_offset();
    let mut sum = [0.0f32; NR];
    for row in panel.chunks_exact_mut(NR) {
        for q in 0..NR {
            let d = row[q] - shift[q];
            let arg = if FMA { d.mul_add(c, off) } else { d * c + off };
            let p = math.exp2(arg);
            sum[q] += p;
            row[q] = math.round_p(p);
        }
    }
    for q in 0..NR {
        states[q].l = states[q].l * scales[q] + sum[q];
    }
}

/// Multiplies each query column of `MR` rows of an output panel (`[MR][NR]`, from `o_rows`) by
/// its scale, into the accumulator `acc` of the second product: the rescale is fused into the
/// load of the accumulator, so O is read and written once per key tile. (Multiplying by 1 is
/// exact, so nothing is skipped when no scale moved.)
#[inline(always)]
pub fn rescale_o<const MR: usize>(o_rows: &[f32], scales: &[f32; NR], acc: &mut [[f32; NR]; MR]) {
    for (a, row) in acc.iter_mut().zip(o_rows.chunks_exact(NR)) {
        for q in 0..NR {
            a[q] = row[q] * scales[q];
        }
    }
}

/// The final normaliser and LSE (natural log) of a query: `(1 / l, lse)`, where `u` converts
/// score units to natural units (`scale` for raw dot products, 1 otherwise). A query that saw no
/// key (`l == 0`) gets `(0, −inf)`: its output is 0 (written as 0 by the caller, never `O · 0`,
/// which is NaN if a masked key's infinite V reached O), never NaN.
#[inline(always)]
pub fn finalize<M: Exp2Math>(st: &RowState, u: f32, math: &M) -> (f32, f32) {
    if st.l == 0.0 {
        return (0.0, f32::NEG_INFINITY);
    }
    (1.0 / st.l, lse_of(st.m, st.l.log2(), u, math))
}

/// [`finalize`]'s LSE in f64, for states that are merged before the LSE is returned (split-KV):
/// `m · u` is exact in f64 (two 24-bit significands), so the only rounding left is that of the
/// logarithm, where an f32 LSE of a score near 1e4 would be off by up to 5e-4.
#[inline(always)]
pub fn lse_f64<M: Exp2Math>(st: &RowState, u: f32, math: &M) -> f64 {
    if st.l == 0.0 {
        return f64::NEG_INFINITY;
    }
    st.m as f64 * u as f64 + ((st.l as f64).log2() - math.p_offset() as f64) * std::f64::consts::LN_2
}

/// The LSE (natural log) of a query whose running max is `m` and whose sum's log2 is `log2_l`
/// (the one formula of [`finalize`] and [`finalize_panel`]).
#[inline(always)]
fn lse_of<M: Exp2Math>(m: f32, log2_l: f32, u: f32, math: &M) -> f32 {
    m * u + (log2_l - math.p_offset()) * std::f32::consts::LN_2
}

/// [`finalize`] for a panel of up to `NR` queries, bit for bit: `(1 / l, lse)` into `inv` and
/// `lse` (`states.len()` of each), and the mask of queries that saw a key. The `log2` calls
/// (libm's) run in a loop of their own and the rest in lane-wise loops that vectorise: with the
/// arithmetic between them, each call would be preceded by a scalar division and stack spills
/// around it, a visible share of a short-sequence call. The lane-wise rest in AVX-512 instructions
/// where the CPU has them (`simd::finalize_lanes`: the compiler kept the loop scalar).
#[inline(always)]
pub fn finalize_panel<M: Exp2Math>(
    states: &[RowState],
    u: f32,
    math: &M,
    inv: &mut [f32; NR],
    lse: &mut [f32],
) -> u16 {
    let n = states.len().min(NR);
    // The calls first, each reading its argument from `states` (every vector register is
    // caller-saved: values computed before the calls would be spilled around each of them).
    let mut log = [0.0f32; NR];
    for (x, st) in log.iter_mut().zip(&states[..n]) {
        *x = st.l.log2();
    }
    // Every lane computed (the padding as l = 1), the `n` wanted ones kept: whole-array loops.
    let (mut l, mut m) = ([1.0f32; NR], [0.0f32; NR]);
    for (lane, st) in states[..n].iter().enumerate() {
        (l[lane], m[lane]) = (st.l, st.m);
    }
    if let Some(live) = super::simd::finalize_lanes((&l, &m, &log), (u, math.p_offset()), inv, &mut lse[..n]) {
        return live;
    }
    let (mut out, mut live) = ([0.0f32; NR], 0u16);
    for lane in 0..NR {
        let seen = l[lane] != 0.0;
        inv[lane] = if seen { 1.0 / l[lane] } else { 0.0 };
        let x = lse_of(m[lane], log[lane], u, math);
        out[lane] = if seen { x } else { f32::NEG_INFINITY };
        live |= u16::from(seen) << lane;
    }
    lse[..n].copy_from_slice(&out[..n]);
    if n < NR {
        live &= (1 << n) - 1;
    }
    live
}

/// One query row's online-softmax step over the scores `x[..n]` (score units): the new max and
/// the factor the old sum and output must be scaled by (`max_get_scale`), and the unrounded
/// probabilities `exp2((x − m)·c + offset)`, 0 past `n` (`online_softmax`'s arithmetic, its −inf
/// guard included). The caller adds them to the row's sum in its own order and rounds them for
/// P·V. `N` is a power of two.
#[inline(always)]
pub fn row_probs<M: Exp2Math, const N: usize, const FMA: bool>(
    st: &mut RowState,
    x: &[f32; N],
    n: usize,
    c: f32,
    math: &M,
) -> ([f32; N], f32) {
    let scale = max_get_scale(st, block_max(x, n), c, math);
    // The −inf guard of `online_softmax`: a row with no visible key yet keeps m = −inf.
    let shift = if st.m == f32::NEG_INFINITY { 0.0 } else { st.m };
    let off = math.p_offset();
    let mut p = [0.0f32; N];
    for (t, (pt, &xt)) in p.iter_mut().zip(x).enumerate() {
        let dx = xt - shift;
        let e = math.exp2(if FMA { dx.mul_add(c, off) } else { dx * c + off });
        *pt = if t < n { e } else { 0.0 };
    }
    (p, scale)
}

/// The max of `x[..n]` as `panel_max` takes it (NaN scores skipped; −inf when there is none),
/// as a tree so that it vectorises.
#[inline(always)]
pub fn block_max<const N: usize>(x: &[f32; N], n: usize) -> f32 {
    let mut a: [f32; N] = std::array::from_fn(|t| if t < n && x[t] > f32::NEG_INFINITY { x[t] } else { f32::NEG_INFINITY });
    let mut w = N / 2;
    while w > 0 {
        for i in 0..w {
            a[i] = if a[i + w] > a[i] { a[i + w] } else { a[i] };
        }
        w /= 2;
    }
    a[0]
}

/// The sum of `N` (a power of two) values as a tree of halves.
#[inline(always)]
pub fn tree_sum<const N: usize>(mut a: [f32; N]) -> f32 {
    let mut w = N / 2;
    while w > 0 {
        for i in 0..w {
            a[i] += a[i + w];
        }
        w /= 2;
    }
    a[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The blocked decode's max skips NaN scores and the keys past `n` as `panel_max` does, and
    /// is −inf when there is no other score; its sum is the tree of halves.
    #[test]
    fn block_max_and_sum() {
        let nan = f32::NAN;
        let mut x = [0.5f32; 16];
        x[3] = nan;
        x[7] = 2.0;
        x[12] = 9.0;
        assert_eq!(block_max(&x, 12), 2.0);
        assert_eq!(block_max(&x, 16), 9.0);
        let all_nan = [nan; 16];
        assert_eq!(block_max(&all_nan, 16), f32::NEG_INFINITY);
        let ninf = [f32::NEG_INFINITY; 16];
        assert_eq!(block_max(&ninf, 5), f32::NEG_INFINITY);
        for n in 0..=16 {
            let y: [f32; 16] = std::array::from_fn(|t| if t < n { (t * t) as f32 - 7.5 } else { f32::NEG_INFINITY });
            let want = y[..n].iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
            assert_eq!(block_max(&y, n), want);
        }
        let p: [f32; 16] = std::array::from_fn(|t| t as f32);
        assert_eq!(tree_sum(p), 120.0);
        let mut q = [0.0f32; 16];
        q[5] = f32::INFINITY;
        assert_eq!(tree_sum(q), f32::INFINITY);
    }
}

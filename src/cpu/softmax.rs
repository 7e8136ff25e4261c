//! The online softmax of one query row, with FlashAttention-3's verbs (`max_get_scale`,
//! `online_softmax`, `rescale_o`, `finalize`), mirrored by `cuda/include/online_softmax.cuh`.
//!
//! Scores arrive in log2 units (pre-multiplied by `scale * log2(e)`), so every exponential is an
//! `exp2`. The running max `m` starts at −inf; while a row has seen no key, `m` stays −inf and the
//! guard below keeps `-inf - (-inf)` (NaN) from ever being formed.

/// The score-to-probability arithmetic: which exp2, the P offset, and P's rounding.
pub trait Exp2Math: Copy + Send + Sync {
    /// Probabilities are computed as `exp2(s - m + P_OFFSET)` (FA3's FP8 `Max_offset`); the
    /// offset cancels in `O / l` and is removed from the LSE.
    fn p_offset(&self) -> f32;
    fn exp2(&self, x: f32) -> f32;
    /// The value P takes into the second product (identity, or e4m3 rounding).
    fn round_p(&self, p: f32) -> f32;
    /// Lazy rescaling threshold in log2 units (`None`: rescale whenever the max grows).
    fn lazy_threshold(&self) -> Option<f32>;
}

/// Running state of one row.
#[derive(Clone, Copy, Debug)]
pub struct RowState {
    /// Running max (log2 units), possibly stale under lazy rescaling.
    pub m: f32,
    /// Running sum of `exp2(s - m + offset)`.
    pub l: f32,
}

impl RowState {
    pub const EMPTY: RowState = RowState { m: f32::NEG_INFINITY, l: 0.0 };
}

/// Lane count of the partial reductions (one AVX2 vector).
const LANES: usize = 8;

/// Max of a row, ignoring nothing: NaN scores are left for `exp2` to propagate.
#[inline(always)]
pub fn row_max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    let mut m = acc.iter().fold(f32::NEG_INFINITY, |a, &x| if x > a { x } else { a });
    for &x in rest {
        m = if x > m { x } else { m };
    }
    m
}

/// Folds a tile's row max into the state and returns the factor the row's output and sum must
/// be multiplied by (1 when nothing changes).
///
/// Lazy rule (FA4): when the max grows by at most `τ = threshold`, keep the stale max `m`.
///
/// Why this is exact and cannot overflow:
/// - In real arithmetic `O = Σ 2^(s_j - m + c)·v_j` and `l = Σ 2^(s_j - m + c)` share the same `m`
///   (and offset `c`), so `O / l` does not depend on which `m` was used; the LSE adds `m - c` back.
/// - Invariant: every score seen so far is at most `m + τ` (a tile whose max exceeds `m + τ` moves
///   `m` up to that max and rescales O and l by `2^(m_old - m_new) < 1`). Hence each
///   `P = 2^(s - m + c) <= 2^(τ + c)`, so `l <= n_keys·2^(τ + c)` and `|O| <= l·max|v|`.
///   `numerics::validate` caps τ at 64 and c is 0 or 8, so `|O|, l <= 2^72·n_keys·max(1, max|v|)`:
///   f32 (max ~2^128) overflows only if `n_keys·max|v| >= 2^56` (e.g. 2^32 keys with |v| up to
///   2^24 are safe). With FA4's τ = 8 the margin is 2^112, the same order as eager rescaling's.
/// - The exp2 argument `s - m + c` is at most `τ + c <= 72`, inside the polynomial's exponent-add
///   range (< 128).
/// - With P in e4m3 the bound `2^(τ + c)` must also stay below 448, hence `τ + 8 < log2(448)`
///   for FP8 (checked by `numerics::validate`).
///
/// The final normalisation is exact either way; only rounding differs from eager rescaling.
#[inline(always)]
pub fn max_get_scale<M: Exp2Math>(st: &mut RowState, tile_max: f32, math: &M) -> f32 {
    if !(tile_max > st.m) {
        // No growth, or a NaN tile max (propagated by `exp2` in `online_softmax`).
        return 1.0;
    }
    if st.m == f32::NEG_INFINITY {
        st.m = tile_max; // first visible key: O and l are still 0, nothing to rescale
        return 1.0;
    }
    if let Some(t) = math.lazy_threshold() {
        if crate::numerics::lazy_keeps_max(st.m, tile_max, t) {
            return 1.0;
        }
    }
    let scale = math.exp2(st.m - tile_max);
    st.m = tile_max;
    scale
}

/// Turns a row of scores into probabilities in place (`exp2(s - m + offset)`, masked scores
/// −inf give 0), adds them to `l` after scaling `l` by `scale`, and rounds P for the second
/// product.
#[inline(always)]
pub fn online_softmax<M: Exp2Math>(st: &mut RowState, scale: f32, row: &mut [f32], math: &M) {
    // The −inf guard: a row with no visible key so far has m = −inf; use 0 so that masked
    // scores give exp2(−inf) = 0 rather than exp2(NaN).
    let m = if st.m == f32::NEG_INFINITY { 0.0 } else { st.m };
    let shift = m - math.p_offset();
    let mut sum = [0.0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            let p = math.exp2(c[i] - shift);
            sum[i] += p;
            c[i] = math.round_p(p);
        }
    }
    let mut s = sum.iter().sum::<f32>();
    for x in chunks.into_remainder() {
        let p = math.exp2(*x - shift);
        s += p;
        *x = math.round_p(p);
    }
    st.l = st.l * scale + s;
}

/// Multiplies a row of the output accumulator by `scale` (skipped when 1).
#[inline(always)]
pub fn rescale_o(o: &mut [f32], scale: f32) {
    if scale != 1.0 {
        for x in o {
            *x *= scale;
        }
    }
}

/// Normalises the output row by `1/l` and returns the LSE (natural log). A row that saw no key
/// (`l == 0`) gives output 0 and LSE −inf.
#[inline(always)]
pub fn finalize<M: Exp2Math>(st: &RowState, o: &mut [f32], math: &M) -> f32 {
    if st.l == 0.0 {
        o.iter_mut().for_each(|x| *x = 0.0);
        return f32::NEG_INFINITY;
    }
    let inv = 1.0 / st.l;
    for x in o.iter_mut() {
        *x *= inv;
    }
    (st.m - math.p_offset() + st.l.log2()) * std::f32::consts::LN_2
}

//! Incoherent processing (FlashAttention-3 §3.3): rotate Q and K by the same random orthogonal
//! matrix `M = H·D / sqrt(d)` before the FP8 cast, so `(Mq)·(Mk) = q·k` while an outlier entry is
//! spread over all `d` entries and no longer sets the quantisation scale on its own.
//!
//! `D` is a diagonal of ±1 drawn from a seed, `H` the `d × d` Walsh–Hadamard matrix (Sylvester
//! order), applied in `O(d log d)` by the butterfly below. `H·Hᵀ = d·I`, so `M` is orthogonal.
//! `d` must be a power of two; other head dims are refused by [`crate::numerics::validate`]
//! (padding with zeros would change the quantisation blocks' content and is left to callers).
//! Mirrored step for step by `cuda/common/hadamard.cuh`.

use super::rng;

/// Whether the rotation applies to this head_dim.
pub const fn supported(d: usize) -> bool {
    d.is_power_of_two()
}

/// In-place unnormalised fast Walsh–Hadamard transform (`x <- H x`), `x.len()` a power of two.
///
/// Stages of width `h = 1, 2, 4, ...`; each pairs `x[j]` with `x[j + h]` into `(a + b, a - b)`.
/// The CUDA header uses the same stage and pair order, so results agree bit for bit.
///
/// # Panics
/// If `x.len()` is neither 0 nor a power of two (a precondition, like a slice copy's lengths:
/// the transform is not defined there, and a partial one would be a silently wrong answer).
pub fn fwht(x: &mut [f32]) {
    let n = x.len();
    assert!(n == 0 || n.is_power_of_two(), "fwht needs a power-of-two length, got {n}");
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        h *= 2;
    }
}

/// The sign of entry `i` of the random diagonal: the top bit of the `i`-th SplitMix64 output.
#[inline]
pub fn sign(seed: u64, i: usize) -> f32 {
    if rng::nth(seed, i as u64) >> 63 == 1 {
        -1.0
    } else {
        1.0
    }
}

/// `1/sqrt(d)` as both languages compute it (a correctly rounded sqrt, then a correctly rounded
/// division).
#[inline]
pub fn norm(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

/// The rotation `x -> H·D·x / sqrt(d)` for one head_dim and seed. The signs of `D` are computed
/// as they are used, so building a rotation allocates nothing.
#[derive(Clone, Debug)]
pub struct Rotation {
    d: usize,
    seed: u64,
    norm: f32,
}

impl Rotation {
    /// `None` when `d` is not a power of two.
    pub fn new(d: usize, seed: u64) -> Option<Self> {
        supported(d).then(|| Rotation { d, seed, norm: norm(d) })
    }

    pub fn head_dim(&self) -> usize {
        self.d
    }

    /// Rotates one row in place: signs, butterfly, then the normalisation.
    ///
    /// # Panics
    /// If `x.len()` is not the rotation's head_dim (a precondition, like a slice copy's lengths).
    pub fn apply(&self, x: &mut [f32]) {
        assert_eq!(x.len(), self.d, "row length must be head_dim");
        for (i, v) in x.iter_mut().enumerate() {
            *v *= sign(self.seed, i);
        }
        fwht(x);
        for v in x.iter_mut() {
            *v *= self.norm;
        }
    }

    /// Rotates every row of a contiguous `[.., head_dim]` buffer (a tail shorter than head_dim,
    /// which no `[.., head_dim]` buffer has, is left as it is).
    pub fn apply_rows(&self, data: &mut [f32]) {
        for row in data.chunks_exact_mut(self.d) {
            self.apply(row);
        }
    }
}

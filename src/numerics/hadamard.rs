//! Incoherent processing (FlashAttention-3 §3.3): rotate Q and K by the same random orthogonal
//! matrix `M = H·D / sqrt(d)` before the FP8 cast, so `(Mq)·(Mk) = q·k` while an outlier entry is
//! spread over all `d` entries and no longer sets the quantisation scale on its own.
//!
//! `D` is a diagonal of ±1 drawn from a seed, `H` the `d × d` Walsh–Hadamard matrix (Sylvester
//! order), applied in `O(d log d)` by the butterfly below. `H·Hᵀ = d·I`, so `M` is orthogonal.
//! `d` must be a power of two; other head dims are refused by [`crate::numerics::validate`]
//! (padding with zeros would change the quantisation blocks' content and is left to callers).
//! Mirrored step for step by `cuda/include/hadamard.cuh`.

use super::rng;

/// Whether the rotation applies to this head_dim.
pub const fn supported(d: usize) -> bool {
    d.is_power_of_two()
}

/// In-place unnormalised fast Walsh–Hadamard transform (`x <- H x`), `x.len()` a power of two.
///
/// Stages of width `h = 1, 2, 4, ...`; each pairs `x[j]` with `x[j + h]` into `(a + b, a - b)`.
/// The CUDA header uses the same stage and pair order, so results agree bit for bit.
pub fn fwht(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
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

/// The rotation `x -> H·D·x / sqrt(d)` for one head_dim and seed.
#[derive(Clone, Debug)]
pub struct Rotation {
    signs: Vec<f32>,
    norm: f32,
}

impl Rotation {
    /// `None` when `d` is not a power of two.
    pub fn new(d: usize, seed: u64) -> Option<Self> {
        supported(d).then(|| Rotation { signs: (0..d).map(|i| sign(seed, i)).collect(), norm: norm(d) })
    }

    pub fn head_dim(&self) -> usize {
        self.signs.len()
    }

    /// Rotates one row in place: signs, butterfly, then the normalisation.
    pub fn apply(&self, x: &mut [f32]) {
        assert_eq!(x.len(), self.signs.len(), "row length must be head_dim");
        for (v, s) in x.iter_mut().zip(&self.signs) {
            *v *= s;
        }
        fwht(x);
        for v in x.iter_mut() {
            *v *= self.norm;
        }
    }

    /// Rotates every row of a contiguous `[.., head_dim]` buffer.
    pub fn apply_rows(&self, data: &mut [f32]) {
        for row in data.chunks_exact_mut(self.signs.len()) {
            self.apply(row);
        }
    }
}

//! A tiny deterministic generator (SplitMix64, Steele, Lea & Flood 2014), so the crate needs no
//! RNG dependency. It is counter based: the `i`-th output (0-based) of a stream seeded with `s`
//! is `mix64(s + (i + 1) * GOLDEN_GAMMA)`, so a GPU thread can compute any element on its own
//! (`cuda/common/hadamard.cuh` does exactly that for the Hadamard signs).

/// The SplitMix64 increment, `2^64 / φ` rounded to odd.
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function (a bijective 64-bit finaliser).
#[inline]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `i`-th output of the stream seeded with `seed`, without stepping through the others.
#[inline]
pub const fn nth(seed: u64, i: u64) -> u64 {
    mix64(seed.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA)))
}

/// A sequential SplitMix64 stream.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub const fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box–Muller, one value per call; the partner value is dropped).
    pub fn normal(&mut self) -> f64 {
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// `true` with probability `p`.
    pub fn bernoulli(&mut self, p: f64) -> bool {
        self.uniform() < p
    }

    /// Uniform in `0..n` (0 for `n == 0`); the modulo bias is below `n / 2^64`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Fisher–Yates shuffle of `v`.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// Probability that an entry of FlashAttention-3's accuracy inputs carries an outlier.
pub const FA3_OUTLIER_PROB: f64 = 0.001;
/// Standard deviation of the outlier term (`N(0, 100)`).
pub const FA3_OUTLIER_STD: f64 = 10.0;

/// `n` entries of FlashAttention-3's accuracy inputs (§4.3, Table 3):
/// `N(0, 1) + N(0, 100)·Bernoulli(0.001)`, i.e. 0.1 % of the entries get an extra std-10 term.
pub fn fa3_outlier_values(g: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let base = g.normal();
            let extra = if g.bernoulli(FA3_OUTLIER_PROB) { FA3_OUTLIER_STD * g.normal() } else { 0.0 };
            (base + extra) as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_reference_vector_and_nth() {
        // First outputs of SplitMix64 seeded with 0 (as published with the reference C code).
        let mut g = SplitMix64::new(0);
        assert_eq!(g.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(g.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let mut g = SplitMix64::new(1234);
        for i in 0..100 {
            assert_eq!(g.next_u64(), nth(1234, i));
        }
    }

    #[test]
    fn normal_has_unit_moments() {
        let mut g = SplitMix64::new(7);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| g.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }
}

//! The FLOP and byte model of a forward pass, shared by the benches, the `bench` example and the
//! report, so every number in them is counted the same way.
//!
//! - **FLOPs** = 4 · head_dim · (visible (query, key) pairs summed over batch and query heads):
//!   the two products S = Q·Kᵀ and O = P·V each cost 2·head_dim FLOPs (a multiply and an add) per
//!   visible pair. Without a mask that is FlashAttention's 4·batch·heads·seqlen_q·seqlen_k·head_dim.
//!   Causal and window masks count only the unmasked pairs, exactly ([`Problem::visible_pairs`]),
//!   not "÷2": a square causal head has n(n+1)/2 pairs, and bottom-right alignment with
//!   seqlen_q ≠ seqlen_k is honoured. Softmax work (exp, max, sums) is not counted, as in every
//!   FlashAttention paper, so rates compare with theirs and with a GEMM's.
//! - **Minimum bytes**: what any implementation must move to and from memory: q, k and v read once,
//!   o written once, plus the LSE (f32) when it is returned. All in the input dtype (an FP8 run
//!   still receives and returns the input dtype, so it is counted the same).
//! - **Arithmetic intensity** = FLOPs / minimum bytes, the x axis of the roofline plot.

use crate::problem::Problem;

/// Bytes of one LSE value (always f32).
const LSE_BYTES: u64 = 4;
/// FLOPs per visible (query, key) pair and head-dim element: a multiply and an add in each of
/// the two products.
const FLOPS_PER_PAIR_ELEMENT: u64 = 4;

/// The cost of one forward pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    /// FLOPs of the two products over the unmasked pairs.
    pub flops: u64,
    /// Minimum bytes moved: q, k, v read once, o (and LSE) written once.
    pub bytes: u64,
}

impl Cost {
    /// FLOPs per byte.
    pub fn intensity(&self) -> f64 {
        self.flops as f64 / self.bytes.max(1) as f64
    }
}

/// FLOPs of the two products, counting only the unmasked (query, key) pairs (saturating at
/// `u64::MAX`, like every count here: a model of a problem too large to run must not panic).
/// Q·Kᵀ runs over q/k's head_dim and P·V over v's: each pair costs half the per-element count
/// on each.
pub fn flops(p: &Problem) -> u64 {
    let dims = (p.head_dim as u64).saturating_add(p.head_dim_v as u64);
    (FLOPS_PER_PAIR_ELEMENT / 2).saturating_mul(dims).saturating_mul(p.visible_pairs())
}

/// Minimum bytes: q, k, v read once, o written once, plus the LSE when returned.
pub fn min_bytes(p: &Problem) -> u64 {
    let prod = |xs: &[usize]| xs.iter().fold(1u64, |a, &x| a.saturating_mul(x as u64));
    let elem = p.dtype.size();
    let q_rows = prod(&[p.batch, p.seqlen_q, p.heads_q]);
    let qo = prod(&[p.batch, p.seqlen_q, p.heads_q, p.head_dim + p.head_dim_v, elem]); // q read, o written
    let kv = prod(&[p.batch, p.seqlen_k, p.heads_kv, p.head_dim + p.head_dim_v, elem]); // k and v read
    let lse = if p.return_lse { q_rows.saturating_mul(LSE_BYTES) } else { 0 };
    qo.saturating_add(kv).saturating_add(lse)
}

/// FLOPs per byte of minimum traffic.
pub fn arithmetic_intensity(p: &Problem) -> f64 {
    cost(p).intensity()
}

/// FLOPs and minimum bytes together.
pub fn cost(p: &Problem) -> Cost {
    Cost { flops: flops(p), bytes: min_bytes(p) }
}

/// A rate in FLOP/s from a FLOP count and a time in milliseconds.
pub fn flops_per_second(flops: u64, ms: f64) -> f64 {
    flops as f64 / (ms * 1e-3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ForwardOptions, Mask, Tensor};

    fn problem(b: usize, sq: usize, sk: usize, h: usize, d: usize, opts: &ForwardOptions) -> Problem {
        let q = Tensor::from_vec(vec![0.0f32; b * sq * h * d], [b, sq, h, d]).unwrap();
        let k = Tensor::from_vec(vec![0.0f32; b * sk * h * d], [b, sk, h, d]).unwrap();
        Problem::new(&q.view(), &k.view(), &k.view(), opts).unwrap()
    }

    #[test]
    fn dense_is_the_textbook_formula() {
        let p = problem(2, 5, 7, 3, 16, &ForwardOptions::default());
        assert_eq!(flops(&p), 4 * 2 * 3 * 5 * 7 * 16);
        // q and o: 2*5*3*16 elements each; k and v: 2*7*3*16 each; f32.
        assert_eq!(min_bytes(&p), (2 * 2 * 5 * 3 * 16 + 2 * 2 * 7 * 3 * 16) * 4);
        let with_lse = problem(2, 5, 7, 3, 16, &ForwardOptions::default().return_lse(true));
        assert_eq!(min_bytes(&with_lse), min_bytes(&p) + 2 * 3 * 5 * 4);
    }

    #[test]
    fn square_causal_counts_n_n_plus_1_over_2_pairs() {
        let n = 37;
        let p = problem(1, n, n, 2, 8, &ForwardOptions::default().causal(true));
        assert_eq!(flops(&p), 4 * 8 * 2 * (n * (n + 1) / 2) as u64);
    }

    #[test]
    fn causal_is_bottom_right_aligned() {
        // sq=3 < sk=5: row i sees keys 0..=i+2 -> 3 + 4 + 5 = 12 pairs.
        let p = problem(1, 3, 5, 1, 4, &ForwardOptions::default().causal(true));
        assert_eq!(flops(&p), 4 * 4 * 12);
        // sq=5 > sk=3: row i sees keys 0..=i-2 -> rows 0,1 none, then 1 + 2 + 3 = 6 pairs.
        let p = problem(1, 5, 3, 1, 4, &ForwardOptions::default().causal(true));
        assert_eq!(flops(&p), 4 * 4 * 6);
    }

    #[test]
    fn window_counts_the_band() {
        // n=8, left 2, right 1: rows 0 and 7 see 2 and 3 keys, row 1 sees 3, rows 2..=6 see 4.
        let p = problem(1, 8, 8, 1, 4, &ForwardOptions::default().mask(Mask::window(2, 1)));
        assert_eq!(flops(&p), 4 * 4 * (2 + 3 + 5 * 4 + 3));
        // Causal window of 3 keys back, n=8: rows see 1, 2, 3, then 4 keys each (5 rows).
        let p = problem(1, 8, 8, 1, 4, &ForwardOptions::default().mask(Mask::causal_window(3)));
        assert_eq!(flops(&p), 4 * 4 * (1 + 2 + 3 + 5 * 4));
    }

    #[test]
    fn intensity_is_flops_over_bytes() {
        let p = problem(1, 64, 64, 2, 32, &ForwardOptions::default());
        let c = cost(&p);
        assert!((arithmetic_intensity(&p) - c.flops as f64 / c.bytes as f64).abs() < 1e-12);
        assert!((flops_per_second(2_000_000, 2.0) - 1e9).abs() < 1e-3);
    }
}

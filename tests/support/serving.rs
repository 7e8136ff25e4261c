//! Helpers of the serving tests: per-sequence checks against the float64 reference.
#![allow(dead_code)]

use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff};
use flash_attn::{DType, ForwardOptions, Mask, Problem, Tensor};
use proptest::prelude::*;

pub use super::{floor_for, Rng};
use super::props;

/// `n` normal values rounded to `dtype` (so every copy of them is exact).
pub fn values(rng: &mut Rng, n: usize, dtype: DType) -> Vec<f32> {
    (0..n).map(|_| dtype.round(rng.normal() as f32)).collect()
}

/// The observed margins of one sequence.
#[derive(Clone, Copy, Debug, Default)]
pub struct SeqCheck {
    pub err: f64,
    pub naive_err: f64,
    pub lse_err: f64,
}

/// Checks one sequence: `q` `[sq][hq][d]`, `k`, `v` `[sk][hkv][d]` (values already in `dtype`),
/// against our output rows `o` `[sq][hq][d]` and LSE `lse[h][i]` (when given), with
/// FlashAttention's rule `err <= 2·naive_err + floor` and LSE within 1e-4 relative.
#[allow(clippy::too_many_arguments)]
pub fn check_seq(
    dtype: DType,
    (sq, sk, hq, hkv, d): (usize, usize, usize, usize, usize),
    q: &[f32],
    k: &[f32],
    v: &[f32],
    opts: &ForwardOptions,
    o: &[f32],
    lse: Option<&dyn Fn(usize, usize) -> f32>,
) -> Result<SeqCheck, String> {
    if sq == 0 {
        return Ok(SeqCheck::default());
    }
    if sk == 0 {
        // No key at all: every row is 0 with LSE −inf.
        if o.iter().any(|&x| x != 0.0) {
            return Err("a sequence with no keys must give 0".into());
        }
        if let Some(l) = lse {
            for h in 0..hq {
                for i in 0..sq {
                    if l(h, i) != f32::NEG_INFINITY {
                        return Err(format!("lse[{h}][{i}] = {} for a sequence with no keys", l(h, i)));
                    }
                }
            }
        }
        return Ok(SeqCheck::default());
    }
    let qt = Tensor::from_f32(q, dtype, [1, sq, hq, d]).unwrap();
    let kt = Tensor::from_f32(k, dtype, [1, sk, hkv, d]).unwrap();
    let vt = Tensor::from_f32(v, dtype, [1, sk, hkv, d]).unwrap();
    let p = Problem::new(&qt.view(), &kt.view(), &vt.view(), opts).map_err(|e| e.to_string())?;
    let r = attention_f64(&p, &qt.view(), &kt.view(), &vt.view()).unwrap();
    let naive = attention_naive(&p, &qt.view(), &kt.view(), &vt.view(), dtype).unwrap();
    let ours: Vec<f64> = o.iter().map(|&x| x as f64).collect();
    let c = SeqCheck {
        err: max_abs_diff(&ours, &r.o),
        naive_err: max_abs_diff(&naive, &r.o),
        lse_err: match lse {
            Some(l) => {
                let mut worst = 0.0f64;
                for h in 0..hq {
                    for i in 0..sq {
                        let (got, want) = (l(h, i) as f64, r.lse[h * sq + i]);
                        let e = if got == want { 0.0 } else { (got - want).abs() / want.abs().max(1.0) };
                        worst = worst.max(if e.is_nan() { f64::INFINITY } else { e });
                    }
                }
                worst
            }
            None => 0.0,
        },
    };
    if c.err > 2.0 * c.naive_err + floor_for(dtype) {
        return Err(format!("output error {c:?} above 2·naive + {}", floor_for(dtype)));
    }
    if c.lse_err > 1e-4 {
        return Err(format!("lse error {c:?}"));
    }
    if o.iter().any(|x| !x.is_finite()) {
        return Err("finite inputs must give finite outputs".into());
    }
    Ok(c)
}

/// Rows `r0..r1` of a `[rows][heads][d]` buffer.
pub fn rows(x: &[f32], r0: usize, r1: usize, heads: usize, d: usize) -> Vec<f32> {
    x[r0 * heads * d..r1 * heads * d].to_vec()
}

/// ALiBi slopes for `hq` heads (the usual geometric sequence).
pub fn slopes(hq: usize) -> Vec<f32> {
    (0..hq).map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / hq as f32)).collect()
}

/// Attention-sink logits of `hq` query heads, cycling through one far above any score (the
/// keys weigh ~e^-97; exp(sink - max) overflows f32), none (-inf), and two near the scores.
pub fn sinks(hq: usize) -> Vec<f32> {
    (0..hq).map(|h| [100.0, f32::NEG_INFINITY, 0.7, -2.0][h % 4]).collect()
}

/// The attention options of a random serving case, and the seed of its values.
#[derive(Debug, Clone)]
pub struct Opts {
    pub heads_kv: usize,
    /// heads_q / heads_kv (the GQA group).
    pub ratio: usize,
    pub d: usize,
    pub mask: Mask,
    pub softcap: Option<f32>,
    pub alibi: bool,
    pub lse: bool,
    pub threads: usize,
    pub splits: Option<usize>,
    pub seed: u64,
}

impl Opts {
    pub fn hq(&self) -> usize {
        self.heads_kv * self.ratio
    }
    pub fn forward(&self) -> ForwardOptions {
        let mut o = ForwardOptions::default()
            .mask(self.mask)
            .return_lse(self.lse)
            .cpu_threads(self.threads);
        if let Some(c) = self.softcap {
            o = o.softcap(c);
        }
        if self.alibi {
            o = o.alibi_slopes(slopes(self.hq()));
        }
        if let Some(s) = self.splits {
            o = o.num_splits(s);
        }
        o
    }
}

/// Every mask kind, windows of -1 (unbounded) to 29: [`props::mask_strategy`] at the serving
/// properties' bound.
pub fn mask_strategy() -> impl Strategy<Value = Mask> {
    props::mask_strategy(30)
}

/// Options with 1-2 kv heads, GQA ratios 1, 2, 4, 7, head dims 16 to 128, every mask, softcap,
/// ALiBi and LSE at random, 1-3 threads, and `splits` for `num_splits`.
pub fn opts_strategy(splits: impl Strategy<Value = Option<usize>>) -> impl Strategy<Value = Opts> {
    (
        (
            1usize..=2,
            prop::sample::select(vec![1usize, 2, 4, 7]),
            prop::sample::select(vec![16usize, 36, 64, 72, 128]),
        ),
        mask_strategy(),
        (
            prop::option::weighted(0.3, 5.0f32..50.0),
            prop::bool::weighted(0.3),
            any::<bool>(),
        ),
        (1usize..=3, splits, any::<u64>()),
    )
        .prop_map(
            |((heads_kv, ratio, d), mask, (softcap, alibi, lse), (threads, splits, seed))| Opts {
                heads_kv,
                ratio,
                d,
                mask,
                softcap,
                alibi,
                lse,
                threads,
                splits,
                seed,
            },
        )
}

/// A sequence length with 0 and 1 well represented.
pub fn len_strategy(max: usize) -> impl Strategy<Value = usize> {
    prop_oneof![1 => Just(0usize), 1 => Just(1usize), 4 => 0..=max]
}

/// A paged cache's block table: sequence `b` holds `lens[b] + new` keys in pages of `ps`, and
/// with `share` each sequence after the first takes its first full cached pages from sequence 0
/// (prefix sharing). The pool has the blocks used plus `spare_blocks`, in shuffled order (one
/// `rng.shuffle`); each table row has `spare_width` entries past the longest sequence's pages,
/// -1 past a sequence's own.
pub struct PagedTable {
    /// `[batch][width]` block ids.
    pub ids: Vec<i32>,
    pub width: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Pages of each sequence shared with sequence 0.
    pub shared: Vec<usize>,
}

pub fn paged_table(
    lens: &[usize],
    new: usize,
    ps: usize,
    share: bool,
    (spare_blocks, spare_width): (usize, usize),
    rng: &mut Rng,
) -> PagedTable {
    let batch = lens.len();
    let pages: Vec<usize> = lens.iter().map(|l| (l + new).div_ceil(ps)).collect();
    let shared: Vec<usize> =
        (0..batch).map(|b| if share && b > 0 { (lens[0] / ps).min(lens[b] / ps) } else { 0 }).collect();
    let num_blocks = (0..batch).map(|b| pages[b] - shared[b]).sum::<usize>() + spare_blocks;
    let mut pool: Vec<i32> = (0..num_blocks as i32).collect();
    rng.shuffle(&mut pool);
    let width = pages.iter().copied().max().unwrap_or(0) + spare_width;
    let mut ids = vec![-1i32; batch * width];
    let mut next = pool.into_iter();
    for b in 0..batch {
        for p in 0..pages[b] {
            ids[b * width + p] = if p < shared[b] { ids[p] } else { next.next().unwrap() };
        }
    }
    PagedTable { ids, width, num_blocks, shared }
}

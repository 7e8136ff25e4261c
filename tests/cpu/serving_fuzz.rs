//! Property tests of the serving API over random, possibly malformed, layouts.
//!
//! Each case draws a well-formed batch (packed offsets, packed k/v contiguous or head-major, a
//! dense or paged cache, contiguous or head-major, with shuffled and shared blocks, page sizes
//! 1..=300, caches of 0 to 320 keys and now and then 1025..=1400, appends of 0 to 4 rows,
//! `num_splits` 1..=64 or the heuristic, GQA, every mask, softcap, ALiBi, LSE, f32 / f16 /
//! bf16) and then breaks about half of them with one to three random edits (offsets swapped,
//! shifted, added, dropped, set to extremes; packed tensors with more or fewer rows than the
//! offsets say; `max_seqlen` one short; cache lengths past the capacity or negative; block ids
//! out of range, negative or another entry's; two sequences made twins (one length, one table
//! row: their appends collide); tables of another length or width; caches of
//! another batch, capacity or block count, or page size 0; `num_splits` 0 or past 128). The test
//! reads the layout by the documented rules itself (docs/serving.md "Semantics"), and the call
//! must agree:
//!
//! - a layout that breaks a rule is a typed error naming an argument that breaks one, and the
//!   cache an append may write is unchanged, byte for byte (`forward_kvcache_append` and
//!   `append_kv`);
//! - a valid layout gives, per sequence, the float64 reference of that sequence's keys as the
//!   test gathers them, within FlashAttention's rule (`support::serving::check_seq`); unread cache
//!   slots hold NaN;
//! - the split-KV result equals the unsplit one (`num_splits(1)`) within [`SPLIT_ULPS`] f32 ulps
//!   of max |v| (plus one ulp of a 16-bit output; LSE: of max(1, |LSE|));
//! - `forward_kvcache_append` equals the explicit append (the test writes k/v into a copy of the
//!   cache at the slots the table names) followed by `forward_kvcache`, bit for bit, and leaves
//!   the cache equal to that copy; `append_kv` leaves it the same.
//!
//! `cargo test --test cpu serving_fuzz -- --nocapture` prints the worst margins of each run.

use crate::support::props;

use flash_attn::serving::{
    append_kv, forward_kvcache, forward_kvcache_append, forward_varlen, forward_varlen_kvcache, BlockTable, KvCache,
    KvCacheMut, Varlen,
};
use flash_attn::{DType, Element, Error, ForwardOptions, Output, OwnedData, Tensor, TensorView};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use crate::support::serving::{check_seq, len_strategy, opts_strategy, paged_table, values, Opts, Rng, SeqCheck};
use std::cell::Cell;

mod cache;
mod edits;
mod layout;
mod varlen;

use layout::{named, Broken, CacheLayout};

// ---------------------------------------------------------------- checks shared by the properties

/// Bits of a cache element, so that buffers are compared byte for byte (NaN included).
trait Bits: Element {
    fn bits(self) -> u32;
}
impl Bits for f32 {
    fn bits(self) -> u32 {
        self.to_bits()
    }
}
impl Bits for half::f16 {
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
}
impl Bits for half::bf16 {
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
}

/// The first element where `a` and `b` differ in their bits.
fn first_diff<T: Bits>(a: &[T], b: &[T]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x.bits() != y.bits())
}

/// f32 ulps of the largest |v| by which the split-KV output may differ from the unsplit one: the
/// partial outputs' rescalings and sums see the keys in other groupings, so each partial carries
/// its own f32 rounding (then merged in f64). LSEs: the same count of ulps of max(1, |LSE|).
const SPLIT_ULPS: f64 = 16.0;

/// One unit in the last place of `dtype` at |x| (0 for f32, whose rounding the ulps above
/// cover): two f32 results a hair apart may round to neighbouring f16 / bf16 values.
fn output_ulp(dtype: DType, x: f32) -> f64 {
    let (mantissa, min_normal) = match dtype {
        DType::F16 => (10, 2f64.powi(-14)),
        DType::BF16 => (7, 2f64.powi(-126)),
        _ => return 0.0,
    };
    2f64.powf((x.abs() as f64).max(min_normal).log2().floor() - mantissa as f64)
}

/// The split-KV difference in f32 ulps (see [`SPLIT_ULPS`]): for outputs, `(|split − unsplit| −
/// output_ulp) / (2⁻²⁴ · max|v|)`, the output ulp taken at the larger of the two; for LSEs,
/// `|split − unsplit| / (2⁻²⁴ · max(1, |LSE|))`. Fails above [`SPLIT_ULPS`]; returns the largest.
fn split_ulps(dtype: DType, one: &Output, split: &Output, vmax: f32) -> Result<f64, TestCaseError> {
    let ulp = f64::powi(2.0, -24);
    let (a, b) = (one.o.to_f32_vec(), split.o.to_f32_vec());
    prop_assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    let mut see = |r: f64| worst = worst.max(if r.is_nan() { f64::INFINITY } else { r });
    for (x, y) in a.iter().zip(&b) {
        if x.to_bits() != y.to_bits() {
            let excess = (x - y).abs() as f64 - output_ulp(dtype, x.abs().max(y.abs()));
            see(excess.max(0.0) / (ulp * vmax as f64));
        }
    }
    if let (Some(la), Some(lb)) = (&one.lse, &split.lse) {
        for (x, y) in la.iter().zip(lb) {
            if x.to_bits() != y.to_bits() {
                see((x - y).abs() as f64 / (ulp * (x.abs() as f64).max(1.0)));
            }
        }
    }
    prop_assert!(
        worst <= SPLIT_ULPS,
        "split-KV result {worst:.1} f32 ulps away from the unsplit one (at most {SPLIT_ULPS})"
    );
    Ok(worst)
}

/// The margins a passing run saw.
#[derive(Default)]
struct Worst {
    reference: Cell<f64>,
    split: Cell<f64>,
    refused: Cell<u32>,
    accepted: Cell<u32>,
}

impl Worst {
    fn seq(&self, c: &SeqCheck, dtype: DType) {
        let r = c.err / (2.0 * c.naive_err + crate::support::floor_for(dtype));
        self.reference.set(self.reference.get().max(r));
    }
    fn split(&self, m: f64) {
        self.split.set(self.split.get().max(m));
    }
}

/// Runs `cases` cases of `f` under the shared proptest configuration and prints the margins.
fn run<S: Strategy>(name: &str, cases: u32, strategy: S, f: impl Fn(&S::Value, &Worst) -> Result<(), TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    let config = props::config(name, file!(), cases);
    let cases = config.cases;
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let worst = Worst::default();
    let result = runner.run(&strategy, |c| f(&c, &worst));
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    println!(
        "{name}: {cases} cases passed ({} refused, {} run); max err / (2·naive_err + floor) {:.3}; max split-KV difference {:.1} f32 ulps",
        worst.refused.get(),
        worst.accepted.get(),
        worst.reference.get(),
        worst.split.get()
    );
}

/// An error must be typed and name an argument the case breaks; a valid case must not fail.
fn expect_refusal(e: &Error, broken: &Broken) -> Result<(), TestCaseError> {
    prop_assert!(!broken.is_empty(), "a valid layout refused: {e}");
    let name = named(e);
    prop_assert!(
        name.is_some_and(|n| broken.contains(&n)),
        "the error names {name:?}, the case breaks {broken:?}: {e}"
    );
    Ok(())
}

/// The per-sequence inputs of the reference: q rows `[sq][hq][d]`, keys and values `[sk][hkv][d]`.
struct SeqInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Checks every sequence of `out` against the float64 reference of its own inputs. `q_rows(b)`
/// is sequence `b`'s rows of q (and o) as (first flat row, count); LSE rows are at
/// `lse_at(b, h, i)`.
#[allow(clippy::too_many_arguments)]
fn check_sequences(
    dtype: DType,
    o: &Opts,
    opts: &ForwardOptions,
    out: &Output,
    seqs: &[SeqInputs],
    q_rows: &dyn Fn(usize) -> (usize, usize),
    lse_at: &dyn Fn(usize, usize, usize) -> usize,
    worst: &Worst,
) -> Result<(), TestCaseError> {
    let (hq, hkv, d) = (o.hq(), o.heads_kv, o.d);
    let ov = out.o.to_f32_vec();
    for (b, s) in seqs.iter().enumerate() {
        let (r0, n) = q_rows(b);
        let lse = |h: usize, i: usize| out.lse.as_ref().unwrap()[lse_at(b, h, i)];
        let c = check_seq(
            dtype,
            (n, s.k.len() / (hkv * d), hq, hkv, d),
            &s.q,
            &s.k,
            &s.v,
            opts,
            &ov[r0 * hq * d..(r0 + n) * hq * d],
            if o.lse { Some(&lse) } else { None },
        )
        .map_err(|e| TestCaseError::fail(format!("sequence {b}: {e} ({})", out.dispatch.reason)))?;
        worst.seq(&c, dtype);
    }
    Ok(())
}

/// Cache rows `slots` of a cache buffer, gathered as `[keys][hkv][d]`.
fn gather<T: Element>(buf: &[T], layout: &CacheLayout, slots: &[usize]) -> Vec<f32> {
    let [_, _, hkv, d] = layout.shape;
    let rows = slots.iter().flat_map(|&s| (0..hkv).map(move |h| layout.at(s, h)));
    rows.flat_map(|at| buf[at..at + d].iter().map(|x| x.to_f32())).collect()
}

fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

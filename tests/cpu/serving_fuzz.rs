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

// ---------------------------------------------------------------- the test's reading of a layout

/// The arguments a case breaks (the `what` / `option` an error may name), empty for a valid one.
type Broken = Vec<&'static str>;

/// The argument a typed error names, or `None` for an error the serving layouts never cause.
fn named(e: &Error) -> Option<&str> {
    match e {
        Error::InvalidSeqLayout { what, .. } | Error::ShapeMismatch { what, .. } => Some(what),
        Error::InvalidOption { option, .. } => Some(option),
        Error::TooLarge { .. } => Some("too large"),
        Error::EmptyDimension { operand, .. } if *operand == flash_attn::Operand::K => Some("k"),
        _ => None,
    }
}

/// Sequence row ranges of a `cu_seqlens` array over a tensor of `rows` rows, by the rules
/// (`batch + 1 >= 2` entries from 0, non-decreasing, ending at `rows`, `max_seqlen` at least
/// the longest), or the names of the rules it breaks.
fn read_cu(
    name: &'static str,
    max_name: &'static str,
    cu: &[i32],
    rows: usize,
    max: usize,
    broken: &mut Broken,
) -> Option<Vec<(usize, usize)>> {
    let ok = cu.len() >= 2
        && cu[0] == 0
        && cu.windows(2).all(|w| w[0] <= w[1])
        && usize::try_from(cu[cu.len() - 1]) == Ok(rows);
    if !ok {
        broken.push(name);
        return None;
    }
    let ranges: Vec<(usize, usize)> = cu.windows(2).map(|w| (w[0] as usize, w[1] as usize)).collect();
    if ranges.iter().any(|r| r.1 - r.0 > max) {
        broken.push(max_name);
        return None;
    }
    Some(ranges)
}

/// A KV cache's layout as the call receives it.
#[derive(Clone, Debug)]
struct CacheLayout {
    /// `[batch, capacity, hkv, d]` (dense) or `[num_blocks, page_size, hkv, d]` (paged).
    shape: [usize; 4],
    seqlens: Vec<i32>,
    /// Block ids and `max_blocks_per_seq` (paged).
    table: Option<(Vec<i32>, usize)>,
    /// The buffers hold `[outer, hkv, rows, d]` (a strided view of the shape above).
    heads_major: bool,
}

impl CacheLayout {
    /// The cache row (`outer · rows + row`) of key `j` of sequence `b` (the layout known valid
    /// for it).
    fn slot(&self, b: usize, j: usize) -> Option<usize> {
        let [n0, n1, _, _] = self.shape;
        Some(match &self.table {
            None => b * n1 + j,
            Some((ids, mb)) => {
                let id = usize::try_from(ids[b * mb + j / n1]).ok().filter(|&id| id < n0)?;
                id * n1 + j % n1
            }
        })
    }

    /// Element offset of head `h` of cache row `slot`.
    fn at(&self, slot: usize, h: usize) -> usize {
        let [_, n1, hkv, d] = self.shape;
        if self.heads_major {
            ((slot / n1 * hkv + h) * n1 + slot % n1) * d
        } else {
            (slot * hkv + h) * d
        }
    }

    /// The cache rows of the `seqlens[b] + new` key rows of each of `batch` sequences, by
    /// the rules, or the names of the rules the layout breaks.
    fn read(&self, batch: usize, new: usize, broken: &mut Broken) -> Option<Vec<Vec<usize>>> {
        let [n0, n1, _, _] = self.shape;
        let before = broken.len();
        let capacity = match &self.table {
            None => {
                if n0 != batch {
                    broken.push("k_cache");
                }
                n1
            }
            Some((ids, mb)) => {
                if n1 == 0 {
                    broken.push("page size");
                    return None;
                }
                match batch.checked_mul(*mb) {
                    None => broken.push("too large"),
                    Some(n) if n != ids.len() => broken.push("block_table"),
                    _ => {}
                }
                mb.saturating_mul(n1)
            }
        };
        let lens_ok =
            self.seqlens.len() == batch && self.seqlens.iter().all(|&s| s >= 0 && s as usize + new <= capacity);
        if !lens_ok {
            broken.push("cache_seqlens");
        }
        if broken.len() > before {
            return None;
        }
        let mut out = Vec::with_capacity(batch);
        for (b, &s) in self.seqlens.iter().enumerate() {
            let keys: Option<Vec<usize>> = (0..s as usize + new).map(|j| self.slot(b, j)).collect();
            let Some(keys) = keys else {
                broken.push("block_table");
                return None;
            };
            out.push(keys);
        }
        Some(out)
    }

    fn view<'a, T: Element>(&'a self, k: &'a [T], v: &'a [T]) -> KvCache<'a> {
        let [n0, n1, hkv, d] = self.shape;
        let (k, v) = if self.heads_major {
            (
                TensorView::heads_major(k, [n0, hkv, n1, d]),
                TensorView::heads_major(v, [n0, hkv, n1, d]),
            )
        } else {
            (TensorView::new(k, self.shape), TensorView::new(v, self.shape))
        };
        match &self.table {
            None => KvCache::dense(k, v, &self.seqlens),
            Some((ids, mb)) => KvCache::paged(
                k,
                v,
                &self.seqlens,
                BlockTable {
                    ids,
                    max_blocks_per_seq: *mb,
                },
            ),
        }
    }
}

// ---------------------------------------------------------------- edits that may break a layout

/// An edit of a `cu_seqlens` array or its packed tensor (`k`: the key side, else the query
/// side). Indices are taken modulo the array's length.
#[derive(Clone, Debug)]
enum CuEdit {
    Swap(bool, usize, usize),
    Add(bool, usize, i32),
    Set(bool, usize, i32),
    Push(bool, i32),
    Pop(bool),
    /// The packed tensor gets this many rows more (or fewer) than the last offset.
    Rows(bool, i32),
}

fn extreme_i32() -> impl Strategy<Value = i32> {
    prop_oneof![
        3 => -3i32..400,
        1 => prop::sample::select(vec![i32::MIN, -1, i32::MAX, i32::MAX - 1, 1 << 20]),
    ]
}

fn cu_edit(sides: bool) -> impl Strategy<Value = CuEdit> {
    let side = move || any::<bool>().prop_map(move |k| k && sides);
    prop_oneof![
        (side(), any::<usize>(), any::<usize>()).prop_map(|(k, i, j)| CuEdit::Swap(k, i, j)),
        (side(), any::<usize>(), -5i32..=5).prop_map(|(k, i, x)| CuEdit::Add(k, i, x)),
        (side(), any::<usize>(), extreme_i32()).prop_map(|(k, i, x)| CuEdit::Set(k, i, x)),
        (side(), extreme_i32()).prop_map(|(k, x)| CuEdit::Push(k, x)),
        side().prop_map(CuEdit::Pop),
        (side(), -3i32..=3).prop_map(|(k, x)| CuEdit::Rows(k, x)),
    ]
}

/// Applies `e` to the `cu` arrays and row counts of (queries, keys).
fn apply_cu(e: &CuEdit, cu: [&mut Vec<i32>; 2], rows: [&mut usize; 2]) {
    let keys = match *e {
        CuEdit::Swap(k, ..) | CuEdit::Add(k, ..) | CuEdit::Set(k, ..) | CuEdit::Push(k, _) | CuEdit::Pop(k) => k,
        CuEdit::Rows(k, _) => k,
    };
    let ([cq, ck], [rq, rk]) = (cu, rows);
    let (cu, rows) = if keys { (ck, rk) } else { (cq, rq) };
    let n = cu.len().max(1);
    match *e {
        CuEdit::Swap(_, i, j) if !cu.is_empty() => cu.swap(i % n, j % n),
        CuEdit::Add(_, i, x) if !cu.is_empty() => cu[i % n] = cu[i % n].saturating_add(x),
        CuEdit::Set(_, i, x) if !cu.is_empty() => cu[i % n] = x,
        CuEdit::Push(_, x) => cu.push(x),
        CuEdit::Pop(_) => {
            cu.pop();
        }
        CuEdit::Rows(_, x) => *rows = (*rows as i64 + x as i64).max(0) as usize,
        _ => {}
    }
}

/// An edit of a KV cache's layout. Indices are taken modulo the array's length.
#[derive(Clone, Debug)]
enum CacheEdit {
    SeqlenAdd(usize, i32),
    SeqlenSet(usize, i32),
    SeqlensPush(i32),
    SeqlensPop,
    /// Entry `i` of the table (used or not) becomes entry `j`'s block (a shared block).
    TableShare(usize, usize),
    /// Sequence `i` becomes a twin of sequence `j`: its length and (paged) its table row copied,
    /// so that an append writes both into the same slots.
    Twin(usize, usize),
    /// Entry `i` of the table becomes `num_blocks + x` (out of range).
    TablePast(usize, u16),
    /// Entry `i` of the table becomes `x` (negative, or any id).
    TableSet(usize, i32),
    TablePush(i32),
    TablePop,
    /// The table read with `max_blocks_per_seq` changed by this much, its entries kept in
    /// row-major order (cut, or padded with -1 when the width grows).
    Width(i8),
    /// `max_blocks_per_seq` set to a huge value (the table kept).
    WidthSet(usize),
    /// The cache's first dimension (dense: batch; paged: blocks) changed by this much.
    Outer(i8),
    /// A dense cache's capacity changed by this much.
    Capacity(i8),
    /// A paged cache with page size 0.
    PageZero,
}

fn cache_edit() -> impl Strategy<Value = CacheEdit> {
    prop_oneof![
        2 => (any::<usize>(), -3i32..=3).prop_map(|(b, x)| CacheEdit::SeqlenAdd(b, x)),
        2 => (any::<usize>(), extreme_i32()).prop_map(|(b, x)| CacheEdit::SeqlenSet(b, x)),
        2 => (0i32..50).prop_map(CacheEdit::SeqlensPush),
        2 => Just(CacheEdit::SeqlensPop),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(i, j)| CacheEdit::TableShare(i, j)),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(i, j)| CacheEdit::Twin(i, j)),
        2 => (any::<usize>(), 0u16..3).prop_map(|(i, x)| CacheEdit::TablePast(i, x)),
        2 => (any::<usize>(), extreme_i32()).prop_map(|(i, x)| CacheEdit::TableSet(i, x)),
        2 => (-1i32..4).prop_map(CacheEdit::TablePush),
        2 => Just(CacheEdit::TablePop),
        2 => (-2i8..=2).prop_map(CacheEdit::Width),
        1 => prop::sample::select(vec![1usize << 40, usize::MAX / 2 + 1, usize::MAX]).prop_map(CacheEdit::WidthSet),
        2 => (-2i8..=2).prop_map(CacheEdit::Outer),
        2 => (-3i8..=3).prop_map(CacheEdit::Capacity),
        1 => Just(CacheEdit::PageZero),
    ]
}

fn apply_cache(e: &CacheEdit, c: &mut CacheLayout) {
    let at = |i: usize, n: usize| i % n.max(1);
    let grow = |x: usize, by: i8| (x as i128 + by as i128).clamp(0, usize::MAX as i128) as usize;
    let n0 = c.shape[0];
    match (e, &mut c.table) {
        (CacheEdit::SeqlenAdd(b, x), _) if !c.seqlens.is_empty() => {
            let b = at(*b, c.seqlens.len());
            c.seqlens[b] = c.seqlens[b].saturating_add(*x);
        }
        (CacheEdit::SeqlenSet(b, x), _) if !c.seqlens.is_empty() => {
            let b = at(*b, c.seqlens.len());
            c.seqlens[b] = *x;
        }
        (CacheEdit::SeqlensPush(x), _) => c.seqlens.push(*x),
        (CacheEdit::SeqlensPop, _) => {
            c.seqlens.pop();
        }
        (CacheEdit::TableShare(i, j), Some((ids, _))) if !ids.is_empty() => {
            let n = ids.len();
            ids[at(*i, n)] = ids[at(*j, n)];
        }
        (CacheEdit::Twin(i, j), table) if !c.seqlens.is_empty() => {
            let n = c.seqlens.len();
            let (i, j) = (at(*i, n), at(*j, n));
            c.seqlens[i] = c.seqlens[j];
            if let Some((ids, mb)) = table {
                if (i.max(j) + 1).checked_mul(*mb).is_some_and(|n| n <= ids.len()) {
                    let row = ids[j * *mb..(j + 1) * *mb].to_vec();
                    ids[i * *mb..(i + 1) * *mb].copy_from_slice(&row);
                }
            }
        }
        (CacheEdit::TablePast(i, x), Some((ids, _))) if !ids.is_empty() => {
            let n = ids.len();
            ids[at(*i, n)] = (n0 + *x as usize) as i32;
        }
        (CacheEdit::TableSet(i, x), Some((ids, _))) if !ids.is_empty() => {
            let n = ids.len();
            ids[at(*i, n)] = *x;
        }
        (CacheEdit::TablePush(x), Some((ids, _))) => ids.push(*x),
        (CacheEdit::TablePop, Some((ids, _))) => {
            ids.pop();
        }
        (CacheEdit::Width(x), Some((ids, mb))) => {
            let batch = ids.len() / (*mb).max(1);
            *mb = grow(*mb, *x);
            ids.resize(batch * *mb, -1);
        }
        (CacheEdit::WidthSet(x), Some((_, mb))) => *mb = *x,
        (CacheEdit::Outer(x), _) => c.shape[0] = grow(n0, *x),
        (CacheEdit::Capacity(x), None) => c.shape[1] = grow(c.shape[1], *x),
        (CacheEdit::PageZero, Some(_)) => c.shape[1] = 0,
        _ => {}
    }
}

/// Edits: none for about half the cases (a valid layout), else one to three.
fn edits<E: std::fmt::Debug + Clone>(e: impl Strategy<Value = E>) -> impl Strategy<Value = Vec<E>> {
    prop_oneof![1 => Just(Vec::new()), 1 => prop::collection::vec(e, 1..=3)]
}

/// `num_splits`: the heuristic, any count in 1..=64, or (rarely) 0 or past the limit of 128.
fn splits_strategy() -> impl Strategy<Value = Option<usize>> {
    prop_oneof![
        3 => Just(None),
        6 => (1usize..=64).prop_map(Some),
        1 => prop::sample::select(vec![0usize, 129, 1000]).prop_map(Some),
    ]
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![DType::F32, DType::F16, DType::BF16])
}

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

// ---------------------------------------------------------------- packed (varlen) batches

#[derive(Clone, Debug)]
struct VarlenCase {
    opts: Opts,
    dtype: DType,
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
    /// `max_seqlen_q/k` = the longest sequence + this (below the longest when negative).
    slack: (i8, i8),
    /// k and v stored head-major (strided views).
    heads_major: bool,
    edits: Vec<CuEdit>,
}

fn varlen_strategy() -> impl Strategy<Value = VarlenCase> {
    (
        (opts_strategy(splits_strategy()), dtype_strategy(), 1usize..=4),
        ((slack(), slack()), any::<bool>(), edits(cu_edit(true))),
    )
        .prop_flat_map(|((opts, dtype, batch), (slack, heads_major, edits))| {
            (
                prop::collection::vec(len_strategy(24), batch),
                prop::collection::vec(len_strategy(80), batch),
            )
                .prop_map(move |(lens_q, lens_k)| VarlenCase {
                    opts: opts.clone(),
                    dtype,
                    lens_q,
                    lens_k,
                    slack,
                    heads_major,
                    edits: edits.clone(),
                })
        })
}

/// `max_seqlen` slack: mostly an upper bound (0 to 2 past the longest, or `usize::MAX` for
/// `i8::MAX`), sometimes one short.
fn slack() -> impl Strategy<Value = i8> {
    prop_oneof![9 => 0i8..=2, 1 => Just(i8::MAX), 1 => Just(-1i8)]
}

fn offsets(lens: &[usize]) -> Vec<i32> {
    std::iter::once(0)
        .chain(lens.iter().scan(0i32, |a, &l| {
            *a += l as i32;
            Some(*a)
        }))
        .collect()
}

fn bound(lens: &[usize], slack: i8) -> usize {
    if slack == i8::MAX {
        return usize::MAX;
    }
    (lens.iter().copied().max().unwrap_or(0) as i64 + slack as i64).max(0) as usize
}

/// `x` `[rows][heads][d]` stored head-major, `[heads][rows][d]`.
fn heads_major_copy(x: &[f32], rows: usize, heads: usize, d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for h in 0..heads {
        for r in 0..rows {
            out.extend_from_slice(&x[(r * heads + h) * d..][..d]);
        }
    }
    out
}

/// A `[b, h, s, d]` tensor read as `[b, s, h, d]` (strided).
fn heads_major_view(t: &Tensor) -> TensorView<'_> {
    match t.data() {
        OwnedData::F32(x) => TensorView::heads_major(x, t.shape()),
        OwnedData::F16(x) => TensorView::heads_major(x, t.shape()),
        OwnedData::BF16(x) => TensorView::heads_major(x, t.shape()),
    }
}

fn varlen_case(c: &VarlenCase, worst: &Worst) -> Result<(), TestCaseError> {
    let (o, dtype) = (&c.opts, c.dtype);
    let (hq, hkv, d) = (o.hq(), o.heads_kv, o.d);
    let (mut cu_q, mut cu_k) = (offsets(&c.lens_q), offsets(&c.lens_k));
    let (mut tq, mut tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
    for e in &c.edits {
        apply_cu(e, [&mut cu_q, &mut cu_k], [&mut tq, &mut tk]);
    }
    let (max_q, max_k) = (bound(&c.lens_q, c.slack.0), bound(&c.lens_k, c.slack.1));
    let mut broken = Broken::new();
    let rq = read_cu("cu_seqlens_q", "max_seqlen_q", &cu_q, tq, max_q, &mut broken);
    let rk = read_cu("cu_seqlens_k", "max_seqlen_k", &cu_k, tk, max_k, &mut broken);
    if let (Some(a), Some(b)) = (&rq, &rk) {
        if a.len() != b.len() {
            broken.push("cu_seqlens_k");
        }
    }
    if matches!(o.splits, Some(n) if !(1..=128).contains(&n)) {
        broken.push("num_splits");
    }
    let mut rng = Rng::new(o.seed | 1);
    let (qv, kv, vv) = (
        values(&mut rng, tq * hq * d, dtype),
        values(&mut rng, tk * hkv * d, dtype),
        values(&mut rng, tk * hkv * d, dtype),
    );
    let q = Tensor::from_f32(&qv, dtype, [1, tq, hq, d]).unwrap();
    // k and v contiguous, or stored head-major and read through strided views.
    let kv_tensor = |x: &[f32]| match c.heads_major {
        false => Tensor::from_f32(x, dtype, [1, tk, hkv, d]).unwrap(),
        true => Tensor::from_f32(&heads_major_copy(x, tk, hkv, d), dtype, [1, hkv, tk, d]).unwrap(),
    };
    let (k_store, v_store) = (kv_tensor(&kv), kv_tensor(&vv));
    let (k, v) = match c.heads_major {
        false => (k_store.view(), v_store.view()),
        true => (heads_major_view(&k_store), heads_major_view(&v_store)),
    };
    let seqs = Varlen {
        cu_seqlens_q: &cu_q,
        cu_seqlens_k: &cu_k,
        max_seqlen_q: max_q,
        max_seqlen_k: max_k,
    };
    let opts = o.forward();
    let out = match forward_varlen(&q, &k, &v, &seqs, &opts) {
        Err(e) => {
            worst.refused.set(worst.refused.get() + 1);
            return expect_refusal(&e, &broken);
        }
        Ok(out) => out,
    };
    worst.accepted.set(worst.accepted.get() + 1);
    prop_assert!(broken.is_empty(), "accepted a layout that breaks {:?}", broken);
    let (rq, rk) = (rq.unwrap(), rk.unwrap());
    prop_assert_eq!(out.o.shape(), [1, tq, hq, d]);
    prop_assert_eq!(out.lse.as_ref().map(|l| l.len()), o.lse.then_some(hq * tq));
    let seq_inputs: Vec<SeqInputs> = rq
        .iter()
        .zip(&rk)
        .map(|(&(q0, q1), &(k0, k1))| SeqInputs {
            q: qv[q0 * hq * d..q1 * hq * d].to_vec(),
            k: kv[k0 * hkv * d..k1 * hkv * d].to_vec(),
            v: vv[k0 * hkv * d..k1 * hkv * d].to_vec(),
        })
        .collect();
    let q_rows = |b: usize| (rq[b].0, rq[b].1 - rq[b].0);
    let lse_at = |b: usize, h: usize, i: usize| h * tq + rq[b].0 + i;
    check_sequences(dtype, o, &opts, &out, &seq_inputs, &q_rows, &lse_at, worst)?;
    let one = forward_varlen(&q, &k, &v, &seqs, &opts.clone().num_splits(1))
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    worst.split(split_ulps(dtype, &one, &out, max_abs(&vv))?);
    Ok(())
}

#[test]
fn varlen_layouts() {
    run("varlen layouts", 400, varlen_strategy(), varlen_case);
}

// ---------------------------------------------------------------- KV caches (read, and append)

#[derive(Clone, Debug)]
struct CacheCase {
    opts: Opts,
    dtype: DType,
    /// Cached keys per sequence.
    lens: Vec<usize>,
    /// Rows appended by the call (the append property only).
    new: usize,
    /// Query rows per sequence (dense q), or the packed q's lengths.
    sq: usize,
    varlen_q: Option<Vec<usize>>,
    /// Paged with this page size, or dense.
    page: Option<usize>,
    /// Sequences after the first share its first full pages.
    share: bool,
    /// The cache stored head-major (read-only calls: a writable cache is contiguous).
    heads_major: bool,
    /// Blocks no sequence uses; table columns / dense capacity past the longest sequence.
    spare: (usize, usize),
    cu_edits: Vec<CuEdit>,
    edits: Vec<CacheEdit>,
}

/// Query rows per sequence: mostly decode-like (1-4), sometimes past the 16 rows from which a
/// sequence with contiguous keys takes the tiled path.
fn q_len_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 1usize..=4, 1 => 17usize..=20]
}

fn page_strategy() -> impl Strategy<Value = Option<usize>> {
    prop_oneof![
        1 => Just(None),
        1 => prop::sample::select(vec![1usize, 2, 3, 16, 256, 300]).prop_map(Some),
        2 => (1usize..=300).prop_map(Some),
    ]
}

fn cache_strategy(append: bool) -> impl Strategy<Value = CacheCase> {
    let new = if append {
        (0usize..=4).boxed()
    } else {
        Just(0usize).boxed()
    };
    (
        (
            opts_strategy(splits_strategy()),
            dtype_strategy(),
            1usize..=4,
            page_strategy(),
        ),
        (
            new,
            q_len_strategy(),
            any::<bool>(),
            (0usize..=3, 0usize..=2),
            any::<bool>(),
        ),
        (edits(cu_edit(false)), edits(cache_edit()), any::<bool>()),
    )
        .prop_flat_map(
            move |((opts, dtype, batch, page), (new, sq, share, spare, packed), (cu_edits, edits, hm))| {
                // Mostly short caches; now and then long enough for the split heuristic (> 1024 keys).
                let lens = prop::collection::vec(prop_oneof![24 => len_strategy(320), 1 => 1025usize..=1400], batch);
                let varlen_q = if packed && !append {
                    prop::collection::vec(len_strategy(20), batch).prop_map(Some).boxed()
                } else {
                    Just(None).boxed()
                };
                (lens, varlen_q).prop_map(move |(lens, varlen_q)| CacheCase {
                    opts: opts.clone(),
                    dtype,
                    lens,
                    new,
                    sq,
                    cu_edits: if varlen_q.is_some() {
                        cu_edits.clone()
                    } else {
                        Vec::new()
                    },
                    varlen_q,
                    page,
                    share,
                    heads_major: hm && !append,
                    spare,
                    edits: edits.clone(),
                })
            },
        )
}

/// The case's well-formed layout (blocks shuffled; shared prefixes), before its edits.
fn base_layout(c: &CacheCase, rng: &mut Rng) -> CacheLayout {
    let (hkv, d, batch) = (c.opts.heads_kv, c.opts.d, c.lens.len());
    let seqlens: Vec<i32> = c.lens.iter().map(|&l| l as i32).collect();
    let Some(ps) = c.page else {
        let cap = c.lens.iter().map(|l| l + c.new).max().unwrap_or(0) + c.spare.1;
        return CacheLayout {
            shape: [batch, cap, hkv, d],
            seqlens,
            table: None,
            heads_major: c.heads_major,
        };
    };
    let t = paged_table(&c.lens, c.new, ps, c.share, c.spare, rng);
    CacheLayout {
        shape: [t.num_blocks.max(1), ps, hkv, d],
        seqlens,
        table: Some((t.ids, t.width)),
        heads_major: c.heads_major,
    }
}

/// A cache buffer of `layout`'s shape: random values at every slot in `read`, NaN elsewhere (so
/// that a stray read shows).
fn fill_cache<T: Element>(layout: &CacheLayout, read: Option<&[Vec<usize>]>, rng: &mut Rng, dtype: DType) -> Vec<T> {
    let [n0, n1, hkv, d] = layout.shape;
    let mut vals = values(rng, n0 * n1 * hkv * d, dtype);
    if let Some(read) = read {
        let mut used = vec![false; n0 * n1];
        read.iter().flatten().for_each(|&s| used[s] = true);
        for s in (0..n0 * n1).filter(|&s| !used[s]) {
            for h in 0..hkv {
                let at = layout.at(s, h);
                vals[at..at + d].fill(f32::NAN);
            }
        }
    }
    vals.into_iter().map(T::from_f32).collect()
}

/// Sequence rows of q and the LSE index of each sequence's rows, for a dense or packed q.
struct QRows {
    /// (first flat row, rows) per sequence.
    rows: Vec<(usize, usize)>,
    total: usize,
    packed: bool,
}

fn cache_case<T: Bits>(c: &CacheCase, worst: &Worst) -> Result<(), TestCaseError> {
    let (o, dtype) = (&c.opts, c.dtype);
    let (hq, hkv, d) = (o.hq(), o.heads_kv, o.d);
    let row = hkv * d;
    let batch = c.lens.len();
    let mut rng = Rng::new(o.seed | 1);
    let mut layout = base_layout(c, &mut rng);
    for e in &c.edits {
        apply_cache(e, &mut layout);
    }
    let mut broken = Broken::new();
    // Queries: dense [batch, sq, hq, d], or packed with (possibly edited) offsets.
    let (q_shape, cu_q, max_q, q_batch) = match &c.varlen_q {
        None => ([batch, c.sq, hq, d], Vec::new(), 0, Some(batch)),
        Some(lens) => {
            let mut cu = offsets(lens);
            let (mut tq, mut unused) = (*cu.last().unwrap() as usize, 0usize);
            for e in &c.cu_edits {
                apply_cu(e, [&mut cu, &mut Vec::new()], [&mut tq, &mut unused]);
            }
            let max = bound(lens, 0);
            let r = read_cu("cu_seqlens_q", "max_seqlen_q", &cu, tq, max, &mut broken);
            ([1, tq, hq, d], cu, max, r.map(|r| r.len()))
        }
    };
    if layout.shape[0] == 0 {
        // A cache with no block (or of no sequence) is an empty tensor, refused as such first.
        broken.push("k");
    }
    let read = q_batch.and_then(|qb| layout.read(qb, c.new, &mut broken));
    if c.new > 0 {
        // Every appended row needs a slot of its own.
        if let Some(read) = &read {
            let mut writes: Vec<usize> = (0..batch)
                .flat_map(|b| read[b][layout.seqlens[b] as usize..].to_vec())
                .collect();
            writes.sort_unstable();
            if writes.windows(2).any(|w| w[0] == w[1]) {
                broken.push("block_table");
            }
        }
    }
    if matches!(o.splits, Some(n) if !(1..=128).contains(&n)) {
        broken.push("num_splits");
    }
    let q_rows = match &c.varlen_q {
        None => QRows {
            rows: (0..batch).map(|b| (b * c.sq, c.sq)).collect(),
            total: batch * c.sq,
            packed: false,
        },
        Some(_) => QRows {
            rows: cu_q
                .windows(2)
                .map(|w| (w[0].max(0) as usize, (w[1] as i64 - w[0] as i64).max(0) as usize))
                .collect(),
            total: q_shape[1],
            packed: true,
        },
    };
    let valid = broken.is_empty();
    let k: Vec<T> = fill_cache(&layout, read.as_deref().filter(|_| valid), &mut rng, dtype);
    let v: Vec<T> = fill_cache(&layout, read.as_deref().filter(|_| valid), &mut rng, dtype);
    let qv = values(&mut rng, q_shape.iter().product(), dtype);
    let q = Tensor::from_f32(&qv, dtype, q_shape).unwrap();
    let opts = o.forward();
    let (k_new, v_new) = (
        values(&mut rng, batch * c.new * row, dtype),
        values(&mut rng, batch * c.new * row, dtype),
    );

    // The call, and the cache as the test expects it afterwards (the explicit append).
    let (result, k_after, v_after, attended) = if c.new > 0 {
        let kn = Tensor::from_f32(&k_new, dtype, [batch, c.new, hkv, d]).unwrap();
        let vn = Tensor::from_f32(&v_new, dtype, [batch, c.new, hkv, d]).unwrap();
        let (mut kc, mut vc) = (k.clone(), v.clone());
        let mut cache = KvCacheMut {
            k: &mut kc,
            v: &mut vc,
            shape: layout.shape,
            seqlens: &layout.seqlens,
            block_table: layout.table.as_ref().map(|(ids, mb)| BlockTable {
                ids,
                max_blocks_per_seq: *mb,
            }),
            batch_idx: None,
            leftpad: None,
        };
        let r = forward_kvcache_append(&q, &mut cache, &kn, &vn, &opts);
        // The explicit append: row i of sequence b at the slot of key seqlens[b] + i, when the
        // layout takes it (the attention's options aside: `append_kv` has none).
        let append_broken: Broken = broken.iter().copied().filter(|&n| n != "num_splits").collect();
        let (mut kx, mut vx) = (k.clone(), v.clone());
        if let (true, Some(read)) = (append_broken.is_empty(), &read) {
            for (b, keys) in read.iter().enumerate() {
                for (i, &slot) in keys[keys.len() - c.new..].iter().enumerate() {
                    for h in 0..hkv {
                        let (src, at) = (((b * c.new + i) * hkv + h) * d, layout.at(slot, h));
                        for x in 0..d {
                            kx[at + x] = T::from_f32(k_new[src + x]);
                            vx[at + x] = T::from_f32(v_new[src + x]);
                        }
                    }
                }
            }
        }
        match &r {
            Ok(_) => prop_assert!(broken.is_empty(), "accepted a layout that breaks {:?}", broken),
            Err(e) => expect_refusal(e, &broken)?,
        }
        // Both caches as the test's own append left them, or untouched after a refusal.
        let caches_are = |(kg, vg): (&[T], &[T]), ok: bool, after: &str, err: Option<&Error>| {
            let (wk, wv) = if ok { (&kx, &vx) } else { (&k, &v) };
            prop_assert_eq!(first_diff(kg, wk), None, "k cache after {} ({:?})", after, err);
            prop_assert_eq!(first_diff(vg, wv), None, "v cache after {} ({:?})", after, err);
            Ok(())
        };
        caches_are((&kc, &vc), r.is_ok(), "the call", r.as_ref().err())?;
        // `append_kv` alone: the same writes, or the same refusal with the cache untouched.
        let (mut ka, mut va) = (k.clone(), v.clone());
        let mut cache = KvCacheMut {
            k: &mut ka,
            v: &mut va,
            shape: layout.shape,
            seqlens: &layout.seqlens,
            block_table: layout.table.as_ref().map(|(ids, mb)| BlockTable {
                ids,
                max_blocks_per_seq: *mb,
            }),
            batch_idx: None,
            leftpad: None,
        };
        let ra = append_kv(&mut cache, &kn, &vn);
        match &ra {
            Ok(()) => prop_assert!(
                append_broken.is_empty(),
                "append_kv took a layout that breaks {:?}",
                append_broken
            ),
            Err(e) => expect_refusal(e, &append_broken)?,
        }
        caches_are((&ka, &va), ra.is_ok(), "append_kv", ra.as_ref().err())?;
        let attended = layout.clone_with_new(c.new);
        (r, kx, vx, attended)
    } else {
        let cache = layout.view(&k, &v);
        let r = match &c.varlen_q {
            None => forward_kvcache(&q, &cache, &opts),
            Some(_) => forward_varlen_kvcache(&q, &cu_q, max_q, &cache, &opts),
        };
        (r, k.clone(), v.clone(), layout.clone())
    };
    let out = match result {
        Err(e) => {
            worst.refused.set(worst.refused.get() + 1);
            return expect_refusal(&e, &broken);
        }
        Ok(out) => out,
    };
    worst.accepted.set(worst.accepted.get() + 1);
    prop_assert!(broken.is_empty(), "accepted a layout that breaks {:?}", broken);
    let read = read.unwrap();
    prop_assert_eq!(out.o.shape(), q_shape);
    let lse_len = hq * q_rows.total;
    prop_assert_eq!(out.lse.as_ref().map(|l| l.len()), o.lse.then_some(lse_len));
    let attend = |opts: &ForwardOptions| {
        let cache = attended.view(&k_after, &v_after);
        match &c.varlen_q {
            None => forward_kvcache(&q, &cache, opts),
            Some(_) => forward_varlen_kvcache(&q, &cu_q, max_q, &cache, opts),
        }
        .map_err(|e| TestCaseError::fail(e.to_string()))
    };
    if c.new > 0 {
        // forward_kvcache_append = append, then forward_kvcache: the same bits.
        let then = attend(&opts)?;
        prop_assert_eq!(&then.o, &out.o, "append-then-forward output");
        let bits = |l: &Option<Vec<f32>>| l.as_ref().map(|l| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        prop_assert_eq!(bits(&then.lse), bits(&out.lse), "append-then-forward LSE");
    }
    let seq_inputs: Vec<SeqInputs> = (0..batch)
        .map(|b| {
            let (r0, n) = q_rows.rows[b];
            SeqInputs {
                q: qv[r0 * hq * d..(r0 + n) * hq * d].to_vec(),
                k: gather(&k_after, &attended, &read[b]),
                v: gather(&v_after, &attended, &read[b]),
            }
        })
        .collect();
    let vmax = seq_inputs.iter().map(|s| max_abs(&s.v)).fold(0.0, f32::max);
    let rows_of = |b: usize| q_rows.rows[b];
    let lse_at = |b: usize, h: usize, i: usize| {
        if q_rows.packed {
            h * q_rows.total + q_rows.rows[b].0 + i
        } else {
            (b * hq + h) * c.sq + i
        }
    };
    check_sequences(dtype, o, &opts, &out, &seq_inputs, &rows_of, &lse_at, worst)?;
    let one = attend(&opts.clone().num_splits(1))?;
    worst.split(split_ulps(dtype, &one, &out, vmax)?);
    Ok(())
}

impl CacheLayout {
    /// The layout a later call sees after this call appended `new` rows to each sequence.
    fn clone_with_new(&self, new: usize) -> CacheLayout {
        CacheLayout {
            seqlens: self.seqlens.iter().map(|&s| s.saturating_add(new as i32)).collect(),
            ..self.clone()
        }
    }
}

fn cache_case_any(c: &CacheCase, worst: &Worst) -> Result<(), TestCaseError> {
    match c.dtype {
        DType::F32 => cache_case::<f32>(c, worst),
        DType::F16 => cache_case::<half::f16>(c, worst),
        _ => cache_case::<half::bf16>(c, worst),
    }
}

#[test]
fn cache_layouts() {
    run("cache layouts", 400, cache_strategy(false), cache_case_any);
}

#[test]
fn append_layouts() {
    run("append layouts", 400, cache_strategy(true), cache_case_any);
}

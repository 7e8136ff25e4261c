//! The batch layout of a serving call: where each sequence's query rows and keys lie.
//!
//! One description for every backend. The CPU backend reads it directly; the GPU kernels will
//! get the same fields in their parameter struct (FlashAttention's `cu_seqlens_q`,
//! `cu_seqlens_k`, `seqused_k`, `block_table`, `page_block_size`: docs/serving.md), so the
//! validation below is the contract both follow.
//!
//! Index arrays are `i32`, as FlashAttention's (torch `int32` tensors), so a device form can
//! hand the same buffers to a kernel. Everything is checked here before anything runs, with
//! checked arithmetic; afterwards every index is known to be in range.

use crate::error::{Error, Result};
use crate::tensor::Shape;

/// Where the query rows of each sequence are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueryLayout<'a> {
    /// q is `[batch, seqlen_q, heads_q, head_dim]`: every sequence has `seqlen_q` rows.
    Dense,
    /// q is packed, `[1, total_q, heads_q, head_dim]`: sequence `b` is rows
    /// `cu_seqlens[b]..cu_seqlens[b + 1]`; `max_seqlen` bounds every sequence's length.
    Varlen { cu_seqlens: &'a [i32], max_seqlen: usize },
}

/// Where the keys (and values, laid out the same) of each sequence are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvLayout<'a> {
    /// k, v are `[batch, seqlen_k, heads_kv, head_dim]`: every sequence sees all `seqlen_k` keys.
    Dense,
    /// k, v are packed, `[1, total_k, heads_kv, head_dim]`: sequence `b` is rows
    /// `cu_seqlens[b]..cu_seqlens[b + 1]`.
    Varlen { cu_seqlens: &'a [i32], max_seqlen: usize },
    /// k, v are caches `[batch, capacity, heads_kv, head_dim]`: sequence `b` uses its first
    /// `seqlens[b] + new` rows (`new`: the rows appended by this call), or the rows from
    /// [`CacheRows::leftpad`] of the cache row [`CacheRows::batch_idx`] names.
    Cache { seqlens: &'a [i32], new: usize },
    /// k, v are paged caches `[num_blocks, page_size, heads_kv, head_dim]`: key `j` of sequence
    /// `b` is slot `j % page_size` of block `block_table[b * max_blocks_per_seq + j / page_size]`;
    /// sequence `b` has `seqlens[b] + new` keys. Blocks may come in any order and be shared.
    Paged {
        block_table: &'a [i32],
        max_blocks_per_seq: usize,
        seqlens: &'a [i32],
        new: usize,
    },
}

/// Which row of a dense cache each sequence reads and writes, and the row its keys start at
/// (FlashAttention's `cache_batch_idx` and `cache_leftpad`). Both are per sequence of the
/// batch, and only a dense cache ([`KvLayout::Cache`]) takes them, as in FlashAttention: a
/// paged cache's block table already says where each sequence's keys are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheRows<'a> {
    /// Sequence `b` uses cache row `batch_idx[b]` (`None`: row `b`). The cache's batch
    /// dimension may then differ from the batch: a pool of cache rows, some unused.
    pub batch_idx: Option<&'a [i32]>,
    /// Sequence `b`'s keys are cache positions `leftpad[b]..seqlens[b] + new` (`None`: from 0).
    /// Masks and ALiBi count keys from `leftpad[b]`; `cache_seqlens` counts from row 0.
    pub leftpad: Option<&'a [i32]>,
}

impl CacheRows<'_> {
    fn is_none(&self) -> bool {
        self.batch_idx.is_none() && self.leftpad.is_none()
    }
}

/// A validated batch layout (see [`BatchLayout::new`] for the rules).
#[derive(Clone, Copy, Debug)]
pub struct BatchLayout<'a> {
    batch: usize,
    q: QueryLayout<'a>,
    kv: KvLayout<'a>,
    rows: CacheRows<'a>,
    /// Rows of q's seqlen dimension: seqlen_q (dense) or total_q (varlen).
    q_rows: usize,
    /// k's first two dimensions: (batch, seqlen_k), (1, total_k), (batch, capacity) or
    /// (num_blocks, page_size).
    k_dims: [usize; 2],
    max_seqlen_q: usize,
    max_seqlen_k: usize,
}

fn bad(what: &str, got: String, expected: String) -> Error {
    Error::InvalidSeqLayout {
        what: what.to_string(),
        got,
        expected,
    }
}

/// A packed tensor has batch dimension 1.
fn expect_packed(name: &str, shape: Shape) -> Result<()> {
    if shape[0] != 1 {
        return Err(Error::ShapeMismatch {
            what: name.to_string(),
            got: format!("{shape:?}"),
            expected: format!("[1, total_rows, heads, head_dim] (a packed {name} has batch dimension 1)"),
        });
    }
    Ok(())
}

/// Checks a `cu_seqlens` array against the packed tensor's row count; returns (batch, max len).
fn check_cu(what: &str, tensor: &str, cu: &[i32], total: usize, max_seqlen: usize) -> Result<(usize, usize)> {
    if cu.len() < 2 {
        return Err(bad(
            what,
            format!("{} entries", cu.len()),
            "batch + 1 >= 2 entries (offsets of each sequence's first row, then the total)".into(),
        ));
    }
    if cu[0] != 0 {
        return Err(bad(
            what,
            format!("{what}[0] = {}", cu[0]),
            "0 (the first sequence starts at row 0)".into(),
        ));
    }
    let mut max_len = 0usize;
    for (b, w) in cu.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(bad(
                what,
                format!("{what}[{}] = {} < {what}[{b}] = {}", b + 1, w[1], w[0]),
                "non-decreasing offsets (a sequence cannot have negative length)".into(),
            ));
        }
        // Both are >= 0 here (cu[0] = 0 and non-decreasing), so the difference fits.
        max_len = max_len.max((w[1] - w[0]) as usize);
    }
    let last = cu[cu.len() - 1] as usize;
    if last != total {
        return Err(bad(
            what,
            format!("{what}[{}] = {last}", cu.len() - 1),
            format!("{total}, the number of rows of the packed {tensor} (total = the last offset)"),
        ));
    }
    let max_name = what.replace("cu_seqlens", "max_seqlen");
    if max_len > max_seqlen {
        return Err(bad(
            &max_name,
            max_seqlen.to_string(),
            format!("at least {max_len}, the longest sequence in {what}"),
        ));
    }
    Ok((cu.len() - 1, max_len))
}

/// Checks `cache_seqlens` (one non-negative length per sequence) and returns the lengths with
/// `new` added, each at most `capacity`.
fn check_seqlens(seqlens: &[i32], batch: usize, new: usize, capacity: usize, cap_what: &str) -> Result<usize> {
    if seqlens.len() != batch {
        return Err(bad(
            "cache_seqlens",
            format!("{} entries", seqlens.len()),
            format!("{batch} (one per sequence of the batch)"),
        ));
    }
    let mut max_len = 0usize;
    for (b, &s) in seqlens.iter().enumerate() {
        let Ok(s) = usize::try_from(s) else {
            return Err(bad("cache_seqlens", format!("cache_seqlens[{b}] = {s}"), ">= 0".into()));
        };
        let total = s.checked_add(new).ok_or_else(|| Error::TooLarge {
            what: format!("cache_seqlens[{b}] + {new}"),
        })?;
        if total > capacity {
            let got = if new > 0 {
                format!("cache_seqlens[{b}] = {s} plus {new} new rows = {total} keys")
            } else {
                format!("cache_seqlens[{b}] = {s} keys")
            };
            return Err(bad("cache_seqlens", got, format!("at most {capacity}, {cap_what}")));
        }
        max_len = max_len.max(total);
    }
    Ok(max_len)
}

/// Checks `cache_batch_idx`: one cache row in `0..cache_rows` per sequence.
fn check_batch_idx(idx: &[i32], batch: usize, cache_rows: usize) -> Result<()> {
    if idx.len() != batch {
        return Err(bad(
            "cache_batch_idx",
            format!("{} entries", idx.len()),
            format!("{batch} (one cache row per sequence of the batch)"),
        ));
    }
    if let Some((b, &r)) = idx.iter().enumerate().find(|(_, &r)| usize::try_from(r).map_or(true, |r| r >= cache_rows)) {
        return Err(bad(
            "cache_batch_idx",
            format!("cache_batch_idx[{b}] = {r}"),
            format!("a row of the cache in 0..{cache_rows} (its batch dimension)"),
        ));
    }
    Ok(())
}

/// Two sequences of an append on one cache row (`cache_batch_idx`) would write each other's keys.
pub(crate) fn check_distinct_cache_rows(idx: &[i32]) -> Result<()> {
    let mut seen: Vec<(i32, usize)> = idx.iter().copied().zip(0..).collect();
    seen.sort_unstable();
    match seen.windows(2).find(|w| w[0].0 == w[1].0) {
        Some(w) => Err(Error::InvalidSeqLayout {
            what: "cache_batch_idx".into(),
            got: format!("sequences {} and {} both append to cache row {}", w[0].1, w[1].1, w[0].0),
            expected: "a distinct cache row for every sequence of an append".into(),
        }),
        None => Ok(()),
    }
}

/// Checks `cache_leftpad` (`0 <= leftpad[b] <= cache_seqlens[b]`, seqlens already checked);
/// returns the most keys a sequence sees, `seqlens[b] + new - leftpad[b]`.
fn check_leftpad(pad: &[i32], seqlens: &[i32], new: usize) -> Result<usize> {
    if pad.len() != seqlens.len() {
        return Err(bad(
            "cache_leftpad",
            format!("{} entries", pad.len()),
            format!("{} (one per sequence of the batch)", seqlens.len()),
        ));
    }
    let mut max_len = 0usize;
    for (b, (&p, &s)) in pad.iter().zip(seqlens).enumerate() {
        if p < 0 || p > s {
            return Err(bad(
                "cache_leftpad",
                format!("cache_leftpad[{b}] = {p} with cache_seqlens[{b}] = {s}"),
                "0 <= cache_leftpad[b] <= cache_seqlens[b] (the keys start at row leftpad, before the cached end)".into(),
            ));
        }
        max_len = max_len.max((s - p) as usize + new);
    }
    Ok(max_len)
}

impl<'a> BatchLayout<'a> {
    /// Validates a layout against the shapes of q and k (v must have k's shape; the caller
    /// checks that).
    ///
    /// Rules (each violation is an [`Error::InvalidSeqLayout`] or [`Error::ShapeMismatch`] that
    /// says what was given and what was expected):
    /// - A packed tensor has batch dimension 1; `cu_seqlens` has `batch + 1 >= 2` entries,
    ///   starts at 0, never decreases, ends at the packed tensor's row count; `max_seqlen` is at
    ///   least the longest sequence. Sequences of length 0 are allowed.
    /// - `cu_seqlens_k` (and `cache_seqlens`, a dense cache, a block table) describe the same
    ///   batch as q.
    /// - `cache_seqlens[b] >= 0` and `cache_seqlens[b] + new` fits the cache: `capacity` rows of
    ///   a dense cache, `max_blocks_per_seq * page_size` slots of a paged one.
    /// - Paged: `page_size >= 1` (any size), `block_table` has `batch * max_blocks_per_seq`
    ///   entries, and every entry a sequence uses (the first `ceil(len / page_size)` of its row)
    ///   is a block id in `0..num_blocks`; unused entries are not read (engines pad with -1).
    pub fn new(q: QueryLayout<'a>, q_shape: Shape, kv: KvLayout<'a>, k_shape: Shape) -> Result<Self> {
        Self::with_cache_rows(q, q_shape, kv, k_shape, CacheRows::default())
    }

    /// [`BatchLayout::new`] with each sequence's cache row and first key ([`CacheRows`]).
    /// Further rules:
    /// - Only a dense cache takes them (FlashAttention refuses them with a paged cache).
    /// - `batch_idx` has `batch` entries, each a row of the cache (`0..k_shape[0]`); rows may
    ///   repeat when nothing is appended (the append refuses two sequences on one row).
    /// - `leftpad` has `batch` entries with `0 <= leftpad[b] <= cache_seqlens[b]`.
    pub fn with_cache_rows(
        q: QueryLayout<'a>,
        q_shape: Shape,
        kv: KvLayout<'a>,
        k_shape: Shape,
        rows: CacheRows<'a>,
    ) -> Result<Self> {
        let (batch, q_rows, max_seqlen_q) = match q {
            QueryLayout::Dense => (q_shape[0], q_shape[1], q_shape[1]),
            QueryLayout::Varlen { cu_seqlens, max_seqlen } => {
                expect_packed("q", q_shape)?;
                let (b, m) = check_cu("cu_seqlens_q", "q", cu_seqlens, q_shape[1], max_seqlen)?;
                (b, q_shape[1], m)
            }
        };
        let k_dims = [k_shape[0], k_shape[1]];
        let same_batch = |what: &str| -> Result<()> {
            if k_shape[0] != batch {
                return Err(Error::ShapeMismatch {
                    what: what.to_string(),
                    got: format!("{k_shape:?}"),
                    expected: format!("[{batch}, ..] (one row of the cache per sequence of q's batch)"),
                });
            }
            Ok(())
        };
        if !rows.is_none() && !matches!(kv, KvLayout::Cache { .. }) {
            let what = if rows.batch_idx.is_some() { "cache_batch_idx" } else { "cache_leftpad" };
            let got = match kv {
                KvLayout::Paged { .. } => "a paged cache (block_table)",
                _ => "packed or dense k/v",
            };
            return Err(bad(
                what,
                got.into(),
                "a dense cache [batch, capacity, heads_kv, head_dim] (FlashAttention takes cache_batch_idx and \
                 cache_leftpad only there; a block table already places each sequence's keys)"
                    .into(),
            ));
        }
        let max_seqlen_k = match kv {
            KvLayout::Dense => {
                same_batch("k")?;
                k_shape[1]
            }
            KvLayout::Varlen { cu_seqlens, max_seqlen } => {
                expect_packed("k", k_shape)?;
                let (b, m) = check_cu("cu_seqlens_k", "k", cu_seqlens, k_shape[1], max_seqlen)?;
                if b != batch {
                    return Err(bad(
                        "cu_seqlens_k",
                        format!("{} entries", cu_seqlens.len()),
                        format!("{} (batch + 1, the batch of q)", batch + 1),
                    ));
                }
                m
            }
            KvLayout::Cache { seqlens, new } => {
                match rows.batch_idx {
                    None => same_batch("k_cache")?,
                    Some(idx) => check_batch_idx(idx, batch, k_shape[0])?,
                }
                let max_len = check_seqlens(
                    seqlens,
                    batch,
                    new,
                    k_shape[1],
                    "the cache's capacity (its seqlen dimension)",
                )?;
                match rows.leftpad {
                    None => max_len,
                    Some(pad) => check_leftpad(pad, seqlens, new)?,
                }
            }
            KvLayout::Paged {
                block_table,
                max_blocks_per_seq,
                seqlens,
                new,
            } => {
                let [num_blocks, page_size] = k_dims;
                if page_size == 0 {
                    return Err(bad(
                        "page size",
                        format!("0 (k_cache shape {k_shape:?})"),
                        "at least 1 slot per block: [num_blocks, page_size, heads_kv, head_dim]".into(),
                    ));
                }
                let entries = batch.checked_mul(max_blocks_per_seq).ok_or_else(|| Error::TooLarge {
                    what: format!("block table of {batch} x {max_blocks_per_seq}"),
                })?;
                if block_table.len() != entries {
                    return Err(bad(
                        "block_table",
                        format!("{} entries", block_table.len()),
                        format!("{entries} = batch {batch} x max_blocks_per_seq {max_blocks_per_seq} (row-major)"),
                    ));
                }
                let capacity = max_blocks_per_seq.saturating_mul(page_size);
                let cap_what = format!(
                    "the block table's capacity (max_blocks_per_seq {max_blocks_per_seq} x page size {page_size})"
                );
                let max_len = check_seqlens(seqlens, batch, new, capacity, &cap_what)?;
                for (b, &s) in seqlens.iter().enumerate() {
                    let pages = (s as usize + new).div_ceil(page_size);
                    let row = &block_table[b * max_blocks_per_seq..][..pages];
                    for (p, &id) in row.iter().enumerate() {
                        if usize::try_from(id).map_or(true, |id| id >= num_blocks) {
                            return Err(bad(
                                "block_table",
                                format!("block_table[{b}][{p}] = {id} (used by sequence {b})"),
                                format!("a block id in 0..{num_blocks} (the cache's first dimension)"),
                            ));
                        }
                    }
                }
                max_len
            }
        };
        Ok(BatchLayout {
            batch,
            q,
            kv,
            rows,
            q_rows,
            k_dims,
            max_seqlen_q,
            max_seqlen_k,
        })
    }

    /// The layout of a dense forward call, `[batch, seqlen, heads, head_dim]` on both sides.
    pub(crate) fn dense(batch: usize, seqlen_q: usize, seqlen_k: usize) -> BatchLayout<'static> {
        BatchLayout {
            batch,
            q: QueryLayout::Dense,
            kv: KvLayout::Dense,
            rows: CacheRows::default(),
            q_rows: seqlen_q,
            k_dims: [batch, seqlen_k],
            max_seqlen_q: seqlen_q,
            max_seqlen_k: seqlen_k,
        }
    }

    /// The problem a launch over this layout is validated and parameterised with (the one
    /// place: the CPU API, `Engine::launch_serving_raw` and the emulator tests): the layout's
    /// batch and longest sequences, q's heads and head_dim, k's heads. Lengths may be 0 (an
    /// empty batch, or no keys anywhere).
    ///
    /// # Errors
    /// As [`crate::forward`]'s option validation.
    pub fn launch_problem(
        &self,
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
        dtype: crate::tensor::DType,
        opts: &crate::options::ForwardOptions,
    ) -> Result<crate::problem::Problem> {
        self.launch_problem_v(heads_q, heads_kv, (head_dim, head_dim), dtype, opts)
    }

    /// As [`launch_problem`](Self::launch_problem), with v's (and o's) own head_dim:
    /// `(head_dim, head_dim_v)`.
    pub fn launch_problem_v(
        &self,
        heads_q: usize,
        heads_kv: usize,
        (head_dim, head_dim_v): (usize, usize),
        dtype: crate::tensor::DType,
        opts: &crate::options::ForwardOptions,
    ) -> Result<crate::problem::Problem> {
        let (b, msq, msk) = (self.batch, self.max_seqlen_q, self.max_seqlen_k);
        crate::problem::Problem::from_shapes(
            [b, msq, heads_q, head_dim],
            [b, msk, heads_kv, head_dim],
            [b, msk, heads_kv, head_dim_v],
            dtype,
            opts,
        )
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }
    pub fn query_layout(&self) -> QueryLayout<'a> {
        self.q
    }
    pub fn kv_layout(&self) -> KvLayout<'a> {
        self.kv
    }
    /// The longest sequence of queries (actual, not the caller's bound).
    pub fn max_seqlen_q(&self) -> usize {
        self.max_seqlen_q
    }
    /// The most keys any sequence sees (cached + new).
    pub fn max_seqlen_k(&self) -> usize {
        self.max_seqlen_k
    }
    /// Rows of q's (and o's) seqlen dimension: `seqlen_q` dense, `total_q` packed.
    pub fn q_rows(&self) -> usize {
        self.q_rows
    }

    /// Each sequence's cache row and first key (none unless the call gave them).
    pub fn cache_rows(&self) -> CacheRows<'a> {
        self.rows
    }

    /// The first cache position of sequence `b`'s keys (`cache_leftpad[b]`, else 0).
    #[inline]
    pub fn leftpad(&self, b: usize) -> usize {
        self.rows.leftpad.map_or(0, |p| p[b] as usize)
    }

    /// The cache row (k's first index) of sequence `b` of a dense cache (`cache_batch_idx[b]`,
    /// else `b`).
    #[inline]
    pub fn cache_row(&self, b: usize) -> usize {
        self.rows.batch_idx.map_or(b, |i| i[b] as usize)
    }

    /// k's first two dimensions: `(batch, seqlen_k)`, `(1, total_k)`, `(batch, capacity)` or
    /// `(num_blocks, page_size)`.
    pub fn k_dims(&self) -> [usize; 2] {
        self.k_dims
    }

    /// Keys per block of a paged cache (1 for any other layout).
    pub fn page_size(&self) -> usize {
        match self.kv {
            KvLayout::Paged { .. } => self.k_dims[1],
            _ => 1,
        }
    }

    /// Query rows of sequence `b`.
    #[inline]
    pub fn seqlen_q(&self, b: usize) -> usize {
        match self.q {
            QueryLayout::Dense => self.q_rows,
            QueryLayout::Varlen { cu_seqlens, .. } => (cu_seqlens[b + 1] - cu_seqlens[b]) as usize,
        }
    }

    /// Keys of sequence `b` (for a cache: the cached ones plus this call's new ones).
    #[inline]
    pub fn seqlen_k(&self, b: usize) -> usize {
        match self.kv {
            KvLayout::Dense => self.k_dims[1],
            KvLayout::Varlen { cu_seqlens, .. } => (cu_seqlens[b + 1] - cu_seqlens[b]) as usize,
            KvLayout::Cache { seqlens, new } => seqlens[b] as usize + new - self.leftpad(b),
            KvLayout::Paged { seqlens, new, .. } => seqlens[b] as usize + new,
        }
    }

    /// Query row `i` of sequence `b` as (batch index, row index) of q (and of o).
    #[inline]
    pub fn q_row(&self, b: usize, i: usize) -> (usize, usize) {
        match self.q {
            QueryLayout::Dense => (b, i),
            QueryLayout::Varlen { cu_seqlens, .. } => (0, cu_seqlens[b] as usize + i),
        }
    }

    /// Key `j` of sequence `b` as (first index, row index) of k and v.
    #[inline]
    pub fn kv_row(&self, b: usize, j: usize) -> (usize, usize) {
        let mut out = (0, 0);
        self.for_kv_rows(b, j, j + 1, |_, outer, row| out = (outer, row));
        out
    }

    /// Calls `f(j - j0, first index, row index)` for keys `j0..j1` of sequence `b`, walking the
    /// pages incrementally (no division per key).
    #[inline]
    pub(crate) fn for_kv_rows(&self, b: usize, j0: usize, j1: usize, mut f: impl FnMut(usize, usize, usize)) {
        match self.kv {
            KvLayout::Dense => (j0..j1).enumerate().for_each(|(jl, j)| f(jl, b, j)),
            KvLayout::Cache { .. } => {
                let (row, pad) = (self.cache_row(b), self.leftpad(b));
                (j0..j1).enumerate().for_each(|(jl, j)| f(jl, row, pad + j));
            }
            KvLayout::Varlen { cu_seqlens, .. } => {
                let start = cu_seqlens[b] as usize;
                (j0..j1).enumerate().for_each(|(jl, j)| f(jl, 0, start + j));
            }
            KvLayout::Paged {
                block_table,
                max_blocks_per_seq,
                ..
            } => {
                let ps = self.k_dims[1];
                let row = &block_table[b * max_blocks_per_seq..(b + 1) * max_blocks_per_seq];
                let (mut page, mut slot) = (j0 / ps, j0 % ps);
                for jl in 0..j1.saturating_sub(j0) {
                    f(jl, row[page] as usize, slot);
                    slot += 1;
                    if slot == ps {
                        slot = 0;
                        page += 1;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paged_rows_walk_the_table() {
        let table = [2, 0, 1, -1, 1, 2, -1, -1];
        let seqlens = [7, 4];
        let kv = KvLayout::Paged {
            block_table: &table,
            max_blocks_per_seq: 4,
            seqlens: &seqlens,
            new: 1,
        };
        let l = BatchLayout::new(QueryLayout::Dense, [2, 1, 4, 8], kv, [3, 3, 2, 8]).unwrap();
        assert_eq!((l.seqlen_k(0), l.seqlen_k(1), l.max_seqlen_k()), (8, 5, 8));
        let rows: Vec<_> = (0..8).map(|j| l.kv_row(0, j)).collect();
        assert_eq!(rows, [(2, 0), (2, 1), (2, 2), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]);
        let mut walked = Vec::new();
        l.for_kv_rows(1, 2, 5, |jl, o, r| walked.push((jl, o, r)));
        assert_eq!(walked, [(0, 1, 2), (1, 2, 0), (2, 2, 1)]);
    }
}

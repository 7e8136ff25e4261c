//! The test's own reading of a layout by the documented rules: the rows each sequence reads, or
//! the names of the rules it breaks.

use super::*;

/// The arguments a case breaks (the `what` / `option` an error may name), empty for a valid one.
pub(super) type Broken = Vec<&'static str>;

/// The argument a typed error names, or `None` for an error the serving layouts never cause.
pub(super) fn named(e: &Error) -> Option<&str> {
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
pub(super) fn read_cu(
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
pub(super) struct CacheLayout {
    /// `[batch, capacity, hkv, d]` (dense) or `[num_blocks, page_size, hkv, d]` (paged).
    pub(super) shape: [usize; 4],
    pub(super) seqlens: Vec<i32>,
    /// Block ids and `max_blocks_per_seq` (paged).
    pub(super) table: Option<(Vec<i32>, usize)>,
    /// The buffers hold `[outer, hkv, rows, d]` (a strided view of the shape above).
    pub(super) heads_major: bool,
}

impl CacheLayout {
    /// The cache row (`outer · rows + row`) of key `j` of sequence `b` (the layout known valid
    /// for it).
    pub(super) fn slot(&self, b: usize, j: usize) -> Option<usize> {
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
    pub(super) fn at(&self, slot: usize, h: usize) -> usize {
        let [_, n1, hkv, d] = self.shape;
        if self.heads_major {
            ((slot / n1 * hkv + h) * n1 + slot % n1) * d
        } else {
            (slot * hkv + h) * d
        }
    }

    /// The cache rows of the `seqlens[b] + new` key rows of each of `batch` sequences, by
    /// the rules, or the names of the rules the layout breaks.
    pub(super) fn read(&self, batch: usize, new: usize, broken: &mut Broken) -> Option<Vec<Vec<usize>>> {
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

    pub(super) fn view<'a, T: Element>(&'a self, k: &'a [T], v: &'a [T]) -> KvCache<'a> {
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

//! Where an append to a contiguous cache writes: its checks of the new rows' shapes and of the
//! slots they go to, and the walk over those rows, shared by the f32 / f16 / bf16 and FP8 caches.

use super::layout::{BatchLayout, CacheRows, KvLayout, QueryLayout};
use super::validate::check_view;
use crate::error::{Error, Operand, Result};
use crate::tensor::{Shape, TensorView};

/// The shape and slot checks of an append to a contiguous cache of `shape` (k's; v's rows have
/// `head_dim_v` elements) (`layout`: with the new rows; `rows`: each sequence's cache row and
/// first key); returns the element offset of
/// every row to write, in (b, i) order.
pub(super) fn append_slots(
    shape: Shape,
    head_dim_v: usize,
    layout: KvLayout<'_>,
    rows: CacheRows<'_>,
    k_new: &TensorView<'_>,
    v_new: &TensorView<'_>,
) -> Result<Vec<usize>> {
    check_view(k_new, Operand::K, true)?;
    check_view(v_new, Operand::V, true)?;
    let [batch, new, hkv, d] = k_new.shape();
    if v_new.shape() != [batch, new, hkv, head_dim_v] {
        return Err(Error::ShapeMismatch {
            what: "v_new".into(),
            got: format!("{:?}", v_new.shape()),
            expected: format!(
                "{:?} (k_new's batch, rows and heads; the cache's v head_dim {head_dim_v})",
                [batch, new, hkv, head_dim_v]
            ),
        });
    }
    let [_, cap, ch, cd] = shape;
    if (hkv, d) != (ch, cd) {
        return Err(Error::ShapeMismatch {
            what: "k_new".into(),
            got: format!("{:?}", k_new.shape()),
            expected: format!("[batch, seqlen_new, {ch}, {cd}] (heads_kv and head_dim of the cache)"),
        });
    }
    let layout = BatchLayout::with_cache_rows(QueryLayout::Dense, k_new.shape(), layout, shape, rows)?;
    if let (Some(idx), true) = (rows.batch_idx, new > 0) {
        crate::batch_layout::check_distinct_cache_rows(idx)?;
    }
    let mut slots = Vec::with_capacity(batch * new);
    let mut owner = Vec::with_capacity(batch * new);
    for b in 0..batch {
        // The new keys follow the cached ones: positions seqlens[b].. of the cache, keys
        // seqlens[b] - leftpad[b].. of the sequence.
        let start = layout.seqlen_k(b) - new;
        layout.for_kv_rows(b, start, start + new, |i, outer, row| {
            // The cache is contiguous (checked by the caller) and the layout bounds every index.
            slots.push((outer * cap + row) * ch * cd);
            owner.push((outer, row, b, i));
        });
    }
    // Two sequences writing one slot (a shared block appended to by both) is a caller bug whose
    // result would depend on the write order.
    owner.sort_unstable();
    for w in owner.windows(2) {
        let ((o, r, b0, i0), (_, _, b1, i1)) = (w[0], w[1]);
        if (w[0].0, w[0].1) == (w[1].0, w[1].1) {
            return Err(Error::InvalidSeqLayout {
                what: "block_table".into(),
                got: format!(
                    "sequence {b0} (new row {i0}) and sequence {b1} (new row {i1}) both write slot {r} of block {o}"
                ),
                expected: "distinct cache slots for every appended row (a block shared between sequences is read-only)"
                    .into(),
            });
        }
    }
    Ok(slots)
}

/// Calls `f(b, i, h, at)` for row `i` of sequence `b`, kv head `h` of an accepted append
/// (`slots` from [`append_slots`]), `at` its element offset in the cache.
pub(super) fn for_new_rows(k_new: &TensorView<'_>, slots: &[usize], mut f: impl FnMut(usize, usize, usize, usize)) {
    let [batch, new, hkv, d] = k_new.shape();
    let mut it = slots.iter();
    for b in 0..batch {
        for i in 0..new {
            let Some(&base) = it.next() else { return };
            for h in 0..hkv {
                f(b, i, h, base + h * d);
            }
        }
    }
}

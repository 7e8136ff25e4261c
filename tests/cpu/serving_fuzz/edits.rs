//! Edits that may break a layout: of `cu_seqlens` arrays and packed tensors, of KV caches and
//! block tables; and the strategies the properties share.

use super::*;
use super::layout::CacheLayout;

/// An edit of a `cu_seqlens` array or its packed tensor (`k`: the key side, else the query
/// side). Indices are taken modulo the array's length.
#[derive(Clone, Debug)]
pub(super) enum CuEdit {
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

pub(super) fn cu_edit(sides: bool) -> impl Strategy<Value = CuEdit> {
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
pub(super) fn apply_cu(e: &CuEdit, cu: [&mut Vec<i32>; 2], rows: [&mut usize; 2]) {
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
pub(super) enum CacheEdit {
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

pub(super) fn cache_edit() -> impl Strategy<Value = CacheEdit> {
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

pub(super) fn apply_cache(e: &CacheEdit, c: &mut CacheLayout) {
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
pub(super) fn edits<E: std::fmt::Debug + Clone>(e: impl Strategy<Value = E>) -> impl Strategy<Value = Vec<E>> {
    prop_oneof![1 => Just(Vec::new()), 1 => prop::collection::vec(e, 1..=3)]
}

/// `num_splits`: the heuristic, any count in 1..=64, or (rarely) 0 or past the limit of 128.
pub(super) fn splits_strategy() -> impl Strategy<Value = Option<usize>> {
    prop_oneof![
        3 => Just(None),
        6 => (1usize..=64).prop_map(Some),
        1 => prop::sample::select(vec![0usize, 129, 1000]).prop_map(Some),
    ]
}

pub(super) fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![DType::F32, DType::F16, DType::BF16])
}

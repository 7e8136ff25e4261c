//! The caller's K/V rows: how they lie (the one rule both paths read them by), and asking the
//! cache for them ahead of use.

use super::simd;
use crate::tensor::{Data, TensorView};

/// Whether K and V hold each key's rows of all heads side by side (the head stride at most the
/// sequence stride: `[batch, seqlen, heads, head_dim]`, FlashAttention's layout), rather than
/// each head's keys as one run (`[batch, heads, seqlen, head_dim]` passed as strided views: the
/// layout of torch's SDPA, candle's attention and onnxruntime's Attention). The one rule both
/// CPU paths read K/V by: side by side, one pass over the keys reads every head's rows as a
/// single sequential stream, so the tiled path packs all kv heads of a batch per item and the
/// decode sweep takes every head block by block; head-major, such a pass is two streams per head
/// (2 × heads interleaved runs), so both go head by head, each head's K and V then two
/// sequential runs (`tiled::tiled`'s item choice, `inplace::forward_isa`'s units). One head, or one
/// key: nothing to choose (true).
pub(crate) fn heads_side_by_side(k: &TensorView, v: &TensorView) -> bool {
    [k, v].iter().all(|t| t.heads() <= 1 || t.seqlen() <= 1 || t.strides()[2] <= t.strides()[1])
}

/// Prefetches (into L1) the cache lines of `d` elements from element `ofs` of `data`.
#[inline(always)]
pub(crate) fn prefetch_row(data: Data<'_>, ofs: usize, d: usize) {
    prefetch_row_with(data, ofs, d, simd::prefetch);
}

/// As [`prefetch_row`], with the given prefetch instruction (`simd::prefetch` or `prefetch_l2`).
#[inline(always)]
pub(crate) fn prefetch_row_with(data: Data<'_>, ofs: usize, d: usize, fetch: impl Fn(*const i8)) {
    let (ptr, bytes) = match data {
        Data::F32(x) => (x.as_ptr().wrapping_add(ofs) as *const i8, 4 * d),
        Data::F16(x) => (x.as_ptr().wrapping_add(ofs) as *const i8, 2 * d),
        Data::BF16(x) => (x.as_ptr().wrapping_add(ofs) as *const i8, 2 * d),
    };
    prefetch_lines(ptr, bytes, fetch);
}

/// Prefetches (into L1) the cache lines of the `d` bytes from byte `ofs` of `codes` (a row of
/// an FP8 cache).
#[inline(always)]
pub(crate) fn prefetch_codes(codes: &[u8], ofs: usize, d: usize) {
    prefetch_lines(codes.as_ptr().wrapping_add(ofs) as *const i8, d, simd::prefetch);
}

/// Prefetches the cache lines of `bytes` bytes from `ptr`.
#[inline(always)]
fn prefetch_lines(ptr: *const i8, bytes: usize, fetch: impl Fn(*const i8)) {
    // Every line the row touches, once: from the line holding its first byte (a row need not
    // start on a line boundary) to the one holding its last.
    let lead = ptr as usize % 64;
    let mut at = 0;
    while at < lead + bytes {
        fetch(ptr.wrapping_sub(lead).wrapping_add(at));
        at += 64;
    }
}

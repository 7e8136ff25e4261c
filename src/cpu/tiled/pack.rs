//! K and V of one (batch, kv head) packed into the micro-kernel's A-operand layouts, and the
//! sizes of the tiled path's buffers, checked before anything is allocated.

use super::sizes::round_up;
use crate::cpu::gemm::MR;
use crate::cpu::rows::prefetch_row_with;
use crate::cpu::head_dim::MAX_HEAD_DIM;
use crate::cpu::{pool, simd};
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::tensor::{Data, TensorView};
use std::ops::Range;

/// K and V of one (batch, kv head) in the micro-kernel's A-operand layouts (strips of `MR` rows).
pub(super) struct PackedKv<'a> {
    /// `[seqlen_k_pad / MR][head_dim][MR]`: strips of 6 keys, zero-padded; empty when `k_rows`
    /// holds K instead.
    pub(super) k: Vec<f32>,
    /// An f32 K read in place (the AVX-512 path): the input's elements, the offset of key 0's
    /// row of this head, and the key stride.
    pub(super) k_rows: Option<(&'a [f32], usize, usize)>,
    /// `[head_dim_v_pad / MR][seqlen_k_pad][MR]`: strips of 6 columns of V (i.e. rows of Vᵀ).
    pub(super) v: Vec<f32>,
    /// Every element of V is finite. Otherwise `Oᵀ += Vᵀ·Pᵀ` skips the zeros of P, so a key's
    /// infinite or NaN V reaches only the queries that see it (`0 · inf` is NaN).
    pub(super) v_finite: bool,
}

/// Strips of K/V rows `pack_heads` prefetches ahead of the one it packs when it packs some of
/// the kv heads only: then each key's rows are a run of a few head_dim elements out of a row of
/// all heads, a separate run of cache misses the hardware prefetchers do not follow; asked for
/// this far ahead they arrive while the strips before them are scattered. Whole rows of all kv
/// heads are one sequential stream that the hardware prefetches, so there software prefetches
/// only cost. One head of head-major storage (see [`heads_side_by_side`]) is one sequential run
/// per K and V, yet the prefetch measured faster there too, so it stays on for every item of
/// fewer than all kv heads.
pub(super) const PACK_PREFETCH_STRIPS: usize = 4;

/// Row `(b, s, h)` of `t` as f32: the input's own elements where it holds f32 (no copy), else
/// widened into `buf` (length head_dim).
#[inline(always)]
pub(super) fn row_f32<'r, 'a: 'r>(t: &TensorView<'a>, (b, s, h): (usize, usize, usize), buf: &'r mut [f32]) -> &'r [f32] {
    match t.data() {
        Data::F32(x) => {
            let at = t.offset(b, s, h);
            &x[at..at + buf.len()]
        }
        _ => {
            t.read_row(b, s, h, buf);
            buf
        }
    }
}

/// Rows `s0..s0 + rows` of heads `heads` of `t`, asked for ahead of use (into L2 if `l2`, else L1).
#[inline(always)]
pub(super) fn prefetch_rows(t: &TensorView, (b, s0, heads): (usize, usize, Range<usize>), rows: usize, l2: bool) {
    for s in s0..(s0 + rows).min(t.seqlen()) {
        for h in heads.clone() {
            let (data, at, d) = (t.data(), t.offset(b, s, h), t.head_dim());
            if l2 {
                prefetch_row_with(data, at, d, simd::prefetch_l2);
            } else {
                prefetch_row_with(data, at, d, simd::prefetch);
            }
        }
    }
}

/// A row of zeros: the keys past seqlen_k of the last K strip.
pub(super) static ZEROS: [f32; MAX_HEAD_DIM] = [0.0; MAX_HEAD_DIM];

/// One head's packed K and V buffers (reused ones keep old contents), their padding zeroed:
/// keys past seqlen_k, and columns past head_dim_v of the last column strip of V. The scatter
/// of `pack_heads` writes every other element.
pub(super) fn packed_buffers(p: &Problem, sz: &Sizes, pack_k: bool) -> Result<(Vec<f32>, Vec<f32>)> {
    let (d, d_v) = (p.head_dim, p.head_dim_v);
    let sk_pad = sz.sk_pad;
    let mut kp = if pack_k { pool::take_dirty(sz.k_pack, "packed K of one head")? } else { Vec::new() };
    let mut vp = pool::take_dirty(sz.v_pack, "packed V of one head")?;
    if pack_k {
        kp[p.seqlen_k / MR * d * MR..].fill(0.0); // the last, partial strip (rewritten by the scatter)
    }
    let dv = sz.v_pack / sk_pad;
    for strip in vp.chunks_exact_mut(sk_pad * MR) {
        strip[p.seqlen_k * MR..].fill(0.0);
    }
    if dv > d_v {
        // Columns d_v..dv of the last column strip, for every key.
        let last = &mut vp[(dv / MR - 1) * sk_pad * MR..];
        for key in last.chunks_exact_mut(MR) {
            key[d_v % MR..].fill(0.0);
        }
    }
    Ok((kp, vp))
}

/// Packs K and V of kv heads `heads` of batch `b` in one pass over the keys, in address order:
/// in the `[batch, seqlen, heads, head_dim]` layout the rows of one key's heads lie side by side,
/// so each key is one contiguous run (a whole row when `heads` is every kv head), which the
/// hardware prefetchers stream, where a pass per head reads head_dim elements out of every row
/// of all heads, each a separate miss. `buf`: `MR × max(head_dim, head_dim_v)` f32 of scratch
/// (the widened rows of an f16/bf16 input).
pub(super) fn pack_heads<'a>(
    p: &Problem,
    sz: &Sizes,
    (k, v): (&TensorView<'a>, &TensorView),
    b: usize,
    heads: Range<usize>,
    buf: &mut [f32],
    k_in_place: bool,
) -> Result<Vec<PackedKv<'a>>> {
    let (d, d_v) = (p.head_dim, p.head_dim_v);
    let sk_pad = sz.sk_pad;
    // K read in place by the first product (see `KTile::Rows`): an f32 input, when asked for.
    let k_rows = match k.data() {
        Data::F32(x) if k_in_place => Some(x),
        _ => None,
    };
    let mut bufs: Vec<(Vec<f32>, Vec<f32>)> = Vec::with_capacity(heads.len());
    for _ in heads.clone() {
        bufs.push(packed_buffers(p, sz, k_rows.is_none())?);
    }
    // Per head: every V value packed by `simd::pack_v_strip` is finite (`None`: the scalar
    // copy ran, the packed V is checked afterwards).
    let mut finite: Vec<Option<bool>> = vec![Some(true); heads.len()];
    let fetch_strip = |strip: usize| {
        prefetch_rows(k, (b, strip * MR, heads.clone()), MR, false);
        prefetch_rows(v, (b, strip * MR, heads.clone()), MR, false);
    };
    let nstrips = p.seqlen_k.div_ceil(MR);
    let dist = if heads.len() < p.heads_kv { PACK_PREFETCH_STRIPS } else { 0 };
    (0..dist.min(nstrips)).for_each(fetch_strip);
    for strip in 0..nstrips {
        if dist > 0 && strip + dist < nstrips {
            fetch_strip(strip + dist);
        }
        let n = MR.min(p.seqlen_k - strip * MR);
        for (h, (kp, _)) in heads.clone().zip(bufs.iter_mut()).filter(|_| k_rows.is_none()) {
            // The strip's six rows (zeros past seqlen_k), interleaved column by column: each
            // column's six values are written contiguously.
            let mut rows: [&[f32]; MR] = [&ZEROS[..d]; MR];
            for (lane, (row, lane_buf)) in rows.iter_mut().zip(buf[..MR * d].chunks_exact_mut(d)).take(n).enumerate() {
                *row = row_f32(k, (b, strip * MR + lane, h), lane_buf);
            }
            let kdst = &mut kp[strip * d * MR..(strip + 1) * d * MR];
            if simd::pack_strip(&rows, d, kdst) {
                continue;
            }
            for (x, col) in kdst.chunks_exact_mut(MR).enumerate() {
                for (dst, row) in col.iter_mut().zip(rows) {
                    *dst = row[x];
                }
            }
        }
        for ((h, (_, vp)), fin) in heads.clone().zip(bufs.iter_mut()).zip(finite.iter_mut()) {
            let mut rows: [&[f32]; MR] = [&ZEROS[..d_v]; MR];
            for (lane, (row, lane_buf)) in rows.iter_mut().zip(buf[..MR * d_v].chunks_exact_mut(d_v)).take(n).enumerate() {
                *row = row_f32(v, (b, strip * MR + lane, h), lane_buf);
            }
            // Per column strip, the strip's six keys are 36 consecutive f32: six columns of
            // each key (fixed-size copies; the last column strip holds d_v % 6 columns).
            if let Some(f) = simd::pack_v_strip(&rows, d_v, &mut vp[strip * MR * MR..], sk_pad * MR) {
                *fin = fin.map(|x| x && f);
                continue;
            }
            *fin = None;
            for (c, col_strip) in vp.chunks_exact_mut(sk_pad * MR).enumerate() {
                let dst = &mut col_strip[strip * MR * MR..(strip + 1) * MR * MR];
                for (key, row) in dst.chunks_exact_mut(MR).zip(rows) {
                    match row.get(c * MR..(c + 1) * MR) {
                        Some(six) => key.copy_from_slice(six),
                        // Not a slice copy: one of run-time length is a call to memmove.
                        None => key.iter_mut().zip(&row[c * MR..]).for_each(|(k, &x)| *k = x),
                    }
                }
            }
        }
    }
    let packed = bufs.into_iter().zip(finite).zip(heads);
    Ok(packed
        .map(|(((kp, vp), f), h)| PackedKv {
            v_finite: f.unwrap_or_else(|| all_finite(&vp)),
            k: kp,
            k_rows: k_rows.map(|x| (x, k.offset(b, 0, h), k.strides()[1])),
            v: vp,
        })
        .collect())
}

/// Whether every element is finite: `x * 0` is 0 for a finite x and NaN for ±inf or NaN, summed
/// in 8 independent lanes so that the loop vectorises.
pub(super) fn all_finite(x: &[f32]) -> bool {
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i] * 0.0;
        }
    }
    acc.iter().all(|&a| a == 0.0) && tail.iter().all(|t| t.is_finite())
}

/// Sizes of the CPU backend's buffers, computed with checked arithmetic before anything is
/// allocated: a problem whose buffers cannot exist is [`Error::TooLarge`] up front.
pub(super) struct Sizes {
    /// `seqlen_k` rounded up to the micro-kernel's strips.
    pub(super) sk_pad: usize,
    /// f32 elements of one head's packed K, and of its packed V.
    pub(super) k_pack: usize,
    pub(super) v_pack: usize,
    /// LSEs `[batch, heads_q, seqlen_q]`.
    pub(super) n_lse: usize,
}

impl Sizes {
    pub(super) fn new(p: &Problem) -> Result<Self> {
        let too_large = |what: &str| Error::TooLarge { what: format!("the CPU backend's {what} for this problem") };
        let (d, dv) = (p.head_dim, round_up(p.head_dim_v, MR)); // both <= MAX_HEAD_DIM
        let sk_pad = p.seqlen_k.checked_next_multiple_of(MR).ok_or_else(|| too_large("padded key count"))?;
        let f32s = |n: Option<usize>, what: &str| {
            n.filter(|&n| n <= isize::MAX as usize / 4).ok_or_else(|| too_large(what))
        };
        let k_pack = f32s(sk_pad.checked_mul(d), "packed K")?;
        let v_pack = f32s(sk_pad.checked_mul(dv), "packed V")?;
        let n_lse = f32s(p.batch.checked_mul(p.heads_q).and_then(|x| x.checked_mul(p.seqlen_q)), "LSE")?;
        Ok(Sizes { sk_pad, k_pack, v_pack, n_lse })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_finite_sees_every_element() {
        for n in [0usize, 1, 7, 8, 9, 64, 77] {
            let mut x = vec![1.5f32; n];
            assert!(all_finite(&x));
            for i in 0..n {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    x[i] = bad;
                    assert!(!all_finite(&x), "n {n} i {i} {bad}");
                    x[i] = f32::MAX;
                    assert!(all_finite(&x));
                }
            }
        }
    }
}

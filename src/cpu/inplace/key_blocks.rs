//! Decode in blocks of 16 keys, with the products of `lanes` on the AVX-512 or the AVX2 build.

use super::chunks::prefetch_rows;
use super::scratch::Scratch;
use super::sweep::{same_span, span, Sweep};
use super::item::{Ctx, Item, ItemSpan};
use super::lanes;
use crate::cpu::gemm::NR;
use crate::cpu::isa::{detect_isa, Isa};
use crate::cpu::rows::{heads_side_by_side, prefetch_row_with};
use crate::cpu::simd;
use crate::cpu::softmax::{row_probs, tree_sum};
use crate::numerics::softmax_math::Exp2Math;
use crate::problem::Problem;
use crate::tensor::Data;

/// Decode in blocks of [`lanes::BLOCK_KEYS`] keys ([`sweep_key_blocks`]), for units whose items
/// see the same keys and whose K and V share an element type.
pub(super) struct KeyBlocks;

impl Sweep for KeyBlocks {
    #[inline(always)]
    fn run<M: Exp2Math, const FMA: bool>(c: &Ctx<'_, M>, items: &mut [Item<'_>], scrs: &mut [Scratch], spans: &[ItemSpan]) -> bool {
        if !same_span(spans) || c.fp8.is_some() {
            return false;
        }
        let span = span(spans);
        match (c.k.data(), c.v.data()) {
            (Data::BF16(k), Data::BF16(v)) => sweep_key_blocks(c, items, scrs, spans, span, (k, v)),
            (Data::F16(k), Data::F16(v)) => sweep_key_blocks(c, items, scrs, spans, span, (k, v)),
            (Data::F32(k), Data::F32(v)) => sweep_key_blocks(c, items, scrs, spans, span, (k, v)),
            _ => false,
        }
    }
}

/// Decode in blocks of [`lanes::BLOCK_KEYS`] keys ([`sweep_key_blocks_with`]) with the AVX-512 products when
/// this call runs the AVX-512 build, else the AVX2 + FMA + F16C ones when it runs the AVX2 build
/// (and the CPU has F16C), when head_dim is a multiple of 32 up to `32 · lanes::MAX_W`, every
/// item holds at most [`NR`] query rows and every row sees the whole span, with the native
/// arithmetic only (`M::NATIVE`: the emulated numerics, a tool for comparing with kernels, take
/// the chunked path; each arithmetic doubled this function's 48 instantiations per ISA and the
/// crate's release build time); `false` (nothing done) otherwise.
#[inline(always)]
fn sweep_key_blocks<M: Exp2Math, T: lanes::Elem>(
    c: &Ctx<'_, M>,
    items: &mut [Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
    span: (usize, usize),
    kv: (&[T], &[T]),
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if M::NATIVE {
        let d = c.p.head_dim;
        // Specialised per head_dim (`W`), for q/k and v alike: an unequal pair takes the chunks.
        let fits = d == c.p.head_dim_v && d.is_multiple_of(32) && (1..=lanes::MAX_W).contains(&(d / 32));
        let rows_fit = items.iter().all(|it| it.r1 - it.r0 <= NR);
        let whole = items.iter().zip(scrs.iter()).all(|(it, scr)| {
            let n = it.r1 - it.r0;
            scr.lo[..n].iter().all(|&l| l == span.0) && scr.hi[..n].iter().all(|&h| h == span.1)
        });
        if !(fits && rows_fit && whole) {
            return false;
        }
        macro_rules! by_w {
            ($f:ident) => {
                match d / 32 {
                    1 => $f::<M, T, 1>(c, items, scrs, spans, span, kv),
                    2 => $f::<M, T, 2>(c, items, scrs, spans, span, kv),
                    3 => $f::<M, T, 3>(c, items, scrs, spans, span, kv),
                    4 => $f::<M, T, 4>(c, items, scrs, spans, span, kv),
                    5 => $f::<M, T, 5>(c, items, scrs, spans, span, kv),
                    6 => $f::<M, T, 6>(c, items, scrs, spans, span, kv),
                    7 => $f::<M, T, 7>(c, items, scrs, spans, span, kv),
                    _ => $f::<M, T, 8>(c, items, scrs, spans, span, kv),
                }
            };
        }
        let has = detect_isa();
        if c.isa == Isa::Avx512 && has == Isa::Avx512 {
            // SAFETY: `detect_isa()` found AVX-512F, AVX2 and FMA on this CPU, the only
            // requirement of the `#[target_feature]` functions `sweep_key_blocks_avx512`; they are
            // safe code.
            unsafe { by_w!(sweep_key_blocks_avx512) };
            return true;
        }
        if c.isa != Isa::Portable && has != Isa::Portable && std::is_x86_feature_detected!("f16c") {
            // SAFETY: `detect_isa()` found AVX2 and FMA on this CPU and F16C was just detected,
            // the only requirements of the `#[target_feature]` functions `sweep_key_blocks_avx2`;
            // they are safe code.
            unsafe { by_w!(sweep_key_blocks_avx2) };
            return true;
        }
    }
    let _ = (c, items, scrs, spans, span, kv);
    false
}

/// [`sweep_key_blocks_with`] compiled for AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn sweep_key_blocks_avx512<M: Exp2Math, T: lanes::Elem, const W: usize>(
    c: &Ctx<'_, M>,
    items: &mut [Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
    span: (usize, usize),
    kv: (&[T], &[T]),
) {
    if let Some(s) = lanes::Avx512::new() {
        sweep_key_blocks_with::<lanes::Avx512, M, T, W>(s, c, items, scrs, spans, span, kv);
    }
}

/// [`sweep_key_blocks_with`] compiled for AVX2 + FMA + F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn sweep_key_blocks_avx2<M: Exp2Math, T: lanes::Elem, const W: usize>(
    c: &Ctx<'_, M>,
    items: &mut [Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
    span: (usize, usize),
    kv: (&[T], &[T]),
) {
    if let Some(s) = lanes::Avx2::new() {
        sweep_key_blocks_with::<lanes::Avx2, M, T, W>(s, c, items, scrs, spans, span, kv);
    }
}

/// Decode-like items (each at most [`NR`] query rows of one kv head: the query heads of its GQA
/// group at one query position, all seeing every key of `lo..hi`) in blocks of [`lanes::BLOCK_KEYS`]
/// keys: per block and item, in tiles of up to `S::MAX_R` rows, the tile's scores against the
/// block (`lanes::scores`: each K vector loaded once for the tile's rows), one online-softmax
/// step per row for the block (the chunked path's rule: one max and one rescale per block), and
/// `o = o · scale + P·V` with O in registers (`lanes::scale_add_pv`). The items take the block
/// in turn, so a block's K/V rows of all heads (`[.., seqlen, heads, head_dim]`: side by side)
/// are read within a short window, and the tiles after an item's first read them from L1.
/// head_dim is `32 · W`; the queries and O are held in the element type's lane order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn sweep_key_blocks_with<S: lanes::Lanes, M: Exp2Math, T: lanes::Elem, const W: usize>(
    s: S,
    c: &Ctx<'_, M>,
    items: &mut [Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
    (lo, hi): (usize, usize),
    (k, v): (&[T], &[T]),
) {
    use lanes::{lane_order, BLOCK_KEYS};
    let Some(b) = items.first().map(|it| it.b) else {
        return;
    };
    let d = 32 * W;
    let ord = lane_order(T::KIND, S::LANES);
    for (it, scr) in items.iter().zip(scrs.iter_mut()) {
        let n = (it.r1 - it.r0) * d;
        for (i, x) in scr.qp[..n].iter_mut().enumerate() {
            *x = scr.q[i / 32 * 32 + ord[i % 32]];
        }
        scr.op[..n].fill(0.0);
    }
    let (mut kb, mut vb, mut nkb) = ([0usize; BLOCK_KEYS], [0usize; BLOCK_KEYS], [0usize; BLOCK_KEYS]);
    let (mut kofs, mut vofs) = ([0usize; BLOCK_KEYS], [0usize; BLOCK_KEYS]);
    // Head-major K/V (one head per unit, see `forward_isa`): each item's next block of keys is
    // asked for into L1 while this one is computed, which measured faster than the hardware
    // prefetchers alone on that single pair of streams (further ahead, into L2, or one line per
    // page: slower). Side by side, `key_block_in_key_order` prefetches its own way;
    // a lone item side by side leaves it to the hardware.
    let side = heads_side_by_side(&c.k, &c.v);
    let ahead = !side;
    // Side by side, the items of several kv heads take each block in key order
    // (`key_block_in_key_order`), so that memory is read as a few sequential streams.
    let key_major = side && items.len() > 1;
    let mut j0 = lo;
    while j0 < hi {
        let n = BLOCK_KEYS.min(hi - j0);
        c.layout.for_kv_rows(b, j0, j0 + n, |t, outer, row| {
            kb[t] = c.k.offset(outer, row, 0);
            vb[t] = c.v.offset(outer, row, 0);
        });
        if key_major {
            let nn = BLOCK_KEYS.min(hi - (j0 + n));
            c.layout.for_kv_rows(b, j0 + n, j0 + n + nn, |t, outer, row| nkb[t] = c.k.offset(outer, row, 0));
            key_block_in_key_order::<S, M, T, W>(s, c, items, scrs, spans, j0, (k, v), (&kb[..n], &vb[..n]), &nkb[..nn]);
            j0 += n;
            continue;
        }
        for ((it, scr), sp) in items.iter().zip(scrs.iter_mut()).zip(spans) {
            if ahead {
                prefetch_rows(c, b, (it.hk, (j0 + n).min(hi), (j0 + n + BLOCK_KEYS).min(hi)));
            }
            let (kh, vh) = (c.k.offset(0, 0, it.hk), c.v.offset(0, 0, it.hk));
            for t in 0..n {
                kofs[t] = kb[t] + kh;
                vofs[t] = vb[t] + vh;
            }
            let (kofs, vofs) = (&kofs[..n], &vofs[..n]);
            for (r0, r) in row_tiles::<S>(it.r1 - it.r0) {
                match r {
                    4 => key_block_row_tile::<S, M, T, W, 4>(s, c, scr, &sp.ps, r0, j0, (k, v), (kofs, vofs)),
                    2 => key_block_row_tile::<S, M, T, W, 2>(s, c, scr, &sp.ps, r0, j0, (k, v), (kofs, vofs)),
                    _ => key_block_row_tile::<S, M, T, W, 1>(s, c, scr, &sp.ps, r0, j0, (k, v), (kofs, vofs)),
                }
            }
        }
        j0 += n;
    }
    for (it, scr) in items.iter().zip(scrs.iter_mut()) {
        let n = (it.r1 - it.r0) * d;
        for (i, &x) in scr.op[..n].iter().enumerate() {
            scr.o[i / 32 * 32 + ord[i % 32]] = x;
        }
    }
}

/// The product tiles of an item's `rows` query rows in the blocked decode: `(first row, rows)`,
/// 4 rows at a time where `S` holds them (AVX-512), then 2, then 1.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn row_tiles<S: lanes::Lanes>(rows: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut r0 = 0;
    std::iter::from_fn(move || {
        let left = rows - r0;
        let r = if S::MAX_R >= 4 && left >= 4 {
            4
        } else if S::MAX_R >= 2 && left >= 2 {
            2
        } else {
            1
        };
        (left > 0).then(|| {
            r0 += r;
            (r0 - r, r)
        })
    })
}

/// One block of keys (starting at key `j0`, offsets `kofs`, `vofs`) for rows `r0..r0 + R` of
/// an item ([`sweep_key_blocks_with`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn key_block_row_tile<S: lanes::Lanes, M: Exp2Math, T: lanes::Elem, const W: usize, const R: usize>(
    s: S,
    c: &Ctx<'_, M>,
    scr: &mut Scratch,
    ps: &Problem,
    r0: usize,
    j0: usize,
    (k, v): (&[T], &[T]),
    (kofs, vofs): (&[usize], &[usize]),
) {
    use lanes::{scale_add_pv, scores, BLOCK_KEYS};
    let d = 32 * W;
    let n = kofs.len();
    let rows = r0 * d..(r0 + R) * d;
    let mut x = scores::<S, T, W, R>(s, &scr.qp[rows.clone()], k, kofs);
    let mut p = [[0.0f32; BLOCK_KEYS]; R];
    let mut scale = [1.0f32; R];
    for (r, (xr, (pr, sc))) in x.iter_mut().zip(p.iter_mut().zip(scale.iter_mut())).enumerate() {
        (*pr, *sc) = key_block_probs(c, scr, ps, r0 + r, j0, n, xr);
    }
    scale_add_pv::<S, T, W, R>(s, &mut scr.op[rows], scale, (&p, 0), v, vofs);
}

/// Row `rl`'s softmax step over a block's scores `x[..n]` (keys `j0..`): softcap and ALiBi in
/// natural units (as in `attend_chunk`), [`row_probs`], the sum updated; returns the
/// probabilities as P·V takes them and the factor for the row's output.
#[inline(always)]
fn key_block_probs<M: Exp2Math>(
    c: &Ctx<'_, M>,
    scr: &mut Scratch,
    ps: &Problem,
    rl: usize,
    j0: usize,
    n: usize,
    x: &mut [f32; lanes::BLOCK_KEYS],
) -> ([f32; lanes::BLOCK_KEYS], f32) {
    if c.sm.natural {
        for (t, y) in x.iter_mut().enumerate().take(n) {
            *y = c.sm.natural_score(*y) + ps.alibi_bias(scr.head[rl], scr.qi[rl], j0 + t);
        }
    }
    let st = &mut scr.rows[rl];
    let (q, f) = row_probs::<M, { lanes::BLOCK_KEYS }, true>(st, x, n, c.sm.c, &c.math);
    st.l = st.l * f + tree_sum(q);
    (q.map(|y| c.math.round_p(y)), f)
}

/// Keys a decode item takes at a time in [`key_block_in_key_order`]: as many sequential streams of K
/// (then V) rows. 8 streams read faster than 4 (f32, bf16, GQA), and 16 no faster than 8.
const KEY_STREAMS: usize = 8;

/// One block of keys (starting at key `j0`; `kb`, `vb`: the element offsets of its K and V rows
/// for kv head 0) for items of several kv heads whose rows lie side by side, in key order: the
/// products of every item with keys `t0..t0 + KEY_STREAMS`, then the next `KEY_STREAMS` keys, so that the block's
/// K rows (`[.., seqlen, heads, head_dim]`) are read as `KEY_STREAMS` sequential streams, not as one
/// stream per key a row of all heads apart, as each item taking the whole block in turn would
/// read (that order is markedly slower, most of all for bf16); then
/// each row's softmax step, then `o·scale + P·V` in the same order over V. The same operations
/// in the same order per row as [`key_block_row_tile`] (each key's horizontal sum by `Lanes::hsum_one`,
/// `hsum_keys`' tree for one key; O waits in `Scratch::op` between key groups, scaled before
/// the first), so the bits are the same.
///
/// Each pass asks for the rows the next one reads, into L2 (`next_kb`: the next block's K
/// offsets for kv head 0, empty after the last block): the first pass for the block's V rows,
/// the third for the next block's K rows, the same keys of the same head at each step, so they
/// arrive half a block (256 KiB at 1×32×…×128 f32) before they are used. With the hardware
/// prefetchers alone the core computes and reads DRAM in turn, waiting on memory between its
/// bursts of work; the prefetches overlap the two (T1 and T2 hints measure the same, T0 and
/// NTA slower).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn key_block_in_key_order<S: lanes::Lanes, M: Exp2Math, T: lanes::Elem, const W: usize>(
    s: S,
    c: &Ctx<'_, M>,
    items: &[Item<'_>],
    scrs: &mut [Scratch],
    spans: &[ItemSpan],
    j0: usize,
    (k, v): (&[T], &[T]),
    (kb, vb): (&[usize], &[usize]),
    next_kb: &[usize],
) {
    use lanes::{key_sums, scale_add_pv, BLOCK_KEYS};
    let d = 32 * W;
    let n = kb.len().min(BLOCK_KEYS);
    for t0 in (0..n).step_by(KEY_STREAMS) {
        let nt = KEY_STREAMS.min(n - t0);
        for (it, scr) in items.iter().zip(scrs.iter_mut()) {
            let kh = c.k.offset(0, 0, it.hk);
            let kofs: [usize; KEY_STREAMS] = std::array::from_fn(|t| kb[(t0 + t).min(n - 1)] + kh);
            let Scratch { qp, xb, .. } = scr;
            for (r0, r) in row_tiles::<S>(it.r1 - it.r0) {
                let q = &qp[r0 * d..(r0 + r) * d];
                macro_rules! sums {
                    ($r:literal) => {{
                        let mut sums = [[s.fold(s.zero()); KEY_STREAMS]; $r];
                        key_sums::<S, T, W, $r, KEY_STREAMS>(s, q, k, &kofs[..nt], &mut sums);
                        for (x, sr) in xb[r0..r0 + $r].iter_mut().zip(&sums) {
                            for (xt, &v) in x[t0..t0 + nt].iter_mut().zip(sr) {
                                *xt = s.hsum_one(v);
                            }
                        }
                    }};
                }
                match r {
                    4 => sums!(4),
                    2 => sums!(2),
                    _ => sums!(1),
                }
            }
            // The same keys' V rows, which the third pass reads: asked for now, into L2.
            let vh = c.v.offset(0, 0, it.hk);
            for &o in &vb[t0..t0 + nt] {
                prefetch_row_with(c.v.data(), o + vh, d, simd::prefetch_l2);
            }
        }
    }
    for ((it, scr), sp) in items.iter().zip(scrs.iter_mut()).zip(spans) {
        for rl in 0..it.r1 - it.r0 {
            // Keys past `n` score 0, as in `scores`.
            let mut x: [f32; BLOCK_KEYS] = std::array::from_fn(|t| if t < n { scr.xb[rl][t] } else { 0.0 });
            (scr.pb[rl], scr.fb[rl]) = key_block_probs(c, scr, &sp.ps, rl, j0, n, &mut x);
        }
    }
    for t0 in (0..n).step_by(KEY_STREAMS) {
        let nt = KEY_STREAMS.min(n - t0);
        for (it, scr) in items.iter().zip(scrs.iter_mut()) {
            let vh = c.v.offset(0, 0, it.hk);
            let vofs: [usize; KEY_STREAMS] = std::array::from_fn(|t| vb[(t0 + t).min(n - 1)] + vh);
            let Scratch { op, pb, fb, .. } = scr;
            for (r0, r) in row_tiles::<S>(it.r1 - it.r0) {
                let o = &mut op[r0 * d..(r0 + r) * d];
                // The rows' probabilities of keys `t0..`; the output scaled before the block's
                // first keys only (× 1 after: exact).
                macro_rules! pv {
                    ($r:literal) => {{
                        let scale: [f32; $r] = std::array::from_fn(|i| if t0 == 0 { fb[r0 + i] } else { 1.0 });
                        scale_add_pv::<S, T, W, $r>(s, o, scale, (&pb[r0..r0 + $r], t0), v, &vofs[..nt])
                    }};
                }
                match r {
                    4 => pv!(4),
                    2 => pv!(2),
                    _ => pv!(1),
                }
            }
            // The same keys of the next block's K rows, which its first pass reads.
            let kh = c.k.offset(0, 0, it.hk);
            for &o in next_kb.iter().skip(t0).take(nt) {
                prefetch_row_with(c.k.data(), o + kh, d, simd::prefetch_l2);
            }
        }
    }
}

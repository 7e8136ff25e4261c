//! Products along head_dim over rows as they lie: dot products of a query row with key rows and
//! `o += p·v` over value rows, written so that LLVM vectorises them (the in-place path's
//! products; f16/bf16 rows widened where they are read).

use super::gemm::NR;
use crate::convert::Widen;

#[inline(always)]
pub(crate) fn fma<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `W` consecutive elements from `x` as a value (one bounds check; then registers).
#[inline(always)]
pub(crate) fn load<const W: usize>(s: &[f32], x: usize) -> [f32; W] {
    let mut a = [0.0; W];
    a.copy_from_slice(&s[x..x + W]);
    a
}

/// `a · b + c` lane by lane.
#[inline(always)]
pub(crate) fn fma_lanes<const W: usize, const FMA: bool>(a: [f32; W], b: [f32; W], c: [f32; W]) -> [f32; W] {
    std::array::from_fn(|l| fma::<FMA>(a[l], b[l], c[l]))
}

/// Sum of 8 lanes as a tree (two halves, then pairs), which vectorises.
#[inline(always)]
pub(crate) fn hsum8(a: [f32; 8]) -> f32 {
    let h = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (h[0] + h[2]) + (h[1] + h[3])
}

/// Dot products of one query row with 4 key rows, all of length head_dim: one 8-lane
/// accumulator per key over the 8-element chunks (the query chunk loaded once for all keys), a
/// scalar tail for `d % 8`, and one horizontal sum per key.
///
/// The shape of this loop matters to LLVM: a zip of whole chunks with one accumulator per key
/// keeps each accumulator in a vector register along head_dim. The `black_box` keeps the final
/// horizontal sums from being vectorised across keys, which LLVM otherwise does by rebuilding
/// the whole loop across keys, with shuffles. (Index loops over several query rows at once, or
/// chunks copied into local arrays, end up scalar or shuffled the same way.)
#[inline(always)]
pub(crate) fn dot_row4<const FMA: bool>(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let mut acc = [[0.0f32; 8]; 4];
    let chunks = q.chunks_exact(8).zip(k[0].chunks_exact(8)).zip(k[1].chunks_exact(8));
    let chunks = chunks.zip(k[2].chunks_exact(8)).zip(k[3].chunks_exact(8));
    for ((((x, y0), y1), y2), y3) in chunks {
        for (t, y) in [y0, y1, y2, y3].into_iter().enumerate() {
            for l in 0..8 {
                acc[t][l] = fma::<FMA>(x[l], y[l], acc[t][l]);
            }
        }
    }
    let acc = std::hint::black_box(acc);
    let mut out: [f32; 4] = std::array::from_fn(|t| hsum8(acc[t]));
    let n8 = q.len() / 8 * 8;
    if n8 < q.len() {
        for (t, o) in out.iter_mut().enumerate() {
            *o += q[n8..]
                .iter()
                .zip(&k[t][n8..])
                .fold(0.0, |a, (x, y)| fma::<FMA>(*x, *y, a));
        }
    }
    out
}

/// [`dot_row4`] for one key.
#[inline(always)]
pub(crate) fn dot_row1<const FMA: bool>(q: &[f32], k: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = fma::<FMA>(x[l], y[l], acc[l]);
        }
    }
    let n8 = q.len() / 8 * 8;
    hsum8(acc)
        + q[n8..]
            .iter()
            .zip(&k[n8..])
            .fold(0.0, |a, (x, y)| fma::<FMA>(*x, *y, a))
}

/// Dot product of an f32 query row with a K row stored as `T`, widened on the fly: 16 lanes
/// along head_dim, one horizontal sum, a scalar tail for `d % 16`.
#[inline(always)]
pub(crate) fn dot_widen<const FMA: bool, T: Widen>(q: &[f32], k: &[T]) -> f32 {
    let mut acc = [0.0f32; 16];
    for (x, y) in q.chunks_exact(16).zip(k.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] = fma::<FMA>(x[l], y[l].widen(), acc[l]);
        }
    }
    // As in `dot_row4`: without the `black_box` LLVM rebuilds the loop around the horizontal
    // sum, in 2-lane pieces (seen in the assembly: `vmovsd` loads, one `xmm` FMA per 2 lanes).
    let acc = std::hint::black_box(acc);
    let n16 = q.len() / 16 * 16;
    let tail = q[n16..].iter().zip(&k[n16..]).fold(0.0, |a, (x, y)| fma::<FMA>(*x, y.widen(), a));
    let h: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
    hsum8(h) + tail
}

/// `s[t][l] = q_l · k_t` for the panel's `nl` query rows and the chunk's keys `krows`, four keys
/// at a time (their rows stay in L1 while every query row passes over them).
#[inline(always)]
pub(crate) fn qk_panel<const FMA: bool>(q: &[f32], d: usize, nl: usize, krows: &[&[f32]], s: &mut [[f32; NR]]) {
    let mut t0 = 0;
    while t0 < krows.len() {
        if t0 + 4 <= krows.len() {
            let kr: [&[f32]; 4] = std::array::from_fn(|t| &krows[t0 + t][..d]);
            for l in 0..nl {
                let sums = dot_row4::<FMA>(&q[l * d..(l + 1) * d], kr);
                for (t, &x) in sums.iter().enumerate() {
                    s[t0 + t][l % NR] = x;
                }
            }
            t0 += 4;
        } else {
            let kr = &krows[t0][..d];
            for l in 0..nl {
                s[t0][l % NR] = dot_row1::<FMA>(&q[l * d..(l + 1) * d], kr);
            }
            t0 += 1;
        }
    }
}

/// `o_{l0 + r}[x..x + W] += Σ_t p[t][l0 + r] · v_t[x..x + W]` for `NQ` rows: `NQ × W`
/// accumulators held over all keys of the chunk. `SKIP`: a zero probability (a key the row does
/// not see) contributes nothing even when V is infinite or NaN (`0 · inf` is NaN), so a key's V
/// reaches only the rows that see it; used on chunks where some row does not see some key.
#[inline(always)]
pub(crate) fn pv_strip<const NQ: usize, const W: usize, const FMA: bool, const SKIP: bool>(
    o: &mut [f32],
    d: usize,
    x: usize,
    l0: usize,
    p: &[[f32; NR]],
    vrows: &[&[f32]],
) {
    let mut acc: [[f32; W]; NQ] = std::array::from_fn(|r| load::<W>(o, (l0 + r) * d + x));
    for (pt, vt) in p.iter().zip(vrows) {
        let vc = load::<W>(vt, x);
        let pr: [f32; NQ] = std::array::from_fn(|r| pt[(l0 + r) % NR]);
        for r in 0..NQ {
            let t = fma_lanes::<W, FMA>([pr[r]; W], vc, acc[r]);
            acc[r] = if SKIP && pr[r] == 0.0 { acc[r] } else { t };
        }
    }
    for (r, a) in acc.iter().enumerate() {
        o[(l0 + r) * d + x..][..W].copy_from_slice(a);
    }
}

#[inline(always)]
pub(crate) fn pv_rows<const NQ: usize, const FMA: bool, const SKIP: bool>(
    o: &mut [f32],
    d: usize,
    l0: usize,
    p: &[[f32; NR]],
    vrows: &[&[f32]],
) {
    let mut x = 0;
    while x + 16 <= d {
        pv_strip::<NQ, 16, FMA, SKIP>(o, d, x, l0, p, vrows);
        x += 16;
    }
    if x + 8 <= d {
        pv_strip::<NQ, 8, FMA, SKIP>(o, d, x, l0, p, vrows);
        x += 8;
    }
    while x < d {
        pv_strip::<NQ, 1, FMA, SKIP>(o, d, x, l0, p, vrows);
        x += 1;
    }
}

/// `O += P·V` for the panel's `nl` rows, 4, 2 or 1 at a time.
#[inline(always)]
pub(crate) fn pv_panel<const FMA: bool, const SKIP: bool>(o: &mut [f32], d: usize, nl: usize, p: &[[f32; NR]], vrows: &[&[f32]]) {
    let mut r = 0;
    while r < nl {
        if nl - r >= 4 {
            pv_rows::<4, FMA, SKIP>(o, d, r, p, vrows);
            r += 4;
        } else if nl - r >= 2 {
            pv_rows::<2, FMA, SKIP>(o, d, r, p, vrows);
            r += 2;
        } else {
            pv_rows::<1, FMA, SKIP>(o, d, r, p, vrows);
            r += 1;
        }
    }
}

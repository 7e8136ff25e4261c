//! Rows in and out of the tiled path's panel layouts in AVX-512 instructions: Q rows into Qᵀ
//! panels, K and V rows into packed strips, Oᵀ panels out to rows (register transposes).
#![allow(clippy::incompatible_msrv)]

#[cfg(target_arch = "x86_64")]
use super::lanes::{first_lanes, load_columns, transpose16};
use crate::cpu::gemm::{MR, NR};

/// Rows `0..n` of one Oᵀ panel (`op`: `[head_dim_pad >= d][NR]`, query `r` in lane `r`) as the
/// `n = out.len()` rows `out[r]` (each `d` f32, n <= 16; anywhere: the caller's own output rows,
/// a row stride apart), each multiplied by `inv[r]`, or 0 where bit `r` of `live` is clear:
/// exactly `op[x·16 + r] · inv[r]` per element, in 16×16 blocks transposed in registers rather
/// than read with a 16-float stride.
///
/// `false` when this CPU lacks AVX-512F (the caller then writes the rows itself).
#[inline]
pub(crate) fn write_panel_rows(op: &[f32], inv: &[f32; NR], live: u16, d: usize, out: &mut [&mut [f32]]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected on this CPU, the only requirement of
        // `write_panel_rows_avx512` (its slice lengths it checks itself).
        unsafe { write_panel_rows_avx512(op, inv, live, d, out) };
        return true;
    }
    let _ = (op, inv, live, d, out);
    false
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn write_panel_rows_avx512(op: &[f32], inv: &[f32; NR], live: u16, d: usize, out: &mut [&mut [f32]]) {
    use std::arch::x86_64::*;
    assert!(out.len() <= NR && out.iter().all(|r| r.len() == d) && op.len() >= d * NR);
    // SAFETY: `inv` is 16 f32.
    let invv = unsafe { _mm512_loadu_ps(inv.as_ptr()) };
    // Floats from the 64-byte line the rows start in to their start, when it is the same for
    // every row (rows a multiple of 16 f32 apart, as the output rows of a head_dim that is one):
    // then the 16-column blocks start that far before column 0, so that each store fills whole
    // lines of the rows, where a 16-float store from column 0 spans two lines of every row (a
    // large allocation from glibc often starts 16 bytes past a line) and the rows' lines miss the
    // cache: one miss per store, not two, for one more block.
    let lead_of = |r: &&mut [f32]| r.as_ptr() as usize / 4 % NR;
    let lead = out.first().map_or(0, lead_of);
    let lead = if out.iter().all(|r| lead_of(r) == lead) { lead as isize } else { 0 };
    let d = d as isize;
    let mut x0 = -lead;
    while x0 < d {
        // Vector k: column x0 + k of the 16 queries, scaled (0 outside the head dim, or not live).
        let mut m = [_mm512_setzero_ps(); NR];
        for (x, mk) in (x0..).zip(m.iter_mut()) {
            if (0..d).contains(&x) {
                let src = &op[x as usize * NR..(x as usize + 1) * NR];
                // SAFETY: `src` is 16 f32.
                *mk = _mm512_maskz_mul_ps(live, unsafe { _mm512_loadu_ps(src.as_ptr()) }, invv);
            }
        }
        let rows = transpose16(m);
        // Lanes k with 0 <= x0 + k < d (x0 >= -15).
        let before = ((1u32 << (-x0).max(0)) - 1) as u16;
        let mask = first_lanes((d - x0) as usize) & !before;
        for (row, dst) in rows.iter().zip(out.iter_mut()) {
            // SAFETY: the mask enables exactly the lanes k whose column x0 + k lies in 0..d,
            // inside `dst` (masked lanes are neither read nor written, whatever their address).
            unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr().wrapping_offset(x0), mask, *row) };
        }
        x0 += NR as isize;
    }
}

/// Where lane `l` of output vector `j` of [`pack_strip`] comes from: float `f = 16j + l` of
/// the 96 a 16-column block of six rows packs to is column `x = f / 6` of row `i = f % 6`, taken
/// from the pair of rows `i / 2` as index `x + 16·(i % 2)` (the second of the pair's rows).
const PACK_IDX: [[i32; NR]; MR] = {
    let mut idx = [[0; NR]; MR];
    let mut f = 0;
    while f < NR * MR {
        idx[f / NR][f % NR] = ((f / MR) + NR * (f % MR % 2)) as i32;
        f += 1;
    }
    idx
};

/// The lanes of output vector `j` of [`pack_strip`] that come from the pair of rows `p`.
const PACK_PAIR: [[u16; MR / 2]; MR] = {
    let mut m = [[0; MR / 2]; MR];
    let mut f = 0;
    while f < NR * MR {
        m[f / NR][f % MR / 2] |= 1 << (f % NR);
        f += 1;
    }
    m
};

/// A strip of six key rows (`rows`, each at least `d` f32; the missing ones `ZEROS`) packed
/// column by column, the micro-kernel's A operand: `dst[x·6 + i] = rows[i][x]` for `x < d`, 16
/// columns (96 floats, six vectors) at a time from three two-source permutes per vector where
/// the scalar loop moves one float per load and store. `false` when this CPU lacks AVX-512F
/// (the caller then runs its scalar loop).
#[inline]
pub(crate) fn pack_strip(rows: &[&[f32]; MR], d: usize, dst: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected on this CPU, the only requirement of
        // `pack_strip_avx512` (its slice lengths it checks itself).
        unsafe { pack_strip_avx512(rows, d, dst) };
        return true;
    }
    let _ = (rows, d, dst);
    false
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn pack_strip_avx512(rows: &[&[f32]; MR], d: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(dst.len() >= d * MR && rows.iter().all(|r| r.len() >= d));
    // SAFETY (both): each array is 16 i32.
    let idx: [__m512i; MR] = std::array::from_fn(|j| unsafe { _mm512_loadu_si512(PACK_IDX[j].as_ptr().cast()) });
    let mut x0 = 0;
    while x0 < d {
        let w = (d - x0).min(NR);
        // SAFETY: every row holds at least `d ≥ x0 + w` f32 (asserted above).
        let r = unsafe { load_columns(rows, x0, w) };
        let out = &mut dst[x0 * MR..(x0 + w) * MR];
        for (j, ix) in idx.iter().enumerate() {
            let (lo, n) = (j * NR, (w * MR).saturating_sub(j * NR).min(NR));
            if n == 0 {
                break;
            }
            let [p0, p1, p2] = PACK_PAIR[j];
            let v = _mm512_maskz_permutex2var_ps(p0, r[0], *ix, r[1]);
            let v = _mm512_mask_blend_ps(p1, v, _mm512_permutex2var_ps(r[2], *ix, r[3]));
            let v = _mm512_mask_blend_ps(p2, v, _mm512_permutex2var_ps(r[4], *ix, r[5]));
            let keep = first_lanes(n);
            let o = &mut out[lo..lo + n];
            // SAFETY: `o` holds `n` f32 and the mask enables only the first `n` lanes (masked
            // lanes are neither read nor written).
            unsafe { _mm512_mask_storeu_ps(o.as_mut_ptr(), keep, v) };
        }
        x0 += NR;
    }
}

/// A strip of six rows of V (`rows`, each at least `d` f32; the missing ones `ZEROS`) into
/// the micro-kernel's A operand of the second product: column strip `c` (columns `6c..6c + 6`)
/// of key `i` at `dst[c·stride + 6i..][..6]`, the columns past `d` of the last column strip
/// written as 0. One masked load and one masked store per six floats, where the scalar copy
/// branched on each strip's width. Returns whether every value packed is finite (`x · 0` summed
/// is 0 exactly then, as in `cpu::all_finite`; taken while the values are in registers, where a
/// pass over the packed V read them all again), or `None` when this CPU lacks AVX-512F (the
/// caller then runs its scalar loop).
#[inline]
pub(crate) fn pack_v_strip(rows: &[&[f32]; MR], d: usize, dst: &mut [f32], stride: usize) -> Option<bool> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected on this CPU, the only requirement of
        // `pack_v_strip_avx512` (its slice lengths it checks itself).
        return Some(unsafe { pack_v_strip_avx512(rows, d, dst, stride) });
    }
    let _ = (rows, d, dst, stride);
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn pack_v_strip_avx512(rows: &[&[f32]; MR], d: usize, dst: &mut [f32], stride: usize) -> bool {
    use std::arch::x86_64::*;
    let strips = d.div_ceil(MR);
    assert!(rows.iter().all(|r| r.len() >= d) && stride >= MR * MR);
    assert!(strips == 0 || dst.len() >= (strips - 1) * stride + MR * MR);
    const SIX: __mmask16 = (1 << MR) - 1;
    let zero = _mm512_setzero_ps();
    let mut acc = zero;
    for c in 0..strips {
        let w = (d - c * MR).min(MR);
        let load: __mmask16 = (1 << w) - 1;
        let out = &mut dst[c * stride..c * stride + MR * MR];
        for (row, key) in rows.iter().zip(out.chunks_exact_mut(MR)) {
            // SAFETY: `row` holds at least `c·6 + w` f32 (`d` of them) and the mask enables only
            // the first `w` lanes (masked lanes are not read); `key` holds 6 f32 and the store
            // writes the first 6 lanes only.
            let x = unsafe { _mm512_maskz_loadu_ps(load, row.as_ptr().add(c * MR)) };
            // SAFETY: as above.
            unsafe { _mm512_mask_storeu_ps(key.as_mut_ptr(), SIX, x) };
            acc = _mm512_fmadd_ps(x, zero, acc);
        }
    }
    _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(acc, zero) == 0
}

/// The Qᵀ panel of up to 16 query rows (`rows`, each `d` f32; the missing ones `ZEROS`):
/// `dst[x * NR + lane] = rows[lane][x]`, 16×16 blocks transposed in registers (`transpose16`)
/// where the scalar loop moves one float per load and store. `false` when this CPU lacks
/// AVX-512F (the caller then runs its scalar loop).
#[inline]
pub(crate) fn fill_panel(rows: &[&[f32]; NR], d: usize, dst: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected on this CPU, the only requirement of
        // `fill_panel_avx512` (its slice lengths it checks itself).
        unsafe { fill_panel_avx512(rows, d, dst) };
        return true;
    }
    let _ = (rows, d, dst);
    false
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fill_panel_avx512(rows: &[&[f32]; NR], d: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(dst.len() >= d * NR && rows.iter().all(|r| r.len() >= d));
    let mut x0 = 0;
    while x0 < d {
        let w = (d - x0).min(NR);
        // SAFETY: every row holds at least `d ≥ x0 + w` f32 (asserted above).
        let cols = transpose16(unsafe { load_columns(rows, x0, w) });
        for (k, col) in cols.iter().enumerate().take(w) {
            let out = &mut dst[(x0 + k) * NR..(x0 + k + 1) * NR];
            // SAFETY: `out` is 16 f32.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *col) };
        }
        x0 += NR;
    }
}

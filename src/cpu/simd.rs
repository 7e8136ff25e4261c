//! The CPU backend's explicit instructions (`std::arch`), in one place.
//!
//! The AVX-512 intrinsics are stable since Rust 1.89, as are the `avx512f` target features the
//! tiled path's AVX-512 build already enables (`cpu/mod.rs`): the crate needs 1.89 whatever
//! `rust-version` says, hence the `incompatible_msrv` allowance below.
#![allow(clippy::incompatible_msrv)]

/// Asks for the cache line holding `p` to be brought into L1 (a hint: no memory is read
/// architecturally, any address is allowed, nothing happens on other architectures).
#[inline(always)]
pub(crate) fn prefetch(p: *const i8) {
    prefetch_hint::<true>(p)
}

/// As [`prefetch`], into L2 only: for data read a whole work item later, which would only
/// crowd the L1 that the current item's panels live in.
#[inline(always)]
pub(crate) fn prefetch_l2(p: *const i8) {
    prefetch_hint::<false>(p)
}

#[inline(always)]
fn prefetch_hint<const L1: bool>(p: *const i8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has (it is part of the
        // x86_64 baseline the crate is compiled for); a prefetch never faults, whatever the address.
        unsafe {
            if L1 {
                _mm_prefetch::<_MM_HINT_T0>(p)
            } else {
                _mm_prefetch::<_MM_HINT_T1>(p)
            }
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

use super::gemm::{MR, NR};
use super::softmax::RowState;

/// The online softmax of one `[keys][NR]` score panel with the native arithmetic (`cpu::Native`:
/// the degree-5 `exp2_fast`, no P offset, no P rounding, eager rescaling): the panel max, the
/// rescale factors (returned), the probabilities in place and the updated row states, bit for
/// bit what `panel_max`, `panel_scales` and `online_softmax::<Native, true>` compute, in fewer
/// instructions: `exp2_fast` there is 18 vector operations per 16 scores (two clamps, floor,
/// the exponent built from bits and multiplied in), here 12 (`vscalefps` multiplies by
/// `2^floor(x)` and a mask zeroes what is below `2^-126`, as `exp2_fast`'s clamp does). With 512-bit vectors every vector operation shares the two FMA
/// ports with the products, so each operation the softmax saves goes to the products.
///
/// `tile_max`: the panel's `panel_max`, when the product already took it (`product_max`); it is
/// then not taken again.
///
/// `None` when this CPU lacks AVX-512F (the caller then runs the generic verbs).
#[inline]
pub(crate) fn native_softmax(
    states: &mut [RowState],
    panel: &mut [f32],
    c: f32,
    tile_max: Option<&[f32; NR]>,
) -> Option<[f32; NR]> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected on this CPU, the only requirement of
        // `native_softmax_avx512` (its slice lengths it checks itself).
        return Some(unsafe { native_softmax_avx512(states, panel, c, tile_max) });
    }
    let _ = (states, panel, c, tile_max);
    None
}

/// `2^a` for `a <= 0` (NaN propagates), 16 lanes: exactly `cpu::exp2_fast` lane by lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp2_neg_avx512(a: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use crate::numerics::exp2::POLY_EX2;
    use std::arch::x86_64::*;
    let c = POLY_EX2[5];
    // Below -126 `exp2_fast` gives exactly 0 (its 2^floor(a) has a zero exponent field); NaN
    // compares "not less" and stays in.
    let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(a, _mm512_set1_ps(-126.0));
    // a − floor(a) in [0, 1), rounded to nearest as `exp2_fast` does (`vreduceps` would round
    // this difference down: one ulp apart at times).
    let f = _mm512_sub_ps(a, _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(a));
    // The shared degree-5 polynomial, Horner with FMAs, as `numerics::exp2::poly_frac::<5>`.
    let mut p = _mm512_set1_ps(c[5]);
    for &ci in c[..5].iter().rev() {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ci));
    }
    // p · 2^floor(a): exact (the result is a normal float for a >= -126).
    _mm512_maskz_scalef_ps(keep, p, a)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn native_softmax_avx512(
    states: &mut [RowState],
    panel: &mut [f32],
    c: f32,
    tile_max: Option<&[f32; NR]>,
) -> [f32; NR] {
    use std::arch::x86_64::*;
    assert!(states.len() >= NR && panel.len().is_multiple_of(NR));
    let load = |x: &[f32]| {
        // SAFETY: `x` holds at least 16 f32 (every caller passes a 16-lane panel row).
        unsafe { _mm512_loadu_ps(x[..NR].as_ptr()) }
    };
    let tile_max = match tile_max {
        Some(m) => load(m),
        None => running_max(_mm512_set1_ps(f32::NEG_INFINITY), panel.chunks_exact(NR).map(load)),
    };
    let m_old: [f32; NR] = std::array::from_fn(|q| states[q].m);
    let l_old: [f32; NR] = std::array::from_fn(|q| states[q].l);
    let (m_old, l_old) = (load(&m_old), load(&l_old));
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    // `max_get_scale` without a lazy threshold: the max grows where the tile max is above it
    // (false for a NaN tile max); a first visible key sets it with nothing to rescale.
    let grows = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(tile_max, m_old);
    let first = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(m_old, ninf);
    let cv = _mm512_set1_ps(c);
    let growth = _mm512_mul_ps(_mm512_sub_ps(tile_max, m_old), cv);
    let factor = exp2_neg_avx512(_mm512_sub_ps(_mm512_setzero_ps(), growth));
    let scales = _mm512_mask_blend_ps(grows & !first, _mm512_set1_ps(1.0), factor);
    let m_new = _mm512_mask_blend_ps(grows, m_old, tile_max);
    // The −inf guard of `online_softmax`: a query with no visible key yet shifts by 0.
    let shift = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_EQ_OQ>(m_new, ninf), m_new, _mm512_setzero_ps());
    let zero = _mm512_setzero_ps();
    let mut sum = _mm512_setzero_ps();
    for row in panel.chunks_exact_mut(NR) {
        // (x − m)·c + 0 (the FMA of `online_softmax` with a zero offset), then 2^that.
        let p = exp2_neg_avx512(_mm512_fmadd_ps(_mm512_sub_ps(load(row), shift), cv, zero));
        sum = _mm512_add_ps(sum, p);
        // SAFETY: `row` is 16 f32 (`chunks_exact_mut(NR)`).
        unsafe { _mm512_storeu_ps(row.as_mut_ptr(), p) };
    }
    // l · scale + sum, two roundings as in `online_softmax`.
    let l_new = _mm512_add_ps(_mm512_mul_ps(l_old, scales), sum);
    let (mut m_out, mut l_out, mut sc) = ([0.0f32; NR], [0.0f32; NR], [0.0f32; NR]);
    // SAFETY: each destination is an array of 16 f32.
    unsafe {
        _mm512_storeu_ps(m_out.as_mut_ptr(), m_new);
        _mm512_storeu_ps(l_out.as_mut_ptr(), l_new);
        _mm512_storeu_ps(sc.as_mut_ptr(), scales);
    }
    for (q, st) in states[..NR].iter_mut().enumerate() {
        *st = RowState { m: m_out[q], l: l_out[q] };
    }
    sc
}

/// `panel_max` folded over more rows, in their order: `max_ps(row, acc)` returns `acc` when
/// `row` is NaN (`panel_max` skips it) and when both are zeros (`panel_max` keeps the first), so
/// the result is `panel_max`'s bit for bit, sign of a zero included.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn running_max(
    mut acc: std::arch::x86_64::__m512,
    rows: impl Iterator<Item = std::arch::x86_64::__m512>,
) -> std::arch::x86_64::__m512 {
    for row in rows {
        acc = std::arch::x86_64::_mm512_max_ps(row, acc);
    }
    acc
}

/// The first product for `N` (1 to 4) query panels over one key tile, with the softmax's max
/// pass fused in: `s[t] = k·b[t]`, where `k` holds the tile's strips of `MR` keys of K (`kc`
/// steps of `MR` each, `kc` = head_dim; packed, or the key rows in place: see [`KTile`]), `b[t]`
/// is a Qᵀ panel (`kc` rows of `NR`) and `s[t]` the `[keys][NR]` scores, each strip exactly
/// `gemm::micro_kernel` (`_x2`) from zero; and `tile_max[t]` folded over the first `keys` score
/// rows in key order, as `panel_max` over them: taken while the scores are still in registers,
/// where the softmax would read them back in a chain of dependent maxes (`keys` short of the
/// tile: the padding keys of the last strip, which the mask then sets to −inf, no-ops of the
/// max). One call per tile (not per strip): the strips' loop is in here.
///
/// `false` when this CPU lacks AVX-512F (the caller then runs those).
#[inline(always)]
pub(crate) fn product_max<const N: usize>(
    k: KTile<'_>,
    b: [&[f32]; N],
    s: [&mut [f32]; N],
    (tile_max, keys): ([&mut [f32; NR]; N], usize),
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected on this CPU, the only requirement of
        // `product_max_avx512` (its slice lengths it checks itself).
        unsafe { product_max_avx512::<N>(k, b, s, (tile_max, keys)) };
        return true;
    }
    let _ = (k, b, s, tile_max, keys);
    false
}

// Indexed loops with constant bounds over the accumulators: unrolled, the arrays kept in registers.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn product_max_avx512<const N: usize>(
    k: KTile<'_>,
    b: [&[f32]; N],
    s: [&mut [f32]; N],
    (tile_max, keys): ([&mut [f32; NR]; N], usize),
) {
    use std::arch::x86_64::*;
    let kc = b[0].len() / NR;
    let strips = s[0].len() / (MR * NR);
    for t in 0..N {
        assert!(b[t].len() >= kc * NR && s[t].len() >= strips * MR * NR);
    }
    match k {
        KTile::Packed(k) => assert!(k.len() >= strips * kc * MR),
        KTile::Rows { data, at, stride, keys, zeros } => {
            let end = keys.checked_sub(1).map(|j| j.checked_mul(stride).and_then(|x| x.checked_add(at + kc)));
            assert!(zeros.len() >= kc && end.is_none_or(|e| e.is_some_and(|e| e <= data.len())));
        }
    }
    let bp: [*const f32; N] = std::array::from_fn(|t| b[t].as_ptr());
    let mut mx = [_mm512_setzero_ps(); N];
    for t in 0..N {
        // SAFETY: `tile_max[t]` is 16 f32.
        mx[t] = unsafe { _mm512_loadu_ps(tile_max[t].as_ptr()) };
    }
    for st in 0..strips {
        let mut acc = [[_mm512_setzero_ps(); MR]; N];
        match k {
            KTile::Packed(k) => {
                let a = &k[st * kc * MR..(st + 1) * kc * MR];
                // SAFETY: `a` is `kc` steps of MR and every `b[t]` holds `kc` rows of 16 (checked above).
                unsafe { strip_fma::<N, false, MR>(a, bp, &mut acc) };
            }
            KTile::Rows { data, at, stride, keys, zeros } => {
                let rows: [*const f32; MR] = std::array::from_fn(|i| {
                    let j = st * MR + i;
                    if j < keys {
                        data.as_ptr().wrapping_add(at + j * stride)
                    } else {
                        zeros.as_ptr()
                    }
                });
                // SAFETY: key `j < keys` starts at `at + j·stride`, `kc` f32 from the end of `data`
                // at the latest, and `zeros` holds `kc` f32 (both checked above); every `b[t]`
                // holds `kc` rows of 16 (checked above).
                unsafe { strip_fma_rows::<N>(rows, kc, bp, &mut acc) };
            }
        }
        for t in 0..N {
            for i in 0..MR {
                // SAFETY: `s[t]` holds `strips` blocks of MR rows of 16 (checked above).
                unsafe { _mm512_storeu_ps(s[t].as_mut_ptr().add((st * MR + i) * NR), acc[t][i]) };
            }
            // Rows past `keys` (the last strip's padding only) are left out.
            let rows = keys.saturating_sub(st * MR).min(MR);
            mx[t] = running_max(mx[t], acc[t].into_iter().take(rows));
        }
    }
    for t in 0..N {
        let m = &mut *tile_max[t];
        // SAFETY: `m` is 16 f32.
        unsafe { _mm512_storeu_ps(m.as_mut_ptr(), mx[t]) };
    }
}

/// One strip of the micro-kernel in AVX-512 registers: `acc[t][i] += a[step·MR + i] · b[t][step]`
/// for `i < R` (the strip's rows past `R`, padding, left alone) over the `a.len() / MR` steps, `b[t]` a panel of 16-float rows at `bp[t]` (`SKIP`: only where
/// that element of `b[t]` is not 0, NaN included, as `b != 0` in `gemm::micro_kernel_skip_zero_b`):
/// `gemm::micro_kernel` (`_x2`), the same FMAs in the same order. Inlined into both products.
///
/// # Safety
/// Every `bp[t]` points to at least `a.len() / MR` rows of 16 readable f32.
// Indexed loops with constant bounds over the accumulators: unrolled, the arrays kept in registers.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn strip_fma<const N: usize, const SKIP: bool, const R: usize>(
    a: &[f32],
    bp: [*const f32; N],
    acc: &mut [[std::arch::x86_64::__m512; MR]; N],
) {
    use std::arch::x86_64::*;
    for (step, ak) in a.chunks_exact(MR).enumerate() {
        let mut bv = [_mm512_setzero_ps(); N];
        for t in 0..N {
            // SAFETY: `step < a.len() / MR`, within the rows the caller vouches for.
            bv[t] = unsafe { _mm512_loadu_ps(bp[t].add(step * NR)) };
        }
        for (i, &ai) in ak[..R].iter().enumerate() {
            let ai = _mm512_set1_ps(ai);
            for t in 0..N {
                acc[t][i] = if SKIP {
                    let nz = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(bv[t], _mm512_setzero_ps());
                    _mm512_mask3_fmadd_ps(ai, bv[t], acc[t][i], nz)
                } else {
                    _mm512_fmadd_ps(ai, bv[t], acc[t][i])
                };
            }
        }
    }
}

/// [`strip_fma`] (`SKIP` false, all `MR` rows) with the A operand read from six rows in place:
/// at step `x` the broadcasts are `rows[i][x]`, where the packed strip holds the same values at
/// `a[x·MR + i]`; the same FMAs in the same order.
///
/// # Safety
/// Every `rows[i]` points to at least `kc` readable f32 and every `bp[t]` to at least `kc` rows
/// of 16.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn strip_fma_rows<const N: usize>(
    rows: [*const f32; MR],
    kc: usize,
    bp: [*const f32; N],
    acc: &mut [[std::arch::x86_64::__m512; MR]; N],
) {
    use std::arch::x86_64::*;
    for step in 0..kc {
        let mut bv = [_mm512_setzero_ps(); N];
        for t in 0..N {
            // SAFETY: `step < kc`, within the rows the caller vouches for.
            bv[t] = unsafe { _mm512_loadu_ps(bp[t].add(step * NR)) };
        }
        for i in 0..MR {
            // SAFETY: `step < kc`, within the row the caller vouches for.
            let ai = _mm512_set1_ps(unsafe { *rows[i].add(step) });
            for t in 0..N {
                acc[t][i] = _mm512_fmadd_ps(ai, bv[t], acc[t][i]);
            }
        }
    }
}

/// The K operand of the first product over one key tile: packed strips, or an f32 input's key
/// rows read in place (no packing pass: the first product only broadcasts K's elements, one per
/// key and depth step, which it can take from each key's row as well as from a packed strip).
#[derive(Clone, Copy)]
pub(crate) enum KTile<'a> {
    /// Strips of `MR` keys, `[strips][kc][MR]` (`gemm::micro_kernel`'s A operand).
    Packed(&'a [f32]),
    /// Key `j` of the tile at `data[at + j·stride..][..kc]` for `j < keys`; the keys past them
    /// (the last strip's padding) are `zeros` (at least `kc` zeros), as the packed strip's are.
    Rows { data: &'a [f32], at: usize, stride: usize, keys: usize, zeros: &'a [f32] },
}

impl<'a> KTile<'a> {
    /// The tile's first `strips` strips packed (`[strips][kc][MR]`): the packed slice itself, or
    /// the rows gathered into `buf` (for the kernels that take only the packed form).
    pub(crate) fn packed<'b>(&self, strips: usize, kc: usize, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        'a: 'b,
    {
        match self {
            KTile::Packed(k) => &k[..strips * kc * MR],
            &KTile::Rows { data, at, stride, keys, zeros } => {
                // Key `j`'s first `kc` elements, zeros past the tile's keys.
                let row = |j: usize| if j < keys { &data[at + j * stride..][..kc] } else { &zeros[..kc] };
                buf.clear();
                buf.resize(strips * kc * MR, 0.0);
                for (st, strip) in buf.chunks_exact_mut(kc * MR).enumerate() {
                    for i in 0..MR {
                        let row = row(st * MR + i);
                        strip.iter_mut().skip(i).step_by(MR).zip(row).for_each(|(d, &x)| *d = x);
                    }
                }
                buf
            }
        }
    }
}

/// The second product over one key tile with the rescale fused into its accumulator loads, for
/// `N` (1 to 4) query panels: `o[t] = o[t]·diag(sc[t]) + Vᵀ·b[t]`, `o[t]` an Oᵀ panel (blocks
/// of `[MR][NR]`), `b[t]` the tile's Pᵀ (`kc` rows of `NR`), and strip `ds` of `v` (6 columns
/// of V, `kc` steps of `MR`) starting at `ds · stride`, of which the first `cols` columns are
/// V's: the rows of `o[t]` past them (padding) are only rescaled, so that the last strip at a
/// head_dim short of a multiple of 6 runs the FMAs of its real columns only. The accumulators are loaded from and
/// stored to the panel directly, in registers in between: exactly `rescale_o` then
/// `gemm::micro_kernel` (`_x2`, `SKIP`: `_skip_zero_b`) element by element, the same FMAs in
/// the same order. One call per tile: the strips' loop is in here.
///
/// `false` when this CPU lacks AVX-512F (the caller then runs those).
#[inline(always)]
pub(crate) fn scaled_product<const N: usize, const SKIP: bool>(
    (v, stride, cols): (&[f32], usize, usize),
    b: [&[f32]; N],
    o: [&mut [f32]; N],
    sc: [&[f32; NR]; N],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected on this CPU, the only requirement of
        // `scaled_product_avx512` (its slice lengths it checks itself).
        unsafe { scaled_product_avx512::<N, SKIP>((v, stride, cols), b, o, sc) };
        return true;
    }
    let _ = (v, stride, cols, b, o, sc);
    false
}

// Indexed loops with constant bounds over the accumulators: unrolled, the arrays kept in registers.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn scaled_product_avx512<const N: usize, const SKIP: bool>(
    (v, stride, cols): (&[f32], usize, usize),
    b: [&[f32]; N],
    o: [&mut [f32]; N],
    sc: [&[f32; NR]; N],
) {
    use std::arch::x86_64::*;
    let kc = b[0].len() / NR;
    let strips = o[0].len() / (MR * NR);
    for t in 0..N {
        assert!(b[t].len() >= kc * NR && o[t].len() >= strips * MR * NR);
    }
    assert!(strips == 0 || (strips - 1) * stride + kc * MR <= v.len());
    let bp: [*const f32; N] = std::array::from_fn(|t| b[t].as_ptr());
    let mut scv = [_mm512_setzero_ps(); N];
    for t in 0..N {
        // SAFETY: `sc[t]` is 16 f32.
        scv[t] = unsafe { _mm512_loadu_ps(sc[t].as_ptr()) };
    }
    for ds in 0..strips {
        let a = &v[ds * stride..ds * stride + kc * MR];
        let rows = cols.saturating_sub(ds * MR).min(MR);
        let mut acc = [[_mm512_setzero_ps(); MR]; N];
        for t in 0..N {
            for i in 0..MR {
                // SAFETY: `o[t]` holds `strips` blocks of MR rows of 16 (checked above).
                let x = unsafe { _mm512_loadu_ps(o[t].as_ptr().add((ds * MR + i) * NR)) };
                acc[t][i] = _mm512_mul_ps(x, scv[t]);
            }
        }
        // SAFETY: `a` is `kc` steps of MR and every `b[t]` holds `kc` rows of 16 (checked above).
        unsafe {
            match rows {
                // Two to four panels: 4 to 16 accumulators keep the FMA ports as busy as 12 to
                // 24 do (a step is the FMA latency, not 6 to 12 cycles); one panel's 2 or 4
                // would not.
                2 if N >= 2 => strip_fma::<N, SKIP, 2>(a, bp, &mut acc),
                4 if N >= 2 => strip_fma::<N, SKIP, 4>(a, bp, &mut acc),
                _ => strip_fma::<N, SKIP, MR>(a, bp, &mut acc),
            }
        };
        for t in 0..N {
            for i in 0..MR {
                // SAFETY: `o[t]` holds `strips` blocks of MR rows of 16 (checked above).
                unsafe { _mm512_storeu_ps(o[t].as_mut_ptr().add((ds * MR + i) * NR), acc[t][i]) };
            }
        }
    }
}

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

/// The lane-wise end of `softmax::finalize_panel` for `n = lse.len()` (≤ 16) queries: from the
/// sums `l`, maxima `m` and `log2_l` (libm's `log2` of each `l`, computed by the caller), `inv =
/// 1 / l` and `lse = m·u + (log2_l − off)·ln 2` (four roundings, in `lse_of`'s order), each 0 and
/// −inf where `l == 0`; returns the mask of the first `n` lanes whose `l` is not 0. Bit for bit
/// the scalar loop, which the compiler left scalar (a division and two branches per lane, the
/// LSEs then copied by a call to `memcpy`). `None` when this CPU lacks AVX-512F.
#[inline]
pub(crate) fn finalize_lanes(
    (l, m, log2_l): (&[f32; NR], &[f32; NR], &[f32; NR]),
    (u, off): (f32, f32),
    inv: &mut [f32; NR],
    lse: &mut [f32],
) -> Option<u16> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected on this CPU, the only requirement of
        // `finalize_lanes_avx512` (its slice lengths it checks itself).
        return Some(unsafe { finalize_lanes_avx512((l, m, log2_l), (u, off), inv, lse) });
    }
    let _ = (l, m, log2_l, u, off, inv, lse);
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn finalize_lanes_avx512(
    (l, m, log2_l): (&[f32; NR], &[f32; NR], &[f32; NR]),
    (u, off): (f32, f32),
    inv: &mut [f32; NR],
    lse: &mut [f32],
) -> u16 {
    use std::arch::x86_64::*;
    let n = lse.len().min(NR);
    // SAFETY: each array is 16 f32.
    let (lv, mv, log) =
        unsafe { (_mm512_loadu_ps(l.as_ptr()), _mm512_loadu_ps(m.as_ptr()), _mm512_loadu_ps(log2_l.as_ptr())) };
    // `l != 0.0`: true for NaN too (unordered or not equal).
    let seen = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(lv, _mm512_setzero_ps());
    let iv = _mm512_maskz_div_ps(seen, _mm512_set1_ps(1.0), lv);
    let x = _mm512_add_ps(
        _mm512_mul_ps(mv, _mm512_set1_ps(u)),
        _mm512_mul_ps(_mm512_sub_ps(log, _mm512_set1_ps(off)), _mm512_set1_ps(std::f32::consts::LN_2)),
    );
    let out = _mm512_mask_blend_ps(seen, _mm512_set1_ps(f32::NEG_INFINITY), x);
    let keep = first_lanes(n);
    // SAFETY: `inv` is 16 f32; `lse` holds `n` f32 and the mask enables only the first `n` lanes
    // (masked lanes are neither read nor written).
    unsafe {
        _mm512_storeu_ps(inv.as_mut_ptr(), iv);
        _mm512_mask_storeu_ps(lse.as_mut_ptr(), keep, out);
    }
    seen & keep
}

/// The mask of the first `w` (1..=16) lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn first_lanes(w: usize) -> std::arch::x86_64::__mmask16 {
    if w >= NR {
        !0
    } else {
        (1u16 << w) - 1
    }
}

/// Columns `x0..x0 + w` (`w` ≤ 16) of each row as one vector per row, the lanes past `w` zero.
///
/// # Safety
/// AVX-512F, and every row holds at least `x0 + min(w, 16)` f32 (the callers assert their rows'
/// lengths once, outside their column loops, where a check per row and block would sit in them).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_columns<const N: usize>(rows: &[&[f32]; N], x0: usize, w: usize) -> [std::arch::x86_64::__m512; N] {
    use std::arch::x86_64::*;
    let mask = first_lanes(w);
    // A plain loop: out of line, `std::array::from_fn`'s closure would lose this function's
    // `#[target_feature]` context.
    let mut v = [_mm512_setzero_ps(); N];
    for (vi, row) in v.iter_mut().zip(rows) {
        // SAFETY: the row holds at least `x0 + min(w, 16)` f32 (this function's contract) and
        // the mask enables only the first `min(w, 16)` lanes (masked lanes are not read).
        *vi = unsafe { _mm512_maskz_loadu_ps(mask, row.as_ptr().add(x0)) };
    }
    v
}

/// The transpose of 16 vectors of 16 lanes: lane `k` of result `r` is lane `r` of input `k`
/// (pairs of lanes interleaved, then pairs of pairs, then the 128-bit quarters twice).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose16(m: [std::arch::x86_64::__m512; NR]) -> [std::arch::x86_64::__m512; NR] {
    use std::arch::x86_64::*;
    // Plain loops over arrays (constant bounds: unrolled, the arrays kept in registers), not
    // `array::from_fn`, whose closure may be compiled out of line.
    let z = _mm512_setzero_ps();
    // t[2i], t[2i+1]: rows 2i and 2i+1 interleaved lane by lane.
    let mut t = [z; NR];
    for i in 0..NR / 2 {
        t[2 * i] = _mm512_unpacklo_ps(m[2 * i], m[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(m[2 * i], m[2 * i + 1]);
    }
    // u[4i + j], quarter L: column 4L + j of rows 4i..4i+4.
    let mut u = [z; NR];
    for i in 0..NR / 4 {
        for h in 0..2 {
            let (a, b) = (_mm512_castps_pd(t[4 * i + h]), _mm512_castps_pd(t[4 * i + 2 + h]));
            u[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            u[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    }
    // w[8h + j] = quarters (0, 2) of u[8h + j] then of u[8h + 4 + j]; w[8h + 4 + j] quarters (1, 3).
    let mut w = [z; NR];
    for h in 0..2 {
        for j in 0..4 {
            let (a, b) = (u[8 * h + j], u[8 * h + 4 + j]);
            w[8 * h + j] = _mm512_shuffle_f32x4::<0x88>(a, b);
            w[8 * h + 4 + j] = _mm512_shuffle_f32x4::<0xDD>(a, b);
        }
    }
    // Column 4L + j: quarter L of u[j], u[4 + j], u[8 + j], u[12 + j].
    let mut c = [z; NR];
    for odd in 0..2 {
        for j in 0..4 {
            let (a, b) = (w[4 * odd + j], w[8 + 4 * odd + j]);
            c[4 * odd + j] = _mm512_shuffle_f32x4::<0x88>(a, b);
            c[8 + 4 * odd + j] = _mm512_shuffle_f32x4::<0xDD>(a, b);
        }
    }
    c
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::softmax::{online_softmax, panel_max, panel_scales};
    use crate::cpu::Native;

    /// The register transpose places every element where the scalar loop does: every head_dim
    /// remainder mod 16, fewer rows than a panel (zero rows).
    #[test]
    fn panel_transpose_matches_the_scalar_layout() {
        if !std::is_x86_feature_detected!("avx512f") {
            eprintln!("this CPU has no AVX-512: nothing to compare");
            return;
        }
        let zeros = [0.0f32; 80];
        for d in [1usize, 5, 15, 16, 17, 24, 40, 64, 72, 80] {
            let data: Vec<f32> = (0..NR * d).map(|i| i as f32 + 0.5).collect();
            for n in [1usize, 4, 6, 11, 16] {
                let rows: [&[f32]; NR] =
                    std::array::from_fn(|r| if r < n { &data[r * d..(r + 1) * d] } else { &zeros[..d] });
                let mut q = vec![-1.0f32; d * NR + 3];
                assert!(fill_panel(&rows, d, &mut q));
                for x in 0..d {
                    for (r, row) in rows.iter().enumerate() {
                        assert_eq!(q[x * NR + r], row[x], "d {d} n {n} x {x} lane {r}");
                    }
                }
                assert!(q[d * NR..].iter().all(|&v| v == -1.0), "d {d}: wrote past the panel");
            }
        }
    }

    /// `pack_strip` places every element where the scalar loop of `pack_heads` does: every
    /// head_dim remainder mod 16 (partial output vectors), up to MAX_HEAD_DIM, fewer rows than a
    /// strip (zero rows), rows a stride apart, NaN and infinities moved as they are.
    #[test]
    fn pack_strip_matches_the_scalar_layout() {
        if !std::is_x86_feature_detected!("avx512f") {
            eprintln!("this CPU has no AVX-512: nothing to compare");
            return;
        }
        let max = crate::cpu::MAX_HEAD_DIM;
        let zeros = vec![0.0f32; max];
        for d in (1..=40).chain([47, 48, 63, 64, 65, 72, 96, 100, 128, 200, 256, max]) {
            let stride = d + 5;
            let mut data: Vec<f32> = (0..MR * stride).map(|i| i as f32 * 0.75 - 3.0).collect();
            data[stride + d - 1] = f32::NAN;
            data[2] = f32::INFINITY;
            for n in 1..=MR {
                let rows: [&[f32]; MR] =
                    std::array::from_fn(|r| if r < n { &data[r * stride..r * stride + d] } else { &zeros[..d] });
                let mut k = vec![-1.0f32; d * MR + 7];
                assert!(pack_strip(&rows, d, &mut k));
                for x in 0..d {
                    for (i, row) in rows.iter().enumerate() {
                        assert_eq!(k[x * MR + i].to_bits(), row[x].to_bits(), "d {d} n {n} x {x} row {i}");
                    }
                }
                assert!(k[d * MR..].iter().all(|&v| v == -1.0), "d {d}: wrote past the strip");
            }
        }
    }

    /// `pack_v_strip` writes what the scalar copy of `pack_heads` and the padding of
    /// `packed_buffers` leave: every head_dim remainder mod 6, up to MAX_HEAD_DIM, fewer rows
    /// than a strip (zero rows), NaN and infinities moved as they are, nothing between strips.
    #[test]
    fn pack_v_strip_matches_the_scalar_layout() {
        if !std::is_x86_feature_detected!("avx512f") {
            eprintln!("this CPU has no AVX-512: nothing to compare");
            return;
        }
        let max = crate::cpu::MAX_HEAD_DIM;
        let zeros = vec![0.0f32; max];
        for d in (1..=40).chain([63, 64, 65, 72, 100, 128, 256, max]) {
            let rs = d + 3;
            let mut data: Vec<f32> = (0..MR * rs).map(|i| i as f32 * 0.5 - 7.0).collect();
            let clean = data.clone();
            data[rs + d - 1] = f32::NAN;
            data[1] = f32::NEG_INFINITY;
            let stride = MR * MR + 12;
            let strips = d.div_ceil(MR);
            for n in 1..=MR {
                let rows: [&[f32]; MR] =
                    std::array::from_fn(|r| if r < n { &data[r * rs..r * rs + d] } else { &zeros[..d] });
                let mut v = vec![-1.0f32; strips * stride];
                // Row 0 holds −inf in its second column, row 1 a NaN in its last: finite only below both.
                let finite = pack_v_strip(&rows, d, &mut v, stride);
                assert_eq!(finite, Some(d < 2 && n < 2), "d {d} n {n}");
                let finite_rows: [&[f32]; MR] = std::array::from_fn(|r| &clean[r * rs..r * rs + d]);
                assert_eq!(pack_v_strip(&finite_rows, d, &mut vec![0.0; strips * stride], stride), Some(true));
                for c in 0..strips {
                    for (i, row) in rows.iter().enumerate() {
                        for col in 0..MR {
                            let want = row.get(c * MR + col).copied().unwrap_or(0.0);
                            let got = v[c * stride + i * MR + col];
                            assert_eq!(got.to_bits(), want.to_bits(), "d {d} n {n} strip {c} key {i} col {col}");
                        }
                    }
                    assert!(v[c * stride + MR * MR..(c + 1) * stride].iter().all(|&x| x == -1.0), "d {d}");
                }
            }
        }
    }

    /// `native_softmax` is the generic verbs with `Native`, bit for bit: scores spread over the
    /// whole exponent range the softmax meets (differences down to −200 in log2 units), masked
    /// keys (−inf), NaN scores, rows that have seen nothing, rows whose max grows by any amount
    /// (or to +inf) and rows whose max does not move.
    #[test]
    fn native_softmax_is_the_generic_verbs_bit_for_bit() {
        let mut rng = crate::numerics::rng::SplitMix64::new(7);
        let mut checked = 0;
        for case in 0..400 {
            let keys = 1 + case % 23;
            let c = [1.0f32, std::f32::consts::LOG2_E * 0.088, 3.7, 40.0][case % 4];
            let mut panel: Vec<f32> = (0..keys * NR).map(|_| (rng.uniform() as f32 - 0.5) * 60.0).collect();
            for (i, x) in panel.iter_mut().enumerate() {
                match (i * 7 + case) % 41 {
                    0 => *x = f32::NEG_INFINITY,
                    1 if case % 5 == 0 => *x = f32::NAN,
                    2 => *x = -1.0e30,
                    3 if case % 7 == 0 => *x = f32::INFINITY,
                    _ => {}
                }
            }
            let states: Vec<RowState> = (0..NR)
                .map(|q| match (q + case) % 5 {
                    0 => RowState::EMPTY,
                    1 => RowState { m: 1.0e6, l: 3.0 },
                    2 => RowState { m: -1.0e6, l: 0.5 },
                    _ => RowState { m: (rng.uniform() as f32 - 0.5) * 40.0, l: 1.0 + rng.uniform() as f32 },
                })
                .collect();
            let (mut st_a, mut p_a) = (states.clone(), panel.clone());
            // Every other case with the max taken beforehand (as `product_max` does).
            let pre = panel_max(&panel);
            let Some(sc_a) = native_softmax(&mut st_a, &mut p_a, c, (case % 2 == 1).then_some(&pre)) else {
                eprintln!("this CPU has no AVX-512F: native_softmax is compiled but not run here");
                return;
            };
            let (mut st_b, mut p_b) = (states, panel);
            let tile_max = panel_max(&p_b);
            let sc_b = panel_scales(&mut st_b, &tile_max, c, &Native);
            online_softmax::<Native, true>(&mut st_b, &sc_b, &mut p_b, c, &Native);
            let bits = |x: &[f32]| x.iter().map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() }).collect::<Vec<_>>();
            assert_eq!(bits(&sc_a), bits(&sc_b), "case {case}: scales");
            assert_eq!(bits(&p_a), bits(&p_b), "case {case}: probabilities");
            let ml = |s: &[RowState]| s.iter().flat_map(|r| [r.m, r.l]).collect::<Vec<_>>();
            assert_eq!(bits(&ml(&st_a)), bits(&ml(&st_b)), "case {case}: states");
            checked += 1;
        }
        assert_eq!(checked, 400);
    }

    /// `write_panel_rows` is the strided scalar loop, bit for bit, for head dims that do and do
    /// not fill whole 16-column blocks, partial panels and rows that saw no key (written as 0
    /// even where O holds an infinity or a NaN), into rows a stride apart (as the caller's
    /// `[batch, seqlen, heads, head_dim]` rows lie) whose gaps it leaves alone.
    #[test]
    fn write_panel_rows_is_the_strided_loop() {
        for d in [1usize, 5, 16, 24, 40, 64, 72, 128, 130] {
            let dv = d.next_multiple_of(6);
            let op: Vec<f32> = (0..dv * NR).map(|i| ((i * 37) % 101) as f32 * 0.37 - 17.0).collect();
            let mut op = op;
            op[3 * NR + 2] = f32::INFINITY;
            op[NR + 5] = f32::NAN;
            let inv: [f32; NR] = std::array::from_fn(|r| 1.0 / (r as f32 + 1.7));
            for n in [1usize, 7, 15, 16] {
                for live in [0xffffu16, 0xb5db, 0x0004] {
                    // Rows at different places in their lines (stride d + 3), and rows that all
                    // start `lead` floats into a line (stride a multiple of 16, gaps either side).
                    let aligned = (0..NR).map(|lead| (d.next_multiple_of(NR) + NR, lead));
                    for (stride, lead) in [(d + 3, 0)].into_iter().chain(aligned) {
                        let mut whole = vec![-1.0f32; n * stride + 2 * NR];
                        let start = whole.as_ptr().align_offset(64).min(NR) + lead;
                        let buf = &mut whole[start..start + n * stride];
                        let mut rows: Vec<&mut [f32]> = buf.chunks_exact_mut(stride).map(|r| &mut r[..d]).collect();
                        if !write_panel_rows(&op, &inv, live, d, &mut rows) {
                            eprintln!("this CPU has no AVX-512F: write_panel_rows is compiled but not run here");
                            return;
                        }
                        let a: Vec<f32> = buf.chunks_exact(stride).flat_map(|r| r[..d].to_vec()).collect();
                        let gaps = buf.chunks_exact(stride).all(|r| r[d..].iter().all(|&x| x == -1.0));
                        let outside = whole[..start].iter().chain(&whole[start + n * stride..]).all(|&x| x == -1.0);
                        assert!(gaps && outside, "d {d} stride {stride} lead {lead}: wrote into a gap");
                        let b: Vec<f32> = (0..n * d)
                            .map(|i| {
                                let (r, x) = (i / d, i % d);
                                if live >> r & 1 == 0 {
                                    0.0
                                } else {
                                    op[x * NR + r] * inv[r]
                                }
                            })
                            .collect();
                        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&a), bits(&b), "d {d} n {n} live {live:#x} stride {stride} lead {lead}");
                    }
                }
            }
        }
    }

    /// `product_max` and `scaled_product` are the generic micro-kernels strip by strip (and
    /// `panel_max`, and the rescale) bit for bit, over tiles of several strips: scores with NaNs
    /// and zeros for the max, P with zeros and V with an infinity for the skipping product.
    #[test]
    fn fused_products_are_the_generic_kernels() {
        use crate::cpu::gemm::{micro_kernel, micro_kernel_skip_zero_b, micro_kernel_x2, Acc};
        use crate::cpu::softmax::{panel_max, rescale_o};
        let bits = |x: &[f32]| x.iter().map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() }).collect::<Vec<_>>();
        // First product: 3 strips of 6 keys, head_dim 11. A NaN key row; a Q column of zeros.
        let (d, strips) = (11, 3);
        let mut k: Vec<f32> = (0..strips * d * MR).map(|i| ((i * 7) % 11) as f32 * 0.5 - 2.5).collect();
        k[d * MR + 2] = f32::NAN;
        let q0: Vec<f32> = (0..d * NR).map(|i| ((i * 5) % 13) as f32 * 0.25 - 1.5).collect();
        let mut q1: Vec<f32> = (0..d * NR).map(|i| ((i * 3) % 7) as f32 - 3.0).collect();
        for x in 0..d {
            q1[x * NR + 3] = 0.0;
        }
        let init: [f32; NR] = std::array::from_fn(|q| if q % 4 == 0 { f32::NEG_INFINITY } else { -1.0 });
        let mut s = [vec![0.0f32; strips * MR * NR], vec![0.0f32; strips * MR * NR]];
        let mut m = [init, init];
        let [s0, s1] = &mut s;
        let [m0, m1] = &mut m;
        if !product_max::<2>(KTile::Packed(&k), [&q0, &q1], [s0, s1], ([m0, m1], strips * MR)) {
            eprintln!("this CPU has no AVX-512F: the fused products are compiled but not run here");
            return;
        }
        let mut want = [vec![], vec![]];
        for st in 0..strips {
            let mut acc: [Acc; 2] = [[[0.0; NR]; MR]; 2];
            micro_kernel_x2::<true, false>(&k[st * d * MR..(st + 1) * d * MR], [&q0, &q1], &mut acc);
            want[0].extend_from_slice(acc[0].as_flattened());
            want[1].extend_from_slice(acc[1].as_flattened());
        }
        for t in 0..2 {
            assert_eq!(bits(&s[t]), bits(&want[t]), "panel {t}: scores");
            let rows = [init.as_slice(), &want[t]].concat();
            assert_eq!(bits(&m[t]), bits(&panel_max(&rows)), "panel {t}: max");
        }
        let (mut s1only, mut m1only) = (vec![0.0f32; strips * MR * NR], init);
        assert!(product_max::<1>(KTile::Packed(&k), [&q1], [&mut s1only], ([&mut m1only], strips * MR)));
        assert_eq!(bits(&s1only), bits(&want[1]), "single panel: scores");
        assert_eq!(bits(&m1only), bits(&m[1]), "single panel: max");
        // K's rows read in place (`KTile::Rows`, rows `stride` apart, the last strip's last
        // `pad` keys missing): the packed strips' bits, the packed padding being zeros.
        for pad in [0, 1, 5] {
            let (stride, n) = (d + 5, strips * MR - pad);
            let mut rows = vec![f32::NAN; 3 + n * stride];
            let mut kp = k.clone();
            for j in 0..strips * MR {
                for x in 0..d {
                    let at = (j / MR * d + x) * MR + j % MR;
                    if j < n {
                        rows[3 + j * stride + x] = k[at];
                    } else {
                        kp[at] = 0.0;
                    }
                }
            }
            let zeros = [0.0f32; 16];
            let tile = KTile::Rows { data: &rows, at: 3, stride, keys: n, zeros: &zeros };
            let mut buf = Vec::new();
            assert_eq!(bits(tile.packed(strips, d, &mut buf)), bits(&kp), "pad {pad}: gathered strips");
            for t in 0..2 {
                let q = [&q0, &q1][t];
                let (mut sr, mut sp) = (vec![0.0f32; strips * MR * NR], vec![0.0f32; strips * MR * NR]);
                let (mut mr, mut mp) = (init, init);
                assert!(product_max::<1>(tile, [q], [&mut sr], ([&mut mr], n)));
                assert!(product_max::<1>(KTile::Packed(&kp), [q], [&mut sp], ([&mut mp], n)));
                assert_eq!(bits(&sr), bits(&sp), "pad {pad} panel {t}: scores");
                assert_eq!(bits(&mr), bits(&mp), "pad {pad} panel {t}: max");
            }
        }
        // The max over the first `keys` rows only (the scores all the same).
        for keys in 0..strips * MR {
            let mut m2 = [init, init];
            let [m20, m21] = &mut m2;
            let mut s2 = [vec![0.0f32; strips * MR * NR], vec![0.0f32; strips * MR * NR]];
            let [s20, s21] = &mut s2;
            assert!(product_max::<2>(KTile::Packed(&k), [&q0, &q1], [s20, s21], ([m20, m21], keys)));
            for t in 0..2 {
                assert_eq!(bits(&s2[t]), bits(&want[t]), "keys {keys}: scores");
                let rows = [init.as_slice(), &want[t][..keys * NR]].concat();
                assert_eq!(bits(&m2[t]), bits(&panel_max(&rows)), "keys {keys} panel {t}: max");
            }
        }

        // Second product: 2 strips of 6 columns of V, 13 keys, strips `stride` apart.
        let (keys, strips, stride) = (13, 2, 13 * MR + 7);
        let mut v: Vec<f32> = (0..stride * strips).map(|i| ((i * 7) % 11) as f32 * 0.5 - 2.5).collect();
        let p0: Vec<f32> = (0..keys * NR).map(|i| ((i * 5) % 13) as f32 * 0.125).collect();
        let p1: Vec<f32> = (0..keys * NR).map(|i| if i % 5 == 0 { 0.0 } else { ((i * 3) % 7) as f32 * 0.25 }).collect();
        let sc: [f32; NR] = std::array::from_fn(|q| if q % 3 == 0 { 1.0 } else { 0.375 * q as f32 });
        let o: Vec<f32> = (0..strips * MR * NR).map(|i| ((i * 13) % 17) as f32 - 8.0).collect();
        for skip in [false, true] {
            if skip {
                v[stride + 2] = f32::INFINITY;
            }
            let (mut x0, mut x1, mut y) = (o.clone(), o.clone(), o.clone());
            let vt = (&v[..], stride, strips * MR);
            if skip {
                assert!(scaled_product::<2, true>(vt, [&p0, &p1], [&mut x0, &mut x1], [&sc, &sc]));
                assert!(scaled_product::<1, true>(vt, [&p1], [&mut y], [&sc]));
            } else {
                assert!(scaled_product::<2, false>(vt, [&p0, &p1], [&mut x0, &mut x1], [&sc, &sc]));
                assert!(scaled_product::<1, false>(vt, [&p1], [&mut y], [&sc]));
            }
            for ds in 0..strips {
                let a = &v[ds * stride..ds * stride + keys * MR];
                let blk = ds * MR * NR..(ds + 1) * MR * NR;
                let mut acc: [Acc; 2] = [[[0.0; NR]; MR]; 2];
                rescale_o(&o[blk.clone()], &sc, &mut acc[0]);
                rescale_o(&o[blk.clone()], &sc, &mut acc[1]);
                let mut one = acc[1];
                if skip {
                    micro_kernel_x2::<true, true>(a, [&p0, &p1], &mut acc);
                    micro_kernel_skip_zero_b::<true>(a, &p1, &mut one);
                } else {
                    micro_kernel_x2::<true, false>(a, [&p0, &p1], &mut acc);
                    micro_kernel::<true>(a, &p1, &mut one);
                }
                assert_eq!(bits(&x0[blk.clone()]), bits(acc[0].as_flattened()), "skip {skip} strip {ds}: panel 0");
                assert_eq!(bits(&x1[blk.clone()]), bits(acc[1].as_flattened()), "skip {skip} strip {ds}: panel 1");
                assert_eq!(bits(&y[blk]), bits(one.as_flattened()), "skip {skip} strip {ds}: single panel");
            }
        }

        // The last strip with 4 or 2 real columns (head_dim 64, 256; 32, 128): those are the
        // generic kernels' bits, the padding rows only rescaled.
        for cols in [strips * MR - 2, strips * MR - 4] {
            let (mut x0, mut x1, mut y) = (o.clone(), o.clone(), o.clone());
            let vt = (&v[..], stride, cols);
            assert!(scaled_product::<2, true>(vt, [&p0, &p1], [&mut x0, &mut x1], [&sc, &sc]));
            assert!(scaled_product::<1, true>(vt, [&p1], [&mut y], [&sc]));
            for ds in 0..strips {
                let a = &v[ds * stride..ds * stride + keys * MR];
                let blk = ds * MR * NR..(ds + 1) * MR * NR;
                let mut acc: [Acc; 2] = [[[0.0; NR]; MR]; 2];
                rescale_o(&o[blk.clone()], &sc, &mut acc[0]);
                rescale_o(&o[blk.clone()], &sc, &mut acc[1]);
                let (scaled, mut one) = (acc[1], acc[1]);
                micro_kernel_x2::<true, true>(a, [&p0, &p1], &mut acc);
                micro_kernel_skip_zero_b::<true>(a, &p1, &mut one);
                for i in 0..MR {
                    let row = (ds * MR + i) * NR..(ds * MR + i + 1) * NR;
                    let real = ds * MR + i < cols;
                    let want = |acc: &Acc| if real { acc[i] } else { scaled[i] };
                    assert_eq!(bits(&x0[row.clone()]), bits(&want(&acc[0])), "cols {cols} row {i}: panel 0");
                    assert_eq!(bits(&x1[row.clone()]), bits(&want(&acc[1])), "cols {cols} row {i}: panel 1");
                    if real {
                        assert_eq!(bits(&y[row]), bits(&one[i]), "cols {cols} row {i}: single panel");
                    }
                }
            }
        }
    }

    /// Three and four panels at once (the grouping of the AVX-512 tiled path): each panel's
    /// scores, max and Oᵀ are the single-panel generic kernels' bit for bit, the max over a part
    /// of the keys, V with an infinity, and the last V strip with 2 or 4 real columns included.
    #[test]
    fn grouped_products_are_the_generic_kernels() {
        group_is_the_generic_kernels::<3>();
        group_is_the_generic_kernels::<4>();
    }

    fn group_is_the_generic_kernels<const G: usize>() {
        use crate::cpu::gemm::{micro_kernel, micro_kernel_skip_zero_b, Acc};
        use crate::cpu::softmax::{panel_max, rescale_o};
        let bits = |x: &[f32]| x.iter().map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() }).collect::<Vec<_>>();
        let (d, strips) = (9, 3);
        let mut k: Vec<f32> = (0..strips * d * MR).map(|i| ((i * 7) % 11) as f32 * 0.5 - 2.5).collect();
        k[2 * d * MR + 4] = f32::NAN;
        let q: [Vec<f32>; G] =
            std::array::from_fn(|t| (0..d * NR).map(|i| ((i * (3 + 2 * t)) % 13) as f32 * 0.25 - 1.5).collect());
        let init: [f32; NR] = std::array::from_fn(|l| if l % 5 == 0 { f32::NEG_INFINITY } else { -0.5 });
        let want: [Vec<f32>; G] = std::array::from_fn(|t| {
            let mut w = vec![];
            for st in 0..strips {
                let mut acc: Acc = [[0.0; NR]; MR];
                micro_kernel::<true>(&k[st * d * MR..(st + 1) * d * MR], &q[t], &mut acc);
                w.extend_from_slice(acc.as_flattened());
            }
            w
        });
        for keys in [strips * MR, strips * MR - 4, 7, 0] {
            let mut s: [Vec<f32>; G] = std::array::from_fn(|_| vec![0.0f32; strips * MR * NR]);
            let mut m = [init; G];
            let qs: [&[f32]; G] = std::array::from_fn(|t| &q[t][..]);
            if !product_max::<G>(KTile::Packed(&k), qs, s.each_mut().map(|x| &mut x[..]), (m.each_mut(), keys)) {
                eprintln!("this CPU has no AVX-512F: the fused products are compiled but not run here");
                return;
            }
            for t in 0..G {
                assert_eq!(bits(&s[t]), bits(&want[t]), "keys {keys} panel {t}: scores");
                let rows = [init.as_slice(), &want[t][..keys * NR]].concat();
                assert_eq!(bits(&m[t]), bits(&panel_max(&rows)), "keys {keys} panel {t}: max");
            }
        }

        let (keys, strips, stride) = (11, 3, 11 * MR + 5);
        let mut v: Vec<f32> = (0..stride * strips).map(|i| ((i * 7) % 11) as f32 * 0.5 - 2.5).collect();
        let p: [Vec<f32>; G] = std::array::from_fn(|t| {
            (0..keys * NR).map(|i| if (i + t) % 4 == 0 { 0.0 } else { ((i * (t + 3)) % 7) as f32 * 0.25 }).collect()
        });
        let sc: [[f32; NR]; G] = std::array::from_fn(|t| std::array::from_fn(|l| 0.125 * ((l + t) % 9) as f32 + 0.5));
        let o: Vec<f32> = (0..strips * MR * NR).map(|i| ((i * 13) % 17) as f32 - 8.0).collect();
        let all = strips * MR;
        for (skip, cols) in [(false, all), (true, all), (true, all - 2), (false, all - 4)] {
            if skip {
                v[stride + 3] = f32::INFINITY;
            }
            let mut x: [Vec<f32>; G] = std::array::from_fn(|_| o.clone());
            let vt = (&v[..], stride, cols);
            let ps: [&[f32]; G] = std::array::from_fn(|t| &p[t][..]);
            let xs = x.each_mut().map(|x| &mut x[..]);
            let scs: [&[f32; NR]; G] = std::array::from_fn(|t| &sc[t]);
            if skip {
                assert!(scaled_product::<G, true>(vt, ps, xs, scs));
            } else {
                assert!(scaled_product::<G, false>(vt, ps, xs, scs));
            }
            for ds in 0..strips {
                let a = &v[ds * stride..ds * stride + keys * MR];
                let blk = ds * MR * NR..(ds + 1) * MR * NR;
                for t in 0..G {
                    let mut acc: Acc = [[0.0; NR]; MR];
                    rescale_o(&o[blk.clone()], &sc[t], &mut acc);
                    let scaled = acc;
                    if skip {
                        micro_kernel_skip_zero_b::<true>(a, &p[t], &mut acc);
                    } else {
                        micro_kernel::<true>(a, &p[t], &mut acc);
                    }
                    for i in 0..MR {
                        let want = if ds * MR + i < cols { acc[i] } else { scaled[i] };
                        let row = (ds * MR + i) * NR..(ds * MR + i + 1) * NR;
                        let at = format!("skip {skip} cols {cols} strip {ds} row {i} panel {t}");
                        assert_eq!(bits(&x[t][row]), bits(&want), "{G} panels: {at}");
                    }
                }
            }
        }
    }
}

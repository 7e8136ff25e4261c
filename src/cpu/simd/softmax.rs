//! The tiled path's online softmax and finalisation in AVX-512 instructions.
#![allow(clippy::incompatible_msrv)]

#[cfg(target_arch = "x86_64")]
use super::lanes::{first_lanes, running_max};
use crate::cpu::gemm::NR;
use crate::cpu::row_state::RowState;

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

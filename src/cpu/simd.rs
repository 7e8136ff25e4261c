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
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has (it is part of the
    // x86_64 baseline the crate is compiled for); a prefetch never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// As [`prefetch`], into L2 only: for data read a whole work item later, which would only
/// crowd the L1 that the current item's panels live in.
#[inline(always)]
pub(crate) fn prefetch_l2(p: *const i8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as `prefetch`: SSE is part of the x86_64 baseline, and a prefetch never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

use super::gemm::NR;
use super::softmax::RowState;

/// The online softmax of one `[keys][NR]` score panel with the native arithmetic (`cpu::Native`:
/// the degree-5 `exp2_fast`, no P offset, no P rounding, eager rescaling): the panel max, the
/// rescale factors (returned), the probabilities in place and the updated row states, bit for
/// bit what `panel_max`, `panel_scales` and `online_softmax::<Native, true>` compute, in fewer
/// instructions: `exp2_fast` there is 18 vector operations per 16 scores (two clamps, floor,
/// the exponent built from bits and multiplied in), here 12 (`vscalefps` multiplies by
/// `2^floor(x)` and a mask zeroes what is below `2^-126`, as `exp2_fast`'s clamp does). With 512-bit vectors every vector operation shares the two FMA
/// ports with the products, so at head_dim 64 the softmax was more than half of them.
///
/// `None` when this CPU lacks AVX-512F (the caller then runs the generic verbs).
#[inline]
pub(crate) fn native_softmax(states: &mut [RowState], panel: &mut [f32], c: f32) -> Option<[f32; NR]> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected on this CPU, the only requirement of
        // `native_softmax_avx512` (its slice lengths it checks itself).
        return Some(unsafe { native_softmax_avx512(states, panel, c) });
    }
    let _ = (states, panel, c);
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
fn native_softmax_avx512(states: &mut [RowState], panel: &mut [f32], c: f32) -> [f32; NR] {
    use std::arch::x86_64::*;
    assert!(states.len() >= NR && panel.len() % NR == 0);
    let load = |x: &[f32]| {
        // SAFETY: `x` holds at least 16 f32 (every caller passes a 16-lane panel row).
        unsafe { _mm512_loadu_ps(x[..NR].as_ptr()) }
    };
    // The tile max; `max_ps(row, acc)` returns `acc` when `row` is NaN, as `panel_max` skips it.
    let mut tile_max = _mm512_set1_ps(f32::NEG_INFINITY);
    for row in panel.chunks_exact(NR) {
        tile_max = _mm512_max_ps(load(row), tile_max);
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::softmax::{online_softmax, panel_max, panel_scales};
    use crate::cpu::Native;

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
            let Some(sc_a) = native_softmax(&mut st_a, &mut p_a, c) else {
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
}

//! Lane helpers the AVX-512 kernels share: lane masks, the running max over vectors, masked
//! column loads and the 16×16 transpose.

#[cfg(target_arch = "x86_64")]
use crate::cpu::gemm::NR;

/// `panel_max` folded over more rows, in their order: `max_ps(row, acc)` returns `acc` when
/// `row` is NaN (`panel_max` skips it) and when both are zeros (`panel_max` keeps the first), so
/// the result is `panel_max`'s bit for bit, sign of a zero included.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn running_max(
    mut acc: std::arch::x86_64::__m512,
    rows: impl Iterator<Item = std::arch::x86_64::__m512>,
) -> std::arch::x86_64::__m512 {
    for row in rows {
        acc = std::arch::x86_64::_mm512_max_ps(row, acc);
    }
    acc
}

/// The mask of the first `w` (1..=16) lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn first_lanes(w: usize) -> std::arch::x86_64::__mmask16 {
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
pub(super) unsafe fn load_columns<const N: usize>(rows: &[&[f32]; N], x0: usize, w: usize) -> [std::arch::x86_64::__m512; N] {
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
pub(super) fn transpose16(m: [std::arch::x86_64::__m512; NR]) -> [std::arch::x86_64::__m512; NR] {
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

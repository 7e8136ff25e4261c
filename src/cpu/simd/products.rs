//! The tiled path's two products in AVX-512 instructions, on up to four query panels at once:
//! `Sᵀ = K·Qᵀ` with the softmax's max taken on the way, and `Oᵀ = Oᵀ·diag(scale) + Vᵀ·Pᵀ`.
#![allow(clippy::incompatible_msrv)]

#[cfg(target_arch = "x86_64")]
use super::lanes::running_max;
use crate::cpu::gemm::{MR, NR};

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

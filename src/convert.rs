//! Conversions between f32 and the 16-bit element types, for the tensors and both CPU paths (one
//! home below them all). Whole rows are converted bit for bit as `half`'s
//! scalar conversions convert them (`f16::to_f32`, `f16::from_f32`, `bf16::to_f32`, `bf16::from_f32`),
//! in vector instructions where the CPU has them (detected at run time).
//!
//! `half` converts one element per call: on x86_64 each call checks for F16C and converts one
//! value with the scalar form of the instruction (no inlining across its `#[target_feature]`
//! function), which makes widening f16 K, V and Q rows and narrowing f16 outputs a large share
//! of an f16 forward pass. Here one check per row, then 16 (AVX-512F) or 8 (F16C)
//! elements per instruction. The instructions round as `half` does: `vcvtps2ph` with
//! round-to-nearest-even is the instruction `half` itself uses (and its portable fallback
//! matches), f32 → bf16 rounds to nearest even with the same integer steps, and NaNs are made
//! quiet exactly as `half` makes them (tested on every 16-bit pattern and on edge f32 values).
#![allow(clippy::incompatible_msrv)]

use half::{bf16, f16};

/// The instruction set a conversion runs on, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // elsewhere only `Portable` is detected
enum Path {
    /// AVX-512F: 16 elements per instruction.
    Avx512,
    /// F16C (+ AVX): 8 f16 elements per instruction; bf16 goes the portable way.
    F16c,
    /// `half`'s scalar conversions.
    Portable,
}

/// The best [`Path`] this CPU has (the detection is a cached load; repeated per row).
#[inline]
fn detect() -> Path {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            return Path::Avx512;
        }
        if std::is_x86_feature_detected!("f16c") && std::is_x86_feature_detected!("avx") {
            return Path::F16c;
        }
    }
    Path::Portable
}

/// `dst[i] = src[i]` widened, for `i < min(src.len(), dst.len())`.
pub(crate) fn widen_f16(src: &[f16], dst: &mut [f32]) {
    widen_f16_on(detect(), src, dst)
}

/// `dst[i] = src[i]` widened, for `i < min(src.len(), dst.len())`.
pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    widen_bf16_on(detect(), src, dst)
}

/// `dst[i] = f16::from_f32(src[i])`, for `i < min(src.len(), dst.len())`.
pub(crate) fn narrow_f16(src: &[f32], dst: &mut [f16]) {
    narrow_f16_on(detect(), src, dst)
}

/// `dst[i] = bf16::from_f32(src[i])`, for `i < min(src.len(), dst.len())`.
pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    narrow_bf16_on(detect(), src, dst)
}

// Each `*_on` re-checks the CPU for the path it is asked for, so that the safety of every call
// below rests on a check made right there (tests ask for each path in turn).

fn widen_f16_on(path: Path, src: &[f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let has = detect();
        if path == Path::Avx512 && has == Path::Avx512 {
            // SAFETY: AVX-512F was just detected, the only requirement of this safe function.
            return unsafe { x86::widen_f16_avx512(src, dst) };
        }
        if path != Path::Portable && has != Path::Portable {
            // SAFETY: F16C and AVX (implied by AVX-512F) were just detected, the function's only requirement.
            return unsafe { x86::widen_f16_f16c(src, dst) };
        }
    }
    let _ = path;
    dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
}

fn widen_bf16_on(path: Path, src: &[bf16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if path == Path::Avx512 && detect() == Path::Avx512 {
        // SAFETY: AVX-512F was just detected, the only requirement of this safe function.
        return unsafe { x86::widen_bf16_avx512(src, dst) };
    }
    let _ = path;
    dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
}

fn narrow_f16_on(path: Path, src: &[f32], dst: &mut [f16]) {
    #[cfg(target_arch = "x86_64")]
    {
        let has = detect();
        if path == Path::Avx512 && has == Path::Avx512 {
            // SAFETY: AVX-512F was just detected, the only requirement of this safe function.
            return unsafe { x86::narrow_f16_avx512(src, dst) };
        }
        if path != Path::Portable && has != Path::Portable {
            // SAFETY: F16C and AVX (implied by AVX-512F) were just detected, the function's only requirement.
            return unsafe { x86::narrow_f16_f16c(src, dst) };
        }
    }
    let _ = path;
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = f16::from_f32(s));
}

fn narrow_bf16_on(path: Path, src: &[f32], dst: &mut [bf16]) {
    #[cfg(target_arch = "x86_64")]
    if path == Path::Avx512 && detect() == Path::Avx512 {
        // SAFETY: AVX-512F was just detected, the only requirement of this safe function.
        return unsafe { x86::narrow_bf16_avx512(src, dst) };
    }
    let _ = path;
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = bf16::from_f32(s));
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Converts `src` into `dst` (`min` of the lengths) `W` elements at a time by `block`, which
    /// reads `W` elements at its first argument and writes `W` at its second; the last partial
    /// block goes through zero-filled stack copies. Every pointer `block` is given addresses `W`
    /// valid elements.
    #[inline(always)]
    fn blocks<S: Copy + Default, D: Copy + Default, const W: usize>(
        src: &[S],
        dst: &mut [D],
        block: impl Fn(*const S, *mut D),
    ) {
        let n = src.len().min(dst.len());
        let whole = n / W * W;
        for (s, d) in src[..whole].chunks_exact(W).zip(dst[..whole].chunks_exact_mut(W)) {
            block(s.as_ptr(), d.as_mut_ptr());
        }
        if whole < n {
            let (mut s, mut d) = ([S::default(); W], [D::default(); W]);
            s[..n - whole].copy_from_slice(&src[whole..n]);
            block(s.as_ptr(), d.as_mut_ptr());
            dst[whole..n].copy_from_slice(&d[..n - whole]);
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn widen_f16_avx512(src: &[f16], dst: &mut [f32]) {
        blocks::<_, _, 16>(src, dst, |s, d| {
            // SAFETY: `blocks` hands out pointers to 16 valid elements (32 bytes read, 64
            // written, unaligned forms); AVX-512F is enabled in this function.
            unsafe { _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(s.cast()))) }
        })
    }

    #[target_feature(enable = "avx,f16c")]
    pub(super) fn widen_f16_f16c(src: &[f16], dst: &mut [f32]) {
        blocks::<_, _, 8>(src, dst, |s, d| {
            // SAFETY: `blocks` hands out pointers to 8 valid elements (16 bytes read, 32
            // written, unaligned forms); AVX and F16C are enabled in this function.
            unsafe { _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm_loadu_si128(s.cast()))) }
        })
    }

    /// bf16 is the high half of an f32; a NaN gets its quiet bit set, as `bf16::to_f32` does.
    #[target_feature(enable = "avx512f")]
    pub(super) fn widen_bf16_avx512(src: &[bf16], dst: &mut [f32]) {
        blocks::<_, _, 16>(src, dst, |s, d| {
            // SAFETY: `blocks` hands out pointers to 16 valid elements (32 bytes read, 64
            // written, unaligned forms); AVX-512F is enabled in this function.
            let h = unsafe { _mm256_loadu_si256(s.cast()) };
            let x = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
            let nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff)), inf());
            let x = _mm512_mask_or_epi32(x, nan, x, _mm512_set1_epi32(0x0040_0000));
            // SAFETY: as above.
            unsafe { _mm512_storeu_si512(d.cast(), x) }
        })
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn narrow_f16_avx512(src: &[f32], dst: &mut [f16]) {
        blocks::<_, _, 16>(src, dst, |s, d| {
            // SAFETY: `blocks` hands out pointers to 16 valid elements (64 bytes read, 32
            // written, unaligned forms); AVX-512F is enabled in this function.
            let x = unsafe { _mm512_loadu_ps(s) };
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
            // SAFETY: as above.
            unsafe { _mm256_storeu_si256(d.cast(), h) }
        })
    }

    #[target_feature(enable = "avx,f16c")]
    pub(super) fn narrow_f16_f16c(src: &[f32], dst: &mut [f16]) {
        blocks::<_, _, 8>(src, dst, |s, d| {
            // SAFETY: `blocks` hands out pointers to 8 valid elements (32 bytes read, 16
            // written, unaligned forms); AVX and F16C are enabled in this function.
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(unsafe { _mm256_loadu_ps(s) });
            // SAFETY: as above.
            unsafe { _mm_storeu_si128(d.cast(), h) }
        })
    }

    /// Round to nearest even on the bits (`x + 0x7fff + lsb`, then the high half: a carry out
    /// of the low half is the round up, and rounds the largest finite values to infinity); a
    /// NaN keeps its high half with the quiet bit set. `bf16::from_f32`'s rule, lane by lane.
    #[target_feature(enable = "avx512f")]
    pub(super) fn narrow_bf16_avx512(src: &[f32], dst: &mut [bf16]) {
        blocks::<_, _, 16>(src, dst, |s, d| {
            // SAFETY: `blocks` hands out pointers to 16 valid elements (64 bytes read, 32
            // written, unaligned forms); AVX-512F is enabled in this function.
            let x = unsafe { _mm512_loadu_si512(s.cast()) };
            let high = _mm512_srli_epi32::<16>(x);
            let lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
            let rounded = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb);
            let rounded = _mm512_srli_epi32::<16>(rounded);
            let nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff)), inf());
            let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x0040));
            let h = _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
            // SAFETY: as above.
            unsafe { _mm256_storeu_si256(d.cast(), h) }
        })
    }

    /// The bits of f32 +infinity in every lane: above it (as unsigned, sign cleared) lie the NaNs.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn inf() -> __m512i {
        _mm512_set1_epi32(0x7f80_0000)
    }
}

/// f16 → f32, exact, branch-free so that it vectorises inside a caller's loop (a product that
/// widens K or V as it reads them): the exponent and mantissa bits moved to f32's positions and
/// scaled by 2^112 (the difference of the exponent biases; this also turns f16 subnormals into
/// the right normal f32), infinities and NaNs given f32's all-ones exponent, the sign put back.
#[inline(always)]
pub(crate) fn f16_to_f32(h: f16) -> f32 {
    const SCALE: f32 = f32::from_bits((127 + 112) << 23); // 2^112
    let h = u32::from(h.to_bits());
    let em = (h & 0x7fff) << 13;
    let finite = f32::from_bits(em) * SCALE;
    let v = if em >= 0x7c00 << 13 {
        f32::from_bits(em | 0x7f80_0000)
    } else {
        finite
    };
    f32::from_bits(v.to_bits() | ((h & 0x8000) << 16))
}

/// An element type rows are stored in, widened to f32 exactly, one element at a time, where a
/// product uses it.
pub(crate) trait Widen: Copy {
    fn widen(self) -> f32;
}

impl Widen for bf16 {
    /// bf16 is the high half of an f32: exact (a NaN stays a NaN).
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

impl Widen for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f16_to_f32(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The paths this CPU can run (the others are then the portable or F16C path again, and
    /// the tests say so on stderr).
    fn paths() -> Vec<Path> {
        let has = detect();
        if has != Path::Avx512 {
            eprintln!("this CPU lacks AVX-512F: its conversion paths are compiled but not run here");
        }
        [Path::Avx512, Path::F16c, Path::Portable].into_iter().filter(|&p| p as u8 >= has as u8).collect()
    }

    /// Lengths that leave every remainder of 8 and 16, and offsets that misalign the rows.
    const LENS: [usize; 8] = [0, 1, 7, 8, 15, 16, 17, 133];

    #[test]
    fn widening_is_half_on_every_16_bit_pattern() {
        let f16s: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let bf16s: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        for path in paths() {
            for off in [0, 1, 3] {
                let mut out = vec![0.0f32; 65536 - off];
                widen_f16_on(path, &f16s[off..], &mut out);
                for (h, x) in f16s[off..].iter().zip(&out) {
                    assert_eq!(x.to_bits(), h.to_f32().to_bits(), "{path:?} f16 {:#06x}", h.to_bits());
                    assert_eq!(x.to_bits(), f16::to_f32_const(*h).to_bits(), "{path:?} f16 {:#06x}", h.to_bits());
                }
                widen_bf16_on(path, &bf16s[off..], &mut out);
                for (h, x) in bf16s[off..].iter().zip(&out) {
                    assert_eq!(x.to_bits(), h.to_f32().to_bits(), "{path:?} bf16 {:#06x}", h.to_bits());
                }
            }
            for n in LENS {
                let mut out = vec![-1.0f32; n + 3];
                widen_f16_on(path, &f16s[1000..1000 + n], &mut out);
                assert!(out[n..].iter().all(|&x| x == -1.0), "{path:?} wrote past {n}");
                widen_bf16_on(path, &bf16s[16_000..16_000 + n], &mut out);
                assert!(out[n..].iter().all(|&x| x == -1.0), "{path:?} wrote past {n}");
                for (x, h) in out.iter().zip(&bf16s[16_000..16_000 + n]) {
                    assert_eq!(x.to_bits(), h.to_f32().to_bits());
                }
            }
        }
    }

    /// f32 values at every edge of both narrowings: zeros, f16 and bf16 subnormals and their
    /// underflow, values halfway between two 16-bit neighbours (both parities, and just off
    /// halfway), the largest finite values and overflow to infinity, infinities, quiet and
    /// signalling NaNs with payloads; plus a sweep of bit patterns across the whole f32 range.
    fn edge_values() -> Vec<f32> {
        let mut bits: Vec<u32> = vec![
            0,
            1,
            0x0000_8000,
            0x007f_ffff,
            0x0080_0000,
            0x3380_0000, // 2^-24: f16's smallest subnormal
            0x3300_0000, // 2^-25: halfway to 0
            0x3300_0001,
            0x3340_0000,
            0x387f_c000, // halfway below f16's smallest normal
            0x3880_0000,
            0x3f80_1000, // 1 + 2^-11: halfway between f16 1 and its successor (even: down)
            0x3f80_3000, // 1 + 3·2^-11: halfway, odd: up
            0x3f80_1001,
            0x3f80_0fff,
            0x3f80_8000, // 1 + 2^-8: halfway for bf16 (even: down)
            0x3f81_8000, // odd: up
            0x3f80_8001,
            0x3f80_7fff,
            0x477f_e000, // 65504: f16's largest
            0x477f_efff, // just below the halfway to 65536
            0x477f_f000, // halfway: rounds to infinity
            0x4780_0000,
            0x7f7f_ffff, // f32's largest: bf16 infinity
            0x7f7f_7fff,
            0x7f7f_8000,
            0x7f80_0000, // +inf
            0x7f80_0001, // signalling NaN, payload in the low bits only
            0x7f80_2000,
            0x7fa0_0000, // signalling NaN with a high payload
            0x7fc0_0000, // quiet NaN
            0x7fff_ffff,
            0x7f81_0000,
            0x7f80_8000,
        ];
        let negs: Vec<u32> = bits.iter().map(|b| b | 0x8000_0000).collect();
        bits.extend(negs);
        bits.extend((0..200_000u32).map(|i| i.wrapping_mul(21_475)));
        bits.extend((0..=u16::MAX as u32).map(|h| h << 16 | 0x8000)); // every bf16 halfway
        bits.extend((0..=u16::MAX as u32).map(|h| f16::from_bits(h as u16).to_f32().to_bits() + 0x1000));
        bits.into_iter().map(f32::from_bits).collect()
    }

    #[test]
    fn narrowing_is_half_on_edge_values() {
        let xs = edge_values();
        for path in paths() {
            let mut h = vec![f16::ZERO; xs.len()];
            narrow_f16_on(path, &xs, &mut h);
            for (x, h) in xs.iter().zip(&h) {
                let want = f16::from_f32(*x).to_bits();
                assert_eq!(h.to_bits(), want, "{path:?} f16 of {:#010x}", x.to_bits());
                assert_eq!(h.to_bits(), f16::from_f32_const(*x).to_bits(), "{path:?} f16 of {:#010x}", x.to_bits());
            }
            let mut b = vec![bf16::ZERO; xs.len()];
            narrow_bf16_on(path, &xs, &mut b);
            for (x, b) in xs.iter().zip(&b) {
                assert_eq!(b.to_bits(), bf16::from_f32(*x).to_bits(), "{path:?} bf16 of {:#010x}", x.to_bits());
                assert_eq!(b.is_nan(), x.is_nan());
            }
            for n in LENS {
                let mut h = vec![f16::ONE; n + 3];
                narrow_f16_on(path, &xs[5..5 + n], &mut h);
                assert!(h[n..].iter().all(|&x| x == f16::ONE), "{path:?} wrote past {n}");
                assert!(h[..n].iter().zip(&xs[5..]).all(|(h, x)| h.to_bits() == f16::from_f32(*x).to_bits()));
                let mut b = vec![bf16::ONE; n + 3];
                narrow_bf16_on(path, &xs[5..5 + n], &mut b);
                assert!(b[n..].iter().all(|&x| x == bf16::ONE), "{path:?} wrote past {n}");
                assert!(b[..n].iter().zip(&xs[5..]).all(|(b, x)| b.to_bits() == bf16::from_f32(*x).to_bits()));
            }
        }
    }

    #[test]
    fn scalar_f16_widening_is_exact() {
        for h in (0..=u16::MAX).map(f16::from_bits) {
            let (w, want) = (f16_to_f32(h), h.to_f32());
            assert!(want.to_bits() == w.to_bits() || (want.is_nan() && w.is_nan()), "{h:?}: {w} vs {want}");
            assert_eq!(w.to_bits(), h.widen().to_bits());
        }
    }
}

//! AVX-512 products of group-1 decode in blocks of [`KB`] keys (`inplace::sweep_blocks`): one
//! query row per kv head, the scores of a block's keys, then `O·scale + P·V` over the block.
//!
//! Why blocks: the one-key sweep (`sweep_rows`) runs a serial chain per key (dot product,
//! horizontal sum, max, exp2, rescale of O in memory, `o += p·v`), and it measured bound by that
//! chain's latency, not by the bytes it reads. Here a block's scores are independent dot
//! products (four keys' accumulators in flight) reduced together into one 16-lane vector (a
//! transpose-and-add tree: about two shuffles per key instead of a horizontal sum each), the
//! softmax runs once per block on that vector, and O stays in registers while the block's V rows
//! are added.
//!
//! Rows are read 32 elements at a time as two f32 vectors in a *lane order* of their type
//! ([`lane_order`]): f32 and f16 in order (f16 through `vcvtph2ps`); bf16 as its even elements
//! (the 32-bit lane shifted left by 16) and its odd elements (the lane's high half kept), one
//! load and two integer operations per 32 elements instead of a widening move per 16. The query
//! is permuted into the same order once per call and O is kept in it, so every product pairs
//! the same elements as in natural order; the caller puts O back in order at the end.
#![allow(clippy::incompatible_msrv)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Keys per block: one score per lane of a 512-bit vector.
pub(super) const KB: usize = 16;
/// Largest `head_dim / 32` the kernels take (head_dim 256); larger head dims take `sweep_rows`.
pub(super) const MAX_W: usize = 8;

/// How a K/V element type is read.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Kind {
    F32,
    F16,
    BF16,
}

/// A K/V element type of the blocked decode.
pub(super) trait Elem: Copy + Sync {
    const KIND: Kind;
}

impl Elem for f32 {
    const KIND: Kind = Kind::F32;
}

impl Elem for half::f16 {
    const KIND: Kind = Kind::F16;
}

impl Elem for half::bf16 {
    const KIND: Kind = Kind::BF16;
}

/// Position `p` (0..32) of the two vectors [`load32`] returns (`p < 16`: the first) holds
/// element `lane_order(kind)[p]` of the 32.
pub(super) fn lane_order(kind: Kind) -> [usize; 32] {
    match kind {
        Kind::F32 | Kind::F16 => std::array::from_fn(|p| p),
        Kind::BF16 => std::array::from_fn(|p| if p < 16 { 2 * p } else { 2 * (p - 16) + 1 }),
    }
}

/// Elements `at..at + 32` of `x` as two f32 vectors in [`lane_order`]; exact (a bf16 is the high
/// half of its f32; `vcvtph2ps` converts every f16, subnormals and NaNs included, exactly).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn load32<T: Elem>(x: &[T], at: usize) -> (__m512, __m512) {
    let s = &x[at..at + 32];
    let p = s.as_ptr();
    match T::KIND {
        Kind::F32 => {
            let p = p as *const f32;
            // SAFETY: `s` holds 32 f32 (sliced above, so bounds-checked); unaligned loads.
            unsafe { (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))) }
        }
        Kind::F16 => {
            let p = p as *const __m256i;
            // SAFETY: `s` holds 32 f16 (64 bytes, bounds-checked above) read as two 32-byte
            // unaligned loads.
            let (a, b) = unsafe { (_mm256_loadu_si256(p), _mm256_loadu_si256(p.add(1))) };
            (_mm512_cvtph_ps(a), _mm512_cvtph_ps(b))
        }
        Kind::BF16 => {
            // SAFETY: `s` holds 32 bf16 (64 bytes, bounds-checked above): one unaligned load.
            let w = unsafe { _mm512_loadu_si512(p as *const __m512i) };
            let even = _mm512_slli_epi32::<16>(w);
            let odd = _mm512_and_si512(w, _mm512_set1_epi32(0xffff_0000_u32 as i32));
            (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
        }
    }
}

/// 16 f32 from `x[at..at + 16]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn load16(x: &[f32], at: usize) -> __m512 {
    let s = &x[at..at + 16];
    // SAFETY: `s` holds 16 f32 (bounds-checked above); an unaligned load.
    unsafe { _mm512_loadu_ps(s.as_ptr()) }
}

/// Stores 16 f32 into `x[at..at + 16]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn store16(x: &mut [f32], at: usize, v: __m512) {
    let s = &mut x[at..at + 16];
    // SAFETY: `s` holds 16 f32 (bounds-checked above); an unaligned store.
    unsafe { _mm512_storeu_ps(s.as_mut_ptr(), v) }
}

/// `x + y` quarters: `[x.q0 + x.q2, x.q1 + x.q3, y.q0 + y.q2, y.q1 + y.q3]` (128-bit quarters).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn fold_halves(x: __m512, y: __m512) -> __m512 {
    let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y);
    let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y);
    _mm512_add_ps(lo, hi)
}

/// `[x.q0 + x.q1, x.q2 + x.q3, y.q0 + y.q1, y.q2 + y.q3]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn fold_quarters(x: __m512, y: __m512) -> __m512 {
    let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y);
    let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y);
    _mm512_add_ps(lo, hi)
}

/// The 16 horizontal sums of `v` as one vector, lane `t` the sum of `v[t]`: pairs of vectors
/// folded into one (halves, quarters, then pairs and single lanes inside each quarter), 15 adds
/// and 31 shuffles for the 16 sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn hsum16(v: &[__m512; KB]) -> __m512 {
    // w[i]: quarters 0-1 hold 8 partials of v[2i], quarters 2-3 of v[2i + 1].
    let w: [__m512; 8] = std::array::from_fn(|i| fold_halves(v[2 * i], v[2 * i + 1]));
    // z[j]: quarter r holds 4 partials of v[4j + r].
    let z: [__m512; 4] = std::array::from_fn(|j| fold_quarters(w[2 * j], w[2 * j + 1]));
    // Inside each quarter r: u0 = [2 partials of v[r], 2 of v[4 + r]], u1 likewise for 8 + r, 12 + r.
    let pairs = |x: __m512, y: __m512| {
        let lo = _mm512_shuffle_ps::<0b01_00_01_00>(x, y);
        let hi = _mm512_shuffle_ps::<0b11_10_11_10>(x, y);
        _mm512_add_ps(lo, hi)
    };
    let (u0, u1) = (pairs(z[0], z[1]), pairs(z[2], z[3]));
    let lo = _mm512_shuffle_ps::<0b10_00_10_00>(u0, u1);
    let hi = _mm512_shuffle_ps::<0b11_01_11_01>(u0, u1);
    // Lane 4r + c holds the sum of v[4c + r]: transpose the 4×4.
    let s = _mm512_add_ps(lo, hi);
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(idx, s)
}

/// Scores `q · k_t` of the block's `n <= KB` keys, key `t`'s row at `k[kofs[t]..][..32·W]`; `q`
/// is permuted into `T`'s [`lane_order`] per 32 elements. Lanes `n..` are 0.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[inline]
pub(super) fn scores<T: Elem, const W: usize>(q: &[f32], k: &[T], kofs: &[usize]) -> [f32; KB] {
    let n = kofs.len().min(KB);
    let qv: [[__m512; 2]; W] = std::array::from_fn(|x| [load16(q, 32 * x), load16(q, 32 * x + 16)]);
    let zero = _mm512_setzero_ps();
    let mut sums = [zero; KB];
    let mut t0 = 0;
    while t0 < n {
        // Four keys at a time, two accumulators each: eight independent FMA chains.
        let m = (n - t0).min(4);
        let mut acc = [[zero; 2]; 4];
        for (x, qx) in qv.iter().enumerate() {
            for (i, a) in acc.iter_mut().enumerate().take(m) {
                let (ka, kb) = load32(k, kofs[t0 + i] + 32 * x);
                a[0] = _mm512_fmadd_ps(qx[0], ka, a[0]);
                a[1] = _mm512_fmadd_ps(qx[1], kb, a[1]);
            }
        }
        for (i, a) in acc.iter().enumerate().take(m) {
            sums[t0 + i] = _mm512_add_ps(a[0], a[1]);
        }
        t0 += m;
    }
    let mut out = [0.0f32; KB];
    store16(&mut out, 0, hsum16(&sums));
    out
}

/// `o = o · scale + Σ_t p[t] · v_t` over the block's `n <= KB` keys, key `t`'s row at
/// `v[vofs[t]..][..32·W]`; `o` (`32·W` floats) in `T`'s [`lane_order`] per 32 elements, held in
/// registers across the keys.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[inline]
pub(super) fn scale_add_pv<T: Elem, const W: usize>(o: &mut [f32], scale: f32, p: &[f32; KB], v: &[T], vofs: &[usize]) {
    let sc = _mm512_set1_ps(scale);
    let mut acc: [[__m512; 2]; W] =
        std::array::from_fn(|x| [_mm512_mul_ps(load16(o, 32 * x), sc), _mm512_mul_ps(load16(o, 32 * x + 16), sc)]);
    for (&pt, &vo) in p.iter().zip(vofs) {
        let pv = _mm512_set1_ps(pt);
        for (x, a) in acc.iter_mut().enumerate() {
            let (va, vb) = load32(v, vo + 32 * x);
            a[0] = _mm512_fmadd_ps(pv, va, a[0]);
            a[1] = _mm512_fmadd_ps(pv, vb, a[1]);
        }
    }
    for (x, a) in acc.iter().enumerate() {
        store16(o, 32 * x, a[0]);
        store16(o, 32 * x + 16, a[1]);
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    fn has_avx512() -> bool {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma")
    }

    /// The vector widening gives `half`'s conversion bit for bit, in `lane_order`, for every
    /// 16-bit pattern (NaNs stay NaNs with the same bits for bf16; f16 NaNs stay NaNs).
    #[test]
    fn widening_matches_half_bit_for_bit() {
        if !has_avx512() {
            eprintln!("no AVX-512 on this CPU: the widening test has nothing to run");
            return;
        }
        let bits: Vec<u16> = (0..=u16::MAX).collect();
        for kind in [Kind::BF16, Kind::F16] {
            let ord = lane_order(kind);
            for c in bits.chunks_exact(32) {
                let mut got = [0.0f32; 32];
                // SAFETY: AVX-512F was detected above, the only requirement of `load32`.
                let (a, b) = unsafe {
                    match kind {
                        Kind::BF16 => load32(&c.iter().map(|&x| half::bf16::from_bits(x)).collect::<Vec<_>>(), 0),
                        _ => load32(&c.iter().map(|&x| half::f16::from_bits(x)).collect::<Vec<_>>(), 0),
                    }
                };
                // SAFETY: as above.
                unsafe {
                    store16(&mut got, 0, a);
                    store16(&mut got, 16, b);
                }
                for (pos, &g) in got.iter().enumerate() {
                    let h = c[ord[pos]];
                    let want = match kind {
                        Kind::BF16 => half::bf16::from_bits(h).to_f32(),
                        _ => half::f16::from_bits(h).to_f32(),
                    };
                    let same = want.to_bits() == g.to_bits() || (want.is_nan() && g.is_nan());
                    assert!(same, "{kind:?} {h:#06x}: {g} vs {want}");
                    if kind == Kind::BF16 {
                        assert_eq!(g.to_bits(), u32::from(h) << 16);
                    }
                }
            }
        }
    }

    /// The block's scores and `o·scale + P·V` against scalar sums, for every key count and head
    /// dims 32..256, f32 and bf16 rows at odd offsets.
    #[test]
    fn block_products_match_scalar_sums() {
        if !has_avx512() {
            eprintln!("no AVX-512 on this CPU: the block product test has nothing to run");
            return;
        }
        fn check<const W: usize>() {
            let d = 32 * W;
            let rows = KB + 3;
            let val = |i: usize| (((i * 37) % 101) as f32 / 101.0 - 0.5) * 2.0;
            let kf: Vec<f32> = (0..rows * d + 5).map(val).collect();
            let kb: Vec<half::bf16> = kf.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let q: Vec<f32> = (0..d).map(|i| val(i * 7 + 3)).collect();
            for n in 1..=KB {
                let ofs: Vec<usize> = (0..n).map(|t| 5 + ((t * 5) % rows) * d).collect();
                let p: [f32; KB] = std::array::from_fn(|t| if t < n { val(t * 11 + 1) } else { 0.0 });
                for kind in [Kind::F32, Kind::BF16] {
                    let ord = lane_order(kind);
                    let perm = |x: &[f32]| -> Vec<f32> { (0..d).map(|i| x[i / 32 * 32 + ord[i % 32]]).collect() };
                    let row = |t: usize| -> Vec<f32> {
                        let r = ofs[t]..ofs[t] + d;
                        match kind {
                            Kind::BF16 => kb[r].iter().map(|x| x.to_f32()).collect(),
                            _ => kf[r].to_vec(),
                        }
                    };
                    let qp = perm(&q);
                    // SAFETY: AVX-512F and FMA were detected above.
                    let s = unsafe {
                        match kind {
                            Kind::BF16 => scores::<half::bf16, W>(&qp, &kb, &ofs),
                            _ => scores::<f32, W>(&qp, &kf, &ofs),
                        }
                    };
                    for (t, &st) in s.iter().enumerate() {
                        let want: f64 = if t < n {
                            row(t).iter().zip(&q).map(|(&a, &b)| a as f64 * b as f64).sum()
                        } else {
                            0.0
                        };
                        assert!((st as f64 - want).abs() < 1e-4, "W {W} n {n} {kind:?} key {t}: {st} vs {want}");
                    }
                    let o0: Vec<f32> = (0..d).map(|i| val(i + 50)).collect();
                    let mut o = perm(&o0);
                    // SAFETY: as above.
                    unsafe {
                        match kind {
                            Kind::BF16 => scale_add_pv::<half::bf16, W>(&mut o, 0.5, &p, &kb, &ofs),
                            _ => scale_add_pv::<f32, W>(&mut o, 0.5, &p, &kf, &ofs),
                        }
                    };
                    for i in 0..d {
                        let e = i / 32 * 32 + ord[i % 32];
                        let want: f64 = o0[e] as f64 * 0.5 + (0..n).map(|t| p[t] as f64 * row(t)[e] as f64).sum::<f64>();
                        assert!((o[i] as f64 - want).abs() < 1e-4, "W {W} n {n} {kind:?} o[{e}]: {} vs {want}", o[i]);
                    }
                }
            }
        }
        check::<1>();
        check::<2>();
        check::<3>();
        check::<4>();
        check::<8>();
    }
}

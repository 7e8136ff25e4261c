//! The products of decode in blocks of [`BLOCK_KEYS`] keys (`inplace::sweep_key_blocks_with`), written once over
//! the vector instructions of an ISA ([`Lanes`]: AVX-512 in [`Avx512`], AVX2 + FMA + F16C in
//! [`Avx2`]): the scores of a tile of `R` query rows (of one kv head) against a block's keys, then
//! `O·scale + P·V` of those rows over the block.
//!
//! Why blocks: the one-key sweep (`sweep_key_by_key`) runs a serial chain per key (dot product,
//! horizontal sum, max, exp2, rescale of O in memory, `o += p·v`), and it measured bound by that
//! chain's latency, not by the bytes it reads. Here a block's scores are independent dot
//! products (several keys' accumulators in flight) reduced together into 16 lanes (a
//! transpose-and-add tree: about two shuffles per key instead of a horizontal sum each), the
//! softmax runs once per block and row, and O stays in registers while the block's V rows are
//! added. With `R > 1` rows (GQA: the query heads of one kv head) every K and V vector loaded is
//! used for all `R` rows. The key-order sweep over several kv heads (`inplace::key_block_in_key_order`)
//! takes a block's keys in groups ([`key_sums`]) and sums each key alone with the same tree
//! ([`Lanes::hsum_one`]), trading those shuffles for sequential reads of K and V.
//!
//! Rows are read 32 elements at a time as `32 / lanes` f32 vectors in a *lane order* of their
//! type ([`lane_order`]): f32 and f16 in order (f16 through `vcvtph2ps`); bf16 per `2 · lanes`
//! elements as their even elements (the 32-bit lane shifted left by 16) and their odd elements
//! (the lane's high half kept), one load and two integer operations per `2 · lanes` elements
//! instead of a widening move per `lanes`. The query is permuted into the same order once per
//! call and O is kept in it, so every product pairs the same elements as in natural order; the
//! caller puts O back in order at the end.
#![allow(clippy::incompatible_msrv)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Keys per block: one score per lane of a 512-bit vector, two 256-bit vectors.
pub(super) const BLOCK_KEYS: usize = 16;
/// Largest `head_dim / 32` the kernels take (head_dim 256); larger head dims take `sweep_key_by_key`.
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

/// Position `p` (0..32) of the `32 / lanes` vectors [`Lanes::load32`] returns (vector `p /
/// lanes`, lane `p % lanes`) holds element `lane_order(kind, lanes)[p]` of the 32.
pub(super) fn lane_order(kind: Kind, lanes: usize) -> [usize; 32] {
    match kind {
        Kind::F32 | Kind::F16 => std::array::from_fn(|p| p),
        Kind::BF16 => std::array::from_fn(|p| {
            let (chunk, at) = (p / (2 * lanes), p % (2 * lanes));
            2 * lanes * chunk + if at < lanes { 2 * at } else { 2 * (at - lanes) + 1 }
        }),
    }
}

/// The vector instructions of one ISA, as the blocked decode uses them. A value of an
/// implementing type exists only where its instructions were detected on this CPU (its `new`
/// checks), which is what makes the methods safe; they are `#[inline(always)]` so that they are
/// compiled into the caller, which must itself be compiled for the ISA (a `#[target_feature]`
/// function) for the intrinsics to become single instructions.
pub(super) trait Lanes: Copy {
    /// f32 lanes per vector.
    const LANES: usize;
    /// 32-element units (of `32 / LANES` vectors) of accumulators a product tile keeps in
    /// registers (besides the vectors it loads).
    const ACC_UNITS: usize;
    /// Most query rows of one product tile.
    const MAX_R: usize;
    /// One vector.
    type V: Copy;
    /// 32 f32 as `32 / LANES` vectors.
    type U: Copy;
    fn zero(self) -> Self::U;
    /// Elements `at..at + 32` of `x` in [`lane_order`]; exact.
    fn load32<T: Elem>(self, x: &[T], at: usize) -> Self::U;
    /// `x[at..at + 32]` (f32 already in lane order).
    fn load(self, x: &[f32], at: usize) -> Self::U;
    fn store(self, x: &mut [f32], at: usize, u: Self::U);
    /// `a · b + c`, lane by lane.
    fn fma(self, a: Self::U, b: Self::U, c: Self::U) -> Self::U;
    /// `s · b + c`.
    fn fma_s(self, s: f32, b: Self::U, c: Self::U) -> Self::U;
    /// `a · s`.
    fn mul_s(self, a: Self::U, s: f32) -> Self::U;
    /// The unit's vectors added into one.
    fn fold(self, u: Self::U) -> Self::V;
    /// The horizontal sum of one vector, bit for bit lane `t` of [`Lanes::hsum_keys`] with `v`
    /// as its `v[t]` (the same additions in the same order).
    fn hsum_one(self, v: Self::V) -> f32;
    /// The horizontal sums of the 16 vectors, lane `t` of the result the sum of `v[t]`.
    fn hsum_keys(self, v: &[Self::V; BLOCK_KEYS]) -> [f32; BLOCK_KEYS];
}

/// The AVX-512F + FMA instructions.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Avx512(());

#[cfg(target_arch = "x86_64")]
impl Avx512 {
    /// `Some` where this CPU has AVX-512F and FMA.
    pub(super) fn new() -> Option<Self> {
        (std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma")).then_some(Avx512(()))
    }
}

/// The AVX2 + FMA + F16C instructions (every AVX2 CPU with FMA has F16C: Haswell, Zen).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Avx2(());

#[cfg(target_arch = "x86_64")]
impl Avx2 {
    /// `Some` where this CPU has AVX2, FMA and F16C.
    pub(super) fn new() -> Option<Self> {
        let has = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        has.then_some(Avx2(()))
    }
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
fn hsum16(v: &[__m512; BLOCK_KEYS]) -> __m512 {
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

/// The 8 horizontal sums of `v` as one vector, lane `t` the sum of `v[t]`: the same tree in
/// 256-bit vectors (halves, then pairs and single lanes inside each half, then the lane order).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn hsum8(v: &[__m256; 8]) -> __m256 {
    // w[i]: the low half holds 4 partials of v[2i], the high half of v[2i + 1].
    let w: [__m256; 4] = std::array::from_fn(|i| {
        let (x, y) = (v[2 * i], v[2 * i + 1]);
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(x, y), _mm256_permute2f128_ps::<0x31>(x, y))
    });
    // Half h of z0: [2 partials of v[h], 2 of v[2 + h]]; of z1: likewise for 4 + h, 6 + h.
    let pairs = |x: __m256, y: __m256| {
        let lo = _mm256_shuffle_ps::<0b01_00_01_00>(x, y);
        let hi = _mm256_shuffle_ps::<0b11_10_11_10>(x, y);
        _mm256_add_ps(lo, hi)
    };
    let (z0, z1) = (pairs(w[0], w[1]), pairs(w[2], w[3]));
    let lo = _mm256_shuffle_ps::<0b10_00_10_00>(z0, z1);
    let hi = _mm256_shuffle_ps::<0b11_01_11_01>(z0, z1);
    // Lane 4h + c holds the sum of v[2c + h].
    let s = _mm256_add_ps(lo, hi);
    _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx512 {
    const LANES: usize = 16;
    const ACC_UNITS: usize = 8;
    const MAX_R: usize = 4;
    type V = __m512;
    type U = [__m512; 2];

    #[inline(always)]
    fn zero(self) -> Self::U {
        // SAFETY (this and every `unsafe` block of this impl): an `Avx512` exists only where
        // `Avx512::new` detected AVX-512F and FMA, the only requirement of these intrinsics;
        // every memory access is on a bounds-checked slice, unaligned.
        unsafe { [_mm512_setzero_ps(); 2] }
    }

    #[inline(always)]
    fn load32<T: Elem>(self, x: &[T], at: usize) -> Self::U {
        let s = &x[at..at + 32];
        let p = s.as_ptr();
        match T::KIND {
            Kind::F32 => {
                let p = p as *const f32;
                // SAFETY: as above; `s` holds 32 f32.
                unsafe { [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))] }
            }
            Kind::F16 => {
                let p = p as *const __m256i;
                // SAFETY: as above; `s` holds 32 f16 (64 bytes), two 32-byte loads.
                unsafe { [_mm512_cvtph_ps(_mm256_loadu_si256(p)), _mm512_cvtph_ps(_mm256_loadu_si256(p.add(1)))] }
            }
            Kind::BF16 => {
                // SAFETY: as above; `s` holds 32 bf16 (64 bytes), one load.
                unsafe {
                    let w = _mm512_loadu_si512(p as *const __m512i);
                    let even = _mm512_slli_epi32::<16>(w);
                    let odd = _mm512_and_si512(w, _mm512_set1_epi32(0xffff_0000_u32 as i32));
                    [_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd)]
                }
            }
        }
    }

    #[inline(always)]
    fn load(self, x: &[f32], at: usize) -> Self::U {
        let s = &x[at..at + 32];
        // SAFETY: as above; `s` holds 32 f32.
        unsafe { [_mm512_loadu_ps(s.as_ptr()), _mm512_loadu_ps(s.as_ptr().add(16))] }
    }

    #[inline(always)]
    fn store(self, x: &mut [f32], at: usize, u: Self::U) {
        let s = &mut x[at..at + 32];
        // SAFETY: as above; `s` holds 32 f32.
        unsafe {
            _mm512_storeu_ps(s.as_mut_ptr(), u[0]);
            _mm512_storeu_ps(s.as_mut_ptr().add(16), u[1]);
        }
    }

    #[inline(always)]
    fn fma(self, a: Self::U, b: Self::U, c: Self::U) -> Self::U {
        // SAFETY: as above.
        unsafe { [_mm512_fmadd_ps(a[0], b[0], c[0]), _mm512_fmadd_ps(a[1], b[1], c[1])] }
    }

    #[inline(always)]
    fn fma_s(self, s: f32, b: Self::U, c: Self::U) -> Self::U {
        // SAFETY: as above.
        unsafe {
            let s = _mm512_set1_ps(s);
            [_mm512_fmadd_ps(s, b[0], c[0]), _mm512_fmadd_ps(s, b[1], c[1])]
        }
    }

    #[inline(always)]
    fn mul_s(self, a: Self::U, s: f32) -> Self::U {
        // SAFETY: as above.
        unsafe {
            let s = _mm512_set1_ps(s);
            [_mm512_mul_ps(a[0], s), _mm512_mul_ps(a[1], s)]
        }
    }

    #[inline(always)]
    fn fold(self, u: Self::U) -> Self::V {
        // SAFETY: as above.
        unsafe { _mm512_add_ps(u[0], u[1]) }
    }

    #[inline(always)]
    fn hsum_one(self, v: Self::V) -> f32 {
        // SAFETY: as above.
        unsafe {
            // `hsum16`'s tree for one key: quarters q0 + q2 and q1 + q3 (`fold_halves`), their
            // sum (`fold_quarters`), then lanes 0 + 2 and 1 + 3 (`pairs`), then those two.
            let a = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b01_00_11_10>(v, v));
            let z = _mm512_castps512_ps128(_mm512_add_ps(a, _mm512_shuffle_f32x4::<0b00_11_00_01>(a, a)));
            let c = _mm_add_ps(z, _mm_shuffle_ps::<0b01_00_11_10>(z, z));
            _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps::<0b00_00_00_01>(c, c)))
        }
    }

    #[inline(always)]
    fn hsum_keys(self, v: &[Self::V; BLOCK_KEYS]) -> [f32; BLOCK_KEYS] {
        let mut out = [0.0f32; BLOCK_KEYS];
        // SAFETY: as above; `out` holds 16 f32.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), hsum16(v)) };
        out
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx2 {
    const LANES: usize = 8;
    // 16 registers: 8 accumulators, a loaded unit (4), a broadcast.
    const ACC_UNITS: usize = 2;
    const MAX_R: usize = 2;
    type V = __m256;
    type U = [__m256; 4];

    #[inline(always)]
    fn zero(self) -> Self::U {
        // SAFETY (this and every `unsafe` block of this impl): an `Avx2` exists only where
        // `Avx2::new` detected AVX2, FMA and F16C, the only requirements of these intrinsics;
        // every memory access is on a bounds-checked slice, unaligned.
        unsafe { [_mm256_setzero_ps(); 4] }
    }

    #[inline(always)]
    fn load32<T: Elem>(self, x: &[T], at: usize) -> Self::U {
        let s = &x[at..at + 32];
        let p = s.as_ptr();
        match T::KIND {
            Kind::F32 => {
                let p = p as *const f32;
                // SAFETY: as above; `s` holds 32 f32.
                unsafe { std::array::from_fn(|i| _mm256_loadu_ps(p.add(8 * i))) }
            }
            Kind::F16 => {
                let p = p as *const __m128i;
                // SAFETY: as above; `s` holds 32 f16 (64 bytes), four 16-byte loads.
                unsafe { std::array::from_fn(|i| _mm256_cvtph_ps(_mm_loadu_si128(p.add(i)))) }
            }
            Kind::BF16 => {
                let p = p as *const __m256i;
                // SAFETY: as above; `s` holds 32 bf16 (64 bytes), two 32-byte loads.
                unsafe {
                    let hi = _mm256_set1_epi32(0xffff_0000_u32 as i32);
                    let (a, b) = (_mm256_loadu_si256(p), _mm256_loadu_si256(p.add(1)));
                    [
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(a)),
                        _mm256_castsi256_ps(_mm256_and_si256(a, hi)),
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(b)),
                        _mm256_castsi256_ps(_mm256_and_si256(b, hi)),
                    ]
                }
            }
        }
    }

    #[inline(always)]
    fn load(self, x: &[f32], at: usize) -> Self::U {
        let s = &x[at..at + 32];
        // SAFETY: as above; `s` holds 32 f32.
        unsafe { std::array::from_fn(|i| _mm256_loadu_ps(s.as_ptr().add(8 * i))) }
    }

    #[inline(always)]
    fn store(self, x: &mut [f32], at: usize, u: Self::U) {
        let s = &mut x[at..at + 32];
        for (i, v) in u.into_iter().enumerate() {
            // SAFETY: as above; `s` holds 32 f32.
            unsafe { _mm256_storeu_ps(s.as_mut_ptr().add(8 * i), v) };
        }
    }

    #[inline(always)]
    fn fma(self, a: Self::U, b: Self::U, c: Self::U) -> Self::U {
        // SAFETY: as above.
        unsafe { std::array::from_fn(|i| _mm256_fmadd_ps(a[i], b[i], c[i])) }
    }

    #[inline(always)]
    fn fma_s(self, s: f32, b: Self::U, c: Self::U) -> Self::U {
        // SAFETY: as above.
        unsafe {
            let s = _mm256_set1_ps(s);
            std::array::from_fn(|i| _mm256_fmadd_ps(s, b[i], c[i]))
        }
    }

    #[inline(always)]
    fn mul_s(self, a: Self::U, s: f32) -> Self::U {
        // SAFETY: as above.
        unsafe {
            let s = _mm256_set1_ps(s);
            std::array::from_fn(|i| _mm256_mul_ps(a[i], s))
        }
    }

    #[inline(always)]
    fn fold(self, u: Self::U) -> Self::V {
        // SAFETY: as above.
        unsafe { _mm256_add_ps(_mm256_add_ps(u[0], u[1]), _mm256_add_ps(u[2], u[3])) }
    }

    #[inline(always)]
    fn hsum_one(self, v: Self::V) -> f32 {
        // SAFETY: as above.
        unsafe {
            // `hsum8`'s tree for one key: the halves' sum, then lanes 0 + 2 and 1 + 3, then
            // those two.
            let z = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let c = _mm_add_ps(z, _mm_shuffle_ps::<0b01_00_11_10>(z, z));
            _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps::<0b00_00_00_01>(c, c)))
        }
    }

    #[inline(always)]
    fn hsum_keys(self, v: &[Self::V; BLOCK_KEYS]) -> [f32; BLOCK_KEYS] {
        let mut out = [0.0f32; BLOCK_KEYS];
        let (lo, hi) = v.split_at(8);
        let (lo, hi): (&[__m256; 8], &[__m256; 8]) = (lo.try_into().unwrap(), hi.try_into().unwrap());
        // SAFETY: as above; `out` holds 16 f32.
        unsafe {
            let (a, b) = (hsum8(lo), hsum8(hi));
            _mm256_storeu_ps(out.as_mut_ptr(), a);
            _mm256_storeu_ps(out.as_mut_ptr().add(8), b);
        }
        out
    }
}

/// Scores `q_r · k_t` of `R` query rows against the block's `n <= BLOCK_KEYS` keys, key `t`'s row at
/// `k[kofs[t]..][..32·W]`, row `r`'s query at `q[r·32·W..][..32·W]` in `T`'s [`lane_order`] per
/// 32 elements. Lanes `n..` are 0. Each K vector loaded is used for all `R` rows: [`key_sums`],
/// then [`Lanes::hsum_keys`].
#[inline(always)]
pub(super) fn scores<S: Lanes, T: Elem, const W: usize, const R: usize>(
    s: S,
    q: &[f32],
    k: &[T],
    kofs: &[usize],
) -> [[f32; BLOCK_KEYS]; R] {
    let mut sums: [[S::V; BLOCK_KEYS]; R] = [[s.fold(s.zero()); BLOCK_KEYS]; R];
    key_sums::<S, T, W, R, BLOCK_KEYS>(s, q, k, kofs, &mut sums);
    std::array::from_fn(|r| s.hsum_keys(&sums[r]))
}

/// The products of [`scores`] before their horizontal sums: for each row `r` and key `t` of
/// `kofs` (at most `N`), the `32·W` products `q_r · k_t` accumulated over the row in vector
/// lanes and folded into one vector, `sums[r][t]` (entries past `kofs.len()` untouched). A key's
/// lanes depend only on its own row and the query, so the keys of a block may be taken in
/// several calls (keys `t0..` as `kofs[t0..]`) and give the same bits. (An array, not a closure
/// to hand each vector to: a closure is not compiled for the caller's instruction set, so the
/// intrinsics a closure called were not inlined.)
///
/// The loops over the keys in flight and the rows have constant trip counts (bounds such as
/// `m` fold to constants per instantiation, the guards on `n` are branches) so that they unroll
/// and the accumulators live in registers.
#[inline(always)]
pub(super) fn key_sums<S: Lanes, T: Elem, const W: usize, const R: usize, const N: usize>(
    s: S,
    q: &[f32],
    k: &[T],
    kofs: &[usize],
    sums: &mut [[S::V; N]; R],
) {
    let d = 32 * W;
    let n = kofs.len().min(N);
    // Keys in flight: `R · m` accumulator units (one row: four keys).
    let m = (S::ACC_UNITS / R).clamp(1, 4);
    let zero = s.zero();
    // One row's query is held in registers where it fits (AVX-512: up to head_dim 256; in cache
    // the loads of a memory operand per FMA measured slower); otherwise each FMA reads it from L1.
    let qreg = R == 1 && W <= S::ACC_UNITS;
    let qv: [S::U; MAX_W] = std::array::from_fn(|x| if qreg && x < W { s.load(q, 32 * x) } else { zero });
    for t0 in (0..n).step_by(m) {
        let mut acc = [[zero; 4]; R];
        for (x, &qx1) in qv.iter().enumerate().take(W) {
            for i in 0..4 {
                if i < m && t0 + i < n {
                    let kx = s.load32(k, kofs[t0 + i] + 32 * x);
                    for (r, a) in acc.iter_mut().enumerate() {
                        let qx = if qreg { qx1 } else { s.load(q, r * d + 32 * x) };
                        a[i] = s.fma(qx, kx, a[i]);
                    }
                }
            }
        }
        for (sr, a) in sums.iter_mut().zip(&acc) {
            for (i, &ai) in a.iter().enumerate() {
                if i < m && t0 + i < n {
                    sr[t0 + i] = s.fold(ai);
                }
            }
        }
    }
}

/// `o_r = o_r · scale[r] + Σ_t p[r][t0 + t] · v_t` for `R` rows (the first `R` of `p`) over the
/// `n <= BLOCK_KEYS - t0` keys of `vofs`, key `t`'s row at `v[vofs[t]..][..32·W]` (a block's keys
/// `t0..`; its probabilities `p` read in place), row `r`'s output at `o[r·32·W..][..32·W]` in `T`'s
/// [`lane_order`] per 32 elements. The rows are taken in slices of `su` 32-element units that
/// fit the registers ([`Lanes::ACC_UNITS`]; one row of up to 256 elements in AVX-512 at once),
/// held there across the keys; each V vector loaded is used for all `R` rows.
#[inline(always)]
pub(super) fn scale_add_pv<S: Lanes, T: Elem, const W: usize, const R: usize>(
    s: S,
    o: &mut [f32],
    scale: [f32; R],
    (p, t0): (&[[f32; BLOCK_KEYS]], usize),
    v: &[T],
    vofs: &[usize],
) {
    let d = 32 * W;
    let su = (S::ACC_UNITS / R).clamp(1, W);
    let zero = s.zero();
    for x0 in (0..W).step_by(su) {
        let live = |j: usize| j < su && x0 + j < W;
        let mut acc = [[zero; MAX_W]; R];
        for (r, a) in acc.iter_mut().enumerate() {
            for (j, aj) in a.iter_mut().enumerate() {
                if live(j) {
                    *aj = s.mul_s(s.load(o, r * d + 32 * (x0 + j)), scale[r]);
                }
            }
        }
        for (t, &vo) in vofs.iter().enumerate().take(BLOCK_KEYS) {
            for j in 0..MAX_W {
                if live(j) {
                    let vx = s.load32(v, vo + 32 * (x0 + j));
                    for (a, pr) in acc.iter_mut().zip(p) {
                        a[j] = s.fma_s(pr[t0 + t], vx, a[j]);
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (j, &aj) in a.iter().enumerate() {
                if live(j) {
                    s.store(o, r * d + 32 * (x0 + j), aj);
                }
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// `load32` gives `half`'s conversion bit for bit, in `lane_order`, for every 16-bit pattern
    /// (NaNs stay NaNs with the same bits for bf16; f16 NaNs stay NaNs).
    fn widening_matches_half<S: Lanes>(s: S) {
        let bits: Vec<u16> = (0..=u16::MAX).collect();
        for kind in [Kind::BF16, Kind::F16] {
            let ord = lane_order(kind, S::LANES);
            for c in bits.chunks_exact(32) {
                let mut got = [0.0f32; 32];
                let u = match kind {
                    Kind::BF16 => s.load32(&c.iter().map(|&x| half::bf16::from_bits(x)).collect::<Vec<_>>(), 0),
                    _ => s.load32(&c.iter().map(|&x| half::f16::from_bits(x)).collect::<Vec<_>>(), 0),
                };
                s.store(&mut got, 0, u);
                for (pos, &g) in got.iter().enumerate() {
                    let h = c[ord[pos]];
                    let want = match kind {
                        Kind::BF16 => half::bf16::from_bits(h).to_f32(),
                        _ => half::f16::from_bits(h).to_f32(),
                    };
                    let same = want.to_bits() == g.to_bits() || (want.is_nan() && g.is_nan());
                    assert!(same, "{} lanes {kind:?} {h:#06x}: {g} vs {want}", S::LANES);
                    if kind == Kind::BF16 {
                        assert_eq!(g.to_bits(), u32::from(h) << 16);
                    }
                }
            }
        }
    }

    #[test]
    fn widening_matches_half_bit_for_bit() {
        match Avx512::new() {
            Some(s) => widening_matches_half(s),
            None => eprintln!("no AVX-512 on this CPU: its widening is not run"),
        }
        match Avx2::new() {
            Some(s) => widening_matches_half(s),
            None => eprintln!("no AVX2 + FMA + F16C on this CPU: its widening is not run"),
        }
    }

    /// The block's scores and `o·scale + P·V` of `R` rows against float64 sums, for every key
    /// count, f32 and bf16 rows at odd offsets.
    fn block_products<S: Lanes, const W: usize, const R: usize>(s: S) {
        let d = 32 * W;
        let rows = BLOCK_KEYS + 3;
        let val = |i: usize| (((i * 37) % 101) as f32 / 101.0 - 0.5) * 2.0;
        let kf: Vec<f32> = (0..rows * d + 5).map(val).collect();
        let kb: Vec<half::bf16> = kf.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let q: Vec<f32> = (0..R * d).map(|i| val(i * 7 + 3)).collect();
        let o0: Vec<f32> = (0..R * d).map(|i| val(i + 50)).collect();
        let scale: [f32; R] = std::array::from_fn(|r| 0.5 + 0.25 * r as f32);
        for n in 1..=BLOCK_KEYS {
            let ofs: Vec<usize> = (0..n).map(|t| 5 + ((t * 5) % rows) * d).collect();
            let p: [[f32; BLOCK_KEYS]; R] =
                std::array::from_fn(|r| std::array::from_fn(|t| if t < n { val(t * 11 + r + 1) } else { 0.0 }));
            for kind in [Kind::F32, Kind::BF16] {
                let ord = lane_order(kind, S::LANES);
                let perm = |x: &[f32]| -> Vec<f32> { (0..x.len()).map(|i| x[i / 32 * 32 + ord[i % 32]]).collect() };
                let row = |t: usize| -> Vec<f32> {
                    let r = ofs[t]..ofs[t] + d;
                    match kind {
                        Kind::BF16 => kb[r].iter().map(|x| x.to_f32()).collect(),
                        _ => kf[r].to_vec(),
                    }
                };
                let qp = perm(&q);
                let sc = match kind {
                    Kind::BF16 => scores::<S, half::bf16, W, R>(s, &qp, &kb, &ofs),
                    _ => scores::<S, f32, W, R>(s, &qp, &kf, &ofs),
                };
                for (r, sr) in sc.iter().enumerate() {
                    for (t, &st) in sr.iter().enumerate() {
                        let want: f64 = if t < n {
                            row(t).iter().zip(&q[r * d..]).map(|(&a, &b)| a as f64 * b as f64).sum()
                        } else {
                            0.0
                        };
                        let what = format!("{} lanes W {W} R {R} n {n} {kind:?} row {r} key {t}", S::LANES);
                        assert!((st as f64 - want).abs() < 1e-4, "{what}: {st} vs {want}");
                    }
                }
                let mut o = perm(&o0);
                match kind {
                    Kind::BF16 => scale_add_pv::<S, half::bf16, W, R>(s, &mut o, scale, (&p, 0), &kb, &ofs),
                    _ => scale_add_pv::<S, f32, W, R>(s, &mut o, scale, (&p, 0), &kf, &ofs),
                };
                for r in 0..R {
                    for i in 0..d {
                        let e = i / 32 * 32 + ord[i % 32];
                        let pv: f64 = (0..n).map(|t| p[r][t] as f64 * row(t)[e] as f64).sum();
                        let want = o0[r * d + e] as f64 * scale[r] as f64 + pv;
                        let got = o[r * d + i] as f64;
                        let what = format!("{} lanes W {W} R {R} n {n} {kind:?} o[{r}][{e}]", S::LANES);
                        assert!((got - want).abs() < 1e-4, "{what}: {got} vs {want}");
                    }
                }
            }
        }
    }

    /// `hsum_one` of a vector is its lane of `hsum_keys`, bit for bit, on sums whose order
    /// shows (values of very different magnitudes, cancellations).
    fn one_key_sums<S: Lanes>(s: S) {
        let val = |i: usize| {
            let m = [1.0f32, 1e-8, 3e7, -2.5e7, 0.1, -1e-3][i % 6];
            m * ((i * 37 % 101) as f32 / 101.0 - 0.4)
        };
        for round in 0..8 {
            let x: Vec<f32> = (0..BLOCK_KEYS * S::LANES).map(|i| val(i * 3 + round * 11)).collect();
            let v: [S::V; BLOCK_KEYS] = std::array::from_fn(|t| {
                let mut u = [0.0f32; 32];
                u[..S::LANES].copy_from_slice(&x[t * S::LANES..(t + 1) * S::LANES]);
                // The lanes after the first vector are 0: the fold adds zeros, exactly.
                s.fold(s.load(&u, 0))
            });
            let all = s.hsum_keys(&v);
            for (t, &vt) in v.iter().enumerate() {
                assert_eq!(s.hsum_one(vt).to_bits(), all[t].to_bits(), "{} lanes, round {round}, key {t}", S::LANES);
            }
        }
    }

    #[test]
    fn hsum_one_is_hsum_keys_per_key() {
        if let Some(s) = Avx512::new() {
            one_key_sums(s);
        }
        if let Some(s) = Avx2::new() {
            one_key_sums(s);
        }
    }

    fn all_block_products<S: Lanes>(s: S) {
        block_products::<S, 1, 1>(s);
        block_products::<S, 2, 1>(s);
        block_products::<S, 3, 1>(s);
        block_products::<S, 4, 1>(s);
        block_products::<S, 8, 1>(s);
        block_products::<S, 1, 2>(s);
        block_products::<S, 4, 2>(s);
        block_products::<S, 5, 2>(s);
        block_products::<S, 2, 4>(s);
        block_products::<S, 4, 4>(s);
        block_products::<S, 8, 4>(s);
    }

    #[test]
    fn block_products_match_float64_sums() {
        match Avx512::new() {
            Some(s) => all_block_products(s),
            None => eprintln!("no AVX-512 on this CPU: its block products are not run"),
        }
        match Avx2::new() {
            Some(s) => all_block_products(s),
            None => eprintln!("no AVX2 + FMA + F16C on this CPU: its block products are not run"),
        }
    }
}

//! The products of the backward's tiles: `C (+)= A·B` on f32 buffers, register-blocked as the
//! forward's micro-kernel (`cpu::gemm`): an `MR × N` accumulator tile, one broadcast of A and
//! `N / lanes` FMAs per row and step. Unlike the forward's, A and B are read where they lie
//! (row-major tiles of the backward's scratch, B rows contiguous), because each operand here is
//! used by one or two products only: a packing pass would cost as much as it saves.
//!
//! On AVX-512 (`N = 32`) the tile is written in intrinsics ([`product_avx512`]): its 12
//! accumulators in zmm registers, operand bounds checked once per product. As plain loops the
//! compiled k loop carried eight bounds checks and two pointer reloads from the stack per step
//! besides its 12 FMAs. Elsewhere it is plain fixed-size loops compiled inside a `#[target_feature]`
//! function (`avx2,fma` with `N = 16`, or none). Every C element is accumulated over k in the
//! same order whatever `N` is, so the result does not depend on the instruction set (given FMA).

/// Rows of the accumulator tile (as `cpu::gemm::MR`).
pub(super) const MR: usize = 6;

/// How A is stored: `RowMajor(ld)` has `A(m, k) = a[m·ld + k]`, `ColMajor(ld)` has
/// `A(m, k) = a[k·ld + m]` (a transposed operand: Pᵀ and dSᵀ).
#[derive(Clone, Copy)]
pub(super) enum ALayout {
    RowMajor(usize),
    ColMajor(usize),
}

/// The sizes of one product: `m` rows of C (a multiple of [`MR`]), `n` columns (a multiple of
/// `N`), `k` steps.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// `C = A·B` (or `C += A·B` with `ACC`) with `B(k, n) = b[k·ldb + n]` and
/// `C(m, n) = c[m·ldc + n]`. `FMA` chooses fused multiply-add (only when the CPU has it).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn product<const N: usize, const FMA: bool, const ACC: bool>(
    dims: Dims,
    a: &[f32],
    al: ALayout,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    debug_assert!(dims.m.is_multiple_of(MR) && dims.n.is_multiple_of(N));
    #[cfg(target_arch = "x86_64")]
    if N == 2 * LANES && FMA && std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected on this CPU, the only requirement of
        // `product_avx512` (its slice lengths it checks itself).
        unsafe { product_avx512::<ACC>(dims, a, al, b, ldb, c, ldc) };
        return;
    }
    for i0 in (0..dims.m).step_by(MR) {
        for j0 in (0..dims.n).step_by(N) {
            let mut acc = [[0.0f32; N]; MR];
            if ACC {
                for (r, row) in acc.iter_mut().enumerate() {
                    row.copy_from_slice(&c[(i0 + r) * ldc + j0..][..N]);
                }
            }
            match al {
                ALayout::RowMajor(lda) => {
                    let rows: [&[f32]; MR] = std::array::from_fn(|r| &a[(i0 + r) * lda..][..dims.k]);
                    for kk in 0..dims.k {
                        let bk = &b[kk * ldb + j0..][..N];
                        for r in 0..MR {
                            step::<N, FMA>(rows[r][kk], bk, &mut acc[r]);
                        }
                    }
                }
                ALayout::ColMajor(lda) => {
                    for kk in 0..dims.k {
                        let ak = &a[kk * lda + i0..][..MR];
                        let bk = &b[kk * ldb + j0..][..N];
                        for r in 0..MR {
                            step::<N, FMA>(ak[r], bk, &mut acc[r]);
                        }
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                c[(i0 + r) * ldc + j0..][..N].copy_from_slice(row);
            }
        }
    }
}

/// f32 lanes of one AVX-512 register.
#[cfg(target_arch = "x86_64")]
const LANES: usize = 16;

/// [`product`] with `N = 32` and FMA in AVX-512 registers: the 6×32 tile's 12 accumulators are
/// zmm registers from the first step to the store (the generic loop's arrays are not always
/// kept there), one broadcast of A and two FMAs per row and step. The same FMAs in the same
/// order as the generic loop, so the results are bit for bit the AVX2 and portable builds'
/// (given FMA).
// Indexed loops with constant bounds over the accumulators: unrolled, the arrays kept in registers.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn product_avx512<const ACC: bool>(
    dims: Dims,
    a: &[f32],
    al: ALayout,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    use std::arch::x86_64::*;
    const N: usize = 2 * LANES;
    let Dims { m, n, k } = dims;
    if m == 0 || n == 0 {
        return;
    }
    assert!(m.is_multiple_of(MR) && n.is_multiple_of(N));
    // The last element each operand is read at, checked once here for the raw loads below.
    let last = |rows: usize, ld: usize, cols: usize| (rows - 1).checked_mul(ld).and_then(|x| x.checked_add(cols));
    assert!(last(m, ldc, n).is_some_and(|e| e <= c.len()));
    if k > 0 {
        assert!(last(k, ldb, n).is_some_and(|e| e <= b.len()));
        let a_end = match al {
            ALayout::RowMajor(lda) => last(m, lda, k),
            ALayout::ColMajor(lda) => last(k, lda, m),
        };
        assert!(a_end.is_some_and(|e| e <= a.len()));
    }
    let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
    for i0 in (0..m).step_by(MR) {
        for j0 in (0..n).step_by(N) {
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            if ACC {
                for r in 0..MR {
                    for h in 0..2 {
                        // SAFETY: row `i0 + r < m`, columns `j0 + 16h..+16 ≤ n` of C (checked above).
                        acc[r][h] = unsafe { _mm512_loadu_ps(cp.add((i0 + r) * ldc + j0 + h * LANES)) };
                    }
                }
            }
            // A(i0 + r, kk) is at `arow[r] + kk · ka`.
            let (ra, ka) = match al {
                ALayout::RowMajor(lda) => (lda, 1),
                ALayout::ColMajor(lda) => (1, lda),
            };
            let arow: [*const f32; MR] = std::array::from_fn(|r| ap.wrapping_add((i0 + r) * ra));
            for kk in 0..k {
                // SAFETY: row `kk < k`, columns `j0..j0 + 32 ≤ n` of B (checked above).
                let b0 = unsafe { _mm512_loadu_ps(bp.add(kk * ldb + j0)) };
                // SAFETY: as `b0`.
                let b1 = unsafe { _mm512_loadu_ps(bp.add(kk * ldb + j0 + LANES)) };
                for r in 0..MR {
                    // SAFETY: A(i0 + r, kk) with `i0 + r < m` and `kk < k` (checked above).
                    let x = _mm512_set1_ps(unsafe { *arow[r].add(kk * ka) });
                    acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
                }
            }
            for r in 0..MR {
                for h in 0..2 {
                    // SAFETY: as the loads of C above.
                    unsafe { _mm512_storeu_ps(cp.add((i0 + r) * ldc + j0 + h * LANES), acc[r][h]) };
                }
            }
        }
    }
}

/// `acc += a · b` lane by lane.
#[inline(always)]
fn step<const N: usize, const FMA: bool>(a: f32, b: &[f32], acc: &mut [f32; N]) {
    let b = &b[..N];
    for j in 0..N {
        acc[j] = if FMA { a.mul_add(b[j], acc[j]) } else { a * b[j] + acc[j] };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both layouts of A and both modes against a plain triple loop.
    #[test]
    fn products_are_the_triple_loop() {
        let (m, n, k) = (12, 32, 7);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let at: Vec<f32> = (0..k * m).map(|x| a[(x % m) * k + x / m]).collect(); // [k][m]
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 13) as f32 * 0.25 - 1.0).collect();
        let want: Vec<f32> =
            (0..m * n).map(|x| (0..k).map(|kk| a[(x / n) * k + kk] * b[kk * n + x % n]).sum::<f32>() + 1.0).collect();
        let dims = Dims { m, n, k };
        for (al, src) in [(ALayout::RowMajor(k), &a), (ALayout::ColMajor(m), &at)] {
            let mut c = vec![1.0f32; m * n];
            product::<16, false, true>(dims, src, al, &b, n, &mut c, n);
            assert_eq!(c, want);
            let mut c = vec![f32::NAN; m * n];
            product::<32, false, false>(dims, src, al, &b, n, &mut c, n);
            let want0: Vec<f32> = want.iter().map(|x| x - 1.0).collect();
            assert_eq!(c, want0);
        }
    }

    /// The 32-column FMA product (AVX-512 registers where the CPU has them) is the 16-column
    /// generic loop bit for bit, in both layouts and both modes, on values that round.
    #[test]
    fn wide_product_is_the_narrow_one_bit_for_bit() {
        let (m, n, k, lda, ldb, ldc) = (12, 64, 37, 41, 67, 70);
        let val = |i: usize| ((i * 2654435761) % 1000) as f32 / 317.0 - 1.3;
        let a: Vec<f32> = (0..m.max(k) * lda).map(val).collect();
        let b: Vec<f32> = (0..k * ldb).map(|i| val(i + 7)).collect();
        let c0: Vec<f32> = (0..m * ldc).map(|i| val(i + 13)).collect();
        let dims = Dims { m, n, k };
        for al in [ALayout::RowMajor(lda), ALayout::ColMajor(lda)] {
            let (mut c16, mut c32) = (c0.clone(), c0.clone());
            product::<16, true, true>(dims, &a, al, &b, ldb, &mut c16, ldc);
            product::<32, true, true>(dims, &a, al, &b, ldb, &mut c32, ldc);
            assert_eq!(c16.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), c32.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            assert_ne!(c16, c0);
            let (mut c16, mut c32) = (c0.clone(), c0.clone());
            product::<16, true, false>(dims, &a, al, &b, ldb, &mut c16, ldc);
            product::<32, true, false>(dims, &a, al, &b, ldb, &mut c32, ldc);
            assert_eq!(c16.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), c32.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
    }
}

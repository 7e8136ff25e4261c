//! The products of the backward's tiles: `C (+)= A·B` on f32 buffers, register-blocked as the
//! forward's micro-kernel (`cpu::gemm`): an `MR × N` accumulator tile, one broadcast of A and
//! `N / lanes` FMAs per row and step. Unlike the forward's, A and B are read where they lie
//! (row-major tiles of the backward's scratch, B rows contiguous), because each operand here is
//! used by one or two products only: a packing pass would cost as much as it saves.
//!
//! Written as plain fixed-size loops: compiled inside a `#[target_feature]` function
//! (`avx512f` with `N = 32`, `avx2,fma` with `N = 16`) LLVM keeps the 12 accumulator vectors in
//! registers. Every C element is accumulated over k in the same order whatever `N` is, so the
//! result does not depend on the instruction set (given FMA).

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
    debug_assert!(dims.m % MR == 0 && dims.n % N == 0);
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
}

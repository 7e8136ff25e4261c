//! The register-blocked micro-kernel behind both products of the CPU backend.
//!
//! `C[6][16] += A · B` with A packed as `kc × 6` (one column of six rows per step) and B packed as
//! `kc × 16`. Written as plain fixed-size loops: inside a `#[target_feature(enable = "avx2,fma")]`
//! caller LLVM keeps the 12 accumulator vectors in ymm registers and emits one broadcast, two
//! FMAs per row and step, the classic 6×16 AVX2 GEMM kernel.

/// Rows of the micro-tile (A is packed in strips of this many rows).
pub const MR: usize = 6;
/// Columns of the micro-tile (B is packed in panels of this many columns).
pub const NR: usize = 16;

/// One micro-tile accumulator.
pub type Acc = [[f32; NR]; MR];

/// `acc += a_packed · b_packed` over `kc = a_packed.len() / MR` steps.
/// `FMA` chooses fused multiply-add (only when the CPU has it: otherwise `mul_add` is a libm call).
#[inline(always)]
pub fn micro_kernel<const FMA: bool>(a_packed: &[f32], b_packed: &[f32], acc: &mut Acc) {
    for (a, b) in a_packed.chunks_exact(MR).zip(b_packed.chunks_exact(NR)) {
        for i in 0..MR {
            let ai = a[i];
            for j in 0..NR {
                acc[i][j] = if FMA { ai.mul_add(b[j], acc[i][j]) } else { ai * b[j] + acc[i][j] };
            }
        }
    }
}

/// [`micro_kernel`] where a zero in B contributes nothing: `acc += a · b` only where `b != 0`.
/// With B = Pᵀ and A = V this keeps a key's V out of the queries that do not see it (their P is
/// 0): `0 · inf` would be NaN. Used only when V holds an infinity or a NaN.
#[inline(always)]
pub fn micro_kernel_skip_zero_b<const FMA: bool>(a_packed: &[f32], b_packed: &[f32], acc: &mut Acc) {
    for (a, b) in a_packed.chunks_exact(MR).zip(b_packed.chunks_exact(NR)) {
        for i in 0..MR {
            let ai = a[i];
            for j in 0..NR {
                let t = if FMA { ai.mul_add(b[j], acc[i][j]) } else { ai * b[j] + acc[i][j] };
                acc[i][j] = if b[j] != 0.0 { t } else { acc[i][j] };
            }
        }
    }
}

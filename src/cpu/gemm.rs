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

/// [`micro_kernel`] on two B panels at once: `acc[t] += a · b[t]`, a 6×32 tile from one pass
/// over A. Each element of A is broadcast once for both panels; with 512-bit registers the 12
/// accumulators are 12 zmm, enough independent FMA chains to cover their latency, where the 6 of
/// a single 6×16 tile are not. (With 256-bit registers the 24 accumulators would spill: AVX2
/// uses [`micro_kernel`].) `SKIP`: as [`micro_kernel_skip_zero_b`], per panel. The reference the
/// AVX-512 products (`simd::product_max`, `simd::scaled_product`, which run 1 to 4 panels at once)
/// are tested against; the tiled path's portable fallback runs one panel at a time.
#[cfg(test)]
#[inline(always)]
pub fn micro_kernel_x2<const FMA: bool, const SKIP: bool>(a_packed: &[f32], b: [&[f32]; 2], acc: &mut [Acc; 2]) {
    let steps = a_packed.chunks_exact(MR).zip(b[0].chunks_exact(NR)).zip(b[1].chunks_exact(NR));
    for ((a, b0), b1) in steps {
        for i in 0..MR {
            let ai = a[i];
            for (t, bt) in [b0, b1].into_iter().enumerate() {
                for j in 0..NR {
                    let x = if FMA { ai.mul_add(bt[j], acc[t][i][j]) } else { ai * bt[j] + acc[t][i][j] };
                    acc[t][i][j] = if SKIP && bt[j] == 0.0 { acc[t][i][j] } else { x };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_kernel_is_two_single_kernels() {
        let kc = 13;
        let a: Vec<f32> = (0..kc * MR).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let b0: Vec<f32> = (0..kc * NR).map(|i| ((i * 5) % 13) as f32 * 0.25 - 1.0).collect();
        let mut b1: Vec<f32> = (0..kc * NR).map(|i| ((i * 3) % 7) as f32 - 3.0).collect();
        b1[5] = 0.0;
        let mut a_inf = a.clone();
        a_inf[3] = f32::INFINITY;
        for (a, skip) in [(&a, false), (&a_inf, true)] {
            let init: Acc = std::array::from_fn(|i| std::array::from_fn(|j| (i * NR + j) as f32));
            let (mut s0, mut s1) = (init, init);
            let mut pair = [init, init];
            if skip {
                micro_kernel_skip_zero_b::<false>(a, &b0, &mut s0);
                micro_kernel_skip_zero_b::<false>(a, &b1, &mut s1);
                micro_kernel_x2::<false, true>(a, [&b0, &b1], &mut pair);
            } else {
                micro_kernel::<false>(a, &b0, &mut s0);
                micro_kernel::<false>(a, &b1, &mut s1);
                micro_kernel_x2::<false, false>(a, [&b0, &b1], &mut pair);
            }
            let bits = |x: &Acc| x.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&pair[0]), bits(&s0));
            assert_eq!(bits(&pair[1]), bits(&s1));
        }
    }
}

//! The reference rule on one sequence of an emulated launch, and what an emulated result may
//! differ by beyond it: the bound against the CPU oracle of FA4's softmax rows, and near ties
//! that f32 scores cannot resolve at huge scales.

use super::*;

/// One sequence of an emulated launch against the float64 reference with the GPU tests' rule:
/// `o` (its rows `[sq][hq][dv]`) within `2·max|naive − ref| + floor` of `attention_f64` on `q`,
/// `k`, `v` (the naive attention in `dtype`), every value finite, and with `lse` (`lse(h, i)`)
/// every LSE within [`LSE_TOL`] (−inf exactly). Returns err / bound; an error says what failed.
pub fn check_sequence(
    (q, k, v): (&TensorView<'_>, &TensorView<'_>, &TensorView<'_>),
    opts: &ForwardOptions,
    dtype: DType,
    o: &[f32],
    lse: Option<&dyn Fn(usize, usize) -> f32>,
) -> Result<f64, String> {
    let p = Problem::new(q, k, v, opts).map_err(|e| format!("problem {e}"))?;
    let r = attention_f64(&p, q, k, v).unwrap();
    let naive = attention_naive(&p, q, k, v, dtype).unwrap();
    let ours: Vec<f64> = o.iter().map(|&x| x as f64).collect();
    let err = max_abs_diff(&ours, &r.o);
    let bound = 2.0 * max_abs_diff(&naive, &r.o) + floor_for(dtype);
    if err > bound || ours.iter().any(|x| !x.is_finite()) {
        return Err(format!("max |O - ref| {err:.3e} > bound {bound:.3e}"));
    }
    if let Some(lse) = lse {
        let [_, sq, hq, _] = q.shape();
        for h in 0..hq {
            for i in 0..sq {
                let (got, want) = (lse(h, i) as f64, r.lse[h * sq + i]);
                if !(got == want || (got - want).abs() <= LSE_TOL) {
                    return Err(format!("LSE[{h}][{i}] = {got}, reference {want}"));
                }
            }
        }
    }
    Ok(err / bound)
}

/// The largest output difference the CPU oracle may show against an FA4-softmax kernel, in
/// epsilons of the 16-bit dtype at the output's scale (max |O_ref|): both round O to the dtype
/// (1 ulp each at most at that scale) and P to the dtype for the second product; the kernel
/// takes 7 of 8 (3 of 4) exponentials on MUFU (relative error 2^-22) where the oracle takes the
/// degree-3 polynomial (5e-5 relative, 0.4 bf16 / 0.05 f16 epsilon), and sums in its own order.
pub const CPU_ORACLE_ULPS: f64 = 4.0;

/// max |O - O_cpu| / (eps * max |O_ref|) for `c` against the CPU backend with the row's softmax
/// as options (see `Case::cpu_oracle`); Err when over `CPU_ORACLE_ULPS`.
pub(super) fn cpu_oracle_ulps(
    c: &Case,
    opts: &ForwardOptions,
    q: &TensorView<'_>,
    k: &TensorView<'_>,
    v: &TensorView<'_>,
    o: &[f64],
    o_ref: &[f64],
) -> Result<f64, String> {
    let fam = FAMILIES.iter().find(|f| f.name == c.family).unwrap();
    let s = fam.softmax;
    let mut cpu = opts.clone().backend(flash_attn::Backend::Cpu).variant(Variant::Auto);
    cpu.fa4_stage = None;
    cpu.fa4_exp2_share = None;
    cpu = cpu.exp2(if s.poly_every > 0 { flash_attn::Exp2::Poly(s.poly_degree) } else { flash_attn::Exp2::Accurate });
    cpu = cpu.rescale(if s.lazy_tau >= 0.0 {
        flash_attn::Rescale::Lazy { threshold: s.lazy_tau }
    } else {
        flash_attn::Rescale::Always
    });
    let out = flash_attn::forward(q, k, v, &cpu).map_err(|e| format!("cpu oracle: {e}"))?;
    let got: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
    let eps = match c.dtype {
        DType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-11),
    };
    let scale = o_ref.iter().fold(0.0f64, |m, x| if x.is_finite() { m.max(x.abs()) } else { m }).max(1e-30);
    let ulps = max_abs_diff(o, &got) / (eps * scale);
    if ulps > CPU_ORACLE_ULPS {
        return Err(format!(
            "max |O - O_cpu oracle ({:?}, {:?})| is {ulps:.2} epsilons of max |O_ref| {scale:.3e}, over {CPU_ORACLE_ULPS}",
            cpu.exp2, cpu.rescale
        ));
    }
    Ok(ulps)
}

/// Whether output row `row` ([b, s, h] order, contiguous Q/K/V as `max_score` cases use) of a
/// case with huge scores is a correct result of a near tie that the f32 scores cannot resolve.
///
/// At such scales the softmax is one-hot on the largest f32 score: two keys whose exact scores
/// differ by less than the rounding error of an f32 dot product may round to the same f32 score
/// (both get P = 1, the row is their mean) or swap, in any correct kernel, whatever its
/// summation order; the float64 reference resolves them and the naive f32 softmax, summing in
/// another order, may too. So a row is accepted when (1) distinct f32 scores near the top are
/// one-hot apart (half an ulp of the top score times scale * log2 e is past the f32 exponent
/// range: P is exactly 0 or 1), and (2) it is, within `bound`, the mean of V over a nonempty
/// subset of the keys whose exact score is within the error bounds of the top one (Higham's
/// gamma_(d+1) * sum |q_i k_i| each: d products, exact in f32 for 16-bit inputs, summed in any
/// order, and one rounding for a scale applied to the score). Found on fa3s4 F16 window (40, 8),
/// max |score| 2.5e38, row 79 head 1: keys 84 and 90 differ by 5.5e-7 (under an ulp, 1.9e-6)
/// and the wgmma summation order rounds both to 0x1.208936p+4.
pub(super) fn near_tie_row_ok(p: &Problem, q: &[f32], k: &[f32], v: &[f32], row: usize, got: &[f64], bound: f64) -> bool {
    let d = p.head_dim;
    let (h, i, b) = (row % p.heads_q, (row / p.heads_q) % p.seqlen_q, row / p.heads_q / p.seqlen_q);
    let kh = h / (p.heads_q / p.heads_kv);
    let kv_row = |j: usize| ((b * p.seqlen_k + j) * p.heads_kv + kh) * d;
    let qr = &q[row * d..][..d];
    let u = f32::EPSILON as f64 / 2.0;
    let gamma = (d + 1) as f64 * u / (1.0 - (d + 1) as f64 * u);
    let (lo, hi) = p.key_range(i);
    let scores: Vec<(usize, f64, f64)> = (lo..hi)
        .map(|j| {
            let (dot, abs) = qr.iter().zip(&k[kv_row(j)..][..d]).fold((0.0, 0.0), |(s, a), (&x, &y)| {
                let t = x as f64 * y as f64;
                (s + t, a + t.abs())
            });
            (j, dot, gamma * abs)
        })
        .collect();
    let Some(&(_, top, top_err)) = scores.iter().max_by(|a, b| a.1.total_cmp(&b.1)) else { return false };
    let t32 = (top as f32).abs();
    let half_ulp = (f32::from_bits(t32.to_bits() + 1) - t32) as f64 / 2.0;
    if half_ulp * p.scale as f64 * std::f64::consts::LOG2_E < 160.0 {
        return false;
    }
    let near: Vec<usize> = scores.iter().filter(|s| top - s.1 <= top_err + s.2).map(|s| s.0).collect();
    if near.len() < 2 || near.len() > 8 {
        return false;
    }
    (1u32..1 << near.len()).any(|set| {
        let keys: Vec<usize> = (0..near.len()).filter(|&n| set >> n & 1 == 1).map(|n| near[n]).collect();
        (0..d).all(|e| {
            let mean = keys.iter().map(|&j| v[kv_row(j) + e] as f64).sum::<f64>() / keys.len() as f64;
            (got[e] - mean).abs() <= bound
        })
    })
}

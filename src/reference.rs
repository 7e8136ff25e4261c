//! The naive references: used only by tests, benches and examples to check the fast paths.
//!
//! [`attention_f64`] materialises the score matrix in float64 and is the ground truth.
//! [`attention_naive`] is "a straightforward implementation in the input precision" (as PyTorch
//! would compute it in that dtype): its error against float64 is the yardstick of
//! FlashAttention's tolerance rule, `max|ours - ref64| <= 2 * max|naive - ref64| + floor`.

use crate::error::{Error, Operand, Result};
use crate::problem::Problem;
use crate::tensor::{try_filled, DType, TensorView};

/// Checks that q, k, v are the views `p` describes (shapes, layouts inside their buffers, GQA
/// grouping and ALiBi slopes), so that a reference never indexes out of bounds, whatever `Problem`
/// it is handed (its fields are public).
pub(crate) fn check_views(p: &Problem, q: &TensorView, k: &TensorView, v: &TensorView) -> Result<()> {
    let want_q = [p.batch, p.seqlen_q, p.heads_q, p.head_dim];
    let want_k = [p.batch, p.seqlen_k, p.heads_kv, p.head_dim];
    let want_v = [p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v];
    for (op, t, want) in [(Operand::Q, q, want_q), (Operand::K, k, want_k), (Operand::V, v, want_v)] {
        if t.shape() != want {
            return Err(Error::ShapeMismatch {
                what: format!("{op} (against the problem)"),
                got: format!("{:?}", t.shape()),
                expected: format!("{want:?}"),
            });
        }
        t.check_layout(op)?;
    }
    if !p.heads_q.is_multiple_of(p.heads_kv) {
        return Err(Error::HeadsNotDivisible { heads_q: p.heads_q, heads_kv: p.heads_kv });
    }
    if let Some(s) = &p.alibi {
        if s.len() != p.heads_q {
            return Err(Error::InvalidAlibi { got: s.len(), expected: p.heads_q, reason: "wrong length".into() });
        }
    }
    crate::tensor::check_size(want_q, 8, "float64 reference q")?;
    crate::tensor::check_size([p.batch, p.seqlen_q, p.heads_q, p.head_dim_v], 8, "float64 reference output")?;
    Ok(())
}

/// Output of a reference: `o` as `[batch, seqlen_q, heads_q, head_dim_v]`, `lse` as
/// `[batch, heads_q, seqlen_q]` (natural log; −inf for rows that see no key, the sink logit
/// for such a row of a head with a sink).
#[derive(Clone, Debug)]
pub struct RefOutput {
    pub o: Vec<f64>,
    pub lse: Vec<f64>,
}

/// The score (natural units, after scale, softcap and ALiBi) of query row `qi` against key row
/// `kj`, or `None` when masked.
fn score64(p: &Problem, h: usize, i: usize, j: usize, q: &[f64], k: &[f64]) -> Option<f64> {
    if !p.visible(i, j) {
        return None;
    }
    let dot: f64 = q.iter().zip(k).map(|(a, b)| a * b).sum();
    let mut s = dot * p.scale as f64;
    if let Some(cap) = p.softcap {
        let cap = cap as f64;
        s = cap * (s / cap).tanh();
    }
    Some(s + p.alibi_bias(h, i, j) as f64)
}

/// The max of a row's visible scores and its sink logit (NaN-propagating), and the sink.
fn row_max64(p: &Problem, h: usize, s: &[Option<f64>]) -> (f64, Option<f64>) {
    let sink = p.sink(h).map(f64::from);
    let m = s.iter().flatten().chain(&sink).fold(f64::NEG_INFINITY, |a, &x| if x > a || x.is_nan() { x } else { a });
    (m, sink)
}

fn row64(t: &TensorView, b: usize, s: usize, h: usize) -> Vec<f64> {
    let d = t.head_dim();
    let off = t.offset(b, s, h);
    (0..d).map(|x| t.data().get_f32(off + x) as f64).collect()
}

/// Float64 attention with the full score matrix per (batch, head).
///
/// # Errors
/// [`Error::ShapeMismatch`] / [`Error::InvalidLayout`] when the views are not the ones `p`
/// describes, [`Error::TooLarge`] when the float64 output cannot be allocated.
pub fn attention_f64(p: &Problem, q: &TensorView, k: &TensorView, v: &TensorView) -> Result<RefOutput> {
    check_views(p, q, k, v)?;
    let d = p.head_dim_v;
    let n_o = p.batch * p.seqlen_q * p.heads_q * d; // checked by check_views
    let mut o = try_filled(n_o, 0.0f64, || "float64 reference output".into())?;
    let mut lse = try_filled(n_o / d, f64::NEG_INFINITY, || "float64 reference LSE".into())?;
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let hk = h / p.group();
            let ks: Vec<Vec<f64>> = (0..p.seqlen_k).map(|j| row64(k, b, j, hk)).collect();
            let vs: Vec<Vec<f64>> = (0..p.seqlen_k).map(|j| row64(v, b, j, hk)).collect();
            for i in 0..p.seqlen_q {
                let qi = row64(q, b, i, h);
                let s: Vec<Option<f64>> = (0..p.seqlen_k).map(|j| score64(p, h, i, j, &qi, &ks[j])).collect();
                let (m, sink) = row_max64(p, h, &s);
                if m == f64::NEG_INFINITY {
                    continue; // no visible key (or all scores -inf) and no sink: output 0, LSE -inf
                }
                let e: Vec<f64> = s.iter().map(|x| x.map_or(0.0, |x| (x - m).exp())).collect();
                // The sink's term: in the denominator only, with no value.
                let l: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |z| (z - m).exp());
                let out = &mut o[((b * p.seqlen_q + i) * p.heads_q + h) * d..][..d];
                for (j, ej) in e.iter().enumerate() {
                    if *ej != 0.0 || ej.is_nan() {
                        for (ox, vx) in out.iter_mut().zip(&vs[j]) {
                            *ox += ej * vx;
                        }
                    }
                }
                for ox in out.iter_mut() {
                    *ox /= l;
                }
                lse[(b * p.heads_q + h) * p.seqlen_q + i] = m + l.ln();
            }
        }
    }
    Ok(RefOutput { o, lse })
}

/// Float64 reference output for a few sampled `(batch, head, query row)` triples only: each row
/// costs O(seqlen_k · head_dim), so the bench can check a large problem cheaply. Returns one
/// `head_dim_v` vector per triple with the values [`attention_f64`] gives for that row (zeros for a
/// row that sees no key).
///
/// # Errors
/// As [`attention_f64`], and [`Error::InvalidOption`] for a row outside the problem.
pub fn attention_f64_rows(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    rows: &[(usize, usize, usize)],
) -> Result<Vec<Vec<f64>>> {
    check_views(p, q, k, v)?;
    if let Some(&(b, h, i)) = rows.iter().find(|&&(b, h, i)| b >= p.batch || h >= p.heads_q || i >= p.seqlen_q) {
        return Err(Error::InvalidOption {
            option: "reference row",
            got: format!("(batch {b}, head {h}, query {i})"),
            expected: format!("batch < {}, head < {}, query < {}", p.batch, p.heads_q, p.seqlen_q),
        });
    }
    let d = p.head_dim_v;
    Ok(rows
        .iter()
        .map(|&(b, h, i)| {
            let hk = h / p.group();
            let qi = row64(q, b, i, h);
            let s: Vec<Option<f64>> = (0..p.seqlen_k).map(|j| score64(p, h, i, j, &qi, &row64(k, b, j, hk))).collect();
            let (m, sink) = row_max64(p, h, &s);
            let mut out = vec![0.0f64; d];
            if m == f64::NEG_INFINITY {
                return out; // no visible key and no sink: output 0
            }
            let mut l = sink.map_or(0.0, |z| (z - m).exp());
            for (j, sj) in s.iter().enumerate() {
                let Some(sj) = sj else { continue };
                let e = (sj - m).exp();
                l += e;
                if e != 0.0 || e.is_nan() {
                    for (ox, vx) in out.iter_mut().zip(row64(v, b, j, hk)) {
                        *ox += e * vx;
                    }
                }
            }
            out.iter_mut().for_each(|x| *x /= l);
            out
        })
        .collect())
}

/// The straightforward implementation in `dtype`, as a framework computes it: S = QKᵀ with f32
/// accumulation rounded to `dtype`, the scale applied and rounded, softcap/ALiBi in f32 rounded,
/// softmax in f32 with P rounded to `dtype`, O = PV with f32 accumulation rounded to `dtype`.
/// Returns `o` as f64 for comparison.
///
/// # Errors
/// As [`attention_f64`].
pub fn attention_naive(p: &Problem, q: &TensorView, k: &TensorView, v: &TensorView, dtype: DType) -> Result<Vec<f64>> {
    check_views(p, q, k, v)?;
    naive(p, &InDtype { views: [q, k, v], dtype })
}

/// The arithmetic of a naive (materialised-softmax) attention, step by step: what the one loop
/// of [`naive`] asks. The defaults are those of plain 16/32-bit operands; the FP8 baseline
/// (`bench::fp8_baseline`) overrides the descales and P's cast.
pub(crate) trait NaiveSteps {
    /// The precision scores, P and O are rounded to.
    fn dtype(&self) -> DType;
    /// Row `s` of head `h` of batch `b` of operand `which` (q, k or v), as the products read it.
    fn row(&self, which: Operand, b: usize, s: usize, h: usize) -> Vec<f32>;
    /// Factor of the raw product q_i·k_j (query row `i` of head `h`, key row `j` of kv head `hk`).
    fn qk_descale(&self, _b: usize, _i: usize, _h: usize, _j: usize, _hk: usize) -> f32 {
        1.0
    }
    /// P (normalised and rounded to `dtype`) as it enters the second product.
    fn p_cast(&self, p: f32) -> f32 {
        p
    }
    /// Rows of V that share one descale: P·V is accumulated per block, then descaled.
    fn v_block_rows(&self) -> usize {
        usize::MAX
    }
    /// Factor of the block of P·V that ends at key row `j`.
    fn v_descale(&self, _b: usize, _j: usize, _hk: usize) -> f32 {
        1.0
    }
}

/// Operands read in `dtype`, every step rounded to it.
struct InDtype<'a> {
    views: [&'a TensorView<'a>; 3],
    dtype: DType,
}

impl NaiveSteps for InDtype<'_> {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn row(&self, which: Operand, b: usize, s: usize, h: usize) -> Vec<f32> {
        let t = self.views[match which {
            Operand::Q => 0,
            Operand::K => 1,
            _ => 2,
        }];
        let mut out = vec![0.0f32; t.shape()[3]];
        t.read_row(b, s, h, &mut out);
        out.iter().map(|&x| self.dtype.round(x)).collect()
    }
}

/// The naive attention of `a`'s arithmetic on `p` (views checked by the caller). Rows with no
/// visible key give 0. Returns `o` as f64 `[batch, seqlen_q, heads_q, head_dim_v]`.
pub(crate) fn naive(p: &Problem, a: &impl NaiveSteps) -> Result<Vec<f64>> {
    let d = p.head_dim_v;
    let r = |x: f32| a.dtype().round(x);
    let mut o = try_filled(p.batch * p.seqlen_q * p.heads_q * d, 0.0f64, || "naive reference output".into())?;
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let hk = h / p.group();
            let ks: Vec<Vec<f32>> = (0..p.seqlen_k).map(|j| a.row(Operand::K, b, j, hk)).collect();
            let vs: Vec<Vec<f32>> = (0..p.seqlen_k).map(|j| a.row(Operand::V, b, j, hk)).collect();
            for i in 0..p.seqlen_q {
                let qi = a.row(Operand::Q, b, i, h);
                let s: Vec<f32> = (0..p.seqlen_k)
                    .map(|j| {
                        if !p.visible(i, j) {
                            return f32::NEG_INFINITY;
                        }
                        let dot: f32 = qi.iter().zip(&ks[j]).map(|(x, y)| x * y).sum();
                        let mut s = r(r(dot * a.qk_descale(b, i, h, j, hk)) * p.scale);
                        if let Some(cap) = p.softcap {
                            s = r(cap * (s / cap).tanh());
                        }
                        r(s + p.alibi_bias(h, i, j))
                    })
                    .collect();
                let sink = p.sink(h);
                let m = s.iter().chain(&sink).fold(f32::NEG_INFINITY, |acc, &x| if x > acc || x.is_nan() { x } else { acc });
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let e: Vec<f32> = s.iter().map(|&x| (x - m).exp()).collect();
                let l: f32 = e.iter().sum::<f32>() + sink.map_or(0.0, |z| (z - m).exp());
                let (mut out, mut acc) = (vec![0.0f32; d], vec![0.0f32; d]);
                for (j, ej) in e.iter().enumerate() {
                    let pj = a.p_cast(r(ej / l));
                    for (x, vx) in acc.iter_mut().zip(&vs[j]) {
                        *x += pj * vx;
                    }
                    if (j + 1) % a.v_block_rows() == 0 || j + 1 == p.seqlen_k {
                        let dv = a.v_descale(b, j, hk);
                        for (ox, x) in out.iter_mut().zip(acc.iter_mut()) {
                            *ox += *x * dv;
                            *x = 0.0;
                        }
                    }
                }
                let dst = &mut o[((b * p.seqlen_q + i) * p.heads_q + h) * d..][..d];
                for (ox, x) in dst.iter_mut().zip(&out) {
                    *ox = r(*x) as f64;
                }
            }
        }
    }
    Ok(o)
}

/// Gradients of a reference backward: `dq` as `[batch, seqlen_q, heads_q, head_dim]`, `dk` as
/// `[batch, seqlen_k, heads_kv, head_dim]` and `dv` as `[batch, seqlen_k, heads_kv, head_dim_v]`
/// (summed over each GQA group's query heads), and with attention sinks the gradient of each
/// head's sink logit, `[heads_q]`.
#[derive(Clone, Debug)]
pub struct RefGradients {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    pub d_sinks: Option<Vec<f64>>,
}

/// Checks `d_o` against `p` (o's shape, inside its buffer) on top of [`check_views`].
fn check_backward_views(p: &Problem, q: &TensorView, k: &TensorView, v: &TensorView, d_o: &TensorView) -> Result<()> {
    check_views(p, q, k, v)?;
    let want_o = [p.batch, p.seqlen_q, p.heads_q, p.head_dim_v];
    if d_o.shape() != want_o {
        return Err(Error::ShapeMismatch {
            what: "d_o (against the problem)".into(),
            got: format!("{:?}", d_o.shape()),
            expected: format!("{want_o:?} (the shape of o)"),
        });
    }
    d_o.check_layout(Operand::DO)?;
    crate::tensor::check_size([p.batch, p.seqlen_k, p.heads_kv, p.head_dim], 8, "float64 reference dk")?;
    crate::tensor::check_size([p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v], 8, "float64 reference dv")?;
    Ok(())
}

/// The analytic float64 gradient of [`attention_f64`]'s output against `d_o` (the gradient of
/// the loss with respect to `o`), with the full score matrix per (batch, head):
/// `P = softmax(s)`, `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − rowsum(dP ∘ P))`, through the
/// softcap `dS · (1 − tanh²)` (ALiBi slopes are constants), then `dQ = scale · dS·K` and
/// `dK = scale · dSᵀ·Q`. Rows that see no key have zero gradients. With attention sinks the
/// softmax denominator has the sink's term `exp(s_h − m)` (no value), dq, dk and dv follow with
/// that P, and the sink's gradient is `d_s_h = −Σ_rows P_sink · D` with `P_sink = exp(s_h −
/// LSE)` and `D = rowsum(P ∘ dP) = rowsum(dO ∘ O)` (the sink has no value, so no dP of its own).
///
/// # Errors
/// As [`attention_f64`], and [`Error::ShapeMismatch`] / [`Error::InvalidLayout`] for a `d_o`
/// that is not q's shape.
pub fn attention_backward_f64(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    d_o: &TensorView,
) -> Result<RefGradients> {
    check_backward_views(p, q, k, v, d_o)?;
    let (d, dvd) = (p.head_dim, p.head_dim_v);
    let n_q = p.batch * p.seqlen_q * p.heads_q * d;
    let n_k = p.batch * p.seqlen_k * p.heads_kv * d;
    let n_v = p.batch * p.seqlen_k * p.heads_kv * dvd;
    let mut dq = try_filled(n_q, 0.0f64, || "float64 reference dq".into())?;
    let mut dk = try_filled(n_k, 0.0f64, || "float64 reference dk".into())?;
    let mut dv = try_filled(n_v, 0.0f64, || "float64 reference dv".into())?;
    let mut d_sinks = p.sinks.as_ref().map(|_| vec![0.0f64; p.heads_q]);
    let scale = p.scale as f64;
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let hk = h / p.group();
            let ks: Vec<Vec<f64>> = (0..p.seqlen_k).map(|j| row64(k, b, j, hk)).collect();
            let vs: Vec<Vec<f64>> = (0..p.seqlen_k).map(|j| row64(v, b, j, hk)).collect();
            for i in 0..p.seqlen_q {
                let qi = row64(q, b, i, h);
                let doi = row64(d_o, b, i, h);
                // Scores and the softcap's tanh, per visible key.
                let st: Vec<Option<(f64, f64)>> = (0..p.seqlen_k)
                    .map(|j| {
                        if !p.visible(i, j) {
                            return None;
                        }
                        let u = qi.iter().zip(&ks[j]).map(|(a, b)| a * b).sum::<f64>() * scale;
                        let (s, t) = match p.softcap {
                            Some(cap) => {
                                let t = (u / cap as f64).tanh();
                                (cap as f64 * t, t)
                            }
                            None => (u, 0.0),
                        };
                        Some((s + p.alibi_bias(h, i, j) as f64, t))
                    })
                    .collect();
                let sink = p.sink(h).map(f64::from);
                let m = st.iter().flatten().map(|&(x, _)| x).chain(sink).fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue; // no visible key and no sink: zero gradients
                }
                let e: Vec<f64> = st.iter().map(|x| x.map_or(0.0, |(s, _)| (s - m).exp())).collect();
                let e_sink = sink.map_or(0.0, |z| (z - m).exp());
                let l: f64 = e.iter().sum::<f64>() + e_sink;
                let pr: Vec<f64> = e.iter().map(|x| x / l).collect();
                let dp: Vec<f64> = vs.iter().map(|vj| doi.iter().zip(vj).map(|(a, b)| a * b).sum()).collect();
                let delta: f64 = pr.iter().zip(&dp).map(|(a, b)| a * b).sum();
                if let Some(ds) = d_sinks.as_mut() {
                    ds[h] -= e_sink / l * delta;
                }
                let dqi = &mut dq[((b * p.seqlen_q + i) * p.heads_q + h) * d..][..d];
                for j in 0..p.seqlen_k {
                    let Some((_, t)) = st[j] else { continue };
                    let kv_row = ((b * p.seqlen_k + j) * p.heads_kv + hk) * d;
                    let v_row = ((b * p.seqlen_k + j) * p.heads_kv + hk) * dvd;
                    for (x, o) in dv[v_row..][..dvd].iter_mut().zip(&doi) {
                        *x += pr[j] * o;
                    }
                    let ds = pr[j] * (dp[j] - delta) * (1.0 - t * t) * scale;
                    for (x, kx) in dqi.iter_mut().zip(&ks[j]) {
                        *x += ds * kx;
                    }
                    for (x, qx) in dk[kv_row..][..d].iter_mut().zip(&qi) {
                        *x += ds * qx;
                    }
                }
            }
        }
    }
    Ok(RefGradients { dq, dk, dv, d_sinks })
}

/// The straightforward backward in `dtype`, as a framework's autograd computes it through
/// [`attention_naive`]'s steps: S = QKᵀ (f32 accumulation) rounded, the scale, softcap and ALiBi
/// rounded, P = softmax in f32 rounded; dV = Pᵀ·dO, dP = dO·Vᵀ rounded; the softmax backward
/// `dS = P ∘ (dP − rowsum(dP ∘ P))` in f32 rounded, the softcap's `1 − tanh²` and the scale
/// rounded; dQ = dS·K and dK = dSᵀ·Q with f32 accumulation, rounded to `dtype` at the end (dk
/// and dv summed over the GQA group in f32 first). The yardstick of the backward's tolerance rule.
///
/// # Errors
/// As [`attention_backward_f64`].
pub fn attention_backward_naive(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    d_o: &TensorView,
    dtype: DType,
) -> Result<RefGradients> {
    check_backward_views(p, q, k, v, d_o)?;
    let (d, dvd) = (p.head_dim, p.head_dim_v);
    let r = |x: f32| dtype.round(x);
    let n_q = p.batch * p.seqlen_q * p.heads_q * d;
    let n_k = p.batch * p.seqlen_k * p.heads_kv * d;
    let n_v = p.batch * p.seqlen_k * p.heads_kv * dvd;
    let mut dq = try_filled(n_q, 0.0f64, || "naive reference dq".into())?;
    let mut dk32 = try_filled(n_k, 0.0f32, || "naive reference dk".into())?;
    let mut dv32 = try_filled(n_v, 0.0f32, || "naive reference dv".into())?;
    let mut d_sinks = p.sinks.as_ref().map(|_| vec![0.0f64; p.heads_q]);
    let read = |t: &TensorView, b: usize, s: usize, h: usize| -> Vec<f32> {
        let mut out = vec![0.0f32; t.head_dim()];
        t.read_row(b, s, h, &mut out);
        out.iter().map(|&x| r(x)).collect()
    };
    let dot = |a: &[f32], b: &[f32]| -> f32 { a.iter().zip(b).map(|(x, y)| x * y).sum() };
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            let hk = h / p.group();
            let ks: Vec<Vec<f32>> = (0..p.seqlen_k).map(|j| read(k, b, j, hk)).collect();
            let vs: Vec<Vec<f32>> = (0..p.seqlen_k).map(|j| read(v, b, j, hk)).collect();
            // Per head: the group's dk/dv contributions in f32, as an autograd's per-head tensors.
            let mut dk_h = vec![0.0f32; p.seqlen_k * d];
            let mut dv_h = vec![0.0f32; p.seqlen_k * dvd];
            for i in 0..p.seqlen_q {
                let qi = read(q, b, i, h);
                let doi = read(d_o, b, i, h);
                let mut t = vec![0.0f32; p.seqlen_k];
                let s: Vec<f32> = (0..p.seqlen_k)
                    .map(|j| {
                        if !p.visible(i, j) {
                            return f32::NEG_INFINITY;
                        }
                        let mut s = r(r(dot(&qi, &ks[j])) * p.scale);
                        if let Some(cap) = p.softcap {
                            t[j] = r((s / cap).tanh());
                            s = r(cap * t[j]);
                        }
                        r(s + p.alibi_bias(h, i, j))
                    })
                    .collect();
                let sink = p.sink(h);
                let m = s.iter().copied().chain(sink).fold(f32::NEG_INFINITY, f32::max);
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let e: Vec<f32> = s.iter().map(|&x| (x - m).exp()).collect();
                let e_sink = sink.map_or(0.0, |z| (z - m).exp());
                let l: f32 = e.iter().sum::<f32>() + e_sink;
                let pr: Vec<f32> = e.iter().map(|x| r(x / l)).collect();
                let dp: Vec<f32> = vs.iter().map(|vj| r(dot(&doi, vj))).collect();
                let delta: f32 = pr.iter().zip(&dp).map(|(a, b)| a * b).sum();
                if let Some(ds) = d_sinks.as_mut() {
                    ds[h] -= r(r(e_sink / l) * delta) as f64;
                }
                let mut dqi = vec![0.0f32; d];
                for j in 0..p.seqlen_k {
                    if pr[j] == 0.0 && !p.visible(i, j) {
                        continue;
                    }
                    for (x, o) in dv_h[j * dvd..][..dvd].iter_mut().zip(&doi) {
                        *x += pr[j] * o;
                    }
                    let mut ds = r(pr[j] * (dp[j] - delta));
                    if p.softcap.is_some() {
                        ds = r(ds * (1.0 - t[j] * t[j]));
                    }
                    let ds = r(ds * p.scale);
                    for (x, kx) in dqi.iter_mut().zip(&ks[j]) {
                        *x += ds * kx;
                    }
                    for (x, qx) in dk_h[j * d..][..d].iter_mut().zip(&qi) {
                        *x += ds * qx;
                    }
                }
                for (x, y) in dq[((b * p.seqlen_q + i) * p.heads_q + h) * d..][..d].iter_mut().zip(&dqi) {
                    *x = r(*y) as f64;
                }
            }
            for j in 0..p.seqlen_k {
                let row = ((b * p.seqlen_k + j) * p.heads_kv + hk) * d;
                for x in 0..d {
                    dk32[row + x] += r(dk_h[j * d + x]);
                }
                let row = ((b * p.seqlen_k + j) * p.heads_kv + hk) * dvd;
                for x in 0..dvd {
                    dv32[row + x] += r(dv_h[j * dvd + x]);
                }
            }
        }
    }
    let widen = |v: Vec<f32>| v.into_iter().map(|x| r(x) as f64).collect();
    Ok(RefGradients { dq, dk: widen(dk32), dv: widen(dv32), d_sinks })
}

/// Largest absolute difference, NaN-aware: a NaN on one side only counts as infinite error, a NaN
/// on both sides as none.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| match (x.is_nan(), y.is_nan()) {
            (true, true) => 0.0,
            (false, false) if x == y => 0.0,
            (false, false) => (x - y).abs(),
            _ => f64::INFINITY,
        })
        .fold(0.0, f64::max)
}

/// The rotary embedding of one head's row in float64 (FlashAttention's `apply_rotary_emb`):
/// the first `2 * cos_row.len()` features turn by the angles whose cosines and sines are
/// `cos_row`, `sin_row` (one table row, the row's position), paired as adjacent features
/// `(2t, 2t + 1)` with `interleaved`, else as `t` and `t + cos_row.len()`; the rest pass through.
pub fn rotary_f64(x: &[f64], cos_row: &[f32], sin_row: &[f32], interleaved: bool) -> Vec<f64> {
    let half = cos_row.len();
    let mut out = x.to_vec();
    for (t, (&c, &s)) in cos_row.iter().zip(sin_row).enumerate() {
        let (a, b) = if interleaved { (2 * t, 2 * t + 1) } else { (t, t + half) };
        let (c, s) = (c as f64, s as f64);
        out[a] = x[a] * c - x[b] * s;
        out[b] = x[a] * s + x[b] * c;
    }
    out
}

/// Root-mean-square difference.
pub fn rmse(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().max(1) as f64;
    (a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>() / n).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ForwardOptions, Mask, Tensor};

    #[test]
    fn rotary_turns_each_pair_by_its_angle() {
        let (c, s) = (0.6f32, 0.8f32); // cos and sin of one angle
        let x = [1.0, 2.0, 3.0, 4.0, 5.0];
        // Half-split: pairs (0, 2) and (1, 3) of rotary_dim 4; feature 4 passes through.
        let r = rotary_f64(&x, &[c, 1.0], &[s, 0.0], false);
        let want = [1.0 * 0.6 - 3.0 * 0.8, 2.0, 1.0 * 0.8 + 3.0 * 0.6, 4.0, 5.0];
        assert!(r.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{r:?}");
        // Interleaved: pairs (0, 1) and (2, 3).
        let r = rotary_f64(&x, &[c, 1.0], &[s, 0.0], true);
        let want = [1.0 * 0.6 - 2.0 * 0.8, 1.0 * 0.8 + 2.0 * 0.6, 3.0, 4.0, 5.0];
        assert!(r.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{r:?}");
    }

    #[test]
    fn sampled_rows_match_the_full_reference() {
        let (b, sq, sk, hq, hkv, d) = (2, 13, 9, 4, 2, 8);
        let gen = |n: usize, salt: usize| -> Vec<f32> {
            (0..n).map(|i| (((i * 7919 + salt * 104729) % 211) as f32 / 211.0 - 0.5) * 3.0).collect()
        };
        let q = Tensor::from_vec(gen(b * sq * hq * d, 1), [b, sq, hq, d]).unwrap();
        let k = Tensor::from_vec(gen(b * sk * hkv * d, 2), [b, sk, hkv, d]).unwrap();
        let v = Tensor::from_vec(gen(b * sk * hkv * d, 3), [b, sk, hkv, d]).unwrap();
        // sq > sk with a causal window leaves the first rows with no key; softcap and GQA on top.
        let opts = ForwardOptions::default().mask(Mask::causal_window(2)).softcap(5.0);
        let p = Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
        let full = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
        let rows: Vec<_> = (0..b).flat_map(|bi| (0..hq).flat_map(move |h| (0..sq).map(move |i| (bi, h, i)))).collect();
        let sampled = attention_f64_rows(&p, &q.view(), &k.view(), &v.view(), &rows).unwrap();
        for (&(bi, h, i), got) in rows.iter().zip(&sampled) {
            let want = &full.o[((bi * sq + i) * hq + h) * d..][..d];
            assert!(max_abs_diff(got, want) < 1e-12, "row {bi},{h},{i}: {got:?} vs {want:?}");
        }
        assert!(sampled.iter().any(|r| r.iter().all(|&x| x == 0.0)), "some row sees no key");
    }

    /// `Σ o ∘ d_o` in float64: the loss whose gradient `attention_backward_f64` returns.
    fn loss(p: &Problem, q: &Tensor, k: &Tensor, v: &Tensor, d_o: &Tensor) -> f64 {
        let o = attention_f64(p, &q.view(), &k.view(), &v.view()).unwrap().o;
        o.iter().zip(d_o.to_f32_vec()).map(|(a, b)| a * b as f64).sum()
    }

    #[test]
    fn backward_matches_central_finite_differences() {
        let gen = |n: usize, salt: usize| -> Vec<f32> {
            (0..n).map(|i| (((i * 7919 + salt * 104729) % 211) as f32 / 211.0 - 0.5) * 2.0).collect()
        };
        let slopes: Vec<f32> = vec![0.25, 0.5, 0.125, 1.0];
        // (sq, sk, hq, hkv, d, options): GQA, causal with sq > sk (rows with no key), windows,
        // softcap, ALiBi, and seqlen_q != seqlen_k both ways.
        let cases: Vec<(usize, usize, usize, usize, usize, ForwardOptions)> = vec![
            (5, 7, 2, 1, 4, ForwardOptions::default()),
            (6, 4, 4, 2, 3, ForwardOptions::default().mask(Mask::Causal)),
            (7, 7, 2, 2, 4, ForwardOptions::default().mask(Mask::window(2, 1)).softcap(1.5)),
            (4, 6, 4, 1, 5, ForwardOptions::default().alibi_slopes(slopes.clone()).mask(Mask::causal_window(2))),
            (5, 5, 4, 4, 4, ForwardOptions::default().softcap(0.8).alibi_slopes(slopes.clone()).softmax_scale(0.9)),
            // Sinks: with GQA; causal with sq > sk (rows that see no key but the sink); with
            // softcap, ALiBi and a window; one head's sink -inf (no sink).
            (5, 7, 2, 1, 4, ForwardOptions::default().sinks(vec![0.3f32, -0.7])),
            (6, 4, 4, 2, 3, ForwardOptions::default().mask(Mask::Causal).sinks(vec![1.5f32, -0.2, 0.0, 2.0])),
            (
                5,
                6,
                4,
                2,
                4,
                ForwardOptions::default()
                    .mask(Mask::window(2, 1))
                    .softcap(1.5)
                    .alibi_slopes(slopes)
                    .sinks(vec![0.5f32, f32::NEG_INFINITY, -1.0, 0.25]),
            ),
        ];
        for (ci, (sq, sk, hq, hkv, d, opts)) in cases.into_iter().enumerate() {
            let q = Tensor::from_vec(gen(sq * hq * d, 1 + ci), [1, sq, hq, d]).unwrap();
            let k = Tensor::from_vec(gen(sk * hkv * d, 2 + ci), [1, sk, hkv, d]).unwrap();
            let v = Tensor::from_vec(gen(sk * hkv * d, 3 + ci), [1, sk, hkv, d]).unwrap();
            let d_o = Tensor::from_vec(gen(sq * hq * d, 4 + ci), [1, sq, hq, d]).unwrap();
            let p = Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
            let g = attention_backward_f64(&p, &q.view(), &k.view(), &v.view(), &d_o.view()).unwrap();
            let mut checked = 0;
            for (which, grad) in [(0, &g.dq), (1, &g.dk), (2, &g.dv)] {
                let base = [&q, &k, &v][which].to_f32_vec();
                for idx in 0..base.len() {
                    let at = |delta: f32| {
                        let mut x = base.clone();
                        x[idx] += delta;
                        let t = Tensor::from_vec(x.clone(), [&q, &k, &v][which].shape()).unwrap();
                        let (qq, kk, vv) = match which {
                            0 => (&t, &k, &v),
                            1 => (&q, &t, &v),
                            _ => (&q, &k, &t),
                        };
                        (loss(&p, qq, kk, vv, &d_o), x[idx] as f64)
                    };
                    let ((lp, xp), (lm, xm)) = (at(1e-3), at(-1e-3));
                    let fd = (lp - lm) / (xp - xm);
                    assert!((fd - grad[idx]).abs() <= 1e-5 * (1.0 + fd.abs()), "case {ci} operand {which} element {idx}: finite difference {fd}, analytic {}", grad[idx]);
                    checked += 1;
                }
            }
            assert_eq!(checked, sq * hq * d + 2 * sk * hkv * d);
            assert_eq!(g.d_sinks.is_some(), opts.sinks.is_some());
            if let (Some(sinks), Some(ds)) = (&opts.sinks, &g.d_sinks) {
                for h in 0..hq {
                    if sinks[h] == f32::NEG_INFINITY {
                        assert_eq!(ds[h], 0.0, "case {ci}: a -inf sink has no gradient");
                        continue;
                    }
                    let at = |delta: f32| {
                        let mut s = sinks.to_vec();
                        s[h] += delta;
                        let pp = Problem::new(&q.view(), &k.view(), &v.view(), &opts.clone().sinks(s.clone())).unwrap();
                        (loss(&pp, &q, &k, &v, &d_o), s[h] as f64)
                    };
                    let ((lp, xp), (lm, xm)) = (at(1e-3), at(-1e-3));
                    let fd = (lp - lm) / (xp - xm);
                    assert!((fd - ds[h]).abs() <= 1e-5 * (1.0 + fd.abs()), "case {ci} sink {h}: finite difference {fd}, analytic {}", ds[h]);
                    assert!(ds[h] != 0.0, "case {ci} sink {h}: a zero gradient checks nothing");
                }
            }
            if ci == 1 {
                // sq 6 > sk 4, causal: the first two rows see no key and have zero gradients.
                assert!(g.dq[..2 * hq * d].iter().all(|&x| x == 0.0));
                assert!(g.dq.iter().any(|&x| x != 0.0));
            }
        }
    }
}

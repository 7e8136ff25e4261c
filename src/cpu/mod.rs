//! The CPU backend: FlashAttention's algorithm on the host.
//!
//! Per (batch, kv head), K and V are packed once (f32, strips of 6 keys / 6 columns); every
//! query head of the GQA group and every block of `BR` query rows then streams over the key
//! tiles of `BC` keys: `Sᵀ = K·Qᵀ` (6×16 register micro-kernel), the online softmax of each
//! query (exp2 of `(x − m)·scale·log2e`, −inf guard; `softmax` explains the units),
//! `Oᵀ = Oᵀ·diag(scale) + Vᵀ·Pᵀ`, and one normalisation at the end. Work items (kv head, group head, query block) are handed out heaviest first to
//! `std` threads; each writes its own disjoint slice of the output.

mod gemm;
pub(crate) mod inplace;
mod parallel;
mod pool;
pub mod softmax;

use crate::error::{Error, Result};
use crate::numerics::softmax_math::SoftmaxMath;
use crate::numerics::exp2::{poly_frac, EXP2_CLAMP_LOW};
use crate::numerics::hadamard::Rotation;
use crate::numerics::quant::fake_quantize;
use crate::options::Precision;
use crate::problem::Problem;
use crate::tensor::{try_filled, DataMut, Element, Tensor, TensorView};
use gemm::{micro_kernel, micro_kernel_skip_zero_b, Acc, MR, NR};
use softmax::{finalize, max_get_scale, online_softmax, rescale_o, Exp2Math, RowState};
use std::sync::Mutex;

/// Query rows per work item (a multiple of the 16-query panels).
pub const BR: usize = 96;
/// Keys per tile (a multiple of the micro-kernel's 6-key strips).
pub const BC: usize = 96;
/// Largest head_dim the CPU backend accepts.
pub const MAX_HEAD_DIM: usize = 512;
/// Upper bound on the packed K/V held at once; larger problems are processed in chunks of kv heads.
const PACK_BUDGET_BYTES: usize = 256 << 20;

/// The CPU result: `o` as `[batch, seqlen_q, heads_q, head_dim]` in q's dtype, `lse` as
/// `[batch, heads_q, seqlen_q]`.
pub(crate) struct CpuOutput {
    pub o: Tensor,
    pub lse: Vec<f32>,
    pub kernel: &'static str,
}

/// Native arithmetic: exp2 by the degree-5 polynomial (max relative error 8.5e-8, about one f32
/// ulp), vectorisable, no P rounding, eager rescaling.
#[derive(Clone, Copy)]
pub(crate) struct Native;

impl Exp2Math for Native {
    #[inline(always)]
    fn p_offset(&self) -> f32 {
        0.0
    }
    #[inline(always)]
    fn exp2(&self, x: f32) -> f32 {
        exp2_fast(x)
    }
    #[inline(always)]
    fn round_p(&self, p: f32) -> f32 {
        p
    }
    #[inline(always)]
    fn lazy_threshold(&self) -> Option<f32> {
        None
    }
}

/// `1.5 * 2^23`: adding it to a float in `[-2^22, 2^22)` leaves the integer in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// The f32 exponent bias.
const EXP_BIAS: f32 = 127.0;

/// The native CPU `exp2` for `x <= 0` (every argument of the native softmax: `(x − m)·c` with
/// `x <= m`, and the rescale factor's `−growth`): the same split and degree-5 polynomial as
/// [`crate::numerics::exp2::exp2_poly`], but `2^floor(x)` is built as a float from the bits of
/// `floor(x) + 127 + 1.5·2^23` and multiplied in, so the whole function vectorises (a float→int
/// conversion would not: Rust's saturating `as i32` is scalarised). NaN propagates through the
/// product; x < −126 gives 0 (below f32's normal range, irrelevant to a softmax). Positive
/// arguments are clamped to 0 (never reached; the clamp keeps the exponent bits in range).
#[inline(always)]
#[allow(clippy::manual_clamp)] // `f32::clamp` asserts its bounds; the `if` chain is what vectorises (and passes NaN)
fn exp2_fast(x: f32) -> f32 {
    // `if` chains rather than min/max so that NaN passes through.
    let x = if x < EXP2_CLAMP_LOW { EXP2_CLAMP_LOW } else if x > 0.0 { 0.0 } else { x };
    let n = x.floor();
    let p = poly_frac::<5>(x - n);
    // n + 127 is in [0, 127]: it sits in the low 8 mantissa bits; << 23 moves it to the exponent.
    let two_n = f32::from_bits((n + (ROUND_MAGIC + EXP_BIAS)).to_bits() << 23);
    p * two_n
}

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// K and V of one (batch, kv head) in the micro-kernel's A-operand layouts (strips of `MR` rows).
struct PackedKv {
    /// `[seqlen_k_pad / MR][head_dim][MR]`: strips of 6 keys, zero-padded.
    k: Vec<f32>,
    /// `[head_dim_pad / MR][seqlen_k_pad][MR]`: strips of 6 columns of V (i.e. rows of Vᵀ).
    v: Vec<f32>,
    /// Every element of V is finite. Otherwise `Oᵀ += Vᵀ·Pᵀ` skips the zeros of P, so a key's
    /// infinite or NaN V reaches only the queries that see it (`0 · inf` is NaN).
    v_finite: bool,
}

fn pack_kv(p: &Problem, sz: &Sizes, k: &TensorView, v: &TensorView, b: usize, hk: usize) -> Result<PackedKv> {
    let d = p.head_dim;
    let sk_pad = sz.sk_pad;
    let mut kp = pool::take(sz.k_pack, "packed K of one head")?;
    let mut vp = pool::take(sz.v_pack, "packed V of one head")?;
    let mut row = vec![0.0f32; d];
    for j in 0..p.seqlen_k {
        let (strip, lane) = (j / MR, j % MR);
        k.read_row(b, j, hk, &mut row);
        let base = strip * d * MR;
        for (x, &val) in row.iter().enumerate() {
            kp[base + x * MR + lane] = val;
        }
        v.read_row(b, j, hk, &mut row);
        for (x, &val) in row.iter().enumerate() {
            vp[(x / MR) * sk_pad * MR + j * MR + x % MR] = val;
        }
    }
    let v_finite = all_finite(&vp);
    Ok(PackedKv { k: kp, v: vp, v_finite })
}

/// Whether every element is finite: `x * 0` is 0 for a finite x and NaN for ±inf or NaN, summed
/// in 8 independent lanes so that the loop vectorises.
fn all_finite(x: &[f32]) -> bool {
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i] * 0.0;
        }
    }
    acc.iter().all(|&a| a == 0.0) && tail.iter().all(|t| t.is_finite())
}

/// Sizes of the CPU backend's buffers, computed with checked arithmetic before anything is
/// allocated: a problem whose buffers cannot exist is [`Error::TooLarge`] up front.
struct Sizes {
    /// `seqlen_k` rounded up to the micro-kernel's strips.
    sk_pad: usize,
    /// f32 elements of one head's packed K, and of its packed V.
    k_pack: usize,
    v_pack: usize,
    /// Output elements `[batch, heads_q, seqlen_q, head_dim]` and LSEs `[batch, heads_q, seqlen_q]`.
    n_o: usize,
    n_lse: usize,
}

impl Sizes {
    fn new(p: &Problem) -> Result<Self> {
        let too_large = |what: &str| Error::TooLarge { what: format!("the CPU backend's {what} for this problem") };
        let d = p.head_dim;
        let dv = round_up(d, MR); // d <= MAX_HEAD_DIM
        let sk_pad = p.seqlen_k.checked_next_multiple_of(MR).ok_or_else(|| too_large("padded key count"))?;
        let f32s = |n: Option<usize>, what: &str| {
            n.filter(|&n| n <= isize::MAX as usize / 4).ok_or_else(|| too_large(what))
        };
        let k_pack = f32s(sk_pad.checked_mul(d), "packed K")?;
        let v_pack = f32s(sk_pad.checked_mul(dv), "packed V")?;
        let n_lse = f32s(p.batch.checked_mul(p.heads_q).and_then(|x| x.checked_mul(p.seqlen_q)), "LSE")?;
        let n_o = f32s(n_lse.checked_mul(d), "output")?;
        Ok(Sizes { sk_pad, k_pack, v_pack, n_o, n_lse })
    }
}

/// Per-thread scratch, sized once. Everything about queries is held transposed, in panels of
/// `NR` queries side by side, so the softmax and the rescale are vertical vector operations and
/// the probabilities are already in the B-operand layout of the second product.
struct Scratch {
    /// Qᵀ panels `[BR / NR][head_dim][NR]`.
    q: Vec<f32>,
    /// Sᵀ (then Pᵀ) panels `[BR / NR][BC][NR]`.
    s: Vec<f32>,
    /// Oᵀ panels `[BR / NR][head_dim_pad][NR]`.
    o: Vec<f32>,
    rows: Vec<RowState>,
    q_row: Vec<f32>,
}

impl Scratch {
    fn new(d: usize) -> Self {
        Scratch {
            q: vec![0.0; BR * d],
            s: vec![0.0; BR * BC],
            o: vec![0.0; BR * round_up(d, MR)],
            rows: vec![RowState::EMPTY; BR],
            q_row: vec![0.0; d],
        }
    }
}

/// How scores are formed from `Q·Kᵀ` and converted (units: see `softmax`).
#[derive(Clone, Copy)]
struct ScoreMod {
    /// Scores in natural units (`scale · q·k`, then softcap, then ALiBi), because softcap or
    /// ALiBi is on; otherwise raw dot products.
    natural: bool,
    /// Score units to log2 units: `scale · log2 e` for raw dot products, `log2 e` for natural.
    c: f32,
    /// Score units to natural units (for the LSE): `scale`, or 1.
    u: f32,
    scale: f32,
    /// With softcap: the cap, the score being `cap · tanh(s / cap)`.
    softcap: Option<f32>,
}

impl ScoreMod {
    fn new(p: &Problem) -> Self {
        let units = p.score_units();
        ScoreMod { natural: units.natural, c: units.to_log2, u: units.to_natural, scale: p.scale, softcap: p.softcap }
    }
}

/// One work item: query rows `i0..i1` of head `h` against the packed K/V of its kv head.
/// Writes `(i1 - i0) × d` normalised outputs to `o_out` and the LSEs to `lse_out`.
///
/// Transposed formulation: `Sᵀ = K·Qᵀ` (A = 6 keys, B = 16 queries), softmax down each query
/// column, `Oᵀ += Vᵀ·Pᵀ` (A = 6 columns of V, B = the Pᵀ panel as it lies): no per-tile packing.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `pn` indexes the panel's keys, Q and score slices alike
fn attend_block<M: Exp2Math, const FMA: bool>(
    p: &Problem,
    q: &TensorView,
    kv: &PackedKv,
    (b, h, i0, i1): (usize, usize, usize, usize),
    sm: ScoreMod,
    math: &M,
    scr: &mut Scratch,
    o_out: &mut [f32],
    lse_out: &mut [f32],
) {
    let d = p.head_dim;
    let dv = round_up(d, MR);
    let sk_pad = round_up(p.seqlen_k, MR);
    let nrows = i1 - i0;
    let panels = nrows.div_ceil(NR);

    // Qᵀ panels (queries past i1 are zero and their results are dropped).
    for pn in 0..panels {
        let dst = &mut scr.q[pn * d * NR..(pn + 1) * d * NR];
        for lane in 0..NR {
            let r = pn * NR + lane;
            if r < nrows {
                q.read_row(b, i0 + r, h, &mut scr.q_row);
                for (x, &val) in scr.q_row.iter().enumerate() {
                    dst[x * NR + lane] = val;
                }
            } else {
                for x in 0..d {
                    dst[x * NR + lane] = 0.0;
                }
            }
        }
    }
    scr.o[..panels * NR * dv].iter_mut().for_each(|x| *x = 0.0);
    scr.rows[..panels * NR].iter_mut().for_each(|r| *r = RowState::EMPTY);

    // Keys any row of the block can see, and those every row sees (no masking needed).
    let ranges: Vec<(usize, usize)> = (i0..i1).map(|i| p.key_range(i)).collect();
    let lo_all = ranges.iter().map(|r| r.0).min().unwrap_or(0);
    let hi_all = ranges.iter().map(|r| r.1).max().unwrap_or(0);
    let inner_lo = ranges.iter().map(|r| r.0).max().unwrap_or(0);
    let inner_hi = ranges.iter().map(|r| r.1).min().unwrap_or(0);
    // Per panel of 16 queries: the keys any of them sees, so that each panel computes only the
    // part of a tile it can see (the triangle above a causal diagonal, the outside of a window).
    let panel_keys: Vec<(usize, usize)> = ranges
        .chunks(NR)
        .map(|rs| (rs.iter().map(|r| r.0).min().unwrap_or(0), rs.iter().map(|r| r.1).max().unwrap_or(0)))
        .collect();

    let mut j0 = lo_all / MR * MR;
    while j0 < hi_all {
        let j1 = (j0 + BC).min(round_up(hi_all, MR)).min(sk_pad);
        let cols = j1 - j0;
        let full_tile = j0 >= inner_lo && j1 <= inner_hi;
        for pn in 0..panels {
            // This panel's part of the tile: local keys c0..c1 (multiples of MR).
            let (plo, phi) = panel_keys[pn];
            let c0 = (plo.max(j0) - j0) / MR * MR;
            let c1 = (round_up(phi.max(j0), MR) - j0).min(cols);
            if c0 >= c1 {
                continue;
            }
            let (k0, k1) = (j0 + c0, j0 + c1);
            let qp = &scr.q[pn * d * NR..(pn + 1) * d * NR];
            let sp = &mut scr.s[pn * BC * NR + c0 * NR..pn * BC * NR + c1 * NR];
            // Sᵀ = K·Qᵀ, six keys at a time.
            for (ks, s6) in sp.chunks_exact_mut(MR * NR).enumerate() {
                let strip = k0 / MR + ks;
                let mut acc: Acc = [[0.0; NR]; MR];
                micro_kernel::<FMA>(&kv.k[strip * d * MR..(strip + 1) * d * MR], qp, &mut acc);
                for (dst, a) in s6.chunks_exact_mut(NR).zip(&acc) {
                    dst.copy_from_slice(a);
                }
            }
            // Softcap and ALiBi, in natural units (as a straightforward implementation computes
            // them: each step is finite wherever its f32 counterpart there is).
            if sm.natural {
                for (jl, row) in sp.chunks_exact_mut(NR).enumerate() {
                    for (lane, x) in row.iter_mut().enumerate().take(nrows.saturating_sub(pn * NR)) {
                        let s = *x * sm.scale;
                        // A division, as a straightforward implementation writes it: for a cap
                        // far above the scores, (s / cap) * cap gives s back to within an ulp,
                        // where s * (1 / cap) * cap accumulates three roundings.
                        let s = match sm.softcap {
                            Some(cap) => cap * (s / cap).tanh(),
                            None => s,
                        };
                        *x = s + p.alibi_bias(h, i0 + pn * NR + lane, k0 + jl);
                    }
                }
            }
            // The mask, branch-free per lane so it vectorises (padded lanes see everything).
            if !full_tile {
                let lo: [i64; NR] = std::array::from_fn(|l| ranges.get(pn * NR + l).map_or(0, |r| r.0 as i64));
                let hi: [i64; NR] = std::array::from_fn(|l| ranges.get(pn * NR + l).map_or(i64::MAX, |r| r.1 as i64));
                for (jl, row) in sp.chunks_exact_mut(NR).enumerate() {
                    let j = (k0 + jl) as i64;
                    for q in 0..NR {
                        row[q] = if j < lo[q] || j >= hi[q] { f32::NEG_INFINITY } else { row[q] };
                    }
                }
            }
            // Online softmax down each query column.
            let states = &mut scr.rows[pn * NR..(pn + 1) * NR];
            let tile_max = softmax::panel_max(sp);
            let scales: [f32; NR] = std::array::from_fn(|q| max_get_scale(&mut states[q], tile_max[q], sm.c, math));
            online_softmax::<M, FMA>(states, &scales, sp, sm.c, math);
            let op = &mut scr.o[pn * dv * NR..(pn + 1) * dv * NR];
            rescale_o(op, &scales);
            // Oᵀ += Vᵀ·Pᵀ, six columns of V at a time.
            for (ds, o6) in op.chunks_exact_mut(MR * NR).enumerate() {
                let base = ds * sk_pad * MR;
                let mut acc: Acc = [[0.0; NR]; MR];
                for (a, src) in acc.iter_mut().zip(o6.chunks_exact(NR)) {
                    a.copy_from_slice(src);
                }
                let vs = &kv.v[base + k0 * MR..base + k1 * MR];
                if kv.v_finite {
                    micro_kernel::<FMA>(vs, sp, &mut acc);
                } else {
                    micro_kernel_skip_zero_b::<FMA>(vs, sp, &mut acc);
                }
                for (dst, a) in o6.chunks_exact_mut(NR).zip(&acc) {
                    dst.copy_from_slice(a);
                }
            }
        }
        j0 = j1;
    }

    for r in 0..nrows {
        let (pn, lane) = (r / NR, r % NR);
        let (inv, lse) = finalize(&scr.rows[r], sm.u, math);
        lse_out[r] = lse;
        let op = &scr.o[pn * dv * NR..];
        let out = &mut o_out[r * d..(r + 1) * d];
        if scr.rows[r].l == 0.0 {
            out.fill(0.0); // saw no key: exactly 0, whatever reached O
        } else {
            for (x, dst) in out.iter_mut().enumerate() {
                *dst = op[x * NR + lane] * inv;
            }
        }
    }
}

/// Work item: (b, kv head, q head, row range), with its output slices.
type Item<'o> = ((usize, usize, usize, usize, usize), &'o mut [f32], &'o mut [f32]);

/// Runs one thread's share of the items of a chunk.
#[inline(always)]
fn worker<M: Exp2Math, const FMA: bool>(
    p: &Problem,
    q: &TensorView,
    packed: &[(usize, PackedKv)],
    sm: ScoreMod,
    math: &M,
    queue: &Mutex<Vec<Item<'_>>>,
) {
    let mut scr = Scratch::new(p.head_dim);
    loop {
        let item = match queue.lock() {
            Ok(mut g) => g.pop(),
            Err(poisoned) => poisoned.into_inner().pop(),
        };
        let Some(((b, kvi, h, i0, i1), o_out, lse_out)) = item else { break };
        let kv = &packed[kvi].1;
        attend_block::<M, FMA>(p, q, kv, (b, h, i0, i1), sm, math, &mut scr, o_out, lse_out);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn worker_avx2<M: Exp2Math>(
    p: &Problem,
    q: &TensorView,
    packed: &[(usize, PackedKv)],
    sm: ScoreMod,
    math: &M,
    queue: &Mutex<Vec<Item<'_>>>,
) {
    worker::<M, true>(p, q, packed, sm, math, queue)
}

fn run_worker<M: Exp2Math>(
    p: &Problem,
    q: &TensorView,
    packed: &[(usize, PackedKv)],
    sm: ScoreMod,
    math: &M,
    queue: &Mutex<Vec<Item<'_>>>,
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU was just checked to support AVX2 and FMA, the only requirement of a
        // `#[target_feature]` function; the function itself is safe code.
        unsafe { worker_avx2(p, q, packed, sm, math, queue) };
        return;
    }
    worker::<M, false>(p, q, packed, sm, math, queue)
}

/// Number of worker threads: the request, capped at the machine's available parallelism (more
/// threads than cores only add scheduling and memory on this compute-bound work); `None` or 0
/// uses the available parallelism.
pub(crate) fn threads(requested: Option<usize>) -> usize {
    let hw = std::thread::available_parallelism().map_or(1, |n| n.get());
    requested.filter(|&n| n > 0).map_or(hw, |n| n.min(hw))
}

/// Runs `job` on up to `n` threads of `scope` (the calling thread being one of them). A thread
/// the system refuses to start is simply not started: the others share its work.
fn run_on<'scope, 'env, F>(scope: &'scope std::thread::Scope<'scope, 'env>, n: usize, job: &'scope F)
where
    F: Fn() + Sync,
{
    for _ in 1..n {
        if std::thread::Builder::new().spawn_scoped(scope, job).is_err() {
            break;
        }
    }
    job();
}

fn check_head_dim(p: &Problem) -> Result<()> {
    if p.head_dim > MAX_HEAD_DIM {
        return Err(Error::UnsupportedHeadDim {
            head_dim: p.head_dim,
            backend: "the CPU backend".into(),
            supported: format!("1..={MAX_HEAD_DIM}"),
        });
    }
    Ok(())
}

/// The CPU forward pass on validated inputs, with the given exp2/rounding arithmetic.
#[cfg(any(test, feature = "bench"))]
pub(crate) fn forward_with<M: Exp2Math>(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    math: M,
    nthreads: usize,
) -> Result<CpuOutput> {
    check_head_dim(p)?;
    let mut o = Tensor::zeros(p.dtype, [p.batch, p.seqlen_q, p.heads_q, p.head_dim])?;
    let lse = forward_with_into(p, q, k, v, math, nthreads, o.data_mut().as_data_mut())?;
    Ok(CpuOutput { o, lse, kernel: path_name() })
}

/// As [`forward_with`], writing the output into `dst` (contiguous `[batch, seqlen_q, heads_q,
/// head_dim]` of the problem's dtype, checked by the caller); returns the LSE.
fn forward_with_into<M: Exp2Math>(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    math: M,
    nthreads: usize,
    dst: DataMut<'_>,
) -> Result<Vec<f32>> {
    check_head_dim(p)?;
    let d = p.head_dim;
    let sm = ScoreMod::new(p);
    // Every size first: a problem too large for this machine fails here, before any work.
    let sz = Sizes::new(p)?;
    // Internal layout [batch, heads_q, seqlen_q, d] so each work item owns a contiguous slice.
    let mut o_hm = pool::take(sz.n_o, "output")?;
    let mut lse = try_filled(sz.n_lse, f32::NEG_INFINITY, || "LSE".into())?;

    let kv_bytes = 4 * (sz.k_pack + sz.v_pack);
    let chunk = (PACK_BUDGET_BYTES / kv_bytes.max(1)).clamp(1, p.batch * p.heads_kv);
    let nblocks = p.seqlen_q.div_ceil(BR);
    let per_kv = p.group() * nblocks; // work items per kv head
    let (mut o_rest, mut lse_rest) = (&mut o_hm[..], &mut lse[..]);

    let kv_heads: Vec<(usize, usize)> =
        (0..p.batch).flat_map(|b| (0..p.heads_kv).map(move |hk| (b, hk))).collect();
    for heads in kv_heads.chunks(chunk) {
        // Pack this chunk's K/V in parallel.
        let packed: Vec<(usize, PackedKv)> = {
            let next = Mutex::new(heads.iter().enumerate().rev().collect::<Vec<_>>());
            let out = Mutex::new(Vec::with_capacity(heads.len()));
            let job = || loop {
                let job = next.lock().unwrap_or_else(|e| e.into_inner()).pop();
                let Some((idx, &(b, hk))) = job else { break };
                let pk = pack_kv(p, &sz, k, v, b, hk);
                out.lock().unwrap_or_else(|e| e.into_inner()).push((idx, pk));
            };
            std::thread::scope(|s| run_on(s, nthreads.min(heads.len()), &job));
            let mut v = out.into_inner().unwrap_or_else(|e| e.into_inner());
            v.sort_by_key(|x| x.0);
            let mut packed = Vec::with_capacity(v.len());
            for (i, pk) in v {
                packed.push((heads[i].1, pk?));
            }
            packed
        };
        // Split this chunk's output into one slice per work item, in memory order.
        let mut items: Vec<(u64, Item)> = Vec::with_capacity(heads.len() * per_kv);
        for (kvi, &(b, hk)) in heads.iter().enumerate() {
            for g in 0..p.group() {
                let h = hk * p.group() + g;
                for blk in 0..nblocks {
                    let (i0, i1) = (blk * BR, ((blk + 1) * BR).min(p.seqlen_q));
                    let (o_item, o_tail) = std::mem::take(&mut o_rest).split_at_mut((i1 - i0) * d);
                    let (l_item, l_tail) = std::mem::take(&mut lse_rest).split_at_mut(i1 - i0);
                    o_rest = o_tail;
                    lse_rest = l_tail;
                    let cost: u64 = (i0..i1)
                        .map(|i| {
                            let (lo, hi) = p.key_range(i);
                            hi.saturating_sub(lo) as u64
                        })
                        .sum();
                    items.push((cost, ((b, kvi, h, i0, i1), o_item, l_item)));
                }
            }
        }
        // Heaviest first (popped from the back): causal blocks near the bottom go out early.
        items.sort_by_key(|x| x.0);
        let queue = Mutex::new(items.into_iter().map(|x| x.1).collect::<Vec<_>>());
        let n = nthreads.min(heads.len() * per_kv).max(1);
        let job = || run_worker(p, q, &packed, sm, &math, &queue);
        std::thread::scope(|s| run_on(s, n, &job));
        for (_, pk) in packed {
            pool::give(pk.k);
            pool::give(pk.v);
        }
    }

    match dst {
        DataMut::F32(v) => to_seq_major(p, &o_hm, v, nthreads),
        DataMut::F16(v) => to_seq_major(p, &o_hm, v, nthreads),
        DataMut::BF16(v) => to_seq_major(p, &o_hm, v, nthreads),
    }
    pool::give(o_hm);
    Ok(lse)
}

/// `[b, h, s, d]` f32 → `[b, s, h, d]` in the output type, split over threads by blocks of rows
/// (each block of all heads is contiguous in the output).
fn to_seq_major<T: Element>(p: &Problem, src: &[f32], dst: &mut [T], nthreads: usize) {
    let (hq, sq, d) = (p.heads_q, p.seqlen_q, p.head_dim);
    let rows = p.batch * sq;
    let per = rows.div_ceil(nthreads.max(1)).max(1);
    let convert = |c: usize, chunk: &mut [T]| {
        for (r, row) in chunk.chunks_mut(hq * d).enumerate() {
            let (b, i) = ((c * per + r) / sq, (c * per + r) % sq);
            for (h, out) in row.chunks_mut(d).enumerate() {
                let from = &src[((b * hq + h) * sq + i) * d..][..d];
                for (o, &x) in out.iter_mut().zip(from) {
                    *o = T::from_f32(x);
                }
            }
        }
    };
    let chunks: Vec<(usize, &mut [T])> = dst.chunks_mut(per * hq * d).enumerate().collect();
    let n = chunks.len();
    let queue = Mutex::new(chunks);
    let job = || loop {
        let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let Some((c, chunk)) = next else { break };
        convert(c, chunk);
    };
    std::thread::scope(|s| run_on(s, n, &job));
}

/// The CPU forward pass with the problem's arithmetic. Returns the output and the name of the
/// path that ran.
///
/// `Native` runs when precision is Native, exp2 Accurate and rescale Always; any other option
/// runs that kernel arithmetic on the CPU (`numerics::softmax_math`), and FP8 first rotates
/// (optionally) and fake-quantises Q, K, V (`numerics::quant::fake_quantize`).
pub(crate) fn run(p: &Problem, q: &TensorView, k: &TensorView, v: &TensorView, nthreads: usize) -> Result<CpuOutput> {
    check_head_dim(p)?; // before the FP8 preprocessing reads anything
    let mut o = Tensor::zeros(p.dtype, [p.batch, p.seqlen_q, p.heads_q, p.head_dim])?;
    let (lse, kernel) = run_into(p, q, k, v, nthreads, o.data_mut().as_data_mut())?;
    Ok(CpuOutput { o, lse, kernel })
}

/// As [`run`], writing the output into `dst` (contiguous `[batch, seqlen_q, heads_q, head_dim]`
/// of the problem's dtype, checked by the caller); returns the LSE and the path's name.
pub(crate) fn run_into(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    nthreads: usize,
    dst: DataMut<'_>,
) -> Result<(Vec<f32>, &'static str)> {
    let math = SoftmaxMath::for_problem(p);
    if math.is_native() {
        return Ok((forward_with_into(p, q, k, v, Native, nthreads, dst)?, path_name()));
    }
    let Precision::Fp8 { scaling, hadamard } = p.precision else {
        return Ok((forward_with_into(p, q, k, v, math, nthreads, dst)?, "cpu-tiled-emulated-exp2"));
    };
    let rot = hadamard.and_then(|seed| Rotation::new(p.head_dim, seed));
    let q8 = fake_quantize(q, scaling, rot.as_ref())?;
    let k8 = fake_quantize(k, scaling, rot.as_ref())?;
    let v8 = fake_quantize(v, scaling, None)?;
    let lse = forward_with_into(p, &q8.view(), &k8.view(), &v8.view(), math, nthreads, dst)?;
    Ok((lse, "cpu-tiled-emulated-fp8"))
}

/// Name of the micro-kernel path this CPU takes.
pub(crate) fn path_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        return "cpu-tiled-avx2-fma";
    }
    "cpu-tiled-portable"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_requests_are_capped_at_the_available_parallelism() {
        let hw = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(threads(None), hw);
        assert_eq!(threads(Some(0)), hw);
        assert_eq!(threads(Some(1)), 1);
        assert_eq!(threads(Some(1_000_000)), hw);
        assert_eq!(threads(Some(usize::MAX)), hw);
    }

    #[test]
    fn exp2_fast_on_its_domain() {
        assert_eq!(exp2_fast(0.0), 1.0);
        assert_eq!(exp2_fast(-1.0), 0.5);
        assert_eq!(exp2_fast(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2_fast(-200.0), 0.0);
        assert!(exp2_fast(f32::NAN).is_nan());
        assert_eq!(exp2_fast(5.0), 1.0, "positive arguments never occur; clamped to 0");
        for i in 0..2000 {
            let x = -126.0 * i as f32 / 2000.0;
            let rel = (exp2_fast(x) as f64 / (x as f64).exp2() - 1.0).abs();
            assert!(rel < 2e-7, "{x}: {rel}");
        }
    }

    #[test]
    fn all_finite_sees_every_element() {
        for n in [0usize, 1, 7, 8, 9, 64, 77] {
            let mut x = vec![1.5f32; n];
            assert!(all_finite(&x));
            for i in 0..n {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    x[i] = bad;
                    assert!(!all_finite(&x), "n {n} i {i} {bad}");
                    x[i] = f32::MAX;
                    assert!(all_finite(&x));
                }
            }
        }
    }
}

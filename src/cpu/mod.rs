//! The CPU backend: FlashAttention's algorithm on the host.
//!
//! Per (batch, kv head), K is packed once into 16-key panels and V into 16-column panels (f32);
//! every query head of the GQA group and every block of `BR` query rows then streams over the
//! key tiles of `BC` keys: `S = Q·Kᵀ` (6×16 register micro-kernel), the online softmax of each row
//! (exp2 on pre-scaled scores, −inf guard), `O = diag(scale)·O + P·V`, and one normalisation at
//! the end. Work items (kv head, group head, query block) are handed out heaviest first to
//! `std` threads; each writes its own disjoint slice of the output.

mod gemm;
pub mod softmax;

use crate::error::{Error, Result};
use crate::numerics::emulate::EmulatedMath;
use crate::numerics::exp2::exp2_poly;
use crate::numerics::hadamard::Rotation;
use crate::numerics::quant::fake_quantize;
use crate::options::Precision;
use crate::problem::{Problem, LOG2E};
use crate::tensor::{Tensor, TensorView};
use gemm::{micro_kernel, pack_a, Acc, MR, NR};
use softmax::{finalize, max_get_scale, online_softmax, rescale_o, Exp2Math, RowState};
use std::sync::Mutex;

/// Query rows per work item (a multiple of the micro-kernel's 6 rows).
pub const BR: usize = 48;
/// Keys per tile (a multiple of the micro-kernel's 16 columns).
pub const BC: usize = 128;
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
        exp2_poly::<5>(x)
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

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// K and V of one (batch, kv head) in the micro-kernel's panel layouts.
struct PackedKv {
    /// `[seqlen_k / 16][head_dim][16]`, zero-padded keys.
    k: Vec<f32>,
    /// `[head_dim_pad / 16][seqlen_k_pad][16]`, zero-padded keys and columns.
    v: Vec<f32>,
}

fn pack_kv(p: &Problem, k: &TensorView, v: &TensorView, b: usize, hk: usize) -> PackedKv {
    let d = p.head_dim;
    let sk_pad = round_up(p.seqlen_k, NR);
    let d_pad = round_up(d, NR);
    let mut kp = vec![0.0f32; sk_pad * d];
    let mut vp = vec![0.0f32; d_pad * sk_pad];
    let mut row = vec![0.0f32; d];
    for j in 0..p.seqlen_k {
        let (panel, lane) = (j / NR, j % NR);
        k.read_row(b, j, hk, &mut row);
        let base = panel * d * NR;
        for (x, &val) in row.iter().enumerate() {
            kp[base + x * NR + lane] = val;
        }
        v.read_row(b, j, hk, &mut row);
        for (x, &val) in row.iter().enumerate() {
            vp[(x / NR) * sk_pad * NR + j * NR + x % NR] = val;
        }
    }
    PackedKv { k: kp, v: vp }
}

/// Per-thread scratch, sized once.
struct Scratch {
    q_packed: Vec<f32>,
    s: Vec<f32>,
    p_packed: Vec<f32>,
    o: Vec<f32>,
    rows: Vec<RowState>,
    q_row: Vec<f32>,
}

impl Scratch {
    fn new(d: usize) -> Self {
        let d_pad = round_up(d, NR);
        Scratch {
            q_packed: vec![0.0; BR * d],
            s: vec![0.0; BR * BC],
            p_packed: vec![0.0; BR * BC],
            o: vec![0.0; BR * d_pad],
            rows: vec![RowState::EMPTY; BR],
            q_row: vec![0.0; d],
        }
    }
}

/// How scores are formed from the pre-scaled `Q·Kᵀ`.
#[derive(Clone, Copy)]
struct ScoreMod {
    /// Multiplies q when packing: `scale * log2e`, or `scale / cap` with softcap.
    q_mul: f32,
    /// With softcap: `cap * log2e` multiplies `tanh(s)`.
    softcap_log2: Option<f32>,
}

/// One work item: query rows `i0..i1` of head `h` against the packed K/V of its kv head.
/// Writes `(i1 - i0) × d` normalised outputs to `o_out` and the LSEs to `lse_out`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
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
    let d_pad = round_up(d, NR);
    let sk_pad = round_up(p.seqlen_k, NR);
    let nrows = i1 - i0;
    let strips = nrows.div_ceil(MR);

    // Q tile: pre-scaled, packed in strips of MR rows.
    for st in 0..strips {
        let rows_here = (nrows - st * MR).min(MR);
        let dst = &mut scr.q_packed[st * MR * d..(st + 1) * MR * d];
        for r in 0..MR {
            if r < rows_here {
                q.read_row(b, i0 + st * MR + r, h, &mut scr.q_row);
                for (x, &val) in scr.q_row.iter().enumerate() {
                    dst[x * MR + r] = val * sm.q_mul;
                }
            } else {
                for x in 0..d {
                    dst[x * MR + r] = 0.0;
                }
            }
        }
    }
    scr.o[..strips * MR * d_pad].iter_mut().for_each(|x| *x = 0.0);
    scr.rows[..strips * MR].iter_mut().for_each(|r| *r = RowState::EMPTY);

    // Keys any row of the block can see, and those every row sees (no masking needed).
    let ranges: Vec<(usize, usize)> = (i0..i1).map(|i| p.key_range(i)).collect();
    let lo_all = ranges.iter().map(|r| r.0).min().unwrap_or(0);
    let hi_all = ranges.iter().map(|r| r.1).max().unwrap_or(0);
    let inner_lo = ranges.iter().map(|r| r.0).max().unwrap_or(0);
    let inner_hi = ranges.iter().map(|r| r.1).min().unwrap_or(0);
    let needs_bias = p.alibi.is_some() || sm.softcap_log2.is_some();

    let mut j0 = lo_all / NR * NR;
    while j0 < hi_all {
        let j1 = (j0 + BC).min(round_up(hi_all, NR)).min(sk_pad);
        let cols = j1 - j0;
        // S = Q·Kᵀ for the tile, row-major [strips*MR][cols].
        for st in 0..strips {
            let a = &scr.q_packed[st * MR * d..(st + 1) * MR * d];
            for pn in 0..cols / NR {
                let panel = j0 / NR + pn;
                let bk = &kv.k[panel * d * NR..(panel + 1) * d * NR];
                let mut acc: Acc = [[0.0; NR]; MR];
                micro_kernel::<FMA>(a, bk, &mut acc);
                for (r, accr) in acc.iter().enumerate() {
                    scr.s[(st * MR + r) * BC + pn * NR..][..NR].copy_from_slice(accr);
                }
            }
        }
        let full_tile = j0 >= inner_lo && j1 <= inner_hi;
        for r in 0..strips * MR {
            let row = &mut scr.s[r * BC..r * BC + cols];
            if r >= nrows {
                row.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
            } else {
                if needs_bias {
                    for (c, x) in row.iter_mut().enumerate() {
                        if let Some(cl) = sm.softcap_log2 {
                            *x = cl * x.tanh();
                        }
                        *x += p.alibi_bias(h, i0 + r, j0 + c) * LOG2E;
                    }
                }
                if !full_tile {
                    let (lo, hi) = ranges[r];
                    for (c, x) in row.iter_mut().enumerate() {
                        let j = j0 + c;
                        if j < lo || j >= hi {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            let st = &mut scr.rows[r];
            let scale = max_get_scale(st, softmax::row_max(row), math);
            online_softmax(st, scale, row, math);
            rescale_o(&mut scr.o[r * d_pad..(r + 1) * d_pad], scale);
        }
        // O += P·V.
        for st in 0..strips {
            pack_a(&scr.s[st * MR * BC..], BC, cols, &mut scr.p_packed);
            let a = &scr.p_packed[..cols * MR];
            for cp in 0..d_pad / NR {
                let bv = &kv.v[cp * sk_pad * NR + j0 * NR..cp * sk_pad * NR + j1 * NR];
                let mut acc: Acc = [[0.0; NR]; MR];
                for (r, accr) in acc.iter_mut().enumerate() {
                    accr.copy_from_slice(&scr.o[(st * MR + r) * d_pad + cp * NR..][..NR]);
                }
                micro_kernel::<FMA>(a, bv, &mut acc);
                for (r, accr) in acc.iter().enumerate() {
                    scr.o[(st * MR + r) * d_pad + cp * NR..][..NR].copy_from_slice(accr);
                }
            }
        }
        j0 = j1;
    }

    for r in 0..nrows {
        let orow = &mut scr.o[r * d_pad..(r + 1) * d_pad];
        lse_out[r] = finalize(&scr.rows[r], orow, math);
        o_out[r * d..(r + 1) * d].copy_from_slice(&orow[..d]);
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

/// Number of worker threads for `opts`.
pub(crate) fn threads(requested: Option<usize>) -> usize {
    requested
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The CPU forward pass on validated inputs, with the given exp2/rounding arithmetic.
pub(crate) fn forward_with<M: Exp2Math>(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    math: M,
    nthreads: usize,
) -> Result<CpuOutput> {
    if p.head_dim > MAX_HEAD_DIM {
        return Err(Error::UnsupportedHeadDim {
            head_dim: p.head_dim,
            backend: "the CPU backend".into(),
            supported: format!("1..={MAX_HEAD_DIM}"),
        });
    }
    let d = p.head_dim;
    let sm = match p.softcap {
        None => ScoreMod { q_mul: p.scale * LOG2E, softcap_log2: None },
        Some(cap) => ScoreMod { q_mul: p.scale / cap, softcap_log2: Some(cap * LOG2E) },
    };
    let n_o = crate::tensor::numel([p.batch, p.heads_q, p.seqlen_q, d], "output")?;
    // Internal layout [batch, heads_q, seqlen_q, d] so each work item owns a contiguous slice.
    let mut o_hm = vec![0.0f32; n_o];
    let mut lse = vec![f32::NEG_INFINITY; p.batch * p.heads_q * p.seqlen_q];

    let kv_bytes = 4 * (round_up(p.seqlen_k, NR) * (d + round_up(d, NR)));
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
            std::thread::scope(|s| {
                for _ in 0..nthreads.min(heads.len()) {
                    s.spawn(|| loop {
                        let job = next.lock().unwrap_or_else(|e| e.into_inner()).pop();
                        let Some((idx, &(b, hk))) = job else { break };
                        let pk = pack_kv(p, k, v, b, hk);
                        out.lock().unwrap_or_else(|e| e.into_inner()).push((idx, pk));
                    });
                }
            });
            let mut v = out.into_inner().unwrap_or_else(|e| e.into_inner());
            v.sort_by_key(|x| x.0);
            v.into_iter().map(|(i, pk)| (heads[i].1, pk)).collect()
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
        std::thread::scope(|s| {
            for _ in 1..n {
                s.spawn(|| run_worker(p, q, &packed, sm, &math, &queue));
            }
            run_worker(p, q, &packed, sm, &math, &queue);
        });
    }

    // [b, h, s, d] f32 -> [b, s, h, d] in q's dtype.
    let mut o = Tensor::zeros(p.dtype, [p.batch, p.seqlen_q, p.heads_q, d])?;
    let out = o.data_mut();
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            for i in 0..p.seqlen_q {
                let src = &o_hm[((b * p.heads_q + h) * p.seqlen_q + i) * d..][..d];
                out.write_f32(((b * p.seqlen_q + i) * p.heads_q + h) * d, src);
            }
        }
    }
    Ok(CpuOutput { o, lse, kernel: path_name() })
}

/// The CPU forward pass with the problem's arithmetic. Returns the output and the name of the
/// path that ran.
///
/// `Native` runs when precision is Native, exp2 Accurate and rescale Always; any other option
/// runs the emulation of a kernel's arithmetic (`numerics::emulate`), and FP8 first rotates
/// (optionally) and fake-quantises Q, K, V (`numerics::quant::fake_quantize`).
pub(crate) fn run(p: &Problem, q: &TensorView, k: &TensorView, v: &TensorView, nthreads: usize) -> Result<CpuOutput> {
    let math = EmulatedMath::for_problem(p);
    if math.is_native() {
        return forward_with(p, q, k, v, Native, nthreads);
    }
    let Precision::Fp8 { scaling, hadamard } = p.precision else {
        let mut out = forward_with(p, q, k, v, math, nthreads)?;
        out.kernel = "cpu-tiled-emulated-exp2";
        return Ok(out);
    };
    let rot = hadamard.and_then(|seed| Rotation::new(p.head_dim, seed));
    let q8 = fake_quantize(q, scaling, rot.as_ref())?;
    let k8 = fake_quantize(k, scaling, rot.as_ref())?;
    let v8 = fake_quantize(v, scaling, None)?;
    let mut out = forward_with(p, &q8.view(), &k8.view(), &v8.view(), math, nthreads)?;
    out.kernel = "cpu-tiled-emulated-fp8";
    Ok(out)
}

/// Name of the micro-kernel path this CPU takes.
pub(crate) fn path_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        return "cpu-tiled-avx2-fma";
    }
    "cpu-tiled-portable"
}

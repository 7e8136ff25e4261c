//! The CPU backend: FlashAttention's algorithm on the host.
//!
//! Per (batch, kv head), K and V are packed once (f32, strips of 6 keys / 6 columns); every
//! query head of the GQA group and every block of `BR` query rows then streams over the key
//! tiles of `BC` keys: `Sᵀ = K·Qᵀ` (6×16 register micro-kernel), the online softmax of each
//! query (exp2 of `(x − m)·scale·log2e`, −inf guard; `softmax` explains the units),
//! `Oᵀ = Oᵀ·diag(scale) + Vᵀ·Pᵀ`, and one normalisation at the end. Work items (kv head, group
//! head, query block) are handed out heaviest first to the persistent worker pool (`parallel`);
//! each owns its own output rows (disjoint `&mut` row slices of the caller's buffer) and writes
//! them once, in the final layout and type.

pub(crate) mod backward;
pub(crate) mod convert;
mod gemm;
pub(crate) mod inplace;
mod parallel;
mod pool;
mod simd;
pub mod softmax;

use crate::error::{Error, Result};
use crate::numerics::softmax_math::SoftmaxMath;
use crate::numerics::exp2::{poly_frac, EXP2_CLAMP_LOW};
use crate::numerics::hadamard::Rotation;
use crate::numerics::quant::fake_quantize;
use crate::options::Precision;
use crate::problem::Problem;
use crate::tensor::{try_filled, Data, DataMut, Element, Tensor, TensorView};
use std::ops::Range;
use gemm::{micro_kernel, micro_kernel_skip_zero_b, Acc, MR, NR};
use simd::KTile;
use softmax::{finalize_panel, online_softmax, rescale_o, Exp2Math, RowState};

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
    const NATIVE: bool = true;
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
struct PackedKv<'a> {
    /// `[seqlen_k_pad / MR][head_dim][MR]`: strips of 6 keys, zero-padded; empty when `k_rows`
    /// holds K instead.
    k: Vec<f32>,
    /// An f32 K read in place (the AVX-512 path): the input's elements, the offset of key 0's
    /// row of this head, and the key stride.
    k_rows: Option<(&'a [f32], usize, usize)>,
    /// `[head_dim_pad / MR][seqlen_k_pad][MR]`: strips of 6 columns of V (i.e. rows of Vᵀ).
    v: Vec<f32>,
    /// Every element of V is finite. Otherwise `Oᵀ += Vᵀ·Pᵀ` skips the zeros of P, so a key's
    /// infinite or NaN V reaches only the queries that see it (`0 · inf` is NaN).
    v_finite: bool,
}

/// Strips of K/V rows `pack_heads` prefetches ahead of the one it packs when it packs some of
/// the kv heads only: then each key's rows are a run of a few head_dim elements out of a row of
/// all heads, a separate run of cache misses the hardware prefetchers do not follow; asked for
/// this far ahead they arrive while the strips before them are scattered. Whole rows of all kv
/// heads are one sequential stream that the hardware prefetches, so there software prefetches
/// only cost. One head of head-major storage (see [`heads_side_by_side`]) is one sequential run
/// per K and V, yet the prefetch measured faster there too, so it stays on for every item of
/// fewer than all kv heads.
const PACK_PREFETCH_STRIPS: usize = 4;

/// Most query blocks (over all query heads of a kv head) for which an f32 K is read in place by
/// the first product (`simd::KTile::Rows`, AVX-512 path) instead of packed: the packing pass
/// (K's rows read at the streaming rate, nothing overlapping it) is then saved, but every block
/// reads six rows per strip where the packed strip is one run, which costs more once K is read
/// by several blocks: in place measured faster up to 3 blocks, even at 4, and slower from 6 on
/// (`[batch, seqlen, heads, head_dim]` inputs).
const K_IN_PLACE_READS: usize = 3;

/// Bytes of packed K/V one head-major work item holds at most (several kv heads packed in one
/// pass over the keys; see `tiled`): about a core's L2, so that each head's packed data is
/// still in a cache when its blocks run (the eight kv heads of 512×64 hold 2.1 MB). Longer
/// sequences pack one head per item (one head of 2048×128 holds 2.1 MB), their rows strided but
/// prefetched.
const PACK_ITEM_BYTES: usize = 4 << 20;

/// Whether K and V hold each key's rows of all heads side by side (the head stride at most the
/// sequence stride: `[batch, seqlen, heads, head_dim]`, FlashAttention's layout), rather than
/// each head's keys as one run (`[batch, heads, seqlen, head_dim]` passed as strided views: the
/// layout of torch's SDPA, candle's attention and onnxruntime's Attention). The one rule both
/// CPU paths read K/V by: side by side, one pass over the keys reads every head's rows as a
/// single sequential stream, so the tiled path packs all kv heads of a batch per item and the
/// decode sweep takes every head block by block; head-major, such a pass is two streams per head
/// (2 × heads interleaved runs), so both go head by head, each head's K and V then two
/// sequential runs (`tiled`'s item choice, `inplace::forward_isa`'s units). One head, or one
/// key: nothing to choose (true).
pub(crate) fn heads_side_by_side(k: &TensorView, v: &TensorView) -> bool {
    [k, v].iter().all(|t| t.heads() <= 1 || t.seqlen() <= 1 || t.strides()[2] <= t.strides()[1])
}

/// Row `(b, s, h)` of `t` as f32: the input's own elements where it holds f32 (no copy), else
/// widened into `buf` (length head_dim).
#[inline(always)]
fn row_f32<'r, 'a: 'r>(t: &TensorView<'a>, (b, s, h): (usize, usize, usize), buf: &'r mut [f32]) -> &'r [f32] {
    match t.data() {
        Data::F32(x) => {
            let at = t.offset(b, s, h);
            &x[at..at + buf.len()]
        }
        _ => {
            t.read_row(b, s, h, buf);
            buf
        }
    }
}

/// Rows `s0..s0 + rows` of heads `heads` of `t`, asked for ahead of use (into L2 if `l2`, else L1).
#[inline(always)]
fn prefetch_rows(t: &TensorView, (b, s0, heads): (usize, usize, Range<usize>), rows: usize, l2: bool) {
    for s in s0..(s0 + rows).min(t.seqlen()) {
        for h in heads.clone() {
            let (data, at, d) = (t.data(), t.offset(b, s, h), t.head_dim());
            if l2 {
                inplace::prefetch_row_with(data, at, d, simd::prefetch_l2);
            } else {
                inplace::prefetch_row_with(data, at, d, simd::prefetch);
            }
        }
    }
}

/// A row of zeros: the keys past seqlen_k of the last K strip.
static ZEROS: [f32; MAX_HEAD_DIM] = [0.0; MAX_HEAD_DIM];

/// One head's packed K and V buffers (reused ones keep old contents), their padding zeroed:
/// keys past seqlen_k, and columns past head_dim of the last column strip of V. The scatter of
/// `pack_heads` writes every other element.
fn packed_buffers(p: &Problem, sz: &Sizes, pack_k: bool) -> Result<(Vec<f32>, Vec<f32>)> {
    let d = p.head_dim;
    let sk_pad = sz.sk_pad;
    let mut kp = if pack_k { pool::take_dirty(sz.k_pack, "packed K of one head")? } else { Vec::new() };
    let mut vp = pool::take_dirty(sz.v_pack, "packed V of one head")?;
    if pack_k {
        kp[p.seqlen_k / MR * d * MR..].fill(0.0); // the last, partial strip (rewritten by the scatter)
    }
    let dv = sz.v_pack / sk_pad;
    for strip in vp.chunks_exact_mut(sk_pad * MR) {
        strip[p.seqlen_k * MR..].fill(0.0);
    }
    if dv > d {
        // Columns d..dv of the last column strip, for every key.
        let last = &mut vp[(dv / MR - 1) * sk_pad * MR..];
        for key in last.chunks_exact_mut(MR) {
            key[d % MR..].fill(0.0);
        }
    }
    Ok((kp, vp))
}

/// Packs K and V of kv heads `heads` of batch `b` in one pass over the keys, in address order:
/// in the `[batch, seqlen, heads, head_dim]` layout the rows of one key's heads lie side by side,
/// so each key is one contiguous run (a whole row when `heads` is every kv head), which the
/// hardware prefetchers stream, where a pass per head reads head_dim elements out of every row
/// of all heads, each a separate miss. `buf`: `MR × head_dim` f32 of scratch (the widened rows
/// of an f16/bf16 input).
fn pack_heads<'a>(
    p: &Problem,
    sz: &Sizes,
    (k, v): (&TensorView<'a>, &TensorView),
    b: usize,
    heads: Range<usize>,
    buf: &mut [f32],
    k_in_place: bool,
) -> Result<Vec<PackedKv<'a>>> {
    let d = p.head_dim;
    let sk_pad = sz.sk_pad;
    // K read in place by the first product (see `KTile::Rows`): an f32 input, when asked for.
    let k_rows = match k.data() {
        Data::F32(x) if k_in_place => Some(x),
        _ => None,
    };
    let mut bufs: Vec<(Vec<f32>, Vec<f32>)> = Vec::with_capacity(heads.len());
    for _ in heads.clone() {
        bufs.push(packed_buffers(p, sz, k_rows.is_none())?);
    }
    // Per head: every V value packed by `simd::pack_v_strip` is finite (`None`: the scalar
    // copy ran, the packed V is checked afterwards).
    let mut finite: Vec<Option<bool>> = vec![Some(true); heads.len()];
    let buf = &mut buf[..MR * d];
    let fetch_strip = |strip: usize| {
        prefetch_rows(k, (b, strip * MR, heads.clone()), MR, false);
        prefetch_rows(v, (b, strip * MR, heads.clone()), MR, false);
    };
    let nstrips = p.seqlen_k.div_ceil(MR);
    let dist = if heads.len() < p.heads_kv { PACK_PREFETCH_STRIPS } else { 0 };
    (0..dist.min(nstrips)).for_each(fetch_strip);
    for strip in 0..nstrips {
        if dist > 0 && strip + dist < nstrips {
            fetch_strip(strip + dist);
        }
        let n = MR.min(p.seqlen_k - strip * MR);
        for (h, (kp, _)) in heads.clone().zip(bufs.iter_mut()).filter(|_| k_rows.is_none()) {
            // The strip's six rows (zeros past seqlen_k), interleaved column by column: each
            // column's six values are written contiguously.
            let mut rows: [&[f32]; MR] = [&ZEROS[..d]; MR];
            for (lane, (row, lane_buf)) in rows.iter_mut().zip(buf.chunks_exact_mut(d)).take(n).enumerate() {
                *row = row_f32(k, (b, strip * MR + lane, h), lane_buf);
            }
            let kdst = &mut kp[strip * d * MR..(strip + 1) * d * MR];
            if simd::pack_strip(&rows, d, kdst) {
                continue;
            }
            for (x, col) in kdst.chunks_exact_mut(MR).enumerate() {
                for (dst, row) in col.iter_mut().zip(rows) {
                    *dst = row[x];
                }
            }
        }
        for ((h, (_, vp)), fin) in heads.clone().zip(bufs.iter_mut()).zip(finite.iter_mut()) {
            let mut rows: [&[f32]; MR] = [&ZEROS[..d]; MR];
            for (lane, (row, lane_buf)) in rows.iter_mut().zip(buf.chunks_exact_mut(d)).take(n).enumerate() {
                *row = row_f32(v, (b, strip * MR + lane, h), lane_buf);
            }
            // Per column strip, the strip's six keys are 36 consecutive f32: six columns of
            // each key (fixed-size copies; the last column strip holds d % 6 columns).
            if let Some(f) = simd::pack_v_strip(&rows, d, &mut vp[strip * MR * MR..], sk_pad * MR) {
                *fin = fin.map(|x| x && f);
                continue;
            }
            *fin = None;
            for (c, col_strip) in vp.chunks_exact_mut(sk_pad * MR).enumerate() {
                let dst = &mut col_strip[strip * MR * MR..(strip + 1) * MR * MR];
                for (key, row) in dst.chunks_exact_mut(MR).zip(rows) {
                    match row.get(c * MR..(c + 1) * MR) {
                        Some(six) => key.copy_from_slice(six),
                        // Not a slice copy: one of run-time length is a call to memmove.
                        None => key.iter_mut().zip(&row[c * MR..]).for_each(|(k, &x)| *k = x),
                    }
                }
            }
        }
    }
    let packed = bufs.into_iter().zip(finite).zip(heads);
    Ok(packed
        .map(|(((kp, vp), f), h)| PackedKv {
            v_finite: f.unwrap_or_else(|| all_finite(&vp)),
            k: kp,
            k_rows: k_rows.map(|x| (x, k.offset(b, 0, h), k.strides()[1])),
            v: vp,
        })
        .collect())
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
    /// LSEs `[batch, heads_q, seqlen_q]`.
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
        Ok(Sizes { sk_pad, k_pack, v_pack, n_lse })
    }
}

/// Per-thread scratch, sized once. Everything about queries is held transposed, in panels of
/// `NR` queries side by side, so the softmax and the rescale are vertical vector operations and
/// the probabilities are already in the B-operand layout of the second product.
struct Scratch {
    /// Qᵀ panels `[BR / NR][head_dim][NR]`.
    q: LineAligned,
    /// Sᵀ (then Pᵀ) panels `[BR / NR][BC][NR]`.
    s: LineAligned,
    /// Oᵀ panels `[BR / NR][head_dim_pad][NR]`.
    o: LineAligned,
    rows: Vec<RowState>,
    /// `NR × head_dim`: a panel's Q rows widened from f16/bf16.
    q_row: Vec<f32>,
}

/// A zeroed f32 buffer whose first element starts a 64-byte cache line. The panels' rows are
/// 16 f32 (64 bytes) from there, so every 512-bit load and store of Q, P and O in the products
/// and the softmax touches one line; from the allocator's usual 16-byte alignment three rows in
/// four would straddle two lines, and a split load takes two of the load ports' slots.
struct LineAligned {
    buf: Vec<f32>,
    off: usize,
    len: usize,
}

impl LineAligned {
    fn new(len: usize) -> Self {
        let buf = vec![0.0; len + 15];
        // `align_offset` may in principle answer "cannot" (usize::MAX): then unaligned, still correct.
        let off = buf.as_ptr().align_offset(64).min(15);
        LineAligned { buf, off, len }
    }
}

impl std::ops::Deref for LineAligned {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[self.off..self.off + self.len]
    }
}

impl std::ops::DerefMut for LineAligned {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

impl Scratch {
    fn new(d: usize) -> Self {
        Scratch {
            q: LineAligned::new(BR * d),
            s: LineAligned::new(BR * BC),
            o: LineAligned::new(BR * round_up(d, MR)),
            rows: vec![RowState::EMPTY; BR],
            q_row: vec![0.0; NR * d],
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

    /// A raw dot product in natural units: `scale · x`, then the softcap if any (ALiBi, which
    /// depends on the position, the caller adds). A division, as a straightforward
    /// implementation writes it: for a cap far above the scores, (s / cap) * cap gives s back
    /// to within an ulp, where s * (1 / cap) * cap accumulates three roundings.
    #[inline(always)]
    fn natural_score(&self, x: f32) -> f32 {
        let s = x * self.scale;
        match self.softcap {
            Some(cap) => cap * (s / cap).tanh(),
            None => s,
        }
    }
}

/// Where a panel's part of a tile lies: head, first query row and row count of the block, the
/// tile's first computed key, and whether every row of the block sees the whole tile.
struct PanelAt {
    h: usize,
    i0: usize,
    nrows: usize,
    k0: usize,
    full_tile: bool,
}

/// Panel `pn`'s scores `sp` (`[keys][NR]`, keys from `at.k0`) to probabilities: softcap and
/// ALiBi, the mask and the online softmax down each query column (`tile_max`: the scores'
/// `panel_max`, when the product took it). Returns the factors its output
/// panel must be rescaled by (`rescale_o`, fused into the second product's accumulator load).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn panel_softmax<M: Exp2Math, const FMA: bool, const WIDE: bool>(
    p: &Problem,
    sm: ScoreMod,
    math: &M,
    at: &PanelAt,
    (pn, tile_max): (usize, Option<&[f32; NR]>),
    ranges: &[(usize, usize)],
    sp: &mut [f32],
    states: &mut [RowState],
) -> [f32; NR] {
    // Softcap and ALiBi, in natural units (as a straightforward implementation computes them:
    // each step is finite wherever its f32 counterpart there is).
    if sm.natural {
        for (jl, row) in sp.chunks_exact_mut(NR).enumerate() {
            for (lane, x) in row.iter_mut().enumerate().take(at.nrows.saturating_sub(pn * NR)) {
                *x = sm.natural_score(*x) + p.alibi_bias(at.h, at.i0 + pn * NR + lane, at.k0 + jl);
            }
        }
    }
    // The mask, branch-free per lane (padded lanes see everything), on the keys that some lane
    // of the panel does not see: below the largest `lo`, and from the smallest `hi` on. Every
    // lane sees the keys in between (on a causal diagonal or at the padded end of the keys most
    // of the tile), so those rows are left alone.
    if !at.full_tile {
        let lo: [i64; NR] = std::array::from_fn(|l| ranges.get(pn * NR + l).map_or(0, |r| r.0 as i64));
        let hi: [i64; NR] = std::array::from_fn(|l| ranges.get(pn * NR + l).map_or(i64::MAX, |r| r.1 as i64));
        let keys = sp.len() / NR;
        let local = |j: i64| (j.max(at.k0 as i64) - at.k0 as i64).min(keys as i64) as usize;
        let below = local(lo.iter().copied().max().unwrap_or(0));
        let from = local(hi.iter().copied().min().unwrap_or(i64::MAX)).max(below);
        for jl in (0..below).chain(from..keys) {
            let (j, row) = ((at.k0 + jl) as i64, &mut sp[jl * NR..(jl + 1) * NR]);
            for q in 0..NR {
                row[q] = if j < lo[q] || j >= hi[q] { f32::NEG_INFINITY } else { row[q] };
            }
        }
    }
    // Online softmax down each query column.
    let states = &mut states[..NR];
    if WIDE && M::NATIVE {
        // The same arithmetic in AVX-512 instructions (`simd::native_softmax`).
        if let Some(scales) = simd::native_softmax(states, sp, sm.c, tile_max) {
            return scales;
        }
    }
    let tile_max = softmax::panel_max(sp);
    let scales = softmax::panel_scales(states, &tile_max, sm.c, math);
    online_softmax::<M, FMA>(states, &scales, sp, sm.c, math);
    scales
}

/// One work item: query rows `i0..i1` of head `h` against the packed K/V of its kv head.
/// Writes the `i1 - i0` normalised output rows to `o_out` and the LSEs to `lse_out`.
///
/// Transposed formulation: `Sᵀ = K·Qᵀ` (A = 6 keys, B = 16 queries), softmax down each query
/// column, `Oᵀ += Vᵀ·Pᵀ` (A = 6 columns of V, B = the Pᵀ panel as it lies): no per-tile packing.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `pn` indexes the panel's keys, Q and score slices alike
fn attend_block<M: Exp2Math, const FMA: bool, const PAIR: bool>(
    p: &Problem,
    q: &TensorView,
    kv: &PackedKv,
    (b, h, i0, i1): (usize, usize, usize, usize),
    sm: ScoreMod,
    math: &M,
    scr: &mut Scratch,
    o_out: BlockOut<'_, '_>,
    lse_out: &mut [f32],
) {
    let d = p.head_dim;
    let sk_pad = round_up(p.seqlen_k, MR);
    let nrows = i1 - i0;
    let panels = nrows.div_ceil(NR);

    fill_q_panels::<PAIR>(q, (b, h, i0, i1), d, &mut scr.q, &mut scr.q_row);
    if !PAIR {
        prefetch_next_q(q, (b, h, i1));
    }
    // The caller's output rows, asked for into L2 while the products run: written straight
    // from the panels at the end, their lines would otherwise each miss then (a store buffer
    // full of misses stalls the next panel's stores).
    if let BlockOut::Rows(rows) = &o_out {
        for row in rows.iter() {
            for line in row.chunks(16) {
                simd::prefetch_l2(line.as_ptr().cast());
            }
        }
    }
    // The LSEs likewise (their lines were filled at the start of the call, long evicted).
    for line in lse_out.chunks(16) {
        simd::prefetch_l2(line.as_ptr().cast());
    }
    // Each panel's Oᵀ is zeroed just before its first product (`fresh`: the panels not yet
    // zeroed), where it is about to be read, rather than all of them here, where the block's
    // 25 KB (head_dim 64) of zeros would push other lines out of L1 before the products read
    // them. A panel that sees no key at all is written as zeros whatever its Oᵀ holds.
    let mut fresh: u32 = (1 << panels) - 1;
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

    // On the AVX-512 path (`PAIR`) the next block's Q rows are asked for once this block's first
    // panel is done, because at the block's start that burst waits behind the output rows'
    // prefetches and the previous block's row stores; the AVX2 path is faster asking at the
    // start.
    let mut next_q = !PAIR;
    let mut j0 = lo_all / MR * MR;
    while j0 < hi_all {
        let j1 = (j0 + BC).min(round_up(hi_all, MR)).min(sk_pad);
        let cols = j1 - j0;
        let full_tile = j0 >= inner_lo && j1 <= inner_hi;
        // Every row sees every key of the tile short of seqlen_k: the mask sets only the last
        // strip's padding keys to −inf (every row's range ends at seqlen_k), so a max over the
        // keys before them is the softmax's.
        let pad_only = j0 >= inner_lo && j1.min(p.seqlen_k) <= inner_hi;
        // This panel's part of the tile: local keys c0..c1 (multiples of MR), if any.
        let part = |pn: usize| {
            let (plo, phi) = panel_keys[pn];
            let c0 = (plo.max(j0) - j0) / MR * MR;
            let c1 = (round_up(phi.max(j0), MR) - j0).min(cols);
            (c0 < c1).then_some((c0, c1))
        };
        let tile = TileAt { j0, pad_only, full_tile, h, i0, nrows };
        let mut pn = 0;
        while pn < panels {
            let Some(c) = part(pn) else {
                pn += 1;
                continue;
            };
            // Up to three panels that see the same keys of this tile go through the kernel
            // together: each strip of K or V is then read once for all of them. Four past
            // head_dim 192, where a head's K and V outgrow L2 and a pass fewer over each tile
            // pays (four measured slower at 128).
            let same = |t: usize| pn + t < panels && part(pn + t) == Some(c);
            let most = if d > 192 { 4 } else { 3 };
            let group = if PAIR { 1 + (1..most).take_while(|&t| same(t)).count() } else { 1 };
            let at = (pn, c, &mut fresh);
            match group {
                4 => panel_group::<M, FMA, PAIR, 4>(p, sm, math, kv, scr, &ranges, &tile, at),
                3 => panel_group::<M, FMA, PAIR, 3>(p, sm, math, kv, scr, &ranges, &tile, at),
                2 => panel_group::<M, FMA, PAIR, 2>(p, sm, math, kv, scr, &ranges, &tile, at),
                _ => panel_group::<M, FMA, PAIR, 1>(p, sm, math, kv, scr, &ranges, &tile, at),
            }
            if !next_q {
                prefetch_next_q(q, (b, h, i1));
                next_q = true;
            }
            pn += group;
        }
        j0 = j1;
    }
    if !next_q {
        prefetch_next_q(q, (b, h, i1));
    }

    write_rows::<M, PAIR>(&scr.o, &scr.rows[..nrows], d, sm.u, math, (o_out, lse_out));
}

/// Where a key tile lies in a block: its first key, whether every row of the block sees all of
/// it (`full_tile`) or all of it short of the last strip's padding keys (`pad_only`), and the
/// block's head, first query row and row count.
struct TileAt {
    j0: usize,
    pad_only: bool,
    full_tile: bool,
    h: usize,
    i0: usize,
    nrows: usize,
}

/// Panels `pn..pn + G` of a block over local keys `c0..c1` of one tile (the same part for all of
/// them): `Sᵀ = K·Qᵀ`, each panel's softmax, `Oᵀ = Oᵀ·diag(scale) + Vᵀ·Pᵀ`. With `WIDE` (the
/// AVX-512 build) the products run for the `G` panels at once (`simd::product_max`,
/// `simd::scaled_product`); otherwise one panel at a time. Every S and O element takes the same
/// FMAs in the same order either way.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn panel_group<M: Exp2Math, const FMA: bool, const WIDE: bool, const G: usize>(
    p: &Problem,
    sm: ScoreMod,
    math: &M,
    kv: &PackedKv,
    scr: &mut Scratch,
    ranges: &[(usize, usize)],
    tile: &TileAt,
    (pn, (c0, c1), fresh): (usize, (usize, usize), &mut u32),
) {
    let d = p.head_dim;
    let dv = round_up(d, MR);
    let sk_pad = round_up(p.seqlen_k, MR);
    let (k0, k1) = (tile.j0 + c0, tile.j0 + c1);
    let mut s_panels = scr.s.chunks_exact_mut(BC * NR).skip(pn);
    let mut sp: [&mut [f32]; G] = std::array::from_fn(|_| &mut s_panels.next().unwrap()[c0 * NR..c1 * NR]);
    let mut o_panels = scr.o.chunks_exact_mut(dv * NR).skip(pn);
    let mut op: [&mut [f32]; G] = std::array::from_fn(|_| o_panels.next().unwrap());
    let mut row_panels = scr.rows.chunks_exact_mut(NR).skip(pn);
    let states: [&mut [RowState]; G] = std::array::from_fn(|_| row_panels.next().unwrap());
    let qp: [&[f32]; G] = std::array::from_fn(|t| &scr.q[(pn + t) * d * NR..(pn + t + 1) * d * NR]);

    // Sᵀ = K·Qᵀ, six keys at a time (AVX-512: with the softmax's max pass fused in).
    let mut tile_max = [[f32::NEG_INFINITY; NR]; G];
    let keys = k1.min(p.seqlen_k).saturating_sub(k0);
    let k_tile = match kv.k_rows {
        Some((data, at, stride)) => KTile::Rows { data, at: at + k0 * stride, stride, keys, zeros: &ZEROS[..d] },
        None => KTile::Packed(&kv.k[k0 * d..k1 * d]),
    };
    let sp_now = sp.each_mut().map(|s| &mut **s);
    let fused = WIDE && simd::product_max::<G>(k_tile, qp, sp_now, (tile_max.each_mut(), keys));
    if !fused {
        let mut gathered = Vec::new();
        let k_tile = k_tile.packed((k1 - k0) / MR, d, &mut gathered);
        for (s, q) in sp.iter_mut().zip(qp) {
            for (ks, s6) in s.chunks_exact_mut(MR * NR).enumerate() {
                let mut acc: Acc = [[0.0; NR]; MR];
                micro_kernel::<FMA>(&k_tile[ks * d * MR..(ks + 1) * d * MR], q, &mut acc);
                s6.copy_from_slice(acc.as_flattened());
            }
        }
    }
    // The max taken in the product is the softmax's only while nothing changes the scores in
    // between (no softcap, ALiBi, or mask short of the padding keys).
    let fused = fused && tile.pad_only && !sm.natural;
    let panel = PanelAt { h: tile.h, i0: tile.i0, nrows: tile.nrows, k0, full_tile: tile.full_tile };
    let mut sc = [[1.0; NR]; G];
    for (t, st) in states.into_iter().enumerate() {
        let at = (pn + t, fused.then_some(&tile_max[t]));
        sc[t] = panel_softmax::<M, FMA, WIDE>(p, sm, math, &panel, at, ranges, sp[t], st);
    }

    // A panel's Oᵀ is zeroed just before its first product (`fresh`, see `attend_block`).
    for (t, o) in op.iter_mut().enumerate() {
        if *fresh >> (pn + t) & 1 == 1 {
            o.fill(0.0);
            *fresh &= !(1 << (pn + t));
        }
    }
    // Oᵀ = Oᵀ·diag(scale) + Vᵀ·Pᵀ, six columns of V at a time.
    let finite = kv.v_finite;
    let pp: [&[f32]; G] = sp.map(|s| &*s);
    let v_tile = (&kv.v[k0 * MR..], sk_pad * MR, d);
    let scs: [&[f32; NR]; G] = std::array::from_fn(|t| &sc[t]);
    let wide = WIDE
        && if finite {
            simd::scaled_product::<G, false>(v_tile, pp, op.each_mut().map(|o| &mut **o), scs)
        } else {
            simd::scaled_product::<G, true>(v_tile, pp, op.each_mut().map(|o| &mut **o), scs)
        };
    if !wide {
        for ((o, s), sc) in op.iter_mut().zip(pp).zip(&sc) {
            for (ds, o6) in o.chunks_exact_mut(MR * NR).enumerate() {
                let a = &kv.v[ds * sk_pad * MR + k0 * MR..ds * sk_pad * MR + k1 * MR];
                let mut acc: Acc = [[0.0; NR]; MR];
                rescale_o(o6, sc, &mut acc);
                if finite {
                    micro_kernel::<FMA>(a, s, &mut acc);
                } else {
                    micro_kernel_skip_zero_b::<FMA>(a, s, &mut acc);
                }
                o6.copy_from_slice(acc.as_flattened());
            }
        }
    }
}

/// Query rows per block `fill_q_panels` asks the cache for ahead: the next block of the head.
const Q_PREFETCH_ROWS: usize = BR;

/// The Qᵀ panels of query rows `i0..i1` of head `h`: `[panel][head_dim][NR]`, the lanes past
/// `i1` zero (their results are dropped). Rows are read straight from an f32 input (`row`:
/// `NR × head_dim` f32 for the widened rows of an f16/bf16 one).
#[inline(always)]
fn fill_q_panels<const WIDE: bool>(
    q: &TensorView,
    at: (usize, usize, usize, usize),
    d: usize,
    dst: &mut [f32],
    row: &mut [f32],
) {
    let (b, h, i0, i1) = at;
    let nrows = i1 - i0;
    for pn in 0..nrows.div_ceil(NR) {
        // The panel's sixteen rows (zeros past i1), interleaved column by column: each
        // column's sixteen values are written contiguously (not sixteen stores a line apart).
        let mut rows: [&[f32]; NR] = [&ZEROS[..d]; NR];
        let n = NR.min(nrows - pn * NR);
        for (lane, (r, buf)) in rows.iter_mut().zip(row.chunks_exact_mut(d)).take(n).enumerate() {
            *r = row_f32(q, (b, i0 + pn * NR + lane, h), buf);
        }
        let dst = &mut dst[pn * d * NR..(pn + 1) * d * NR];
        if WIDE && simd::fill_panel(&rows, d, dst) {
            continue;
        }
        for (x, col) in dst.chunks_exact_mut(NR).enumerate() {
            for (v, r) in col.iter_mut().zip(rows) {
                *v = r[x];
            }
        }
    }
}

/// The rows of the next block of head `h` after rows `..i1` (the next head's first, after a
/// head's last), asked for into L2: the next block this worker runs is usually that one, and
/// its strided rows would each miss the cache.
#[inline(always)]
fn prefetch_next_q(q: &TensorView, (b, h, i1): (usize, usize, usize)) {
    if i1 < q.seqlen() {
        prefetch_rows(q, (b, i1, h..h + 1), Q_PREFETCH_ROWS, true);
    } else if h + 1 < q.heads() {
        // The head is done: its next block is the next head's first (head-major items).
        prefetch_rows(q, (b, 0, h + 1..h + 2), Q_PREFETCH_ROWS, true);
    }
}

/// Where a block's normalised output rows go.
enum BlockOut<'a, 'o> {
    /// `rows × head_dim` contiguous f32, converted into the output type afterwards (`store_rows`).
    Staged(&'a mut [f32]),
    /// The caller's own f32 output rows (`rows_by_head`), written straight from the Oᵀ panels:
    /// one pass over the output instead of a block then a copy.
    Rows(&'a mut [&'o mut [f32]]),
}

/// A block's normalised output rows (`o_out`, `rows.len()` rows of `d`) out of its Oᵀ panels
/// (`o`: `[panel][head_dim_pad][NR]`), and its LSEs. `WIDE`: AVX-512 transposes 16×16 blocks
/// in registers (`simd::write_panel_rows`) where the scalar loop reads with a 16-float stride.
///
/// Every panel's normaliser and LSEs first, then every panel's rows: the rows' stores miss the
/// cache (the caller's output lines, at best in L2), and while they wait in the store buffer a
/// load of values just stored (the `log2` results, spilled around the libm calls) cannot be
/// forwarded and waits for the buffer to drain.
#[inline(always)]
fn write_rows<M: Exp2Math, const WIDE: bool>(
    o: &[f32],
    rows: &[RowState],
    d: usize,
    u: f32,
    math: &M,
    (mut o_out, lse_out): (BlockOut<'_, '_>, &mut [f32]),
) {
    let dv = round_up(d, MR);
    // A query that saw no key is written as exactly 0, whatever reached O (`finalize`).
    let mut inv = [[0.0f32; NR]; BR / NR];
    let mut live = [0u16; BR / NR];
    // A panel's output rows asked for into L1 while the panel before it is written (the block's
    // rows were asked for into L2 before its products): stores that hit L1 leave the store buffer
    // at once, where stores that wait for their lines there stall whatever stores follow. Only
    // where whole-vector stores write the rows (`WIDE`): the AVX2 path's scalar row loop is
    // slower with it.
    let fetch_panel = |o_out: &BlockOut<'_, '_>, pn: usize| {
        if let BlockOut::Rows(rs) = o_out {
            for row in rs.iter().skip(pn * NR).take(NR).filter(|r| !r.is_empty()) {
                inplace::prefetch_row_with(Data::F32(row), 0, row.len(), simd::prefetch);
            }
        }
    };
    if WIDE {
        fetch_panel(&o_out, 0);
    }
    for (pn, states) in rows.chunks(NR).enumerate() {
        let r0 = pn * NR;
        live[pn] = finalize_panel(states, u, math, &mut inv[pn], &mut lse_out[r0..r0 + states.len()]);
    }
    for (pn, states) in rows.chunks(NR).enumerate() {
        let r0 = pn * NR;
        let op = &o[pn * dv * NR..(pn + 1) * dv * NR];
        let (inv, live) = (&inv[pn], live[pn]);
        if WIDE {
            fetch_panel(&o_out, pn + 1);
        }
        match &mut o_out {
            BlockOut::Staged(buf) => {
                // The panel's rows of the block as row slices (no allocation).
                let mut chunks = buf[r0 * d..(r0 + states.len()) * d].chunks_exact_mut(d.max(1));
                let mut staged: [&mut [f32]; NR] = std::array::from_fn(|_| chunks.next().unwrap_or(&mut []));
                write_panel::<WIDE>(op, (inv, live), d, &mut staged[..states.len()]);
            }
            BlockOut::Rows(rs) => write_panel::<WIDE>(op, (inv, live), d, &mut rs[r0..r0 + states.len()]),
        }
    }
}

/// One Oᵀ panel's rows (`out`: up to `NR` rows of `d`), each multiplied by its `inv`, or 0
/// where its bit of `live` is clear.
#[inline(always)]
fn write_panel<const WIDE: bool>(op: &[f32], (inv, live): (&[f32; NR], u16), d: usize, out: &mut [&mut [f32]]) {
    if WIDE && simd::write_panel_rows(op, inv, live, d, out) {
        return;
    }
    for (lane, row) in out.iter_mut().enumerate() {
        if live >> lane & 1 == 0 {
            row.fill(0.0);
        } else {
            for (x, dst) in row.iter_mut().enumerate() {
                *dst = op[x * NR + lane] * inv[lane];
            }
        }
    }
}

/// The output element types: f32 rows are written straight from the Oᵀ panels
/// ([`BlockOut::Rows`]), f16/bf16 ones through a staged f32 block.
trait OutElem: Element {
    /// `rows` as f32 rows, where `Self` is f32.
    fn as_f32_rows<'a, 'o>(rows: &'a mut [&'o mut [Self]]) -> Option<&'a mut [&'o mut [f32]]>;
}

impl OutElem for f32 {
    fn as_f32_rows<'a, 'o>(rows: &'a mut [&'o mut [f32]]) -> Option<&'a mut [&'o mut [f32]]> {
        Some(rows)
    }
}

impl OutElem for half::f16 {
    fn as_f32_rows<'a, 'o>(_: &'a mut [&'o mut [Self]]) -> Option<&'a mut [&'o mut [f32]]> {
        None
    }
}

impl OutElem for half::bf16 {
    fn as_f32_rows<'a, 'o>(_: &'a mut [&'o mut [Self]]) -> Option<&'a mut [&'o mut [f32]]> {
        None
    }
}

/// A block's output: straight into the caller's rows `o` (f32), else staged in `blk` (the
/// worker's `BR × head_dim` f32) and converted.
#[allow(clippy::too_many_arguments)]
fn attend_into<M: Exp2Math, T: OutElem>(
    p: &Problem,
    q: &TensorView,
    kv: &PackedKv,
    at: (usize, usize, usize, usize),
    sm: ScoreMod,
    math: &M,
    scr: &mut Scratch,
    (o, blk, lse): (&mut [&mut [T]], &mut [f32], &mut [f32]),
    isa: Isa,
) {
    let d = p.head_dim;
    match T::as_f32_rows(o) {
        Some(rows) => attend_any(p, q, kv, at, sm, math, scr, (BlockOut::Rows(rows), lse), isa),
        None => {
            let blk = &mut blk[..o.len() * d];
            attend_any(p, q, kv, at, sm, math, scr, (BlockOut::Staged(&mut *blk), lse), isa);
            store_rows(blk, o, d);
        }
    }
}

/// Head-major work item: (b, kv heads), with the output rows and LSEs of all their query heads.
type HeadItem<'r, 'o, T> = ((usize, Range<usize>), &'r mut [&'o mut [T]], &'r mut [f32]);

/// Work item: (b, kv head, q head, row range), with its output rows and LSEs.
type Item<'r, 'o, T> = ((usize, usize, usize, usize, usize), &'r mut [&'o mut [T]], &'r mut [f32]);

/// A worker's scratch: the tiled path's panels, a block's normalised f32 output rows for an
/// f16/bf16 output (`BR × head_dim`, converted into the caller's rows as soon as the block is
/// done; f32 rows are written in place), and `MR × head_dim` f32 for widening a strip of
/// f16/bf16 K/V.
type Worker = (Scratch, Vec<f32>, Vec<f32>);

/// One work item, compiled for `isa` (AVX-512: the products on up to three or four panels at once)
/// when the CPU has it.
#[allow(clippy::too_many_arguments)]
fn attend_any<M: Exp2Math>(
    p: &Problem,
    q: &TensorView,
    kv: &PackedKv,
    at: (usize, usize, usize, usize),
    sm: ScoreMod,
    math: &M,
    scr: &mut Scratch,
    out: (BlockOut<'_, '_>, &mut [f32]),
    isa: Isa,
) {
    // The detection is repeated (a cached atomic load) so that the safety of each call below
    // rests on a check right here, whatever `isa` was asked for.
    let has = detect_isa();
    // `attend_block` compiled with `$features` enabled (`$simd`, `$wide`: its const parameters).
    #[cfg(target_arch = "x86_64")]
    macro_rules! compiled_for {
        ($features:literal, $simd:literal, $wide:literal) => {{
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            fn run<M: Exp2Math>(
                p: &Problem,
                q: &TensorView,
                kv: &PackedKv,
                at: (usize, usize, usize, usize),
                sm: ScoreMod,
                math: &M,
                scr: &mut Scratch,
                (o, lse): (BlockOut<'_, '_>, &mut [f32]),
            ) {
                attend_block::<M, $simd, $wide>(p, q, kv, at, sm, math, scr, o, lse)
            }
            run::<M>
        }};
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && has == Isa::Avx512 {
        let avx512 = compiled_for!("avx512f,avx2,fma", true, true);
        // SAFETY: `detect_isa()` found AVX-512F, AVX2 and FMA on this CPU, the only requirement of a
        // `#[target_feature]` function; the function itself is safe code.
        unsafe { avx512(p, q, kv, at, sm, math, scr, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable && has != Isa::Portable {
        let avx2 = compiled_for!("avx2,fma", true, false);
        // SAFETY: the CPU was just checked to support AVX2 and FMA, the only requirement of a
        // `#[target_feature]` function; the function itself is safe code.
        unsafe { avx2(p, q, kv, at, sm, math, scr, out) };
        return;
    }
    attend_block::<M, false, false>(p, q, kv, at, sm, math, scr, out.0, out.1)
}

/// The instruction sets the tiled path is compiled for, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512F (+ AVX2, FMA): the same loops in 512-bit registers (a 16-query panel row is one).
    Avx512,
    Avx2Fma,
    Portable,
}

/// The best [`Isa`] this CPU has (detected at run time), unless `FLASH_ATTN_CPU_ISA` asks for a
/// lesser one (`avx2`, `portable`: to compare paths on one machine; never a better one than the
/// CPU has).
pub(crate) fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let detected = detect_isa();
        let cap = match std::env::var("FLASH_ATTN_CPU_ISA").as_deref() {
            Ok("portable") => Isa::Portable,
            Ok("avx2") => Isa::Avx2Fma,
            _ => Isa::Avx512,
        };
        // Variants are ordered best first: the larger of the two is the lesser ISA.
        if (cap as u8) > (detected as u8) {
            cap
        } else {
            detected
        }
    })
}

fn detect_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
        if avx2 && std::is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
        if avx2 {
            return Isa::Avx2Fma;
        }
    }
    Isa::Portable
}

/// Number of worker threads: the request, capped at the machine's available parallelism (more
/// threads than cores only add scheduling and memory on this compute-bound work); `None` or 0
/// uses the available parallelism. That is read once per process, because
/// `available_parallelism` reads the cgroup's CPU quota from /sys on every call, which costs
/// more than a small decode call itself, and the worker pool's size is fixed when it starts
/// anyway.
pub(crate) fn threads(requested: Option<usize>) -> usize {
    static HW: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let hw = *HW.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    requested.filter(|&n| n > 0).map_or(hw, |n| n.min(hw))
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
    let lse = forward_with_into(p, q, k, v, math, nthreads, o.data_mut().as_data_mut(), isa())?;
    Ok(CpuOutput { o, lse, kernel: path_name() })
}

/// As [`forward_with`], writing the output into `dst` (contiguous `[batch, seqlen_q, heads_q,
/// head_dim]` of the problem's dtype, checked by the caller); returns the LSE.
#[allow(clippy::too_many_arguments)]
fn forward_with_into<M: Exp2Math>(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    math: M,
    nthreads: usize,
    dst: DataMut<'_>,
    isa: Isa,
) -> Result<Vec<f32>> {
    match dst {
        DataMut::F32(o) => tiled(p, (q, k, v), math, nthreads, o, isa),
        DataMut::F16(o) => tiled(p, (q, k, v), math, nthreads, o, isa),
        DataMut::BF16(o) => tiled(p, (q, k, v), math, nthreads, o, isa),
    }
}

/// The rows of `dst` (`[batch, seqlen_q, heads_q, head_dim]`, one `&mut` slice of head_dim
/// elements per (batch, query, head)) in the order `[batch, heads_q, seqlen_q]`, so that the
/// work items can own consecutive runs of them: each item writes its output once, in the final
/// layout and type, where an item's part of the output is not contiguous. Allocated fallibly.
fn rows_by_head<'o, T>(p: &Problem, dst: &'o mut [T]) -> Result<Vec<&'o mut [T]>> {
    let (hq, sq, d) = (p.heads_q, p.seqlen_q, p.head_dim);
    let n = p.batch * sq * hq; // dst holds n * d elements (checked by the caller)
    let mut rows = Vec::new();
    if n == 0 {
        return Ok(rows);
    }
    let too_large = || Error::TooLarge { what: format!("the CPU backend's {n} output row references") };
    rows.try_reserve_exact(n).map_err(|_| too_large())?;
    // One pass over the rows in their memory order: per batch, one iterator over each query's
    // heads, and head by head the next row of every query (no table of every row first).
    let mut queries: Vec<std::slice::ChunksExactMut<'o, T>> = Vec::new();
    queries.try_reserve_exact(sq).map_err(|_| too_large())?;
    for batch in dst.chunks_exact_mut(sq * hq * d) {
        queries.clear();
        queries.extend(batch.chunks_exact_mut(hq * d).map(|q| q.chunks_exact_mut(d)));
        for _ in 0..hq {
            rows.extend(queries.iter_mut().filter_map(|q| q.next()));
        }
    }
    Ok(rows)
}

/// A block's normalised f32 rows (`src`, `dst.len() × d`) into its output rows, converted to
/// the output type (a whole row at a time: `convert`).
fn store_rows<T: Element>(src: &[f32], dst: &mut [&mut [T]], d: usize) {
    for (row, from) in dst.iter_mut().zip(src.chunks_exact(d)) {
        convert::narrow_row(from, T::wrap_mut(row));
    }
}

/// [`forward_with_into`] for the output element type `T`.
fn tiled<M: Exp2Math, T: OutElem>(
    p: &Problem,
    (q, k, v): (&TensorView, &TensorView, &TensorView),
    math: M,
    nthreads: usize,
    dst: &mut [T],
    isa: Isa,
) -> Result<Vec<f32>> {
    check_head_dim(p)?;
    let d = p.head_dim;
    let sm = ScoreMod::new(p);
    // Every size first: a problem too large for this machine fails here, before any work.
    let sz = Sizes::new(p)?;
    let mut rows = rows_by_head(p, dst)?;
    let mut lse = try_filled(sz.n_lse, f32::NEG_INFINITY, || "LSE".into())?;
    let worker = || -> Worker { (Scratch::new(d), vec![0.0; BR * d], vec![0.0; MR * d]) };

    let kv_bytes = 4 * (sz.k_pack + sz.v_pack);
    let chunk = (PACK_BUDGET_BYTES / kv_bytes.max(1)).clamp(1, p.batch * p.heads_kv);
    let nblocks = p.seqlen_q.div_ceil(BR);
    let per_kv = p.group() * nblocks; // work items per kv head
    let (mut o_rest, mut lse_rest) = (&mut rows[..], &mut lse[..]);

    let kv_heads: Vec<(usize, usize)> =
        (0..p.batch).flat_map(|b| (0..p.heads_kv).map(move |hk| (b, hk))).collect();
    // Enough kv heads to share out whole: one work item per (batch, run of kv heads) packs
    // those heads' K/V in one pass over the keys (into the buffers the worker's previous item
    // gave back) and runs all their query blocks, while the packed data is still in this
    // core's cache. Otherwise (few kv heads: long sequences, or many threads) all heads are
    // packed first and the items are (kv head, query head, query block), so that every worker
    // has work.
    let head_major = kv_heads.len() >= 2 * nthreads;
    // kv heads per item: whole rows of K/V (all kv heads of a batch) where that leaves eight
    // items per worker (whole rows are packed in one sweep of contiguous memory, which measured
    // cheaper than more, smaller items; one thread: one item per batch), else sixteen items per
    // worker (a worker slowed by the host then delays the end by a sixteenth of its share at
    // most, which measured faster than fewer, larger items), and at most PACK_ITEM_BYTES of
    // packed K/V. Head-major storage (`heads_side_by_side` false): one head per item, each
    // head's K and V two sequential runs, because several heads packed in one pass would read
    // 2 × heads interleaved runs.
    let side_by_side = heads_side_by_side(k, v);
    // The first product reads an f32 K in place on the AVX-512 path (`attend_any`'s condition
    // for it) when each kv head's K is read by few blocks (see `K_IN_PLACE_READS`).
    let k_in_place = isa == Isa::Avx512
        && detect_isa() == Isa::Avx512
        && p.group() * nblocks <= K_IN_PLACE_READS;
    let whole_rows = side_by_side && (nthreads == 1 || p.batch >= 8 * nthreads);
    let groups = if whole_rows {
        1
    } else if side_by_side {
        (16 * nthreads).div_ceil(p.batch)
    } else {
        p.heads_kv
    }
    .clamp(1, p.heads_kv);
    let per_item = p.heads_kv.div_ceil(groups).min((PACK_ITEM_BYTES / kv_bytes.max(1)).max(1));
    let per_item = p.heads_kv.div_ceil(p.heads_kv.div_ceil(per_item)); // runs of equal length
    let failed: std::sync::Mutex<Option<Error>> = std::sync::Mutex::new(None);
    let rows_per_kv = p.group() * p.seqlen_q;
    let mut head_items: Vec<HeadItem<'_, '_, T>> = Vec::new();
    if head_major {
        for b in 0..p.batch {
            for hk0 in (0..p.heads_kv).step_by(per_item) {
                let hk1 = (hk0 + per_item).min(p.heads_kv);
                let (o_item, o_tail) = std::mem::take(&mut o_rest).split_at_mut((hk1 - hk0) * rows_per_kv);
                let (l_item, l_tail) = std::mem::take(&mut lse_rest).split_at_mut((hk1 - hk0) * rows_per_kv);
                (o_rest, lse_rest) = (o_tail, l_tail);
                head_items.push(((b, hk0..hk1), o_item, l_item));
            }
        }
    }
    parallel::for_each(&mut head_items, nthreads, worker, |(scr, o_blk, buf), ((b, heads), o, l)| {
        let packed = match pack_heads(p, &sz, (k, v), *b, heads.clone(), buf, k_in_place) {
            Ok(kv) => kv,
            Err(e) => {
                failed.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                return;
            }
        };
        for (hi, kv) in packed.iter().enumerate() {
            for gi in 0..p.group() {
                let h = (heads.start + hi) * p.group() + gi;
                for blk in 0..nblocks {
                    let (i0, i1) = (blk * BR, ((blk + 1) * BR).min(p.seqlen_q));
                    let r0 = (hi * p.group() + gi) * p.seqlen_q + i0;
                    let out = (&mut o[r0..r0 + i1 - i0], &mut o_blk[..], &mut l[r0..r0 + i1 - i0]);
                    attend_into(p, q, kv, (*b, h, i0, i1), sm, &math, scr, out, isa);
                }
            }
        }
        for kv in packed {
            pool::give(kv.k);
            pool::give(kv.v);
        }
    });
    drop(head_items);
    if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    for heads in kv_heads.chunks(if head_major { usize::MAX } else { chunk }).filter(|_| !head_major) {
        // Pack this chunk's K/V in parallel.
        let packed: Vec<(usize, PackedKv)> = {
            let mut jobs: Vec<(usize, usize, Option<Result<PackedKv>>)> =
                heads.iter().map(|&(b, hk)| (b, hk, None)).collect();
            parallel::for_each(
                &mut jobs,
                nthreads,
                || vec![0.0; MR * d],
                |buf, j| {
                    let packed = pack_heads(p, &sz, (k, v), j.0, j.1..j.1 + 1, buf, k_in_place);
                    j.2 = packed.map(|h| h.into_iter().next()).transpose()
                },
            );
            let mut packed = Vec::with_capacity(jobs.len());
            for (_, hk, pk) in jobs {
                // Every job ran (for_each returns when all are done).
                let pk = pk.ok_or_else(|| Error::TooLarge { what: "packed K/V".into() })?;
                packed.push((hk, pk?));
            }
            packed
        };
        // Split this chunk's output into one run of rows per work item, in memory order.
        let mut items: Vec<(u64, Item<'_, '_, T>)> = Vec::with_capacity(heads.len() * per_kv);
        for (kvi, &(b, hk)) in heads.iter().enumerate() {
            for g in 0..p.group() {
                let h = hk * p.group() + g;
                for blk in 0..nblocks {
                    let (i0, i1) = (blk * BR, ((blk + 1) * BR).min(p.seqlen_q));
                    let (o_item, o_tail) = std::mem::take(&mut o_rest).split_at_mut(i1 - i0);
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
        // Heaviest first: causal blocks near the bottom go out early.
        items.sort_by_key(|x| std::cmp::Reverse(x.0));
        let mut items: Vec<Item<'_, '_, T>> = items.into_iter().map(|x| x.1).collect();
        parallel::for_each(&mut items, nthreads, worker, |(scr, o_blk, _), ((b, kvi, h, i0, i1), o_out, lse_out)| {
            let kv = &packed[*kvi].1;
            attend_into(p, q, kv, (*b, *h, *i0, *i1), sm, &math, scr, (o_out, o_blk, lse_out), isa);
        });
        for (_, pk) in packed {
            pool::give(pk.k);
            pool::give(pk.v);
        }
    }
    Ok(lse)
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
        return Ok((forward_with_into(p, q, k, v, Native, nthreads, dst, isa())?, path_name()));
    }
    let Precision::Fp8 { scaling, hadamard } = p.precision else {
        return Ok((forward_with_into(p, q, k, v, math, nthreads, dst, isa())?, "cpu-tiled-emulated-exp2"));
    };
    let rot = hadamard.and_then(|seed| Rotation::new(p.head_dim, seed));
    let q8 = fake_quantize(q, scaling, rot.as_ref())?;
    let k8 = fake_quantize(k, scaling, rot.as_ref())?;
    let v8 = fake_quantize(v, scaling, None)?;
    let lse = forward_with_into(p, &q8.view(), &k8.view(), &v8.view(), math, nthreads, dst, isa())?;
    Ok((lse, "cpu-tiled-emulated-fp8"))
}

/// Name of the micro-kernel path this CPU takes.
pub(crate) fn path_name() -> &'static str {
    match isa() {
        Isa::Avx512 => "cpu-tiled-avx512",
        Isa::Avx2Fma => "cpu-tiled-avx2-fma",
        Isa::Portable => "cpu-tiled-portable",
    }
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

    /// Every instruction set this CPU has (AVX-512 runs only where the CPU has it: on a CPU
    /// without it that case is the AVX2 path again, and the test says so on stderr) gives the
    /// float64 reference's output within 2e-6 and matches the other paths' to f32 rounding, on
    /// shapes that exercise paired and unpaired panels (partial blocks, causal diagonals,
    /// windows, GQA, softcap, an infinite V); also with the inputs stored head-major (strided
    /// views: one-head work items) at 1 and 2 threads.
    #[test]
    #[cfg(feature = "bench")] // the head-major copies are bench::support::HeadMajor
    fn every_isa_matches_the_reference() {
        use crate::options::{ForwardOptions, Mask};
        use crate::reference::{attention_f64, max_abs_diff};
        use crate::tensor::DType;
        if detect_isa() != Isa::Avx512 {
            eprintln!("this CPU has no AVX-512: the AVX-512 path is compiled but not run here");
        }
        let isas = [Isa::Avx512, Isa::Avx2Fma, Isa::Portable];
        let cases: [(usize, usize, usize, usize, usize, ForwardOptions); 6] = [
            (1, 200, 200, 2, 64, ForwardOptions::default()),
            (2, 97, 131, 2, 40, ForwardOptions::default().causal(true)),
            (1, 130, 130, 4, 128, ForwardOptions::default().mask(Mask::window(37, 5))),
            (1, 64, 300, 1, 24, ForwardOptions::default().softcap(7.0)),
            (1, 48, 48, 2, 72, ForwardOptions::default().causal(true)),
            (1, 33, 77, 2, 16, ForwardOptions::default().mask(Mask::window(9, 0))),
        ];
        for (ci, (b, sq, sk, hkv, d, opts)) in cases.into_iter().enumerate() {
            let hq = 2 * hkv;
            let val = |i: usize, m: usize| (((i * m) % 97) as f32 / 97.0 - 0.5) * 2.0;
            let q = Tensor::from_vec((0..b * sq * hq * d).map(|i| val(i, 31)).collect(), [b, sq, hq, d]).unwrap();
            let k = Tensor::from_vec((0..b * sk * hkv * d).map(|i| val(i, 17)).collect(), [b, sk, hkv, d]).unwrap();
            let mut vv: Vec<f32> = (0..b * sk * hkv * d).map(|i| val(i, 13)).collect();
            if ci == 1 {
                vv[(sk - 1) * hkv * d] = f32::INFINITY; // the last key: seen by the last query only
            }
            let v = Tensor::from_vec(vv, [b, sk, hkv, d]).unwrap();
            let p = Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
            let r = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
            let stored = [&q, &k, &v].map(crate::bench::support::HeadMajor::new);
            let hm = [&stored[0], &stored[1], &stored[2]].map(|t| t.view());
            assert!(!heads_side_by_side(&hm[1], &hm[2]) || hkv == 1);
            // (layout, threads): [B,S,H,D] at 2 threads; head-major at 1 and 2.
            let runs = [(q.view(), k.view(), v.view(), 2), (hm[0], hm[1], hm[2], 1), (hm[0], hm[1], hm[2], 2)];
            let mut outs = Vec::new();
            for (isa, (qx, kx, vx, nthreads)) in isas.into_iter().flat_map(|i| runs.iter().map(move |r| (i, r))) {
                let isa_run = (isa, kx.strides(), nthreads);
                let mut o = Tensor::zeros(DType::F32, [b, sq, hq, d]).unwrap();
                let out = o.data_mut().as_data_mut();
                let lse = forward_with_into(&p, qx, kx, vx, Native, *nthreads, out, isa).unwrap();
                let o: Vec<f64> = o.to_f32_vec().iter().map(|&x| x as f64).collect();
                let finite = |x: &[f64]| x.iter().map(|&y| if y.is_finite() { y } else { 0.0 }).collect::<Vec<_>>();
                let same_inf = o.iter().zip(&r.o).all(|(a, b)| a.is_finite() == b.is_finite());
                assert!(same_inf, "case {ci} {isa_run:?}: non-finite outputs differ from the reference");
                let err = max_abs_diff(&finite(&o), &finite(&r.o));
                assert!(err < 2e-6, "case {ci} {isa_run:?}: max error {err}");
                let lse64: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
                let lerr = max_abs_diff(&finite(&lse64), &finite(&r.lse));
                assert!(lerr < 2e-5, "case {ci} {isa_run:?}: LSE error {lerr}");
                outs.push(finite(&o));
            }
            for w in outs.windows(2) {
                assert!(max_abs_diff(&w[0], &w[1]) < 1e-6, "case {ci}: paths disagree");
            }
        }
    }

    /// Packed K/V reuse buffers without zeroing them: a call whose inputs are all NaN and
    /// infinities leaves such values behind, and the next call (smaller, so its padding lies
    /// where the old data was) must not see them.
    #[test]
    fn reused_buffers_never_leak_into_results() {
        use crate::options::ForwardOptions;
        use crate::reference::{attention_f64, max_abs_diff};
        use crate::tensor::DType;
        let bad = |n: usize, x: f32| Tensor::from_vec(vec![x; n], [1, 60, 1, 22]).unwrap();
        let (q, k, v) = (bad(60 * 22, 1.0), bad(60 * 22, f32::INFINITY), bad(60 * 22, f32::NAN));
        let p = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default()).unwrap();
        for isa in [Isa::Avx512, Isa::Avx2Fma, Isa::Portable] {
            let (sq, sk, d) = (23, 49, 14);
            let mut o = Tensor::zeros(DType::F32, [1, 60, 1, 22]).unwrap();
            forward_with_into(&p, &q.view(), &k.view(), &v.view(), Native, 1, o.data_mut().as_data_mut(), isa).unwrap();
            let val = |i: usize, m: usize| (((i * m) % 89) as f32 / 89.0 - 0.5) * 3.0;
            let t = |n: usize, s: usize, m: usize| Tensor::from_vec((0..n * d).map(|i| val(i, m)).collect(), [1, s, 1, d]);
            let (q2, k2, v2) = (t(sq, sq, 7).unwrap(), t(sk, sk, 11).unwrap(), t(sk, sk, 5).unwrap());
            let p2 = Problem::new(&q2.view(), &k2.view(), &v2.view(), &ForwardOptions::default()).unwrap();
            let mut o2 = Tensor::zeros(DType::F32, [1, sq, 1, d]).unwrap();
            let (q2v, k2v, v2v) = (q2.view(), k2.view(), v2.view());
            forward_with_into(&p2, &q2v, &k2v, &v2v, Native, 1, o2.data_mut().as_data_mut(), isa).unwrap();
            let r = attention_f64(&p2, &q2v, &k2v, &v2v).unwrap();
            let o2: Vec<f64> = o2.to_f32_vec().iter().map(|&x| x as f64).collect();
            assert!(o2.iter().all(|x| x.is_finite()), "{isa:?}");
            assert!(max_abs_diff(&o2, &r.o) < 2e-6, "{isa:?}");
        }
    }

    #[test]
    fn scratch_panels_start_on_cache_lines() {
        for d in [1, 16, 64, 100, 128, 256] {
            let mut scr = Scratch::new(d);
            for buf in [&mut scr.q, &mut scr.s, &mut scr.o] {
                assert_eq!(buf.as_ptr() as usize % 64, 0, "d {d}");
                assert!(buf.iter().all(|&x| x == 0.0));
                buf.fill(1.0);
            }
            assert_eq!((scr.q.len(), scr.s.len(), scr.o.len()), (BR * d, BR * BC, BR * round_up(d, MR)));
        }
    }

    /// `finalize_panel` is `finalize` lane by lane, bit for bit: rows that saw no key, NaN and
    /// infinite states, tiny and huge sums, partial panels, both arithmetics' LSE offsets.
    #[test]
    fn finalize_panel_is_finalize_per_lane() {
        use crate::numerics::softmax_math::SoftmaxMath;
        use softmax::finalize;
        let specials = [0.0f32, 1.0, 1.0e-38, 3.0e38, f32::NAN, f32::INFINITY, 0.75, 123.456];
        let states: Vec<RowState> = (0..NR * 5)
            .map(|i| RowState { m: [-1.0e30, 0.0, 7.5, f32::NEG_INFINITY, f32::NAN][i % 5], l: specials[i % 8] })
            .collect();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        fn check<M: Exp2Math>(states: &[RowState], math: &M, bits: &dyn Fn(&[f32]) -> Vec<u32>) {
            for u in [1.0f32, 0.125, 0.088] {
                for chunk in states.windows(NR).step_by(3).chain(states.chunks(7)) {
                    let mut inv = [f32::NAN; NR];
                    let mut lse = vec![f32::NAN; chunk.len()];
                    let live = finalize_panel(chunk, u, math, &mut inv, &mut lse);
                    for (lane, st) in chunk.iter().enumerate() {
                        let (i, l) = finalize(st, u, math);
                        assert_eq!(bits(&[inv[lane], lse[lane]]), bits(&[i, l]), "{st:?} u {u}");
                        assert_eq!(live >> lane & 1 == 1, st.l != 0.0, "{st:?}");
                    }
                    assert!(chunk.len() == NR || live >> chunk.len() == 0, "lanes past the panel are not live");
                }
            }
        }
        check(&states, &Native, &bits);
        // FP8's arithmetic: P carries a scale, taken out of the LSE.
        check(&states, &SoftmaxMath { degree: 5, lazy: None, fp8_p: true }, &bits);
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

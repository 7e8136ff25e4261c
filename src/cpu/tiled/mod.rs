//! The tiled path: FlashAttention's algorithm for the dense forward.
//!
//! Per (batch, kv head), K and V are packed once (f32, strips of 6 keys / 6 columns); every
//! query head of the GQA group and every block of `BLOCK_ROWS` query rows then streams over the key
//! tiles of `TILE_KEYS` keys: `Sᵀ = K·Qᵀ` (6×16 register micro-kernel), the online softmax of each
//! query (exp2 of `(x − m)·scale·log2e`, −inf guard; `softmax` explains the units),
//! `Oᵀ = Oᵀ·diag(scale) + Vᵀ·Pᵀ`, and one normalisation at the end. Work items (kv head, group
//! head, query block) are handed out heaviest first to the persistent worker pool (`parallel`);
//! each owns its own output rows (disjoint `&mut` row slices of the caller's buffer) and writes
//! them once, in the final layout and type.
//!
//! Files: this driver (work items, the choice of what to pack per item, the entry points);
//! `pack` (K/V into the micro-kernel's layouts, the buffers' sizes); `block` (one work item,
//! tile by tile); `output` (the normalised rows into the caller's buffer); `scratch` (a worker's
//! panels).

mod block;
mod output;
mod pack;
mod scratch;
mod sizes;

use super::head_dim::check_head_dim;
use super::gemm::MR;
use super::isa::{detect_isa, isa, Isa};
use super::native::Native;
use super::parallel;
use super::pool;
use super::rows::heads_side_by_side;
use super::score::ScoreMod;
use crate::error::{Error, Result};
use crate::numerics::hadamard::Rotation;
use crate::numerics::quant::fake_quantize;
use crate::numerics::softmax_math::{Exp2Math, SoftmaxMath};
use crate::options::Precision;
use crate::problem::Problem;
use crate::tensor::{try_filled, DataMut, Element, Tensor, TensorView};
use block::attend_block;
use output::{rows_by_head, store_rows, BlockOut};
use pack::{pack_heads, PackedKv, Sizes};
use scratch::Scratch;
use sizes::BLOCK_ROWS;
use std::ops::Range;

/// Upper bound on the packed K/V held at once; larger problems are processed in chunks of kv heads.
const PACK_BUDGET_BYTES: usize = 256 << 20;

/// Most query blocks (over all query heads of a kv head) for which an f32 K is read in place by
/// the first product (`simd::KTile::Rows`, AVX-512 path) instead of packed: the packing pass
/// (K's rows read at the streaming rate, nothing overlapping it) is then saved, but every block
/// reads six rows per strip where the packed strip is one run, which costs more once K is read
/// by several blocks: in place measured faster up to 3 blocks, even at 4, and slower from 6 on
/// (`[batch, seqlen, heads, head_dim]` inputs).
const K_IN_PLACE_READS: usize = 3;

/// Bytes of packed K/V one head-major work item holds at most (several kv heads packed in one
/// pass over the keys; see `tiled()`): about a core's L2, so that each head's packed data is
/// still in a cache when its blocks run (the eight kv heads of 512×64 hold 2.1 MB). Longer
/// sequences pack one head per item (one head of 2048×128 holds 2.1 MB), their rows strided but
/// prefetched.
const PACK_ITEM_BYTES: usize = 4 << 20;

/// The CPU result: `o` as `[batch, seqlen_q, heads_q, head_dim_v]` in q's dtype, `lse` as
/// `[batch, heads_q, seqlen_q]`.
pub(crate) struct CpuOutput {
    pub o: Tensor,
    pub lse: Vec<f32>,
    pub kernel: &'static str,
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
/// worker's `BLOCK_ROWS × head_dim_v` f32) and converted.
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
    let d = p.head_dim_v;
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
/// f16/bf16 output (`BLOCK_ROWS × head_dim_v`, converted into the caller's rows as soon as the
/// block is done; f32 rows are written in place), and `MR × max(head_dim, head_dim_v)` f32 for
/// widening a strip of f16/bf16 K/V.
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
    let mut o = Tensor::zeros(p.dtype, [p.batch, p.seqlen_q, p.heads_q, p.head_dim_v])?;
    let lse = forward_with_into(p, q, k, v, math, nthreads, o.data_mut().as_data_mut(), isa())?;
    Ok(CpuOutput { o, lse, kernel: path_name() })
}

/// As [`forward_with`], writing the output into `dst` (contiguous `[batch, seqlen_q, heads_q,
/// head_dim_v]` of the problem's dtype, checked by the caller); returns the LSE.
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
    let (d, d_v) = (p.head_dim, p.head_dim_v);
    let sm = ScoreMod::new(p);
    // Every size first: a problem too large for this machine fails here, before any work.
    let sz = Sizes::new(p)?;
    let mut rows = rows_by_head(p, dst)?;
    let mut lse = try_filled(sz.n_lse, f32::NEG_INFINITY, || "LSE".into())?;
    let worker = || -> Worker { (Scratch::new(d, d_v), vec![0.0; BLOCK_ROWS * d_v], vec![0.0; MR * d.max(d_v)]) };

    let kv_bytes = 4 * (sz.k_pack + sz.v_pack);
    let chunk = (PACK_BUDGET_BYTES / kv_bytes.max(1)).clamp(1, p.batch * p.heads_kv);
    let nblocks = p.seqlen_q.div_ceil(BLOCK_ROWS);
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
                    let (i0, i1) = (blk * BLOCK_ROWS, ((blk + 1) * BLOCK_ROWS).min(p.seqlen_q));
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
                || vec![0.0; MR * d.max(d_v)],
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
                    let (i0, i1) = (blk * BLOCK_ROWS, ((blk + 1) * BLOCK_ROWS).min(p.seqlen_q));
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
    let mut o = Tensor::zeros(p.dtype, [p.batch, p.seqlen_q, p.heads_q, p.head_dim_v])?;
    let (lse, kernel) = run_into(p, q, k, v, nthreads, o.data_mut().as_data_mut())?;
    Ok(CpuOutput { o, lse, kernel })
}

/// As [`run`], writing the output into `dst` (contiguous `[batch, seqlen_q, heads_q,
/// head_dim_v]` of the problem's dtype, checked by the caller); returns the LSE and the path's name.
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
    use crate::cpu::gemm::NR;
    use crate::cpu::softmax::{finalize_panel, RowState};

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

    /// `finalize_panel` is `finalize` lane by lane, bit for bit: rows that saw no key, NaN and
    /// infinite states, tiny and huge sums, partial panels, both arithmetics' LSE offsets.
    #[test]
    fn finalize_panel_is_finalize_per_lane() {
        use crate::numerics::softmax_math::SoftmaxMath;
        use crate::cpu::softmax::finalize;
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

    /// Why `validate` refuses `τ + 8 >= log2(448)` with FP8: with FA4's τ = 8 on a growing row
    /// max, P reaches 2^16, saturates at 448 in e4m3, and the f32 row sum still counts the
    /// unsaturated value, so the output shrinks (reported upstream as
    /// Dao-AILab/flash-attention#2131 and #2716). This runs the kernel arithmetic directly, past
    /// the validation.
    #[test]
    fn fp8_p_with_tau_8_saturates_and_loses_accuracy() {
        use crate::numerics::softmax_math::{SoftmaxMath, ACCURATE_DEGREE};
        use crate::options::ForwardOptions;
        use crate::reference::{attention_f64, rmse};
        let (sq, sk, d) = (8, 1024, 64);
        let q: Vec<f32> = vec![1.0; sq * d];
        // Scores rise by 20 log2 units over the keys, 2.5 per 128-key tile.
        let per_key = 20.0 * std::f32::consts::LN_2 / (sk as f32 * (d as f32).sqrt());
        let k: Vec<f32> = (0..sk * d).map(|i| per_key * (i / d) as f32).collect();
        let v: Vec<f32> = (0..sk * d).map(|i| 1.0 + ((i * 7) % 13) as f32 / 13.0).collect();
        let q = Tensor::from_vec(q, [1, sq, 1, d]).unwrap();
        let k = Tensor::from_vec(k, [1, sk, 1, d]).unwrap();
        let v = Tensor::from_vec(v, [1, sk, 1, d]).unwrap();
        let p = Problem::new(&q.view(), &k.view(), &v.view(), &ForwardOptions::default()).unwrap();
        let r = attention_f64(&p, &q.view(), &k.view(), &v.view()).unwrap();
        let err = |lazy: Option<f32>| {
            let math = SoftmaxMath { degree: ACCURATE_DEGREE, lazy, fp8_p: true };
            let out = forward_with(&p, &q.view(), &k.view(), &v.view(), math, 1).unwrap();
            let o: Vec<f64> = out.o.to_f32_vec().iter().map(|&x| x as f64).collect();
            rmse(&o, &r.o)
        };
        let (eager, legal, fa4) = (err(None), err(Some(0.8)), err(Some(8.0)));
        assert!(legal <= eager * 1.5 + 1e-4, "τ 0.8: {legal} vs {eager}");
        assert!(fa4 > 10.0 * eager && fa4 > 0.05, "τ 8 with FP8 P: {fa4} vs {eager}");
    }
}

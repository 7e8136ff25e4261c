//! One work item of the tiled path: a block of query rows of one head against the packed K/V of
//! its kv head, tile by tile.

use super::output::{write_rows, BlockOut};
use super::pack::{prefetch_rows, row_f32, PackedKv, ZEROS};
use super::scratch::Scratch;
use super::sizes::{round_up, TILE_KEYS, BLOCK_ROWS};
use crate::cpu::gemm::{micro_kernel, micro_kernel_skip_zero_b, Acc, MR, NR};
use crate::cpu::score::ScoreMod;
use crate::cpu::simd::{self, KTile};
use crate::cpu::softmax::{self, online_softmax, rescale_o, RowState};
use crate::numerics::softmax_math::Exp2Math;
use crate::problem::Problem;
use crate::tensor::TensorView;

/// Where a panel's part of a tile lies: head, first query row and row count of the block, the
/// tile's first computed key, and whether every row of the block sees the whole tile.
pub(super) struct PanelAt {
    pub(super) h: usize,
    pub(super) i0: usize,
    pub(super) nrows: usize,
    pub(super) k0: usize,
    pub(super) full_tile: bool,
}

/// Panel `pn`'s scores `sp` (`[keys][NR]`, keys from `at.k0`) to probabilities: softcap and
/// ALiBi, the mask and the online softmax down each query column (`tile_max`: the scores'
/// `panel_max`, when the product took it). Returns the factors its output
/// panel must be rescaled by (`rescale_o`, fused into the second product's accumulator load).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn panel_softmax<M: Exp2Math, const FMA: bool, const WIDE: bool>(
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
pub(super) fn attend_block<M: Exp2Math, const FMA: bool, const PAIR: bool>(
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
        let j1 = (j0 + TILE_KEYS).min(round_up(hi_all, MR)).min(sk_pad);
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

    write_rows::<M, PAIR>(&scr.o, &scr.rows[..nrows], (p.head_dim_v, p.sink(h)), sm.u, math, (o_out, lse_out));
}

/// Where a key tile lies in a block: its first key, whether every row of the block sees all of
/// it (`full_tile`) or all of it short of the last strip's padding keys (`pad_only`), and the
/// block's head, first query row and row count.
pub(super) struct TileAt {
    pub(super) j0: usize,
    pub(super) pad_only: bool,
    pub(super) full_tile: bool,
    pub(super) h: usize,
    pub(super) i0: usize,
    pub(super) nrows: usize,
}

/// Panels `pn..pn + G` of a block over local keys `c0..c1` of one tile (the same part for all of
/// them): `Sᵀ = K·Qᵀ`, each panel's softmax, `Oᵀ = Oᵀ·diag(scale) + Vᵀ·Pᵀ`. With `WIDE` (the
/// AVX-512 build) the products run for the `G` panels at once (`simd::product_max`,
/// `simd::scaled_product`); otherwise one panel at a time. Every S and O element takes the same
/// FMAs in the same order either way.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn panel_group<M: Exp2Math, const FMA: bool, const WIDE: bool, const G: usize>(
    p: &Problem,
    sm: ScoreMod,
    math: &M,
    kv: &PackedKv,
    scr: &mut Scratch,
    ranges: &[(usize, usize)],
    tile: &TileAt,
    (pn, (c0, c1), fresh): (usize, (usize, usize), &mut u32),
) {
    let (d, d_v) = (p.head_dim, p.head_dim_v);
    let dv = round_up(d_v, MR);
    let sk_pad = round_up(p.seqlen_k, MR);
    let (k0, k1) = (tile.j0 + c0, tile.j0 + c1);
    let mut s_panels = scr.s.chunks_exact_mut(TILE_KEYS * NR).skip(pn);
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
    let v_tile = (&kv.v[k0 * MR..], sk_pad * MR, d_v);
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
pub(super) const Q_PREFETCH_ROWS: usize = BLOCK_ROWS;

/// The Qᵀ panels of query rows `i0..i1` of head `h`: `[panel][head_dim][NR]`, the lanes past
/// `i1` zero (their results are dropped). Rows are read straight from an f32 input (`row`:
/// `NR × head_dim` f32 for the widened rows of an f16/bf16 one).
#[inline(always)]
pub(super) fn fill_q_panels<const WIDE: bool>(
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
pub(super) fn prefetch_next_q(q: &TensorView, (b, h, i1): (usize, usize, usize)) {
    if i1 < q.seqlen() {
        prefetch_rows(q, (b, i1, h..h + 1), Q_PREFETCH_ROWS, true);
    } else if h + 1 < q.heads() {
        // The head is done: its next block is the next head's first (head-major items).
        prefetch_rows(q, (b, 0, h + 1..h + 2), Q_PREFETCH_ROWS, true);
    }
}

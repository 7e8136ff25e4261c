//! The tiled path's output: a block's normalised rows out of its Oᵀ panels, straight into the
//! caller's rows (f32) or converted from a staged block (f16/bf16).

use super::sizes::{round_up, BLOCK_ROWS};
use crate::convert::{narrow_bf16, narrow_f16};
use crate::cpu::gemm::{MR, NR};
use crate::cpu::rows::prefetch_row_with;
use crate::cpu::simd;
use crate::cpu::softmax::{finalize_panel, lse_f64, RowState};
use crate::error::{Error, Result};
use crate::numerics::merge::fold_sink;
use crate::numerics::softmax_math::Exp2Math;
use crate::problem::Problem;
use crate::tensor::{Data, DataMut, Element};

/// Where a block's normalised output rows go.
pub(super) enum BlockOut<'a, 'o> {
    /// `rows × head_dim` contiguous f32, converted into the output type afterwards (`store_rows`).
    Staged(&'a mut [f32]),
    /// The caller's own f32 output rows (`rows_by_head`), written straight from the Oᵀ panels:
    /// one pass over the output instead of a block then a copy.
    Rows(&'a mut [&'o mut [f32]]),
}

/// A block's normalised output rows (`o_out`, `rows.len()` rows of `d`, the head_dim of v) out
/// of its Oᵀ panels (`o`: `[panel][head_dim_v_pad][NR]`), and its LSEs. `WIDE`: AVX-512 transposes 16×16 blocks
/// in registers (`simd::write_panel_rows`) where the scalar loop reads with a 16-float stride.
///
/// Every panel's normaliser and LSEs first, then every panel's rows: the rows' stores miss the
/// cache (the caller's output lines, at best in L2), and while they wait in the store buffer a
/// load of values just stored (the `log2` results, spilled around the libm calls) cannot be
/// forwarded and waits for the buffer to drain.
///
/// `sink`, the block's head's sink logit, is folded into each row's normaliser and LSE
/// (`numerics::merge::fold_sink`, in f64 from the row's state).
#[inline(always)]
pub(super) fn write_rows<M: Exp2Math, const WIDE: bool>(
    o: &[f32],
    rows: &[RowState],
    (d, sink): (usize, Option<f32>),
    u: f32,
    math: &M,
    (mut o_out, lse_out): (BlockOut<'_, '_>, &mut [f32]),
) {
    let dv = round_up(d, MR);
    // A query that saw no key is written as exactly 0, whatever reached O (`finalize`).
    let mut inv = [[0.0f32; NR]; BLOCK_ROWS / NR];
    let mut live = [0u16; BLOCK_ROWS / NR];
    // A panel's output rows asked for into L1 while the panel before it is written (the block's
    // rows were asked for into L2 before its products): stores that hit L1 leave the store buffer
    // at once, where stores that wait for their lines there stall whatever stores follow. Only
    // where whole-vector stores write the rows (`WIDE`): the AVX2 path's scalar row loop is
    // slower with it.
    let fetch_panel = |o_out: &BlockOut<'_, '_>, pn: usize| {
        if let BlockOut::Rows(rs) = o_out {
            for row in rs.iter().skip(pn * NR).take(NR).filter(|r| !r.is_empty()) {
                prefetch_row_with(Data::F32(row), 0, row.len(), simd::prefetch);
            }
        }
    };
    if WIDE {
        fetch_panel(&o_out, 0);
    }
    for (pn, states) in rows.chunks(NR).enumerate() {
        let r0 = pn * NR;
        live[pn] = finalize_panel(states, u, math, &mut inv[pn], &mut lse_out[r0..r0 + states.len()]);
        if let Some(z) = sink {
            for (lane, st) in states.iter().enumerate() {
                let (w, lse) = fold_sink(lse_f64(st, u, math), z);
                if st.l != 0.0 {
                    inv[pn][lane] = (w / st.l as f64) as f32;
                }
                lse_out[r0 + lane] = lse as f32;
            }
        }
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
pub(super) fn write_panel<const WIDE: bool>(op: &[f32], (inv, live): (&[f32; NR], u16), d: usize, out: &mut [&mut [f32]]) {
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

/// The rows of `dst` (`[batch, seqlen_q, heads_q, head_dim_v]`, one `&mut` slice of head_dim_v
/// elements per (batch, query, head)) in the order `[batch, heads_q, seqlen_q]`, so that the
/// work items can own consecutive runs of them: each item writes its output once, in the final
/// layout and type, where an item's part of the output is not contiguous. Allocated fallibly.
pub(super) fn rows_by_head<'o, T>(p: &Problem, dst: &'o mut [T]) -> Result<Vec<&'o mut [T]>> {
    let (hq, sq, d) = (p.heads_q, p.seqlen_q, p.head_dim_v);
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

/// `src` converted into an output row of any element type (`min` of the two lengths). Inlined:
/// for an f32 output (the element type is known where this is called) it is the plain copy.
#[inline]
pub(crate) fn narrow_row(src: &[f32], dst: DataMut<'_>) {
    match dst {
        DataMut::F32(d) => {
            let n = d.len().min(src.len());
            d[..n].copy_from_slice(&src[..n])
        }
        DataMut::F16(d) => narrow_f16(src, d),
        DataMut::BF16(d) => narrow_bf16(src, d),
    }
}

/// A block's normalised f32 rows (`src`, `dst.len() × d`) into its output rows, converted to
/// the output type (a whole row at a time: `convert`).
pub(super) fn store_rows<T: Element>(src: &[f32], dst: &mut [&mut [T]], d: usize) {
    for (row, from) in dst.iter_mut().zip(src.chunks_exact(d)) {
        narrow_row(from, T::wrap_mut(row));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrow_row_writes_every_type() {
        let src = [1.0f32, -2.5, 3.0e-6, f32::INFINITY, 1.0e10];
        let mut a = [0.0f32; 5];
        narrow_row(&src, DataMut::F32(&mut a));
        assert_eq!(a, src);
        let mut h = [half::f16::ZERO; 5];
        narrow_row(&src, DataMut::F16(&mut h));
        assert!(h.iter().zip(&src).all(|(h, &x)| h.to_bits() == half::f16::from_f32(x).to_bits()));
        let mut b = [half::bf16::ZERO; 5];
        narrow_row(&src, DataMut::BF16(&mut b));
        assert!(b.iter().zip(&src).all(|(b, &x)| b.to_bits() == half::bf16::from_f32(x).to_bits()));
    }
}

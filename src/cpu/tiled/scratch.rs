//! A worker's scratch for the tiled path: the Qᵀ, Sᵀ and Oᵀ panels, on cache lines.

use super::sizes::{round_up, TILE_KEYS, BLOCK_ROWS};
use crate::cpu::gemm::{MR, NR};
use crate::cpu::softmax::RowState;

/// Per-thread scratch, sized once. Everything about queries is held transposed, in panels of
/// `NR` queries side by side, so the softmax and the rescale are vertical vector operations and
/// the probabilities are already in the B-operand layout of the second product.
pub(super) struct Scratch {
    /// Qᵀ panels `[BLOCK_ROWS / NR][head_dim][NR]`.
    pub(super) q: LineAligned,
    /// Sᵀ (then Pᵀ) panels `[BLOCK_ROWS / NR][TILE_KEYS][NR]`.
    pub(super) s: LineAligned,
    /// Oᵀ panels `[BLOCK_ROWS / NR][head_dim_v_pad][NR]`.
    pub(super) o: LineAligned,
    pub(super) rows: Vec<RowState>,
    /// `NR × head_dim`: a panel's Q rows widened from f16/bf16.
    pub(super) q_row: Vec<f32>,
}

/// A zeroed f32 buffer whose first element starts a 64-byte cache line. The panels' rows are
/// 16 f32 (64 bytes) from there, so every 512-bit load and store of Q, P and O in the products
/// and the softmax touches one line; from the allocator's usual 16-byte alignment three rows in
/// four would straddle two lines, and a split load takes two of the load ports' slots.
pub(super) struct LineAligned {
    pub(super) buf: Vec<f32>,
    pub(super) off: usize,
    pub(super) len: usize,
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
    /// For q/k head_dim `d` and v head_dim `d_v`.
    pub(super) fn new(d: usize, d_v: usize) -> Self {
        Scratch {
            q: LineAligned::new(BLOCK_ROWS * d),
            s: LineAligned::new(BLOCK_ROWS * TILE_KEYS),
            o: LineAligned::new(BLOCK_ROWS * round_up(d_v, MR)),
            rows: vec![RowState::EMPTY; BLOCK_ROWS],
            q_row: vec![0.0; NR * d],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_panels_start_on_cache_lines() {
        for d in [1, 16, 64, 100, 128, 256] {
            let mut scr = Scratch::new(d, d);
            for buf in [&mut scr.q, &mut scr.s, &mut scr.o] {
                assert_eq!(buf.as_ptr() as usize % 64, 0, "d {d}");
                assert!(buf.iter().all(|&x| x == 0.0));
                buf.fill(1.0);
            }
            assert_eq!((scr.q.len(), scr.s.len(), scr.o.len()), (BLOCK_ROWS * d, BLOCK_ROWS * TILE_KEYS, BLOCK_ROWS * round_up(d, MR)));
        }
    }
}

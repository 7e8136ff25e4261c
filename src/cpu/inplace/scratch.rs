//! The in-place path's per-worker scratch, kept by each thread between calls.

use super::lanes;
use super::sizes::CHUNK_KEYS;
use crate::cpu::gemm::NR;
use crate::cpu::softmax::RowState;

/// Per-worker buffers, sized once.
pub(super) struct Scratch {
    /// Query rows `[ITEM_ROWS][d]` (`d`: q/k's head_dim).
    pub(super) q: Vec<f32>,
    /// Unnormalised outputs `[ITEM_ROWS][dv]` (`dv`: v's head_dim).
    pub(super) o: Vec<f32>,
    /// One panel's scores, then probabilities: `[CHUNK_KEYS][NR]`.
    pub(super) s: Vec<[f32; NR]>,
    pub(super) rows: Vec<RowState>,
    /// Per row: visible keys `[lo, hi)` (clipped to the split), query position, query head.
    pub(super) lo: Vec<usize>,
    pub(super) hi: Vec<usize>,
    pub(super) qi: Vec<usize>,
    pub(super) head: Vec<usize>,
    /// Widened K and V rows of one chunk (16-bit inputs only): `[CHUNK_KEYS][d]` and
    /// `[CHUNK_KEYS][dv]`, sized on first use
    /// (the group-1 sweeps never use them, and a decode unit holds one scratch per kv head:
    /// zeroing 2 × 32 KiB for each on every call would cost as much as a short decode call).
    pub(super) kbuf: Vec<f32>,
    pub(super) vbuf: Vec<f32>,
    /// Element offsets of the chunk's K and V rows.
    pub(super) kofs: Vec<usize>,
    pub(super) vofs: Vec<usize>,
    /// The query rows and their unnormalised outputs in the blocked decode's lane order
    /// (`sweep_key_blocks_with`): `[rows][d]` each, `rows` at most `NR` (the most an item it takes has).
    pub(super) qp: Vec<f32>,
    pub(super) op: Vec<f32>,
    /// The blocked decode's scores of each row against a block's keys (`key_block_in_key_order`),
    /// then the rows' probabilities, `[rows][BLOCK_KEYS]` each, and output factors `[rows]`.
    pub(super) xb: Vec<[f32; lanes::BLOCK_KEYS]>,
    pub(super) pb: Vec<[f32; lanes::BLOCK_KEYS]>,
    pub(super) fb: Vec<f32>,
}

/// A worker's scratches for one call, kept by its thread for the next call, because a decode
/// unit holds one per kv head and allocating and zeroing them on every call is a visible part
/// of a short decode call's time. Only scratches for the same head_dims and row count are reused.
pub(super) struct Scratches {
    /// The head_dims of q/k and of v.
    pub(super) d: (usize, usize),
    pub(super) rows: usize,
    pub(super) v: Vec<Scratch>,
}

/// Most bytes of scratch a thread keeps between calls.
pub(super) const SCRATCH_KEEP_BYTES: usize = 4 << 20;

/// A thread's kept scratches: their head_dims (q/k, v), row count, and the scratches.
type Kept = ((usize, usize), usize, Vec<Scratch>);

thread_local! {
    static KEPT: std::cell::RefCell<Option<Kept>> = const { std::cell::RefCell::new(None) };
}

impl Scratches {
    pub(super) fn take(d: (usize, usize), rows: usize) -> Self {
        let kept = KEPT.try_with(|k| k.try_borrow_mut().ok().and_then(|mut s| s.take())).ok().flatten();
        match kept {
            Some((kd, kr, v)) if (kd, kr) == (d, rows) => Scratches { d, rows, v },
            _ => Scratches { d, rows, v: Vec::new() },
        }
    }

    /// The first `n` scratches, made as needed.
    pub(super) fn at_least(&mut self, n: usize) -> &mut [Scratch] {
        while self.v.len() < n {
            self.v.push(Scratch::new(self.d, self.rows));
        }
        &mut self.v[..n]
    }
}

impl Drop for Scratches {
    fn drop(&mut self) {
        let rb = self.rows.div_ceil(NR).max(1) * NR;
        let dec = self.rows.clamp(1, NR);
        let (d, dv) = self.d;
        let floats = rb * (d + dv) + CHUNK_KEYS * NR + 2 * dec * d + dec * (2 * lanes::BLOCK_KEYS + 1);
        let each = 4 * floats + 4 * CHUNK_KEYS * (d + dv);
        if self.v.is_empty() || self.v.len().saturating_mul(each) > SCRATCH_KEEP_BYTES {
            return;
        }
        let v = std::mem::take(&mut self.v);
        // Kept only in an empty slot of a live thread (a nested call on this thread may have
        // filled it, or hold it borrowed); otherwise freed here.
        let _ = KEPT.try_with(|k| {
            if let Ok(mut slot) = k.try_borrow_mut() {
                if slot.is_none() {
                    *slot = Some((self.d, self.rows, v));
                }
            }
        });
    }
}

impl Scratch {
    /// For items of up to `rows` query rows (at most [`ITEM_ROWS`]) of q/k head_dim `d` and v
    /// head_dim `dv`. The blocked decode's `qp` and `op` are sized for `d`: it runs only where
    /// `dv == d`.
    pub(super) fn new((d, dv): (usize, usize), rows: usize) -> Self {
        let rb = rows.div_ceil(NR).max(1) * NR;
        Scratch {
            q: vec![0.0; rb * d],
            o: vec![0.0; rb * dv],
            s: vec![[0.0; NR]; CHUNK_KEYS],
            rows: vec![RowState::EMPTY; rb],
            lo: vec![0; rb],
            hi: vec![0; rb],
            qi: vec![0; rb],
            head: vec![0; rb],
            kbuf: Vec::new(),
            vbuf: Vec::new(),
            kofs: vec![0; CHUNK_KEYS],
            vofs: vec![0; CHUNK_KEYS],
            qp: vec![0.0; rows.clamp(1, NR) * d],
            op: vec![0.0; rows.clamp(1, NR) * d],
            xb: vec![[0.0; lanes::BLOCK_KEYS]; rows.clamp(1, NR)],
            pb: vec![[0.0; lanes::BLOCK_KEYS]; rows.clamp(1, NR)],
            fb: vec![1.0; rows.clamp(1, NR)],
        }
    }
}

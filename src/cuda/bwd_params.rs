//! `BwdParams`: the FFI struct between Rust and the backward kernels (`cuda/fa2_bwd.cu`),
//! mirrored field for field from `cuda/common/bwd_params.h`. Both sides assert the size and the
//! offsets, so a change on one side alone fails the build.

use super::params::{assert_c_layout, FLAG_ALIBI, FLAG_SOFTCAP};
use crate::problem::Problem;
use std::mem::size_of;

/// dq accumulated without floating-point atomics (FA_BWD_FLAG_DETERMINISTIC): per-key-block f32
/// partials summed in key-block order by the convert kernel.
pub const FLAG_DETERMINISTIC: u32 = 8;

/// Where the backward's tensors live: device addresses and element strides of (batch, seqlen,
/// heads) of q, k, v, o, dO, dq, dk, dv (in that order), and the f32 buffers.
#[derive(Clone, Copy, Debug)]
pub struct BwdOperands {
    pub ptrs: [u64; 8],
    pub strides: [[usize; 3]; 8],
    /// f32 `[batch, heads_q, seqlen_q]`: the forward's LSE (natural log).
    pub lse: u64,
    /// f32 `[batch, heads_q, seqlen_q]` scratch: D = rowsum(dO ∘ O).
    pub d_sum: u64,
    /// f32 scratch of [`super::fa2_bwd::BwdPlan::dq_accum_floats`] floats.
    pub dq_accum: u64,
    /// f32 `[heads_q]`, or 0.
    pub alibi: u64,
    /// f32 `[heads_q]`: the forward's sink logits (`Problem::sinks`), or 0.
    pub sinks: u64,
    /// f32 `[heads_q]`: the sink logits' gradient, written by the sink launch; 0: not taken (no
    /// launch).
    pub d_sinks: u64,
}

/// Kernel parameters, passed by value as `const __grid_constant__ BwdParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BwdParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub d_o: u64,
    pub lse: u64,
    pub d_sum: u64,
    pub dq_accum: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub alibi_slopes: u64,
    /// (batch, row, head) element strides of q, k, v, o, dO, dq, dk, dv.
    pub strides: [[i64; 3]; 8],
    pub batch: i32,
    pub seqlen_q: i32,
    pub seqlen_k: i32,
    pub heads_q: i32,
    pub heads_kv: i32,
    pub head_dim: i32,
    /// -1 = unbounded; causal: window_right = 0.
    pub window_left: i32,
    pub window_right: i32,
    pub softmax_scale: f32,
    /// Score units to log2 units, as the forward's.
    pub softmax_scale_log2: f32,
    pub softcap: f32,
    /// FLAG_SOFTCAP | FLAG_ALIBI | FLAG_DETERMINISTIC.
    pub flags: u32,
    /// 1, or the main kernel's key blocks (deterministic).
    pub dq_accum_splits: i32,
    /// Keys per key block of the main kernel.
    pub block_n: i32,
    /// f32 `[heads_q]` sink logits, or 0.
    pub sinks: u64,
    /// f32 `[heads_q]` sink gradient (output), or 0.
    pub d_sinks: u64,
}

// The same numbers as the static_asserts in cuda/common/bwd_params.h, plus every other offset.
assert_c_layout!(BwdParams, size 360, {
    d_o: 32,
    dq_accum: 56,
    dv: 80,
    alibi_slopes: 88,
    strides: 96,
    batch: 288,
    head_dim: 308,
    window_left: 312,
    softmax_scale: 320,
    softcap: 328,
    flags: 332,
    dq_accum_splits: 336,
    block_n: 340,
    sinks: 344,
    d_sinks: 352,
});

impl BwdParams {
    /// The parameters of `p`'s backward over `ops`; `splits` and `block_n` as the plan chose.
    pub(crate) fn for_launch(p: &Problem, ops: &BwdOperands, deterministic: bool, splits: usize, block_n: u32) -> Self {
        let window = |w: Option<usize>| w.map_or(-1, |x| x.min(i32::MAX as usize) as i32);
        let mut flags = 0;
        if p.softcap.is_some() {
            flags |= FLAG_SOFTCAP;
        }
        if ops.alibi != 0 {
            flags |= FLAG_ALIBI;
        }
        if deterministic {
            flags |= FLAG_DETERMINISTIC;
        }
        let [q, k, v, o, d_o, dq, dk, dv] = ops.ptrs;
        BwdParams {
            q,
            k,
            v,
            o,
            d_o,
            lse: ops.lse,
            d_sum: ops.d_sum,
            dq_accum: ops.dq_accum,
            dq,
            dk,
            dv,
            alibi_slopes: ops.alibi,
            strides: ops.strides.map(|s| s.map(|x| x as i64)),
            batch: p.batch as i32,
            seqlen_q: p.seqlen_q as i32,
            seqlen_k: p.seqlen_k as i32,
            heads_q: p.heads_q as i32,
            heads_kv: p.heads_kv as i32,
            head_dim: p.head_dim as i32,
            window_left: window(p.left),
            window_right: window(p.right),
            softmax_scale: p.scale,
            softmax_scale_log2: p.score_units().to_log2,
            softcap: p.softcap.unwrap_or(0.0),
            flags,
            dq_accum_splits: splits as i32,
            block_n: block_n as i32,
            sinks: ops.sinks,
            d_sinks: ops.d_sinks,
        }
    }

    /// The struct's bytes as the kernel receives them (native endianness, the C layout).
    pub fn to_bytes(self) -> [u8; size_of::<BwdParams>()] {
        let mut out = [0u8; size_of::<BwdParams>()];
        let mut at = 0;
        let mut put = |b: &[u8]| {
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        for x in [
            self.q,
            self.k,
            self.v,
            self.o,
            self.d_o,
            self.lse,
            self.d_sum,
            self.dq_accum,
            self.dq,
            self.dk,
            self.dv,
            self.alibi_slopes,
        ] {
            put(&x.to_ne_bytes());
        }
        for x in self.strides.iter().flatten() {
            put(&x.to_ne_bytes());
        }
        for x in [self.batch, self.seqlen_q, self.seqlen_k, self.heads_q, self.heads_kv, self.head_dim] {
            put(&x.to_ne_bytes());
        }
        put(&self.window_left.to_ne_bytes());
        put(&self.window_right.to_ne_bytes());
        for x in [self.softmax_scale, self.softmax_scale_log2, self.softcap] {
            put(&x.to_ne_bytes());
        }
        put(&self.flags.to_ne_bytes());
        put(&self.dq_accum_splits.to_ne_bytes());
        put(&self.block_n.to_ne_bytes());
        put(&self.sinks.to_ne_bytes());
        put(&self.d_sinks.to_ne_bytes());
        debug_assert_eq!(at, out.len());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field lands at the offset the layout asserts say.
    #[test]
    fn to_bytes_follows_the_c_layout() {
        let mut strides = [[0i64; 3]; 8];
        strides[7][2] = 77;
        let p = BwdParams {
            alibi_slopes: 0x55,
            strides,
            head_dim: 128,
            softcap: 2.5,
            block_n: 64,
            sinks: 0x66,
            d_sinks: 0x77,
            ..BwdParams::default()
        };
        let b = p.to_bytes();
        let at = |o: usize, n: usize| &b[o..o + n];
        assert_eq!(at(88, 8), 0x55u64.to_ne_bytes());
        assert_eq!(at(280, 8), 77i64.to_ne_bytes());
        assert_eq!(at(308, 4), 128i32.to_ne_bytes());
        assert_eq!(at(328, 4), 2.5f32.to_ne_bytes());
        assert_eq!(at(340, 4), 64i32.to_ne_bytes());
        assert_eq!(at(344, 8), 0x66u64.to_ne_bytes());
        assert_eq!(at(352, 8), 0x77u64.to_ne_bytes());
    }
}

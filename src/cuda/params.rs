//! `FwdParams`: the one FFI struct between Rust and every forward kernel, mirrored field for
//! field from `cuda/common/params.h`. Both sides assert the size and the offsets, so a change
//! on one side alone fails the build. [`Operands`]: where q, k, v, o, the LSE and the ALiBi
//! slopes live, from which the parameters are built.

use crate::problem::Problem;
use std::mem::{offset_of, size_of};

/// Bits of [`FwdParams::flags`] (FA_FLAG_* in cuda/common/params.h).
pub const FLAG_RETURN_LSE: u32 = 1;
pub const FLAG_SOFTCAP: u32 = 2;
pub const FLAG_ALIBI: u32 = 4;

/// Where q, k, v, o live: device addresses and element strides of (batch, seqlen, heads), plus
/// the LSE and ALiBi buffers (0: none).
#[derive(Clone, Copy, Debug)]
pub struct Operands {
    pub ptrs: [u64; 4],
    pub strides: [[usize; 3]; 4],
    pub lse: u64,
    pub alibi: u64,
}

/// Kernel parameters, passed by value as `const __grid_constant__ FwdParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FwdParams {
    /// Device addresses. q, k, v, o: `[batch, seqlen, heads, head_dim]`, head_dim contiguous.
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    /// f32 `[batch, heads_q, seqlen_q]`, or 0.
    pub lse: u64,
    /// f32 `[heads_q]`, or 0.
    pub alibi_slopes: u64,
    /// FP8 descales (f32), or 0.
    pub q_descale: u64,
    pub k_descale: u64,
    pub v_descale: u64,
    /// Element strides of batch, seqlen and heads.
    pub q_batch_stride: i64,
    pub q_row_stride: i64,
    pub q_head_stride: i64,
    pub k_batch_stride: i64,
    pub k_row_stride: i64,
    pub k_head_stride: i64,
    pub v_batch_stride: i64,
    pub v_row_stride: i64,
    pub v_head_stride: i64,
    pub o_batch_stride: i64,
    pub o_row_stride: i64,
    pub o_head_stride: i64,
    pub batch: i32,
    pub seqlen_q: i32,
    pub seqlen_k: i32,
    pub heads_q: i32,
    pub heads_kv: i32,
    pub head_dim: i32,
    /// -1 = unbounded; causal: window_right = 0.
    pub window_left: i32,
    pub window_right: i32,
    /// Rows per FP8 scale block (0 when unused).
    pub descale_block: i32,
    /// Natural units, multiplies q·k.
    pub softmax_scale: f32,
    /// Score units to log2 units (`Problem::score_units`): softmax_scale·log2(e) for raw q·k
    /// scores; log2(e) for natural-unit scores (softcap or ALiBi on).
    pub softmax_scale_log2: f32,
    /// The cap (0 when off).
    pub softcap: f32,
    /// FLAG_* bits.
    pub flags: u32,
    pub reserved: u32,
}

// The same numbers as the static_asserts in cuda/common/params.h, plus every other offset.
const _: () = {
    assert!(size_of::<FwdParams>() == 224);
    assert!(offset_of!(FwdParams, q) == 0);
    assert!(offset_of!(FwdParams, lse) == 32);
    assert!(offset_of!(FwdParams, alibi_slopes) == 40);
    assert!(offset_of!(FwdParams, v_descale) == 64);
    assert!(offset_of!(FwdParams, q_batch_stride) == 72);
    assert!(offset_of!(FwdParams, k_batch_stride) == 96);
    assert!(offset_of!(FwdParams, v_batch_stride) == 120);
    assert!(offset_of!(FwdParams, o_batch_stride) == 144);
    assert!(offset_of!(FwdParams, o_head_stride) == 160);
    assert!(offset_of!(FwdParams, batch) == 168);
    assert!(offset_of!(FwdParams, head_dim) == 188);
    assert!(offset_of!(FwdParams, window_left) == 192);
    assert!(offset_of!(FwdParams, window_right) == 196);
    assert!(offset_of!(FwdParams, descale_block) == 200);
    assert!(offset_of!(FwdParams, softmax_scale) == 204);
    assert!(offset_of!(FwdParams, softmax_scale_log2) == 208);
    assert!(offset_of!(FwdParams, softcap) == 212);
    assert!(offset_of!(FwdParams, flags) == 216);
    assert!(offset_of!(FwdParams, reserved) == 220);
};

impl FwdParams {
    /// The parameters of a launch of `p` on `ops`: the one place they are built, for
    /// `Engine`'s launches and for the emulator's launch plans. The caller has checked that
    /// seqlens fit `i32` and that the strides address inside their buffers (so they fit `i64`).
    pub(crate) fn for_launch(p: &Problem, ops: &Operands) -> Self {
        let Operands { ptrs, strides, lse, alibi } = *ops;
        let st = |s: usize| s as i64;
        // An unbounded side is -1. Problem::new clamps bounds to the sequence (<= 2^30 on the
        // GPU); a bound past i32::MAX would see the same keys as i32::MAX, and mask.cuh forms
        // its sums in 64 bits anyway.
        let window = |w: Option<usize>| w.map_or(-1, |x| x.min(i32::MAX as usize) as i32);
        let mut flags = 0;
        if lse != 0 {
            flags |= FLAG_RETURN_LSE;
        }
        if p.softcap.is_some() {
            flags |= FLAG_SOFTCAP;
        }
        if alibi != 0 {
            flags |= FLAG_ALIBI;
        }
        let [q, k, v, o] = strides;
        FwdParams {
            q: ptrs[0],
            k: ptrs[1],
            v: ptrs[2],
            o: ptrs[3],
            lse,
            alibi_slopes: alibi,
            q_batch_stride: st(q[0]),
            q_row_stride: st(q[1]),
            q_head_stride: st(q[2]),
            k_batch_stride: st(k[0]),
            k_row_stride: st(k[1]),
            k_head_stride: st(k[2]),
            v_batch_stride: st(v[0]),
            v_row_stride: st(v[1]),
            v_head_stride: st(v[2]),
            o_batch_stride: st(o[0]),
            o_row_stride: st(o[1]),
            o_head_stride: st(o[2]),
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
            ..FwdParams::default()
        }
    }

    /// The struct's bytes as the kernel receives them (native endianness, `cuda/common/params.h` layout).
    pub fn to_bytes(self) -> [u8; size_of::<FwdParams>()] {
        let mut out = [0u8; size_of::<FwdParams>()];
        let mut at = 0;
        let mut put = |b: &[u8]| {
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        for x in [self.q, self.k, self.v, self.o, self.lse, self.alibi_slopes, self.q_descale, self.k_descale, self.v_descale] {
            put(&x.to_ne_bytes());
        }
        for x in [
            self.q_batch_stride,
            self.q_row_stride,
            self.q_head_stride,
            self.k_batch_stride,
            self.k_row_stride,
            self.k_head_stride,
            self.v_batch_stride,
            self.v_row_stride,
            self.v_head_stride,
            self.o_batch_stride,
            self.o_row_stride,
            self.o_head_stride,
        ] {
            put(&x.to_ne_bytes());
        }
        for x in [
            self.batch,
            self.seqlen_q,
            self.seqlen_k,
            self.heads_q,
            self.heads_kv,
            self.head_dim,
            self.window_left,
            self.window_right,
            self.descale_block,
        ] {
            put(&x.to_ne_bytes());
        }
        for x in [self.softmax_scale, self.softmax_scale_log2, self.softcap] {
            put(&x.to_ne_bytes());
        }
        put(&self.flags.to_ne_bytes());
        put(&self.reserved.to_ne_bytes());
        debug_assert_eq!(at, size_of::<FwdParams>());
        out
    }
}

// SAFETY: FwdParams is #[repr(C)], Copy, made only of integers and floats with no padding
// (size and every offset asserted above to match cuda/common/params.h), so its bytes are a valid kernel
// argument of type `FwdParams`.
unsafe impl cudarc::driver::DeviceRepr for FwdParams {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field lands at the offset the layout asserts say (bytes written in field order).
    #[test]
    fn to_bytes_follows_the_c_layout() {
        let p = FwdParams {
            q: 0x1111,
            batch: 7,
            window_left: -1,
            softmax_scale: 0.5,
            flags: 3,
            reserved: 9,
            o_head_stride: 64,
            ..FwdParams::default()
        };
        let b = p.to_bytes();
        let at = |o: usize, n: usize| &b[o..o + n];
        assert_eq!(at(offset_of!(FwdParams, q), 8), &0x1111u64.to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, o_head_stride), 8), &64i64.to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, batch), 4), &7i32.to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, window_left), 4), &(-1i32).to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, softmax_scale), 4), &0.5f32.to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, flags), 4), &3u32.to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, reserved), 4), &9u32.to_ne_bytes());
    }
}

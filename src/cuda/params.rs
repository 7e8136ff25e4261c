//! `FwdParams`: the one FFI struct between Rust and every forward kernel, mirrored field for
//! field from `cuda/include/fa_params.h`. Both sides assert the size and the offsets, so a change
//! on one side alone fails the build.

use std::mem::{offset_of, size_of};

/// Bits of [`FwdParams::flags`] (FA_FLAG_* in fa_params.h).
pub const FLAG_RETURN_LSE: u32 = 1;
pub const FLAG_SOFTCAP: u32 = 2;
pub const FLAG_ALIBI: u32 = 4;

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
    /// Score units to log2 units: softmax_scale·log2(e) for raw q·k scores; log2(e) for
    /// natural-unit scores (softcap or ALiBi on). See cuda/include/softmax_fwd.cuh.
    pub softmax_scale_log2: f32,
    /// The cap (0 when off).
    pub softcap: f32,
    /// FLAG_* bits.
    pub flags: u32,
    pub reserved: u32,
}

// The same numbers as the static_asserts in fa_params.h, plus every other offset.
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

// SAFETY: FwdParams is #[repr(C)], Copy, made only of integers and floats with no padding
// (size and every offset asserted above to match fa_params.h), so its bytes are a valid kernel
// argument of type `FwdParams`.
unsafe impl cudarc::driver::DeviceRepr for FwdParams {}

//! One FP8 forward as data: the device scratch it needs (`Fp8Scratch`) and its three launches
//! (the pre-pass of Q and K, the pre-pass of V, the consumer's parameters).

use super::consumer::{consumer_params, ConsumerOperands};
use super::prepass::{option_error, prepass_plan, PrepassInput, PrepassLaunch};
use crate::cuda::params::{FwdParams, Operands};
use crate::error::{Error, Result};
use crate::numerics::quant::block_rows;
use crate::options::Precision;
use crate::problem::Problem;

/// Byte alignment of each region of the FP8 scratch (TMA base addresses: 16; 256 is cheap).
const SCRATCH_ALIGN: usize = 256;

/// The device scratch of one FP8 forward: the pre-pass's e4m3 codes of Q and K (`[b, s, h, d]`),
/// of Vᵀ (`[b, h_kv, d, keys_pad]`, keys padded to 16 bytes for TMA's stride rule) and the f32
/// scales of Q, K, V (`[b, h, blocks]`), as byte offsets into one buffer of `bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Scratch {
    pub q: usize,
    pub k: usize,
    pub vt: usize,
    /// Keys per Vᵀ row (seqlen_k rounded up to 16).
    pub keys_pad: usize,
    pub scales: [usize; 3],
    pub bytes: usize,
}

impl Fp8Scratch {
    /// The scratch layout of FP8 problem `p`.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] when `p` is not an FP8 problem; [`Error::TooLarge`] past usize.
    pub fn of(p: &Problem) -> Result<Fp8Scratch> {
        let Precision::Fp8 { scaling, .. } = p.precision else {
            return Err(option_error("precision", format!("{:?}", p.precision), "Precision::Fp8"));
        };
        let too_large = || Error::TooLarge { what: format!("FP8 scratch of {p:?}") };
        let mul = |xs: &[usize]| xs.iter().try_fold(1usize, |a, &x| a.checked_mul(x)).ok_or_else(too_large);
        let keys_pad = p.seqlen_k.div_ceil(16) * 16;
        let blocks = |s: usize| s.div_ceil(block_rows(scaling, s));
        let sizes = [
            mul(&[p.batch, p.seqlen_q, p.heads_q, p.head_dim])?,
            mul(&[p.batch, p.seqlen_k, p.heads_kv, p.head_dim])?,
            mul(&[p.batch, p.heads_kv, p.head_dim, keys_pad])?,
            mul(&[p.batch, p.heads_q, blocks(p.seqlen_q), 4])?,
            mul(&[p.batch, p.heads_kv, blocks(p.seqlen_k), 4])?,
            mul(&[p.batch, p.heads_kv, blocks(p.seqlen_k), 4])?,
        ];
        let mut at = [0usize; 6];
        let mut end = 0usize;
        for (a, n) in at.iter_mut().zip(sizes) {
            *a = end;
            end = end.checked_add(n).and_then(|e| e.checked_next_multiple_of(SCRATCH_ALIGN)).ok_or_else(too_large)?;
        }
        Ok(Fp8Scratch { q: at[0], k: at[1], vt: at[2], keys_pad, scales: [at[3], at[4], at[5]], bytes: end })
    }
}

/// The three launches of the FP8 forward of `p` on the caller's bf16/f16 tensors `ops`
/// (element strides; `ops.ptrs[3]` the output, `ops.lse` its LSE or 0) with the scratch at
/// device address `scratch` (laid out as `layout`): the pre-pass of Q and K (rotated when
/// `hadamard` is set), the pre-pass of V into Vᵀ, then the consumer's parameters (the same at
/// every stage; its grid and tensor maps come from the table row: `plan::plan_instance`).
///
/// # Errors
/// As [`prepass_plan`] and [`consumer_plan`](super::consumer_plan).
pub fn forward_plans(
    p: &Problem,
    ops: &Operands,
    scratch: u64,
    layout: &Fp8Scratch,
) -> Result<(PrepassLaunch, PrepassLaunch, FwdParams)> {
    let Precision::Fp8 { scaling, hadamard } = p.precision else {
        return Err(option_error("precision", format!("{:?}", p.precision), "Precision::Fp8"));
    };
    let (b, d, hq, hk) = (p.batch, p.head_dim, p.heads_q, p.heads_kv);
    let at = |off: usize| scratch + off as u64;
    let q_codes = [p.seqlen_q * hq * d, hq * d, d];
    let k_codes = [p.seqlen_k * hk * d, hk * d, d];
    let kp = layout.keys_pad;
    let input = |i: usize, shape: [usize; 4], codes: usize, code_strides: [usize; 4], scales: usize, rotate: bool| {
        PrepassInput {
            shape,
            x: ops.ptrs[i],
            x_strides: ops.strides[i],
            codes: at(codes),
            code_strides,
            scales: at(scales),
            rotate: rotate && hadamard.is_some(),
        }
    };
    let qk = prepass_plan(
        p.dtype,
        scaling,
        hadamard,
        &[
            input(0, [b, p.seqlen_q, hq, d], layout.q, [q_codes[0], q_codes[1], q_codes[2], 1], layout.scales[0], true),
            input(1, [b, p.seqlen_k, hk, d], layout.k, [k_codes[0], k_codes[1], k_codes[2], 1], layout.scales[1], true),
        ],
    )?;
    // Vᵀ: the code of (batch, key, head, dim) at ((batch · h_kv + head) · d + dim) · keys_pad + key.
    let v = prepass_plan(
        p.dtype,
        scaling,
        None,
        &[input(2, [b, p.seqlen_k, hk, d], layout.vt, [hk * d * kp, 1, d * kp, kp], layout.scales[2], false)],
    )?;
    let consumer = ConsumerOperands {
        q: at(layout.q),
        q_strides: q_codes,
        k: at(layout.k),
        k_strides: k_codes,
        vt: at(layout.vt),
        vt_strides: [hk * d * kp, kp, d * kp],
        o: ops.ptrs[3],
        o_strides: ops.strides[3],
        lse: ops.lse,
        descales: layout.scales.map(at),
    };
    Ok((qk, v, consumer_params(p, &consumer)?))
}

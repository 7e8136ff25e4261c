//! The FP8 pre-pass as data (`cuda/fp8_prepass.cu`): bf16/f16 -> e4m3 codes and per-block
//! scales, Q and K optionally rotated by the seeded Hadamard transform, V written transposed;
//! `PrepassParams` mirrors `cuda/common/fp8_prepass_params.h`.

use crate::error::{Error, Result};
use crate::numerics::quant::block_rows;
use crate::options::Fp8Scaling;
use crate::DType;
use crate::cuda::params::assert_c_layout;
use std::mem::size_of;

/// Warps per CTA of the pre-pass (FA_FP8_PREPASS_WARPS); each quantises one scale block.
pub const PREPASS_WARPS: u32 = 4;

/// Operands one pre-pass launch carries (FA_FP8_PREPASS_MAX_OPS): Q and K, or V.
pub const PREPASS_MAX_OPS: usize = 2;

/// `PrepassOperand::flags`: rotate rows by the seeded Hadamard transform (FA_FP8_ROTATE).
pub const PREPASS_ROTATE: u32 = 1;

/// One operand of the pre-pass, mirrored from `Fp8PrepassOperand` (cuda/common/fp8_prepass_params.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrepassOperand {
    pub x: u64,
    pub codes: u64,
    pub scales: u64,
    /// Element strides of the input (batch, seqlen, heads).
    pub x_batch_stride: i64,
    pub x_row_stride: i64,
    pub x_head_stride: i64,
    /// Byte strides of the codes (batch, seqlen, heads, head_dim).
    pub c_batch_stride: i64,
    pub c_row_stride: i64,
    pub c_head_stride: i64,
    pub c_dim_stride: i64,
    pub batch: i32,
    pub seqlen: i32,
    pub heads: i32,
    pub block_rows: i32,
    pub blocks: i32,
    pub flags: u32,
}

/// The pre-pass's parameters, mirrored from `Fp8PrepassParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrepassParams {
    pub op: [PrepassOperand; PREPASS_MAX_OPS],
    pub hadamard_seed: u64,
    pub head_dim: i32,
    pub n_ops: i32,
}

// The same numbers as the static_asserts of cuda/common/fp8_prepass_params.h.
assert_c_layout!(PrepassOperand, size 104, {
    x_batch_stride: 24,
    c_batch_stride: 48,
    batch: 80,
    flags: 100,
});
assert_c_layout!(PrepassParams, size 224, {
    hadamard_seed: 208,
    n_ops: 220,
});

impl PrepassParams {
    /// The struct's bytes as the kernel receives them (native endianness).
    pub fn to_bytes(&self) -> [u8; size_of::<PrepassParams>()] {
        let mut out = [0u8; size_of::<PrepassParams>()];
        let mut at = 0;
        let mut put = |b: &[u8]| {
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        for o in &self.op {
            for x in [o.x, o.codes, o.scales] {
                put(&x.to_ne_bytes());
            }
            for x in [
                o.x_batch_stride,
                o.x_row_stride,
                o.x_head_stride,
                o.c_batch_stride,
                o.c_row_stride,
                o.c_head_stride,
                o.c_dim_stride,
            ] {
                put(&x.to_ne_bytes());
            }
            for x in [o.batch, o.seqlen, o.heads, o.block_rows, o.blocks] {
                put(&x.to_ne_bytes());
            }
            put(&o.flags.to_ne_bytes());
        }
        put(&self.hadamard_seed.to_ne_bytes());
        put(&self.head_dim.to_ne_bytes());
        put(&self.n_ops.to_ne_bytes());
        debug_assert_eq!(at, out.len());
        out
    }
}

/// Where one operand of the pre-pass lives and where its codes and scales go.
#[derive(Clone, Copy, Debug)]
pub struct PrepassInput {
    /// `[batch, seqlen, heads, head_dim]`.
    pub shape: [usize; 4],
    /// Device address of the bf16/f16 input and its element strides (batch, seqlen, heads).
    pub x: u64,
    pub x_strides: [usize; 3],
    /// Device address of the codes and their byte strides (batch, seqlen, heads, head_dim):
    /// `[b, s, h, d]` contiguous for Q and K, `[b, h, d, s_pad]` (Vᵀ) for the consumer's V.
    pub codes: u64,
    pub code_strides: [usize; 4],
    /// Device address of the f32 scales, `[batch, heads, blocks]`.
    pub scales: u64,
    /// Rotate the rows (Q and K; the seed is the launch's).
    pub rotate: bool,
}

/// One pre-pass launch.
#[derive(Clone, Debug)]
pub struct PrepassLaunch {
    /// `fa_fp8_prepass_e<E>_<dtype>`, E = elements per lane (head_dim <= 32·E).
    pub kernel: String,
    pub grid: u32,
    pub block: u32,
    pub params: PrepassParams,
    /// Scale blocks per operand (`ceil(seqlen / block_rows)`).
    pub blocks: Vec<usize>,
}

pub(super) fn option_error(option: &'static str, got: String, expected: &str) -> Error {
    Error::InvalidOption { option, got, expected: expected.into() }
}

pub(super) fn dtype_suffix(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        other => Err(Error::UnsupportedDType {
            dtype: other,
            backend: "the FP8 pre-pass".into(),
            supported: "f16, bf16".into(),
        }),
    }
}

pub(super) fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::TooLarge { what: format!("{what} = {x} (the FP8 kernels take i32)") })
}

pub(super) fn to_i64(x: usize, what: &str) -> Result<i64> {
    i64::try_from(x).map_err(|_| Error::TooLarge { what: format!("{what} = {x}") })
}

/// The pre-pass launch quantising `ops` (one or two operands of one head_dim) with `scaling`,
/// rotating those marked `rotate` by the Hadamard transform of seed `hadamard`.
///
/// # Errors
/// [`Error::InvalidOption`] for no or more than two operands, different head dims, a rotated
/// operand without a seed or with a head_dim that is not a power of two;
/// [`Error::UnsupportedHeadDim`] above 256; [`Error::UnsupportedDType`] for inputs other than
/// f16/bf16; [`Error::TooLarge`] for sizes past i32 / i64.
pub fn prepass_plan(
    dtype: DType,
    scaling: Fp8Scaling,
    hadamard: Option<u64>,
    ops: &[PrepassInput],
) -> Result<PrepassLaunch> {
    if ops.is_empty() || ops.len() > PREPASS_MAX_OPS {
        return Err(option_error("FP8 pre-pass operands", ops.len().to_string(), "1 or 2"));
    }
    let d = ops[0].shape[3];
    if ops.iter().any(|o| o.shape[3] != d) {
        return Err(option_error(
            "FP8 pre-pass head dims",
            format!("{:?}", ops.iter().map(|o| o.shape[3]).collect::<Vec<_>>()),
            "one head_dim",
        ));
    }
    if d == 0 || d > 256 {
        return Err(Error::UnsupportedHeadDim {
            head_dim: d,
            backend: "the FP8 pre-pass".into(),
            supported: "1..=256".into(),
        });
    }
    if ops.iter().any(|o| o.rotate) && (hadamard.is_none() || !d.is_power_of_two()) {
        return Err(option_error(
            "hadamard",
            format!("{hadamard:?} at head_dim {d}"),
            "a seed and a power-of-two head_dim",
        ));
    }
    let suffix = dtype_suffix(dtype)?;
    let mut params = PrepassParams {
        hadamard_seed: hadamard.unwrap_or(0),
        head_dim: to_i32(d, "head_dim")?,
        n_ops: ops.len() as i32,
        ..Default::default()
    };
    let mut items = 0usize;
    let mut blocks = Vec::new();
    for (slot, o) in params.op.iter_mut().zip(ops) {
        let [b, s, h, _] = o.shape;
        let rows = block_rows(scaling, s);
        let n_blocks = s.div_ceil(rows);
        let item_count = b.checked_mul(h).and_then(|x| x.checked_mul(n_blocks));
        items = item_count
            .and_then(|n| items.checked_add(n))
            .ok_or_else(|| Error::TooLarge { what: format!("FP8 pre-pass work items of shape {:?}", o.shape) })?;
        blocks.push(n_blocks);
        *slot = PrepassOperand {
            x: o.x,
            codes: o.codes,
            scales: o.scales,
            x_batch_stride: to_i64(o.x_strides[0], "input batch stride")?,
            x_row_stride: to_i64(o.x_strides[1], "input row stride")?,
            x_head_stride: to_i64(o.x_strides[2], "input head stride")?,
            c_batch_stride: to_i64(o.code_strides[0], "codes batch stride")?,
            c_row_stride: to_i64(o.code_strides[1], "codes row stride")?,
            c_head_stride: to_i64(o.code_strides[2], "codes head stride")?,
            c_dim_stride: to_i64(o.code_strides[3], "codes head_dim stride")?,
            batch: to_i32(b, "batch")?,
            seqlen: to_i32(s, "seqlen")?,
            heads: to_i32(h, "heads")?,
            block_rows: to_i32(rows, "FP8 block rows")?,
            blocks: to_i32(n_blocks, "FP8 blocks")?,
            flags: if o.rotate { PREPASS_ROTATE } else { 0 },
        };
    }
    let grid = u32::try_from(items.div_ceil(PREPASS_WARPS as usize))
        .map_err(|_| Error::TooLarge { what: format!("FP8 pre-pass grid of {items} work items") })?;
    let e = d.div_ceil(32).next_power_of_two();
    Ok(PrepassLaunch {
        kernel: format!("fa_fp8_prepass_e{e}_{suffix}"),
        grid,
        block: PREPASS_WARPS * 32,
        params,
        blocks,
    })
}

//! The Hopper FP8 forward's launches as data (docs/fp8.md, "On Hopper"): the pre-pass
//! (`cuda/fp8_prepass.cu`: bf16/f16 -> e4m3 codes + per-block scales, Q and K rotated) and the FP8
//! consumer (`cuda/fa3_fp8_fwd_sm90.cu`). The CPU emulator runs exactly these launches
//! (tests/fp8_emulator.rs). The stage 3-5 consumers at head_dim 64, 128 and 256, each with the
//! pre-pass of its head_dim in its image, are the table rows "fa3fp8s3".."fa3fp8s5"
//! (build/instances.rs), whose host rules are `Fp8` here: `select` picks them for `Precision::Fp8`
//! problems on sm_90a.

use super::fa3::tma::persistent_grid;
use super::family::{chunked_rows_refusal, tile_grid, FamilyHost, Grid, LayoutRefusal};
use super::launch::TensorMaps;
use super::launch::{
    TensorMapArgs, TmaSpec, TMA_DTYPE_UINT8, TMA_INTERLEAVE_NONE, TMA_L2_PROMOTION_256B, TMA_OOB_FILL_NONE, TMA_RANK,
    TMA_SWIZZLE_128B, TMA_SWIZZLE_64B,
};
use super::params::{FwdParams, Operands};
use super::table::{Family, Tile};
use crate::error::{Error, Operand, Result};
use crate::numerics::quant::block_rows;
use crate::options::{Fp8Scaling, Precision};
use crate::problem::Problem;
use crate::DType;
use std::mem::{offset_of, size_of};

/// Warps per CTA of the pre-pass (FA_FP8_PREPASS_WARPS); each quantises one scale block.
pub const PREPASS_WARPS: u32 = 4;
/// Operands one pre-pass launch carries (FA_FP8_PREPASS_MAX_OPS): Q and K, or V.
pub const PREPASS_MAX_OPS: usize = 2;
/// `PrepassOperand::flags`: rotate rows by the seeded Hadamard transform (FA_FP8_ROTATE).
pub const PREPASS_ROTATE: u32 = 1;

/// The head dims the consumer is instantiated for (`Fp8Traits<S, D>`, cuda/fa3_fp8_fwd_sm90.cu).
pub const CONSUMER_HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Stages 1-2: one warpgroup of 64 query rows per CTA.
pub const CONSUMER_BLOCK_M: usize = 64;
pub const CONSUMER_THREADS: u32 = 128;
/// Stages 3-5: a producer warpgroup and two consumer warpgroups, 128 query rows per CTA.
pub const CONSUMER_S3_THREADS: u32 = 384;
pub const CONSUMER_S3_BLOCK_M: usize = 128;

/// Keys per K/Vᵀ tile at `head_dim` (`Fp8Traits::kBlockN`): 128, or 64 at head_dim 256, where
/// O's 128 f32 registers beside a 128-key S spill at 240 registers (docs/fp8.md).
pub const fn consumer_block_n(head_dim: usize) -> usize {
    if head_dim == 256 {
        64
    } else {
        128
    }
}

/// Bytes of a swizzle row of an e4m3 K-major operand whose reduction extent is `k_bytes`: 128,
/// or 64 for 64-byte rows (Q and K at head_dim 64, Vᵀ with 64-key tiles); the TMA box's inner
/// extent is one swizzle row.
pub const fn consumer_swizzle_bytes(k_bytes: usize) -> usize {
    if k_bytes < 128 {
        k_bytes
    } else {
        128
    }
}

/// `Fp8Traits<stage, head_dim>::kSmemBytes`: e4m3 Q of the CTA's rows, the K / Vᵀ ring (one slot
/// at stage 1, two from stage 2), the mbarriers (stages 2-3: q_full, kv_full and kv_empty per
/// slot; stages 4-5: q_full, k_full, v_full, k_empty, v_empty per slot, q_empty) and one
/// 1024-byte swizzle atom of alignment slack.
pub const fn consumer_smem_bytes(stage: u32, head_dim: usize) -> u32 {
    let block_m = if stage >= 3 { CONSUMER_S3_BLOCK_M } else { CONSUMER_BLOCK_M };
    let slots = if stage >= 2 { 2 } else { 1 };
    let barriers = if stage >= 4 {
        2 + 4 * slots
    } else if stage >= 2 {
        1 + 2 * slots
    } else {
        0
    };
    (block_m * head_dim + 2 * slots * consumer_block_n(head_dim) * head_dim + 8 * barriers + 1024) as u32
}
/// The highest stage of the FP8 consumer (docs/fp8.md): the top row of the FP8 ladder.
pub const CONSUMER_MAX_STAGE: u32 = 5;

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
const _: () = {
    assert!(size_of::<PrepassOperand>() == 104);
    assert!(offset_of!(PrepassOperand, x_batch_stride) == 24);
    assert!(offset_of!(PrepassOperand, c_batch_stride) == 48);
    assert!(offset_of!(PrepassOperand, batch) == 80);
    assert!(offset_of!(PrepassOperand, flags) == 100);
    assert!(size_of::<PrepassParams>() == 224);
    assert!(offset_of!(PrepassParams, hadamard_seed) == 208);
    assert!(offset_of!(PrepassParams, n_ops) == 220);
};

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

fn option_error(option: &'static str, got: String, expected: &str) -> Error {
    Error::InvalidOption { option, got, expected: expected.into() }
}

fn dtype_suffix(dtype: DType) -> Result<&'static str> {
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

fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::TooLarge { what: format!("{what} = {x} (the FP8 kernels take i32)") })
}

fn to_i64(x: usize, what: &str) -> Result<i64> {
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

/// Where the FP8 consumer's operands live.
#[derive(Clone, Copy, Debug)]
pub struct ConsumerOperands {
    /// e4m3 codes of Q and K, `[b, s, h, d]`, byte strides (batch, seqlen, heads).
    pub q: u64,
    pub q_strides: [usize; 3],
    pub k: u64,
    pub k_strides: [usize; 3],
    /// e4m3 codes of Vᵀ, `[b, h_kv, d, keys]`: byte strides (batch, head_dim row, head).
    pub vt: u64,
    pub vt_strides: [usize; 3],
    /// The bf16/f16 output, element strides (batch, seqlen, heads); LSE buffer or 0.
    pub o: u64,
    pub o_strides: [usize; 3],
    pub lse: u64,
    /// f32 descales of Q, K, V: `[batch, heads, blocks]` (one block per (batch, head) with
    /// `Fp8Scaling::PerTensor`: FA3's per-(batch, kv-head) layout for K and V).
    pub descales: [u64; 3],
}

/// One launch of the FP8 consumer.
#[derive(Clone, Debug)]
pub struct ConsumerLaunch {
    /// `fa3fp8s<stage>_fwd_hd<head_dim>_<output dtype>`.
    pub kernel: String,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem_bytes: u32,
    pub params: FwdParams,
    /// Stages 2-3: the maps of Q, K and Vᵀ (`cuTensorMapEncodeTiled` arguments), else empty.
    pub tensor_maps: Vec<TensorMapArgs>,
}

/// A UINT8 4-D map of `dims` (innermost first) with byte strides of dims 1..4, swizzled by the
/// box's inner extent (128 or 64 bytes: one swizzle row).
fn u8_map(global_address: u64, dims: [usize; 4], strides: [usize; 3], box_dims: [u32; 4]) -> TensorMapArgs {
    let swizzle = if box_dims[0] == 64 { TMA_SWIZZLE_64B } else { TMA_SWIZZLE_128B };
    TensorMapArgs {
        global_address,
        spec: TmaSpec {
            data_type: TMA_DTYPE_UINT8,
            rank: TMA_RANK,
            dims: dims.map(|x| x as u64),
            strides: strides.map(|x| x as u64),
            box_dims,
            elem_strides: [1; 4],
            interleave: TMA_INTERLEAVE_NONE,
            swizzle,
            l2_promotion: TMA_L2_PROMOTION_256B,
            oob_fill: TMA_OOB_FILL_NONE,
        },
    }
}

/// The launch of the FP8 consumer's `stage` (1: plain loads; 2: + TMA ring; 3: + warp
/// specialisation; 4: + ping-pong and intra-warpgroup overlap; 5: + the persistent grid of
/// min(`sm_count`, tiles) CTAs, docs/fp8.md) for problem `p` (its precision must be
/// `Precision::Fp8`) on `ops`. `sm_count` matters to stage 5 only.
///
/// # Errors
/// [`Error::InvalidOption`] for a stage other than 1 to 5, when `p` is not an FP8 problem, asks
/// for ALiBi, or has a block size
/// that is not a multiple of 64 rows; [`Error::UnsupportedHeadDim`] for head dims other than
/// 64, 128, 256; [`Error::UnsupportedDType`]; [`Error::InvalidLayout`] for strides or addresses that are
/// not multiples of 16 bytes (the consumer's 16-byte loads); [`Error::TooLarge`].
pub fn consumer_plan(p: &Problem, ops: &ConsumerOperands, stage: u32, sm_count: u32) -> Result<ConsumerLaunch> {
    if !(1..=CONSUMER_MAX_STAGE).contains(&stage) {
        return Err(option_error("FP8 consumer stage", stage.to_string(), "1 to 5"));
    }
    let Precision::Fp8 { scaling, .. } = p.precision else {
        return Err(option_error("precision", format!("{:?}", p.precision), "Precision::Fp8 for the FP8 consumer"));
    };
    let descale_block = match scaling {
        Fp8Scaling::PerTensor => 0,
        Fp8Scaling::PerBlock { rows } if rows > 0 && rows % 64 == 0 => to_i32(rows, "FP8 block rows")?,
        other => {
            return Err(option_error(
                "Fp8Scaling",
                format!("{other:?}"),
                "PerTensor or PerBlock with a multiple of 64 rows",
            ))
        }
    };
    if p.alibi.is_some() {
        return Err(option_error("alibi", "slopes".into(), "none with the FP8 consumer"));
    }
    if !CONSUMER_HEAD_DIMS.contains(&p.head_dim) {
        return Err(Error::UnsupportedHeadDim {
            head_dim: p.head_dim,
            backend: "the FP8 consumer".into(),
            supported: "64, 128, 256".into(),
        });
    }
    let suffix = dtype_suffix(p.dtype)?;
    let aligned = |operand: Operand, addr: u64, strides: &[usize], unit: usize| -> Result<()> {
        if !addr.is_multiple_of(16) || strides.iter().any(|s| !(s * unit).is_multiple_of(16)) {
            return Err(Error::InvalidLayout {
                operand,
                reason: format!("address {addr:#x} and strides {strides:?} must be multiples of 16 bytes"),
            });
        }
        Ok(())
    };
    aligned(Operand::Q, ops.q, &ops.q_strides, 1)?;
    aligned(Operand::K, ops.k, &ops.k_strides, 1)?;
    aligned(Operand::V, ops.vt, &ops.vt_strides, 1)?;
    for x in [p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv] {
        to_i32(x, "a dimension")?;
    }
    let operands = Operands {
        ptrs: [ops.q, ops.k, ops.vt, ops.o],
        strides: [ops.q_strides, ops.k_strides, ops.vt_strides, ops.o_strides],
        lse: ops.lse,
        alibi: 0,
    };
    let mut params = FwdParams::for_launch(p, &operands);
    [params.q_descale, params.k_descale, params.v_descale] = ops.descales;
    params.descale_block = descale_block;
    let block_m = if stage >= 3 { CONSUMER_S3_BLOCK_M } else { CONSUMER_BLOCK_M };
    to_i32(p.seqlen_q.div_ceil(block_m), "query tiles")?;
    let grid = if stage >= 5 {
        persistent_grid(block_m as u32, &params, sm_count)
    } else {
        tile_grid(block_m as u32, &params)
    };
    let tensor_maps = if stage >= 2 { consumer_maps(&params).to_vec() } else { Vec::new() };
    Ok(ConsumerLaunch {
        kernel: format!("fa3fp8s{stage}_fwd_hd{}_{suffix}", p.head_dim),
        grid,
        block: if stage >= 3 { CONSUMER_S3_THREADS } else { CONSUMER_THREADS },
        smem_bytes: consumer_smem_bytes(stage, p.head_dim),
        params,
        tensor_maps,
    })
}

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
/// As [`prepass_plan`] and [`consumer_plan`].
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

/// The consumer's tensor maps (stages 2-3) from its launch parameters: UINT8 maps of the Q and K
/// codes (`[b, s, h, d]`, byte strides) and of Vᵀ (`[b, h_kv, d, keys]`: `v_row_stride` is the
/// stride between head_dim rows). The Q box is 64 rows (one consumer warpgroup's).
fn consumer_maps(p: &FwdParams) -> [TensorMapArgs; 3] {
    let u = |x: i32| x as usize;
    let s = |x: i64| x as usize;
    let d = u(p.head_dim);
    let bn = consumer_block_n(d) as u32;
    let qk_box = consumer_swizzle_bytes(d) as u32;
    [
        u8_map(
            p.q,
            [d, u(p.heads_q), u(p.seqlen_q), u(p.batch)],
            [s(p.q_head_stride), s(p.q_row_stride), s(p.q_batch_stride)],
            [qk_box, 1, CONSUMER_BLOCK_M as u32, 1],
        ),
        u8_map(
            p.k,
            [d, u(p.heads_kv), u(p.seqlen_k), u(p.batch)],
            [s(p.k_head_stride), s(p.k_row_stride), s(p.k_batch_stride)],
            [qk_box, 1, bn, 1],
        ),
        // Vᵀ: keys innermost (seqlen_k of them: the box's keys past it are zero-filled).
        u8_map(
            p.v,
            [u(p.seqlen_k), d, u(p.heads_kv), u(p.batch)],
            [s(p.v_row_stride), s(p.v_head_stride), s(p.v_batch_stride)],
            [bn, d as u32, 1, 1],
        ),
    ]
}

/// The consumer's `FwdParams` for `p` on `ops` (the same at every stage), checked as
/// [`consumer_plan`] checks them.
///
/// # Errors
/// As [`consumer_plan`].
pub fn consumer_params(p: &Problem, ops: &ConsumerOperands) -> Result<FwdParams> {
    Ok(consumer_plan(p, ops, CONSUMER_MAX_STAGE, 1)?.params)
}

/// The host rules of the FP8 rows ("fa3fp8s3".."fa3fp8s5"): the problems the consumer runs, the
/// layout of the bf16/f16 inputs the pre-pass reads, stage 5's persistent grid, and the
/// consumer's tensor maps (over the e4m3 codes its `FwdParams` point at).
#[derive(Debug)]
pub(crate) struct Fp8;

/// Why the FP8 consumer cannot run `p` (the same rules `consumer_plan` reports as typed errors).
pub(crate) fn problem_refusal(p: &Problem) -> Option<&'static str> {
    let Precision::Fp8 { scaling, .. } = p.precision else {
        return Some("runs only Precision::Fp8 problems");
    };
    if !matches!(scaling, Fp8Scaling::PerTensor)
        && !matches!(scaling, Fp8Scaling::PerBlock { rows } if rows > 0 && rows % 64 == 0)
    {
        return Some(
            "needs Fp8Scaling::PerTensor or PerBlock with a multiple of 64 rows (a V scale per 64-key half tile)",
        );
    }
    if p.alibi.is_some() {
        return Some("has no ALiBi (as the 16-bit FA3 kernels)");
    }
    (!CONSUMER_HEAD_DIMS.contains(&p.head_dim))
        .then_some("runs head_dim 64, 128 or 256 only (the FP8 consumer's instances)")
}

impl FamilyHost for Fp8 {
    fn refusal(&self, _fam: &Family, _tile: &Tile, p: &Problem) -> Option<&'static str> {
        problem_refusal(p)
    }

    /// The pre-pass reads the caller's bf16/f16 rows in 16-byte chunks.
    fn layout_refusal(&self, ops: &Operands) -> Option<LayoutRefusal> {
        chunked_rows_refusal(ops)
    }

    /// Stage 5: min(SMs, tiles) CTAs walking every (query tile, head, batch); else one CTA per tile.
    fn grid(&self, fam: &Family, tile: &Tile, params: &FwdParams, sm_count: u32) -> Grid {
        if fam.stage.unwrap_or(3) >= 5 {
            persistent_grid(tile.block_m, params, sm_count)
        } else {
            tile_grid(tile.block_m, params)
        }
    }

    /// Over the e4m3 codes: the launch's `FwdParams` point at the pre-pass's outputs.
    fn tensor_maps(&self, _fam: &Family, _dtype: DType, params: &FwdParams) -> Result<TensorMaps> {
        let [q, k, v] = consumer_maps(params);
        Ok(TensorMaps::new([q.spec, k.spec, v.spec], [q.global_address, k.global_address, v.global_address]))
    }
}

#[cfg(test)]
mod tests {
    use super::super::table::{fp8_prepass_symbol, image_kernel_symbols, KernelOptions, FAMILIES};
    use super::*;
    use crate::options::ForwardOptions;

    fn row() -> &'static Family {
        rows().last().copied().expect("the FP8 rows")
    }

    fn rows() -> Vec<&'static Family> {
        FAMILIES.iter().filter(|f| f.options.contains(KernelOptions::FP8)).collect()
    }

    /// The table rows and the launch plans' constants (the consumer's `Fp8Traits<S, D>`) agree.
    #[test]
    fn table_rows_match_the_consumer() {
        let rows = rows();
        assert_eq!(rows.iter().map(|f| (f.name, f.stage)).collect::<Vec<_>>(), [
            ("fa3fp8s3", Some(3)),
            ("fa3fp8s4", Some(4)),
            ("fa3fp8s5", Some(5))
        ]);
        assert_eq!(row().stage, Some(CONSUMER_MAX_STAGE as u8), "the top row is the highest stage");
        for f in rows {
            assert_eq!((f.source, f.min_sm), ("cuda/fa3_fp8_fwd_sm90.cu", 90));
            assert!(!f.auto && !f.gpu_verified, "never ran on a GPU");
            assert_eq!(f.tiles.iter().map(|t| t.head_dim as usize).collect::<Vec<_>>(), CONSUMER_HEAD_DIMS);
            let stage = f.stage.unwrap() as u32;
            for t in f.tiles {
                let d = t.head_dim as usize;
                assert_eq!(
                    (t.block_m as usize, t.block_n as usize, t.threads, f.smem_bytes(t)),
                    (CONSUMER_S3_BLOCK_M, consumer_block_n(d), CONSUMER_S3_THREADS, consumer_smem_bytes(stage, d))
                );
                assert_eq!(
                    image_kernel_symbols(f, t.head_dim, "bf16"),
                    [format!("{}_fwd_hd{d}_bf16", f.name), fp8_prepass_symbol(t.head_dim, "bf16")]
                );
            }
            assert!(f.sass_expect.contains(&"QGMMA"));
            assert_eq!(image_kernel_symbols(f, 128, "bf16")[1], "fa_fp8_prepass_e4_bf16");
        }
        for d in [1, 32, 33, 64, 96, 128, 256] {
            let p = |x: u64| PrepassInput {
                shape: [1, 1, 1, d],
                x,
                x_strides: [d, d, d],
                codes: x,
                code_strides: [d, d, d, 1],
                scales: x,
                rotate: false,
            };
            let plan = prepass_plan(DType::F16, Fp8Scaling::PerTensor, None, &[p(0)]).unwrap();
            assert_eq!(plan.kernel, fp8_prepass_symbol(d as u32, "f16"), "head_dim {d}");
        }
    }

    fn problem(head_dim: usize, opts: &ForwardOptions) -> Problem {
        Problem::from_shapes([1, 100, 4, head_dim], [1, 90, 2, head_dim], [1, 90, 2, head_dim], DType::BF16, opts)
            .unwrap()
    }

    #[test]
    fn refusals() {
        let fp8 = |scaling| ForwardOptions::default().precision(Precision::Fp8 { scaling, hadamard: Some(7) });
        let block = Fp8Scaling::PerBlock { rows: 128 };
        assert_eq!(problem_refusal(&problem(128, &fp8(block))), None);
        assert_eq!(problem_refusal(&problem(128, &fp8(Fp8Scaling::PerTensor))), None);
        assert!(problem_refusal(&problem(128, &ForwardOptions::default())).unwrap().contains("Precision::Fp8"));
        for d in [64, 256] {
            assert_eq!(problem_refusal(&problem(d, &fp8(block))), None, "head_dim {d}");
        }
        let unrotated = ForwardOptions::default().precision(Precision::Fp8 { scaling: block, hadamard: None });
        assert!(problem_refusal(&problem(96, &unrotated)).unwrap().contains("head_dim 64, 128 or 256"));
        assert!(problem_refusal(&problem(128, &fp8(Fp8Scaling::PerBlock { rows: 32 }))).unwrap().contains("64 rows"));
        let alibi = fp8(block).alibi_slopes(vec![0.5; 4]);
        assert!(problem_refusal(&problem(128, &alibi)).unwrap().contains("ALiBi"));
    }

    /// The host's maps and grids are the consumer plan's (stages 3-5), so `Engine` and the emulator agree.
    #[test]
    fn host_maps_are_the_plans() {
        let opts =
            ForwardOptions::default().precision(Precision::Fp8 { scaling: Fp8Scaling::PerTensor, hadamard: None });
        let p = problem(128, &opts);
        let ops = ConsumerOperands {
            q: 0x1000,
            q_strides: [100 * 4 * 128, 4 * 128, 128],
            k: 0x10_0000,
            k_strides: [90 * 2 * 128, 2 * 128, 128],
            vt: 0x20_0000,
            vt_strides: [2 * 128 * 96, 96, 128 * 96],
            o: 0x30_0000,
            o_strides: [100 * 4 * 128, 4 * 128, 128],
            lse: 0,
            descales: [0x40_0000, 0x50_0000, 0x60_0000],
        };
        for f in rows() {
            let stage = f.stage.unwrap() as u32;
            let plan = consumer_plan(&p, &ops, stage, 132).unwrap();
            let maps = Fp8.tensor_maps(f, DType::BF16, &plan.params).unwrap();
            assert_eq!(&maps[..], &plan.tensor_maps[..]);
            assert_eq!(plan.kernel, crate::cuda::table::kernel_symbol(f.name, 128, "bf16"));
            // The grid the engine launches (the row's host) is the plan's: stage 5 persistent.
            assert_eq!(Fp8.grid(f, &f.tiles[0], &plan.params, 132), plan.grid, "{}", f.name);
        }
        // q [1, 100, 4, 128]: 4 tiles of 128 rows; stage 5 runs min(SMs, tiles) CTAs.
        assert_eq!(consumer_plan(&p, &ops, 4, 132).unwrap().grid, (1, 4, 1));
        assert_eq!(consumer_plan(&p, &ops, 5, 132).unwrap().grid, (4, 1, 1));
        assert_eq!(consumer_plan(&p, &ops, 5, 3).unwrap().grid, (3, 1, 1));
        assert!(consumer_plan(&p, &ops, 6, 132).is_err());
    }

    /// The engine's three launches: scratch regions disjoint and 256-byte aligned, the pre-pass
    /// reading the caller's tensors and writing the regions the consumer reads, Vᵀ padded.
    #[test]
    fn forward_plans_wire_the_prepass_into_the_consumer() {
        let opts = ForwardOptions::default()
            .precision(Precision::Fp8 { scaling: Fp8Scaling::PerBlock { rows: 64 }, hadamard: Some(9) })
            .return_lse(true);
        let p = problem(128, &opts); // q [1, 100, 4, 128], k/v [1, 90, 2, 128]
        let l = Fp8Scratch::of(&p).unwrap();
        assert_eq!(l.keys_pad, 96);
        let regions = [
            (l.q, 100 * 4 * 128),
            (l.k, 90 * 2 * 128),
            (l.vt, 2 * 128 * 96),
            (l.scales[0], 4 * 2 * 4),
            (l.scales[1], 2 * 2 * 4),
            (l.scales[2], 2 * 2 * 4),
        ];
        for w in regions.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0 && w[1].0 % 256 == 0, "{regions:?}");
        }
        assert!(l.scales[2] + 16 <= l.bytes);
        let contiguous = |s: usize, h: usize| [s * h * 128, h * 128, 128];
        let ops = Operands {
            ptrs: [0x10_0000, 0x20_0000, 0x30_0000, 0x40_0000],
            strides: [contiguous(100, 4), contiguous(90, 2), contiguous(90, 2), contiguous(100, 4)],
            lse: 0x50_0000,
            alibi: 0,
        };
        let base = 0x100_0000u64;
        let (qk, v, params) = forward_plans(&p, &ops, base, &l).unwrap();
        assert_eq!((qk.kernel.as_str(), qk.params.n_ops, v.params.n_ops), ("fa_fp8_prepass_e4_bf16", 2, 1));
        let [oq, ok] = qk.params.op;
        assert_eq!((oq.x, oq.codes, oq.scales, oq.flags), (0x10_0000, base + l.q as u64, base + l.scales[0] as u64, 1));
        assert_eq!((ok.x, ok.codes, ok.flags), (0x20_0000, base + l.k as u64, 1));
        assert_eq!(qk.params.hadamard_seed, 9);
        let ov = v.params.op[0];
        assert_eq!((ov.x, ov.codes, ov.flags), (0x30_0000, base + l.vt as u64, 0));
        assert_eq!(
            (ov.c_batch_stride, ov.c_row_stride, ov.c_head_stride, ov.c_dim_stride),
            (2 * 128 * 96, 1, 128 * 96, 96)
        );
        assert_eq!(
            (params.q, params.k, params.v, params.o, params.lse),
            (oq.codes, ok.codes, ov.codes, 0x40_0000, 0x50_0000)
        );
        assert_eq!(
            (params.q_descale, params.k_descale, params.v_descale, params.descale_block),
            (oq.scales, ok.scales, ov.scales, 64)
        );
        assert_eq!((params.v_row_stride, params.v_head_stride), (96, 128 * 96));
        // Not an FP8 problem: typed refusals.
        let plain = problem(128, &ForwardOptions::default());
        assert!(matches!(Fp8Scratch::of(&plain), Err(Error::InvalidOption { .. })));
        assert!(matches!(forward_plans(&plain, &ops, base, &l), Err(Error::InvalidOption { .. })));
    }
}

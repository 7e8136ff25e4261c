//! The FP8 consumer as data (`cuda/fa3_fp8_fwd_sm90.cu`): its tiles and shared memory per stage
//! and head dim, its `FwdParams` over the e4m3 codes, and its UINT8 tensor maps.

use super::prepass::{dtype_suffix, option_error, to_i32};
use crate::cuda::fa3::tma::persistent_grid;
use crate::cuda::family::tile_grid;
use crate::cuda::launch::{
    TensorMapArgs, TmaSpec, TMA_DTYPE_UINT8, TMA_INTERLEAVE_NONE, TMA_L2_PROMOTION_256B, TMA_OOB_FILL_NONE, TMA_RANK,
    TMA_SWIZZLE_128B, TMA_SWIZZLE_64B,
};
use crate::cuda::params::{FwdParams, Operands};
use crate::error::{Error, Operand, Result};
use crate::options::{Fp8Scaling, Precision};
use crate::problem::Problem;

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
pub(super) fn u8_map(global_address: u64, dims: [usize; 4], strides: [usize; 3], box_dims: [u32; 4]) -> TensorMapArgs {
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
        sinks: 0,
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

/// The consumer's tensor maps (stages 2-3) from its launch parameters: UINT8 maps of the Q and K
/// codes (`[b, s, h, d]`, byte strides) and of Vᵀ (`[b, h_kv, d, keys]`: `v_row_stride` is the
/// stride between head_dim rows). The Q box is 64 rows (one consumer warpgroup's).
pub(super) fn consumer_maps(p: &FwdParams) -> [TensorMapArgs; 3] {
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

//! TMA and geometry of the FA3-style sm_90a kernels (`cuda/fa3_fwd_sm90.cu`), as data: the
//! launch geometry of each (stage, head_dim) instance as `Fa3Traits` computes it (a test pins
//! the table rows of build/instances.rs to it, another pins it to the numbers the C++ traits
//! print), the persistent grid, and the `cuTensorMapEncodeTiled` arguments of the three TMA
//! tensor maps stages 2-5 take after `FwdParams` (docs/fa3.md). `launch.rs` encodes them.

use crate::cuda::launch::{
    TmaSpec, TMA_DTYPE_BFLOAT16, TMA_DTYPE_FLOAT16, TMA_DTYPE_UINT8, TMA_INTERLEAVE_NONE, TMA_L2_PROMOTION_256B, TMA_OOB_FILL_NONE, TMA_RANK,
    TMA_SWIZZLE_128B,
};
use crate::cuda::params::FwdParams;
use crate::cuda::table::{fa3_head_dim_v, FA3_MLA_PREFILL};
use crate::error::{Error, Operand, Result};
use crate::tensor::DType;

/// Stages with an instance in `cuda/fa3_fwd_sm90.cu` (1 = wgmma only, 2 = + TMA/mbarrier ring,
/// 3 = + warp specialisation, 4 = + ping-pong and intra-warpgroup overlap, 5 = + persistent
/// tile scheduler).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const FA3_STAGES: [u8; 5] = [1, 2, 3, 4, 5];
/// Head dims with an instance at every stage.
pub(crate) const FA3_HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// The stage with DeepSeek MLA prefill's (192, 128) instance (`FA3_MLA_PREFILL`, V head_dim 128).
pub(crate) const FA3_MLA_STAGE: u8 = 5;

/// Threads in one warpgroup (4 warps issue a wgmma together).
const WARPGROUP_THREADS: u32 = 128;
/// Query rows per consumer warpgroup (the M of wgmma m64nNk16).
const ROWS_PER_WARPGROUP: u32 = 64;
/// 16-bit elements per 128-byte swizzle row: the TMA box's inner extent.
const SLAB_COLS: u32 = 64;
/// Slack so the kernel can round its dynamic shared memory base up to a 1024-byte atom.
const SMEM_ALIGN_SLACK: u32 = 1024;
/// TMA limits (cuTensorMapEncodeTiled): strides multiple of 16 bytes and below 2^40, box
/// extents at most 256, global extents at most 2^32.
const TMA_STRIDE_ALIGN: u64 = 16;
const TMA_MAX_STRIDE: u64 = 1 << 40;
const TMA_MAX_BOX: u32 = 256;
const TMA_MAX_DIM: u64 = 1 << 32;

/// Launch geometry of one (stage, head_dim) instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fa3Geometry {
    /// Threads per CTA (block = (threads, 1, 1)).
    pub threads: u32,
    /// Query rows per CTA (grid.x = ceil(seqlen_q / block_m)).
    pub block_m: u32,
    /// Keys per K/V tile (the TMA box rows of K and V).
    pub block_n: u32,
    /// K/V ring slots.
    pub kv_stages: u32,
    /// Dynamic shared memory to request (and to set as MAX_DYNAMIC_SHARED_SIZE_BYTES).
    pub smem_bytes: u32,
}

/// Same arithmetic as `Fa3Traits<Stage, HeadDim, HeadDimV>` (V's head dim: `fa3_head_dim_v`, 128
/// for the Q/K head dim 192 of stage 5); `None` for a pair without an instance.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn geometry(stage: u8, head_dim: usize) -> Option<Fa3Geometry> {
    let mla = stage == FA3_MLA_STAGE && head_dim == FA3_MLA_PREFILL.0 as usize;
    if !FA3_STAGES.contains(&stage) || !(FA3_HEAD_DIMS.contains(&head_dim) || mla) {
        return None;
    }
    let d = head_dim as u32;
    let dv = fa3_head_dim_v(d);
    let (consumers, producers) = if stage >= 3 { (2, 1) } else { (1, 0) };
    let block_m = ROWS_PER_WARPGROUP * consumers;
    let block_n = if dv <= 128 { 128 } else { 64 };
    let kv_stages = if stage >= 2 { 2 } else { 1 };
    let elem = 2; // bf16 / f16
    let q_bytes = block_m * d * elem;
    let kv_tile = block_n * (d + dv) * elem; // one K and one V tile
    // Stages 2-3: q_full, kv_full[S], kv_empty[S]. Stages 4-5: K and V apart (4 per slot)
    // plus q_empty.
    let barriers: u32 = 8 * if stage >= 4 {
        2 + 4 * kv_stages
    } else {
        1 + 2 * kv_stages
    };
    // An FP8 cache's per-key K and V scales, twice the ring's slots, in the instances that
    // serve the batch layouts (stages 3-5 at V head_dim <= 128).
    let (barriers, scales) = if stage >= 3 && dv <= 128 {
        (barriers.next_multiple_of(16), 2 * kv_stages * 2 * block_n * 4) // scales from a 16-byte boundary
    } else {
        (barriers, 0)
    };
    let used = q_bytes + kv_stages * kv_tile + barriers + scales;
    Some(Fa3Geometry {
        threads: WARPGROUP_THREADS * (consumers + producers),
        block_m,
        block_n,
        kv_stages,
        smem_bytes: used + SMEM_ALIGN_SLACK,
    })
}

/// Grid of a persistent (stage-5) launch of `block_m`-row tiles: (min(SM count, tiles), 1, 1);
/// the CTAs stride over the `ceil(seqlen_q / block_m) * heads_q * batch` tiles.
pub(crate) fn persistent_grid(block_m: u32, p: &FwdParams, sm_count: u32) -> (u32, u32, u32) {
    let tiles = (p.seqlen_q as usize).div_ceil(block_m as usize) * p.heads_q as usize * p.batch as usize;
    (tiles.min(sm_count as usize).max(1) as u32, 1, 1)
}

/// Where one operand lives: `[batch, seqlen, heads, head_dim]` with element strides for batch,
/// seqlen and heads (head_dim contiguous), exactly as in `FwdParams`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OperandLayout {
    pub batch: usize,
    pub seqlen: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub batch_stride: usize,
    pub row_stride: usize,
    pub head_stride: usize,
}

/// One operand's spec with `box_rows`-row boxes (the FA3 stages' and the FA4 kernels', `fa4.rs`).
pub(crate) fn tma_spec(op: Operand, l: &OperandLayout, box_rows: u32, data_type: u32, elem_bytes: u64) -> Result<TmaSpec> {
    let bad = |reason: String| Error::InvalidLayout {
        operand: op,
        reason,
    };
    if !(l.head_dim as u32).is_multiple_of(SLAB_COLS) {
        return Err(bad(format!(
            "head_dim {} is not a multiple of {SLAB_COLS} (the 128-byte TMA box)",
            l.head_dim
        )));
    }
    if box_rows == 0 || box_rows > TMA_MAX_BOX {
        return Err(bad(format!(
            "TMA box of {box_rows} rows; expected 1..={TMA_MAX_BOX}"
        )));
    }
    let dims = [
        l.head_dim as u64,
        l.heads as u64,
        l.seqlen as u64,
        l.batch as u64,
    ];
    if let Some(d) = dims.iter().find(|&&d| d == 0 || d > TMA_MAX_DIM) {
        return Err(bad(format!("extent {d}; TMA needs 1..={TMA_MAX_DIM}")));
    }
    let strides = [
        l.head_stride as u64 * elem_bytes,
        l.row_stride as u64 * elem_bytes,
        l.batch_stride as u64 * elem_bytes,
    ];
    for (name, s) in ["head", "row", "batch"].iter().zip(strides) {
        if s % TMA_STRIDE_ALIGN != 0 || s >= TMA_MAX_STRIDE {
            return Err(bad(format!(
                "{name} stride of {s} bytes; TMA needs a multiple of {TMA_STRIDE_ALIGN} below 2^40"
            )));
        }
    }
    Ok(TmaSpec {
        data_type,
        rank: TMA_RANK,
        dims,
        strides,
        box_dims: [SLAB_COLS, 1, box_rows, 1],
        elem_strides: [1; 4],
        interleave: TMA_INTERLEAVE_NONE,
        swizzle: TMA_SWIZZLE_128B,
        l2_promotion: TMA_L2_PROMOTION_256B,
        oob_fill: TMA_OOB_FILL_NONE,
    })
}

/// Tensor-map specs for Q (box rows 64), K and V (box rows = the instance's block_n). With
/// `kv_codes` (an FP8 KV cache) K and V describe their e4m3 codes, one byte each: the kernels
/// gather and convert every tile of such a launch (`cuda/fa3/serving.cuh`), so no copy goes
/// through those two maps, but they still describe the memory they are given.
pub(crate) fn tma_specs(
    stage: u8,
    dtype: DType,
    kv_codes: bool,
    q: &OperandLayout,
    k: &OperandLayout,
    v: &OperandLayout,
) -> Result<[TmaSpec; 3]> {
    let g = geometry(stage, q.head_dim).ok_or_else(|| Error::UnsupportedHeadDim {
        head_dim: q.head_dim,
        backend: format!("cuda fa3 stage {stage}"),
        supported: format!("{FA3_HEAD_DIMS:?}"),
    })?;
    if dtype == DType::F32 {
        return Err(Error::UnsupportedDType {
            dtype,
            backend: "cuda fa3".into(),
            supported: "BF16, F16".into(),
        });
    }
    let e = dtype.size() as u64;
    let t = if dtype == DType::BF16 { TMA_DTYPE_BFLOAT16 } else { TMA_DTYPE_FLOAT16 };
    let (kv_t, kv_e) = if kv_codes { (TMA_DTYPE_UINT8, 1) } else { (t, e) };
    Ok([
        tma_spec(Operand::Q, q, ROWS_PER_WARPGROUP, t, e)?,
        tma_spec(Operand::K, k, g.block_n, kv_t, kv_e)?,
        tma_spec(Operand::V, v, g.block_n, kv_t, kv_e)?,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contiguous(batch: usize, seqlen: usize, heads: usize, head_dim: usize) -> OperandLayout {
        OperandLayout {
            batch,
            seqlen,
            heads,
            head_dim,
            batch_stride: seqlen * heads * head_dim,
            row_stride: heads * head_dim,
            head_stride: head_dim,
        }
    }

    #[test]
    fn geometry_matches_the_cuda_traits() {
        // (stage, hd) -> (threads, block_m, block_n, kv_stages, smem_bytes): the values
        // Fa3Traits<Stage, HeadDim> prints (host build of cuda/fa3/traits.cuh).
        let want = [
            (1, 64, 128, 64, 128, 1, 42008),
            (1, 128, 128, 64, 128, 1, 82968),
            (1, 256, 128, 64, 64, 1, 99352),
            (2, 64, 128, 64, 128, 2, 74792),
            (2, 128, 128, 64, 128, 2, 148520),
            (2, 256, 128, 64, 64, 2, 164904),
            (3, 64, 384, 128, 128, 2, 87088),
            (3, 128, 384, 128, 128, 2, 169008),
            (3, 256, 384, 128, 64, 2, 197672),
            (4, 64, 384, 128, 128, 2, 87120),
            (4, 128, 384, 128, 128, 2, 169040),
            (4, 256, 384, 128, 64, 2, 197712),
            (5, 64, 384, 128, 128, 2, 87120),
            (5, 128, 384, 128, 128, 2, 169040),
            (5, 256, 384, 128, 64, 2, 197712),
            // DeepSeek MLA prefill's (192, 128): 128-key tiles, K rows of 192 and V rows of 128.
            (5, 192, 384, 128, 128, 2, 218192),
        ];
        for (stage, hd, threads, block_m, block_n, kv_stages, smem_bytes) in want {
            let g = geometry(stage, hd).unwrap();
            assert_eq!(
                g,
                Fa3Geometry {
                    threads,
                    block_m,
                    block_n,
                    kv_stages,
                    smem_bytes
                },
                "stage {stage} hd {hd}"
            );
            assert!(g.smem_bytes <= 227 * 1024, "fits the sm_90 opt-in limit");
        }
        assert_eq!(geometry(6, 128), None);
        assert_eq!(geometry(2, 96), None);
        assert_eq!(geometry(4, 192), None);
    }

    #[test]
    fn persistent_grid_is_min_of_sms_and_tiles() {
        let p = FwdParams { batch: 2, seqlen_q: 1000, heads_q: 16, ..FwdParams::default() };
        assert_eq!(persistent_grid(128, &p, 132), (132, 1, 1)); // 256 tiles
        let p = FwdParams { batch: 1, seqlen_q: 100, heads_q: 2, ..FwdParams::default() };
        assert_eq!(persistent_grid(128, &p, 132), (2, 1, 1)); // 2 tiles
    }

    #[test]
    fn tma_specs_for_contiguous_gqa_bf16() {
        let q = contiguous(2, 1000, 16, 128);
        let kv = contiguous(2, 777, 4, 128);
        let [sq, sk, sv] = tma_specs(3, DType::BF16, false, &q, &kv, &kv).unwrap();
        assert_eq!(sq.dims, [128, 16, 1000, 2]);
        assert_eq!(sq.strides, [256, 16 * 128 * 2, 1000 * 16 * 128 * 2]);
        assert_eq!(sq.box_dims, [64, 1, 64, 1]);
        assert_eq!(sk.dims, [128, 4, 777, 2]);
        assert_eq!(sk.strides, [256, 4 * 128 * 2, 777 * 4 * 128 * 2]);
        assert_eq!(sk.box_dims, [64, 1, 128, 1]);
        assert_eq!(sv, sk);
        assert_eq!(sq.elem_strides, [1; 4]);
        // hd 256 tiles are 64 keys.
        let q = contiguous(1, 10, 2, 256);
        let [_, sk, _] = tma_specs(2, DType::F16, false, &q, &q, &q).unwrap();
        assert_eq!(sk.box_dims, [64, 1, 64, 1]);
        // (192, 128): 128-key boxes of both; V's extent and strides are its own head dim's.
        let (q, k, v) = (contiguous(1, 10, 4, 192), contiguous(1, 20, 2, 192), contiguous(1, 20, 2, 128));
        let [sq, sk, sv] = tma_specs(5, DType::BF16, false, &q, &k, &v).unwrap();
        assert_eq!((sq.dims, sk.dims, sv.dims), ([192, 4, 10, 1], [192, 2, 20, 1], [128, 2, 20, 1]));
        assert_eq!((sk.box_dims, sv.box_dims), ([64, 1, 128, 1], [64, 1, 128, 1]));
        assert_eq!(sv.strides, [256, 2 * 128 * 2, 20 * 2 * 128 * 2]);
        assert!(matches!(tma_specs(4, DType::BF16, false, &q, &k, &v), Err(Error::UnsupportedHeadDim { head_dim: 192, .. })));
    }

    #[test]
    fn tma_specs_reject_what_tma_cannot_describe() {
        let q = contiguous(1, 64, 2, 128);
        // A row stride of 129 elements is 258 bytes: not a multiple of 16.
        let odd = OperandLayout {
            row_stride: 129,
            ..q
        };
        assert!(matches!(
            tma_specs(2, DType::BF16, false, &q, &odd, &q),
            Err(Error::InvalidLayout {
                operand: Operand::K,
                ..
            })
        ));
        assert!(matches!(
            tma_specs(2, DType::BF16, false, &contiguous(1, 64, 2, 96), &q, &q),
            Err(Error::UnsupportedHeadDim { head_dim: 96, .. })
        ));
        assert!(matches!(
            tma_specs(2, DType::F32, false, &q, &q, &q),
            Err(Error::UnsupportedDType { .. })
        ));
    }
}

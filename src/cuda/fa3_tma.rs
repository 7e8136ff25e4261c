//! TMA and geometry helpers of the FA3-style sm_90a kernels (`cuda/fa3_fwd_sm90.cu`), used by
//! `fa3.rs`: the launch geometry of each (stage, head_dim) instance as `Fa3Traits` computes it
//! (a test pins the table rows of build/instances.rs to it, another pins it to the numbers the
//! C++ traits print), the grids, and the three TMA tensor maps stages 2-5 take after
//! `FwdParams` (docs/fa3.md). `tensor_maps_for` encodes them through
//! `cudarc::driver::sys::cuTensorMapEncodeTiled`.

use crate::error::{Error, Operand, Result};
use crate::tensor::DType;

/// Stages with an instance in `cuda/fa3_fwd_sm90.cu` (1 = wgmma only, 2 = + TMA/mbarrier ring,
/// 3 = + warp specialisation, 4 = + ping-pong and intra-warpgroup overlap, 5 = + persistent
/// tile scheduler).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const FA3_STAGES: [u32; 5] = [1, 2, 3, 4, 5];
/// Head dims with an instance.
pub(crate) const FA3_HEAD_DIMS: [usize; 3] = [64, 128, 256];

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

/// Same arithmetic as `Fa3Traits<Stage, HeadDim>`; `None` for a pair without an instance.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn geometry(stage: u32, head_dim: usize) -> Option<Fa3Geometry> {
    if !FA3_STAGES.contains(&stage) || !FA3_HEAD_DIMS.contains(&head_dim) {
        return None;
    }
    let d = head_dim as u32;
    let (consumers, producers) = if stage >= 3 { (2, 1) } else { (1, 0) };
    let block_m = ROWS_PER_WARPGROUP * consumers;
    let block_n = if d <= 128 { 128 } else { 64 };
    let kv_stages = if stage >= 2 { 2 } else { 1 };
    let elem = 2; // bf16 / f16
    let q_bytes = block_m * d * elem;
    let kv_tile = block_n * d * elem;
    // Stages 2-3: q_full, kv_full[S], kv_empty[S]. Stages 4-5: K and V apart (4 per slot)
    // plus q_empty.
    let barriers = 8 * if stage >= 4 {
        2 + 4 * kv_stages
    } else {
        1 + 2 * kv_stages
    };
    let used = q_bytes + 2 * kv_stages * kv_tile + barriers;
    Some(Fa3Geometry {
        threads: WARPGROUP_THREADS * (consumers + producers),
        block_m,
        block_n,
        kv_stages,
        smem_bytes: used + SMEM_ALIGN_SLACK,
    })
}

/// Grid of a stage 1-4 launch: (query tiles, heads_q, batch). Stage 5 is persistent: use
/// `persistent_grid`.
pub(crate) fn grid(
    g: &Fa3Geometry,
    batch: usize,
    seqlen_q: usize,
    heads_q: usize,
) -> (u32, u32, u32) {
    let tiles = seqlen_q.div_ceil(g.block_m as usize);
    (tiles as u32, heads_q as u32, batch as u32)
}

/// Grid of a stage-5 (persistent) launch: (min(SM count, tiles), 1, 1); the CTAs stride over
/// the `ceil(seqlen_q / block_m) * heads_q * batch` tiles.
pub(crate) fn persistent_grid(
    g: &Fa3Geometry,
    batch: usize,
    seqlen_q: usize,
    heads_q: usize,
    sm_count: usize,
) -> (u32, u32, u32) {
    let tiles = seqlen_q.div_ceil(g.block_m as usize) * heads_q * batch;
    (tiles.min(sm_count).max(1) as u32, 1, 1)
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

/// `CUtensorMapDataType` values (cuda.h), as passed to `cuTensorMapEncodeTiled`.
pub(crate) const TMA_DTYPE_FLOAT16: u32 = 6;
pub(crate) const TMA_DTYPE_BFLOAT16: u32 = 9;
/// `CU_TENSOR_MAP_INTERLEAVE_NONE`.
pub(crate) const TMA_INTERLEAVE_NONE: u32 = 0;
/// `CU_TENSOR_MAP_SWIZZLE_128B`: the 128-byte swizzle wgmma's SW128 descriptors un-do.
pub(crate) const TMA_SWIZZLE_128B: u32 = 3;
/// `CU_TENSOR_MAP_L2_PROMOTION_L2_256B`.
pub(crate) const TMA_L2_PROMOTION_256B: u32 = 3;
/// `CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE`: out-of-bounds elements are zeros.
pub(crate) const TMA_OOB_FILL_NONE: u32 = 0;
/// Rank of every map: {head_dim, heads, seqlen, batch}.
pub(crate) const TMA_RANK: u32 = 4;

/// Every argument of one `cuTensorMapEncodeTiled` call except the output map and the global
/// address: `tensor_maps_for` passes exactly these to the driver, and the CPU emulator
/// (`crate::cuda::emulation`) encodes the map its kernels receive from the same values. Rank 4,
/// innermost dimension first: {head_dim, heads, seqlen, batch}. Data type BFLOAT16 / FLOAT16 by
/// the problem's dtype; interleave NONE, swizzle 128B, L2 promotion 256B, OOB fill NONE (= zeros).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaSpec {
    /// `CUtensorMapDataType`.
    pub data_type: u32,
    /// Always `TMA_RANK`.
    pub rank: u32,
    /// Global extents in elements.
    pub dims: [u64; 4],
    /// Byte strides of dims 1..4 (dim 0 is contiguous).
    pub strides: [u64; 3],
    /// Box extents in elements: {64, 1, rows, 1}.
    pub box_dims: [u32; 4],
    /// Always 1: every element of the box is loaded.
    pub elem_strides: [u32; 4],
    /// `CUtensorMapInterleave`, `CUtensorMapSwizzle`, `CUtensorMapL2promotion`,
    /// `CUtensorMapFloatOOBfill` values.
    pub interleave: u32,
    pub swizzle: u32,
    pub l2_promotion: u32,
    pub oob_fill: u32,
}

/// One operand's spec (also used by the FA4 kernels, `fa4.rs`, with 128-row boxes).
pub(crate) fn tma_spec(op: Operand, l: &OperandLayout, box_rows: u32, data_type: u32, elem_bytes: u64) -> Result<TmaSpec> {
    let bad = |reason: String| Error::InvalidLayout {
        operand: op,
        reason,
    };
    if l.head_dim as u32 % SLAB_COLS != 0 {
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

/// Tensor-map specs for Q (box rows 64), K and V (box rows = the instance's block_n).
pub(crate) fn tma_specs(
    stage: u32,
    dtype: DType,
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
    Ok([
        tma_spec(Operand::Q, q, ROWS_PER_WARPGROUP, t, e)?,
        tma_spec(Operand::K, k, g.block_n, t, e)?,
        tma_spec(Operand::V, v, g.block_n, t, e)?,
    ])
}

/// Encodes the three tensor maps of a stage-2..5 launch; pass them, in order Q, K, V, after the
/// `FwdParams` argument (each as its `opaque: [u64; 16]`).
///
/// # Safety
/// 1. `q`, `k`, `v` are device addresses of live allocations holding the described tensors
///    (the maps only record the addresses; the kernel reads through them later).
/// 2. The driver library is loaded (`sys::is_culib_present()`), with a current context.
#[cfg(feature = "cuda")]
pub(crate) unsafe fn tensor_maps_for(
    stage: u32,
    dtype: DType,
    ptrs: [cudarc::driver::sys::CUdeviceptr; 3],
    layouts: [&OperandLayout; 3],
) -> Result<[cudarc::driver::sys::CUtensorMap; 3]> {
    let specs = tma_specs(stage, dtype, layouts[0], layouts[1], layouts[2])?;
    // SAFETY: the caller's guarantees (# Safety) are encode_maps' own.
    unsafe { encode_maps(&specs, ptrs) }
}

/// Encodes the Q, K, V tensor maps of `specs` at `ptrs` (the FA3 stages' and the FA4 kernels').
///
/// # Safety
/// As [`tensor_maps_for`]: `ptrs` are device addresses of live allocations holding the
/// described tensors, and the driver is loaded with a current context.
#[cfg(feature = "cuda")]
pub(crate) unsafe fn encode_maps(
    specs: &[TmaSpec; 3],
    ptrs: [cudarc::driver::sys::CUdeviceptr; 3],
) -> Result<[cudarc::driver::sys::CUtensorMap; 3]> {
    use cudarc::driver::sys;
    let operands = [Operand::Q, Operand::K, Operand::V];
    let mut maps = [sys::CUtensorMap { opaque: [0; 16] }; 3];
    for i in 0..3 {
        if ptrs[i] % TMA_STRIDE_ALIGN != 0 {
            return Err(Error::InvalidLayout {
                operand: operands[i],
                reason: format!("device address {:#x} is not 16-byte aligned (TMA)", ptrs[i]),
            });
        }
        let s = &specs[i];
        let e = cu_enums(s).map_err(|what| Error::Cuda {
            call: format!("cuTensorMapEncodeTiled({})", operands[i]),
            message: format!("no CUDA enum value for {what}"),
        })?;
        // SAFETY: every pointer argument points at a live array of the spec (rank 4 entries,
        // rank - 1 for the strides) the call reads; `maps[i]` is a writable, 128-aligned
        // CUtensorMap; the caller guarantees the driver is loaded (see # Safety).
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut maps[i],
                e.0,
                s.rank,
                ptrs[i] as *mut std::ffi::c_void,
                s.dims.as_ptr(),
                s.strides.as_ptr(),
                s.box_dims.as_ptr(),
                s.elem_strides.as_ptr(),
                e.1,
                e.2,
                e.3,
                e.4,
            )
        };
        r.result().map_err(|e| Error::Cuda {
            call: format!("cuTensorMapEncodeTiled({})", operands[i]),
            message: format!("{e:?}"),
        })?;
    }
    Ok(maps)
}

/// The spec's enum values as cudarc's driver enums (`Err`: which field has no such value).
#[cfg(feature = "cuda")]
#[allow(clippy::type_complexity)]
fn cu_enums(
    s: &TmaSpec,
) -> std::result::Result<
    (
        cudarc::driver::sys::CUtensorMapDataType,
        cudarc::driver::sys::CUtensorMapInterleave,
        cudarc::driver::sys::CUtensorMapSwizzle,
        cudarc::driver::sys::CUtensorMapL2promotion,
        cudarc::driver::sys::CUtensorMapFloatOOBfill,
    ),
    &'static str,
> {
    use cudarc::driver::sys::*;
    let data_type = match s.data_type {
        TMA_DTYPE_FLOAT16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        TMA_DTYPE_BFLOAT16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        _ => return Err("data_type"),
    };
    let interleave = match s.interleave {
        TMA_INTERLEAVE_NONE => CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
        _ => return Err("interleave"),
    };
    let swizzle = match s.swizzle {
        TMA_SWIZZLE_128B => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        _ => return Err("swizzle"),
    };
    let l2 = match s.l2_promotion {
        TMA_L2_PROMOTION_256B => CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        _ => return Err("l2_promotion"),
    };
    let oob = match s.oob_fill {
        TMA_OOB_FILL_NONE => CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        _ => return Err("oob_fill"),
    };
    Ok((data_type, interleave, swizzle, l2, oob))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The numbers the emulator receives are the driver's enum values (cuda.h): cudarc's enums
    /// carry the same discriminants, and `cu_enums` maps each spec field onto them.
    #[test]
    fn spec_enum_values_are_the_drivers() {
        use cudarc::driver::sys::*;
        assert_eq!(CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16 as u32, TMA_DTYPE_FLOAT16);
        assert_eq!(CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 as u32, TMA_DTYPE_BFLOAT16);
        assert_eq!(CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE as u32, TMA_INTERLEAVE_NONE);
        assert_eq!(CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B as u32, TMA_SWIZZLE_128B);
        assert_eq!(CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B as u32, TMA_L2_PROMOTION_256B);
        assert_eq!(CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE as u32, TMA_OOB_FILL_NONE);
        let q = contiguous(1, 10, 2, 64);
        for dt in [DType::BF16, DType::F16] {
            let spec = tma_specs(2, dt, &q, &q, &q).unwrap()[0];
            let (d, i, s, l, o) = cu_enums(&spec).unwrap();
            assert_eq!((d as u32, i as u32, s as u32, l as u32, o as u32), (spec.data_type, 0, 3, 3, 0));
        }
    }

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
        // Fa3Traits<Stage, HeadDim> prints (host build of cuda/include/fa3_traits.cuh).
        let want = [
            (1, 64, 128, 64, 128, 1, 42008),
            (1, 128, 128, 64, 128, 1, 82968),
            (1, 256, 128, 64, 64, 1, 99352),
            (2, 64, 128, 64, 128, 2, 74792),
            (2, 128, 128, 64, 128, 2, 148520),
            (2, 256, 128, 64, 64, 2, 164904),
            (3, 64, 384, 128, 128, 2, 82984),
            (3, 128, 384, 128, 128, 2, 164904),
            (3, 256, 384, 128, 64, 2, 197672),
            (4, 64, 384, 128, 128, 2, 83024),
            (4, 128, 384, 128, 128, 2, 164944),
            (4, 256, 384, 128, 64, 2, 197712),
            (5, 64, 384, 128, 128, 2, 83024),
            (5, 128, 384, 128, 128, 2, 164944),
            (5, 256, 384, 128, 64, 2, 197712),
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
    }

    #[test]
    fn grids() {
        let g = geometry(3, 128).unwrap();
        assert_eq!(grid(&g, 2, 1000, 16), (8, 16, 2)); // ceil(1000 / 128) = 8
        let g = geometry(1, 64).unwrap();
        assert_eq!(grid(&g, 1, 64, 1), (1, 1, 1));
        let g5 = geometry(5, 128).unwrap();
        assert_eq!(persistent_grid(&g5, 2, 1000, 16, 132), (132, 1, 1)); // 256 tiles
        assert_eq!(persistent_grid(&g5, 1, 100, 2, 132), (2, 1, 1)); // 2 tiles
    }

    #[test]
    fn tma_specs_for_contiguous_gqa_bf16() {
        let q = contiguous(2, 1000, 16, 128);
        let kv = contiguous(2, 777, 4, 128);
        let [sq, sk, sv] = tma_specs(3, DType::BF16, &q, &kv, &kv).unwrap();
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
        let [_, sk, _] = tma_specs(2, DType::F16, &q, &q, &q).unwrap();
        assert_eq!(sk.box_dims, [64, 1, 64, 1]);
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
            tma_specs(2, DType::BF16, &q, &odd, &q),
            Err(Error::InvalidLayout {
                operand: Operand::K,
                ..
            })
        ));
        assert!(matches!(
            tma_specs(2, DType::BF16, &contiguous(1, 64, 2, 96), &q, &q),
            Err(Error::UnsupportedHeadDim { head_dim: 96, .. })
        ));
        assert!(matches!(
            tma_specs(2, DType::F32, &q, &q, &q),
            Err(Error::UnsupportedDType { .. })
        ));
    }
}

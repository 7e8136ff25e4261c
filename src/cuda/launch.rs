//! The launch vocabulary, data only: [`LaunchPlan`] is one launch (the instance, grid, block,
//! dynamic shared memory, `FwdParams`, tensor maps), with the tensor-map arguments it carries.
//! `plan.rs` builds plans from the table row and the family's host rules (for `Engine` and the
//! CPU emulator alike); `driver.rs` hands them to the driver.

use super::params::FwdParams;
use super::table::{append_kv_symbol, kernel_symbol, Family, Tile, DTYPE_NAMES};
use crate::tensor::DType;
use std::ops::Deref;

/// The most tensor maps a kernel takes after `FwdParams` (FA3, FA4: Q, K, V).
pub(crate) const MAX_TENSOR_MAPS: usize = 3;

/// The kernel-symbol suffix of a dtype the GPU kernels take (`None` for f32).
pub(crate) fn dtype_name(dtype: DType) -> Option<&'static str> {
    let name = match dtype {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => return None,
    };
    DTYPE_NAMES.iter().copied().find(|n| *n == name)
}

/// `CUtensorMapDataType` values (cuda.h), as passed to `cuTensorMapEncodeTiled`.
pub(crate) const TMA_DTYPE_FLOAT16: u32 = 6;
pub(crate) const TMA_DTYPE_BFLOAT16: u32 = 9;
/// `CU_TENSOR_MAP_DATA_TYPE_UINT8`: e4m3 codes travel as bytes (the FP8 consumer).
pub(crate) const TMA_DTYPE_UINT8: u32 = 0;
/// `CU_TENSOR_MAP_INTERLEAVE_NONE`.
pub(crate) const TMA_INTERLEAVE_NONE: u32 = 0;
/// `CU_TENSOR_MAP_SWIZZLE_128B`: the 128-byte swizzle wgmma's SW128 descriptors un-do.
pub(crate) const TMA_SWIZZLE_128B: u32 = 3;
/// `CU_TENSOR_MAP_SWIZZLE_64B`: for 64-byte box rows (the FP8 consumer's e4m3 tiles whose K
/// extent is 64 bytes), un-done by wgmma's SW64 descriptors.
pub(crate) const TMA_SWIZZLE_64B: u32 = 2;
/// `CU_TENSOR_MAP_L2_PROMOTION_L2_256B`.
pub(crate) const TMA_L2_PROMOTION_256B: u32 = 3;
/// `CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE`: out-of-bounds elements are zeros.
pub(crate) const TMA_OOB_FILL_NONE: u32 = 0;
/// Rank of every map: {head_dim, heads, seqlen, batch}.
pub(crate) const TMA_RANK: u32 = 4;

/// Every argument of one `cuTensorMapEncodeTiled` call except the output map and the global
/// address: `driver.rs` passes exactly these to the driver, and the CPU emulator encodes the
/// map its kernels receive from the same values (the launch plan). Rank 4,
/// innermost dimension first: {head_dim, heads, seqlen, batch}. Data type BFLOAT16 / FLOAT16 by
/// the problem's dtype; interleave NONE, swizzle 128B, L2 promotion 256B, OOB fill NONE (= zeros).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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

/// One tensor map: the global address and every other `cuTensorMapEncodeTiled` argument.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TensorMapArgs {
    pub global_address: u64,
    pub spec: TmaSpec,
}

/// The tensor maps of a launch, in argument order (none for most kernels). Fixed capacity: a
/// launch allocates nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TensorMaps {
    len: usize,
    maps: [TensorMapArgs; MAX_TENSOR_MAPS],
}

impl TensorMaps {
    /// One map per spec, over the matching global address.
    pub(crate) fn new(specs: [TmaSpec; MAX_TENSOR_MAPS], addresses: [u64; MAX_TENSOR_MAPS]) -> Self {
        let maps = std::array::from_fn(|i| TensorMapArgs { global_address: addresses[i], spec: specs[i] });
        TensorMaps { len: MAX_TENSOR_MAPS, maps }
    }
}

impl Deref for TensorMaps {
    type Target = [TensorMapArgs];
    fn deref(&self) -> &[TensorMapArgs] {
        &self.maps[..self.len]
    }
}

impl<'a> IntoIterator for &'a TensorMaps {
    type Item = &'a TensorMapArgs;
    type IntoIter = std::slice::Iter<'a, TensorMapArgs>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// A launch, as data.
#[derive(Clone, Copy, Debug)]
pub struct LaunchPlan {
    pub family: &'static Family,
    /// The instance's tile (its head dim may exceed the problem's: FA1 masks the tail).
    pub tile: &'static Tile,
    /// The kernel-symbol suffix of the dtype ("f16", "bf16").
    pub dtype: &'static str,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub smem_bytes: u32,
    pub params: FwdParams,
    /// The maps after `FwdParams` (FA3 stages 2-5 and every FA4 stage: Q, K, V), else none.
    pub tensor_maps: TensorMaps,
    /// What the launch does beyond its family's name (`FamilyHost::launch_note`: FA3's K/V load
    /// path on a serving layout), else `None`.
    pub note: Option<&'static str>,
    /// The serving KV append kernel of the family's image (`append_kv_symbol`), not the forward.
    pub append_kv: bool,
}

impl LaunchPlan {
    /// `<family>_fwd_hd<D>_<dtype>`, or `fa_append_kv_hd<D>_<dtype>` for an append launch.
    pub fn kernel(&self) -> String {
        if self.append_kv {
            append_kv_symbol(self.tile.head_dim, self.dtype)
        } else {
            kernel_symbol(self.family.name, self.tile.head_dim, self.dtype)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_names_are_the_tables() {
        assert_eq!([dtype_name(DType::F16), dtype_name(DType::BF16), dtype_name(DType::F32)], [Some("f16"), Some("bf16"), None]);
    }
}

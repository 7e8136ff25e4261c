//! Launches. [`LaunchPlan`] is one launch as data (the instance, grid, block, dynamic shared
//! memory, `FwdParams`, tensor maps), built by [`plan_launch`] from the table row and the
//! family's host rules, for `Engine` and for the CPU emulator alike (`plan.rs`). [`launch`] is
//! the one place a kernel is launched, with the driver calls that belong to it (tensor-map
//! encoding): every `Engine` entry point (`forward`, `launch`, `launch_raw`) ends here.

use super::device::{cuda_err, Loaded};
use super::combine::{CombineLaunch, CombineParams};
use super::fp8::{PrepassLaunch, PrepassParams};
use super::params::FwdParams;
use super::table::{append_kv_symbol, kernel_symbol, Family, Tile, DTYPE_NAMES};
use crate::error::{Error, Operand, Result};
use crate::tensor::DType;
use cudarc::driver::{result, sys, DeviceRepr};
use std::ffi::c_void;
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
/// address: `launch.rs` passes exactly these to the driver, and the CPU emulator encodes the
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

/// The launch of `fam`'s instance `tile` on `dtype` data with `params`: block and shared memory
/// from the table row, grid and tensor maps from the family's host rules (`sm_count` sizes a
/// persistent grid).
///
/// # Errors
/// [`Error::UnsupportedDType`] for a dtype the kernels do not take; the family's tensor-map
/// errors ([`Error::InvalidLayout`]).
pub(crate) fn plan_launch(
    fam: &'static Family,
    tile: &'static Tile,
    dtype: DType,
    params: FwdParams,
    sm_count: u32,
) -> Result<LaunchPlan> {
    let dtype_name = dtype_name(dtype).ok_or_else(|| Error::UnsupportedDType {
        dtype,
        backend: format!("cuda {}", fam.name),
        supported: "F16, BF16".into(),
    })?;
    Ok(LaunchPlan {
        family: fam,
        tile,
        dtype: dtype_name,
        grid: fam.host.grid(fam, tile, &params, sm_count),
        block: (tile.threads, 1, 1),
        smem_bytes: fam.smem_bytes(tile),
        params,
        tensor_maps: fam.host.tensor_maps(fam, dtype, &params)?,
        note: fam.host.launch_note(fam, tile, &params),
        append_kv: false,
    })
}

/// A `CUtensorMap` as a kernel argument: 128 opaque bytes, 128-byte aligned (the driver
/// requires 64; CUDA's own type is declared with 64, TMA descriptors in parameter space are
/// read from their 128-byte aligned copy).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(128))]
struct TensorMap([u64; 16]);

// SAFETY: plain bytes with the size and alignment of the kernel's `const __grid_constant__
// CUtensorMap` parameter (asserted below); no pointers the driver must translate.
unsafe impl DeviceRepr for TensorMap {}

const _: () = assert!(std::mem::size_of::<TensorMap>() == 128 && std::mem::align_of::<TensorMap>() == 128);

/// Launches `plan` with `f` (its loaded function, shared-memory opt-in set) on `stream`. The
/// caller has bound the device's context to this thread.
///
/// # Errors
/// [`Error::Cuda`] when encoding a tensor map or the launch fails.
pub(crate) fn launch(f: &Loaded, stream: sys::CUstream, plan: &LaunchPlan) -> Result<()> {
    launch_kernel(f, stream, (plan.grid, plan.block, plan.smem_bytes), Params::Forward(plan.params), &plan.tensor_maps)
}

/// Launches the FP8 pre-pass `plan` with `f` (the pre-pass of an FP8 family's image) on `stream`.
///
/// # Errors
/// [`Error::Cuda`] when the launch fails.
pub(crate) fn launch_fp8_prepass(f: &Loaded, stream: sys::CUstream, plan: &PrepassLaunch) -> Result<()> {
    launch_kernel(f, stream, ((plan.grid, 1, 1), (plan.block, 1, 1), 0), Params::Fp8Prepass(plan.params), &[])
}

/// Launches the combine `plan` (split-KV's second pass, or a device `merge_states`) with `f`
/// (the plan's kernel of the standalone combine image) on `stream`.
///
/// # Errors
/// [`Error::Cuda`] when the launch fails.
pub(crate) fn launch_combine(f: &Loaded, stream: sys::CUstream, plan: &CombineLaunch) -> Result<()> {
    launch_kernel(f, stream, ((plan.grid, 1, 1), (plan.block, 1, 1), 0), Params::Combine(&plan.params), &[])
}

/// The parameter struct a kernel takes first, by value.
#[derive(Clone, Copy)]
enum Params<'a> {
    /// Every forward kernel: `const __grid_constant__ FwdParams`.
    Forward(FwdParams),
    /// The FP8 pre-pass: `const __grid_constant__ Fp8PrepassParams`.
    Fp8Prepass(PrepassParams),
    /// The combine: `const __grid_constant__ CombineParams`.
    /// (by reference: 2.7 KB, read by the driver during the call only)
    Combine(&'a CombineParams),
}

/// Grid, block and dynamic shared memory of a launch.
type Shape3 = ((u32, u32, u32), (u32, u32, u32), u32);

/// The one kernel launch.
fn launch_kernel(
    f: &Loaded,
    stream: sys::CUstream,
    (grid, block, smem_bytes): Shape3,
    mut params: Params<'_>,
    tensor_maps: &[TensorMapArgs],
) -> Result<()> {
    let mut maps = [TensorMap([0; 16]); MAX_TENSOR_MAPS];
    for ((map, args), op) in maps.iter_mut().zip(tensor_maps).zip([Operand::Q, Operand::K, Operand::V]) {
        *map = encode(args, op)?;
    }
    let mut args = [std::ptr::null_mut::<c_void>(); 1 + MAX_TENSOR_MAPS];
    args[0] = match &mut params {
        Params::Forward(p) => p as *mut FwdParams as *mut c_void,
        Params::Fp8Prepass(p) => p as *mut PrepassParams as *mut c_void,
        // The driver only reads the argument values.
        Params::Combine(p) => *p as *const CombineParams as *mut c_void,
    };
    for (arg, map) in args[1..].iter_mut().zip(maps.iter_mut()) {
        *arg = map as *mut TensorMap as *mut c_void;
    }
    let args = &mut args[..1 + tensor_maps.len().min(MAX_TENSOR_MAPS)];
    // SAFETY: every forward kernel takes `const __grid_constant__ FwdParams`, followed by one
    // `const __grid_constant__ CUtensorMap` per tensor map its family's host rules give (FA3
    // stages 2-5, FA4 and the FP8 consumer: Q, K, V); the FP8 pre-pass takes `const
    // __grid_constant__ Fp8PrepassParams` alone, the combine `const __grid_constant__
    // CombineParams` alone. `args` points at exactly those values, alive for the call
    // (cuLaunchKernel copies them). FwdParams mirrors cuda/common/params.h, PrepassParams
    // cuda/common/fp8_prepass_params.h and CombineParams cuda/common/combine_params.h (size and
    // offsets asserted on both sides),
    // TensorMap is the 128-byte map. The engine checked that every address covers the elements
    // the shapes and strides reach (the FP8 scratch is sized by `Fp8Scratch`), and the family's
    // layout rules; block and dynamic shared memory are the table row's (the pre-pass: its own
    // block, none), which the kernel static_asserts against its traits, and `f`'s shared-memory
    // opt-in was set when it was loaded.
    unsafe { result::launch_kernel(f.func, grid, block, smem_bytes, stream, args) }.map_err(cuda_err("cuLaunchKernel"))
}

/// Encodes one tensor map with `cuTensorMapEncodeTiled` (host-only: no device work, no
/// allocation). The context is current, so the driver is loaded.
fn encode(args: &TensorMapArgs, op: Operand) -> Result<TensorMap> {
    let s = &args.spec;
    let call = || format!("cuTensorMapEncodeTiled({op})");
    let (data_type, interleave, swizzle, l2, oob) =
        cu_enums(s).map_err(|what| Error::Cuda { call: call(), message: format!("no CUDA enum value for {what}") })?;
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every pointer argument points at a live array of the spec that the call reads
    // (rank 4 entries, rank - 1 for the strides); `map` is a writable CUtensorMap. The global
    // address is only recorded (the kernel reads through it later: the engine checked it holds
    // the described tensor). The driver is loaded (a context is current).
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            s.rank,
            args.global_address as *mut c_void,
            s.dims.as_ptr(),
            s.strides.as_ptr(),
            s.box_dims.as_ptr(),
            s.elem_strides.as_ptr(),
            interleave,
            swizzle,
            l2,
            oob,
        )
    };
    r.result().map_err(|e| Error::Cuda { call: call(), message: format!("{e:?}") })?;
    Ok(TensorMap(map.opaque))
}

/// The spec's enum values as cudarc's driver enums (`Err`: which field has no such value).
#[allow(clippy::type_complexity)]
fn cu_enums(
    s: &TmaSpec,
) -> std::result::Result<
    (
        sys::CUtensorMapDataType,
        sys::CUtensorMapInterleave,
        sys::CUtensorMapSwizzle,
        sys::CUtensorMapL2promotion,
        sys::CUtensorMapFloatOOBfill,
    ),
    &'static str,
> {
    use sys::*;
    let data_type = match s.data_type {
        TMA_DTYPE_FLOAT16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        TMA_DTYPE_BFLOAT16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        TMA_DTYPE_UINT8 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        _ => return Err("data_type"),
    };
    let interleave = match s.interleave {
        TMA_INTERLEAVE_NONE => CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
        _ => return Err("interleave"),
    };
    let swizzle = match s.swizzle {
        TMA_SWIZZLE_128B => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        TMA_SWIZZLE_64B => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
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
    use super::super::fa3::tma::{tma_specs, OperandLayout};
    use super::*;

    /// The numbers the emulator receives are the driver's enum values (cuda.h): cudarc's enums
    /// carry the same discriminants, and `cu_enums` maps each spec field onto them.
    #[test]
    fn spec_enum_values_are_the_drivers() {
        use cudarc::driver::sys::*;
        assert_eq!(CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16 as u32, TMA_DTYPE_FLOAT16);
        assert_eq!(CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 as u32, TMA_DTYPE_BFLOAT16);
        assert_eq!(CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8 as u32, TMA_DTYPE_UINT8);
        assert_eq!(CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE as u32, TMA_INTERLEAVE_NONE);
        assert_eq!(CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B as u32, TMA_SWIZZLE_128B);
        assert_eq!(CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B as u32, TMA_SWIZZLE_64B);
        assert_eq!(CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B as u32, TMA_L2_PROMOTION_256B);
        assert_eq!(CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE as u32, TMA_OOB_FILL_NONE);
        let q = OperandLayout {
            batch: 1,
            seqlen: 10,
            heads: 2,
            head_dim: 64,
            batch_stride: 10 * 2 * 64,
            row_stride: 2 * 64,
            head_stride: 64,
        };
        for dt in [DType::BF16, DType::F16] {
            let spec = tma_specs(2, dt, &q, &q, &q).unwrap()[0];
            let (d, i, s, l, o) = cu_enums(&spec).unwrap();
            assert_eq!((d as u32, i as u32, s as u32, l as u32, o as u32), (spec.data_type, 0, 3, 3, 0));
        }
    }

    #[test]
    fn dtype_names_are_the_tables() {
        assert_eq!([dtype_name(DType::F16), dtype_name(DType::BF16), dtype_name(DType::F32)], [Some("f16"), Some("bf16"), None]);
    }
}

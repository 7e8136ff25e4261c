//! The driver calls of a launch: [`launch`] (a forward `LaunchPlan`), [`launch_fp8_prepass`],
//! [`launch_combine`] and [`launch_backward`] end in the one `cuLaunchKernel` of the crate, after
//! encoding the plan's tensor maps with `cuTensorMapEncodeTiled`. Every `Engine` entry point
//! (`forward`, `launch`, `launch_raw`, serving, `merge_states`, `backward`) ends here.

use super::bwd_params::BwdParams;
use super::combine::{CombineLaunch, CombineParams};
use super::fa2_bwd::BwdLaunch;
use super::device::{cuda_err, Loaded};
use super::fp8::{PrepassLaunch, PrepassParams};
use super::launch::{
    LaunchPlan, TensorMapArgs, TmaSpec, MAX_TENSOR_MAPS, TMA_DTYPE_BFLOAT16, TMA_DTYPE_FLOAT16, TMA_DTYPE_UINT8,
    TMA_INTERLEAVE_NONE, TMA_L2_PROMOTION_256B, TMA_OOB_FILL_NONE, TMA_SWIZZLE_128B, TMA_SWIZZLE_64B,
};
use super::params::FwdParams;
use crate::error::{Error, Operand, Result};
use cudarc::driver::{result, sys, DeviceRepr};
use std::ffi::c_void;

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

/// Launches one kernel of a backward plan (`fa2_bwd::plan`, `fa3_bwd::plan`) with `f` (its
/// kernel of the fa2_bwd / fa3_bwd standalone image, shared-memory opt-in set) on `stream`, with
/// `tensor_maps` after the parameters (the FA3-style main kernel's Q, K, V, dO; else none).
///
/// # Errors
/// [`Error::Cuda`] when encoding a tensor map or the launch fails.
pub(crate) fn launch_backward(
    f: &Loaded,
    stream: sys::CUstream,
    l: &BwdLaunch,
    params: BwdParams,
    tensor_maps: &[TensorMapArgs],
) -> Result<()> {
    launch_kernel(f, stream, (l.grid, l.block, l.smem_bytes), Params::Backward(params), tensor_maps)
}

/// The most tensor maps a kernel takes after its parameters (the FA3-style backward: Q, K, V, dO).
const MAX_KERNEL_MAPS: usize = 4;
const _: () = assert!(MAX_TENSOR_MAPS <= MAX_KERNEL_MAPS);

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
    /// Every backward kernel: `const __grid_constant__ BwdParams`.
    Backward(BwdParams),
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
    let mut maps = [TensorMap([0; 16]); MAX_KERNEL_MAPS];
    for ((map, args), op) in maps.iter_mut().zip(tensor_maps).zip([Operand::Q, Operand::K, Operand::V, Operand::DO]) {
        *map = encode(args, op)?;
    }
    let mut args = [std::ptr::null_mut::<c_void>(); 1 + MAX_KERNEL_MAPS];
    args[0] = match &mut params {
        Params::Forward(p) => p as *mut FwdParams as *mut c_void,
        Params::Fp8Prepass(p) => p as *mut PrepassParams as *mut c_void,
        // The driver only reads the argument values.
        Params::Combine(p) => *p as *const CombineParams as *mut c_void,
        Params::Backward(p) => p as *mut BwdParams as *mut c_void,
    };
    for (arg, map) in args[1..].iter_mut().zip(maps.iter_mut()) {
        *arg = map as *mut TensorMap as *mut c_void;
    }
    let args = &mut args[..1 + tensor_maps.len().min(MAX_KERNEL_MAPS)];
    // SAFETY: every forward kernel takes `const __grid_constant__ FwdParams`, followed by one
    // `const __grid_constant__ CUtensorMap` per tensor map its family's host rules give (FA3
    // stages 2-5, FA4 and the FP8 consumer: Q, K, V); the FP8 pre-pass takes `const
    // __grid_constant__ Fp8PrepassParams` alone, the combine `const __grid_constant__
    // CombineParams` alone. `args` points at exactly those values, alive for the call
    // (cuLaunchKernel copies them). FwdParams mirrors cuda/common/params.h, PrepassParams
    // cuda/common/fp8_prepass_params.h and CombineParams cuda/common/combine_params.h (size and
    // offsets asserted on both sides),
    // TensorMap is the 128-byte map. The engine checked that every address covers the elements
    // the shapes and strides reach (the FP8 scratch is sized by `Fp8Scratch`, the backward's by
    // its plan), and the family's layout rules; block and dynamic shared memory are the table
    // row's (the pre-pass: its own block, none; the backward: its plan's), which the kernel
    // static_asserts against its traits, and `f`'s shared-memory opt-in was set when it was
    // loaded.
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
    use crate::tensor::DType;

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
            let spec = tma_specs(2, dt, false, &q, &q, &q).unwrap()[0];
            let (d, i, s, l, o) = cu_enums(&spec).unwrap();
            assert_eq!((d as u32, i as u32, s as u32, l as u32, o as u32), (spec.data_type, 0, 3, 3, 0));
        }
    }
}

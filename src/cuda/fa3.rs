//! Host side of the FA3 stage ladder (`cuda/fa3_fwd_sm90.cu`, rows "fa3s1".."fa3s5" of
//! build/instances.rs): what the kernels refuse, the layout preconditions, the three TMA tensor
//! maps (stages 2-5, encoded per call from the device pointers and strides: host-only, no
//! allocation) and the launch (stage 5 on a persistent grid of min(SMs, tiles) CTAs).
//! Launch geometry comes from the table row (`Tile`, `smem_bytes`); `fa3_tma` repeats the
//! `Fa3Traits` arithmetic and its tests pin the two together.

use super::device::{cuda_err, Device};
use super::dispatch::Choice;
use super::fa3_tma::{self, OperandLayout};
use super::kernels::Tile;
use super::params::FwdParams;
use crate::error::{Error, Operand, Result};
use crate::problem::Problem;
use crate::tensor::DType;
use cudarc::driver::{sys, DeviceRepr};

/// Element multiple every batch/row/head stride must be: 8 × 2 bytes = 16 bytes (stage 1's
/// 16-byte vector loads, TMA's stride rule).
const STRIDE_MULTIPLE: i64 = 8;
/// Base address alignment (16-byte vector loads and TMA global addresses).
const ADDRESS_ALIGN: u64 = 16;

/// Why the FA3 kernels cannot run `p` on `tile` (None: they can). The dispatcher calls it for
/// every FA3 row, so an explicit `Variant::Fa3` is refused with this reason
/// (`Error::VariantUnavailable`) and Auto, which never picks FA3 while it is unverified, would
/// skip it.
pub(crate) fn refusal(p: &Problem, tile: &Tile) -> Option<String> {
    if p.alibi.is_some() {
        return Some("has no ALiBi (FlashAttention-3 does not implement it; use Fa2 or Fa1)".into());
    }
    // The kernels load and multiply whole 64-column slabs with no tail mask: the head dim must
    // be the instance's exactly.
    if p.head_dim != tile.head_dim as usize {
        return Some(format!(
            "runs head_dim 64, 128 or 256 exactly (no masked tail), not {}",
            p.head_dim
        ));
    }
    None
}

/// A `CUtensorMap` as a kernel argument: 128 opaque bytes, 128-byte aligned (the driver
/// requires 64; CUDA's own type is declared with 64, TMA descriptors in parameter space are
/// read from their 128-byte aligned copy).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(128))]
pub(crate) struct TensorMap(pub [u64; 16]);

// SAFETY: plain bytes with the size and alignment of the kernel's `const __grid_constant__
// CUtensorMap` parameter (static_assert'ed below); no pointers the driver must translate.
unsafe impl DeviceRepr for TensorMap {}

const _: () = assert!(std::mem::size_of::<TensorMap>() == 128 && std::mem::align_of::<TensorMap>() == 128);

/// Operand layouts as the tensor maps need them, from the launch parameters.
pub(crate) fn layouts(p: &FwdParams) -> [OperandLayout; 3] {
    let l = |seqlen: i32, heads: i32, st: [i64; 3]| OperandLayout {
        batch: p.batch as usize,
        seqlen: seqlen as usize,
        heads: heads as usize,
        head_dim: p.head_dim as usize,
        batch_stride: st[0] as usize,
        row_stride: st[1] as usize,
        head_stride: st[2] as usize,
    };
    [
        l(p.seqlen_q, p.heads_q, [p.q_batch_stride, p.q_row_stride, p.q_head_stride]),
        l(p.seqlen_k, p.heads_kv, [p.k_batch_stride, p.k_row_stride, p.k_head_stride]),
        l(p.seqlen_k, p.heads_kv, [p.v_batch_stride, p.v_row_stride, p.v_head_stride]),
    ]
}

/// The layout preconditions of every stage (docs/fa3.md): 16-byte aligned base addresses and
/// batch/row/head strides that are multiples of 8 elements, for q, k, v and o.
pub(crate) fn check_layout(p: &FwdParams) -> Result<()> {
    let ops = [
        (Operand::Q, p.q, [p.q_batch_stride, p.q_row_stride, p.q_head_stride]),
        (Operand::K, p.k, [p.k_batch_stride, p.k_row_stride, p.k_head_stride]),
        (Operand::V, p.v, [p.v_batch_stride, p.v_row_stride, p.v_head_stride]),
        (Operand::O, p.o, [p.o_batch_stride, p.o_row_stride, p.o_head_stride]),
    ];
    for (op, ptr, strides) in ops {
        if ptr % ADDRESS_ALIGN != 0 {
            return Err(Error::InvalidLayout {
                operand: op,
                reason: format!("FA3 needs a {ADDRESS_ALIGN}-byte aligned device address, got {ptr:#x}"),
            });
        }
        if let Some((name, s)) =
            ["batch", "seqlen", "heads"].into_iter().zip(strides).find(|(_, s)| s % STRIDE_MULTIPLE != 0)
        {
            return Err(Error::InvalidLayout {
                operand: op,
                reason: format!("FA3 needs {name} strides that are multiples of {STRIDE_MULTIPLE} elements (16 bytes), got {s}"),
            });
        }
    }
    Ok(())
}

/// The dtype of a kernel-symbol suffix.
fn dtype_of(name: &str) -> DType {
    if name == "bf16" {
        DType::BF16
    } else {
        DType::F16
    }
}

/// Encodes the Q, K, V tensor maps of a stage-2..5 launch (host-only: no allocation, no
/// device work; the maps embed the addresses, so they are made per call).
fn tensor_maps(stage: u32, dtype: DType, p: &FwdParams) -> Result<[TensorMap; 3]> {
    let [lq, lk, lv] = layouts(p);
    // SAFETY: the addresses are the engine's checked device tensors (live for the launch, the
    // shapes and strides cover only their elements); the context is current (bound by the
    // caller) so the driver is loaded.
    let maps = unsafe { fa3_tma::tensor_maps_for(stage, dtype, [p.q, p.k, p.v], [&lq, &lk, &lv]) }?;
    Ok(maps.map(|m| TensorMap(m.opaque)))
}

/// Launches the FA3 instance `c` (stage `stage`) with `params` on `stream`.
///
/// # Errors
/// [`Error::InvalidLayout`] for layouts the kernels (or TMA) cannot read, [`Error::Cuda`] when
/// a driver call fails.
pub(crate) fn launch(dev: &Device, stream: sys::CUstream, c: &Choice, stage: u32, mut params: FwdParams) -> Result<()> {
    check_layout(&params)?;
    let f = dev.function(c.family, c.tile, c.dtype)?;
    dev.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
    let sms = if stage >= 5 {
        dev.context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err("cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)"))?
            .max(1) as u32
    } else {
        0 // not used by the grid
    };
    let grid = super::plan::launch_grid(c.family, f.tile, &params, sms);
    let block = (f.tile.threads, 1, 1);
    let mut maps = if stage >= 2 { Some(tensor_maps(stage, dtype_of(c.dtype), &params)?) } else { None };
    let p_arg = &mut params as *mut FwdParams as *mut std::ffi::c_void;
    let mut with_maps;
    let mut params_only;
    let args: &mut [*mut std::ffi::c_void] = match maps.as_mut() {
        Some([mq, mk, mv]) => {
            with_maps = [p_arg, mq as *mut TensorMap as _, mk as *mut TensorMap as _, mv as *mut TensorMap as _];
            &mut with_maps
        }
        None => {
            params_only = [p_arg];
            &mut params_only
        }
    };
    // SAFETY: stage 1 takes `const __grid_constant__ FwdParams`, stages 2-5 that plus three
    // `const __grid_constant__ CUtensorMap` (Q, K, V); `args` points at exactly those values,
    // alive for the call (cuLaunchKernel copies them). FwdParams mirrors fa_params.h (size and
    // offsets asserted on both sides), TensorMap is the 128-byte map. Addresses and strides
    // were checked by the engine (within the buffers) and above (alignment); block and dynamic
    // shared memory are the table row's, which the kernel static_asserts against its traits,
    // and the function's shared-memory opt-in was set when it was loaded.
    unsafe { cudarc::driver::result::launch_kernel(f.func, grid, block, f.smem_bytes, stream, args) }
        .map_err(cuda_err("cuLaunchKernel"))
}

#[cfg(test)]
mod tests {
    use super::super::kernels::{fa3_stage, kernel_symbol, FAMILIES, FA3_MAX_STAGE};
    use super::*;
    use crate::options::ForwardOptions;

    /// The table's FA3 rows and fa3_tma's copy of `Fa3Traits` (whose numbers its own test pins
    /// to the ones the C++ traits print) agree on every launch number.
    #[test]
    fn table_rows_match_the_traits() {
        let rows: Vec<_> = FAMILIES.iter().filter(|f| fa3_stage(f.name).is_some()).collect();
        assert_eq!(rows.len(), FA3_MAX_STAGE as usize);
        assert_eq!(FA3_MAX_STAGE, u32::from(crate::problem::FA3_MAX_STAGE));
        for f in rows {
            let stage = fa3_stage(f.name).unwrap();
            assert_eq!((f.variant, f.source, f.min_sm), ("Fa3", "cuda/fa3_fwd_sm90.cu", 90));
            assert!(!f.auto && !f.gpu_verified, "{}: not verified on a GPU yet", f.name);
            assert_eq!(f.tiles.iter().map(|t| t.head_dim as usize).collect::<Vec<_>>(), fa3_tma::FA3_HEAD_DIMS);
            for t in f.tiles {
                let g = fa3_tma::geometry(stage, t.head_dim as usize).unwrap();
                assert_eq!(
                    (t.threads, t.block_m, t.block_n, (f.smem_bytes)(t)),
                    (g.threads, g.block_m, g.block_n, g.smem_bytes),
                    "{} hd{}",
                    f.name,
                    t.head_dim
                );
            }
            let want_tma = stage >= 2;
            assert_eq!(f.sass_expect.contains(&"UTMALDG"), want_tma, "{}", f.name);
            assert_eq!(f.sass_expect.contains(&"SYNCS"), want_tma, "{}", f.name);
            assert_eq!(f.sass_expect.contains(&"USETMAXREG"), stage >= 3, "{}", f.name);
            assert!(f.sass_expect.contains(&"HGMMA"));
        }
        assert_eq!(kernel_symbol("fa3s5", 256, "bf16"), "fa3s5_fwd_hd256_bf16");
        assert_eq!(fa3_stage("fa3s0"), None);
        assert_eq!(fa3_stage("fa3s6"), None);
        assert_eq!(fa3_stage("fa1"), None);
    }

    fn problem(head_dim: usize, opts: &ForwardOptions) -> Problem {
        Problem::from_shapes([1, 100, 4, head_dim], [1, 90, 2, head_dim], [1, 90, 2, head_dim], DType::BF16, opts)
            .unwrap()
    }
    const T128: Tile = Tile { head_dim: 128, block_m: 128, block_n: 128, threads: 384 };

    #[test]
    fn refuses_alibi_and_inexact_head_dims() {
        assert_eq!(refusal(&problem(128, &ForwardOptions::default()), &T128), None);
        let alibi = ForwardOptions::default().alibi_slopes(vec![0.5; 4]);
        assert!(refusal(&problem(128, &alibi), &T128).unwrap().contains("ALiBi"));
        assert!(refusal(&problem(96, &ForwardOptions::default()), &T128).unwrap().contains("exactly"));
    }

    fn params(batch: i32, sq: i32, hq: i32, sk: i32, hk: i32, d: i32) -> FwdParams {
        let (qs, ks) = ((hq * d) as i64, (hk * d) as i64);
        FwdParams {
            q: 0x1000,
            k: 0x2000,
            v: 0x3000,
            o: 0x4000,
            q_batch_stride: sq as i64 * qs,
            q_row_stride: qs,
            q_head_stride: d as i64,
            k_batch_stride: sk as i64 * ks,
            k_row_stride: ks,
            k_head_stride: d as i64,
            v_batch_stride: sk as i64 * ks,
            v_row_stride: ks,
            v_head_stride: d as i64,
            o_batch_stride: sq as i64 * qs,
            o_row_stride: qs,
            o_head_stride: d as i64,
            batch,
            seqlen_q: sq,
            seqlen_k: sk,
            heads_q: hq,
            heads_kv: hk,
            head_dim: d,
            ..FwdParams::default()
        }
    }

    #[test]
    fn layout_preconditions_are_typed_errors() {
        let ok = params(2, 100, 4, 300, 2, 128);
        check_layout(&ok).unwrap();
        let misaligned = FwdParams { k: 0x2008, ..ok };
        assert!(matches!(check_layout(&misaligned), Err(Error::InvalidLayout { operand: Operand::K, .. })));
        let odd_stride = FwdParams { o_row_stride: 4 * 128 + 4, ..ok };
        assert!(matches!(check_layout(&odd_stride), Err(Error::InvalidLayout { operand: Operand::O, .. })));
    }

    #[test]
    fn tensor_map_layouts_follow_the_params() {
        let p = params(2, 100, 4, 300, 2, 128);
        let [lq, lk, lv] = layouts(&p);
        assert_eq!((lq.batch, lq.seqlen, lq.heads, lq.head_dim, lq.row_stride), (2, 100, 4, 128, 512));
        assert_eq!((lk.seqlen, lk.heads, lk.row_stride, lk.batch_stride), (300, 2, 256, 300 * 256));
        assert_eq!(lk, lv);
        let [sq, sk, _] = fa3_tma::tma_specs(4, DType::BF16, &lq, &lk, &lv).unwrap();
        assert_eq!(sq.dims, [128, 4, 100, 2]);
        assert_eq!(sk.box_dims, [64, 1, 128, 1]);
    }
}

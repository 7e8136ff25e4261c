//! Host side of the FA4 ladder (`cuda/fa4_fwd_sm100.cu`, Blackwell sm_100a, rows "fa4s1".. of
//! build/instances.rs): what the kernels refuse, the three TMA tensor maps (Q, K, V with
//! 128-row boxes: one box per 64-column slab of a tile) and the launch. No Blackwell GPU has run
//! these kernels: the rows are not `gpu_verified`, `Auto` never picks them, and an explicit
//! `Variant::Fa4` runs one only when `fa4_stage` names it (dispatch.rs).

use super::device::{cuda_err, Device};
use super::dispatch::Choice;
use super::fa3::TensorMap;
use super::fa3_tma::{self, TmaSpec};
use super::kernels::Tile;
use super::params::FwdParams;
use crate::error::{Error, Operand, Result};
use crate::problem::Problem;
use crate::tensor::DType;
use cudarc::driver::sys;

/// Rows of every TMA box: the 128-row Q tile and the 128-key K/V tiles (`Fa4Traits::kTmaBoxRows`).
const BOX_ROWS: u32 = 128;

/// Why the FA4 kernels cannot run `p` on `tile` (None: they can).
pub(crate) fn refusal(p: &Problem, tile: &Tile) -> Option<String> {
    if p.alibi.is_some() {
        return Some("has no ALiBi (FlashAttention-4 does not implement it; use Fa2 or Fa1)".into());
    }
    // Whole 64-column slabs, no tail mask.
    if p.head_dim != tile.head_dim as usize {
        return Some(format!("runs head_dim 64 or 128 exactly (no masked tail), not {}", p.head_dim));
    }
    None
}

/// The Q, K, V tensor-map specs of a launch (the layouts and TMA rules of fa3_tma, 128-row
/// boxes).
pub(crate) fn tma_specs(dtype: DType, p: &FwdParams) -> Result<[TmaSpec; 3]> {
    if dtype == DType::F32 {
        return Err(Error::UnsupportedDType { dtype, backend: "cuda fa4".into(), supported: "BF16, F16".into() });
    }
    let [lq, lk, lv] = super::fa3::layouts(p);
    let e = dtype.size() as u64;
    let t = if dtype == DType::BF16 { fa3_tma::TMA_DTYPE_BFLOAT16 } else { fa3_tma::TMA_DTYPE_FLOAT16 };
    Ok([
        fa3_tma::tma_spec(Operand::Q, &lq, BOX_ROWS, t, e)?,
        fa3_tma::tma_spec(Operand::K, &lk, BOX_ROWS, t, e)?,
        fa3_tma::tma_spec(Operand::V, &lv, BOX_ROWS, t, e)?,
    ])
}

/// Launches the FA4 instance `c` with `params` on `stream`.
///
/// # Errors
/// [`Error::InvalidLayout`] for layouts the kernels (or TMA) cannot read, [`Error::Cuda`] when a
/// driver call fails.
pub(crate) fn launch(dev: &Device, stream: sys::CUstream, c: &Choice, mut params: FwdParams) -> Result<()> {
    super::fa3::check_layout(&params)?;
    let f = dev.function(c.family, c.tile, c.dtype)?;
    dev.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
    let grid = super::plan::launch_grid(c.family, f.tile, &params, 0);
    let block = (f.tile.threads, 1, 1);
    let dtype = if c.dtype == "bf16" { DType::BF16 } else { DType::F16 };
    let specs = tma_specs(dtype, &params)?;
    // SAFETY: the addresses are the engine's checked device tensors (live for the launch; the
    // shapes and strides cover only their elements); the context is current (bound above).
    let maps = unsafe { fa3_tma::encode_maps(&specs, [params.q, params.k, params.v]) }?;
    let [mut mq, mut mk, mut mv] = maps.map(|m| TensorMap(m.opaque));
    let mut args = [
        &mut params as *mut FwdParams as *mut std::ffi::c_void,
        &mut mq as *mut TensorMap as _,
        &mut mk as *mut TensorMap as _,
        &mut mv as *mut TensorMap as _,
    ];
    // SAFETY: every stage takes `const __grid_constant__ FwdParams` and three `const
    // __grid_constant__ CUtensorMap` (Q, K, V); `args` points at exactly those values, alive for
    // the call (cuLaunchKernel copies them). FwdParams mirrors fa_params.h (size and offsets
    // asserted on both sides), TensorMap is the 128-byte map. Block and dynamic shared memory are
    // the table row's, which the kernel static_asserts against its traits.
    unsafe { cudarc::driver::result::launch_kernel(f.func, grid, block, f.smem_bytes, stream, &mut args) }
        .map_err(cuda_err("cuLaunchKernel"))
}

#[cfg(test)]
mod tests {
    use super::super::kernels::{fa4_stage, FA4_MAX_STAGE, FAMILIES};
    use super::*;
    use crate::options::ForwardOptions;

    #[test]
    fn table_rows_are_unverified_explicit_only_sm100a() {
        let rows: Vec<_> = FAMILIES.iter().filter(|f| fa4_stage(f.name).is_some()).collect();
        assert_eq!(rows.len(), FA4_MAX_STAGE as usize);
        for f in rows {
            assert_eq!((f.variant, f.source, f.min_sm), ("Fa4", "cuda/fa4_fwd_sm100.cu", 100));
            assert!(!f.auto && !f.gpu_verified, "{}: no Blackwell GPU has run it", f.name);
            assert!(f.sass_expect.contains(&"UTCHMMA"), "{}", f.name);
            for t in f.tiles {
                // One 128-row TMA box per Q tile (stage 3 has two) and per K/V tile.
                let q_tiles = if fa4_stage(f.name) == Some(3) { 2 } else { 1 };
                assert_eq!((t.block_m, t.block_n), (q_tiles * BOX_ROWS, BOX_ROWS));
            }
        }
        assert_eq!(fa4_stage("fa4s0"), None);
        assert_eq!(fa4_stage("fa3s1"), None);
    }

    /// The launch the emulator runs (and Engine makes): grid over 128- (stage 3: 256-) row query
    /// tiles, the row's block and shared memory, and three maps with 128-row boxes.
    #[test]
    fn plans_follow_the_table() {
        use super::super::plan::{plan, Operands};
        let (q, k) = ([2, 300, 4, 128], [2, 257, 2, 128]);
        let st = |s: [usize; 4]| [s[1] * s[2] * s[3], s[2] * s[3], s[3]];
        let ops = Operands {
            ptrs: [0x1_0000_0000, 0x2_0000_0000, 0x3_0000_0000, 0x4_0000_0000],
            strides: [st(q), st(k), st(k), st(q)],
            lse: 0,
            alibi: 0,
        };
        let opts = ForwardOptions::default().causal(true);
        let p = Problem::from_shapes(q, k, k, DType::BF16, &opts).unwrap();
        for (fam, grid_x, threads, smem) in
            [("fa4s1", 3, 128, 132_136), ("fa4s2", 3, 512, 169_592), ("fa4s3", 2, 512, 200_840)]
        {
            let pl = plan(fam, &p, &ops, 1).unwrap();
            assert_eq!(pl.kernel, format!("{fam}_fwd_hd128_bf16"));
            assert_eq!((pl.grid, pl.block, pl.smem_bytes), ((grid_x, 4, 2), (threads, 1, 1), smem), "{fam}");
            assert_eq!(pl.tensor_maps.len(), 3);
            assert!(pl.tensor_maps.iter().all(|m| m.spec.box_dims == [64, 1, 128, 1]));
            assert_eq!(pl.tensor_maps[2].global_address, 0x3_0000_0000);
        }
        // ALiBi and inexact head dims are refused by the plan too.
        let alibi = Problem::from_shapes(q, k, k, DType::BF16, &opts.clone().alibi_slopes(vec![0.5; 4])).unwrap();
        assert!(matches!(plan("fa4s2", &alibi, &ops, 1), Err(Error::VariantUnavailable { .. })));
    }

    #[test]
    fn refuses_alibi_and_inexact_head_dims() {
        let t = Tile { head_dim: 128, block_m: 128, block_n: 128, threads: 128 };
        let p = |d: usize, o: &ForwardOptions| {
            Problem::from_shapes([1, 100, 4, d], [1, 90, 2, d], [1, 90, 2, d], DType::BF16, o).unwrap()
        };
        assert_eq!(refusal(&p(128, &ForwardOptions::default()), &t), None);
        assert!(refusal(&p(128, &ForwardOptions::default().alibi_slopes(vec![0.5; 4])), &t).unwrap().contains("ALiBi"));
        assert!(refusal(&p(96, &ForwardOptions::default()), &t).unwrap().contains("exactly"));
    }
}

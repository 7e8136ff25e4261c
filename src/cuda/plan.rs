//! One kernel launch as data: the kernel symbol, grid, block, dynamic shared memory,
//! `FwdParams` and the `cuTensorMapEncodeTiled` arguments of every tensor map, exactly as
//! `Engine` would launch a family on a problem. `Engine` builds its launches from the same
//! pieces (`FwdParams::for_launch`, `launch_grid`, `fa3_tma::tma_specs`); the CPU emulator
//! (cuda/test/emu, driven by tests/emulator.rs) runs the kernel source from a [`LaunchPlan`], so
//! what it checks is what the GPU would be given. Device addresses are whatever the caller says
//! (the emulator maps them onto host buffers).

use super::dispatch::dtype_name;
use super::fa3_tma;
pub use super::fa3_tma::TmaSpec;
use super::kernels::{fa3_stage, fa4_stage, kernel_symbol, Family, Tile, FAMILIES};
use super::params::FwdParams;
use crate::error::{Error, Result};
use crate::problem::Problem;

/// Where q, k, v, o live: device addresses and element strides of (batch, seqlen, heads), plus
/// the LSE and ALiBi buffers (0: none).
#[derive(Clone, Copy, Debug)]
pub struct Operands {
    pub ptrs: [u64; 4],
    pub strides: [[usize; 3]; 4],
    pub lse: u64,
    pub alibi: u64,
}

/// One tensor map: the global address and every other `cuTensorMapEncodeTiled` argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorMapArgs {
    pub global_address: u64,
    pub spec: TmaSpec,
}

/// A launch, as data.
#[derive(Clone, Debug)]
pub struct LaunchPlan {
    pub family: &'static str,
    /// The instance's tile (its head dim may exceed the problem's: FA1 masks the tail).
    pub tile: Tile,
    /// `<family>_fwd_hd<D>_<dtype>`.
    pub kernel: String,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub smem_bytes: u32,
    pub params: FwdParams,
    /// Q, K, V maps for the kernels that take them (FA3 stages 2-5, FA4), else empty.
    pub tensor_maps: Vec<TensorMapArgs>,
}

/// The grid of a launch of `fam`'s instance `tile`: (query tiles, heads_q, batch), or for the
/// persistent FA3 stage (min(`sm_count`, tiles), 1, 1).
pub(crate) fn launch_grid(fam: &Family, tile: &Tile, params: &FwdParams, sm_count: u32) -> (u32, u32, u32) {
    let (b, sq, hq) = (params.batch as usize, params.seqlen_q as usize, params.heads_q as usize);
    let Some(stage) = fa3_stage(fam.name) else {
        return (sq.div_ceil(tile.block_m as usize) as u32, hq as u32, b as u32);
    };
    let g = fa3_tma::Fa3Geometry { threads: tile.threads, block_m: tile.block_m, block_n: tile.block_n, kv_stages: 0, smem_bytes: 0 };
    if stage >= 5 {
        fa3_tma::persistent_grid(&g, b, sq, hq, sm_count.max(1) as usize)
    } else {
        fa3_tma::grid(&g, b, sq, hq)
    }
}

/// The launch `Engine` would make of family `family` (a row name of build/instances.rs, e.g.
/// "fa2", "fa3s4") for problem `p` on `ops`; `sm_count` sizes the persistent FA3 grid.
///
/// # Errors
/// What the launch path refuses: an unknown family, a dtype or head dim the family has no
/// instance for, the family's own preconditions (`Error::VariantUnavailable`), and the layout
/// and TMA rules (`Error::InvalidLayout`).
pub fn plan(family: &str, p: &Problem, ops: &Operands, sm_count: u32) -> Result<LaunchPlan> {
    let unavailable = |reason: String| Error::VariantUnavailable { variant: p_variant(family), reason };
    let fam = FAMILIES.iter().find(|f| f.name == family).ok_or_else(|| unavailable(format!("no family {family:?} in the table")))?;
    let dtype = dtype_name(p.dtype).ok_or_else(|| unavailable(format!("{family} takes f16/bf16, not {:?}", p.dtype)))?;
    let tile = fam
        .tiles
        .iter()
        .find(|t| t.head_dim as usize >= p.head_dim)
        .ok_or_else(|| unavailable(format!("{family} has no instance for head_dim {}", p.head_dim)))?;
    let stage = fa3_stage(fam.name);
    if stage.is_some() {
        if let Some(why) = super::fa3::refusal(p, tile) {
            return Err(unavailable(format!("{family} {why}")));
        }
    }
    if fa4_stage(fam.name).is_some() {
        if let Some(why) = super::fa4::refusal(p, tile) {
            return Err(unavailable(format!("{family} {why}")));
        }
    }
    if fam.name == "fa2" {
        if let Some(why) = super::fa2::problem_unmet(tile, p) {
            return Err(unavailable(why.into()));
        }
    }
    if let Some(why) = super::dispatch::layout_unmet(fam, ops.ptrs, ops.strides) {
        return Err(unavailable(why.into()));
    }
    let params = FwdParams::for_launch(p, ops.ptrs, ops.strides, ops.lse, ops.alibi);
    let mut tensor_maps = Vec::new();
    if let Some(stage) = stage {
        super::fa3::check_layout(&params)?;
        if stage >= 2 {
            let [lq, lk, lv] = super::fa3::layouts(&params);
            let specs = fa3_tma::tma_specs(stage, p.dtype, &lq, &lk, &lv)?;
            for (spec, addr) in specs.into_iter().zip([params.q, params.k, params.v]) {
                tensor_maps.push(TensorMapArgs { global_address: addr, spec });
            }
        }
    }
    if fa4_stage(fam.name).is_some() {
        super::fa3::check_layout(&params)?;
        let specs = super::fa4::tma_specs(p.dtype, &params)?;
        for (spec, addr) in specs.into_iter().zip([params.q, params.k, params.v]) {
            tensor_maps.push(TensorMapArgs { global_address: addr, spec });
        }
    }
    Ok(LaunchPlan {
        family: fam.name,
        tile: *tile,
        kernel: kernel_symbol(fam.name, tile.head_dim, dtype),
        grid: launch_grid(fam, tile, &params, sm_count),
        block: (tile.threads, 1, 1),
        smem_bytes: (fam.smem_bytes)(tile),
        params,
        tensor_maps,
    })
}

/// The variant a family row implements (for the error).
fn p_variant(family: &str) -> crate::options::Variant {
    use crate::options::Variant;
    match FAMILIES.iter().find(|f| f.name == family).map(|f| f.variant) {
        Some("Fa1") => Variant::Fa1,
        Some("Fa2") => Variant::Fa2,
        Some("Fa3") => Variant::Fa3,
        Some("Fa4") => Variant::Fa4,
        _ => Variant::Auto,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::{ForwardOptions, Mask};
    use crate::tensor::DType;

    fn contiguous(s: [usize; 4]) -> [usize; 3] {
        [s[1] * s[2] * s[3], s[2] * s[3], s[3]]
    }

    fn ops(q: [usize; 4], k: [usize; 4]) -> Operands {
        Operands {
            ptrs: [0x1_0000_0000, 0x2_0000_0000, 0x3_0000_0000, 0x4_0000_0000],
            strides: [contiguous(q), contiguous(k), contiguous(k), contiguous(q)],
            lse: 0x5_0000_0000,
            alibi: 0,
        }
    }

    #[test]
    fn fa3_plans_follow_the_table_and_the_tma_specs() {
        let (q, k) = ([2, 130, 4, 128], [2, 257, 2, 128]);
        let opts = ForwardOptions::default().mask(Mask::window(i64::MAX, 3)).return_lse(true);
        let p = Problem::from_shapes(q, k, k, DType::BF16, &opts).unwrap();
        let pl = plan("fa3s4", &p, &ops(q, k), 132).unwrap();
        assert_eq!(pl.kernel, "fa3s4_fwd_hd128_bf16");
        assert_eq!((pl.grid, pl.block, pl.smem_bytes), ((2, 4, 2), (384, 1, 1), 164944));
        // Problem::new clamps a bound past the sequence to the sequence (left <= seqlen_k: the
        // same keys); the right side stays.
        assert_eq!((pl.params.window_left, pl.params.window_right), (257, 3));
        assert_eq!(pl.tensor_maps.len(), 3);
        assert_eq!(pl.tensor_maps[1].global_address, 0x2_0000_0000);
        assert_eq!(pl.tensor_maps[1].spec.box_dims, [64, 1, 128, 1]);
        assert_eq!(pl.tensor_maps[0].spec.dims, [128, 4, 130, 2]);
        // Stage 5: persistent grid of min(SMs, tiles); stage 1 takes no maps.
        let p5 = plan("fa3s5", &p, &ops(q, k), 3).unwrap();
        assert_eq!(p5.grid, (3, 1, 1));
        assert!(plan("fa3s1", &p, &ops(q, k), 1).unwrap().tensor_maps.is_empty());
        // FA1 masks a head-dim tail; FA2 and FA3 refuse it.
        let p100 = Problem::from_shapes([1, 9, 1, 100], [1, 9, 1, 100], [1, 9, 1, 100], DType::F16, &ForwardOptions::default()).unwrap();
        let o100 = ops([1, 9, 1, 104], [1, 9, 1, 104]);
        assert_eq!(plan("fa1", &p100, &o100, 1).unwrap().kernel, "fa1_fwd_hd128_f16");
        assert!(matches!(plan("fa2", &p100, &o100, 1), Err(Error::VariantUnavailable { .. })));
        assert!(matches!(plan("fa3s2", &p100, &o100, 1), Err(Error::VariantUnavailable { .. })));
        assert!(matches!(plan("fa9", &p100, &o100, 1), Err(Error::VariantUnavailable { .. })));
    }
}

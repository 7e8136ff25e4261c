//! Building [`LaunchPlan`]s. `plan_instance` is the one builder: block and shared memory from
//! the table row, grid and tensor maps from the family's host rules; `Engine` launches what it
//! returns. [`plan`], [`plan_serving`] and [`plan_append`] give the plan `Engine` would launch for
//! a named family (a row of build/instances.rs), by the same rules (the family's refusals,
//! `FwdParams::for_launch`), for the CPU emulator (cuda/test/emu, driven by tests/emulator/forward.rs),
//! so what the emulator checks is what the GPU would be given. Device addresses are whatever the
//! caller says (the emulator maps them onto host buffers).

use super::hosts::family_host;
use super::launch::dtype_name;
pub use super::launch::{LaunchPlan, TensorMapArgs};
pub use super::params::{Fp8CacheScales, FwdParams, Operands, RotaryOperands, ServingOperands};
use super::select::layout_error;
use super::table::{Family, Tile, FAMILIES};
use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::options::Variant;
use crate::problem::Problem;
use crate::batch_layout::BatchLayout;

/// The launch `Engine` would make of family `family` (a row name of build/instances.rs, e.g.
/// "fa2", "fa3s4") for problem `p` on `ops`; `sm_count` sizes a persistent grid.
///
/// # Errors
/// What the launch path refuses: an unknown family, a dtype or head dim the family has no
/// instance for, the family's problem refusal (`Error::VariantUnavailable`), its layout refusal
/// and the TMA rules (`Error::InvalidLayout`).
pub fn plan(family: &str, p: &Problem, ops: &Operands, sm_count: u32) -> Result<LaunchPlan> {
    plan_params(family, p, ops, FwdParams::for_launch(p, ops), sm_count)
}

/// The launch of a serving call: `p` as `serving::prepare` builds it (the layout's batch and
/// longest sequences), the validated `layout`, its index buffers at `s`, `num_splits` key splits
/// (1: none). Parameters from `FwdParams::for_serving`; the family's serving refusal applies.
///
/// # Errors
/// As [`plan`], plus `for_serving`'s and the family's serving refusal
/// (`Error::VariantUnavailable`).
pub fn plan_serving(
    family: &str,
    p: &Problem,
    layout: &BatchLayout<'_>,
    ops: &Operands,
    s: &ServingOperands,
    num_splits: usize,
    sm_count: u32,
) -> Result<LaunchPlan> {
    let params = FwdParams::for_serving(p, layout, ops, s, num_splits)?;
    plan_params(family, p, ops, params, sm_count)
}

/// The launch of the serving KV append kernel (cuda/common/append_kv.cuh) for a layout with new
/// rows: grid (seqlen_new, heads_kv, batch), `kFaAppendThreads` threads, no shared memory, in the
/// `APPEND_KV_FAMILY` (FA2) image of the smallest head dim unit that holds `p.head_dim` (the
/// kernel copies `head_dim` elements per row, element by element: any head dim, any alignment).
/// It runs before the attention launch on the same stream. With `s.rotary` it also rotates q
/// into the scratch `q_rot` (the launch's o, contiguous): grid (max(seqlen_new, seqlen_q),
/// heads_kv + heads_q, batch), the blocks past heads_kv rotating q's rows; the attention then
/// reads q from `q_rot`.
///
/// # Errors
/// `for_serving`'s errors; `Error::InvalidSeqLayout` when the layout appends nothing or is not a
/// cache; `Error::UnsupportedDType` for dtypes other than f16/bf16.
pub fn plan_append(p: &Problem, layout: &BatchLayout<'_>, ops: &Operands, s: &ServingOperands) -> Result<LaunchPlan> {
    use crate::batch_layout::KvLayout;
    let new = match layout.kv_layout() {
        KvLayout::Cache { new, .. } | KvLayout::Paged { new, .. } => new,
        _ => 0,
    };
    if new == 0 {
        return Err(Error::InvalidSeqLayout {
            what: "append".into(),
            got: "a layout with no new rows".into(),
            expected: "a dense or paged cache with seqlen_new >= 1 rows to append".into(),
        });
    }
    let mut params = FwdParams::for_serving(p, layout, ops, s, 1)?;
    let fam = FAMILIES.iter().find(|f| f.name == super::table::APPEND_KV_FAMILY).expect("the append family is in the table");
    // The kernel copies FwdParams::head_dim (and head_dim_v) elements per row, whatever its unit:
    // the smallest unit that holds the head_dim, else the largest (MLA's 576 runs on hd 512's).
    let holds = fam.tiles.iter().filter(|t| t.head_dim as usize >= p.head_dim).min_by_key(|t| t.head_dim);
    let tile = holds.or_else(|| fam.tiles.iter().max_by_key(|t| t.head_dim)).ok_or_else(|| {
        Error::VariantUnavailable { variant: Variant::Auto, reason: "the append family has no unit".into() }
    })?;
    let (mut rows, mut heads) = (new, p.heads_kv);
    if let Some(r) = s.rotary.filter(|_| params.rotary_dim > 0) {
        if r.q_rot == 0 {
            return Err(Error::InvalidSeqLayout {
                what: "q_rot".into(),
                got: "no device address (0)".into(),
                expected: "the q-shaped scratch the append launch rotates q into".into(),
            });
        }
        let (hq, d) = (p.heads_q as i64, p.head_dim as i64);
        params.o = r.q_rot;
        (params.o_batch_stride, params.o_row_stride, params.o_head_stride) = (p.seqlen_q as i64 * hq * d, hq * d, d);
        (rows, heads) = (new.max(p.seqlen_q), p.heads_kv + p.heads_q);
    }
    let mut pl = plan_instance(fam, tile, p.dtype, params, 1)?;
    pl.grid = (rows as u32, heads as u32, p.batch as u32);
    pl.block = (APPEND_KV_THREADS, 1, 1);
    pl.smem_bytes = 0;
    pl.tensor_maps = Default::default();
    pl.append_kv = true;
    Ok(pl)
}

/// Threads of the append kernel (`kFaAppendThreads`, cuda/common/append_kv.cuh).
pub const APPEND_KV_THREADS: u32 = 128;

fn plan_params(family: &str, p: &Problem, ops: &Operands, params: FwdParams, sm_count: u32) -> Result<LaunchPlan> {
    let Some(fam) = FAMILIES.iter().find(|f| f.name == family) else {
        let reason = format!("no family {family:?} in the table");
        return Err(Error::VariantUnavailable { variant: Variant::Auto, reason });
    };
    let unavailable = |why: String| Error::VariantUnavailable { variant: fam.variant.into(), reason: format!("{family} {why}") };
    let tile = fam
        .tiles
        .iter()
        .find(|t| t.head_dim as usize >= p.head_dim)
        .ok_or_else(|| unavailable(format!("has no instance for head_dim {}", p.head_dim)))?;
    if let Some(why) = family_host(fam).refusal(fam, tile, p) {
        return Err(unavailable(why.into()));
    }
    if params.is_serving() {
        if let Some(why) = family_host(fam).serving_refusal(fam, tile, &params) {
            return Err(unavailable(why.into()));
        }
    }
    if let Some(r) = family_host(fam).layout_refusal(ops) {
        return Err(layout_error(family, r));
    }
    plan_instance(fam, tile, p.dtype, params, sm_count)
}

/// The launch of `fam`'s instance `tile` on `dtype` data with `params`: block and shared memory
/// from the table row, grid and tensor maps from the family's host rules (`sm_count` sizes a
/// persistent grid).
///
/// # Errors
/// [`Error::UnsupportedDType`] for a dtype the kernels do not take; the family's tensor-map
/// errors ([`Error::InvalidLayout`]).
pub(crate) fn plan_instance(
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
        grid: family_host(fam).grid(fam, tile, &params, sm_count),
        block: (tile.threads, 1, 1),
        smem_bytes: fam.smem_bytes(tile),
        params,
        tensor_maps: family_host(fam).tensor_maps(fam, dtype, &params)?,
        note: family_host(fam).launch_note(fam, tile, &params),
        append_kv: false,
    })
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
            sinks: 0,
        }
    }

    #[test]
    fn fa3_plans_follow_the_table_and_the_tma_specs() {
        let (q, k) = ([2, 130, 4, 128], [2, 257, 2, 128]);
        let opts = ForwardOptions::default().mask(Mask::window(i64::MAX, 3)).return_lse(true);
        let p = Problem::from_shapes(q, k, k, DType::BF16, &opts).unwrap();
        let pl = plan("fa3s4", &p, &ops(q, k), 132).unwrap();
        assert_eq!(pl.kernel(), "fa3s4_fwd_hd128_bf16");
        assert_eq!((pl.grid, pl.block, pl.smem_bytes), ((2, 4, 2), (384, 1, 1), 169040));
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
        let p100 = Problem::from_shapes([1, 9, 1, 100], [1, 9, 1, 100], [1, 9, 1, 100], DType::F16, &ForwardOptions::default())
            .unwrap();
        let o100 = ops([1, 9, 1, 104], [1, 9, 1, 104]);
        assert_eq!(plan("fa1", &p100, &o100, 1).unwrap().kernel(), "fa1_fwd_hd128_f16");
        assert!(matches!(plan("fa2", &p100, &o100, 1), Err(Error::VariantUnavailable { .. })));
        assert!(matches!(plan("fa3s2", &p100, &o100, 1), Err(Error::VariantUnavailable { .. })));
        assert!(matches!(plan("fa9", &p100, &o100, 1), Err(Error::VariantUnavailable { .. })));
    }

    /// FA2 plans every serving layout (grid z = batch x splits, the append kernel on its own
    /// grid); a family without a serving path refuses with a typed reason.
    #[test]
    fn serving_plans() {
        use crate::batch_layout::{BatchLayout, KvLayout, QueryLayout};
        let (table, seqlens) = ([1, 0, 2, 3], [3, 4]);
        let kv = KvLayout::Paged { block_table: &table, max_blocks_per_seq: 2, seqlens: &seqlens, new: 1 };
        let l = BatchLayout::new(QueryLayout::Dense, [2, 1, 8, 64], kv, [4, 3, 2, 64]).unwrap();
        let p = l.launch_problem(8, 2, 64, DType::F16, &ForwardOptions::default()).unwrap();
        let o = ops([2, 1, 8, 64], [4, 3, 2, 64]);
        let s = ServingOperands {
            seqused_k: 0x6_0000_0000,
            block_table: 0x7_0000_0000,
            knew: 0x8_0000_0000,
            vnew: 0x9_0000_0000,
            new_strides: [contiguous([2, 1, 2, 64]); 2],
            o_accum: 0xA_0000_0000,
            lse_accum: 0xB_0000_0000,
            ..ServingOperands::default()
        };
        let pl = plan_serving("fa2", &p, &l, &o, &s, 3, 1).unwrap();
        assert_eq!((pl.kernel(), pl.grid), ("fa2_fwd_hd64_f16".to_string(), (1, 8, 6)));
        assert_eq!((pl.params.page_size, pl.params.seqlen_new, pl.params.num_splits), (3, 1, 3));
        let ap = plan_append(&p, &l, &o, &s).unwrap();
        assert_eq!((ap.kernel(), ap.grid, ap.block, ap.smem_bytes), ("fa_append_kv_hd64_f16".to_string(), (1, 2, 2), (128, 1, 1), 0));
        // With a rotary the append also rotates q's rows into the scratch (its o, contiguous).
        let rot = RotaryOperands { cos: 0xC, sin: 0xD, rotary_dim: 64, q_rot: 0xE, ..Default::default() };
        let ap = plan_append(&p, &l, &o, &ServingOperands { rotary: Some(rot), ..s }).unwrap();
        assert_eq!((ap.grid, ap.params.o, ap.params.o_row_stride, ap.params.rotary_dim), ((1, 10, 2), 0xE, 8 * 64, 64));
        let no_scratch = ServingOperands { rotary: Some(RotaryOperands { q_rot: 0, ..rot }), ..s };
        assert!(matches!(plan_append(&p, &l, &o, &no_scratch), Err(Error::InvalidSeqLayout { .. })));
        // FA1 and FA2 serve every layout; FA3's stages 1-2 do not.
        let e = plan_serving("fa3s1", &p, &l, &o, &s, 1, 1).unwrap_err();
        assert!(matches!(e, Error::VariantUnavailable { .. }) && e.to_string().contains("varlen"), "{e}");
    }

    #[test]
    fn layout_refusals_are_layout_errors() {
        let s = [1, 64, 2, 64];
        let p = Problem::from_shapes(s, s, s, DType::F16, &ForwardOptions::default()).unwrap();
        let misaligned = Operands { ptrs: [0x1000, 0x2008, 0x3000, 0x4000], ..ops(s, s) };
        let e = plan("fa2", &p, &misaligned, 1).unwrap_err();
        assert!(matches!(e, Error::InvalidLayout { operand: crate::Operand::K, .. }), "{e}");
        assert!(plan("fa1", &p, &misaligned, 1).is_ok());
    }
}

//! Host side of the FA4 ladder (`cuda/fa4_fwd_sm100.cu` over `cuda/fa4/`, Blackwell sm_100a, rows "fa4s1".. of
//! build/instances.rs, each with its `stage`): what the kernels refuse, their layout rule and the
//! three TMA tensor maps every stage takes after `FwdParams` (Q, K, V with 128-row boxes: one box
//! per 64-column slab of a tile), as data (`driver.rs` encodes them and launches). The grid is the
//! default one over `block_m`-row query tiles (stage 3: 256 rows, two ping-pong Q tiles).
//!
//! No Blackwell GPU has run these kernels: the rows are not `gpu_verified`, `Auto` never picks
//! them, and an explicit `Variant::Fa4` runs a stage only when `fa4_stage` names it
//! ([`Fa4::refusal`]; docs/fa4.md has the status).

use super::family::{chunked_rows_refusal, FamilyHost, LayoutRefusal};
use super::fa3::{layouts, tma};
use super::launch::{TensorMaps, TMA_DTYPE_BFLOAT16, TMA_DTYPE_FLOAT16};
use super::params::{FwdParams, Operands};
use super::table::{Family, Tile};
use crate::error::{Error, Operand, Result};
use crate::problem::Problem;
use crate::tensor::DType;

/// Rows of every TMA box: the 128-row Q tile and the 128-key K/V tiles (`Fa4Traits::kTmaBoxRows`).
const BOX_ROWS: u32 = 128;

/// The FA4 ladder's host rules (every stage).
#[derive(Debug)]
pub(crate) struct Fa4;

impl FamilyHost for Fa4 {
    fn refusal(&self, fam: &Family, tile: &Tile, p: &Problem) -> Option<&'static str> {
        // Never run on a GPU: a stage runs only when the caller names it (not by a variant
        // request alone, never by Auto).
        if p.fa4_stage.is_none() || p.fa4_stage != fam.stage {
            return Some(
                "FA4 needs fa4_stage naming this stage (the FA4 tcgen05 kernels have not run on a GPU; \
                 Variant::Fa4 alone runs none)",
            );
        }
        if p.alibi.is_some() {
            return Some("FA4 needs a problem without ALiBi (FlashAttention-4 does not implement it; use Fa2 or Fa1)");
        }
        // The kernels load and multiply whole 64-column slabs with no tail mask.
        (p.head_dim != tile.head_dim as usize).then_some("FA4 needs head_dim 64 or 128 exactly (no masked tail)")
    }

    /// TMA's rule: 16-byte aligned base addresses, strides of 8 elements (for o too: the
    /// epilogue stores 16-byte row chunks).
    fn layout_refusal(&self, ops: &Operands) -> Option<LayoutRefusal> {
        let r = chunked_rows_refusal(ops)?;
        let i = [Operand::Q, Operand::K, Operand::V, Operand::O].iter().position(|&o| o == r.operand).unwrap_or(0);
        let why = if !ops.ptrs[i].is_multiple_of(16) {
            "FA4 needs q/k/v/o 16-byte aligned (TMA loads, 16-byte row chunks)"
        } else {
            "FA4 needs every batch/row/head stride a multiple of 8 elements (TMA, 16-byte row chunks)"
        };
        Some(LayoutRefusal { operand: r.operand, why })
    }

    fn tensor_maps(&self, _fam: &Family, dtype: DType, params: &FwdParams) -> Result<TensorMaps> {
        Ok(TensorMaps::new(tma_specs(dtype, params)?, [params.q, params.k, params.v]))
    }
}

/// The Q, K, V tensor-map specs of a launch (the layouts and TMA rules of the FA3 maps, 128-row
/// boxes).
fn tma_specs(dtype: DType, p: &FwdParams) -> Result<[crate::cuda::launch::TmaSpec; 3]> {
    let t = match dtype {
        DType::BF16 => TMA_DTYPE_BFLOAT16,
        DType::F16 => TMA_DTYPE_FLOAT16,
        _ => return Err(Error::UnsupportedDType { dtype, backend: "cuda fa4".into(), supported: "BF16, F16".into() }),
    };
    let [lq, lk, lv] = layouts(p);
    let e = dtype.size() as u64;
    Ok([
        tma::tma_spec(Operand::Q, &lq, BOX_ROWS, t, e)?,
        tma::tma_spec(Operand::K, &lk, BOX_ROWS, t, e)?,
        tma::tma_spec(Operand::V, &lv, BOX_ROWS, t, e)?,
    ])
}

#[cfg(test)]
mod tests {
    use super::super::plan::plan;
    use super::super::table::{unit_source, KernelOptions, KernelVariant, SoftmaxParams, FA4_MAX_STAGE, FAMILIES};
    use super::*;
    use crate::options::{ForwardOptions, Variant};

    fn rows() -> Vec<&'static Family> {
        // The tcgen05 ladder (FA4's softmax on the FA2 / FA3 pipelines has rows of variant Fa4
        // too, on those sources: select/tests.rs).
        FAMILIES.iter().filter(|f| f.variant == KernelVariant::Fa4 && f.ladder_stage().is_some()).collect()
    }

    #[test]
    fn table_rows_are_unverified_explicit_only_sm100a() {
        let rows = rows();
        assert_eq!(rows.len(), FA4_MAX_STAGE as usize);
        assert_eq!(FA4_MAX_STAGE, crate::problem::FA4_MAX_STAGE);
        for (f, want_stage) in rows.into_iter().zip(1..) {
            assert_eq!((f.stage, f.name), (Some(want_stage), format!("fa4s{want_stage}").as_str()));
            assert_eq!((f.source(), f.min_sm), ("cuda/fa4_fwd_sm100.cu", 100));
            assert!(!f.auto && !f.gpu_verified, "{}: no Blackwell GPU has run it", f.name);
            assert!(f.sass_expect.contains(&"UTCHMMA"), "{}", f.name);
            // Every stage folds attention sinks in its epilogue; stage 3 runs FA4's softmax, with
            // the parameters the build passes to the kernel.
            let unit = unit_source(f, &f.tiles[0], "x.cu", false);
            if want_stage == 3 {
                assert_eq!(f.options, KernelOptions::EXP2_POLY.union(KernelOptions::LAZY_RESCALE).union(KernelOptions::SINKS));
                assert_eq!(f.softmax, SoftmaxParams { poly_degree: 3, poly_every: 8, lazy_tau: 8.0 });
                for define in ["FA_EXP2_POLY_DEGREE 3\n", "FA_EXP2_POLY_EVERY 8\n", "FA_LAZY_TAU 8.0f\n"] {
                    assert!(unit.contains(&format!("#define {define}")), "{unit}");
                }
            } else {
                assert_eq!((f.options, f.softmax), (KernelOptions::SINKS, SoftmaxParams::NONE), "{}", f.name);
                assert!(!unit.contains("FA_EXP2_POLY") && !unit.contains("FA_LAZY_TAU"), "{unit}");
            }
            for t in f.tiles {
                // One 128-row TMA box per Q tile (stage 3 has two) and per K/V tile.
                let q_tiles = if want_stage == 3 { 2 } else { 1 };
                assert_eq!((t.block_m, t.block_n), (q_tiles * BOX_ROWS, BOX_ROWS));
            }
        }
    }

    fn ops(q: [usize; 4], k: [usize; 4]) -> Operands {
        let st = |s: [usize; 4]| [s[1] * s[2] * s[3], s[2] * s[3], s[3]];
        Operands {
            ptrs: [0x1_0000_0000, 0x2_0000_0000, 0x3_0000_0000, 0x4_0000_0000],
            strides: [st(q), st(k), st(k), st(q)],
            lse: 0,
            alibi: 0,
            sinks: 0,
        }
    }

    /// The launch the emulator runs (and Engine makes): grid over 128- (stage 3: 256-) row query
    /// tiles, the row's block and shared memory, and three maps with 128-row boxes.
    #[test]
    fn plans_follow_the_table() {
        let (q, k) = ([2, 300, 4, 128], [2, 257, 2, 128]);
        let fa4 = |stage: u8| ForwardOptions::default().causal(true).variant(Variant::Fa4).fa4_stage(stage);
        for (stage, grid_x, threads, smem) in [(1, 3, 128, 132_136), (2, 3, 512, 169_592), (3, 2, 512, 200_840)] {
            let fam = format!("fa4s{stage}");
            let p = Problem::from_shapes(q, k, k, DType::BF16, &fa4(stage)).unwrap();
            let pl = plan(&fam, &p, &ops(q, k), 1).unwrap();
            assert_eq!(pl.kernel(), format!("{fam}_fwd_hd128_bf16"));
            assert_eq!((pl.grid, pl.block, pl.smem_bytes), ((grid_x, 4, 2), (threads, 1, 1), smem), "{fam}");
            assert_eq!(pl.tensor_maps.len(), 3);
            assert!(pl.tensor_maps.iter().all(|m| m.spec.box_dims == [64, 1, 128, 1]));
            assert_eq!(pl.tensor_maps[2].global_address, 0x3_0000_0000);
            // Another stage's plan is refused: the stage is the caller's to name.
            let other = format!("fa4s{}", stage % FA4_MAX_STAGE + 1);
            assert!(matches!(plan(&other, &p, &ops(q, k), 1), Err(Error::VariantUnavailable { .. })));
        }
        // ALiBi is refused by the plan too.
        let alibi = Problem::from_shapes(q, k, k, DType::BF16, &fa4(2).alibi_slopes(vec![0.5; 4])).unwrap();
        assert!(matches!(plan("fa4s2", &alibi, &ops(q, k), 1), Err(Error::VariantUnavailable { .. })));
    }

    #[test]
    fn refusals_say_what_fa4_needs() {
        let (s1, s2) = (rows()[0], rows()[1]);
        let t = Tile { head_dim: 128, head_dim_v: 128, block_m: 128, block_n: 128, threads: 128 };
        let p = |d: usize, o: ForwardOptions| {
            Problem::from_shapes([1, 100, 4, d], [1, 90, 2, d], [1, 90, 2, d], DType::BF16, &o).unwrap()
        };
        let fa4 = |stage: u8| ForwardOptions::default().variant(Variant::Fa4).fa4_stage(stage);
        assert_eq!(Fa4.refusal(s1, &t, &p(128, fa4(1))), None);
        let why = Fa4.refusal(s2, &t, &p(128, fa4(1))).unwrap();
        assert!(why.starts_with("FA4 needs fa4_stage"), "{why}");
        let why = Fa4.refusal(s1, &t, &p(128, ForwardOptions::default().variant(Variant::Fa4))).unwrap();
        assert!(why.starts_with("FA4 needs fa4_stage"), "{why}");
        let why = Fa4.refusal(s1, &t, &p(128, fa4(1).alibi_slopes(vec![0.5; 4]))).unwrap();
        assert!(why.starts_with("FA4 needs") && why.contains("ALiBi"), "{why}");
        let why = Fa4.refusal(s1, &t, &p(96, fa4(1))).unwrap();
        assert!(why.starts_with("FA4 needs") && why.contains("exactly"), "{why}");
    }

    #[test]
    fn layout_refusals_name_the_operand_and_fa4() {
        let s = [1, 100, 4, 128];
        let ok = ops(s, s);
        assert_eq!(Fa4.layout_refusal(&ok), None);
        let r = Fa4.layout_refusal(&Operands { ptrs: [0x1000, 0x2008, 0x3000, 0x4000], ..ok }).unwrap();
        assert_eq!(r.operand, Operand::K);
        assert!(r.why.starts_with("FA4 needs") && r.why.contains("aligned"), "{}", r.why);
        let odd = Operands { strides: [ok.strides[0], ok.strides[1], ok.strides[2], [51200, 516, 128]], ..ok };
        let r = Fa4.layout_refusal(&odd).unwrap();
        assert_eq!(r.operand, Operand::O);
        assert!(r.why.starts_with("FA4 needs") && r.why.contains("stride"), "{}", r.why);
        // Through the plan, a layout refusal is an InvalidLayout error naming the operand.
        let p = Problem::from_shapes(s, s, s, DType::BF16, &ForwardOptions::default().variant(Variant::Fa4).fa4_stage(1))
            .unwrap();
        let e = plan("fa4s1", &p, &odd, 1).unwrap_err();
        assert!(matches!(&e, Error::InvalidLayout { operand: Operand::O, reason } if reason.contains("FA4 needs")), "{e}");
    }
}

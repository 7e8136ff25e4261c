//! Host side of the FA3 stage ladder (`cuda/fa3_fwd_sm90.cu`, rows "fa3s1".."fa3s5" of
//! build/instances.rs, each with its `stage`): what the kernels refuse, their layout rule, the
//! persistent grid of stage 5 (min(SMs, tiles) CTAs), and the three TMA tensor maps stages 2-5
//! take after `FwdParams`, as data (`launch.rs` encodes them per launch from the device
//! pointers and strides: host-only, no allocation). Tiles and shared memory come from the table
//! rows; `tma` repeats the `Fa3Traits` arithmetic and its tests pin the two together.

pub(crate) mod tma;

use super::family::{chunked_rows_refusal, tile_grid, FamilyHost, Grid, LayoutRefusal};
use super::launch::TensorMaps;
use super::params::{FwdParams, Operands, FLAG_KV_FP8};
use super::table::{Family, Tile, FA3_MLA_PREFILL};
use crate::error::Result;
use crate::problem::Problem;
use crate::tensor::DType;
use tma::OperandLayout;

/// The first stage on a persistent grid.
const PERSISTENT_STAGE: u8 = 5;
/// The first stage that runs the serving layouts (warp-specialised: the producer warpgroup's
/// threads gather what TMA cannot load; `Fa3Traits::kServing`).
const SERVING_STAGE: u8 = 3;
/// The largest V head dim with a serving path (`Fa3Traits::kServing`: at 256 the consumers have
/// no registers to spare; O's columns are V's, so (192, 128) has one).
const SERVING_MAX_HEAD_DIM_V: u32 = 128;
/// The first stage that loads through TMA (and takes the tensor maps).
const TMA_STAGE: u8 = 2;

/// The FA3 ladder's host rules (every stage).
#[derive(Debug)]
pub(crate) struct Fa3;

/// The stage of an FA3 row (every row of the ladder has one).
fn stage(fam: &Family) -> u8 {
    fam.stage.unwrap_or(1)
}

impl FamilyHost for Fa3 {
    fn refusal(&self, _fam: &Family, tile: &Tile, p: &Problem) -> Option<&'static str> {
        if p.alibi.is_some() {
            return Some("has no ALiBi (FlashAttention-3 does not implement it; use Fa2 or Fa1)");
        }
        // The kernels load and multiply whole 64-column slabs with no tail mask.
        if p.head_dim != tile.head_dim as usize {
            return Some("runs head_dim 64, 128 or 256 exactly (no masked tail), and (192, 128) at stage 5");
        }
        // V's head dim is the instance's: Q/K's, or 128 in the (192, 128) one (`FA_HEAD_DIM_V`).
        (p.head_dim_v != tile.head_dim_v as usize).then_some(if tile.head_dim == FA3_MLA_PREFILL.0 {
            "runs head_dim 192 only with V head_dim 128 (DeepSeek MLA prefill's (192, 128), stage 5)"
        } else {
            "runs V head_dim == Q/K head_dim (64, 128, 256), or (192, 128) at stage 5"
        })
    }

    /// Stages 3-5 at head_dim 64 and 128 (and stage 5's (192, 128)) run packed batches, dense
    /// caches with cache_seqlens and paged caches of any page size, f16/bf16 or FP8
    /// (`cuda/fa3/serving.cuh`), after an append; not split-KV.
    fn serving_refusal(&self, fam: &Family, tile: &Tile, params: &FwdParams) -> Option<&'static str> {
        if stage(fam) < SERVING_STAGE {
            return Some("stages 1-2 have no varlen / KV-cache path (stages 3-5 have: docs/fa3.md)");
        }
        if tile.head_dim_v > SERVING_MAX_HEAD_DIM_V {
            return Some(concat!(
                "runs varlen / KV caches at head_dim 64, 128 and (192, 128) only ",
                "(at 256 its consumers have no registers to spare)"
            ));
        }
        // An append (seqlen_new > 0) is its own kernel, launched first (fa_append_kv): the
        // attention then reads cache_seqlens + seqlen_new keys, as fa_seq counts them.
        (params.num_splits > 1).then_some("has no split-KV (num_splits > 1)")
    }

    /// 16-byte aligned base addresses and strides of 8 elements: stage 1's 16-byte vector
    /// loads, and TMA's stride rule from stage 2 on.
    fn layout_refusal(&self, ops: &Operands) -> Option<LayoutRefusal> {
        chunked_rows_refusal(ops)
    }

    fn grid(&self, fam: &Family, tile: &Tile, params: &FwdParams, sm_count: u32) -> Grid {
        if stage(fam) >= PERSISTENT_STAGE {
            tma::persistent_grid(tile.block_m, params, sm_count)
        } else {
            tile_grid(tile.block_m, params)
        }
    }

    fn launch_note(&self, _fam: &Family, tile: &Tile, params: &FwdParams) -> Option<&'static str> {
        load_path(tile, params)
    }

    fn tensor_maps(&self, fam: &Family, dtype: DType, params: &FwdParams) -> Result<TensorMaps> {
        if stage(fam) < TMA_STAGE {
            return Ok(TensorMaps::default());
        }
        let [lq, lk, lv] = layouts(params);
        let specs = tma::tma_specs(stage(fam), dtype, params.flags & FLAG_KV_FP8 != 0, &lq, &lk, &lv)?;
        Ok(TensorMaps::new(specs, [params.q, params.k, params.v]))
    }
}

/// Which K/V load path a launch of `tile` takes (`Dispatch::reason` and the launch plan's note
/// say it; `cuda/fa3/serving.cuh` has the rule), or `None` for a dense launch (TMA only).
pub(crate) fn load_path(tile: &Tile, p: &FwdParams) -> Option<&'static str> {
    if !p.is_serving() {
        return None;
    }
    Some(if p.flags & FLAG_KV_FP8 != 0 {
        "K/V gathered: the FP8 cache's codes converted to 16-bit values as the producer loads them, its scales applied in f32"
    } else if p.page_size > 0 && (p.page_size as u32).is_multiple_of(tile.block_n) {
        concat!(
            "K/V by TMA through the block table (page size a multiple of the key tile); ",
            "each sequence's partial last tile gathered with cp.async"
        )
    } else if p.page_size > 0 {
        "K/V gathered with cp.async through the block table (page size not a multiple of the key tile)"
    } else {
        "K/V by TMA; each sequence's partial last tile gathered with cp.async"
    })
}

/// Operand layouts as the tensor maps need them, from the launch parameters (FA3 and FA4; v's
/// head dim is `head_dim_v` where it differs, 0 meaning Q/K's). A
/// serving launch's maps describe the whole tensors: a packed q `[1, total_q, ..]`, and k/v by
/// their extents (`kv_batches`, `kv_rows`: packed, cache or pages); extents of 0 (an empty
/// batch) become 1, as TMA needs, since no tile is loaded then.
pub(crate) fn layouts(p: &FwdParams) -> [OperandLayout; 3] {
    let (q_batch, q_rows) = if p.cu_seqlens_q != 0 { (1, p.total_q.max(1)) } else { (p.batch, p.seqlen_q) };
    let (kv_batch, kv_rows) = if p.kv_batches > 0 { (p.kv_batches, p.kv_rows.max(1)) } else { (p.batch, p.seqlen_k) };
    let dv = if p.head_dim_v > 0 { p.head_dim_v } else { p.head_dim };
    let l = |batch: i32, seqlen: i32, heads: i32, d: i32, st: [i64; 3]| OperandLayout {
        batch: batch as usize,
        seqlen: seqlen as usize,
        heads: heads as usize,
        head_dim: d as usize,
        batch_stride: st[0] as usize,
        row_stride: st[1] as usize,
        head_stride: st[2] as usize,
    };
    [
        l(q_batch, q_rows, p.heads_q, p.head_dim, [p.q_batch_stride, p.q_row_stride, p.q_head_stride]),
        l(kv_batch, kv_rows, p.heads_kv, p.head_dim, [p.k_batch_stride, p.k_row_stride, p.k_head_stride]),
        l(kv_batch, kv_rows, p.heads_kv, dv, [p.v_batch_stride, p.v_row_stride, p.v_head_stride]),
    ]
}

#[cfg(test)]
mod tests {
    use super::super::table::{kernel_symbol, KernelOptions, KernelVariant, FAMILIES, FA3_MAX_STAGE};
    use super::*;
    use crate::error::Operand;
    use crate::options::ForwardOptions;

    /// The table's FA3 rows and tma's copy of `Fa3Traits` (whose numbers its own test pins to
    /// the ones the C++ traits print) agree on every launch number.
    #[test]
    fn table_rows_match_the_traits() {
        // The 16-bit ladder (the FP8 rows, fa3fp8s3..fa3fp8s5, have their own checks in src/cuda/fp8.rs).
        let rows: Vec<_> = FAMILIES.iter().filter(|f| f.variant == KernelVariant::Fa3 && f.source() == "cuda/fa3_fwd_sm90.cu").collect();
        assert_eq!(rows.len(), FA3_MAX_STAGE as usize);
        assert_eq!(FA3_MAX_STAGE, crate::problem::FA3_MAX_STAGE);
        for (f, want_stage) in rows.into_iter().zip(1..) {
            let stage = f.stage.expect("every FA3 row has a stage");
            assert_eq!((stage, f.name), (want_stage, format!("fa3s{want_stage}").as_str()));
            assert_eq!((f.source(), f.min_sm), ("cuda/fa3_fwd_sm90.cu", 90));
            assert!(!f.auto && !f.gpu_verified, "{}: not verified on a GPU yet", f.name);
            // Every stage has 64/128/256; stage 5 also DeepSeek MLA prefill's (192, 128).
            let mut dims = tma::FA3_HEAD_DIMS.to_vec();
            if stage == tma::FA3_MLA_STAGE {
                dims.insert(2, FA3_MLA_PREFILL.0 as usize);
            }
            assert_eq!(f.tiles.iter().map(|t| t.head_dim as usize).collect::<Vec<_>>(), dims);
            assert_eq!(f.options.contains(KernelOptions::HEAD_DIM_V), stage == tma::FA3_MLA_STAGE, "{}", f.name);
            for t in f.tiles {
                let g = tma::geometry(stage, t.head_dim as usize).unwrap();
                assert_eq!(
                    (t.threads, t.block_m, t.block_n, f.smem_bytes(t)),
                    (g.threads, g.block_m, g.block_n, g.smem_bytes),
                    "{} hd{}",
                    f.name,
                    t.head_dim
                );
            }
            let want_tma = stage >= TMA_STAGE;
            assert_eq!(f.sass_expect.contains(&"UTMALDG"), want_tma, "{}", f.name);
            assert_eq!(f.sass_expect.contains(&"SYNCS"), want_tma, "{}", f.name);
            assert_eq!(f.sass_expect.contains(&"USETMAXREG"), stage >= 3, "{}", f.name);
            assert!(f.sass_expect.contains(&"HGMMA"));
        }
        assert_eq!(kernel_symbol("fa3s5", 256, "bf16"), "fa3s5_fwd_hd256_bf16");
    }

    fn problem(head_dim: usize, opts: &ForwardOptions) -> Problem {
        Problem::from_shapes([1, 100, 4, head_dim], [1, 90, 2, head_dim], [1, 90, 2, head_dim], DType::BF16, opts)
            .unwrap()
    }
    const T128: Tile = Tile { head_dim: 128, head_dim_v: 128, block_m: 128, block_n: 128, threads: 384 };

    #[test]
    fn refuses_alibi_and_inexact_head_dims() {
        let fam = FAMILIES.iter().find(|f| f.name == "fa3s5").unwrap();
        assert_eq!(Fa3.refusal(fam, &T128, &problem(128, &ForwardOptions::default())), None);
        let alibi = ForwardOptions::default().alibi_slopes(vec![0.5; 4]);
        assert!(Fa3.refusal(fam, &T128, &problem(128, &alibi)).unwrap().contains("ALiBi"));
        assert!(Fa3.refusal(fam, &T128, &problem(96, &ForwardOptions::default())).unwrap().contains("exactly"));
    }

    /// V's head dim must be the instance's: Q/K's, or 128 in the (192, 128) one.
    #[test]
    fn refuses_v_head_dims_unlike_the_instance() {
        let fam = FAMILIES.iter().find(|f| f.name == "fa3s5").unwrap();
        let t192 = fam.tiles.iter().find(|t| t.head_dim == 192).unwrap();
        let pair = |d: usize, dv: usize| {
            Problem::from_shapes([1, 100, 4, d], [1, 90, 2, d], [1, 90, 2, dv], DType::BF16, &ForwardOptions::default())
                .unwrap()
        };
        assert_eq!(Fa3.refusal(fam, t192, &pair(192, 128)), None);
        assert!(Fa3.refusal(fam, t192, &pair(192, 192)).unwrap().contains("(192, 128)"));
        assert!(Fa3.refusal(fam, t192, &pair(192, 64)).unwrap().contains("V head_dim 128"));
        assert!(Fa3.refusal(fam, &T128, &pair(128, 64)).unwrap().contains("V head_dim == Q/K head_dim"));
        // Its serving path: O has V's 128 columns, so the consumers' registers allow it.
        let varlen = FwdParams { cu_seqlens_q: 0x10, cu_seqlens_k: 0x20, head_dim: 192, head_dim_v: 128, ..params() };
        assert_eq!(Fa3.serving_refusal(fam, t192, &varlen), None);
        let [lq, lk, lv] = layouts(&varlen);
        assert_eq!((lq.head_dim, lk.head_dim, lv.head_dim), (192, 192, 128));
    }

    /// The launch parameters of contiguous q/o `[2, 100, 4, 128]` and k/v `[2, 300, 2, 128]` at
    /// 0x1000.. 0x4000, built as every launch builds them.
    fn params() -> FwdParams {
        let (q, kv) = ([2, 100, 4, 128], [2, 300, 2, 128]);
        let p = Problem::from_shapes(q, kv, kv, DType::BF16, &ForwardOptions::default()).unwrap();
        let st = |s: [usize; 4]| [s[1] * s[2] * s[3], s[2] * s[3], s[3]];
        let ops = Operands { ptrs: [0x1000, 0x2000, 0x3000, 0x4000], strides: [st(q), st(kv), st(kv), st(q)], lse: 0, alibi: 0, sinks: 0 };
        FwdParams::for_launch(&p, &ops)
    }

    #[test]
    fn layout_refusals_name_the_operand() {
        let (q, kv) = ([100 * 4 * 128, 4 * 128, 128], [300 * 2 * 128, 2 * 128, 128]);
        let ok = Operands { ptrs: [0x1000, 0x2000, 0x3000, 0x4000], strides: [q, kv, kv, q], lse: 0, alibi: 0, sinks: 0 };
        assert_eq!(Fa3.layout_refusal(&ok), None);
        let misaligned = Operands { ptrs: [0x1000, 0x2008, 0x3000, 0x4000], ..ok };
        assert_eq!(Fa3.layout_refusal(&misaligned).map(|r| r.operand), Some(Operand::K));
        let odd_stride = Operands { strides: [q, kv, kv, [q[0], 4 * 128 + 4, 128]], ..ok };
        assert_eq!(Fa3.layout_refusal(&odd_stride).map(|r| r.operand), Some(Operand::O));
    }

    #[test]
    fn tensor_map_layouts_follow_the_params() {
        let p = params();
        let [lq, lk, lv] = layouts(&p);
        assert_eq!((lq.batch, lq.seqlen, lq.heads, lq.head_dim, lq.row_stride), (2, 100, 4, 128, 512));
        assert_eq!((lk.seqlen, lk.heads, lk.row_stride, lk.batch_stride), (300, 2, 256, 300 * 256));
        assert_eq!(lk, lv);
        let [sq, sk, _] = tma::tma_specs(4, DType::BF16, false, &lq, &lk, &lv).unwrap();
        assert_eq!(sq.dims, [128, 4, 100, 2]);
        assert_eq!(sk.box_dims, [64, 1, 128, 1]);
        // Stage 1 takes no maps; stages 2-5 take Q, K, V at the operands' addresses.
        let (s1, s4) = (&FAMILIES[2], &FAMILIES[5]);
        assert_eq!((s1.stage, s4.stage), (Some(1), Some(4)));
        assert!(Fa3.tensor_maps(s1, DType::BF16, &p).unwrap().is_empty());
        let maps = Fa3.tensor_maps(s4, DType::BF16, &p).unwrap();
        assert_eq!(maps.iter().map(|m| m.global_address).collect::<Vec<_>>(), [0x1000, 0x2000, 0x3000]);
        assert_eq!(maps[1].spec, sk);
    }

    /// Stages 3-5 at hd 64/128 take the serving layouts; the rest are refused with the rule.
    #[test]
    fn serving_refusals_name_the_rule() {
        let row = |n: &str| FAMILIES.iter().find(|f| f.name == n).unwrap();
        let t = |d: u32| Tile { head_dim: d, head_dim_v: d, block_n: if d <= 128 { 128 } else { 64 }, ..T128 };
        let varlen = FwdParams { cu_seqlens_q: 0x10, cu_seqlens_k: 0x20, ..params() };
        for s in ["fa3s3", "fa3s4", "fa3s5"] {
            assert_eq!(Fa3.serving_refusal(row(s), &t(64), &varlen), None, "{s}");
            assert_eq!(Fa3.serving_refusal(row(s), &t(128), &varlen), None, "{s}");
            assert!(Fa3.serving_refusal(row(s), &t(256), &varlen).unwrap().contains("64, 128 and (192, 128)"));
        }
        for s in ["fa3s1", "fa3s2"] {
            assert!(Fa3.serving_refusal(row(s), &T128, &varlen).unwrap().contains("stages 3-5"));
        }
        let split = FwdParams { num_splits: 2, ..varlen };
        assert!(Fa3.serving_refusal(row("fa3s5"), &T128, &split).unwrap().contains("split-KV"));
        let append = FwdParams { seqlen_new: 1, seqused_k: 0x30, ..varlen };
        assert_eq!(Fa3.serving_refusal(row("fa3s5"), &T128, &append), None);
        let fp8 = FwdParams { flags: FLAG_KV_FP8, ..append };
        assert_eq!(Fa3.serving_refusal(row("fa3s5"), &T128, &fp8), None);
        assert!(Fa3.serving_refusal(row("fa3s2"), &T128, &fp8).unwrap().contains("stages 3-5"));
    }

    /// Serving maps describe the whole tensors (packed q, paged k/v), and the plan's note names
    /// the K/V load path by the page size.
    #[test]
    fn serving_maps_and_load_path() {
        let paged = FwdParams {
            cu_seqlens_q: 0x10,
            total_q: 7,
            seqused_k: 0x20,
            block_table: 0x30,
            page_size: 256,
            block_table_batch_stride: 4,
            kv_batches: 9,
            kv_rows: 256,
            ..params()
        };
        let [lq, lk, lv] = layouts(&paged);
        assert_eq!((lq.batch, lq.seqlen), (1, 7));
        assert_eq!((lk.batch, lk.seqlen), (9, 256));
        assert_eq!(lk, lv);
        assert!(load_path(&T128, &paged).unwrap().starts_with("K/V by TMA through the block table"));
        let small = FwdParams { page_size: 16, kv_rows: 16, ..paged };
        assert!(load_path(&T128, &small).unwrap().starts_with("K/V gathered"));
        let packed = FwdParams { cu_seqlens_k: 0x40, kv_batches: 1, kv_rows: 300, ..params() };
        assert!(load_path(&T128, &packed).unwrap().starts_with("K/V by TMA;"));
        assert_eq!(load_path(&T128, &params()), None);
        let fp8 = FwdParams { flags: FLAG_KV_FP8, ..paged };
        assert!(load_path(&T128, &fp8).unwrap().starts_with("K/V gathered: the FP8 cache"));
        // Its K/V maps describe the codes (one byte each), Q's stays 16-bit.
        let fam = FAMILIES.iter().find(|f| f.name == "fa3s5").unwrap();
        let maps = Fa3.tensor_maps(fam, DType::BF16, &fp8).unwrap();
        let specs: Vec<_> = maps.iter().map(|m| m.spec).collect();
        assert_eq!(specs[0].data_type, crate::cuda::launch::TMA_DTYPE_BFLOAT16);
        assert_eq!((specs[1].data_type, specs[2].data_type), (crate::cuda::launch::TMA_DTYPE_UINT8, crate::cuda::launch::TMA_DTYPE_UINT8));
        assert_eq!(specs[1].strides, [128, 256, 300 * 256], "byte strides of the codes");
        // An empty packed batch still encodes (extents of 1; no tile is loaded).
        let empty = FwdParams { cu_seqlens_q: 0x10, total_q: 0, ..paged };
        assert_eq!(layouts(&empty)[0].seqlen, 1);
    }
}

//! The Hopper FP8 forward's launches as data (docs/fp8.md, "On Hopper"): the pre-pass
//! (`cuda/fp8_prepass.cu`: bf16/f16 -> e4m3 codes + per-block scales, Q and K rotated) and the FP8
//! consumer (`cuda/fa3_fp8_fwd_sm90.cu`). The CPU emulator runs exactly these launches
//! (tests/emulator/fp8.rs). The stage 3-5 consumers at head_dim 64, 128 and 256, each with the
//! pre-pass of its head_dim in its image, are the table rows "fa3fp8s3".."fa3fp8s5"
//! (build/instances.rs), whose host rules are `Fp8` here: `select` picks them for `Precision::Fp8`
//! problems on sm_90a.
//!
//! | file | role |
//! |---|---|
//! | `prepass` | the pre-pass launch and its `PrepassParams` |
//! | `consumer` | the consumer's tiles, parameters and tensor maps |
//! | `forward` | one FP8 forward: scratch layout and its three launches |
//! | `host` | the rows' `FamilyHost`: refusals, layout rule, grid, tensor maps |

mod consumer;
mod forward;
mod host;
mod prepass;

pub use consumer::{
    consumer_block_n, consumer_params, consumer_plan, consumer_smem_bytes, consumer_swizzle_bytes, ConsumerLaunch,
    ConsumerOperands, CONSUMER_BLOCK_M, CONSUMER_HEAD_DIMS, CONSUMER_MAX_STAGE, CONSUMER_S3_BLOCK_M, CONSUMER_S3_THREADS,
    CONSUMER_THREADS,
};
pub use forward::{forward_plans, Fp8Scratch};
pub(crate) use host::Fp8;
pub use prepass::{
    prepass_plan, PrepassInput, PrepassLaunch, PrepassOperand, PrepassParams, PREPASS_MAX_OPS, PREPASS_ROTATE, PREPASS_WARPS,
};

#[cfg(test)]
mod tests {
    use super::consumer::*;
    use super::forward::*;
    use super::host::*;
    use super::prepass::*;
    use crate::cuda::family::FamilyHost;
    use crate::cuda::params::Operands;
    use crate::cuda::table::{fp8_prepass_symbol, image_kernel_symbols, Family, KernelOptions, FAMILIES};
    use crate::error::Error;
    use crate::options::{Fp8Scaling, Precision};
    use crate::problem::Problem;
    use crate::DType;
    use crate::options::ForwardOptions;

    fn row() -> &'static Family {
        rows().last().copied().expect("the FP8 rows")
    }

    fn rows() -> Vec<&'static Family> {
        FAMILIES.iter().filter(|f| f.options.contains(KernelOptions::FP8)).collect()
    }

    /// The table rows and the launch plans' constants (the consumer's `Fp8Traits<S, D>`) agree.
    #[test]
    fn table_rows_match_the_consumer() {
        let rows = rows();
        assert_eq!(rows.iter().map(|f| (f.name, f.stage)).collect::<Vec<_>>(), [
            ("fa3fp8s3", Some(3)),
            ("fa3fp8s4", Some(4)),
            ("fa3fp8s5", Some(5))
        ]);
        assert_eq!(row().stage, Some(CONSUMER_MAX_STAGE as u8), "the top row is the highest stage");
        for f in rows {
            assert_eq!((f.source(), f.min_sm), ("cuda/fa3_fp8_fwd_sm90.cu", 90));
            assert!(!f.auto && !f.gpu_verified, "never ran on a GPU");
            assert_eq!(f.tiles.iter().map(|t| t.head_dim as usize).collect::<Vec<_>>(), CONSUMER_HEAD_DIMS);
            let stage = f.stage.unwrap() as u32;
            for t in f.tiles {
                let d = t.head_dim as usize;
                assert_eq!(
                    (t.block_m as usize, t.block_n as usize, t.threads, f.smem_bytes(t)),
                    (CONSUMER_S3_BLOCK_M, consumer_block_n(d), CONSUMER_S3_THREADS, consumer_smem_bytes(stage, d))
                );
                assert_eq!(
                    image_kernel_symbols(f, t.head_dim, "bf16"),
                    [format!("{}_fwd_hd{d}_bf16", f.name), fp8_prepass_symbol(t.head_dim, "bf16")]
                );
            }
            assert!(f.sass_expect.contains(&"QGMMA"));
            assert_eq!(image_kernel_symbols(f, 128, "bf16")[1], "fa_fp8_prepass_e4_bf16");
        }
        for d in [1, 32, 33, 64, 96, 128, 256] {
            let p = |x: u64| PrepassInput {
                shape: [1, 1, 1, d],
                x,
                x_strides: [d, d, d],
                codes: x,
                code_strides: [d, d, d, 1],
                scales: x,
                rotate: false,
            };
            let plan = prepass_plan(DType::F16, Fp8Scaling::PerTensor, None, &[p(0)]).unwrap();
            assert_eq!(plan.kernel, fp8_prepass_symbol(d as u32, "f16"), "head_dim {d}");
        }
    }

    fn problem(head_dim: usize, opts: &ForwardOptions) -> Problem {
        Problem::from_shapes([1, 100, 4, head_dim], [1, 90, 2, head_dim], [1, 90, 2, head_dim], DType::BF16, opts)
            .unwrap()
    }

    #[test]
    fn refusals() {
        let fp8 = |scaling| ForwardOptions::default().precision(Precision::Fp8 { scaling, hadamard: Some(7) });
        let block = Fp8Scaling::PerBlock { rows: 128 };
        assert_eq!(problem_refusal(&problem(128, &fp8(block))), None);
        assert_eq!(problem_refusal(&problem(128, &fp8(Fp8Scaling::PerTensor))), None);
        assert!(problem_refusal(&problem(128, &ForwardOptions::default())).unwrap().contains("Precision::Fp8"));
        for d in [64, 256] {
            assert_eq!(problem_refusal(&problem(d, &fp8(block))), None, "head_dim {d}");
        }
        let unrotated = ForwardOptions::default().precision(Precision::Fp8 { scaling: block, hadamard: None });
        assert!(problem_refusal(&problem(96, &unrotated)).unwrap().contains("head_dim 64, 128 or 256"));
        assert!(problem_refusal(&problem(128, &fp8(Fp8Scaling::PerBlock { rows: 32 }))).unwrap().contains("64 rows"));
        let alibi = fp8(block).alibi_slopes(vec![0.5; 4]);
        assert!(problem_refusal(&problem(128, &alibi)).unwrap().contains("ALiBi"));
    }

    /// The host's maps and grids are the consumer plan's (stages 3-5), so `Engine` and the emulator agree.
    #[test]
    fn host_maps_are_the_plans() {
        let opts =
            ForwardOptions::default().precision(Precision::Fp8 { scaling: Fp8Scaling::PerTensor, hadamard: None });
        let p = problem(128, &opts);
        let ops = ConsumerOperands {
            q: 0x1000,
            q_strides: [100 * 4 * 128, 4 * 128, 128],
            k: 0x10_0000,
            k_strides: [90 * 2 * 128, 2 * 128, 128],
            vt: 0x20_0000,
            vt_strides: [2 * 128 * 96, 96, 128 * 96],
            o: 0x30_0000,
            o_strides: [100 * 4 * 128, 4 * 128, 128],
            lse: 0,
            descales: [0x40_0000, 0x50_0000, 0x60_0000],
        };
        for f in rows() {
            let stage = f.stage.unwrap() as u32;
            let plan = consumer_plan(&p, &ops, stage, 132).unwrap();
            let maps = Fp8.tensor_maps(f, DType::BF16, &plan.params).unwrap();
            assert_eq!(&maps[..], &plan.tensor_maps[..]);
            assert_eq!(plan.kernel, crate::cuda::table::kernel_symbol(f.name, 128, "bf16"));
            // The grid the engine launches (the row's host) is the plan's: stage 5 persistent.
            assert_eq!(Fp8.grid(f, &f.tiles[0], &plan.params, 132), plan.grid, "{}", f.name);
        }
        // q [1, 100, 4, 128]: 4 tiles of 128 rows; stage 5 runs min(SMs, tiles) CTAs.
        assert_eq!(consumer_plan(&p, &ops, 4, 132).unwrap().grid, (1, 4, 1));
        assert_eq!(consumer_plan(&p, &ops, 5, 132).unwrap().grid, (4, 1, 1));
        assert_eq!(consumer_plan(&p, &ops, 5, 3).unwrap().grid, (3, 1, 1));
        assert!(consumer_plan(&p, &ops, 6, 132).is_err());
    }

    /// The engine's three launches: scratch regions disjoint and 256-byte aligned, the pre-pass
    /// reading the caller's tensors and writing the regions the consumer reads, Vᵀ padded.
    #[test]
    fn forward_plans_wire_the_prepass_into_the_consumer() {
        let opts = ForwardOptions::default()
            .precision(Precision::Fp8 { scaling: Fp8Scaling::PerBlock { rows: 64 }, hadamard: Some(9) })
            .return_lse(true);
        let p = problem(128, &opts); // q [1, 100, 4, 128], k/v [1, 90, 2, 128]
        let l = Fp8Scratch::of(&p).unwrap();
        assert_eq!(l.keys_pad, 96);
        let regions = [
            (l.q, 100 * 4 * 128),
            (l.k, 90 * 2 * 128),
            (l.vt, 2 * 128 * 96),
            (l.scales[0], 4 * 2 * 4),
            (l.scales[1], 2 * 2 * 4),
            (l.scales[2], 2 * 2 * 4),
        ];
        for w in regions.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0 && w[1].0 % 256 == 0, "{regions:?}");
        }
        assert!(l.scales[2] + 16 <= l.bytes);
        let contiguous = |s: usize, h: usize| [s * h * 128, h * 128, 128];
        let ops = Operands {
            ptrs: [0x10_0000, 0x20_0000, 0x30_0000, 0x40_0000],
            strides: [contiguous(100, 4), contiguous(90, 2), contiguous(90, 2), contiguous(100, 4)],
            lse: 0x50_0000,
            alibi: 0,
            sinks: 0,
        };
        let base = 0x100_0000u64;
        let (qk, v, params) = forward_plans(&p, &ops, base, &l).unwrap();
        assert_eq!((qk.kernel.as_str(), qk.params.n_ops, v.params.n_ops), ("fa_fp8_prepass_e4_bf16", 2, 1));
        let [oq, ok] = qk.params.op;
        assert_eq!((oq.x, oq.codes, oq.scales, oq.flags), (0x10_0000, base + l.q as u64, base + l.scales[0] as u64, 1));
        assert_eq!((ok.x, ok.codes, ok.flags), (0x20_0000, base + l.k as u64, 1));
        assert_eq!(qk.params.hadamard_seed, 9);
        let ov = v.params.op[0];
        assert_eq!((ov.x, ov.codes, ov.flags), (0x30_0000, base + l.vt as u64, 0));
        assert_eq!(
            (ov.c_batch_stride, ov.c_row_stride, ov.c_head_stride, ov.c_dim_stride),
            (2 * 128 * 96, 1, 128 * 96, 96)
        );
        assert_eq!(
            (params.q, params.k, params.v, params.o, params.lse),
            (oq.codes, ok.codes, ov.codes, 0x40_0000, 0x50_0000)
        );
        assert_eq!(
            (params.q_descale, params.k_descale, params.v_descale, params.descale_block),
            (oq.scales, ok.scales, ov.scales, 64)
        );
        assert_eq!((params.v_row_stride, params.v_head_stride), (96, 128 * 96));
        // Not an FP8 problem: typed refusals.
        let plain = problem(128, &ForwardOptions::default());
        assert!(matches!(Fp8Scratch::of(&plain), Err(Error::InvalidOption { .. })));
        assert!(matches!(forward_plans(&plain, &ops, base, &l), Err(Error::InvalidOption { .. })));
    }
}

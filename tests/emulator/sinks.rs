//! Attention sinks in the kernels (`ForwardOptions::sinks`, `FwdParams::sinks`) in the CPU
//! emulator: every family whose table row has `SINKS` (FA1, FA2, FA3 stages 1-5) against the
//! float64 reference with sinks, with the GPU tests' rule (support/emu.rs `run_case`); and the
//! serving launches of FA1 and FA2, split-KV included, where the splits leave the sink out and
//! the merge folds it once: FA1's through the combine kernel (also emulated, its `sinks`), FA2's
//! on the host with the sink as one more state (serving_fa2.rs `merge_splits`).
//!
//! Each case has four query heads with the sinks of support/serving.rs `sinks`: one far above
//! every score (the row's keys weigh ~e^-97: O ≈ 0, LSE ≈ 100, where exp(sink - max) overflows
//! f32), none (-inf), and two near the scores. The causal shapes have more queries than keys, and
//! the serving batches a sequence without keys, so some rows see no key: O = 0 and LSE = the
//! head's sink (-inf without one).
//!
//! `cargo test --test emulator sinks::` runs the CI subset (12 dense launches: FA1, FA2 and FA3
//! stage 5, the stage `Variant::Fa3` runs, over both dtypes, head dims 64 and 128 and every mask,
//! and one launch of each FA3 stage 1-4;
//! 3 FA1 and 2 FA2 serving launches, 3 of them split-KV); `FLASH_ATTN_EMU=full` runs every
//! family x f16/bf16 x head dim 64/128/256 x no mask/causal/window and 5 serving launches more.
//! These ran in the emulator; nothing here ran on a GPU.
use super::serving_fa1::{self, Kv};
use super::serving_fa2::{self, base, paged, SCase};
use crate::support::emu::*;
use crate::support::serving::sinks;
use flash_attn::cuda::table::{KernelOptions, FAMILIES};
use flash_attn::{DType, ForwardOptions, Mask};

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}
fn threads() -> usize {
    std::env::var("FLASH_ATTN_EMU_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(1)
}

/// The families the full matrix runs: every row of the table with `SINKS`.
const FAMILIES_WITH_SINKS: [&str; 7] = ["fa1", "fa2", "fa3s1", "fa3s2", "fa3s3", "fa3s4", "fa3s5"];

#[derive(Clone, Copy, Debug)]
enum Shape {
    /// GQA (4 query heads on 2), seqlen_q != seqlen_k, batch 2.
    NoMask,
    /// MQA, 130 queries on 63 keys: rows 0..67 see no key.
    Causal,
    /// GQA, a sliding window (20, 5) with softcap 20 (scores in natural units).
    Window,
}

fn sink_case(family: &'static str, dtype: DType, d: usize, shape: Shape) -> Case {
    let base = ForwardOptions::default().return_lse(true).sinks(sinks(4));
    let (q, k, opts) = match shape {
        Shape::NoMask => ([2, 65, 4, d], [2, 130, 2, d], base),
        Shape::Causal => ([1, 130, 4, d], [1, 63, 1, d], base.mask(Mask::Causal)),
        Shape::Window => ([1, 70, 4, d], [1, 200, 2, d], base.mask(Mask::window(20, 5)).softcap(20.0)),
    };
    let mut c = Case::new(family, dtype, q, k, opts);
    c.label = format!("sinks {shape:?}");
    if family == "fa3s5" {
        c.sm_count = 2; // the persistent grid walks more than one tile per CTA
    }
    c
}

fn check(what: &str, cases: &[Case]) {
    let t0 = std::time::Instant::now();
    let results = run_all(cases, None, threads());
    let mut failed = Vec::new();
    for (name, r) in &results {
        match r {
            Ok(p) => println!("ok    {name}: err/bound {:.3}", p.ratio),
            Err(e) => {
                println!("FAIL  {name}:\n{e}");
                failed.push(name.clone());
            }
        }
    }
    println!("{what}: {} cases in {:.1} s, {} failed", cases.len(), t0.elapsed().as_secs_f64(), failed.len());
    assert!(failed.is_empty(), "{what}: {} failed: {failed:#?}", failed.len());
}

/// The families of the full matrix are exactly the table's rows with `SINKS`.
#[test]
fn the_matrix_covers_every_row_with_sinks() {
    let mut rows: Vec<&str> =
        FAMILIES.iter().filter(|f| f.options.contains(KernelOptions::SINKS)).map(|f| f.name).collect();
    rows.sort_unstable();
    let mut ours = FAMILIES_WITH_SINKS.to_vec();
    ours.sort_unstable();
    assert_eq!(rows, ours);
}

/// Dense launches: the CI subset, or every family x dtype x head dim x mask.
#[test]
fn sinks_dense_launches() {
    let mut cases = Vec::new();
    if full() {
        for family in FAMILIES_WITH_SINKS {
            for dtype in [DType::F16, DType::BF16] {
                for d in [64, 128, 256] {
                    for shape in [Shape::NoMask, Shape::Causal, Shape::Window] {
                        cases.push(sink_case(family, dtype, d, shape));
                    }
                }
            }
        }
    } else {
        cases = vec![
            sink_case("fa1", DType::F16, 64, Shape::Causal),
            sink_case("fa1", DType::BF16, 128, Shape::Window),
            sink_case("fa2", DType::BF16, 64, Shape::NoMask),
            sink_case("fa2", DType::F16, 128, Shape::Causal),
            sink_case("fa2", DType::BF16, 128, Shape::Window),
            sink_case("fa3s5", DType::BF16, 64, Shape::Causal),
            sink_case("fa3s5", DType::F16, 128, Shape::Window),
            sink_case("fa3s5", DType::BF16, 128, Shape::NoMask),
            // Stages 1-4 share stage 5's epilogue; one launch each (their units are the ones
            // forward::'s subset builds too).
            sink_case("fa3s1", DType::F16, 64, Shape::NoMask),
            sink_case("fa3s2", DType::BF16, 128, Shape::Causal),
            sink_case("fa3s3", DType::F16, 64, Shape::Window),
            sink_case("fa3s4", DType::BF16, 128, Shape::Causal),
        ];
    }
    check("sinks, dense launches", &cases);
}

/// FA1's serving launches with sinks: varlen, a paged cache with split-KV (the combine folds the
/// sink once; a sequence with no key gets LSE = sink), a dense cache with split-KV and a window.
#[test]
fn sinks_serving_and_split_kv_through_the_combine() {
    let opts = |mask: Mask| ForwardOptions::default().mask(mask).return_lse(true).sinks(sinks(4));
    let case = serving_fa1::case;
    let mut cases = vec![
        case("sinks_varlen_causal", DType::F16, true, vec![5, 0, 70, 3], vec![9, 4, 130, 0], Kv::Varlen, 1, 4, 2, opts(Mask::Causal), 11),
        case(
            "sinks_paged16_splits3",
            DType::BF16,
            false,
            vec![1; 3],
            vec![300, 0, 77],
            Kv::Paged { page: 16, shared: false },
            3,
            4,
            2,
            opts(Mask::Causal),
            12,
        ),
        case("sinks_cache_splits5_window", DType::F16, false, vec![2; 3], vec![150, 1, 64], Kv::Cache, 5, 4, 1, opts(Mask::window(30, 0)), 13),
    ];
    if full() {
        cases.extend([
            case("sinks_varlen_splits4", DType::BF16, true, vec![1, 6, 0], vec![200, 6, 3], Kv::Varlen, 4, 4, 4, opts(Mask::None), 14),
            case(
                "sinks_paged3_shared_splits2",
                DType::F16,
                false,
                vec![4; 3],
                vec![10, 35, 4],
                Kv::Paged { page: 3, shared: true },
                2,
                4,
                2,
                opts(Mask::Causal),
                15,
            ),
            case("sinks_cache_decode", DType::BF16, false, vec![1; 4], vec![0, 1, 77, 200], Kv::Cache, 1, 4, 1, opts(Mask::window(17, 3)), 16),
        ]);
    }
    serving_fa1::check(&cases);
}

/// FA2's serving launches with sinks: varlen with a sequence without keys (the epilogue folds
/// them), split-KV on a shared paged cache (the splits leave them out, the merge adds them once).
#[test]
fn sinks_fa2_serving_and_split_kv() {
    use serving_fa2::Kv;
    let lens = [300, 0, 77, 1];
    let mut cases = vec![
        SCase { sinks: true, mask: Mask::Causal, ..base(DType::F16, 64, 4, 2, Ok(vec![5, 0, 70, 3]), Kv::Varlen(vec![9, 4, 130, 0])) },
        SCase { sinks: true, splits: 3, mask: Mask::Causal, ..base(DType::BF16, 64, 4, 2, Err(1), paged(&lens, 16, true)) },
    ];
    if full() {
        cases.push(SCase { sinks: true, splits: 4, mask: Mask::window(90, 0), ..base(DType::F16, 128, 4, 1, Err(2), paged(&lens, 3, false)) });
        cases.push(SCase { sinks: true, splits: 5, softcap: Some(10.0), ..base(DType::BF16, 64, 4, 2, Ok(vec![2, 3, 40, 1]), Kv::Varlen(lens.to_vec())) });
    }
    serving_fa2::check(&cases);
}

//! Attention sinks in the kernels (`ForwardOptions::sinks`, `FwdParams::sinks`) in the CPU
//! emulator: every family whose table row has `SINKS` (FA1, FA2 with its fa2v row of MLA's V
//! head dims, FA3 stages 1-5, the FA4
//! tcgen05 stages 1-3 and FA4's softmax on the FA2 / FA3 pipelines) against the float64
//! reference with sinks, with the GPU tests' rule (support/emu.rs `run_case`); and the
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
//! `cargo test --test emulator sinks::` runs the CI subset (13 dense launches: FA1, FA2 and FA3
//! stage 5, the stage `Variant::Fa3` runs, over both dtypes, head dims 64 and 128 and every mask,
//! fa2v at (192, 128), and one launch of each FA3 stage 1-4; 6 FA4 launches: each tcgen05 stage,
//! stage 3 twice, and FA4's softmax on each pipeline; 3 FA1 and 3 FA2 serving launches, 4 of
//! them split-KV, one fa2v (576, 512) decode);
//! `FLASH_ATTN_EMU=full` runs every family x f16/bf16 x its head dims among 64/128/256 x no
//! mask/causal/window and 5 serving launches more. `fa4_sink_mutations_are_caught` shows that
//! the FA4 launches fail without the sink's fold, or with a row that sees no key written as
//! LSE -inf. These ran in the emulator; nothing here ran on a GPU.
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
const FAMILIES_WITH_SINKS: [&str; 17] = [
    "fa1",
    "fa2",
    "fa2v",
    "fa3s1",
    "fa3s2",
    "fa3s3",
    "fa3s4",
    "fa3s5",
    "fa4s1",
    "fa4s2",
    "fa4s3",
    "fa4_fa2",
    "fa4_fa3s5",
    "fa4_fa3s5_p0t8",
    "fa4_fa3s5_p8t0",
    "fa4_fa3s5_p4t0",
    "fa4_fa3s5_p4t8",
];

/// The (Q/K, V) head dims of the full matrix a family has instances of: 64, 128 and 256, and
/// every pair of a row whose V head dim differs (fa2v's MLA pairs).
fn dims_of(family: &str) -> Vec<(usize, usize)> {
    let row = FAMILIES.iter().find(|f| f.name == family).expect("a row of the table");
    row.tiles
        .iter()
        .map(|t| (t.head_dim as usize, t.head_dim_v as usize))
        .filter(|&(d, dv)| dv != d || [64, 128, 256].contains(&d))
        .collect()
}

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
    sink_case_v(family, dtype, (d, d), shape)
}

/// As `sink_case`, with V's head dim `dv`.
fn sink_case_v(family: &'static str, dtype: DType, (d, dv): (usize, usize), shape: Shape) -> Case {
    let base = ForwardOptions::default().return_lse(true).sinks(sinks(4));
    let (q, k, opts) = match shape {
        Shape::NoMask => ([2, 65, 4, d], [2, 130, 2, d], base),
        Shape::Causal => ([1, 130, 4, d], [1, 63, 1, d], base.mask(Mask::Causal)),
        Shape::Window => ([1, 70, 4, d], [1, 200, 2, d], base.mask(Mask::window(20, 5)).softcap(20.0)),
    };
    let mut c = Case::new(family, dtype, q, k, opts);
    c.dv = dv;
    c.label = format!("sinks {shape:?}");
    if family.starts_with("fa3s5") || family.starts_with("fa4_fa3s5") {
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
                for dims in dims_of(family) {
                    for shape in [Shape::NoMask, Shape::Causal, Shape::Window] {
                        cases.push(sink_case_v(family, dtype, dims, shape));
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
            // DeepSeek MLA prefill's (192, 128) on the fa2v row (its epilogue is fa2's).
            sink_case_v("fa2v", DType::BF16, (192, 128), Shape::Causal),
            sink_case("fa3s5", DType::BF16, 64, Shape::Causal),
            sink_case("fa3s5", DType::F16, 128, Shape::Window),
            sink_case("fa3s5", DType::BF16, 128, Shape::NoMask),
            // Stages 1-4 share stage 5's epilogue; one launch each (their units are the ones
            // forward::'s subset builds too).
            sink_case("fa3s1", DType::F16, 64, Shape::NoMask),
            sink_case("fa3s2", DType::BF16, 128, Shape::Causal),
            sink_case("fa3s3", DType::F16, 64, Shape::Window),
            sink_case("fa3s4", DType::BF16, 128, Shape::Causal),
            // FA4: each tcgen05 stage (stage 3 with its lazy rescale and software exp2 twice),
            // and FA4's softmax on the FA2 and FA3 pipelines (their epilogues are those rows').
            sink_case("fa4s1", DType::F16, 64, Shape::Causal),
            sink_case("fa4s2", DType::BF16, 128, Shape::Window),
            sink_case("fa4s3", DType::F16, 128, Shape::NoMask),
            sink_case("fa4s3", DType::BF16, 64, Shape::Causal),
            sink_case("fa4_fa2", DType::BF16, 128, Shape::Causal),
            sink_case("fa4_fa3s5", DType::F16, 64, Shape::Window),
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
        // MLA's absorbed decode (576, 512) on the fa2v row, split-KV over a paged cache.
        SCase { family: "fa2v", dv: 512, sinks: true, splits: 2, ..base(DType::BF16, 576, 4, 1, Err(1), paged(&lens, 16, false)) },
    ];
    if full() {
        cases.push(SCase { sinks: true, splits: 4, mask: Mask::window(90, 0), ..base(DType::F16, 128, 4, 1, Err(2), paged(&lens, 3, false)) });
        cases.push(SCase { sinks: true, splits: 5, softcap: Some(10.0), ..base(DType::BF16, 64, 4, 2, Ok(vec![2, 3, 40, 1]), Kv::Varlen(lens.to_vec())) });
    }
    serving_fa2::check(&cases);
}

/// The FA4 launches can fail: without the sink in the epilogue (stage 2's and 3's row end, or
/// stage 1's finalize), O and the LSE are those of the keys alone; with a row that sees no key
/// written as LSE -inf (the rule without sinks), the causal shape's first rows miss the sink.
#[test]
fn fa4_sink_mutations_are_caught() {
    let mutations = [
        (
            Mutation {
                name: "fa4-row-end-without-sink",
                file: "cuda/fa4/roles2.cuh",
                from: "fa_to_natural(p),\n                                    fa_sink(p, head));",
                to: "fa_to_natural(p),\n                                    -INFINITY);",
                defines: &[],
            },
            &["fa4s2", "fa4s3"][..],
        ),
        (
            Mutation {
                name: "fa4-stage1-without-sink",
                file: "cuda/fa4/stage1.cuh",
                from: "st.finalize(0, fa_to_natural(p), fa_sink(p, bc.head))",
                to: "st.finalize(0, fa_to_natural(p))",
                defines: &[],
            },
            &["fa4s1"][..],
        ),
        (
            Mutation {
                name: "fa4-no-key-lse-minus-inf",
                file: "cuda/fa4/tile.cuh",
                from: "const float lse = have_o || end.empty ? end.lse : -INFINITY;",
                to: "const float lse = empty ? -INFINITY : end.lse;",
                defines: &[],
            },
            &["fa4s1", "fa4s3"][..],
        ),
    ];
    for (m, families) in &mutations {
        for &fam in *families {
            let c = sink_case(fam, DType::BF16, 64, Shape::Causal);
            match run_case(&c, Some(m)) {
                Ok(p) => panic!("{fam}: the mutation {} was not caught (err/bound {:.3})", m.name, p.ratio),
                Err(e) => {
                    assert!(e.contains("max |") || e.contains("LSE") || e.contains("lse"), "{fam} {}: unexpected diagnosis {e}", m.name);
                    println!("caught {} on {fam}: {}", m.name, e.lines().next().unwrap_or(""));
                }
            }
        }
    }
}

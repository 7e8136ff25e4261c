//! FA4's softmax (`Exp2::Poly(3)`, `Rescale::Lazy`) on the FA2 / FA3 pipelines, against the
//! float64 reference and the CPU oracle.

use super::*;
use super::domain_edges::edge_cases;

/// A case of an FA4-softmax row on the FA2 / FA3 pipelines (docs/fa4.md, "Part 1"), checked
/// against the float64 reference and against the CPU oracle (the row's share and tau as
/// `Exp2::Poly(3)` / `Rescale::Lazy` options of the CPU backend).
fn fa4_softmax_case(family: &'static str, s: &Shape, dtype: DType, d: usize, sm_count: u32) -> Case {
    let mut c = Case::new(family, dtype, [s.b, s.sq, s.hq, d], [s.b, s.sk, s.hkv, d], opts(s.mask, s.softcap, s.lse));
    c.input_scale = s.input_scale;
    c.sm_count = sm_count;
    c.cpu_oracle = true;
    c.label = s.label.to_string();
    c
}

fn shape(label: &str) -> &'static Shape {
    FA3_SHAPES.iter().find(|s| s.label == label).unwrap()
}

/// The CI subset of an FA4-softmax row: the lazy rescale skipping (scores of unit size: a
/// row's max grows by far less than tau = 8 in log2 units after its first tile, so the factor
/// stays 1) and forced to rescale (scores 144 times larger: growths of hundreds in log2 units,
/// which must move the max), causal and not, both head dims and dtypes, softcap, GQA, a window;
/// the whole FA3 shape matrix with FLASH_ATTN_EMU=full.
fn fa4_softmax_cases(family: &'static str, sms: &[u32]) -> Vec<Case> {
    let mut cases = Vec::new();
    if full() {
        for s in FA3_SHAPES {
            for dtype in FA3_DTYPES {
                for d in FA4_DIMS {
                    for &n in sms {
                        cases.push(fa4_softmax_case(family, s, dtype, d, n));
                    }
                }
            }
        }
    } else {
        let n = *sms.last().unwrap();
        for (label, dtype, d) in [
            ("causal gqa", DType::BF16, 64),
            ("window gqa", DType::F16, 128),
            ("large scores causal", DType::F16, 64),
            ("large scores softcap", DType::BF16, 128),
            ("seqlen_q 1", DType::BF16, 128),
        ] {
            let mut c = fa4_softmax_case(family, shape(label), dtype, d, n);
            if label.starts_with("large") {
                c.label += " (lazy rescale must move the max)";
            } else {
                c.label += " (lazy rescale keeps the max)";
            }
            cases.push(c);
        }
    }
    cases
}

/// FA4's softmax on the FA2 pipeline (`fa4_fa2`: sm_80, sm_120, sm_100 fallback).
#[test]
fn fa4_softmax_fa2() {
    let mut cases = fa4_softmax_cases("fa4_fa2", &[1]);
    // ALiBi runs on this pipeline (not on FA3's).
    let alibi = |hq: usize| (0..hq).map(|h| (-8.0 * (h as f32 + 1.0) / hq as f32).exp2()).collect::<Vec<_>>();
    let mut c = Case::new("fa4_fa2", DType::F16, [1, 150, 4, 128], [1, 170, 2, 128], opts(Mask::Causal, None, true).alibi_slopes(alibi(4)));
    c.cpu_oracle = true;
    c.label = "alibi causal".into();
    cases.push(c);
    check_all("fa4 softmax on fa2", &cases, &[]);
}

/// FA4's softmax on the FA3 pipeline (`fa4_fa3s5`: sm_90a), persistent on 1 and 2 CTAs.
#[test]
fn fa4_softmax_fa3() {
    check_all("fa4 softmax on fa3s5", &fa4_softmax_cases("fa4_fa3s5", &[1, 2]), &[]);
}

/// The benchmark's sweep rows (hd 128, sm_90a): each share x tau on a case that must move the
/// max and one that keeps it (FLASH_ATTN_EMU=full); the CI subset takes one per row, the case
/// that keeps the max for tau 8 and the other for tau 0 (where every growth moves it).
#[test]
fn fa4_softmax_sweep() {
    let mut cases = Vec::new();
    for fam in FAMILIES.iter().filter(|f| f.cpu_emulation == Some("fa4_softmax_sweep")) {
        for (label, dtype) in [("large scores causal", DType::BF16), ("window gqa", DType::F16)] {
            if !full() && label.starts_with("large") == (fam.softmax.lazy_tau > 0.0) {
                continue;
            }
            let mut c = fa4_softmax_case(fam.name, shape(label), dtype, 128, 2);
            let share = match fam.softmax.poly_every {
                0 => "none".to_string(),
                e => format!("1/{e}"),
            };
            c.label = format!("{label} share {share} tau {}", fam.softmax.lazy_tau);
            cases.push(c);
        }
    }
    assert_eq!(cases.len(), if full() { 8 } else { 4 }, "four sweep rows");
    check_all("fa4 softmax sweep", &cases, &[]);
}

/// The domain edges (huge window bounds, scores near f32::MAX, V = inf / NaN) on the FA4-softmax
/// rows: the FA2 pipeline at hd 64 in bf16 in the CI subset; both pipelines, both dtypes with
/// FLASH_ATTN_EMU=full. The software exp2 must be exact where MUFU is: exp2(-inf) = 0 for masked
/// keys (the clamp at -127 gives a zero bit pattern), no NaN from -inf + inf.
#[test]
fn fa4_softmax_domain_edges() {
    let mut cases = Vec::new();
    if full() {
        for (family, hd) in [("fa4_fa2", 64), ("fa4_fa2", 128), ("fa4_fa3s5", 128)] {
            for dtype in [DType::F16, DType::BF16] {
                cases.extend(edge_cases(family, hd, dtype));
            }
        }
    } else {
        cases.extend(edge_cases("fa4_fa2", 64, DType::BF16));
    }
    check_all("fa4 softmax domain edges", &cases, &[]);
}

/// The lazy rescale is exercised: a kernel that always keeps the stale max fails the cases that
/// must move it (P overflows the 16-bit A operand, or O is far off).
#[test]
fn fa4_softmax_lazy_mutation_is_caught() {
    let m = Mutation {
        name: "lazy_always_keeps_max",
        file: "cuda/common/softmax.cuh",
        from: "FA_HD bool fa_lazy_keeps_max(float growth, float tau) { return growth <= tau; }",
        to: "FA_HD bool fa_lazy_keeps_max(float, float) { return true; }",
        defines: &[],
    };
    for fam in ["fa4_fa2", "fa4_fa3s5"] {
        let c = fa4_softmax_case(fam, shape("large scores causal"), DType::BF16, 128, 1);
        run_case(&c, None).unwrap_or_else(|e| panic!("{fam} fails unmutated: {e}"));
        match run_case(&c, Some(&m)) {
            Ok(p) => panic!("{fam}: {} passes with err/bound {:.3}", m.name, p.ratio),
            Err(e) => {
                assert!(e.contains("max |O - ref|") || e.contains("oracle"), "{fam}: unexpected diagnosis {e}");
                println!("caught {} on {fam}: {}", m.name, e.lines().next().unwrap_or(""));
            }
        }
    }
}

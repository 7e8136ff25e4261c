//! The edges of the input domain: huge window bounds, scores near f32::MAX, V = inf / NaN.

use super::*;

/// The edges of the input domain, every family: window bounds up to i64::MAX (the
/// host clamps them to the sequence; mask.cuh is 64-bit regardless), scores up to near f32::MAX
/// and at 2^33 in log2 units against the naive f32 softmax, and V = inf / NaN with rows that see
/// no key (exactly 0, LSE -inf) next to rows that see keys (not finite).
#[test]
fn domain_edges() {
    let mut cases = Vec::new();
    let families: [(&'static str, usize); 4] = [("fa1", 64), ("fa2", 128), ("fa3s1", 64), ("fa3s4", 128)];
    for (family, hd) in families {
        for dtype in [DType::F16, DType::BF16] {
            cases.extend(edge_cases(family, hd, dtype));
        }
    }
    check_all("domain edges", &cases, &[]);
}

/// The domain-edge cases of one family, head dim and dtype (see `domain_edges`).
pub(super) fn edge_cases(family: &'static str, hd: usize, dtype: DType) -> Vec<Case> {
    let mut cases = Vec::new();
    let huge = [i64::MAX, i32::MAX as i64 + 1];
    for (n, &h) in huge.iter().enumerate() {
        for (sq, sk, mask) in [(90, 200, Mask::window(h, h)), (150, 70, Mask::window(h, 0)), (100, 130, Mask::window(0, h))] {
            let mut c = Case::new(family, dtype, [1, sq, 2, hd], [1, sk, 1, hd], opts(mask, None, true));
            c.label = format!("huge bound {n}");
            cases.push(c);
        }
    }
    for (target, mask) in [(3.0e38, Mask::Causal), (2.5e38, Mask::window(40, 8)), (1e10, Mask::None)] {
        let mut c = Case::new(family, dtype, [1, 100, 2, hd], [1, 140, 1, hd], opts(mask, None, true));
        c.max_score = Some(target);
        c.label = format!("max |score| {target:e}");
        cases.push(c);
    }
    for fill in [f32::INFINITY, f32::NAN] {
        let mut c = Case::new(family, dtype, [1, 150, 2, hd], [1, 60, 1, hd], opts(Mask::Causal, None, true));
        c.v_fill = Some(fill);
        c.label = format!("V = {fill}");
        cases.push(c);
    }
    cases
}

/// The domain edges for the FA4 (tcgen05) stages: stage 3 in bf16 at hd 64 in the CI subset;
/// every stage in both dtypes with FLASH_ATTN_EMU=full.
#[test]
fn fa4_domain_edges() {
    let mut cases = Vec::new();
    if full() {
        for (family, hd) in [("fa4s1", 64), ("fa4s2", 128), ("fa4s3", 64)] {
            for dtype in [DType::F16, DType::BF16] {
                cases.extend(edge_cases(family, hd, dtype));
            }
        }
    } else {
        cases.extend(edge_cases("fa4s3", 64, DType::BF16));
    }
    check_all("fa4 domain edges", &cases, &[]);
}

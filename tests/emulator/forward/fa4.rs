//! FA4 (tcgen05, sm_100a): stages 1-3 over the shape matrix, and their mutations.

use super::*;

fn fa4_case(stage: u32, s: &Shape, dtype: DType, d: usize) -> Case {
    let family: &'static str = ["fa4s1", "fa4s2", "fa4s3"][stage as usize - 1];
    let mut c = Case::new(family, dtype, [s.b, s.sq, s.hq, d], [s.b, s.sk, s.hkv, d], opts(s.mask, s.softcap, s.lse));
    c.input_scale = s.input_scale;
    c.label = s.label.to_string();
    c
}

/// Stage `stage`'s cases: the FA3 shape matrix at head dims 64 and 128 (FLASH_ATTN_EMU=full),
/// else 5 cases that rotate over the shapes, head dims and dtypes, one of them a huge window.
fn fa4_cases(stage: u32) -> Vec<Case> {
    let mut cases = Vec::new();
    if full() {
        for s in FA3_SHAPES {
            for dtype in FA3_DTYPES {
                for d in FA4_DIMS {
                    cases.push(fa4_case(stage, s, dtype, d));
                }
            }
        }
    } else {
        let regular: Vec<&Shape> = FA3_SHAPES.iter().filter(|s| !s.label.starts_with("huge")).collect();
        for j in 0..4usize {
            let i = 4 * (stage as usize - 1) + 2 * j;
            cases.push(fa4_case(stage, regular[i % regular.len()], FA3_DTYPES[j % 2], FA4_DIMS[(i + j / 2) % 2]));
        }
        let huge: Vec<&Shape> = FA3_SHAPES.iter().filter(|s| s.label.starts_with("huge")).collect();
        cases.push(fa4_case(stage, huge[stage as usize % 2], FA3_DTYPES[stage as usize % 2], 128));
    }
    cases
}

#[test]
fn fa4_stage1() {
    check_all("fa4 stage 1", &fa4_cases(1), &[]);
}
#[test]
fn fa4_stage2() {
    check_all("fa4 stage 2", &fa4_cases(2), &[]);
}
#[test]
fn fa4_stage3() {
    let mut cases = fa4_cases(3);
    // A problem that asks for FA4's softmax explicitly, with the row's parameters (degree-3
    // exp2, tau 8): the same kernel (src/cuda/select.rs routes it; other parameters are refused).
    let mut explicit = cases[0].clone();
    explicit.opts = explicit.opts.exp2(Exp2::Poly(3)).rescale(Rescale::Lazy { threshold: 8.0 });
    explicit.label += " explicit Exp2::Poly(3) + Rescale::Lazy(8)";
    cases.push(explicit);
    check_all("fa4 stage 3", &cases, &[]);
}

// The FA4 kernel's pieces (cuda/fa4/) each mutation edits.
const FA4_TILE: &str = "cuda/fa4/tile.cuh";
const FA4_STAGE1: &str = "cuda/fa4/stage1.cuh";
const FA4_ROLES2: &str = "cuda/fa4/roles2.cuh";
const FA4_ROLES3: &str = "cuda/fa4/roles3.cuh";
const TC: &str = "cuda/sm100/tcgen05.cuh";

/// tcgen05 mistakes the emulator must catch in the FA4 kernel, with the diagnoses that count.
#[rustfmt::skip]
fn fa4_mutations() -> Vec<(Mutation, &'static str, &'static [&'static str])> {
    vec![
        (Mutation { name: "p_without_proxy_fence", file: FA4_STAGE1,
            from: "        fa3::fence_proxy_async_smem();  // P (generic-proxy stores) -> visible to the MMA\n",
            to: "", defines: &[] },
         "fa4s1", &["after the last fence.proxy.async", "a fence.proxy.async by thread"]),
        (Mutation { name: "rescale_without_wait_st", file: FA4_TILE,
            from: "        tmem_st_32x32b_x32(a, r);\n    }\n    tmem_wait_st();", to: "        tmem_st_32x32b_x32(a, r);\n    }", defines: &[] },
         "fa4s1", &["has not completed", "without tcgen05.wait::st"]),
        (Mutation { name: "umma_desc_without_version", file: TC,
            from: "constexpr uint64_t kUmmaDescVersion = 1;", to: "constexpr uint64_t kUmmaDescVersion = 0;", defines: &[] },
         "fa4s1", &["version field"]),
        (Mutation { name: "idesc_n_off_by_one_bit", file: TC,
            from: "(uint32_t(n >> 3) << 17)", to: "(uint32_t(n >> 3) << 18)", defines: &[] },
         "fa4s1", &["instruction descriptor", "not inside one allocation", "max |O - ref|"]),
        (Mutation { name: "s_read_before_commit_wait", file: FA4_STAGE1,
            from: "        mbar_wait(s_full, it & 1);\n", to: "", defines: &[] },
         "fa4s1", &["has not written yet", "arrival underflow", "deadlock", "max |O - ref|", "incomplete at exit"]),
        (Mutation { name: "kv_reloaded_before_pv_completes", file: FA4_STAGE1,
            from: "            umma_commit(o_full);\n",
            to: "            umma_commit(o_full);\n            if (it + 1 < n_tiles) tma_load_4d(sv, tv, kv_full, 0, bc.kv_head, (n + 1) * Tr::kBlockN, bc.batch);\n", defines: &[] },
         "fa4s1", &["not yet executed", "changed between issue", "deadlock", "max |O - ref|", "arrival underflow", "happens-before"]),
        (Mutation { name: "rows_past_the_end_skip_tcgen05_ld", file: FA4_TILE,
            from: "        if (!live) continue;\n", to: "        if (!live) return;\n", defines: &[] },
         "fa4s1", &["of its 32 lanes: it is .sync.aligned"]),
        (Mutation { name: "s2_p_handed_over_before_wait_st", file: FA4_ROLES2,
            from: "        tmem_wait_st();\n        if (wg == 0) corr_s[slot * Tr::kBlockM + r] = corr;\n",
            to: "        if (wg == 0) corr_s[slot * Tr::kBlockM + r] = corr;\n", defines: &[] },
         "fa4s2", &["has not completed", "without tcgen05.wait::st", "not yet waited for"]),
        (Mutation { name: "s2_one_s_buffer", file: FA4_ROLES2,
            from: "Tr::kTmemS + slot * Tr::kBlockN), umma_desc_kmajor_sw128(sq + off)",
            to: "Tr::kTmemS), umma_desc_kmajor_sw128(sq + off)", defines: &[] },
         "fa4s2", &["(in flight) uses", "has not written yet", "has not completed", "max |O - ref|"]),
        // (Dropping only the p_full wait of stage 3 is benign: o_ready implies it, since the
        // correction warpgroup's arrival follows the softmax's corr_full, which follows p_full.)
        (Mutation { name: "s3_pv_without_waits", file: FA4_ROLES3,
            from: "        mbar_wait(&b.p_full[t], j & 1);\n        mbar_wait(&b.o_ready[t], j & 1);\n", to: "", defines: &[] },
         "fa4s3", &["has not completed", "has not written yet", "(in flight) uses", "max |O - ref|", "deadlock", "arrival underflow"]),
    ]
}

#[test]
fn fa4_mutations_are_caught() {
    let case = |fam: &'static str| {
        Case::new(fam, DType::BF16, [1, 130, 2, 64], [1, 400, 1, 64], ForwardOptions::default().return_lse(true).causal(true))
    };
    for fam in ["fa4s1", "fa4s2", "fa4s3"] {
        run_case(&case(fam), None).unwrap_or_else(|e| panic!("{fam} fails unmutated: {e}"));
    }
    let mut missed = Vec::new();
    for (m, fam, expect) in &fa4_mutations() {
        match run_case(&case(fam), Some(m)) {
            Ok(p) => {
                println!("MISSED {}: passes with err/bound {:.3}", m.name, p.ratio);
                missed.push(m.name);
            }
            Err(e) => {
                let why = expect.iter().find(|x| e.contains(*x));
                println!("caught {} by {why:?}:\n{}\n", m.name, e.lines().take(6).collect::<Vec<_>>().join("\n"));
                if why.is_none() {
                    missed.push(m.name);
                }
            }
        }
    }
    assert!(missed.is_empty(), "mutations not caught (or caught for an unexpected reason): {missed:?}");
}

//! Mutations of the FA3 kernels (and of the happens-before edges) the emulator must catch, and the
//! rule that every wgmma wait is followed by a register fence.

use super::*;

const FA3_MAINLOOP: &str = "cuda/fa3/mainloop.cuh";
const FA3_PIPELINE: &str = "cuda/fa3/pipeline.cuh";
const WG: &str = "cuda/sm90/wgmma.cuh";

/// Kernel mutations the emulator must catch, each on a case that passes unmutated, with the
/// diagnoses that count as catching it.
#[rustfmt::skip]
fn mutations() -> Vec<(Mutation, &'static str, &'static [&'static str])> {
    vec![
        (Mutation { name: "wrong_sbo", file: WG,
            from: "(desc_field(16) << 16) |  // LBO: unused for swizzled K-major\n           (desc_field(kSwizzleAtomBytes) << 32)",
            to: "(desc_field(16) << 16) |\n           (desc_field(512) << 32)", defines: &[] },
         "fa3s2", &["max |O - ref|", "outside the dynamic shared memory"]),
        (Mutation { name: "wrong_swizzle_mode", file: WG,
            from: "constexpr uint64_t kDescSwizzle128B = 1;", to: "constexpr uint64_t kDescSwizzle128B = 2;", defines: &[] },
         "fa3s1", &["max |O - ref|", "outside the dynamic shared memory"]),
        (Mutation { name: "missing_transpose_bit", file: "", from: "", to: "", defines: &["EMU_MUTATE_DROP_TRANS_B"] },
         "fa3s3", &["max |O - ref|", "outside the dynamic shared memory", "happens-before"]),
        (Mutation { name: "a_fragment_registers_swapped", file: WG,
            from: "return acc_index(2 * k + r / 2, r % 2, 0);", to: "return acc_index(2 * k + r % 2, r / 2, 0);", defines: &[] },
         "fa3s4", &["max |O - ref|"]),
        (Mutation { name: "expect_tx_one_box_short", file: FA3_PIPELINE,
            from: "mbar_arrive_expect_tx(full, is_v ? Tr::kVTileBytes : Tr::kKTileBytes);",
            to: "mbar_arrive_expect_tx(full, is_v ? Tr::kVTileBytes : Tr::kKTileBytes - Tr::kKTileBytes / Tr::kSlabs);", defines: &[] },
         "fa3s4", &["the phase completed before all its bytes landed", "happens-before"]),
        (Mutation { name: "flipped_parity", file: FA3_MAINLOOP,
            from: "return static_cast<uint32_t>(((it0 + j) / S) & 1); };",
            to: "return static_cast<uint32_t>((((it0 + j) / S) & 1) ^ 1); };", defines: &[] },
         "fa3s5", &["deadlock", "has not written yet", "max |O - ref|"]),
        (Mutation { name: "kv_slot_released_before_retire", file: FA3_MAINLOOP,
            from: "        op(p, acc, frag, m_first, tile.kv.n_begin + it, q_addr, cta.k_slot(slot), cta.v_slot(slot), kv_scales(it));\n        release(it, slot);",
            to: "        release(it, slot);\n        op(p, acc, frag, m_first, tile.kv.n_begin + it, q_addr, cta.k_slot(slot), cta.v_slot(slot), kv_scales(it));", defines: &[] },
         "fa3s3", &["the buffer was released before its readers' wgmma.wait_group"]),
        (Mutation { name: "missing_wgmma_wait", file: FA3_MAINLOOP,
            from: "    issue_qk<Tr, T>(s, q_addr, k_addr);\n    wgmma_wait<0>();", to: "    issue_qk<Tr, T>(s, q_addr, k_addr);", defines: &[] },
         "fa3s2", &["is read (fence_regs) while wgmma"]),
    ]
}

/// Reads of asynchronously written shared memory without the acquire that orders the write's
/// completion before them: caught by happens-before on every run, so each must fail under each
/// seed alone (every seed mixes the three land policies, drawn per copy), with a diagnosis that
/// names the missing acquire.
#[rustfmt::skip]
fn hb_mutations() -> Vec<(Mutation, &'static str, &'static str)> {
    vec![
        (Mutation { name: "no_q_full_wait", file: FA3_MAINLOOP,
            from: "        consumer_wait(bars.q_full, pos.q_use & 1);\n", to: "", defines: &[] },
         "fa3s4", "the missing acquire: mbarrier.try_wait.parity"),
        (Mutation { name: "no_v_full_wait_before_pv", file: FA3_MAINLOOP,
            from: "            consumer_wait(&bars.v_full[slot(j - 1)], full_parity(j - 1));\n", to: "", defines: &[] },
         "fa3s4", "the missing acquire: mbarrier.try_wait.parity"),
        (Mutation { name: "fa2_no_cp_async_wait", file: "cuda/fa2_fwd.cu",
            from: "        cp_async_wait<0>();  // tile j (and, first time, Q) landed for this thread ...\n", to: "", defines: &[] },
         "fa2", "cp.async.wait_group"),
        (Mutation { name: "stage1_no_barrier_before_wgmma", file: "cuda/fa3/stages.cuh",
            from: "        fence_proxy_async_smem();  // generic-proxy stores -> visible to wgmma (async proxy)\n        __syncthreads();\n",
            to: "        fence_proxy_async_smem();  // generic-proxy stores -> visible to wgmma (async proxy)\n", defines: &[] },
         "fa3s1", "ordinary store"),
    ]
}

#[test]
fn happens_before_mutations_are_caught() {
    let case = |family: &'static str, seed: u64| {
        let mut c = Case::new(family, DType::BF16, [1, 130, 2, 128], [1, 400, 1, 128], ForwardOptions::default().return_lse(true).causal(true));
        c.seeds = vec![seed];
        c
    };
    let mut missed = Vec::new();
    for (m, fam, expect) in &hb_mutations() {
        run_case(&case(fam, 1), None).unwrap_or_else(|e| panic!("{fam} fails unmutated: {e}"));
        for seed in 1..=3 {
            match run_case(&case(fam, seed), Some(m)) {
                Ok(p) => {
                    println!("MISSED {} ({fam}, seed {seed}): passes with err/bound {:.3}", m.name, p.ratio);
                    missed.push(format!("{} seed {seed}", m.name));
                }
                Err(e) => {
                    let ok = e.contains("happens-before") && e.contains(expect);
                    println!("{} {} ({fam}, seed {seed}):\n{}\n", if ok { "caught" } else { "WRONG DIAGNOSIS" }, m.name,
                             e.lines().take(9).collect::<Vec<_>>().join("\n"));
                    if !ok {
                        missed.push(format!("{} seed {seed}", m.name));
                    }
                }
            }
        }
    }
    assert!(missed.is_empty(), "happens-before mutations not caught by happens-before: {missed:?}");
}

/// What the emulator cannot observe, as a rule over the sources: the statement after every
/// `wgmma_wait<N>()` is `fence_regs(...)` on the accumulators read next, which keeps nvcc from
/// moving their reads above the wait (the emulator runs the source order, so a read the
/// compiler hoists would never show here). Returns the waits that break it.
fn unfenced_wgmma_waits(file: &str, text: &str) -> Vec<String> {
    let code = |l: &str| l.split("//").next().unwrap_or("").trim().to_string();
    let lines: Vec<String> = text.lines().map(code).collect();
    let mut bad = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if !(l.starts_with("wgmma_wait<") && l.ends_with(">();")) {
            continue;
        }
        let next = lines[i + 1..].iter().find(|n| !n.is_empty() && !n.starts_with('#'));
        if !next.is_some_and(|n| n.starts_with("fence_regs(")) {
            bad.push(format!("{file}:{}: `{l}` is not followed by fence_regs(...)", i + 1));
        }
    }
    bad
}

/// Every kernel source and header under cuda/ (without the test programs), as (path, text).
pub(super) fn kernel_sources() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![root().join("cuda")];
    while let Some(dir) = dirs.pop() {
        for p in std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()) {
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "test") {
                    dirs.push(p);
                }
            } else {
                let rel = p.strip_prefix(root()).unwrap().display().to_string();
                out.push((rel, std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn every_wgmma_wait_is_followed_by_fence_regs() {
    let sources = kernel_sources();
    let waits: usize = sources.iter().map(|(_, t)| t.lines().filter(|l| l.trim_start().starts_with("wgmma_wait<")).count()).sum();
    assert!(waits >= 9, "the rule must see the kernels' waits (found {waits})");
    let bad: Vec<String> = sources.iter().flat_map(|(f, t)| unfenced_wgmma_waits(f, t)).collect();
    assert!(bad.is_empty(), "{bad:#?}");
    // The rule bites: stage 4's wait for S_j without its fence_regs.
    let (file, text) = sources.iter().find(|(f, _)| f == FA3_MAINLOOP).unwrap();
    let anchor = "            wgmma_wait<1>();  // groups retire in order: S_j is ready, PV may still run\n            fence_regs(op.s);\n";
    assert_eq!(text.matches(anchor).count(), 1, "the mutation's anchor must match the kernel once");
    let mutated = text.replacen(anchor, "            wgmma_wait<1>();  // groups retire in order: S_j is ready, PV may still run\n", 1);
    let found = unfenced_wgmma_waits(file, &mutated);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("wgmma_wait<1>();"), "{found:?}");
}

#[test]
fn mutations_are_caught() {
    let muts = mutations();
    let mut missed = Vec::new();
    // A case with 4 K/V tiles per CTA (ring wrap-around, slot reuse), GQA, causal, LSE.
    let case = |family: &'static str| {
        Case::new(family, DType::BF16, [1, 130, 2, 128], [1, 400, 1, 128], ForwardOptions::default().return_lse(true).causal(true))
    };
    // The unmutated kernels pass this case (a failure here would make every mutation "caught").
    for fam in ["fa3s1", "fa3s2", "fa3s3", "fa3s4", "fa3s5"] {
        run_case(&case(fam), None).unwrap_or_else(|e| panic!("{fam} fails unmutated: {e}"));
    }
    for (m, fam, expect) in &muts {
        match run_case(&case(fam), Some(m)) {
            Ok(p) => {
                println!("MISSED {} ({fam}): passes with err/bound {:.3}", m.name, p.ratio);
                missed.push(m.name);
            }
            Err(e) => {
                let why = expect.iter().find(|x| e.contains(*x));
                println!("caught {} ({fam}) by {why:?}:\n{}\n", m.name, e.lines().take(6).collect::<Vec<_>>().join("\n"));
                if why.is_none() {
                    missed.push(m.name);
                }
            }
        }
    }
    assert!(missed.is_empty(), "mutations not caught (or caught for an unexpected reason): {missed:?}");
}

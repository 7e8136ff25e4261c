//! FA3 stage 5's (192, 128) instance (DeepSeek MLA prefill: Q/K head_dim 192, V and O head_dim
//! 128; docs/fa3.md "V head_dim") in the CPU emulator: dense launches (`plan`) and the serving
//! layouts (`plan_serving`: packed varlen batches, a dense cache with `cache_seqlens`, paged caches
//! by TMA through the block table and by the gathered cp.async path, whose K rows of 24 chunks
//! take one 64-column slab per pass). Each launch is the crate's own plan, run under three
//! scheduler seeds (bit-identical outputs; the emulator checks the mbarrier expect-tx byte counts
//! of K's and V's tiles, which differ here, and the TMA/wgmma ordering), and each sequence is
//! compared with the float64 reference on that sequence alone, with the GPU tests' rule
//! (`max|O - ref| <= 2 max|naive - ref| + floor`, LSE within 2e-3; a sequence with no key:
//! O = 0, LSE = -inf). Unused cache slots hold NaN; outputs are NaN-poisoned by the driver. The
//! launches run through serving_fa3.rs's runner, with V's head dim.
//!
//! `cargo test --release --test emulator head_dim_v_fa3::` runs the CI subset; `FLASH_ATTN_EMU=full`
//! adds a seeded random matrix (`FLASH_ATTN_EMU_SEED` replays it). Ran in the emulator only;
//! nothing here ran on a GPU.
use super::serving_fa3::{run_mutated, with, Case, Kv};
use crate::support::emu::{matrix_seed, Mutation};
use crate::support::serving::Rng;
use flash_attn::cuda::plan::LaunchPlan;
use flash_attn::cuda::table::{FAMILIES, FA3_MLA_PREFILL};
use flash_attn::{DType, Mask};

/// The row with the instance: FA3 stage 5.
const FAMILY: &str = "fa3s5";
/// Q/K's and V's head dims.
const D: usize = FA3_MLA_PREFILL.0 as usize;
const DV: usize = FA3_MLA_PREFILL.1 as usize;

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}

/// Runs one case (with `mutation` if any) through serving_fa3's runner.
fn run(c: &Case, mutation: Option<&Mutation>) -> Result<(f64, LaunchPlan), String> {
    run_mutated(c, true, mutation)
}

fn check(cases: &[Case]) {
    crate::support::check_each("FA3 (192, 128) cases", cases, Case::name, |c| {
        run(c, None).map(|(ratio, pl)| format!("err/bound {ratio:.3}; {}", pl.note.unwrap_or("dense")))
    });
}

/// A (192, 128) launch of stage 5: serving_fa3's case with V's head dim.
fn case(dtype: DType, (hq, hkv): (usize, usize), q_lens: &[usize], q_packed: bool, kv: Kv) -> Case {
    Case { dv: DV, ..super::serving_fa3::case(FAMILY, dtype, (hq, hkv, D), q_lens, q_packed, kv) }
}
/// A paged cache of `page`-key blocks (shuffled, `spare` unused, no shared block).
fn paged(lens: &[usize], page: usize, spare: usize) -> Kv {
    Kv::Paged { lens: lens.to_vec(), page, spare, shared: false }
}

/// The table row: stage 5 has the (192, 128) instance (128-key tiles: O has 128 columns), with
/// `HEAD_DIM_V`, within sm_90's 227 KiB.
#[test]
fn fa3s5_has_the_mla_prefill_instance() {
    let fam = FAMILIES.iter().find(|f| f.name == FAMILY).unwrap();
    let t = fam.tiles.iter().find(|t| t.head_dim == D as u32).expect("fa3s5 has no hd 192 tile");
    assert_eq!((t.block_m, t.block_n, t.threads), (128, 128, 384));
    assert_eq!(fam.smem_bytes(t), 218_192);
    assert!(fam.smem_bytes(t) <= 227 * 1024);
}

/// The CI subset: dense causal and not (several key tiles, a partial last tile, sq != sk, GQA),
/// a packed varlen batch with empty and one-key sequences, a dense cache (TMA and the gathered
/// tail), paged caches by TMA through the table (128-key pages) and gathered (16-key pages).
fn subset() -> Vec<Case> {
    use DType::{BF16, F16};
    vec![
        with(case(BF16, (4, 2), &[130, 130], false, Kv::Dense(300)), |c| c.opts.mask = Mask::Causal),
        with(case(F16, (2, 1), &[70], false, Kv::Dense(200)), |c| c.sm_count = 2),
        with(case(BF16, (4, 2), &[0, 1, 130, 77], true, Kv::Packed(vec![5, 0, 300, 129])), |c| {
            c.opts.mask = Mask::Causal;
            c.sm_count = 2;
        }),
        case(F16, (2, 2), &[16, 16], false, Kv::Cache { lens: vec![140, 16], capacity: 300 }),
        with(case(BF16, (2, 2), &[16, 40], true, paged(&[300, 129], 128, 2)), |c| {
            c.opts.mask = Mask::window(40, 7);
            c.opts.softcap = Some(30.0);
        }),
        case(F16, (4, 1), &[1, 1, 1], false, paged(&[200, 37, 1], 16, 2)),
    ]
}

#[test]
fn fa3_head_dim_v_subset() {
    check(&subset());
}

/// The seeded random matrix (FLASH_ATTN_EMU=full): both dtypes, every layout and page size, masks,
/// softcap, GQA, random lengths with 0 and 1, persistent grids of 1-3 CTAs.
#[test]
fn fa3_head_dim_v_matrix() {
    if !full() {
        println!("the FA3 (192, 128) matrix runs with FLASH_ATTN_EMU=full (the subset runs always)");
        return;
    }
    let mut rng = Rng::new(matrix_seed("fa3 head_dim_v matrix", 0x00d5_c0de));
    let masks = [Mask::None, Mask::Causal, Mask::window(33, 5)];
    let mut cases = Vec::new();
    for (i, kind) in ["dense", "packed", "cache", "p1", "p3", "p16", "p128", "p256", "dense", "packed"].into_iter().enumerate() {
        let dtype = if i % 2 == 0 { DType::BF16 } else { DType::F16 };
        let (hq, hkv) = [(4, 2), (4, 1), (2, 2)][i % 3];
        let batch = 1 + i % 3;
        let mut c = match kind {
            "dense" => {
                let (sq, sk) = (1 + (rng.next_u64() % 200) as usize, 1 + (rng.next_u64() % 400) as usize);
                case(dtype, (hq, hkv), &vec![sq; batch], false, Kv::Dense(sk))
            }
            _ => {
                let mut lens = |max: u64| -> Vec<usize> {
                    (0..batch).map(|b| if b == 1 { [0, 1][i % 2] } else { (rng.next_u64() % max) as usize }).collect()
                };
                let decode = kind.starts_with('p') && i % 2 == 0;
                let q_lens = if decode { vec![1; batch] } else { lens(150) };
                let k_lens: Vec<usize> = lens(400).iter().zip(&q_lens).map(|(&k, &q)| k.max(q)).collect();
                let kv = match kind {
                    "packed" => Kv::Packed(k_lens),
                    "cache" => Kv::Cache { capacity: k_lens.iter().copied().max().unwrap_or(0) + 9, lens: k_lens },
                    _ => paged(&k_lens, kind[1..].parse().unwrap(), 3),
                };
                case(dtype, (hq, hkv), &q_lens, !decode, kv)
            }
        };
        c.opts.mask = masks[i % 3];
        if i % 4 == 3 {
            c.opts.softcap = Some(20.0);
        }
        c.sm_count = 1 + (i % 3) as u32;
        cases.push(c);
    }
    check(&cases);
}

/// A wrong V tile must fail: the consumers reading V's ring slot 1 at K's tile stride (with equal
/// head dims the two strides agree, so only a launch whose V head dim differs can catch it; the
/// emulator's shared-memory bound stops it), V's two 64-column slabs swapped in the PV GEMM (in
/// bounds: caught by the comparison with float64), and (with FLASH_ATTN_EMU=full) the gathered V
/// tile copied with K's 192 columns.
#[test]
fn wrong_v_tile_is_caught() {
    let dense = case(DType::BF16, (2, 1), &[64], false, Kv::Dense(300));
    let mut muts = vec![
        (
            Mutation {
                name: "v_slot_at_k_stride",
                file: "cuda/fa3/preamble.cuh",
                from: "smem_u32(sv + slot * Tr::kVTileBytes)",
                to: "smem_u32(sv + slot * Tr::kKTileBytes)",
                defines: &[],
            },
            dense.clone(),
        ),
        (
            Mutation {
                name: "v_slabs_swapped",
                file: "cuda/fa3/mainloop.cuh",
                from: "Tr::pv_b_offset(kk, nh)",
                to: "Tr::pv_b_offset(kk, nh ^ 1)",
                defines: &[],
            },
            dense,
        ),
    ];
    if full() {
        let paged = case(DType::F16, (2, 2), &[1, 1], false, paged(&[150, 37], 16, 2));
        muts.push((
            Mutation {
                name: "v_gathered_with_k_columns",
                file: "cuda/fa3/pipeline.cuh",
                from: "gather_tile<Tr, Tr::kHeadDimV, T>(",
                to: "gather_tile<Tr, Tr::kHeadDim, T>(",
                defines: &[],
            },
            paged,
        ));
    }
    for (m, c) in &muts {
        run(c, None).unwrap_or_else(|e| panic!("{}: the unmutated kernel fails: {e}", c.name()));
        match run(c, Some(m)) {
            Ok((ratio, _)) => panic!("mutation {} passed {} (err/bound {ratio:.3})", m.name, c.name()),
            Err(e) => println!("caught {}:\n{}", m.name, e.lines().filter(|l| !l.starts_with("tmap")).take(4).collect::<Vec<_>>().join("\n")),
        }
    }
}

//! FA2 with V's head dim below Q/K's (the fa2v row: cuda/fa2_fwd.cu with `Fa2Traits<192, 128>`
//! and `Fa2Traits<576, 512>`, docs/fa2.md "V's head dim"), DeepSeek's MLA pairs, in the CPU
//! emulator against the float64 reference with the GPU tests' rule.
//!
//! - Prefill at (192, 128) (`support::emu::run_case`, three scheduler seeds): causal, no mask,
//!   sliding window, softcap, ALiBi, GQA, odd seqlens, `[b,h,s,d]` strides, f16 and bf16.
//! - Decode at (576, 512) and (192, 128) on the serving layouts (`serving_fa1`'s runner):
//!   paged caches (shuffled, shared first block), a dense cache, packed q and k/v, split-KV whose
//!   partial states (`o_accum` rows of V's head dim) the combine kernel merges at d 512.
//! - The append (`serving_fa2`'s runner): the append kernel writes k_new rows of 576 and v_new
//!   rows of 512 (on the hd 512 unit) into paged and dense caches, then the attention reads them.
//! - Mutations: a V tile read at K's row pitch, V rows loaded at Q/K's width, O rows written over
//!   half of V's width: each fails.
//!
//! `cargo test --release --test emulator head_dim_v::` runs the CI subset; `FLASH_ATTN_EMU=full`
//! adds seeded random configurations (`FLASH_ATTN_EMU_SEED` replays them). These ran in the
//! emulator only; nothing here ran on a GPU.

use crate::serving_fa1::{check as check_serving, Case as DCase, Kv as DKv};
use crate::serving_fa2::{base, check as check_append, paged, Kv, SCase};
use crate::support::emu::{matrix_seed, run_case, Case, Mutation};
use crate::support::{check_each, Rng};
use flash_attn::cuda::table::FAMILIES;
use flash_attn::{DType, ForwardOptions, Mask};

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}

/// A dense launch of (d, dv) on the fa2v row.
fn dense(dtype: DType, (b, hq, hkv, sq, sk): (usize, usize, usize, usize, usize), (d, dv): (usize, usize), o: ForwardOptions) -> Case {
    let mut c = Case::new("fa2v", dtype, [b, sq, hq, d], [b, sk, hkv, d], o);
    c.dv = dv;
    c
}

fn check(cases: &[Case]) {
    check_each("fa2v launches", cases, Case::name, |c| {
        let pass = run_case(c, None)?;
        let t = pass.plan.tile;
        if (t.head_dim as usize, t.head_dim_v as usize) != (c.k[3], c.dv) {
            return Err(format!("planned on the ({}, {}) instance", t.head_dim, t.head_dim_v));
        }
        Ok(format!("err/bound {:.3}", pass.ratio))
    });
}

/// The table row the tests run: the (192, 128) and (576, 512) pairs, within the 99 KiB of
/// sm_86/sm_89.
#[test]
fn fa2v_row_has_the_mla_pairs() {
    let fa2v = FAMILIES.iter().find(|f| f.name == "fa2v").unwrap();
    let rows: Vec<(u32, u32, u32, u32, u32)> =
        fa2v.tiles.iter().map(|t| (t.head_dim, t.head_dim_v, t.block_m, t.block_n, fa2v.smem_bytes(t))).collect();
    assert_eq!(rows, [(192, 128, 64, 32, 68_608), (576, 512, 16, 16, 89_344)]);
}

/// Prefill at (192, 128) and a decode row at (576, 512), dense: masks, softcap, ALiBi, GQA, odd
/// seqlens, both dtypes, both layouts. `cpu_emulation` of the fa2v row (build/instances.rs).
#[test]
fn fa2v_pairs() {
    let opts = |mask: Mask, lse: bool| ForwardOptions::default().mask(mask).return_lse(lse);
    let alibi = |hq: usize| (0..hq).map(|h| (-8.0 * (h as f32 + 1.0) / hq as f32).exp2()).collect::<Vec<f32>>();
    let mut cases = vec![
        dense(DType::F16, (1, 4, 2, 70, 90), (192, 128), opts(Mask::Causal, true)),
        dense(DType::BF16, (2, 2, 2, 33, 47), (192, 128), opts(Mask::None, true)),
        dense(DType::F16, (1, 3, 1, 45, 40), (192, 128), opts(Mask::window(9, 4), false).softcap(20.0)),
        dense(DType::BF16, (1, 2, 1, 1, 70), (576, 512), opts(Mask::Causal, true)),
    ];
    cases[1].bhsd = true;
    cases.push(dense(DType::F16, (1, 2, 2, 20, 37), (192, 128), opts(Mask::Causal, true).alibi_slopes(alibi(2))));
    if full() {
        let mut rng = Rng::new(matrix_seed("fa2v full matrix", 0x05EE_D0DF));
        let mut pick = |lo: u64, hi: u64| lo + rng.next_u64() % (hi - lo + 1);
        for _ in 0..12 {
            let dtype = if pick(0, 1) == 1 { DType::BF16 } else { DType::F16 };
            let pair = if pick(0, 2) == 0 { (576, 512) } else { (192, 128) };
            let (b, hkv) = (pick(1, 2) as usize, pick(1, 2) as usize);
            let hq = hkv * pick(1, 3) as usize;
            // (576, 512) is the decode pair: few query rows.
            let sq = if pair.0 == 576 || pick(0, 3) == 0 { pick(1, 3) as usize } else { pick(1, 130) as usize };
            let sk = pick(1, 130) as usize;
            let left = if pick(0, 2) == 0 { pick(0, 60) as i64 } else { -1 };
            let right = if pick(0, 2) == 0 { pick(0, 60) as i64 } else if pick(0, 1) == 1 { 0 } else { -1 };
            let mut o = opts(Mask::window(left, right), pick(0, 3) != 0);
            if pick(0, 3) == 0 {
                o = o.softcap(10.0 + pick(0, 40) as f32);
            }
            if pick(0, 3) == 0 {
                o = o.alibi_slopes(alibi(hq));
            }
            let mut c = dense(dtype, (b, hq, hkv, sq, sk), pair, o);
            c.bhsd = pick(0, 1) == 1;
            c.label = "random".into();
            cases.push(c);
        }
    }
    check(&cases);
}

#[allow(clippy::too_many_arguments)]
fn serving(
    name: &str,
    (d, dv): (usize, usize),
    dtype: DType,
    packed_q: bool,
    (sq, sk): (Vec<usize>, Vec<usize>),
    kv: DKv,
    splits: usize,
    (hq, hkv): (usize, usize),
    opts: ForwardOptions,
    seed: u64,
) -> DCase {
    DCase { family: "fa2v", name: format!("fa2v_{d}_{dv}_{name}"), dtype, d, dv, hq, hkv, packed_q, sq, sk, kv, splits, opts, seed }
}

/// Decode and chunked prefill on the serving layouts: paged caches (shuffled, shared first
/// block), a dense cache, packed q and k/v; split-KV through the combine kernel at d 512 and 128;
/// sequences of 0 and 1 keys among them.
#[test]
fn fa2v_decode_and_varlen() {
    let causal = ForwardOptions::default().mask(Mask::Causal).return_lse(true);
    let paged = |page: usize, shared: bool| DKv::Paged { page, shared };
    let mla = (576, 512);
    let mut cases = vec![
        serving("paged16_splits3", mla, DType::BF16, false, (vec![1; 3], vec![70, 0, 33]), paged(16, true), 3, (4, 1), causal.clone(), 1),
        serving("cache_splits2", mla, DType::F16, false, (vec![1; 2], vec![60, 9]), DKv::Cache, 2, (2, 2), causal.clone(), 2),
        serving("varlen", (192, 128), DType::F16, true, (vec![5, 0, 9], vec![40, 3, 9]), DKv::Varlen, 1, (4, 2), causal.clone(), 3),
        serving("paged3_splits2", (192, 128), DType::BF16, false, (vec![2; 2], vec![45, 1]), paged(3, false), 2, (2, 1), causal.clone(), 4),
    ];
    if full() {
        let mut rng = Rng::new(matrix_seed("fa2v serving full matrix", 0xD0F));
        for i in 0..10 {
            let pair = if i % 2 == 0 { mla } else { (192, 128) };
            let b = 1 + (rng.next_u64() % 3) as usize;
            let sk: Vec<usize> =
                (0..b).map(|_| [0, 1, 2 + (rng.next_u64() % 150) as usize, 20 + (rng.next_u64() % 130) as usize][(rng.next_u64() % 4) as usize]).collect();
            let kv = [DKv::Varlen, DKv::Cache, paged([1, 3, 16, 64][(rng.next_u64() % 4) as usize], rng.uniform() < 0.5)]
                [(rng.next_u64() % 3) as usize];
            let packed_q = kv == DKv::Varlen || rng.uniform() < 0.3;
            let sq: Vec<usize> =
                if packed_q { (0..b).map(|_| 1 + (rng.next_u64() % 6) as usize).collect() } else { vec![1 + (rng.next_u64() % 2) as usize; b] };
            let heads = [(2, 2), (4, 2), (4, 1)][(rng.next_u64() % 3) as usize];
            let mask = [Mask::None, Mask::Causal, Mask::window(25, 0)][(rng.next_u64() % 3) as usize];
            let o = ForwardOptions::default().mask(mask).return_lse(rng.uniform() < 0.7);
            let splits = [1, 2, 3, 5][(rng.next_u64() % 4) as usize];
            let dt = if rng.uniform() < 0.5 { DType::F16 } else { DType::BF16 };
            cases.push(serving(&format!("random{i}"), pair, dt, packed_q, (sq, sk), kv, splits, heads, o, 900 + i));
        }
    }
    check_serving(&cases);
}

/// An append case of (d, dv) on the fa2v row.
fn append(pair: (usize, usize), c: SCase) -> SCase {
    SCase { family: "fa2v", d: pair.0, dv: pair.1, ..c }
}

/// The append kernel at (576, 512) (k_new rows of 576, v_new rows of 512, on the hd 512 unit:
/// the first run of the append at a head dim above 256) and at (192, 128), into paged and dense
/// caches; then the attention on the fa2v row reads the rows it wrote.
#[test]
fn fa2v_append() {
    let lens = [35, 2, 70];
    let mla = (576, 512);
    let mut cases = vec![
        append(mla, SCase { new: 1, mask: Mask::Causal, ..base(DType::BF16, 576, 4, 1, Err(1), paged(&lens, 16, true)) }),
        append(mla, SCase { new: 2, splits: 2, ..base(DType::F16, 576, 2, 2, Err(2), Kv::Cache { lens: lens.to_vec(), extra: 3 }) }),
        append((192, 128), SCase { new: 2, mask: Mask::Causal, ..base(DType::F16, 192, 4, 2, Err(2), paged(&lens, 3, false)) }),
    ];
    if full() {
        let lens = [40, 5, 90, 3];
        cases.push(append(mla, SCase { new: 3, mask: Mask::Causal, ..base(DType::F16, 576, 2, 1, Err(3), paged(&lens, 1, true)) }));
        cases.push(append((192, 128), SCase { new: 1, alibi: true, ..base(DType::BF16, 192, 2, 1, Err(1), paged(&lens, 64, false)) }));
    }
    check_append(&cases);
}

/// The tests catch a wrong V: P·V read with K's row pitch (the emulator's happens-before check),
/// V rows loaded at Q/K's width (an access outside the buffers), O rows written over half of V's
/// width (the comparison with float64); each fails a CI case that passes unmutated.
#[test]
fn fa2v_mutations_are_caught() {
    let case = dense(DType::F16, (1, 2, 1, 40, 70), (192, 128), ForwardOptions::default().mask(Mask::Causal).return_lse(true));
    let muts = [
        Mutation {
            name: "v_read_at_k_pitch",
            file: "cuda/fa2_fwd.cu",
            from: "(kk * 16 * kStrideV + col0 + dp * 16)",
            to: "(kk * 16 * kStride + col0 + dp * 16)",
            defines: &[],
        },
        Mutation {
            name: "v_rows_at_qk_width",
            file: "cuda/fa2_fwd.cu",
            from: "load_tile<T, T::kBlockN, T::kHeadDimV>(sV_stage",
            to: "load_tile<T, T::kBlockN, T::kHeadDim>(sV_stage",
            defines: &[],
        },
        Mutation {
            name: "o_rows_half_written",
            file: "cuda/fa2_fwd.cu",
            from: "constexpr int kChunks = kHeadDimV / 8;",
            to: "constexpr int kChunks = kHeadDimV / 16;",
            defines: &[],
        },
    ];
    assert!(run_case(&case, None).is_ok(), "the unmutated case must pass");
    for m in &muts {
        match run_case(&case, Some(m)) {
            Ok(p) => panic!("mutation {} was not caught (err/bound {:.3})", m.name, p.ratio),
            Err(e) => {
                let why: Vec<&str> = e.lines().filter(|l| l.contains("ERROR") || l.contains("max |O")).collect();
                eprintln!("mutation {} caught: {}", m.name, why.join(" / "));
            }
        }
    }
}

//! FA2's head_dim 512 instance (cuda/fa2_fwd.cu with `Fa2Traits<512>`: two warps share each 16
//! query rows and split O's columns, docs/fa2.md "Head dim 512") in the CPU emulator, against the
//! float64 reference with the GPU tests' rule, three scheduler seeds per launch.
//!
//! - Prefill (the dense launch, `support::emu::run_case`): causal, sliding window, no mask,
//!   softcap, ALiBi, GQA and MQA, odd seqlens, seqlen_q below and above seqlen_k (empty causal
//!   rows: 0 and LSE -inf), `[b,h,s,d]` strides, f16 and bf16.
//! - Decode and chunked prefill on the serving layouts (`serving_fa1`'s runner with the fa2 row):
//!   paged caches with shuffled and shared block tables, a dense cache, packed q, split-KV
//!   whose partial states the combine kernel merges (also in the emulator).
//!
//! `cargo test --test emulator head_dim_512::` runs the CI subset; `FLASH_ATTN_EMU=full` adds
//! seeded random configurations (`FLASH_ATTN_EMU_SEED` replays them). These ran in the emulator
//! only; nothing here ran on a GPU.

use crate::serving_fa1::{check as check_serving, Case as SCase, Kv};
use crate::support::emu::{matrix_seed, run_case, Case};
use crate::support::{check_each, Rng};
use flash_attn::cuda::table::FAMILIES;
use flash_attn::{DType, ForwardOptions, Mask};

const D: usize = 512;

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}

fn opts(mask: Mask, softcap: Option<f32>, lse: bool) -> ForwardOptions {
    let o = ForwardOptions::default().mask(mask).return_lse(lse);
    match softcap {
        Some(c) => o.softcap(c),
        None => o,
    }
}

fn alibi(hq: usize) -> Vec<f32> {
    (0..hq).map(|h| (-8.0 * (h as f32 + 1.0) / hq as f32).exp2()).collect()
}

fn check(cases: &[Case]) {
    check_each("head_dim 512 launches", cases, Case::name, |c| {
        let pass = run_case(c, None)?;
        if pass.plan.tile.head_dim != D as u32 {
            return Err(format!("planned on the hd {} instance, not hd {D}", pass.plan.tile.head_dim));
        }
        Ok(format!("err/bound {:.3}", pass.ratio))
    });
}

/// The table row the tests run: FA2 instantiates head_dim 512 (32x16 tiles, 4 warps).
#[test]
fn fa2_row_has_head_dim_512() {
    let fa2 = FAMILIES.iter().find(|f| f.name == "fa2").unwrap();
    let t = fa2.tiles.iter().find(|t| t.head_dim == D as u32).expect("fa2 has no hd 512 row");
    assert_eq!((t.block_m, t.block_n, t.threads), (32, 16, 128));
    assert_eq!(fa2.smem_bytes(t), 99_840, "within the 99 KiB opt-in of sm_86/sm_89");
}

/// Prefill: every mask kind, softcap, ALiBi, GQA/MQA, odd and unequal seqlens, both dtypes.
#[test]
fn fa2_hd512_prefill() {
    type Row = (DType, usize, usize, usize, usize, usize, Mask, Option<f32>, bool, bool, bool);
    #[rustfmt::skip]
    let list: &[Row] = &[
        // dtype, b, hq, hkv, sq, sk, mask, softcap, alibi, lse, bhsd
        (DType::F16, 1, 2, 1, 45, 70, Mask::Causal, None, false, true, false),
        (DType::BF16, 1, 3, 1, 33, 33, Mask::window(9, 4), Some(30.0), false, true, false),
        (DType::F16, 2, 2, 2, 1, 51, Mask::None, None, true, true, false),
        (DType::BF16, 1, 2, 2, 40, 17, Mask::Causal, None, true, true, true),
        (DType::F16, 1, 4, 2, 37, 29, Mask::causal_window(11), Some(15.0), false, false, false),
        (DType::BF16, 1, 1, 1, 70, 65, Mask::None, None, false, true, false),
    ];
    let mut cases = Vec::new();
    for &(dtype, b, hq, hkv, sq, sk, mask, cap, use_alibi, lse, bhsd) in list {
        let o = opts(mask, cap, lse);
        let o = if use_alibi { o.alibi_slopes(alibi(hq)) } else { o };
        let mut c = Case::new("fa2", dtype, [b, sq, hq, D], [b, sk, hkv, D], o);
        c.bhsd = bhsd;
        cases.push(c);
    }
    if full() {
        // 12 random configurations: dtype, batch 1-2, GQA 1-3, seqlens 1-130, window sides -1
        // or 0-60, softcap, ALiBi, LSE, layout.
        let mut rng = Rng::new(matrix_seed("fa2 hd512 full matrix", 0x5EED_0512));
        let mut pick = |lo: u64, hi: u64| lo + rng.next_u64() % (hi - lo + 1);
        for _ in 0..12 {
            let dtype = if pick(0, 1) == 1 { DType::BF16 } else { DType::F16 };
            let (b, hkv) = (pick(1, 2) as usize, pick(1, 2) as usize);
            let hq = hkv * pick(1, 3) as usize;
            let sq = if pick(0, 3) == 0 { 1 } else { pick(1, 130) as usize };
            let sk = pick(1, 130) as usize;
            let left = if pick(0, 2) == 0 { pick(0, 60) as i64 } else { -1 };
            let right = if pick(0, 2) == 0 { pick(0, 60) as i64 } else if pick(0, 1) == 1 { 0 } else { -1 };
            let cap = (pick(0, 3) == 0).then(|| 10.0 + pick(0, 40) as f32);
            let o = opts(Mask::window(left, right), cap, pick(0, 3) != 0);
            let o = if pick(0, 3) == 0 { o.alibi_slopes(alibi(hq)) } else { o };
            let mut c = Case::new("fa2", dtype, [b, sq, hq, D], [b, sk, hkv, D], o);
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
    dtype: DType,
    packed_q: bool,
    sq: Vec<usize>,
    sk: Vec<usize>,
    kv: Kv,
    splits: usize,
    (hq, hkv): (usize, usize),
    opts: ForwardOptions,
    seed: u64,
) -> SCase {
    SCase { family: "fa2", name: format!("hd512_{name}"), dtype, d: D, dv: D, hq, hkv, packed_q, sq, sk, kv, splits, opts, seed }
}

/// Decode: paged caches (shuffled, shared first block), a dense cache, packed q; split-KV merged
/// by the combine kernel (head_dim 512 is its largest), lengths 0 and 1 among the sequences.
#[test]
fn fa2_hd512_decode() {
    let causal = ForwardOptions::default().mask(Mask::Causal).return_lse(true);
    let window = ForwardOptions::default().mask(Mask::window(20, 0)).return_lse(true);
    let paged = |page: usize, shared: bool| Kv::Paged { page, shared };
    let mut cases = vec![
        serving("paged16_splits3", DType::F16, false, vec![1; 3], vec![70, 0, 33], paged(16, true), 3, (4, 2), causal.clone(), 1),
        serving("paged3_decode", DType::BF16, false, vec![1; 2], vec![45, 1], paged(3, false), 1, (2, 1), window, 2),
        serving("cache_splits2", DType::BF16, false, vec![2; 2], vec![60, 9], Kv::Cache, 2, (2, 2), causal.clone(), 3),
        serving("varlen_chunk", DType::F16, true, vec![5, 0, 9], vec![40, 3, 9], Kv::Varlen, 1, (2, 1), causal.clone(), 4),
    ];
    if full() {
        let mut rng = Rng::new(matrix_seed("fa2 hd512 serving full matrix", 0x512));
        for i in 0..10 {
            let b = 1 + (rng.next_u64() % 3) as usize;
            // Lengths 0 and 1 in a quarter of the draws each: most sequences have keys to mix.
            let sk: Vec<usize> =
                (0..b).map(|_| [0, 1, 2 + (rng.next_u64() % 150) as usize, 20 + (rng.next_u64() % 130) as usize][(rng.next_u64() % 4) as usize]).collect();
            let kv = [Kv::Varlen, Kv::Cache, paged([1, 3, 16, 256][(rng.next_u64() % 4) as usize], rng.uniform() < 0.5)]
                [(rng.next_u64() % 3) as usize];
            let packed_q = kv == Kv::Varlen || rng.uniform() < 0.3;
            let sq: Vec<usize> =
                if packed_q { (0..b).map(|_| 1 + (rng.next_u64() % 12) as usize).collect() } else { vec![1 + (rng.next_u64() % 3) as usize; b] };
            let heads = [(2, 2), (4, 2), (2, 1)][(rng.next_u64() % 3) as usize];
            let mask = [Mask::None, Mask::Causal, Mask::window(25, 0)][(rng.next_u64() % 3) as usize];
            let o = ForwardOptions::default().mask(mask).return_lse(rng.uniform() < 0.7);
            let splits = [1, 2, 3, 5][(rng.next_u64() % 4) as usize];
            let dt = if i % 2 == 0 { DType::F16 } else { DType::BF16 };
            cases.push(serving(&format!("random{i}"), dt, packed_q, sq, sk, kv, splits, heads, o, 500 + i));
        }
    }
    check_serving(&cases);
}

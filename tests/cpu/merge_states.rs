//! `merge_states` is the exact softmax recombination: attention over a key set split into parts,
//! merged, equals attention over the whole; the order of the parts does not matter (within f64
//! rounding); rows that saw no key (LSE −inf) weigh nothing and never give NaN. The sharded
//! example's check runs here as a test.

use crate::support::props;
#[path = "../../examples/sharded_attention.rs"]
#[allow(dead_code)]
mod sharded_example;

use flash_attn::serving::{merge_states, merge_states_n, Varlen};
use flash_attn::{forward, DType, ForwardOptions, Mask, Tensor, TensorView};
use proptest::prelude::*;
use crate::support::serving::{values, Rng};

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() })
        .fold(0.0, f32::max)
}

#[test]
fn sharded_example_matches_one_shot() {
    for (shards, sq, sk, causal) in [
        (4, 64, 8192, false),
        (4, 64, 8192, true),
        (3, 200, 1000, true),
        (7, 1, 4000, false),
    ] {
        let r = sharded_example::check(shards, sq, sk, causal, DType::F32).unwrap();
        assert!(
            r.max_o_diff <= 2e-6 && r.max_lse_diff <= 2e-5,
            "{shards} shards, causal {causal}: {r:?}"
        );
    }
    // bf16 states are rounded once per shard before the merge: within a few bf16 ulps of |o|.
    let r = sharded_example::check(4, 32, 2048, true, DType::BF16).unwrap();
    assert!(r.rel_o_diff <= 2.0 * 2f64.powi(-8), "{r:?}");
}

/// Splits the keys of a varlen batch into `parts` per sequence (some empty), runs each part,
/// merges in a shuffled order, and compares with the whole.
fn split_and_merge(seed: u64, parts: usize, causal: bool) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed | 1);
    let (hq, hkv, d) = (4, 2, 32);
    let (sq, sk) = (1 + rng.below(12), 1 + rng.below(200));
    let dtype = DType::F32;
    let q = Tensor::from_f32(&values(&mut rng, sq * hq * d, dtype), dtype, [1, sq, hq, d]).unwrap();
    let kv = values(&mut rng, sk * hkv * d, dtype);
    let vv = values(&mut rng, sk * hkv * d, dtype);
    let k = Tensor::from_vec(kv.clone(), [1, sk, hkv, d]).unwrap();
    let v = Tensor::from_vec(vv.clone(), [1, sk, hkv, d]).unwrap();
    let mask = if causal { Mask::Causal } else { Mask::None };
    let opts = ForwardOptions::default().mask(mask).return_lse(true);
    let whole = forward(&q, &k, &v, &opts).unwrap();
    // Random cut points (repeats give empty parts).
    let mut cuts: Vec<usize> = (0..parts - 1).map(|_| rng.below(sk + 1)).collect();
    cuts.push(0);
    cuts.push(sk);
    cuts.sort_unstable();
    let row = hkv * d;
    let mut states = Vec::new();
    for w in cuts.windows(2) {
        let (s, e) = (w[0], w[1]);
        // An empty part through the varlen API (a key sequence of length 0): o = 0, LSE −inf.
        let cu_q = [0, sq as i32];
        let cu_k = [0, (e - s) as i32];
        let seqs = Varlen {
            cu_seqlens_q: &cu_q,
            cu_seqlens_k: &cu_k,
            max_seqlen_q: sq,
            max_seqlen_k: e - s,
        };
        let kp = TensorView::new(&kv[s * row..e * row], [1, e - s, hkv, d]);
        let vp = TensorView::new(&vv[s * row..e * row], [1, e - s, hkv, d]);
        let o = opts.clone().mask(sharded_example::shard_mask(mask, sk, e));
        let out = flash_attn::serving::forward_varlen(&q, &kp, &vp, &seqs, &o).unwrap();
        if e == s {
            prop_assert!(out.o.to_f32_vec().iter().all(|&x| x == 0.0));
            prop_assert!(out.lse.as_ref().unwrap().iter().all(|&x| x == f32::NEG_INFINITY));
        }
        states.push(out);
    }
    let as_states = |order: &[usize]| {
        let list: Vec<(TensorView<'_>, &[f32])> = order
            .iter()
            .map(|&i| (states[i].o.view(), states[i].lse.as_deref().unwrap()))
            .collect();
        merge_states_n(&list).unwrap()
    };
    let order: Vec<usize> = (0..states.len()).collect();
    let mut shuffled = order.clone();
    rng.shuffle(&mut shuffled);
    let (a, b) = (as_states(&order), as_states(&shuffled));
    let whole_o = whole.o.to_f32_vec();
    let whole_lse = whole.lse.unwrap();
    prop_assert!(
        max_diff(&a.o.to_f32_vec(), &whole_o) <= 2e-6,
        "{}",
        max_diff(&a.o.to_f32_vec(), &whole_o)
    );
    prop_assert!(max_diff(&a.lse, &whole_lse) <= 2e-5);
    // Order independence: the same up to f64 rounding, i.e. at most one f32 ulp.
    prop_assert!(max_diff(&a.o.to_f32_vec(), &b.o.to_f32_vec()) <= 1e-6);
    prop_assert!(max_diff(&a.lse, &b.lse) <= 1e-6);
    prop_assert!(a.o.to_f32_vec().iter().all(|x| x.is_finite()));
    Ok(())
}

proptest! {
    #![proptest_config(props::config("merged_parts_equal_the_whole", file!(), 64))]
    #[test]
    fn merged_parts_equal_the_whole(seed in any::<u64>(), parts in 1usize..=6, causal in any::<bool>()) {
        split_and_merge(seed, parts, causal)?;
    }
}

#[test]
fn two_way_equals_n_way_and_neg_inf_rows_are_zero() {
    let mut rng = Rng::new(7);
    let shape = [1, 3, 2, 8];
    let oa: Vec<f32> = values(&mut rng, 48, DType::F32);
    let ob: Vec<f32> = values(&mut rng, 48, DType::F32);
    let nan = vec![f32::NAN; 48];
    let (ta, tb, tn) = (
        Tensor::from_vec(oa, shape).unwrap(),
        Tensor::from_vec(ob.clone(), shape).unwrap(),
        Tensor::from_vec(nan, shape).unwrap(),
    );
    let inf = f32::NEG_INFINITY;
    // Rows (head, token): both finite; a −inf; b −inf; both −inf.
    let la = [0.5, inf, 2.0, inf, 1.0, -3.0];
    let lb = [1.5, 0.25, inf, inf, 1.0, 40.0];
    let two = merge_states(&ta, &la, &tb, &lb).unwrap();
    let n = merge_states_n(&[(ta.view(), &la[..]), (tb.view(), &lb[..])]).unwrap();
    assert_eq!(two, n);
    let o = two.o.to_f32_vec();
    // LSE layout [batch, heads, seqlen]: row (h, s) is lse[h * 3 + s]; o row (s, h) at (s * 2 + h) * 8.
    let orow = |s: usize, h: usize| &o[(s * 2 + h) * 8..][..8];
    assert_eq!(two.lse[3], inf);
    assert!(orow(0, 1).iter().all(|&x| x == 0.0), "both −inf: 0");
    assert_eq!(two.lse[1], 0.25);
    assert_eq!(orow(1, 0), &ob[16..24], "a −inf: b's row");
    let l = two.lse[0];
    assert!((l - (0.5f32.exp() + 1.5f32.exp()).ln()).abs() < 1e-6);
    // A −inf state's output is never read, even when it is NaN.
    let all_inf = [inf; 6];
    let m = merge_states(&tn, &all_inf, &tn, &all_inf).unwrap();
    assert!(m.o.to_f32_vec().iter().all(|&x| x == 0.0) && m.lse.iter().all(|&x| x == inf));
    // One state merges to itself.
    let one = merge_states_n(&[(tb.view(), &lb[..])]).unwrap();
    assert_eq!(one.lse, lb.to_vec());
}

//! FA1 and FA2, every instance (head dim) and dtype.

use super::*;

/// FA1, every instance (head dim) and dtype: empty causal rows, windows, softcap, ALiBi,
/// MQA/GQA, head-dim tails (FA1 masks them), LSE.
#[test]
fn fa1_all_instances() {
    let fam = FAMILIES.iter().find(|f| f.name == "fa1").unwrap();
    let mut cases = Vec::new();
    for t in fam.tiles {
        let hd = t.head_dim as usize;
        let tail = hd - 5;
        for dtype in [DType::F16, DType::BF16] {
            let alibi = |hq: usize| (0..hq).map(|h| 0.5 / (h as f32 + 1.0)).collect::<Vec<_>>();
            let list = [
                ([1, 1, 1, hd], [1, 1, 1, hd], opts(Mask::None, None, true), false),
                ([2, 70, 4, hd], [2, 45, 2, hd], opts(Mask::Causal, None, true), false),
                ([1, 45, 2, tail], [1, 133, 1, tail], opts(Mask::window(7, 3), Some(20.0), true), true),
                ([1, 66, 3, hd], [1, 66, 3, hd], opts(Mask::causal_window(10), None, true), false),
                ([1, 33, 2, tail], [1, 80, 2, tail], opts(Mask::None, None, false), true),
                ([1, 20, 2, hd], [1, 50, 1, hd], opts(Mask::window(2, -1), None, true), false),
            ];
            for (q, k, o, use_alibi) in list {
                let o = if use_alibi { o.alibi_slopes(alibi(q[2])) } else { o };
                cases.push(Case::new("fa1", dtype, q, k, o));
            }
        }
    }
    check_all("fa1", &cases, &[]);
}

/// FA2, all 12 instances (head dims x dtypes): GQA/MQA, causal with empty rows, windows, softcap,
/// ALiBi, seqlen_q = 1, ragged seqlens, [b,h,s,d] strides; 30 random configurations more in the
/// full matrix.
#[test]
fn fa2_all_instances() {
    let alibi = |hq: usize| (0..hq).map(|h| (-8.0 * (h as f32 + 1.0) / hq as f32).exp2()).collect::<Vec<_>>();
    type Row = (DType, usize, usize, usize, usize, usize, usize, Mask, Option<f32>, bool, bool, bool);
    #[rustfmt::skip]
    let list: &[Row] = &[
        // dtype, hd, b, hq, hkv, sq, sk, mask, softcap, alibi, lse, bhsd
        (DType::F16, 32, 1, 4, 2, 70, 150, Mask::window(20, 5), None, true, true, false),
        (DType::F16, 64, 2, 3, 1, 130, 100, Mask::None, None, false, true, false),
        (DType::BF16, 64, 1, 2, 2, 150, 40, Mask::Causal, None, false, true, false),
        (DType::F16, 96, 2, 2, 1, 1, 77, Mask::None, Some(30.0), false, true, false),
        (DType::BF16, 128, 1, 2, 1, 100, 100, Mask::Causal, None, false, true, false),
        (DType::F16, 128, 1, 2, 2, 150, 170, Mask::causal_window(40), Some(20.0), true, true, false),
        (DType::F16, 192, 1, 2, 1, 50, 130, Mask::Causal, None, false, false, false),
        (DType::BF16, 256, 1, 2, 2, 65, 70, Mask::None, None, false, true, false),
        (DType::BF16, 32, 1, 2, 1, 40, 30, Mask::window(0, 0), None, false, true, false),
        (DType::F16, 256, 2, 4, 2, 130, 150, Mask::window(30, 10), None, false, true, true),
        (DType::BF16, 96, 1, 2, 2, 1, 200, Mask::Causal, None, false, true, true),
        (DType::BF16, 192, 1, 2, 1, 70, 70, Mask::None, None, true, true, false),
        (DType::F16, 64, 1, 1, 1, 300, 300, Mask::Causal, Some(50.0), false, true, false),
    ];
    let mut cases = Vec::new();
    for &(dtype, hd, b, hq, hkv, sq, sk, mask, cap, use_alibi, lse, bhsd) in list {
        let o = opts(mask, cap, lse);
        let o = if use_alibi { o.alibi_slopes(alibi(hq)) } else { o };
        let mut c = Case::new("fa2", dtype, [b, sq, hq, hd], [b, sk, hkv, hd], o);
        c.bhsd = bhsd;
        cases.push(c);
    }
    if full() {
        // 30 random configurations: head dim, dtype, batch 1-2, GQA 1-3, seqlens 1-300, window
        // sides -1 or 0-120, softcap, ALiBi, LSE, layout.
        let mut rng = crate::support::Rng::new(crate::support::emu::matrix_seed("fa2 full matrix", 0x5EED_F2F2));
        let mut pick = |lo: u64, hi: u64| lo + rng.next_u64() % (hi - lo + 1);
        for _ in 0..30 {
            let hd = [32, 64, 96, 128, 192, 256][pick(0, 5) as usize];
            let dtype = if pick(0, 1) == 1 { DType::BF16 } else { DType::F16 };
            let (b, hkv) = (pick(1, 2) as usize, pick(1, 2) as usize);
            let hq = hkv * pick(1, 3) as usize;
            let sq = if pick(0, 3) == 0 { 1 } else { pick(1, 300) as usize };
            let sk = pick(1, 300) as usize;
            let left = if pick(0, 2) == 0 { pick(0, 120) as i64 } else { -1 };
            let right = if pick(0, 2) == 0 { pick(0, 120) as i64 } else if pick(0, 1) == 1 { 0 } else { -1 };
            let cap = (pick(0, 3) == 0).then(|| 10.0 + pick(0, 40) as f32);
            let o = opts(Mask::window(left, right), cap, pick(0, 3) != 0);
            let o = if pick(0, 3) == 0 { o.alibi_slopes(alibi(hq)) } else { o };
            let mut c = Case::new("fa2", dtype, [b, sq, hq, hd], [b, sk, hkv, hd], o);
            c.bhsd = pick(0, 1) == 1;
            c.label = "random".into();
            cases.push(c);
        }
    }
    check_all("fa2", &cases, &[]);
}

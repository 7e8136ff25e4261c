//! Attention sinks (`ForwardOptions::sinks`) on the CPU against the float64 reference: dense
//! (in-place decode path and tiled path), varlen, dense and paged KV caches, across masks, GQA,
//! softcap, ALiBi and forced split counts (the sink is counted once, at the merge); the closed
//! form on one key; the `merge_states` recipe; and the domain edges (−inf, NaN, +inf, wrong
//! length, huge logits, rows that see no key).

use crate::support::props;
use crate::support::cu_seqlens;
use crate::support::serving::{check_seq, mask_strategy, paged_table, values};
use crate::support::{check_forward, randn, Rng};
use flash_attn::serving::{
    forward_kvcache, forward_varlen, merge_states_n, BlockTable, KvCache, Varlen,
};
use flash_attn::{forward, Backend, DType, Error, ForwardOptions, Mask, Tensor};
use proptest::prelude::*;

/// Sink logits of `hq` heads: −inf (no sink) and finite values from well below to well above the
/// scores (N(0,1) inputs give scores of a few units).
fn sinks_strategy(hq: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![
            1 => Just(f32::NEG_INFINITY),
            4 => -4.0f32..4.0,
            1 => 4.0f32..40.0,
            1 => -40.0f32..-4.0,
        ],
        hq,
    )
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![DType::F32, DType::F16, DType::BF16])
}

/// The options of one case: mask, softcap / ALiBi at random, the sinks, forced splits.
fn opts_for(mask: Mask, softcap: Option<f32>, alibi: bool, sinks: &[f32], splits: Option<usize>) -> ForwardOptions {
    let hq = sinks.len();
    let mut o = ForwardOptions::default().mask(mask).return_lse(true).sinks(sinks.to_vec()).cpu_threads(2);
    if let Some(c) = softcap {
        o = o.softcap(c);
    }
    if alibi {
        o = o.alibi_slopes(crate::support::serving::slopes(hq));
    }
    if let Some(s) = splits {
        o = o.num_splits(s);
    }
    o
}

#[derive(Debug, Clone)]
struct Dense {
    batch: usize,
    heads_kv: usize,
    ratio: usize,
    sq: usize,
    sk: usize,
    d: usize,
    mask: Mask,
    softcap: Option<f32>,
    alibi: bool,
    splits: Option<usize>,
    dtype: DType,
    seed: u64,
}

fn dense_strategy() -> impl Strategy<Value = (Dense, Vec<f32>)> {
    (
        (1usize..=2, 1usize..=2, prop::sample::select(vec![1usize, 2, 4])),
        // Up to 16 query rows take the in-place decode path, more the tiled path.
        (prop_oneof![1usize..=16, 17usize..=70], 1usize..=160, prop::sample::select(vec![16usize, 40, 64])),
        mask_strategy(),
        (prop::option::weighted(0.25, 5.0f32..50.0), prop::bool::weighted(0.25)),
        (prop::option::of(prop::sample::select(vec![1usize, 2, 3, 7])), dtype_strategy(), any::<u64>()),
    )
        .prop_flat_map(|((batch, heads_kv, ratio), (sq, sk, d), mask, (softcap, alibi), (splits, dtype, seed))| {
            let c = Dense { batch, heads_kv, ratio, sq, sk, d, mask, softcap, alibi, splits, dtype, seed };
            (Just(c), sinks_strategy(heads_kv * ratio))
        })
}

/// Dense calls (both CPU paths) against the float64 reference, FlashAttention's tolerance rule,
/// and the LSE (which includes the sink) within 1e-4.
#[test]
fn dense_matches_the_reference() {
    let config = props::config("sinks dense", file!(), 64);
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let paths = std::cell::RefCell::new(std::collections::BTreeSet::new());
    runner
        .run(&dense_strategy(), |(c, sinks)| {
            let mut rng = Rng::new(c.seed | 1);
            let hq = c.heads_kv * c.ratio;
            let q = randn(&mut rng, c.dtype, [c.batch, c.sq, hq, c.d]);
            let k = randn(&mut rng, c.dtype, [c.batch, c.sk, c.heads_kv, c.d]);
            let v = randn(&mut rng, c.dtype, [c.batch, c.sk, c.heads_kv, c.d]);
            let opts = opts_for(c.mask, c.softcap, c.alibi, &sinks, c.splits).backend(Backend::Cpu);
            let (out, chk) = check_forward(&q, &k, &v, &opts);
            paths.borrow_mut().insert(out.dispatch.kernel.clone());
            prop_assert!(chk.err <= chk.bound, "{c:?} {sinks:?}: {chk:?}");
            let lse_tol = 1e-4 * sinks.iter().filter(|s| s.is_finite()).fold(1.0f32, |m, s| m.max(s.abs())) as f64;
            prop_assert!(chk.lse_err <= lse_tol, "{c:?} {sinks:?}: lse {chk:?}");
            prop_assert!(out.o.to_f32_vec().iter().all(|x| x.is_finite()));
            Ok(())
        })
        .unwrap();
    let paths = paths.into_inner();
    assert!(paths.len() >= 2, "both CPU paths ran: {paths:?}");
}

#[derive(Debug, Clone)]
struct Serving {
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
    heads_kv: usize,
    ratio: usize,
    d: usize,
    mask: Mask,
    splits: Option<usize>,
    dtype: DType,
    /// KV cache cases: paged with this page size (else dense); varlen cases ignore it.
    page: Option<usize>,
    seed: u64,
}

fn serving_strategy() -> impl Strategy<Value = (Serving, Vec<f32>)> {
    (
        prop::collection::vec((crate::support::serving::len_strategy(24), crate::support::serving::len_strategy(90)), 1..=3),
        (1usize..=2, prop::sample::select(vec![1usize, 2, 4]), prop::sample::select(vec![16usize, 64])),
        mask_strategy(),
        (prop::option::of(prop::sample::select(vec![1usize, 2, 5])), dtype_strategy()),
        (prop::option::of(prop::sample::select(vec![1usize, 7, 16])), any::<u64>()),
    )
        .prop_flat_map(|(lens, (heads_kv, ratio, d), mask, (splits, dtype), (page, seed))| {
            let (lens_q, lens_k) = lens.into_iter().unzip();
            let c = Serving { lens_q, lens_k, heads_kv, ratio, d, mask, splits, dtype, page, seed };
            (Just(c), sinks_strategy(heads_kv * ratio))
        })
}

/// One sequence's rows against the reference; a sequence with no key gives 0 and LSE = sink.
#[allow(clippy::too_many_arguments)]
fn check_one(
    c: &Serving,
    sinks: &[f32],
    (sq, sk): (usize, usize),
    (q, k, v): (&[f32], &[f32], &[f32]),
    o: &[f32],
    lse: &dyn Fn(usize, usize) -> f32,
    opts: &ForwardOptions,
) -> Result<(), String> {
    let (hq, hkv, d) = (c.heads_kv * c.ratio, c.heads_kv, c.d);
    if sk == 0 {
        if o.iter().any(|&x| x != 0.0) {
            return Err("a sequence with no key must give 0".into());
        }
        for (h, &z) in sinks.iter().enumerate().take(hq) {
            for i in 0..sq {
                if lse(h, i) != z {
                    return Err(format!("lse[{h}][{i}] = {}, expected the sink {z}", lse(h, i)));
                }
            }
        }
        return Ok(());
    }
    check_seq(c.dtype, (sq, sk, hq, hkv, d), q, k, v, opts, o, Some(lse)).map(|_| ())
}

/// Varlen batches and KV caches (dense and paged), every sequence against the float64
/// reference, with forced split counts.
#[test]
fn varlen_and_caches_match_the_reference() {
    let config = props::config("sinks serving", file!(), 48);
    let mut runner = proptest::test_runner::TestRunner::new(config);
    runner
        .run(&serving_strategy(), |(c, sinks)| {
            let mut rng = Rng::new(c.seed | 1);
            let (hq, hkv, d) = (c.heads_kv * c.ratio, c.heads_kv, c.d);
            let opts = opts_for(c.mask, None, false, &sinks, c.splits);
            let batch = c.lens_q.len();
            let qs: Vec<Vec<f32>> = c.lens_q.iter().map(|&n| values(&mut rng, n * hq * d, c.dtype)).collect();
            let ks: Vec<Vec<f32>> = c.lens_k.iter().map(|&n| values(&mut rng, n * hkv * d, c.dtype)).collect();
            let vs: Vec<Vec<f32>> = c.lens_k.iter().map(|&n| values(&mut rng, n * hkv * d, c.dtype)).collect();

            // Varlen.
            let (cu_q, cu_k) = (cu_seqlens(&c.lens_q), cu_seqlens(&c.lens_k));
            let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
            let q = Tensor::from_f32(&qs.concat(), c.dtype, [1, tq, hq, d]).unwrap();
            let k = Tensor::from_f32(&ks.concat(), c.dtype, [1, tk, hkv, d]).unwrap();
            let v = Tensor::from_f32(&vs.concat(), c.dtype, [1, tk, hkv, d]).unwrap();
            let seqs = Varlen {
                cu_seqlens_q: &cu_q,
                cu_seqlens_k: &cu_k,
                max_seqlen_q: c.lens_q.iter().copied().max().unwrap_or(0),
                max_seqlen_k: c.lens_k.iter().copied().max().unwrap_or(0),
            };
            let out = forward_varlen(&q, &k, &v, &seqs, &opts).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let (o, lse) = (out.o.to_f32_vec(), out.lse.unwrap());
            for b in 0..batch {
                let (q0, sq, sk) = (cu_q[b] as usize, c.lens_q[b], c.lens_k[b]);
                let rows = &o[q0 * hq * d..(q0 + sq) * hq * d];
                let l = |h: usize, i: usize| lse[h * tq + q0 + i];
                check_one(&c, &sinks, (sq, sk), (&qs[b], &ks[b], &vs[b]), rows, &l, &opts)
                    .map_err(|e| TestCaseError::fail(format!("varlen {c:?} {sinks:?} seq {b}: {e}")))?;
            }

            // KV cache: q padded to the longest sequence, the cache dense or paged.
            let sq_max = c.lens_q.iter().copied().max().unwrap_or(0).max(1);
            let mut qd = vec![0.0f32; batch * sq_max * hq * d];
            for b in 0..batch {
                qd[b * sq_max * hq * d..][..qs[b].len()].copy_from_slice(&qs[b]);
            }
            // Every sequence of a cache call has sq_max query rows (the padding rows are checked too).
            let qd_rows = |b: usize| qd[b * sq_max * hq * d..(b + 1) * sq_max * hq * d].to_vec();
            let q = Tensor::from_f32(&qd, c.dtype, [batch, sq_max, hq, d]).unwrap();
            let seqlens: Vec<i32> = c.lens_k.iter().map(|&n| n as i32).collect();
            let cap = c.lens_k.iter().copied().max().unwrap_or(0).max(1);
            let row = hkv * d;
            let (kc, vc, table) = match c.page {
                None => {
                    let (mut kc, mut vc) = (vec![0.0f32; batch * cap * row], vec![0.0f32; batch * cap * row]);
                    for b in 0..batch {
                        kc[b * cap * row..][..ks[b].len()].copy_from_slice(&ks[b]);
                        vc[b * cap * row..][..vs[b].len()].copy_from_slice(&vs[b]);
                    }
                    (kc, vc, None)
                }
                Some(ps) => {
                    let t = paged_table(&c.lens_k, 0, ps, false, (1, 1), &mut rng);
                    let (mut kc, mut vc) = (vec![0.0f32; t.num_blocks * ps * row], vec![0.0f32; t.num_blocks * ps * row]);
                    for b in 0..batch {
                        for j in 0..c.lens_k[b] {
                            let blk = t.ids[b * t.width + j / ps] as usize;
                            let at = (blk * ps + j % ps) * row;
                            kc[at..at + row].copy_from_slice(&ks[b][j * row..(j + 1) * row]);
                            vc[at..at + row].copy_from_slice(&vs[b][j * row..(j + 1) * row]);
                        }
                    }
                    (kc, vc, Some(t))
                }
            };
            let shape = match (&table, c.page) {
                (Some(t), Some(ps)) => [t.num_blocks, ps, hkv, d],
                _ => [batch, cap, hkv, d],
            };
            let kt = Tensor::from_f32(&kc, c.dtype, shape).unwrap();
            let vt = Tensor::from_f32(&vc, c.dtype, shape).unwrap();
            let cache = match &table {
                Some(t) => KvCache::paged(
                    kt.view(),
                    vt.view(),
                    &seqlens,
                    BlockTable { ids: &t.ids, max_blocks_per_seq: t.width },
                ),
                None => KvCache::dense(kt.view(), vt.view(), &seqlens),
            };
            let out = forward_kvcache(&q, &cache, &opts).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let (o, lse) = (out.o.to_f32_vec(), out.lse.unwrap());
            for b in 0..batch {
                let rows = &o[b * sq_max * hq * d..(b + 1) * sq_max * hq * d];
                let l = |h: usize, i: usize| lse[(b * hq + h) * sq_max + i];
                check_one(&c, &sinks, (sq_max, c.lens_k[b]), (&qd_rows(b), &ks[b], &vs[b]), rows, &l, &opts)
                    .map_err(|e| TestCaseError::fail(format!("kvcache {c:?} {sinks:?} seq {b}: {e}")))?;
            }
            Ok(())
        })
        .unwrap();
}

/// One key of score `s` and a sink `z`: `o = v · e^s / (e^s + e^z)`, `lse = ln(e^s + e^z)`, on
/// both CPU paths (1 query row: in place; 40 rows: tiled).
#[test]
fn one_key_closed_form() {
    for sq in [1usize, 40] {
        for (s, z) in [(0.5f32, 0.5f32), (1.0, -2.0), (-3.0, 4.0), (20.0, -20.0)] {
            // q = (s, 0, ..), k = (1, 0, ..) with scale 1: the score is s.
            let d = 8;
            let mut qv = vec![0.0f32; sq * d];
            qv.iter_mut().step_by(d).for_each(|x| *x = s);
            let mut kv = vec![0.0f32; d];
            kv[0] = 1.0;
            let vv: Vec<f32> = (0..d).map(|x| x as f32 - 3.0).collect();
            let q = Tensor::from_vec(qv, [1, sq, 1, d]).unwrap();
            let k = Tensor::from_vec(kv, [1, 1, 1, d]).unwrap();
            let v = Tensor::from_vec(vv.clone(), [1, 1, 1, d]).unwrap();
            let opts = ForwardOptions::default().softmax_scale(1.0).sinks(vec![z]).return_lse(true);
            let out = forward(&q, &k, &v, &opts).unwrap();
            let (s, z) = (s as f64, z as f64);
            let w = 1.0 / (1.0 + (z - s).exp());
            let lse = s.max(z) + ((s - s.max(z)).exp() + (z - s.max(z)).exp()).ln();
            let o = out.o.to_f32_vec();
            for i in 0..sq {
                for x in 0..d {
                    let want = vv[x] as f64 * w;
                    assert!((o[i * d + x] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0), "sq {sq} s {s} z {z}");
                }
                let got = out.lse.as_ref().unwrap()[i] as f64;
                assert!((got - lse).abs() <= 1e-6 * lse.abs().max(1.0), "sq {sq} s {s} z {z}: lse {got} vs {lse}");
            }
        }
    }
}

/// `merge_states` of a split of the keys carries no sink; merging one more state `(0, sink)`
/// gives the call with the sink.
#[test]
fn merge_states_recipe_adds_the_sink_once() {
    let mut rng = Rng::new(7);
    let (sq, sk, hq, d) = (3, 50, 2, 32);
    let q = randn(&mut rng, DType::F32, [1, sq, hq, d]);
    let k = randn(&mut rng, DType::F32, [1, sk, hq, d]);
    let v = randn(&mut rng, DType::F32, [1, sk, hq, d]);
    let sinks = vec![1.5f32, -0.5];
    let half = |t: &Tensor, r: std::ops::Range<usize>| {
        let x = t.to_f32_vec();
        Tensor::from_vec(x[r.start * hq * d..r.end * hq * d].to_vec(), [1, r.len(), hq, d]).unwrap()
    };
    let plain = ForwardOptions::default().return_lse(true);
    let a = forward(&q, &half(&k, 0..20), &half(&v, 0..20), &plain).unwrap();
    let b = forward(&q, &half(&k, 20..sk), &half(&v, 20..sk), &plain).unwrap();
    let zeros = Tensor::zeros(DType::F32, [1, sq, hq, d]).unwrap();
    let sink_lse: Vec<f32> = (0..hq).flat_map(|h| std::iter::repeat_n(sinks[h], sq)).collect();
    let (la, lb) = (a.lse.unwrap(), b.lse.unwrap());
    let merged = merge_states_n(&[(a.o.view(), &la), (b.o.view(), &lb), (zeros.view(), &sink_lse)]).unwrap();
    let whole = forward(&q, &k, &v, &plain.clone().sinks(sinks)).unwrap();
    let (m, w) = (merged.o.to_f32_vec(), whole.o.to_f32_vec());
    assert!(m.iter().zip(&w).all(|(x, y)| (x - y).abs() <= 1e-6), "outputs differ");
    assert!(merged.lse.iter().zip(whole.lse.as_ref().unwrap()).all(|(x, y)| (x - y).abs() <= 1e-5));
}

fn small(sq: usize, dtype: DType) -> (Tensor, Tensor, Tensor) {
    let mut rng = Rng::new(11);
    (
        randn(&mut rng, dtype, [2, sq, 4, 16]),
        randn(&mut rng, dtype, [2, 9, 2, 16]),
        randn(&mut rng, dtype, [2, 9, 2, 16]),
    )
}

/// NaN, +inf and a wrong length are typed errors naming the option, what was given and what
/// was expected; every entry point validates them.
#[test]
fn invalid_sinks_are_typed_errors() {
    let (q, k, v) = small(3, DType::F32);
    for (sinks, got) in [
        (vec![0.0f32, f32::NAN, 0.0, 0.0], "NaN"),
        (vec![0.0f32, 0.0, f32::INFINITY, 0.0], "inf"),
        (vec![0.0f32; 3], "3 values"),
        (vec![0.0f32; 8], "8 values"),
        (vec![], "0 values"),
    ] {
        let opts = ForwardOptions::default().sinks(sinks.clone());
        let e = forward(&q, &k, &v, &opts).unwrap_err();
        match &e {
            Error::InvalidOption { option: "sinks", got: g, expected } => {
                assert!(g.contains(got), "{sinks:?}: {e}");
                assert!(expected.contains("logit"), "{e}");
            }
            _ => panic!("{sinks:?}: {e:?}"),
        }
        let seqlens = [9i32, 9];
        let cache = KvCache::dense(k.view(), v.view(), &seqlens);
        assert!(matches!(forward_kvcache(&q, &cache, &opts), Err(Error::InvalidOption { option: "sinks", .. })));
    }
}

/// −inf is no sink: all −inf gives the call without sinks bit for bit, on both paths and with
/// splits; a head with −inf among finite ones gives that head's rows of the plain call.
#[test]
fn minus_infinity_is_no_sink() {
    for sq in [1usize, 2, 40] {
        for splits in [1usize, 3] {
            let (q, k, v) = small(sq, DType::BF16);
            let plain = ForwardOptions::default().return_lse(true).num_splits(splits);
            let want = forward(&q, &k, &v, &plain).unwrap();
            let none = forward(&q, &k, &v, &plain.clone().sinks(vec![f32::NEG_INFINITY; 4])).unwrap();
            assert_eq!(none.o, want.o, "sq {sq}");
            assert_eq!(none.lse, want.lse, "sq {sq}");
            let some = forward(&q, &k, &v, &plain.clone().sinks(vec![2.0, f32::NEG_INFINITY, -1.0, 0.0])).unwrap();
            let (a, b) = (some.o.to_f32_vec(), want.o.to_f32_vec());
            let (la, lb) = (some.lse.unwrap(), want.lse.unwrap());
            for bi in 0..2 {
                for i in 0..sq {
                    let row = |x: &[f32], h: usize| x[((bi * sq + i) * 4 + h) * 16..][..16].to_vec();
                    assert_eq!(row(&a, 1), row(&b, 1), "head 1 has no sink");
                    assert_ne!(row(&a, 0), row(&b, 0), "head 0 has one");
                    assert_eq!(la[(bi * 4 + 1) * sq + i], lb[(bi * 4 + 1) * sq + i]);
                }
            }
        }
    }
}

/// Huge logits: a sink far above every score takes the whole row (output 0, LSE = the sink), one
/// far below changes nothing; no NaN, no overflow, whatever the magnitude.
#[test]
fn huge_sinks_stay_finite() {
    for sq in [1usize, 40] {
        let (q, k, v) = small(sq, DType::F32);
        let plain = ForwardOptions::default().return_lse(true);
        let want = forward(&q, &k, &v, &plain).unwrap();
        for z in [1e4f32, 1e30, f32::MAX] {
            let out = forward(&q, &k, &v, &plain.clone().sinks(vec![z; 4])).unwrap();
            assert!(out.o.to_f32_vec().iter().all(|&x| x == 0.0), "sink {z}: output 0");
            assert!(out.lse.unwrap().iter().all(|&l| l == z), "sink {z}: LSE is the sink");
        }
        for z in [-1e4f32, -1e30, f32::MIN] {
            let out = forward(&q, &k, &v, &plain.clone().sinks(vec![z; 4])).unwrap();
            let (a, b) = (out.o.to_f32_vec(), want.o.to_f32_vec());
            assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-6 * y.abs().max(1.0)), "sink {z}");
            let (la, lb) = (out.lse.unwrap(), want.lse.as_ref().unwrap().clone());
            assert!(la.iter().zip(&lb).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1.0)), "sink {z}");
        }
    }
}

/// A row that sees no key (a window past the sequence) gives output 0 and LSE = its sink (−inf
/// without one), on both paths.
#[test]
fn rows_that_see_no_key_get_the_sink_as_lse() {
    for sq in [12usize, 40] {
        let (q, k, v) = small(sq, DType::F16);
        // sk = 9 < sq: causal rows i < sq - 9 see no key.
        let sinks = vec![0.25f32, f32::NEG_INFINITY, -3.0, 7.0];
        let opts = ForwardOptions::default().causal(true).return_lse(true).sinks(sinks.clone());
        let out = forward(&q, &k, &v, &opts).unwrap();
        let (o, lse) = (out.o.to_f32_vec(), out.lse.unwrap());
        for b in 0..2 {
            for h in 0..4 {
                for i in 0..sq.saturating_sub(9) {
                    assert!(o[((b * sq + i) * 4 + h) * 16..][..16].iter().all(|&x| x == 0.0));
                    assert_eq!(lse[(b * 4 + h) * sq + i], sinks[h], "b {b} h {h} i {i}");
                }
            }
        }
    }
}

/// The backward with sinks against the float64 reference extended with them (its sink gradient
/// is checked by central finite differences in src/reference.rs): dq, dk, dv and `d_sinks` with
/// FlashAttention's rule for gradients (`max|ours − ref| ≤ 2·max|naive − ref| + floor·max(1,
/// max|ref|)`), over masks (rows that see no key but the sink), GQA, softcap, ALiBi, −inf and
/// large sink logits and the three dtypes.
#[test]
fn backward_matches_the_reference() {
    use flash_attn::reference::{attention_backward_f64, attention_backward_naive, max_abs_diff};
    let config = props::config("sinks backward", file!(), 32);
    let mut runner = proptest::test_runner::TestRunner::new(config);
    runner
        .run(&dense_strategy(), |(c, sinks)| {
            let mut rng = Rng::new(c.seed | 1);
            let hq = c.heads_kv * c.ratio;
            let q = randn(&mut rng, c.dtype, [c.batch, c.sq, hq, c.d]);
            let k = randn(&mut rng, c.dtype, [c.batch, c.sk, c.heads_kv, c.d]);
            let v = randn(&mut rng, c.dtype, [c.batch, c.sk, c.heads_kv, c.d]);
            let d_o = randn(&mut rng, c.dtype, [c.batch, c.sq, hq, c.d]);
            let opts = opts_for(c.mask, c.softcap, c.alibi, &sinks, None).backend(Backend::Cpu);
            let out = forward(&q, &k, &v, &opts).unwrap();
            let g = flash_attn::backward(&q, &k, &v, &out.o, &d_o, out.lse.as_deref().unwrap(), &opts).unwrap();
            let p = flash_attn::Problem::new(&q.view(), &k.view(), &v.view(), &opts).unwrap();
            let (qv, kv, vv, dov) = (q.view(), k.view(), v.view(), d_o.view());
            let r = attention_backward_f64(&p, &qv, &kv, &vv, &dov).unwrap();
            let n = attention_backward_naive(&p, &qv, &kv, &vv, &dov, c.dtype).unwrap();
            let f64s = |t: &Tensor| t.to_f32_vec().iter().map(|&x| x as f64).collect::<Vec<_>>();
            let has_sink = sinks.iter().any(|s| *s != f32::NEG_INFINITY);
            prop_assert_eq!(g.d_sinks.is_some(), has_sink);
            let ours_ds: Vec<f64> = g.d_sinks.iter().flatten().map(|&x| x as f64).collect();
            let none = Vec::new();
            for (name, ours, rf, nv) in [
                ("dq", f64s(&g.dq), &r.dq, &n.dq),
                ("dk", f64s(&g.dk), &r.dk, &n.dk),
                ("dv", f64s(&g.dv), &r.dv, &n.dv),
                ("d_sinks", ours_ds, r.d_sinks.as_ref().unwrap_or(&none), n.d_sinks.as_ref().unwrap_or(&none)),
            ] {
                prop_assert!(ours.iter().all(|x| x.is_finite()), "{c:?} {sinks:?}: {name} not finite");
                let err = max_abs_diff(&ours, rf);
                let scale = rf.iter().fold(1.0f64, |m, x| m.max(x.abs()));
                let bound = 2.0 * max_abs_diff(nv, rf) + crate::support::floor_for(c.dtype) * scale;
                prop_assert!(err <= bound, "{c:?} {sinks:?}: max|{name} - ref| {err:.3e} > {bound:.3e}");
            }
            for (h, s) in sinks.iter().enumerate() {
                if *s == f32::NEG_INFINITY && has_sink {
                    prop_assert_eq!(g.d_sinks.as_ref().unwrap()[h], 0.0, "a -inf sink has no gradient");
                }
            }
            Ok(())
        })
        .unwrap();
}

/// `backward_varlen`'s sink gradient is the sum of its sequences' dense ones; `backward_into`
/// (no buffer for `d_sinks`) refuses sinks with a typed error, and an f32 call with sinks on the
/// GPU route is a typed error too (the kernels take f16/bf16; here no GPU either).
#[test]
fn backward_varlen_and_refusals() {
    let (hq, d) = (2, 16);
    let lens = [5usize, 9, 1];
    let total: usize = lens.iter().sum();
    let mut rng = Rng::new(11);
    let shape = [1, total, hq, d];
    let (q, k, v, d_o) = (
        randn(&mut rng, DType::F32, shape),
        randn(&mut rng, DType::F32, shape),
        randn(&mut rng, DType::F32, shape),
        randn(&mut rng, DType::F32, shape),
    );
    let sinks = vec![0.5f32, -1.0];
    let opts = ForwardOptions::default().backend(Backend::Cpu).causal(true).return_lse(true).sinks(sinks.clone());
    let mut cu = vec![0i32];
    for l in lens {
        cu.push(cu.last().unwrap() + l as i32);
    }
    let seqs = Varlen { cu_seqlens_q: &cu, cu_seqlens_k: &cu, max_seqlen_q: 9, max_seqlen_k: 9 };
    let out = forward_varlen(&q, &k, &v, &seqs, &opts).unwrap();
    let lse = out.lse.clone().unwrap();
    let g = flash_attn::serving::backward_varlen(&q, &k, &v, &out.o, &d_o, &lse, &seqs, &opts).unwrap();
    let mut sum = [0.0f64; 2];
    for (s, w) in cu.windows(2).enumerate() {
        let (a, n) = (w[0] as usize, (w[1] - w[0]) as usize);
        let slice = |t: &Tensor| Tensor::from_vec(t.to_f32_vec()[a * hq * d..(a + n) * hq * d].to_vec(), [1, n, hq, d]).unwrap();
        let (qs, ks, vs, ds) = (slice(&q), slice(&k), slice(&v), slice(&d_o));
        let o1 = forward(&qs, &ks, &vs, &opts).unwrap();
        let g1 = flash_attn::backward(&qs, &ks, &vs, &o1.o, &ds, o1.lse.as_deref().unwrap(), &opts).unwrap();
        for (acc, x) in sum.iter_mut().zip(g1.d_sinks.unwrap()) {
            *acc += x as f64;
        }
        assert!(n > 0, "sequence {s}");
    }
    let ds = g.d_sinks.unwrap();
    for h in 0..hq {
        assert!((ds[h] as f64 - sum[h]).abs() <= 1e-5 * (1.0 + sum[h].abs()), "head {h}: {} vs {}", ds[h], sum[h]);
        assert!(ds[h] != 0.0);
    }
    let dense = ForwardOptions::default().backend(Backend::Cpu).sinks(sinks);
    let q1 = randn(&mut rng, DType::F32, [1, 4, hq, d]);
    let o1 = forward(&q1, &q1, &q1, &dense.clone().return_lse(true)).unwrap();
    let lse1 = o1.lse.unwrap();
    let (mut a, mut b, mut c) = (vec![0.0f32; 4 * hq * d], vec![0.0f32; 4 * hq * d], vec![0.0f32; 4 * hq * d]);
    let e = flash_attn::backward_into(&q1, &q1, &q1, &o1.o, &q1, &lse1, (&mut a, &mut b, &mut c), &dense).unwrap_err();
    assert!(matches!(e, Error::InvalidOption { option: "sinks", .. }), "{e:?}");
    let gpu = dense.clone().backend(Backend::Cuda(0)).variant(flash_attn::Variant::Fa2);
    let e = flash_attn::backward(&q1, &q1, &q1, &o1.o, &q1, &lse1, &gpu).unwrap_err();
    assert!(matches!(e, Error::InvalidOption { .. } | Error::BackendUnavailable { .. } | Error::UnsupportedDType { .. }), "{e:?}");
}

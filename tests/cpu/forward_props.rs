//! Property tests: the CPU backend against the float64 reference over random shapes and options,
//! with FlashAttention's tolerance rule (see tests/support). Each run prints the largest observed
//! ratio err / naive_err so the margins are visible
//! (`cargo test --test cpu forward_props -- --nocapture`).

use crate::support::props;
use crate::support::*;
use crate::support::Rng;
use flash_attn::bench::support::HeadMajor;
use flash_attn::{DType, ForwardOptions, Mask};
use proptest::prelude::*;

/// Upper bound on batch·heads_q·seqlen_q·seqlen_k·head_dim per case, so the float64 reference
/// stays fast; the batch is reduced to fit.
const WORK_LIMIT: usize = 12_000_000;

#[derive(Debug, Clone)]
struct Case {
    batch: usize,
    heads_kv: usize,
    ratio: usize,
    sq: usize,
    sk: usize,
    d: usize,
    mask: Mask,
    softcap: Option<f32>,
    alibi: bool,
    lse: bool,
    /// Q, K, V stored `[batch, heads, seqlen, head_dim]`, passed as strided views.
    head_major: bool,
    seed: u64,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        (1usize..=3, 1usize..=2, prop::sample::select(vec![1usize, 2, 4, 7])),
        (1usize..=300, 1usize..=300, prop::sample::select(vec![32usize, 64, 80, 96, 128, 192, 256])),
        props::mask_strategy(40),
        (prop::option::weighted(0.3, 5.0f32..50.0), prop::bool::weighted(0.3), any::<bool>(), any::<u64>()),
        any::<bool>(),
    )
        .prop_map(|((batch, heads_kv, ratio), (sq, sk, d), mask, (softcap, alibi, lse, seed), head_major)| {
            let per_batch = heads_kv * ratio * sq * sk * d;
            let batch = batch.min((WORK_LIMIT / per_batch).max(1));
            Case { batch, heads_kv, ratio, sq, sk, d, mask, softcap, alibi, lse, head_major, seed }
        })
}

/// Runs `cases` random cases for `dtype` and prints the observed margins.
fn run_dtype(dtype: DType, cases: u32) {
    let config = props::config(&format!("forward_props {dtype:?}"), file!(), cases);
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let margins = std::cell::RefCell::new(Vec::new());
    let result = runner.run(&case_strategy(), |c| {
        let m = run_case(&c, dtype)?;
        margins.borrow_mut().push(m);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{dtype:?}: {e}");
    }
    let m = margins.into_inner();
    let worst = m.iter().map(|(e, n)| e / n.max(1e-30)).fold(0.0, f64::max);
    let max_err = m.iter().map(|x| x.0).fold(0.0, f64::max);
    println!("{dtype:?}: {} cases passed; max err {max_err:.3e}; max err/naive_err {worst:.3}", m.len());
}

/// Returns (err, naive_err) of one case.
fn run_case(c: &Case, dtype: DType) -> Result<(f64, f64), TestCaseError> {
    let mut rng = Rng::new(c.seed | 1);
    let hq = c.heads_kv * c.ratio;
    let q = randn(&mut rng, dtype, [c.batch, c.sq, hq, c.d]);
    let k = randn(&mut rng, dtype, [c.batch, c.sk, c.heads_kv, c.d]);
    let v = randn(&mut rng, dtype, [c.batch, c.sk, c.heads_kv, c.d]);
    let mut opts = ForwardOptions::default().mask(c.mask).return_lse(c.lse);
    if let Some(cap) = c.softcap {
        opts = opts.softcap(cap);
    }
    if c.alibi {
        let slopes: Vec<f32> = (0..hq).map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / hq as f32)).collect();
        opts = opts.alibi_slopes(slopes);
    }
    let (out, chk) = if c.head_major {
        let (qh, kh, vh) = (HeadMajor::new(&q), HeadMajor::new(&k), HeadMajor::new(&v));
        check_views(&qh.view(), &kh.view(), &vh.view(), &opts)
    } else {
        check_forward(&q, &k, &v, &opts)
    };
    prop_assert!(chk.err <= chk.bound, "{c:?} {dtype:?}: {chk:?}");
    prop_assert_eq!(out.lse.is_some(), c.lse);
    if c.lse {
        prop_assert!(chk.lse_err <= 1e-4, "{c:?} {dtype:?}: lse {chk:?}");
    }
    prop_assert!(out.o.to_f32_vec().iter().all(|x| x.is_finite()), "finite inputs must give finite outputs");
    Ok((chk.err, chk.naive_err))
}

#[test]
fn cpu_matches_reference_f32() {
    run_dtype(DType::F32, 48);
}

#[test]
fn cpu_matches_reference_f16() {
    run_dtype(DType::F16, 48);
}

#[test]
fn cpu_matches_reference_bf16() {
    run_dtype(DType::BF16, 48);
}

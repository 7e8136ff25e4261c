//! Packed (varlen) batches: q, k and v packed by offsets, contiguous or head-major.

use super::*;
use super::layout::read_cu;
use super::edits::{apply_cu, cu_edit, dtype_strategy, edits, splits_strategy, CuEdit};

#[derive(Clone, Debug)]
struct VarlenCase {
    opts: Opts,
    dtype: DType,
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
    /// `max_seqlen_q/k` = the longest sequence + this (below the longest when negative).
    slack: (i8, i8),
    /// k and v stored head-major (strided views).
    heads_major: bool,
    edits: Vec<CuEdit>,
}

fn varlen_strategy() -> impl Strategy<Value = VarlenCase> {
    (
        (opts_strategy(splits_strategy()), dtype_strategy(), 1usize..=4),
        ((slack(), slack()), any::<bool>(), edits(cu_edit(true))),
    )
        .prop_flat_map(|((opts, dtype, batch), (slack, heads_major, edits))| {
            (
                prop::collection::vec(len_strategy(24), batch),
                prop::collection::vec(len_strategy(80), batch),
            )
                .prop_map(move |(lens_q, lens_k)| VarlenCase {
                    opts: opts.clone(),
                    dtype,
                    lens_q,
                    lens_k,
                    slack,
                    heads_major,
                    edits: edits.clone(),
                })
        })
}

/// `max_seqlen` slack: mostly an upper bound (0 to 2 past the longest, or `usize::MAX` for
/// `i8::MAX`), sometimes one short.
fn slack() -> impl Strategy<Value = i8> {
    prop_oneof![9 => 0i8..=2, 1 => Just(i8::MAX), 1 => Just(-1i8)]
}

pub(super) fn offsets(lens: &[usize]) -> Vec<i32> {
    std::iter::once(0)
        .chain(lens.iter().scan(0i32, |a, &l| {
            *a += l as i32;
            Some(*a)
        }))
        .collect()
}

pub(super) fn bound(lens: &[usize], slack: i8) -> usize {
    if slack == i8::MAX {
        return usize::MAX;
    }
    (lens.iter().copied().max().unwrap_or(0) as i64 + slack as i64).max(0) as usize
}

/// `x` `[rows][heads][d]` stored head-major, `[heads][rows][d]`.
fn heads_major_copy(x: &[f32], rows: usize, heads: usize, d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for h in 0..heads {
        for r in 0..rows {
            out.extend_from_slice(&x[(r * heads + h) * d..][..d]);
        }
    }
    out
}

/// A `[b, h, s, d]` tensor read as `[b, s, h, d]` (strided).
fn heads_major_view(t: &Tensor) -> TensorView<'_> {
    match t.data() {
        OwnedData::F32(x) => TensorView::heads_major(x, t.shape()),
        OwnedData::F16(x) => TensorView::heads_major(x, t.shape()),
        OwnedData::BF16(x) => TensorView::heads_major(x, t.shape()),
    }
}

fn varlen_case(c: &VarlenCase, worst: &Worst) -> Result<(), TestCaseError> {
    let (o, dtype) = (&c.opts, c.dtype);
    let (hq, hkv, d) = (o.hq(), o.heads_kv, o.d);
    let (mut cu_q, mut cu_k) = (offsets(&c.lens_q), offsets(&c.lens_k));
    let (mut tq, mut tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
    for e in &c.edits {
        apply_cu(e, [&mut cu_q, &mut cu_k], [&mut tq, &mut tk]);
    }
    let (max_q, max_k) = (bound(&c.lens_q, c.slack.0), bound(&c.lens_k, c.slack.1));
    let mut broken = Broken::new();
    let rq = read_cu("cu_seqlens_q", "max_seqlen_q", &cu_q, tq, max_q, &mut broken);
    let rk = read_cu("cu_seqlens_k", "max_seqlen_k", &cu_k, tk, max_k, &mut broken);
    if let (Some(a), Some(b)) = (&rq, &rk) {
        if a.len() != b.len() {
            broken.push("cu_seqlens_k");
        }
    }
    if matches!(o.splits, Some(n) if !(1..=128).contains(&n)) {
        broken.push("num_splits");
    }
    let mut rng = Rng::new(o.seed | 1);
    let (qv, kv, vv) = (
        values(&mut rng, tq * hq * d, dtype),
        values(&mut rng, tk * hkv * d, dtype),
        values(&mut rng, tk * hkv * d, dtype),
    );
    let q = Tensor::from_f32(&qv, dtype, [1, tq, hq, d]).unwrap();
    // k and v contiguous, or stored head-major and read through strided views.
    let kv_tensor = |x: &[f32]| match c.heads_major {
        false => Tensor::from_f32(x, dtype, [1, tk, hkv, d]).unwrap(),
        true => Tensor::from_f32(&heads_major_copy(x, tk, hkv, d), dtype, [1, hkv, tk, d]).unwrap(),
    };
    let (k_store, v_store) = (kv_tensor(&kv), kv_tensor(&vv));
    let (k, v) = match c.heads_major {
        false => (k_store.view(), v_store.view()),
        true => (heads_major_view(&k_store), heads_major_view(&v_store)),
    };
    let seqs = Varlen {
        cu_seqlens_q: &cu_q,
        cu_seqlens_k: &cu_k,
        max_seqlen_q: max_q,
        max_seqlen_k: max_k,
    };
    let opts = o.forward();
    let out = match forward_varlen(&q, &k, &v, &seqs, &opts) {
        Err(e) => {
            worst.refused.set(worst.refused.get() + 1);
            return expect_refusal(&e, &broken);
        }
        Ok(out) => out,
    };
    worst.accepted.set(worst.accepted.get() + 1);
    prop_assert!(broken.is_empty(), "accepted a layout that breaks {:?}", broken);
    let (rq, rk) = (rq.unwrap(), rk.unwrap());
    prop_assert_eq!(out.o.shape(), [1, tq, hq, d]);
    prop_assert_eq!(out.lse.as_ref().map(|l| l.len()), o.lse.then_some(hq * tq));
    let seq_inputs: Vec<SeqInputs> = rq
        .iter()
        .zip(&rk)
        .map(|(&(q0, q1), &(k0, k1))| SeqInputs {
            q: qv[q0 * hq * d..q1 * hq * d].to_vec(),
            k: kv[k0 * hkv * d..k1 * hkv * d].to_vec(),
            v: vv[k0 * hkv * d..k1 * hkv * d].to_vec(),
        })
        .collect();
    let q_rows = |b: usize| (rq[b].0, rq[b].1 - rq[b].0);
    let lse_at = |b: usize, h: usize, i: usize| h * tq + rq[b].0 + i;
    check_sequences(dtype, o, &opts, &out, &seq_inputs, &q_rows, &lse_at, worst)?;
    let one = forward_varlen(&q, &k, &v, &seqs, &opts.clone().num_splits(1))
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    worst.split(split_ulps(dtype, &one, &out, max_abs(&vv))?);
    Ok(())
}

#[test]
fn varlen_layouts() {
    run("varlen layouts", 400, varlen_strategy(), varlen_case);
}

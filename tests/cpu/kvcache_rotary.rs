//! Rotary embedding in the KV append, `cache_batch_idx` and `cache_leftpad`, against the float64
//! reference sequence by sequence (FlashAttention's `flash_attn_with_kvcache` semantics): dense
//! and paged caches, interleaved and half-split pairs, `rotary_dim` below head_dim, GQA, every
//! mask, leftpad, batch_idx permutations of a larger pool of cache rows. The append must write
//! exactly the rotated rows (each within one rounding of the float64 rotation) and nothing else;
//! every malformed argument is a typed error with the cache untouched.

use crate::support::props;
use crate::support::serving::{check_seq, mask_strategy, paged_table, values, Rng};
use flash_attn::reference::rotary_f64;
use flash_attn::serving::{
    forward_kvcache, forward_kvcache_append, forward_kvcache_append_rotary, forward_varlen_kvcache, BlockTable,
    KvCache, KvCacheMut, Rotary,
};
use flash_attn::{Backend, DType, Element, Error, ForwardOptions, Mask, Output, Tensor, TensorView};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    heads_kv: usize,
    ratio: usize,
    d: usize,
    /// `None`: no rotary embedding.
    rotary: Option<(usize, bool)>,
    mask: Mask,
    lens: Vec<usize>,
    /// Padding before each sequence's keys (dense caches).
    leftpad: Option<Vec<usize>>,
    /// Cache rows in the pool beyond the batch, and whether sequences take shuffled rows.
    batch_idx: Option<usize>,
    new: usize,
    sq: usize,
    page_size: Option<usize>,
    /// Read-only calls (new = 0, no rotary) through `forward_varlen_kvcache` with a packed q.
    packed_q: bool,
    threads: usize,
    seed: u64,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        (1usize..=2, prop::sample::select(vec![1usize, 2, 4]), prop::sample::select(vec![16usize, 36, 64, 128])),
        (prop::option::weighted(0.85, (0.0f64..=1.0, any::<bool>())), mask_strategy()),
        (1usize..=3, 0usize..=3, 1usize..=4, prop::option::weighted(0.4, 1usize..=16)),
        (any::<bool>(), any::<bool>(), 0usize..=2, 1usize..=2, any::<u64>(), any::<bool>()),
    )
        .prop_flat_map(
            |((heads_kv, ratio, d), (rot, mask), (batch, new, sq, page_size), (pad, idx, spare, threads, seed, packed))| {
                let rotary = rot.map(|(f, il)| (((d as f64 * f / 2.0) as usize).clamp(1, d / 2) * 2, il));
                let dense = page_size.is_none();
                (prop::collection::vec(0usize..=60, batch), prop::collection::vec(0usize..=60, batch)).prop_map(
                    move |(lens, pads)| Case {
                        heads_kv,
                        ratio,
                        d,
                        rotary,
                        mask,
                        leftpad: (dense && pad).then(|| lens.iter().zip(&pads).map(|(l, p)| p % (l + 1)).collect()),
                        lens,
                        batch_idx: (dense && idx).then_some(spare),
                        // A rotary embedding comes with an append.
                        new: if rotary.is_some() { new.max(1) } else { new },
                        sq,
                        page_size,
                        packed_q: packed && new == 0 && rotary.is_none(),
                        threads,
                        seed,
                    },
                )
            },
        )
}

/// FlashAttention's rule for q's positions: row `i` at `seqlens[b] + i` under a causal or
/// window mask (a bound at or past the cache's capacity counts as unbounded), else all rows at
/// `seqlens[b]`.
fn q_advances(mask: Mask, capacity: usize) -> bool {
    let bounded = |x: i64| x >= 0 && (x as usize) < capacity;
    match mask {
        Mask::None => false,
        Mask::Window { left, right, causal } => causal || bounded(left) || bounded(right),
        _ => true,
    }
}

/// The largest difference an f32 rotation rounded once to `dtype` may have from the float64
/// one: a rounding of the result, plus f32's error on the pair's products.
fn rotation_tol(dtype: DType, want: f64, pair: f64) -> f64 {
    let eps = match dtype {
        DType::F32 => f64::from(f32::EPSILON) * 4.0,
        DType::F16 => 2f64.powi(-10),
        _ => 2f64.powi(-7),
    };
    eps * want.abs().max(pair) + 1e-7
}

fn run_case<T: Element>(c: &Case, dtype: DType) -> Result<(), TestCaseError> {
    let (hkv, d) = (c.heads_kv, c.d);
    let hq = hkv * c.ratio;
    let row = hkv * d;
    let batch = c.lens.len();
    let mut rng = Rng::new(c.seed | 1);
    let pool = batch + c.batch_idx.unwrap_or(0);
    let mut cache_row: Vec<usize> = (0..pool).collect();
    if c.batch_idx.is_some() {
        rng.shuffle(&mut cache_row);
    }
    let pads: Vec<usize> = c.leftpad.clone().unwrap_or_else(|| vec![0; batch]);
    let span = c.new.max(c.sq);
    let cap = c.lens.iter().map(|l| l + span).max().unwrap_or(0) + 1;
    // The cache: random values everywhere (padding and unused rows included), so that a read or
    // write out of place shows.
    let (shape, table, width) = match c.page_size {
        None => ([pool, cap, hkv, d], Vec::new(), 0),
        Some(ps) => {
            let t = paged_table(&c.lens, c.new, ps, false, (1, 1), &mut rng);
            ([t.num_blocks.max(1), ps, hkv, d], t.ids, t.width)
        }
    };
    let n: usize = shape.iter().product();
    let before: Vec<f32> = values(&mut rng, n, dtype);
    let v_before: Vec<f32> = values(&mut rng, n, dtype);
    let mut k: Vec<T> = before.iter().map(|&x| T::from_f32(x)).collect();
    let mut v: Vec<T> = v_before.iter().map(|&x| T::from_f32(x)).collect();
    let slot = |b: usize, j: usize| -> usize {
        match c.page_size {
            None => (cache_row[b] * cap + j) * row,
            Some(ps) => (table[b * width + j / ps] as usize * ps + j % ps) * row,
        }
    };
    let capacity = match c.page_size {
        None => cap,
        Some(ps) => width * ps,
    };
    // Tables covering every position rotated at, in the dtype (as FlashAttention takes them).
    let (rd, il) = c.rotary.unwrap_or((2, false));
    let seqlen_ro = cap + 2;
    let angles: Vec<f64> = (0..seqlen_ro * rd / 2).map(|_| rng.uniform() * std::f64::consts::TAU).collect();
    let cos: Vec<f32> = angles.iter().map(|a| dtype.round(a.cos() as f32)).collect();
    let sin: Vec<f32> = angles.iter().map(|a| dtype.round(a.sin() as f32)).collect();
    let rot = Rotary::new(&cos, &sin, rd, il);
    let turn = |x: &[f32], pos: usize| -> Vec<f64> {
        let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        match c.rotary {
            Some(_) => rotary_f64(&x, &cos[pos * rd / 2..][..rd / 2], &sin[pos * rd / 2..][..rd / 2], il),
            None => x,
        }
    };

    let qv = values(&mut rng, batch * c.sq * hq * d, dtype);
    let k_new = values(&mut rng, batch * c.new * row, dtype);
    let v_new = values(&mut rng, batch * c.new * row, dtype);
    let seqlens: Vec<i32> = c.lens.iter().map(|&l| l as i32).collect();
    let pad_i32: Vec<i32> = pads.iter().map(|&p| p as i32).collect();
    let idx_i32: Vec<i32> = cache_row[..batch].iter().map(|&r| r as i32).collect();
    let bt = c.page_size.map(|_| BlockTable {
        ids: &table,
        max_blocks_per_seq: width,
    });
    let (batch_idx, leftpad) = (c.batch_idx.map(|_| &idx_i32[..]), c.leftpad.as_ref().map(|_| &pad_i32[..]));
    let opts = ForwardOptions::default().mask(c.mask).return_lse(true).cpu_threads(c.threads);
    let fail = |e: Error| TestCaseError::fail(e.to_string());
    let q = Tensor::from_f32(&qv, dtype, [batch, c.sq, hq, d]).unwrap();
    let out: Output = if c.new > 0 || c.rotary.is_some() {
        let kn = Tensor::from_f32(&k_new, dtype, [batch, c.new, hkv, d]).unwrap();
        let vn = Tensor::from_f32(&v_new, dtype, [batch, c.new, hkv, d]).unwrap();
        let mut cache = KvCacheMut {
            k: &mut k,
            v: &mut v,
            shape,
            seqlens: &seqlens,
            block_table: bt,
            batch_idx,
            leftpad,
        };
        match c.rotary {
            Some(_) => forward_kvcache_append_rotary(&q, &mut cache, &kn, &vn, &rot, &opts).map_err(fail)?,
            None => forward_kvcache_append(&q, &mut cache, &kn, &vn, &opts).map_err(fail)?,
        }
    } else {
        let cache = KvCache {
            k: TensorView::new(&k, shape),
            v: TensorView::new(&v, shape),
            seqlens: &seqlens,
            block_table: bt,
            batch_idx,
            leftpad,
        };
        if c.packed_q {
            let qp = Tensor::from_f32(&qv, dtype, [1, batch * c.sq, hq, d]).unwrap();
            let cu: Vec<i32> = (0..=batch).map(|b| (b * c.sq) as i32).collect();
            forward_varlen_kvcache(&qp, &cu, c.sq, &cache, &opts).map_err(fail)?
        } else {
            forward_kvcache(&q, &cache, &opts).map_err(fail)?
        }
    };
    prop_assert_eq!(&out.dispatch.backend, "cpu");

    // The cache: the new rows, rotated, at positions seqlens[b]..; every other value unchanged.
    let kf: Vec<f32> = k.iter().map(|x| x.to_f32()).collect();
    let vf: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
    let mut written = vec![false; n];
    for b in 0..batch {
        for i in 0..c.new {
            let pos = c.lens[b] + i;
            let at = slot(b, pos);
            for h in 0..hkv {
                let src = &k_new[((b * c.new + i) * hkv + h) * d..][..d];
                let want = turn(src, pos);
                for x in 0..d {
                    let got = kf[at + h * d + x] as f64;
                    let pair = src.iter().map(|s| s.abs() as f64).fold(0.0, f64::max);
                    let tol = rotation_tol(dtype, want[x], pair);
                    prop_assert!(
                        (got - want[x]).abs() <= tol,
                        "k of sequence {} row {} head {} feature {}: {} vs float64 {}",
                        b,
                        i,
                        h,
                        x,
                        got,
                        want[x]
                    );
                    if x >= rd || c.rotary.is_none() {
                        prop_assert_eq!(got as f32, src[x], "feature {} past rotary_dim must pass through", x);
                    }
                }
                let vs = &v_new[((b * c.new + i) * hkv + h) * d..][..d];
                prop_assert_eq!(&vf[at + h * d..][..d], vs, "v is written as given");
            }
            written[at..at + row].iter_mut().for_each(|w| *w = true);
        }
    }
    for x in (0..n).filter(|&x| !written[x]) {
        prop_assert_eq!(kf[x].to_bits(), before[x].to_bits(), "k element {} changed", x);
        prop_assert_eq!(vf[x].to_bits(), v_before[x].to_bits(), "v element {} changed", x);
    }

    // The attention: q rotated as FlashAttention does (rounded to the dtype), over the keys
    // leftpad[b]..seqlens[b] + new of the sequence's cache row, as they are now in the cache.
    let advance = q_advances(c.mask, capacity);
    let ov = out.o.to_f32_vec();
    let lse = out.lse.as_ref().unwrap();
    for b in 0..batch {
        let mut qs = Vec::with_capacity(c.sq * hq * d);
        for i in 0..c.sq {
            let pos = c.lens[b] + if advance { i } else { 0 };
            for h in 0..hq {
                let src = &qv[((b * c.sq + i) * hq + h) * d..][..d];
                qs.extend(turn(src, pos).iter().map(|&x| dtype.round(x as f32)));
            }
        }
        let (k0, k1) = (pads[b], c.lens[b] + c.new);
        let keys = |buf: &[f32]| -> Vec<f32> { (k0..k1).flat_map(|j| buf[slot(b, j)..][..row].to_vec()).collect() };
        let lse_at = |h: usize, i: usize| match c.packed_q {
            true => lse[h * batch * c.sq + b * c.sq + i],
            false => lse[(b * hq + h) * c.sq + i],
        };
        check_seq(
            dtype,
            (c.sq, k1 - k0, hq, hkv, d),
            &qs,
            &keys(&kf),
            &keys(&vf),
            &opts,
            &ov[b * c.sq * hq * d..][..c.sq * hq * d],
            Some(&lse_at),
        )
        .map_err(|e| TestCaseError::fail(format!("sequence {b}: {e}")))?;
    }
    Ok(())
}

#[test]
fn rotary_batch_idx_and_leftpad_match_reference() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let name = format!("kvcache rotary {dtype:?}");
        let config = props::config(&name, file!(), 40);
        let mut runner = proptest::test_runner::TestRunner::new(config);
        let result = runner.run(&case_strategy(), |c| match dtype {
            DType::F32 => run_case::<f32>(&c, dtype),
            DType::F16 => run_case::<half::f16>(&c, dtype),
            _ => run_case::<half::bf16>(&c, dtype),
        });
        if let Err(e) = result {
            panic!("{name}: {e}");
        }
    }
}

// ---------------------------------------------------------------- errors

/// A dense cache of `pool` rows, capacity 8, one kv head of 8 features, holding 1.0 everywhere.
struct Small {
    k: Vec<f32>,
    v: Vec<f32>,
    shape: [usize; 4],
}

fn small(pool: usize) -> Small {
    let shape = [pool, 8, 1, 8];
    let n = shape.iter().product();
    Small { k: vec![1.0; n], v: vec![1.0; n], shape }
}

fn t(shape: [usize; 4]) -> Tensor {
    Tensor::from_vec(vec![0.5f32; shape.iter().product()], shape).unwrap()
}

/// Runs an append that must fail; returns its error after checking the cache is untouched.
fn append_err(
    pool: usize,
    seqlens: &[i32],
    batch_idx: Option<&[i32]>,
    leftpad: Option<&[i32]>,
    rotary: Option<&Rotary<'_>>,
    opts: &ForwardOptions,
) -> Error {
    let mut c = small(pool);
    let batch = seqlens.len();
    let mut cache = KvCacheMut {
        k: &mut c.k,
        v: &mut c.v,
        shape: c.shape,
        seqlens,
        block_table: None,
        batch_idx,
        leftpad,
    };
    let (q, kn) = (t([batch, 1, 1, 8]), t([batch, 1, 1, 8]));
    let e = match rotary {
        Some(r) => forward_kvcache_append_rotary(&q, &mut cache, &kn, &kn, r, opts).unwrap_err(),
        None => forward_kvcache_append(&q, &mut cache, &kn, &kn, opts).unwrap_err(),
    };
    assert!(c.k.iter().chain(&c.v).all(|&x| x == 1.0), "the cache changed on error: {e}");
    e
}

fn assert_seq_err(e: Error, what: &str, got: &str) {
    match &e {
        Error::InvalidSeqLayout { what: w, got: g, .. } if w == what && g.contains(got) => {}
        _ => panic!("expected InvalidSeqLayout {{ {what}, {got} }}, got {e:?}"),
    }
}

fn assert_option_err(e: Error, option: &str, got: &str) {
    match &e {
        Error::InvalidOption { option: o, got: g, .. } if *o == option && g.contains(got) => {}
        _ => panic!("expected InvalidOption {{ {option}, {got} }}, got {e:?}"),
    }
}

#[test]
fn batch_idx_and_leftpad_errors() {
    let o = ForwardOptions::default();
    // A row outside the pool, a negative one, and the wrong count.
    assert_seq_err(append_err(3, &[1, 2], Some(&[0, 3]), None, None, &o), "cache_batch_idx", "[1] = 3");
    assert_seq_err(append_err(3, &[1, 2], Some(&[-1, 0]), None, None, &o), "cache_batch_idx", "[0] = -1");
    assert_seq_err(append_err(3, &[1, 2], Some(&[0]), None, None, &o), "cache_batch_idx", "1 entries");
    // Two sequences appending to one cache row.
    assert_seq_err(append_err(3, &[1, 2], Some(&[2, 2]), None, None, &o), "cache_batch_idx", "cache row 2");
    // Leftpad past the cached keys, negative, the wrong count.
    assert_seq_err(append_err(2, &[1, 2], None, Some(&[0, 3]), None, &o), "cache_leftpad", "[1] = 3");
    assert_seq_err(append_err(2, &[1, 2], None, Some(&[-1, 0]), None, &o), "cache_leftpad", "[0] = -1");
    assert_seq_err(append_err(2, &[1, 2], None, Some(&[0, 0, 0]), None, &o), "cache_leftpad", "3 entries");
    // Reading with a repeated row is fine (nothing is written).
    let c = small(3);
    let view = |x| TensorView::new(x, c.shape);
    let cache = KvCache {
        batch_idx: Some(&[1, 1]),
        leftpad: Some(&[1, 0]),
        ..KvCache::dense(view(&c.k), view(&c.v), &[3, 2])
    };
    let out = forward_kvcache(&t([2, 1, 1, 8]), &cache, &o).unwrap();
    assert!(out.o.to_f32_vec().iter().all(|&x| x == 1.0));
    // A paged cache takes neither (FlashAttention refuses them there too).
    for (idx, pad) in [(Some(&[0i32, 1][..]), None), (None, Some(&[0i32, 0][..]))] {
        let cache = KvCache {
            batch_idx: idx,
            leftpad: pad,
            ..KvCache::paged(
                view(&c.k),
                view(&c.v),
                &[1, 1],
                BlockTable {
                    ids: &[0, 1],
                    max_blocks_per_seq: 1,
                },
            )
        };
        let e = forward_kvcache(&t([2, 1, 1, 8]), &cache, &o).unwrap_err();
        let what = if idx.is_some() { "cache_batch_idx" } else { "cache_leftpad" };
        assert_seq_err(e, what, "paged");
    }
}

#[test]
fn rotary_errors_leave_the_cache_untouched() {
    let o = ForwardOptions::default();
    let tables = vec![0.5f32; 8 * 2]; // 8 positions of rotary_dim 4
    // Odd, zero, and wider than head_dim 8.
    for rd in [3, 0, 10] {
        let r = Rotary::new(&tables, &tables, rd, false);
        assert_option_err(append_err(2, &[1, 2], None, None, Some(&r), &o), "rotary_dim", &rd.to_string());
    }
    // Tables of two shapes, or not a whole number of rows.
    let r = Rotary::new(&tables, &tables[..14], 4, true);
    assert_option_err(append_err(2, &[1, 2], None, None, Some(&r), &o), "rotary_sin", "14 values");
    let r = Rotary::new(&tables[..15], &tables[..15], 4, true);
    assert_option_err(append_err(2, &[1, 2], None, None, Some(&r), &o), "rotary_cos", "15 values");
    // 4 positions; sequence 1's new key sits at position 4.
    let r = Rotary::new(&tables[..8], &tables[..8], 4, false);
    assert_option_err(append_err(2, &[1, 4], None, None, Some(&r), &o), "rotary_cos", "4 positions");
    // Under Backend::Cuda the kernels write a device copy of the cache: a call the GPU cannot
    // run (no device here, or f32 data) fails with the cache untouched, rotary and cache rows alike.
    let cuda = ForwardOptions::default().backend(Backend::Cuda(0));
    for (idx, rot) in [(None, Some(&r)), (Some(&[1i32, 0][..]), None)] {
        match append_err(2, &[1, 2], idx, None, rot, &cuda) {
            Error::BackendUnavailable { .. } | Error::UnsupportedDType { .. } | Error::Cuda { .. } => {}
            e => panic!("expected the GPU path's error, got {e:?}"),
        }
    }
}

/// One worked decode step, by hand: a half-split rotation by a quarter turn at position 2.
#[test]
fn rotary_quarter_turn_by_hand() {
    let shape = [1, 4, 1, 4];
    let (mut k, mut v) = (vec![0.0f32; 16], vec![0.0f32; 16]);
    // Positions 0..4, rotary_dim 2: position 2 is a quarter turn (cos 0, sin 1).
    let cos = [1.0, 1.0, 0.0, 1.0];
    let sin = [0.0, 0.0, 1.0, 0.0];
    let r = Rotary::new(&cos, &sin, 2, false);
    let kn = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [1, 1, 1, 4]).unwrap();
    let mut cache = KvCacheMut {
        k: &mut k,
        v: &mut v,
        shape,
        seqlens: &[2],
        block_table: None,
        batch_idx: None,
        leftpad: None,
    };
    forward_kvcache_append_rotary(&kn, &mut cache, &kn, &kn, &r, &ForwardOptions::default()).unwrap();
    // (x0, x1) = (1, 2) turns to (x0·0 − x1·1, x0·1 + x1·0) = (−2, 1); 3 and 4 pass through.
    assert_eq!(&k[8..12], &[-2.0, 1.0, 3.0, 4.0]);
    assert_eq!(&v[8..12], &[1.0, 2.0, 3.0, 4.0]);
    assert!(k[..8].iter().chain(&k[12..]).all(|&x| x == 0.0));
}

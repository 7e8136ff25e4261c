//! KV caches, dense or paged, read by `forward_kvcache` / `forward_varlen_kvcache` and appended
//! to by `forward_kvcache_append` / `append_kv`.

use super::*;
use super::edits::{
    apply_cache, apply_cu, cache_edit, cu_edit, dtype_strategy, edits, splits_strategy, CacheEdit, CuEdit,
};
use super::layout::read_cu;
use super::varlen::{bound, offsets};

#[derive(Clone, Debug)]
struct CacheCase {
    opts: Opts,
    dtype: DType,
    /// Cached keys per sequence.
    lens: Vec<usize>,
    /// Rows appended by the call (the append property only).
    new: usize,
    /// Query rows per sequence (dense q), or the packed q's lengths.
    sq: usize,
    varlen_q: Option<Vec<usize>>,
    /// Paged with this page size, or dense.
    page: Option<usize>,
    /// Sequences after the first share its first full pages.
    share: bool,
    /// The cache stored head-major (read-only calls: a writable cache is contiguous).
    heads_major: bool,
    /// Blocks no sequence uses; table columns / dense capacity past the longest sequence.
    spare: (usize, usize),
    cu_edits: Vec<CuEdit>,
    edits: Vec<CacheEdit>,
}

/// Query rows per sequence: mostly decode-like (1-4), sometimes past the 16 rows from which a
/// sequence with contiguous keys takes the tiled path.
fn q_len_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 1usize..=4, 1 => 17usize..=20]
}

fn page_strategy() -> impl Strategy<Value = Option<usize>> {
    prop_oneof![
        1 => Just(None),
        1 => prop::sample::select(vec![1usize, 2, 3, 16, 256, 300]).prop_map(Some),
        2 => (1usize..=300).prop_map(Some),
    ]
}

fn cache_strategy(append: bool) -> impl Strategy<Value = CacheCase> {
    let new = if append {
        (0usize..=4).boxed()
    } else {
        Just(0usize).boxed()
    };
    (
        (
            opts_strategy(splits_strategy()),
            dtype_strategy(),
            1usize..=4,
            page_strategy(),
        ),
        (
            new,
            q_len_strategy(),
            any::<bool>(),
            (0usize..=3, 0usize..=2),
            any::<bool>(),
        ),
        (edits(cu_edit(false)), edits(cache_edit()), any::<bool>()),
    )
        .prop_flat_map(
            move |((opts, dtype, batch, page), (new, sq, share, spare, packed), (cu_edits, edits, hm))| {
                // Mostly short caches; now and then long enough for the split heuristic (> 1024 keys).
                let lens = prop::collection::vec(prop_oneof![24 => len_strategy(320), 1 => 1025usize..=1400], batch);
                let varlen_q = if packed && !append {
                    prop::collection::vec(len_strategy(20), batch).prop_map(Some).boxed()
                } else {
                    Just(None).boxed()
                };
                (lens, varlen_q).prop_map(move |(lens, varlen_q)| CacheCase {
                    opts: opts.clone(),
                    dtype,
                    lens,
                    new,
                    sq,
                    cu_edits: if varlen_q.is_some() {
                        cu_edits.clone()
                    } else {
                        Vec::new()
                    },
                    varlen_q,
                    page,
                    share,
                    heads_major: hm && !append,
                    spare,
                    edits: edits.clone(),
                })
            },
        )
}

/// The case's well-formed layout (blocks shuffled; shared prefixes), before its edits.
fn base_layout(c: &CacheCase, rng: &mut Rng) -> CacheLayout {
    let (hkv, d, batch) = (c.opts.heads_kv, c.opts.d, c.lens.len());
    let seqlens: Vec<i32> = c.lens.iter().map(|&l| l as i32).collect();
    let Some(ps) = c.page else {
        let cap = c.lens.iter().map(|l| l + c.new).max().unwrap_or(0) + c.spare.1;
        return CacheLayout {
            shape: [batch, cap, hkv, d],
            seqlens,
            table: None,
            heads_major: c.heads_major,
        };
    };
    let t = paged_table(&c.lens, c.new, ps, c.share, c.spare, rng);
    CacheLayout {
        shape: [t.num_blocks.max(1), ps, hkv, d],
        seqlens,
        table: Some((t.ids, t.width)),
        heads_major: c.heads_major,
    }
}

/// A cache buffer of `layout`'s shape: random values at every slot in `read`, NaN elsewhere (so
/// that a stray read shows).
fn fill_cache<T: Element>(layout: &CacheLayout, read: Option<&[Vec<usize>]>, rng: &mut Rng, dtype: DType) -> Vec<T> {
    let [n0, n1, hkv, d] = layout.shape;
    let mut vals = values(rng, n0 * n1 * hkv * d, dtype);
    if let Some(read) = read {
        let mut used = vec![false; n0 * n1];
        read.iter().flatten().for_each(|&s| used[s] = true);
        for s in (0..n0 * n1).filter(|&s| !used[s]) {
            for h in 0..hkv {
                let at = layout.at(s, h);
                vals[at..at + d].fill(f32::NAN);
            }
        }
    }
    vals.into_iter().map(T::from_f32).collect()
}

/// Sequence rows of q and the LSE index of each sequence's rows, for a dense or packed q.
struct QRows {
    /// (first flat row, rows) per sequence.
    rows: Vec<(usize, usize)>,
    total: usize,
    packed: bool,
}

fn cache_case<T: Bits>(c: &CacheCase, worst: &Worst) -> Result<(), TestCaseError> {
    let (o, dtype) = (&c.opts, c.dtype);
    let (hq, hkv, d) = (o.hq(), o.heads_kv, o.d);
    let row = hkv * d;
    let batch = c.lens.len();
    let mut rng = Rng::new(o.seed | 1);
    let mut layout = base_layout(c, &mut rng);
    for e in &c.edits {
        apply_cache(e, &mut layout);
    }
    let mut broken = Broken::new();
    // Queries: dense [batch, sq, hq, d], or packed with (possibly edited) offsets.
    let (q_shape, cu_q, max_q, q_batch) = match &c.varlen_q {
        None => ([batch, c.sq, hq, d], Vec::new(), 0, Some(batch)),
        Some(lens) => {
            let mut cu = offsets(lens);
            let (mut tq, mut unused) = (*cu.last().unwrap() as usize, 0usize);
            for e in &c.cu_edits {
                apply_cu(e, [&mut cu, &mut Vec::new()], [&mut tq, &mut unused]);
            }
            let max = bound(lens, 0);
            let r = read_cu("cu_seqlens_q", "max_seqlen_q", &cu, tq, max, &mut broken);
            ([1, tq, hq, d], cu, max, r.map(|r| r.len()))
        }
    };
    if layout.shape[0] == 0 {
        // A cache with no block (or of no sequence) is an empty tensor, refused as such first.
        broken.push("k");
    }
    let read = q_batch.and_then(|qb| layout.read(qb, c.new, &mut broken));
    if c.new > 0 {
        // Every appended row needs a slot of its own.
        if let Some(read) = &read {
            let mut writes: Vec<usize> = (0..batch)
                .flat_map(|b| read[b][layout.seqlens[b] as usize..].to_vec())
                .collect();
            writes.sort_unstable();
            if writes.windows(2).any(|w| w[0] == w[1]) {
                broken.push("block_table");
            }
        }
    }
    if matches!(o.splits, Some(n) if !(1..=128).contains(&n)) {
        broken.push("num_splits");
    }
    let q_rows = match &c.varlen_q {
        None => QRows {
            rows: (0..batch).map(|b| (b * c.sq, c.sq)).collect(),
            total: batch * c.sq,
            packed: false,
        },
        Some(_) => QRows {
            rows: cu_q
                .windows(2)
                .map(|w| (w[0].max(0) as usize, (w[1] as i64 - w[0] as i64).max(0) as usize))
                .collect(),
            total: q_shape[1],
            packed: true,
        },
    };
    let valid = broken.is_empty();
    let k: Vec<T> = fill_cache(&layout, read.as_deref().filter(|_| valid), &mut rng, dtype);
    let v: Vec<T> = fill_cache(&layout, read.as_deref().filter(|_| valid), &mut rng, dtype);
    let qv = values(&mut rng, q_shape.iter().product(), dtype);
    let q = Tensor::from_f32(&qv, dtype, q_shape).unwrap();
    let opts = o.forward();
    let (k_new, v_new) = (
        values(&mut rng, batch * c.new * row, dtype),
        values(&mut rng, batch * c.new * row, dtype),
    );

    // The call, and the cache as the test expects it afterwards (the explicit append).
    let (result, k_after, v_after, attended) = if c.new > 0 {
        let kn = Tensor::from_f32(&k_new, dtype, [batch, c.new, hkv, d]).unwrap();
        let vn = Tensor::from_f32(&v_new, dtype, [batch, c.new, hkv, d]).unwrap();
        let (mut kc, mut vc) = (k.clone(), v.clone());
        let mut cache = KvCacheMut {
            k: &mut kc,
            v: &mut vc,
            shape: layout.shape,
            seqlens: &layout.seqlens,
            block_table: layout.table.as_ref().map(|(ids, mb)| BlockTable {
                ids,
                max_blocks_per_seq: *mb,
            }),
            batch_idx: None,
            leftpad: None,
        };
        let r = forward_kvcache_append(&q, &mut cache, &kn, &vn, &opts);
        // The explicit append: row i of sequence b at the slot of key seqlens[b] + i, when the
        // layout takes it (the attention's options aside: `append_kv` has none).
        let append_broken: Broken = broken.iter().copied().filter(|&n| n != "num_splits").collect();
        let (mut kx, mut vx) = (k.clone(), v.clone());
        if let (true, Some(read)) = (append_broken.is_empty(), &read) {
            for (b, keys) in read.iter().enumerate() {
                for (i, &slot) in keys[keys.len() - c.new..].iter().enumerate() {
                    for h in 0..hkv {
                        let (src, at) = (((b * c.new + i) * hkv + h) * d, layout.at(slot, h));
                        for x in 0..d {
                            kx[at + x] = T::from_f32(k_new[src + x]);
                            vx[at + x] = T::from_f32(v_new[src + x]);
                        }
                    }
                }
            }
        }
        match &r {
            Ok(_) => prop_assert!(broken.is_empty(), "accepted a layout that breaks {:?}", broken),
            Err(e) => expect_refusal(e, &broken)?,
        }
        // Both caches as the test's own append left them, or untouched after a refusal.
        let caches_are = |(kg, vg): (&[T], &[T]), ok: bool, after: &str, err: Option<&Error>| {
            let (wk, wv) = if ok { (&kx, &vx) } else { (&k, &v) };
            prop_assert_eq!(first_diff(kg, wk), None, "k cache after {} ({:?})", after, err);
            prop_assert_eq!(first_diff(vg, wv), None, "v cache after {} ({:?})", after, err);
            Ok(())
        };
        caches_are((&kc, &vc), r.is_ok(), "the call", r.as_ref().err())?;
        // `append_kv` alone: the same writes, or the same refusal with the cache untouched.
        let (mut ka, mut va) = (k.clone(), v.clone());
        let mut cache = KvCacheMut {
            k: &mut ka,
            v: &mut va,
            shape: layout.shape,
            seqlens: &layout.seqlens,
            block_table: layout.table.as_ref().map(|(ids, mb)| BlockTable {
                ids,
                max_blocks_per_seq: *mb,
            }),
            batch_idx: None,
            leftpad: None,
        };
        let ra = append_kv(&mut cache, &kn, &vn);
        match &ra {
            Ok(()) => prop_assert!(
                append_broken.is_empty(),
                "append_kv took a layout that breaks {:?}",
                append_broken
            ),
            Err(e) => expect_refusal(e, &append_broken)?,
        }
        caches_are((&ka, &va), ra.is_ok(), "append_kv", ra.as_ref().err())?;
        let attended = layout.clone_with_new(c.new);
        (r, kx, vx, attended)
    } else {
        let cache = layout.view(&k, &v);
        let r = match &c.varlen_q {
            None => forward_kvcache(&q, &cache, &opts),
            Some(_) => forward_varlen_kvcache(&q, &cu_q, max_q, &cache, &opts),
        };
        (r, k.clone(), v.clone(), layout.clone())
    };
    let out = match result {
        Err(e) => {
            worst.refused.set(worst.refused.get() + 1);
            return expect_refusal(&e, &broken);
        }
        Ok(out) => out,
    };
    worst.accepted.set(worst.accepted.get() + 1);
    prop_assert!(broken.is_empty(), "accepted a layout that breaks {:?}", broken);
    let read = read.unwrap();
    prop_assert_eq!(out.o.shape(), q_shape);
    let lse_len = hq * q_rows.total;
    prop_assert_eq!(out.lse.as_ref().map(|l| l.len()), o.lse.then_some(lse_len));
    let attend = |opts: &ForwardOptions| {
        let cache = attended.view(&k_after, &v_after);
        match &c.varlen_q {
            None => forward_kvcache(&q, &cache, opts),
            Some(_) => forward_varlen_kvcache(&q, &cu_q, max_q, &cache, opts),
        }
        .map_err(|e| TestCaseError::fail(e.to_string()))
    };
    if c.new > 0 {
        // forward_kvcache_append = append, then forward_kvcache: the same bits.
        let then = attend(&opts)?;
        prop_assert_eq!(&then.o, &out.o, "append-then-forward output");
        let bits = |l: &Option<Vec<f32>>| l.as_ref().map(|l| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        prop_assert_eq!(bits(&then.lse), bits(&out.lse), "append-then-forward LSE");
    }
    let seq_inputs: Vec<SeqInputs> = (0..batch)
        .map(|b| {
            let (r0, n) = q_rows.rows[b];
            SeqInputs {
                q: qv[r0 * hq * d..(r0 + n) * hq * d].to_vec(),
                k: gather(&k_after, &attended, &read[b]),
                v: gather(&v_after, &attended, &read[b]),
            }
        })
        .collect();
    let vmax = seq_inputs.iter().map(|s| max_abs(&s.v)).fold(0.0, f32::max);
    let rows_of = |b: usize| q_rows.rows[b];
    let lse_at = |b: usize, h: usize, i: usize| {
        if q_rows.packed {
            h * q_rows.total + q_rows.rows[b].0 + i
        } else {
            (b * hq + h) * c.sq + i
        }
    };
    check_sequences(dtype, o, &opts, &out, &seq_inputs, &rows_of, &lse_at, worst)?;
    let one = attend(&opts.clone().num_splits(1))?;
    worst.split(split_ulps(dtype, &one, &out, vmax)?);
    Ok(())
}

impl CacheLayout {
    /// The layout a later call sees after this call appended `new` rows to each sequence.
    fn clone_with_new(&self, new: usize) -> CacheLayout {
        CacheLayout {
            seqlens: self.seqlens.iter().map(|&s| s.saturating_add(new as i32)).collect(),
            ..self.clone()
        }
    }
}

fn cache_case_any(c: &CacheCase, worst: &Worst) -> Result<(), TestCaseError> {
    match c.dtype {
        DType::F32 => cache_case::<f32>(c, worst),
        DType::F16 => cache_case::<half::f16>(c, worst),
        _ => cache_case::<half::bf16>(c, worst),
    }
}

#[test]
fn cache_layouts() {
    run("cache layouts", 400, cache_strategy(false), cache_case_any);
}

#[test]
fn append_layouts() {
    run("append layouts", 400, cache_strategy(true), cache_case_any);
}

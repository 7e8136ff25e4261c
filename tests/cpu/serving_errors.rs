//! Every malformed argument of the serving API is a typed error naming what was given and what
//! was expected; nothing panics, and a refused append leaves the cache untouched.

use flash_attn::serving::*;
use flash_attn::*;

fn t(shape: [usize; 4]) -> Tensor {
    Tensor::zeros(DType::F32, shape).unwrap()
}

fn opts() -> ForwardOptions {
    ForwardOptions::default()
}

/// Asserts `e` is an `InvalidSeqLayout` about `what` whose message holds every `needle`.
fn seq_err(e: Error, what: &str, needles: &[&str]) {
    let msg = e.to_string();
    assert!(
        matches!(&e, Error::InvalidSeqLayout { what: w, .. } if w == what),
        "{e:?}"
    );
    for n in needles {
        assert!(msg.contains(n), "{msg:?} should mention {n:?}");
    }
}

fn varlen(cu_q: &[i32], cu_k: &[i32], tq: usize, tk: usize, mq: usize, mk: usize) -> Error {
    let seqs = Varlen {
        cu_seqlens_q: cu_q,
        cu_seqlens_k: cu_k,
        max_seqlen_q: mq,
        max_seqlen_k: mk,
    };
    forward_varlen(&t([1, tq, 2, 8]), &t([1, tk, 2, 8]), &t([1, tk, 2, 8]), &seqs, &opts()).expect_err("refused")
}

#[test]
fn malformed_cu_seqlens() {
    seq_err(
        varlen(&[0], &[0, 3], 0, 3, 0, 3),
        "cu_seqlens_q",
        &["1 entries", "batch + 1 >= 2"],
    );
    seq_err(varlen(&[], &[0, 3], 0, 3, 0, 3), "cu_seqlens_q", &["0 entries"]);
    seq_err(
        varlen(&[1, 3], &[0, 3], 3, 3, 3, 3),
        "cu_seqlens_q",
        &["cu_seqlens_q[0] = 1", "0"],
    );
    seq_err(
        varlen(&[0, 5, 4], &[0, 1, 3], 4, 3, 5, 2),
        "cu_seqlens_q",
        &["cu_seqlens_q[2] = 4 < cu_seqlens_q[1] = 5", "non-decreasing"],
    );
    seq_err(
        varlen(&[0, -1, 2], &[0, 1, 3], 2, 3, 3, 2),
        "cu_seqlens_q",
        &["-1 < cu_seqlens_q[0] = 0"],
    );
    seq_err(
        varlen(&[0, 2, 5], &[0, 1, 3], 6, 3, 3, 2),
        "cu_seqlens_q",
        &["cu_seqlens_q[2] = 5", "6, the number of rows"],
    );
    seq_err(
        varlen(&[0, 2, 6], &[0, 1, 3], 6, 3, 3, 2),
        "max_seqlen_q",
        &["got 3", "at least 4"],
    );
    seq_err(
        varlen(&[0, 2, 6], &[0, 1, 3], 6, 3, 4, 1),
        "max_seqlen_k",
        &["got 1", "at least 2"],
    );
    seq_err(
        varlen(&[0, 2, 6], &[0, 3], 6, 3, 4, 3),
        "cu_seqlens_k",
        &["2 entries", "3 (batch + 1"],
    );
    seq_err(
        varlen(&[0, 2, 6], &[0, 1, 3], 6, 4, 4, 2),
        "cu_seqlens_k",
        &["cu_seqlens_k[2] = 3", "4, the number of rows"],
    );
}

#[test]
fn packed_tensors_have_batch_one() {
    let seqs = Varlen {
        cu_seqlens_q: &[0, 2],
        cu_seqlens_k: &[0, 2],
        max_seqlen_q: 2,
        max_seqlen_k: 2,
    };
    let e = forward_varlen(&t([2, 1, 2, 8]), &t([1, 2, 2, 8]), &t([1, 2, 2, 8]), &seqs, &opts()).unwrap_err();
    assert!(matches!(&e, Error::ShapeMismatch { what, .. } if what == "q"), "{e}");
    assert!(e.to_string().contains("[2, 1, 2, 8]") && e.to_string().contains("batch dimension 1"));
    // v's heads differ from k's (its head_dim may differ: tests/cpu/head_dim_v.rs).
    let e = forward_varlen(&t([1, 2, 2, 8]), &t([1, 2, 2, 8]), &t([1, 2, 1, 8]), &seqs, &opts()).unwrap_err();
    assert!(matches!(&e, Error::ShapeMismatch { what, .. } if what == "v"), "{e}");
    let e = forward_varlen(&t([1, 2, 2, 8]), &t([1, 2, 2, 4]), &t([1, 2, 2, 4]), &seqs, &opts()).unwrap_err();
    assert!(matches!(&e, Error::ShapeMismatch { what, .. } if what == "k") && e.to_string().contains("head_dim 8"));
    let e = forward_varlen(&t([1, 2, 3, 8]), &t([1, 2, 2, 8]), &t([1, 2, 2, 8]), &seqs, &opts()).unwrap_err();
    assert_eq!(
        e,
        Error::HeadsNotDivisible {
            heads_q: 3,
            heads_kv: 2
        }
    );
}

#[test]
fn empty_batches_are_fine() {
    // Every sequence empty: no rows, nothing read.
    let seqs = Varlen {
        cu_seqlens_q: &[0, 0, 0],
        cu_seqlens_k: &[0, 0, 0],
        max_seqlen_q: 0,
        max_seqlen_k: 0,
    };
    let out = forward_varlen(
        &t([1, 0, 2, 8]),
        &t([1, 0, 2, 8]),
        &t([1, 0, 2, 8]),
        &seqs,
        &opts().return_lse(true),
    )
    .unwrap();
    assert_eq!(out.o.shape(), [1, 0, 2, 8]);
    assert_eq!(out.lse, Some(vec![]));
    // Queries but no keys: output 0, LSE −inf.
    let seqs = Varlen {
        cu_seqlens_q: &[0, 3],
        cu_seqlens_k: &[0, 0],
        max_seqlen_q: 3,
        max_seqlen_k: 0,
    };
    let q = Tensor::from_vec(vec![1.0f32; 3 * 2 * 8], [1, 3, 2, 8]).unwrap();
    let out = forward_varlen(&q, &t([1, 0, 2, 8]), &t([1, 0, 2, 8]), &seqs, &opts().return_lse(true)).unwrap();
    assert!(out.o.to_f32_vec().iter().all(|&x| x == 0.0));
    assert!(out.lse.unwrap().iter().all(|&x| x == f32::NEG_INFINITY));
}

fn paged_err(table: &[i32], mb: usize, seqlens: &[i32], cache: [usize; 4], q: [usize; 4]) -> Error {
    let k = t(cache);
    let c = KvCache::paged(
        k.view(),
        k.view(),
        seqlens,
        BlockTable {
            ids: table,
            max_blocks_per_seq: mb,
        },
    );
    forward_kvcache(&t(q), &c, &opts()).expect_err("refused")
}

#[test]
fn malformed_caches() {
    let cache = [4, 16, 2, 8];
    let q = [2, 1, 4, 8];
    seq_err(
        paged_err(&[0, 1, 2], 2, &[5, 5], cache, q),
        "block_table",
        &["3 entries", "4 = batch 2 x max_blocks_per_seq 2"],
    );
    seq_err(
        paged_err(&[0, 1, 2, 3], 2, &[5], cache, q),
        "cache_seqlens",
        &["1 entries", "2 (one per sequence"],
    );
    seq_err(
        paged_err(&[0, 1, 2, 3], 2, &[5, -3], cache, q),
        "cache_seqlens",
        &["cache_seqlens[1] = -3", ">= 0"],
    );
    seq_err(
        paged_err(&[0, 1, 2, 3], 2, &[5, 33], cache, q),
        "cache_seqlens",
        &["cache_seqlens[1] = 33", "at most 32"],
    );
    seq_err(
        paged_err(&[0, 1, 4, 3], 2, &[5, 17], cache, q),
        "block_table",
        &["block_table[1][0] = 4", "0..4"],
    );
    seq_err(
        paged_err(&[0, 1, 2, -1], 2, &[5, 17], cache, q),
        "block_table",
        &["block_table[1][1] = -1"],
    );
    // Unused entries are not read: -1 padding is fine.
    let k = t(cache);
    let c = KvCache::paged(
        k.view(),
        k.view(),
        &[5, 16],
        BlockTable {
            ids: &[0, -1, 2, -7],
            max_blocks_per_seq: 2,
        },
    );
    assert!(forward_kvcache(&t(q), &c, &opts()).is_ok());
    // Page size 0.
    let e = paged_err(&[0, 1], 1, &[0, 0], [4, 0, 2, 8], q);
    seq_err(e, "page size", &["0", "at least 1"]);
    // Dense caches: one per sequence, seqlens within the capacity.
    let k = t([2, 10, 2, 8]);
    let e = forward_kvcache(
        &t([3, 1, 4, 8]),
        &KvCache::dense(k.view(), k.view(), &[1, 2, 3]),
        &opts(),
    )
    .unwrap_err();
    assert!(
        matches!(&e, Error::ShapeMismatch { what, .. } if what == "k_cache"),
        "{e}"
    );
    let e = forward_kvcache(&t([2, 1, 4, 8]), &KvCache::dense(k.view(), k.view(), &[1, 11]), &opts()).unwrap_err();
    seq_err(e, "cache_seqlens", &["cache_seqlens[1] = 11", "at most 10"]);
    // A cache of capacity 0 with nothing cached: every row sees no key (0, LSE −inf).
    let empty = t([2, 0, 2, 8]);
    let c = KvCache::dense(empty.view(), empty.view(), &[0, 0]);
    let out = forward_kvcache(&t([2, 1, 4, 8]), &c, &opts().return_lse(true)).unwrap();
    assert!(out.lse.unwrap().iter().all(|&x| x == f32::NEG_INFINITY));
    let e = forward_kvcache(
        &t([2, 1, 4, 8]),
        &KvCache::dense(empty.view(), empty.view(), &[0, 1]),
        &opts(),
    );
    seq_err(e.unwrap_err(), "cache_seqlens", &["cache_seqlens[1] = 1", "at most 0"]);
}

#[test]
fn appends_are_checked_before_any_write() {
    let shape = [3, 4, 1, 8];
    let mut kc = vec![7.0f32; 3 * 4 * 8];
    let mut vc = kc.clone();
    let knew = Tensor::from_vec(vec![1.0f32; 2 * 2 * 8], [2, 2, 1, 8]).unwrap();
    // Both sequences' new rows land in block 2 (shared): refused.
    let table = [0, 2, 2, 1];
    let mut cache = KvCacheMut {
        k: &mut kc,
        v: &mut vc,
        shape,
        seqlens: &[4, 0],
        block_table: Some(BlockTable {
            ids: &table,
            max_blocks_per_seq: 2,
        }),
        batch_idx: None,
        leftpad: None,
    };
    let e = append_kv(&mut cache, &knew, &knew).unwrap_err();
    seq_err(
        e,
        "block_table",
        &["both write slot 0 of block 2", "distinct cache slots"],
    );
    // Past the table's capacity with the new rows.
    let mut cache = KvCacheMut {
        k: &mut kc,
        v: &mut vc,
        shape,
        seqlens: &[7, 0],
        block_table: Some(BlockTable {
            ids: &[0, 1, 2, 2],
            max_blocks_per_seq: 2,
        }),
        batch_idx: None,
        leftpad: None,
    };
    let e = append_kv(&mut cache, &knew, &knew).unwrap_err();
    seq_err(
        e,
        "cache_seqlens",
        &["cache_seqlens[0] = 7 plus 2 new rows = 9 keys", "at most 8"],
    );
    // A k_new of another dtype, another head count, or a cache buffer of the wrong length.
    let kbf = Tensor::zeros(DType::BF16, [2, 2, 1, 8]).unwrap();
    let mut cache = KvCacheMut {
        k: &mut kc,
        v: &mut vc,
        shape,
        seqlens: &[0, 0],
        block_table: None,
        batch_idx: None,
        leftpad: None,
    };
    let e = append_kv(&mut cache, &kbf, &kbf).unwrap_err();
    assert!(
        matches!(
            e,
            Error::DTypeMismatch {
                got: DType::BF16,
                expected: DType::F32,
                ..
            }
        ),
        "{e}"
    );
    let e = append_kv(&mut cache, &t([2, 2, 2, 8]), &t([2, 2, 2, 8])).unwrap_err();
    assert!(
        matches!(&e, Error::ShapeMismatch { what, .. } if what == "k_new"),
        "{e}"
    );
    let e = append_kv(&mut cache, &knew, &t([2, 1, 1, 8])).unwrap_err();
    assert!(
        matches!(&e, Error::ShapeMismatch { what, .. } if what == "v_new"),
        "{e}"
    );
    // Dense cache with batch 3 while k_new has batch 2.
    let e = append_kv(&mut cache, &knew, &knew).unwrap_err();
    assert!(
        matches!(&e, Error::ShapeMismatch { what, .. } if what == "k_cache"),
        "{e}"
    );
    let mut short = vec![0.0f32; 5];
    let mut cache = KvCacheMut {
        k: &mut short,
        v: &mut vc,
        shape,
        seqlens: &[0, 0],
        block_table: None,
        batch_idx: None,
        leftpad: None,
    };
    let e = append_kv(&mut cache, &knew, &knew).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidLayout {
                operand: Operand::K,
                ..
            }
        ) && e.to_string().contains("holds 5"),
        "{e}"
    );
    // Appending 0 rows writes nothing and is not an error.
    let mut cache = KvCacheMut {
        k: &mut kc,
        v: &mut vc,
        shape,
        seqlens: &[4, 0, 1],
        block_table: None,
        batch_idx: None,
        leftpad: None,
    };
    append_kv(&mut cache, &t([3, 0, 1, 8]), &t([3, 0, 1, 8])).unwrap();
    // An attention option refused after a valid append: nothing was written either.
    let mut cache = KvCacheMut {
        k: &mut kc,
        v: &mut vc,
        shape,
        seqlens: &[0, 1],
        block_table: Some(BlockTable {
            ids: &[0, 1, 2, 1],
            max_blocks_per_seq: 2,
        }),
        batch_idx: None,
        leftpad: None,
    };
    let e = forward_kvcache_append(&t([2, 1, 2, 8]), &mut cache, &knew, &knew, &opts().softcap(-1.0)).unwrap_err();
    assert_eq!(e, Error::InvalidSoftcap(-1.0));
    assert!(
        kc.iter().chain(&vc).all(|&x| x == 7.0),
        "a refused call wrote the cache"
    );
}

#[test]
fn options_the_serving_paths_refuse() {
    let seqs = Varlen {
        cu_seqlens_q: &[0, 2],
        cu_seqlens_k: &[0, 2],
        max_seqlen_q: 2,
        max_seqlen_k: 2,
    };
    let run = |o: ForwardOptions| forward_varlen(&t([1, 2, 2, 8]), &t([1, 2, 2, 8]), &t([1, 2, 2, 8]), &seqs, &o);
    for n in [0, 129] {
        let e = run(opts().num_splits(n)).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidOption {
                    option: "num_splits",
                    ..
                }
            ) && e.to_string().contains("1..=128"),
            "{e}"
        );
        // The dense forward validates it too.
        let e = forward(
            &t([1, 1, 2, 8]),
            &t([1, 4, 2, 8]),
            &t([1, 4, 2, 8]),
            &opts().num_splits(n),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidOption {
                    option: "num_splits",
                    ..
                }
            ),
            "{e}"
        );
    }
    let fp8 = Precision::Fp8 {
        scaling: Fp8Scaling::PerTensor,
        hadamard: None,
    };
    let e = run(opts().precision(fp8)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidOption {
                option: "precision",
                ..
            }
        ),
        "{e}"
    );
    let e = run(opts().variant(Variant::Fa2)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::VariantUnavailable {
                variant: Variant::Fa2,
                ..
            }
        ),
        "{e}"
    );
    // Backend::Cuda goes to the GPU serving path: without a usable GPU (this machine) it says
    // why; with one, these f32 inputs are refused (the kernels take f16/bf16).
    let e = run(opts().backend(Backend::Cuda(0))).unwrap_err();
    assert!(
        matches!(&e, Error::BackendUnavailable { backend, .. } | Error::UnsupportedDType { backend, .. } if backend == "cuda:0"),
        "{e}"
    );
    let e = run(opts().mask(Mask::window(-2, 0))).unwrap_err();
    assert!(matches!(e, Error::NegativeWindow { .. }), "{e}");
    let e = run(opts().alibi_slopes(vec![1.0])).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidAlibi {
                got: 1,
                expected: 2,
                ..
            }
        ),
        "{e}"
    );
    let e = forward_varlen(
        &t([1, 2, 2, 1024]),
        &t([1, 2, 2, 1024]),
        &t([1, 2, 2, 1024]),
        &seqs,
        &opts(),
    )
    .unwrap_err();
    assert!(matches!(e, Error::UnsupportedHeadDim { head_dim: 1024, .. }), "{e}");
    // A view whose strides leave its buffer.
    let data = vec![0.0f32; 10];
    let bad = TensorView::new(&data, [1, 2, 2, 8]);
    let e = forward_varlen(&bad, &t([1, 2, 2, 8]), &t([1, 2, 2, 8]), &seqs, &opts()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidLayout {
                operand: Operand::Q,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn malformed_states_to_merge() {
    let a = t([1, 2, 2, 4]);
    let e = merge_states(&a, &[0.0; 4], &t([1, 3, 2, 4]), &[0.0; 6]).unwrap_err();
    assert!(
        matches!(&e, Error::ShapeMismatch { what, .. } if what == "o of state 1"),
        "{e}"
    );
    let e = merge_states(&a, &[0.0; 4], &a, &[0.0; 3]).unwrap_err();
    assert!(
        matches!(&e, Error::ShapeMismatch { what, .. } if what == "lse of state 1")
            && e.to_string().contains("3 values")
    );
    let bf = Tensor::zeros(DType::BF16, [1, 2, 2, 4]).unwrap();
    let e = merge_states(&a, &[0.0; 4], &bf, &[0.0; 4]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::DTypeMismatch {
                operand: Operand::O,
                ..
            }
        ),
        "{e}"
    );
    let e = merge_states_n(&[]).unwrap_err();
    assert!(matches!(e, Error::InvalidOption { .. }), "{e}");
}

//! FP8 KV caches (e4m3 codes with f32 scales) on the serving API.
//!
//! The error an FP8 cache adds is its quantisation, so the accuracy tests take it out: our output
//! over the cache must match the float64 reference over the *dequantised* cache (`code · scale`)
//! by FlashAttention's rule, as tightly as an f32 cache would. The error against the values before
//! quantisation is printed beside an f16 cache's. Appends are checked code by code against the
//! crate's e4m3 codec, and every bad scale is a typed error that leaves the cache untouched.

use crate::support::serving::{check_seq, paged_table, Rng};
use flash_attn::numerics::fp8::{e4m3_from_f32, e4m3_to_f32, E4M3_MAX};
use flash_attn::numerics::quant::{block_scale, encode_e4m3, finite_amax};
use flash_attn::reference::{attention_f64, max_abs_diff};
use flash_attn::serving::{
    append_kv, forward_kvcache, forward_kvcache_append, forward_kvcache_append_rotary, forward_varlen_kvcache,
    BlockTable, Fp8KvCache, Fp8KvCacheMut, KvCache, KvCacheMut, KvScales, KvScalesMut, Rotary,
};
use flash_attn::{Backend, DType, Error, ForwardOptions, Mask, Problem, Tensor};

/// How the test caches are scaled.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Scaling {
    PerTensor,
    PerTokenHead,
}

/// An FP8 cache built from known values, with the values its codes stand for.
struct Built {
    shape: [usize; 4],
    table: Option<(Vec<i32>, usize)>,
    seqlens: Vec<i32>,
    codes: [Vec<u8>; 2],
    /// Per-tensor scales `[k, v]`, or per (slot, kv head) scales of K and V.
    tensor_scales: [f32; 2],
    row_scales: [Vec<f32>; 2],
    scaling: Scaling,
    /// Per sequence `[sk][hkv][d]`: the values before quantisation and what the codes stand for.
    orig: Vec<[Vec<f32>; 2]>,
    deq: Vec<[Vec<f32>; 2]>,
}

impl Built {
    fn scales(&self) -> KvScales<'_> {
        match self.scaling {
            Scaling::PerTensor => KvScales::PerTensor {
                k: self.tensor_scales[0],
                v: self.tensor_scales[1],
            },
            Scaling::PerTokenHead => KvScales::PerTokenHead {
                k: &self.row_scales[0],
                v: &self.row_scales[1],
            },
        }
    }
    fn cache(&self) -> Fp8KvCache<'_> {
        Fp8KvCache {
            k: &self.codes[0],
            v: &self.codes[1],
            shape: self.shape,
            scales: self.scales(),
            seqlens: &self.seqlens,
            block_table: self.table.as_ref().map(|(ids, w)| BlockTable {
                ids,
                max_blocks_per_seq: *w,
            }),
        }
    }
}

/// Where key `j` of sequence `b` lies: (outer, row) of the cache.
fn slot(table: &Option<(Vec<i32>, usize)>, page: usize, b: usize, j: usize) -> (usize, usize) {
    match table {
        None => (b, j),
        Some((ids, w)) => (ids[b * w + j / page] as usize, j % page),
    }
}

/// `n` N(0, 1) values with every 16th channel of each `d`-row ×8 (outlier channels, as real
/// models' keys have).
fn model_like(rng: &mut Rng, n: usize, d: usize) -> Vec<f32> {
    (0..n).map(|i| rng.normal() as f32 * if i % d % 16 == 3 { 8.0 } else { 1.0 }).collect()
}

/// An FP8 cache (dense of capacity `cap`, or paged with pages of `page`) holding `lens[b]` keys
/// per sequence; unused slots hold random codes and (per-row) scales of 0, which no call may read.
fn build(lens: &[usize], hkv: usize, d: usize, paged: Option<usize>, cap: usize, scaling: Scaling, rng: &mut Rng) -> Built {
    let batch = lens.len();
    let (shape, table, page) = match paged {
        None => ([batch, cap, hkv, d], None, cap),
        Some(page) => {
            let t = paged_table(lens, 0, page, false, (2, 1), rng);
            ([t.num_blocks, page, hkv, d], Some((t.ids, t.width)), page)
        }
    };
    let n: usize = shape.iter().product();
    let orig: Vec<[Vec<f32>; 2]> =
        lens.iter().map(|&l| [model_like(rng, l * hkv * d, d), model_like(rng, l * hkv * d, d)]).collect();
    let amax = |side: usize| orig.iter().map(|o| finite_amax(&o[side])).fold(0.0, f32::max);
    let tensor_scales = [block_scale(amax(0)), block_scale(amax(1))];
    let mut codes = [0, 1].map(|_| (0..n).map(|_| (rng.next_u64() & 0xFF) as u8).collect::<Vec<u8>>());
    let mut row_scales = [vec![0.0f32; n / d], vec![0.0f32; n / d]];
    let mut deq: Vec<[Vec<f32>; 2]> = lens.iter().map(|&l| [vec![0.0; l * hkv * d], vec![0.0; l * hkv * d]]).collect();
    for (b, &l) in lens.iter().enumerate() {
        for j in 0..l {
            let (outer, row) = slot(&table, page, b, j);
            for h in 0..hkv {
                let at = ((outer * shape[1] + row) * hkv + h) * d;
                let src = (j * hkv + h) * d;
                for side in 0..2 {
                    let x = &orig[b][side][src..src + d];
                    let s = match scaling {
                        Scaling::PerTensor => tensor_scales[side],
                        Scaling::PerTokenHead => block_scale(finite_amax(x)),
                    };
                    row_scales[side][at / d] = s;
                    encode_e4m3(x, s, &mut codes[side][at..at + d]);
                    for (y, &c) in deq[b][side][src..src + d].iter_mut().zip(&codes[side][at..at + d]) {
                        *y = e4m3_to_f32(c) * s;
                    }
                }
            }
        }
    }
    Built {
        shape,
        table,
        seqlens: lens.iter().map(|&l| l as i32).collect(),
        codes,
        tensor_scales,
        row_scales,
        scaling,
        orig,
        deq,
    }
}

/// One sequence's rows of a `[batch, sq, heads, d]` buffer.
fn seq_rows(x: &[f32], b: usize, sq: usize, h: usize, d: usize) -> &[f32] {
    &x[b * sq * h * d..(b + 1) * sq * h * d]
}

/// Our output over an FP8 cache against the float64 reference over its dequantised values, by
/// FlashAttention's rule (f32 q: the rule at f32's floor), dense and paged, both scale kinds,
/// GQA, masks, softcap, forced and heuristic splits, and a query long enough for the tiled path
/// (which an FP8 cache does not take: it runs in place).
#[test]
fn matches_reference_on_dequantised_cache() {
    // (seqlen_q, heads_q, heads_kv, head_dim, options)
    let cases: [(usize, usize, usize, usize, ForwardOptions); 6] = [
        (1, 8, 2, 64, ForwardOptions::default()),
        (1, 8, 2, 128, ForwardOptions::default().num_splits(3)),
        (5, 4, 2, 32, ForwardOptions::default().causal(true)),
        (3, 6, 2, 40, ForwardOptions::default().mask(Mask::window(20, 0))),
        (1, 4, 4, 64, ForwardOptions::default().softcap(10.0)),
        (40, 4, 1, 32, ForwardOptions::default().causal(true)),
    ];
    let mut rng = Rng::new(7);
    let lens = [300, 0, 77, 513];
    let mut worst = 0.0f64;
    for (ci, (sq, hq, hkv, d, opts)) in cases.into_iter().enumerate() {
        let opts = opts.return_lse(true);
        for paged in [None, Some(16)] {
            for scaling in [Scaling::PerTensor, Scaling::PerTokenHead] {
                let c = build(&lens, hkv, d, paged, 520, scaling, &mut rng);
                let batch = lens.len();
                let qv: Vec<f32> = (0..batch * sq * hq * d).map(|_| rng.normal() as f32).collect();
                let q = Tensor::from_vec(qv.clone(), [batch, sq, hq, d]).unwrap();
                let out = forward_kvcache(&q, &c.cache(), &opts).unwrap();
                let what = format!("case {ci}, paged {paged:?}, {scaling:?}");
                assert!(!out.dispatch.kernel.contains('+'), "{what}: an FP8 cache runs in place: {}", out.dispatch.kernel);
                let o = out.o.to_f32_vec();
                let lse = out.lse.as_ref().unwrap();
                for (b, &sk) in lens.iter().enumerate() {
                    let l = |h: usize, i: usize| lse[(b * hq + h) * sq + i];
                    let r = check_seq(
                        DType::F32,
                        (sq, sk, hq, hkv, d),
                        seq_rows(&qv, b, sq, hq, d),
                        &c.deq[b][0],
                        &c.deq[b][1],
                        &opts,
                        seq_rows(&o, b, sq, hq, d),
                        Some(&l),
                    );
                    let r = r.unwrap_or_else(|e| panic!("{what}, sequence {b}: {e}"));
                    worst = worst.max(r.err);
                }
            }
        }
    }
    eprintln!("FP8 cache vs the float64 reference on its dequantised values: max error {worst:.2e}");
}

/// f16 and bf16 queries over an FP8 cache give the f32 query's output rounded to their type.
#[test]
fn half_queries_round_the_f32_result() {
    let mut rng = Rng::new(11);
    let (hq, hkv, d) = (8, 2, 64);
    let c = build(&[200, 31], hkv, d, Some(32), 0, Scaling::PerTokenHead, &mut rng);
    for dt in [DType::F16, DType::BF16] {
        let qv: Vec<f32> = (0..2 * hq * d).map(|_| dt.round(rng.normal() as f32)).collect();
        let q32 = Tensor::from_vec(qv.clone(), [2, 1, hq, d]).unwrap();
        let qh = Tensor::from_f32(&qv, dt, [2, 1, hq, d]).unwrap();
        let opts = ForwardOptions::default();
        let a = forward_kvcache(&q32, &c.cache(), &opts).unwrap().o.to_f32_vec();
        let out = forward_kvcache(&qh, &c.cache(), &opts).unwrap();
        assert_eq!(out.o.dtype(), dt);
        let b = out.o.to_f32_vec();
        let ulp = if dt == DType::F16 { 2f32.powi(-11) } else { 2f32.powi(-8) };
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= ulp * x.abs().max(1e-3) * 1.01 + 1e-6, "{dt:?}: {x} vs {y}");
        }
    }
}

/// The packed-query entry point (chunked prefill) over a paged FP8 cache.
#[test]
fn varlen_queries_over_a_paged_cache() {
    let mut rng = Rng::new(5);
    let (hq, hkv, d) = (4, 2, 32);
    let lens = [90, 17, 250];
    let c = build(&lens, hkv, d, Some(16), 0, Scaling::PerTensor, &mut rng);
    let lens_q = [3usize, 1, 20];
    let cu: Vec<i32> = std::iter::once(0).chain(lens_q.iter().scan(0, |s, &l| { *s += l as i32; Some(*s) })).collect();
    let total = *cu.last().unwrap() as usize;
    let qv: Vec<f32> = (0..total * hq * d).map(|_| rng.normal() as f32).collect();
    let q = Tensor::from_vec(qv.clone(), [1, total, hq, d]).unwrap();
    let opts = ForwardOptions::default().causal(true).return_lse(true);
    let out = forward_varlen_kvcache(&q, &cu, 20, &c.cache(), &opts).unwrap();
    let o = out.o.to_f32_vec();
    let lse = out.lse.unwrap();
    for b in 0..lens.len() {
        let (r0, r1) = (cu[b] as usize, cu[b + 1] as usize);
        let l = |h: usize, i: usize| lse[h * total + r0 + i];
        check_seq(
            DType::F32,
            (r1 - r0, lens[b], hq, hkv, d),
            &qv[r0 * hq * d..r1 * hq * d],
            &c.deq[b][0],
            &c.deq[b][1],
            &opts,
            &o[r0 * hq * d..r1 * hq * d],
            Some(&l),
        )
        .unwrap_or_else(|e| panic!("sequence {b}: {e}"));
    }
}

/// The error of an FP8 cache against the values before quantisation (e4m3's 3 mantissa bits:
/// with per-tensor scales, K's outlier channels set the scale of every row) exceeds an f16
/// cache's; printed side by side (the table of docs/serving.md is the example
/// `fp8_kv_cache_error` at a realistic size).
#[test]
fn quantisation_error_beside_an_f16_cache() {
    let mut rng = Rng::new(3);
    let (hq, hkv, d, sk) = (8, 2, 128, 1000);
    for scaling in [Scaling::PerTensor, Scaling::PerTokenHead] {
        let c = build(&[sk], hkv, d, None, sk, scaling, &mut rng);
        let qv: Vec<f32> = (0..hq * d).map(|_| rng.normal() as f32).collect();
        let q = Tensor::from_vec(qv.clone(), [1, 1, hq, d]).unwrap();
        let opts = ForwardOptions::default();
        let fp8 = forward_kvcache(&q, &c.cache(), &opts).unwrap().o.to_f32_vec();
        let [k16, v16] = [0, 1].map(|s| Tensor::from_f32(&c.orig[0][s], DType::F16, [1, sk, hkv, d]).unwrap());
        let q16 = Tensor::from_f32(&qv, DType::F16, [1, 1, hq, d]).unwrap();
        let f16 = forward_kvcache(&q16, &KvCache::dense(k16.view(), v16.view(), &c.seqlens), &opts).unwrap();
        let [ko, vo] = [0, 1].map(|s| Tensor::from_vec(c.orig[0][s].clone(), [1, sk, hkv, d]).unwrap());
        let p = Problem::new(&q.view(), &ko.view(), &vo.view(), &opts).unwrap();
        let r = attention_f64(&p, &q.view(), &ko.view(), &vo.view()).unwrap();
        let f64s = |x: &[f32]| x.iter().map(|&y| y as f64).collect::<Vec<_>>();
        let e8 = max_abs_diff(&f64s(&fp8), &r.o);
        let e16 = max_abs_diff(&f64s(&f16.o.to_f32_vec()), &r.o);
        eprintln!("{scaling:?}: max |o - reference on the values before quantisation|: FP8 cache {e8:.2e}, f16 cache {e16:.2e}");
        assert!(e16 < e8, "{scaling:?}: the FP8 cache's error {e8:e} should exceed the f16 cache's {e16:e}");
        assert!(e8 < 1.0, "{scaling:?}: FP8 cache error {e8:e}");
    }
}

/// The buffers of a writable FP8 cache of `shape`: codes 0x11 (K) and 0x22 (V), and per (slot,
/// kv head) scales of 0.25 (none for per-tensor scaling).
fn writable(shape: [usize; 4], scaling: Scaling) -> ([Vec<u8>; 2], [Vec<f32>; 2]) {
    let n: usize = shape.iter().product();
    let scales = match scaling {
        Scaling::PerTensor => [vec![], vec![]],
        Scaling::PerTokenHead => [vec![0.25; n / shape[3]], vec![0.25; n / shape[3]]],
    };
    ([vec![0x11u8; n], vec![0x22u8; n]], scales)
}

/// Appends quantise each new row with the crate's codec: per tensor with the given scale, per
/// (token, head) with `amax / 448` over the row's finite values, stored in its slot; ±inf and
/// values past the range saturate to ±448, NaN stays NaN; other slots are untouched. Then
/// attention over the cache matches the reference on the dequantised values, and
/// `forward_kvcache_append` is `append_kv` then `forward_kvcache`, bit for bit.
#[test]
fn append_quantises_and_round_trips() {
    let mut rng = Rng::new(21);
    let (hkv, d, page, blocks) = (2, 16, 4, 6);
    let shape = [blocks, page, hkv, d];
    let ids = [4, 1, 0, 5, 2, 3];
    let table = BlockTable { ids: &ids, max_blocks_per_seq: 3 };
    let seqlens = [5, 2];
    let new = 3;
    let mut kn: Vec<f32> = (0..2 * new * hkv * d).map(|_| rng.normal() as f32).collect();
    let vn: Vec<f32> = (0..2 * new * hkv * d).map(|_| rng.normal() as f32 * 3.0).collect();
    // Non-finite and out-of-range inputs in one row (sequence 0, new row 1, kv head 0).
    let r = hkv * d;
    kn[r..r + 4].copy_from_slice(&[f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e6]);
    let k_new = Tensor::from_vec(kn.clone(), [2, new, hkv, d]).unwrap();
    let v_new = Tensor::from_vec(vn.clone(), [2, new, hkv, d]).unwrap();
    let hq = 4;
    let q = Tensor::from_vec((0..2 * hq * d).map(|_| rng.normal() as f32).collect(), [2, 1, hq, d]).unwrap();
    let opts = ForwardOptions::default().return_lse(true);
    for scaling in [Scaling::PerTensor, Scaling::PerTokenHead] {
        let (mut codes, mut scales) = writable(shape, scaling);
        let before = codes.clone();
        let per_tensor = [0.01f32, 0.02];
        {
            let [kc, vc] = &mut codes;
            let [ks, vs] = &mut scales;
            let mut cache = Fp8KvCacheMut {
                k: kc,
                v: vc,
                shape,
                scales: match scaling {
                    Scaling::PerTensor => KvScalesMut::PerTensor { k: per_tensor[0], v: per_tensor[1] },
                    Scaling::PerTokenHead => KvScalesMut::PerTokenHead { k: ks, v: vs },
                },
                seqlens: &seqlens,
                block_table: Some(table),
            };
            append_kv(&mut cache, &k_new, &v_new).unwrap();
        }
        // Every slot: the new rows' codes as the codec makes them, the rest untouched.
        let mut written = vec![false; shape.iter().product::<usize>() / d];
        for b in 0..2 {
            for i in 0..new {
                let j = seqlens[b] as usize + i;
                let (outer, row) = (ids[b * 3 + j / page] as usize, j % page);
                for h in 0..hkv {
                    let at = ((outer * page + row) * hkv + h) * d;
                    written[at / d] = true;
                    let src = ((b * new + i) * hkv + h) * d;
                    for (side, x) in [(0, &kn[src..src + d]), (1, &vn[src..src + d])] {
                        let s = match scaling {
                            Scaling::PerTensor => per_tensor[side],
                            Scaling::PerTokenHead => {
                                let s = block_scale(finite_amax(x));
                                assert_eq!(scales[side][at / d], s, "scale of sequence {b}, row {i}, head {h}");
                                s
                            }
                        };
                        for (t, &xv) in x.iter().enumerate() {
                            let (got, want) = (codes[side][at + t], e4m3_from_f32(xv / s));
                            if xv.is_nan() {
                                assert!(e4m3_to_f32(got).is_nan(), "NaN must stay NaN");
                            } else {
                                assert_eq!(got, want, "{scaling:?} side {side} seq {b} row {i} head {h} elem {t}");
                            }
                            if xv.is_infinite() || xv.abs() / s > E4M3_MAX {
                                assert_eq!(e4m3_to_f32(got), E4M3_MAX.copysign(xv), "saturation");
                            }
                        }
                    }
                }
            }
        }
        for (side, c) in codes.iter().enumerate() {
            for (row, w) in written.iter().enumerate() {
                if !w {
                    assert_eq!(c[row * d..(row + 1) * d], before[side][row * d..(row + 1) * d], "slot {row} touched");
                }
            }
        }
        // Attention over the appended cache (the row with inf/NaN is read: its outputs are NaN
        // where the reference's are; compare the other sequence exactly by the rule).
        let read = Fp8KvCache {
            k: &codes[0],
            v: &codes[1],
            shape,
            scales: match scaling {
                Scaling::PerTensor => KvScales::PerTensor { k: per_tensor[0], v: per_tensor[1] },
                Scaling::PerTokenHead => KvScales::PerTokenHead { k: &scales[0], v: &scales[1] },
            },
            seqlens: &[seqlens[0] + new as i32, seqlens[1] + new as i32],
            block_table: Some(table),
        };
        let out = forward_kvcache(&q, &read, &opts).unwrap();
        let o = out.o.to_f32_vec();
        assert!(o[..hq * d].iter().any(|x| x.is_nan()), "a NaN key must reach sequence 0's output");
        let b = 1;
        let sk = seqlens[b] as usize + new;
        let deq = |side: usize| -> Vec<f32> {
            let mut x = vec![0.0; sk * hkv * d];
            for j in 0..sk {
                let (outer, row) = (ids[b * 3 + j / page] as usize, j % page);
                for h in 0..hkv {
                    let at = ((outer * page + row) * hkv + h) * d;
                    let s = match scaling {
                        Scaling::PerTensor => per_tensor[side],
                        Scaling::PerTokenHead => scales[side][at / d],
                    };
                    for t in 0..d {
                        x[(j * hkv + h) * d + t] = e4m3_to_f32(codes[side][at + t]) * s;
                    }
                }
            }
            x
        };
        let lse = out.lse.as_ref().unwrap();
        let l = |h: usize, i: usize| lse[(b * hq + h) + i];
        check_seq(DType::F32, (1, sk, hq, hkv, d), &q.to_f32_vec()[hq * d..], &deq(0), &deq(1), &opts, &o[hq * d..], Some(&l))
            .unwrap_or_else(|e| panic!("{scaling:?}: {e}"));

        // The fused call on a fresh cache: the same codes, scales and output bits.
        let (mut codes2, mut scales2) = writable(shape, scaling);
        let fused = {
            let [kc, vc] = &mut codes2;
            let [ks, vs] = &mut scales2;
            let mut cache = Fp8KvCacheMut {
                k: kc,
                v: vc,
                shape,
                scales: match scaling {
                    Scaling::PerTensor => KvScalesMut::PerTensor { k: per_tensor[0], v: per_tensor[1] },
                    Scaling::PerTokenHead => KvScalesMut::PerTokenHead { k: ks, v: vs },
                },
                seqlens: &seqlens,
                block_table: Some(table),
            };
            forward_kvcache_append(&q, &mut cache, &k_new, &v_new, &opts).unwrap()
        };
        assert!(codes2 == codes && scales2 == scales, "{scaling:?}: the fused append wrote other codes or scales");
        let bits = |t: &Tensor| t.to_f32_vec().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fused.o), bits(&out.o), "{scaling:?}: fused output differs");
    }
}

/// Every bad scale is [`Error::InvalidScale`] and leaves the cache untouched: a per-tensor scale
/// that is 0, negative, NaN or infinite (read, append, fused append), a per (slot, kv head)
/// scale that is not a finite number > 0 in a slot the call reads; one in a slot it does not read
/// (or is about to write) is no error. Scale and code buffers of the wrong length are refused.
#[test]
fn bad_scales_are_typed_errors() {
    let (hkv, d, cap) = (1, 8, 6);
    let shape = [1, cap, hkv, d];
    let q = Tensor::from_vec(vec![0.5f32; 2 * d], [1, 1, 2, d]).unwrap();
    let kn = Tensor::from_vec(vec![1.0f32; d], [1, 1, hkv, d]).unwrap();
    let opts = ForwardOptions::default();
    let is_scale_err = |e: &Error| matches!(e, Error::InvalidScale { .. });
    for bad in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
        let (mut codes, _) = writable(shape, Scaling::PerTensor);
        let before = codes.clone();
        let [kc, vc] = &mut codes;
        let read = Fp8KvCache {
            k: kc,
            v: vc,
            shape,
            scales: KvScales::PerTensor { k: 1.0, v: bad },
            seqlens: &[3],
            block_table: None,
        };
        let e = forward_kvcache(&q, &read, &opts).unwrap_err();
        assert!(is_scale_err(&e) && e.to_string().contains("PerTensor v"), "{bad}: {e}");
        let mut cache = Fp8KvCacheMut {
            k: kc,
            v: vc,
            shape,
            scales: KvScalesMut::PerTensor { k: bad, v: 1.0 },
            seqlens: &[3],
            block_table: None,
        };
        let e = append_kv(&mut cache, &kn, &kn).unwrap_err();
        assert!(is_scale_err(&e), "{bad}: {e}");
        let e = forward_kvcache_append(&q, &mut cache, &kn, &kn, &opts).unwrap_err();
        assert!(is_scale_err(&e), "{bad}: {e}");
        assert!(codes == before, "{bad}: the cache was written");
    }
    // Per (slot, kv head): slot 1 has scale 0 (read by a call over 3 keys), slot 4 NaN (never read).
    let (mut codes, [mut ks, mut vs]) = writable(shape, Scaling::PerTokenHead);
    ks.iter_mut().for_each(|s| *s = 0.5);
    vs.iter_mut().for_each(|s| *s = 0.5);
    ks[1] = 0.0;
    vs[4] = f32::NAN;
    ks[3] = 0.0; // the slot an append of one row to 3 keys writes
    let before = (codes.clone(), ks.clone(), vs.clone());
    {
        let [kc, vc] = &codes;
        let read = |seqlens: &'static [i32]| Fp8KvCache {
            k: kc,
            v: vc,
            shape,
            scales: KvScales::PerTokenHead { k: &ks, v: &vs },
            seqlens,
            block_table: None,
        };
        let e = forward_kvcache(&q, &read(&[3]), &opts).unwrap_err();
        assert!(is_scale_err(&e) && e.to_string().contains("k of sequence 0, key 1, kv head 0"), "{e}");
        assert!(forward_kvcache(&q, &read(&[1]), &opts).is_ok(), "slot 1 is not read over 1 key");
        // Scales of the wrong length.
        let short = Fp8KvCache {
            scales: KvScales::PerTokenHead { k: &ks[..5], v: &vs },
            ..read(&[1])
        };
        let e = forward_kvcache(&q, &short, &opts).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { .. }) && e.to_string().contains("PerTokenHead k"), "{e}");
        let codes_short = Fp8KvCache { k: &kc[1..], ..read(&[1]) };
        let e = forward_kvcache(&q, &codes_short, &opts).unwrap_err();
        assert!(matches!(e, Error::InvalidLayout { .. }), "{e}");
    }
    {
        let [kc, vc] = &mut codes;
        let mut cache = Fp8KvCacheMut {
            k: kc,
            v: vc,
            shape,
            scales: KvScalesMut::PerTokenHead { k: &mut ks, v: &mut vs },
            seqlens: &[3],
            block_table: None,
        };
        // Keys 0..3 are read, key 1's scale is 0: refused before the write.
        let e = forward_kvcache_append(&q, &mut cache, &kn, &kn, &opts).unwrap_err();
        assert!(is_scale_err(&e), "{e}");
    }
    let bits = |x: &[f32]| x.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
    assert!(codes == before.0 && bits(&ks) == bits(&before.1) && bits(&vs) == bits(&before.2), "the cache was written");
    {
        ks[1] = 0.5;
        let [kc, vc] = &mut codes;
        let mut cache = Fp8KvCacheMut {
            k: kc,
            v: vc,
            shape,
            scales: KvScalesMut::PerTokenHead { k: &mut ks, v: &mut vs },
            seqlens: &[3],
            block_table: None,
        };
        // Slot 3's scale (0) is about to be written: accepted, and set.
        forward_kvcache_append(&q, &mut cache, &kn, &kn, &opts).unwrap();
    }
    assert_eq!(ks[3], 1.0 / E4M3_MAX, "the appended row's scale (amax 1)");
}

/// `Backend::Cuda` takes an FP8 cache to the GPU serving path (FA2's kernels read it): with f32
/// q it stops at q's dtype (the kernels take f16 / bf16) or, without a usable device, at the
/// device, never at the cache. The default backend runs it on the CPU.
#[test]
fn cuda_takes_the_cache_and_auto_runs_on_the_cpu() {
    let mut rng = Rng::new(2);
    let c = build(&[10], 1, 32, None, 16, Scaling::PerTensor, &mut rng);
    let q = Tensor::from_vec(vec![0.1f32; 2 * 32], [1, 1, 2, 32]).unwrap();
    let e = forward_kvcache(&q, &c.cache(), &ForwardOptions::default().backend(Backend::Cuda(0))).unwrap_err();
    assert!(!e.to_string().contains("FP8"), "the FP8 cache itself is not refused: {e}");
    assert!(matches!(e, Error::UnsupportedDType { .. } | Error::BackendUnavailable { .. } | Error::Cuda { .. }), "{e:?}");
    let out = forward_kvcache(&q, &c.cache(), &ForwardOptions::default()).unwrap();
    assert_eq!(out.dispatch.backend, "cpu");
}

/// The error an FP8 cache adds on a realistic decode step, beside an f16 cache's: batch 8, 32
/// query heads on 8 kv heads, head_dim 128, 4096 cached keys per sequence; q, K and V N(0, 1)
/// with 4 of K's 128 channels ×8 (the outlier channels of real models' keys). The FP8 caches are
/// filled through `append_kv` (which quantises). Prints the table of docs/serving.md ("FP8 KV
/// cache"; `cargo test --test cpu fp8_kv_cache::decode_error_table -- --nocapture`) and asserts
/// that against the reference on the dequantised values the FP8 outputs are as tight as f32's.
#[test]
fn decode_error_table() {
    const B: usize = 8;
    const HQ: usize = 32;
    const HKV: usize = 8;
    const D: usize = 128;
    const SK: usize = 4096;
    let errors = |a: &[f32], b: &[f64]| {
        let e: Vec<f64> = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).abs()).collect();
        (e.iter().cloned().fold(0.0, f64::max), e.iter().sum::<f64>() / e.len() as f64)
    };
    let mut rng = Rng::new(2024);
    let shape = [B, SK, HKV, D];
    let n = B * SK * HKV * D;
    let k: Vec<f32> = (0..n).map(|i| rng.normal() as f32 * if i % D % 32 == 5 { 8.0 } else { 1.0 }).collect();
    let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    let q: Vec<f32> = (0..B * HQ * D).map(|_| rng.normal() as f32).collect();
    let (kt, vt) = (Tensor::from_vec(k.clone(), shape).unwrap(), Tensor::from_vec(v.clone(), shape).unwrap());
    let qt = Tensor::from_vec(q.clone(), [B, 1, HQ, D]).unwrap();
    let opts = ForwardOptions::default();
    let seqlens = [SK as i32; B];
    let p = Problem::new(&qt.view(), &kt.view(), &vt.view(), &opts).unwrap();
    let reference = attention_f64(&p, &qt.view(), &kt.view(), &vt.view()).unwrap();

    println!("| K/V cache | max error | mean error | max error vs the reference on the dequantised cache |");
    println!("|---|---:|---:|---:|");
    let (k16, v16) = (Tensor::from_f32(&k, DType::F16, shape).unwrap(), Tensor::from_f32(&v, DType::F16, shape).unwrap());
    let q16 = Tensor::from_f32(&q, DType::F16, [B, 1, HQ, D]).unwrap();
    let o16 = forward_kvcache(&q16, &KvCache::dense(k16.view(), v16.view(), &seqlens), &opts).unwrap();
    let (m16, a16) = errors(&o16.o.to_f32_vec(), &reference.o);
    println!("| f16 (q and o f16) | {m16:.2e} | {a16:.2e} | |");
    for scaling in [Scaling::PerTensor, Scaling::PerTokenHead] {
        let (mut kc, mut vc) = (vec![0u8; n], vec![0u8; n]);
        let (mut ks, mut vs) = (vec![0.0f32; n / D], vec![0.0f32; n / D]);
        let ts = (block_scale(finite_amax(&k)), block_scale(finite_amax(&v)));
        {
            let scales = match scaling {
                Scaling::PerTensor => KvScalesMut::PerTensor { k: ts.0, v: ts.1 },
                Scaling::PerTokenHead => KvScalesMut::PerTokenHead { k: &mut ks, v: &mut vs },
            };
            let no_keys = [0i32; B];
            let mut cache = Fp8KvCacheMut { k: &mut kc, v: &mut vc, shape, scales, seqlens: &no_keys, block_table: None };
            append_kv(&mut cache, &kt, &vt).unwrap();
        }
        let scale = |side: usize, row: usize| match scaling {
            Scaling::PerTensor => [ts.0, ts.1][side],
            Scaling::PerTokenHead => [&ks, &vs][side][row],
        };
        let read = Fp8KvCache {
            k: &kc,
            v: &vc,
            shape,
            scales: match scaling {
                Scaling::PerTensor => KvScales::PerTensor { k: ts.0, v: ts.1 },
                Scaling::PerTokenHead => KvScales::PerTokenHead { k: &ks, v: &vs },
            },
            seqlens: &seqlens,
            block_table: None,
        };
        let o8 = forward_kvcache(&qt, &read, &opts).unwrap().o.to_f32_vec();
        let deq = |side: usize, codes: &[u8]| {
            let x = codes.iter().enumerate().map(|(i, &c)| e4m3_to_f32(c) * scale(side, i / D)).collect();
            Tensor::from_vec(x, shape).unwrap()
        };
        let (kd, vd) = (deq(0, &kc), deq(1, &vc));
        let r8 = attention_f64(&p, &qt.view(), &kd.view(), &vd.view()).unwrap();
        let (m, a) = errors(&o8, &reference.o);
        let (m8, _) = errors(&o8, &r8.o);
        let name = match scaling {
            Scaling::PerTensor => "FP8 e4m3, per-tensor scales",
            Scaling::PerTokenHead => "FP8 e4m3, per-(token, head) scales",
        };
        println!("| {name} (q and o f32) | {m:.2e} | {a:.2e} | {m8:.2e} |");
        assert!(m8 < 1e-5, "{name}: {m8:e} from the reference on the dequantised cache");
        assert!(m > m16, "{name}: the quantisation should show");
    }
}

/// The rotary append into an FP8 cache rotates k_new in f32 and then quantises: its codes are
/// exactly those of an f32 cache's rotated rows encoded with the same per-tensor scale, and v is
/// encoded unrotated (the attention that follows is the FP8 cache's own, tested above).
#[test]
fn rotary_append_quantises_the_rotated_rows() {
    let (batch, cap, hkv, hq, d, new) = (2usize, 8usize, 2usize, 4usize, 16usize, 2usize);
    let (rd, seqlen_ro) = (8usize, 16usize);
    let mut rng = Rng::new(0x0f8_407a);
    let mut draw = |n: usize| (0..n).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
    let angles: Vec<f32> = (0..seqlen_ro * rd / 2).map(|i| 0.37 * i as f32).collect();
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    let seqlens = [3i32, 5];
    let shape = [batch, cap, hkv, d];
    let n = batch * cap * hkv * d;
    let (k0, v0) = (draw(n), draw(n));
    let q = Tensor::from_vec(draw(batch * new * hq * d), [batch, new, hq, d]).unwrap();
    let k_new = Tensor::from_vec(draw(batch * new * hkv * d), [batch, new, hkv, d]).unwrap();
    let v_new = Tensor::from_vec(draw(batch * new * hkv * d), [batch, new, hkv, d]).unwrap();
    let opts = ForwardOptions::default().mask(Mask::Causal);
    let scale = 0.02f32;
    for interleaved in [false, true] {
        let rot = Rotary::new(&cos, &sin, rd, interleaved);
        // The f32 cache: the rotated rows as written, before any quantisation.
        let (mut kf, mut vf) = (k0.clone(), v0.clone());
        let mut cache = KvCacheMut {
            k: &mut kf,
            v: &mut vf,
            shape,
            seqlens: &seqlens,
            block_table: None,
            batch_idx: None,
            leftpad: None,
        };
        forward_kvcache_append_rotary(&q, &mut cache, &k_new, &v_new, &rot, &opts).unwrap();
        // The FP8 cache of the same old values, appended to by the same call.
        let (mut kc, mut vc) = (vec![0u8; n], vec![0u8; n]);
        encode_e4m3(&k0, scale, &mut kc);
        encode_e4m3(&v0, scale, &mut vc);
        let mut cache = Fp8KvCacheMut {
            k: &mut kc,
            v: &mut vc,
            shape,
            scales: KvScalesMut::PerTensor { k: scale, v: scale },
            seqlens: &seqlens,
            block_table: None,
        };
        let out = forward_kvcache_append_rotary(&q, &mut cache, &k_new, &v_new, &rot, &opts).unwrap();
        assert_eq!(out.o.shape(), [batch, new, hq, d]);
        let (mut want_k, mut want_v) = (vec![0u8; n], vec![0u8; n]);
        encode_e4m3(&kf, scale, &mut want_k);
        encode_e4m3(&vf, scale, &mut want_v);
        assert!(kc == want_k, "interleaved {interleaved}: k codes are not the rotated rows' codes");
        assert!(vc == want_v, "interleaved {interleaved}: v codes are not the unrotated rows' codes");
        assert!(kf != k0, "interleaved {interleaved}: the f32 append wrote nothing");
    }
}

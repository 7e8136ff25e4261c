//! The serving paths on a GPU (docs/serving.md "GPU"): varlen and paged KV caches, FP8 (e4m3)
//! caches, and the append with a rotary and cache rows, through the CPU API with `Backend::Cuda` (which runs `Engine::launch_serving_raw` or
//! `launch_serving_fp8_raw`: upload, the serving kernels, download), each sequence against the
//! float64 reference on that sequence alone. The kernels ran in the emulator
//! (tests/emulator/serving_fa2.rs, fp8_kv_cache.rs); these tests have not run on a GPU.

use crate::support::serving::{slopes, values, Rng};
use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff, rotary_f64};
use flash_attn::numerics::fp8::e4m3_to_f32;
use flash_attn::numerics::quant::{block_scale, encode_e4m3, finite_amax};
use flash_attn::serving::{
    forward_kvcache, forward_kvcache_append_rotary, forward_varlen, BlockTable, Fp8KvCache, KvCache, KvCacheMut, KvScales,
    Rotary, Varlen,
};
use flash_attn::{Backend, DType, Element, ForwardOptions, Mask, Output, Problem, Tensor, Variant};

/// Checks sequence rows `o` `[sq][hq][d]` and `lse(h, i)` against the reference of that sequence.
#[allow(clippy::too_many_arguments)]
fn check_seq(dtype: DType, dims: (usize, usize, usize, usize, usize), q: &[f32], k: &[f32], v: &[f32], opts: &ForwardOptions, o: &[f32], lse: &dyn Fn(usize, usize) -> f32, what: &str) {
    let (sq, sk, hq, hkv, d) = dims;
    if sq == 0 {
        return;
    }
    if sk == 0 {
        assert!(o.iter().all(|&x| x == 0.0), "{what}: no keys, O must be 0");
        assert!((0..hq).all(|h| (0..sq).all(|i| lse(h, i) == f32::NEG_INFINITY)), "{what}: no keys, LSE must be -inf");
        return;
    }
    // The inputs as given, in f32 (q, k, v hold dtype values, or an FP8 cache's dequantised ones,
    // which the dtype may not hold); the naive attention rounds to `dtype`.
    let cpu = opts.clone().backend(Backend::Cpu);
    let qt = Tensor::from_f32(q, DType::F32, [1, sq, hq, d]).unwrap();
    let kt = Tensor::from_f32(k, DType::F32, [1, sk, hkv, d]).unwrap();
    let vt = Tensor::from_f32(v, DType::F32, [1, sk, hkv, d]).unwrap();
    let p = Problem::new(&qt.view(), &kt.view(), &vt.view(), &cpu).unwrap();
    let r = attention_f64(&p, &qt.view(), &kt.view(), &vt.view()).unwrap();
    let naive = attention_naive(&p, &qt.view(), &kt.view(), &vt.view(), dtype).unwrap();
    let ours: Vec<f64> = o.iter().map(|&x| x as f64).collect();
    let (err, bound) = (max_abs_diff(&ours, &r.o), 2.0 * max_abs_diff(&naive, &r.o) + crate::support::floor_for(dtype));
    assert!(err <= bound, "{what}: max |O - ref| {err:.3e} > {bound:.3e}");
    for h in 0..hq {
        for i in 0..sq {
            let (got, want) = (lse(h, i) as f64, r.lse[h * sq + i]);
            assert!((got - want).abs() <= 2e-3, "{what}: LSE[{h}][{i}] {got} vs {want}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn serving_varlen_on_gpu() {
    let mut rng = Rng::new(21);
    let (hq, hkv, d) = (8, 2, 128);
    for dtype in [DType::F16, DType::BF16] {
        for mask in [Mask::None, Mask::Causal, Mask::window(33, 2)] {
            let (lq, lk) = ([0usize, 1, 77, 300], [5usize, 0, 129, 300]);
            let cu = |l: &[usize]| l.iter().scan(0i32, |a, &x| Some(std::mem::replace(a, *a + x as i32))).chain([l.iter().sum::<usize>() as i32]).collect::<Vec<i32>>();
            let (cq, ck) = (cu(&lq), cu(&lk));
            let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
            let (q, k, v) = (values(&mut rng, tq * hq * d, dtype), values(&mut rng, tk * hkv * d, dtype), values(&mut rng, tk * hkv * d, dtype));
            let opts = ForwardOptions::default().mask(mask).return_lse(true).alibi_slopes(slopes(hq)).backend(Backend::Cuda(0));
            let seqs = Varlen { cu_seqlens_q: &cq, cu_seqlens_k: &ck, max_seqlen_q: 300, max_seqlen_k: 300 };
            let t = |x: &[f32], r: usize, h: usize| Tensor::from_f32(x, dtype, [1, r, h, d]).unwrap();
            let out = forward_varlen(&t(&q, tq, hq), &t(&k, tk, hkv), &t(&v, tk, hkv), &seqs, &opts).unwrap();
            assert!(out.dispatch.backend.starts_with("cuda"), "{:?}", out.dispatch);
            let (o, lse) = (out.o.to_f32_vec(), out.lse.unwrap());
            for b in 0..lq.len() {
                let (q0, k0) = (cq[b] as usize, ck[b] as usize);
                let rows = |x: &[f32], r0: usize, n: usize, h: usize| x[r0 * h * d..(r0 + n) * h * d].to_vec();
                let lse_at = |h: usize, i: usize| lse[h * tq + q0 + i];
                check_seq(dtype, (lq[b], lk[b], hq, hkv, d), &rows(&q, q0, lq[b], hq), &rows(&k, k0, lk[b], hkv), &rows(&v, k0, lk[b], hkv), &opts, &rows(&o, q0, lq[b], hq), &lse_at, &format!("{dtype:?} {mask:?} seq {b}"));
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn serving_paged_decode_on_gpu() {
    let mut rng = Rng::new(22);
    let (hq, hkv, d) = (32, 8, 128);
    for page in [1usize, 3, 16, 256] {
        let lens = [4096usize, 1, 0, 777];
        let max_blocks = 4096usize.div_ceil(page);
        let num_blocks = lens.iter().map(|l| l.div_ceil(page)).sum::<usize>() + 1;
        let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
        rng.shuffle(&mut ids);
        let mut table = vec![-1i32; lens.len() * max_blocks];
        let mut next = ids.into_iter();
        for (b, &l) in lens.iter().enumerate() {
            for p in 0..l.div_ceil(page) {
                table[b * max_blocks + p] = next.next().unwrap();
            }
        }
        let row = hkv * d;
        let logical: Vec<(Vec<f32>, Vec<f32>)> = lens.iter().map(|&l| (values(&mut rng, l * row, DType::BF16), values(&mut rng, l * row, DType::BF16))).collect();
        let (mut kc, mut vc) = (vec![f32::NAN; num_blocks * page * row], vec![f32::NAN; num_blocks * page * row]);
        for (b, &l) in lens.iter().enumerate() {
            for j in 0..l {
                let at = (table[b * max_blocks + j / page] as usize * page + j % page) * row;
                kc[at..at + row].copy_from_slice(&logical[b].0[j * row..][..row]);
                vc[at..at + row].copy_from_slice(&logical[b].1[j * row..][..row]);
            }
        }
        let shape = [num_blocks, page, hkv, d];
        let (kt, vt) = (Tensor::from_f32(&kc, DType::BF16, shape).unwrap(), Tensor::from_f32(&vc, DType::BF16, shape).unwrap());
        let seqlens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        let cache = KvCache::paged(kt.view(), vt.view(), &seqlens, BlockTable { ids: &table, max_blocks_per_seq: max_blocks });
        let q = values(&mut rng, lens.len() * hq * d, DType::BF16);
        let opts = ForwardOptions::default().mask(Mask::Causal).return_lse(true).backend(Backend::Cuda(0));
        let out = forward_kvcache(&Tensor::from_f32(&q, DType::BF16, [lens.len(), 1, hq, d]).unwrap(), &cache, &opts).unwrap();
        let (o, lse) = (out.o.to_f32_vec(), out.lse.unwrap());
        for (b, &l) in lens.iter().enumerate() {
            let lse_at = |h: usize, _i: usize| lse[b * hq + h];
            let r = |x: &[f32]| x[b * hq * d..(b + 1) * hq * d].to_vec();
            check_seq(DType::BF16, (1, l, hq, hkv, d), &r(&q), &logical[b].0, &logical[b].1, &opts, &r(&o), &lse_at, &format!("page {page} seq {b}"));
        }
    }
}

/// An FP8 (e4m3) cache, dense and paged (pages of 3, 16 and 256), per-tensor and per-(token, head)
/// scales, decode and 3 causal rows, read through `Backend::Cuda` by FA2 (`Auto`): each sequence
/// against the float64 reference over the dequantised cache (`e4m3(code) · scale`, exact in
/// f32), the naive attention rounding it to the dtype as the kernels' 16-bit tiles hold it.
/// Unused slots hold NaN codes and NaN scales.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_kv_cache_on_gpu() {
    fp8_kv_cache_reads(Variant::Auto);
}

/// As `fp8_kv_cache_on_gpu`, on FA3's stage 5 (`Variant::Fa3`, every tile gathered and
/// converted by the producer) on Hopper; elsewhere `Variant::Fa3` is refused with a typed error.
/// Named `fa3_serving_*`: scripts/check/gpu-run.sh runs it after the FA3 stage ladder.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_serving_fp8_kv_cache() {
    if fa3_refused_here() {
        return;
    }
    fp8_kv_cache_reads(Variant::Fa3);
}

/// Whether this GPU lacks FA3 (not sm_90): then a serving call with `Variant::Fa3` must be
/// refused with `VariantUnavailable` (checked here).
fn fa3_refused_here() -> bool {
    if crate::util::engine().device().sm() == 90 {
        return false;
    }
    let (q, k) = (Tensor::from_f32(&[0.0; 128], DType::BF16, [1, 1, 1, 128]).unwrap(), Tensor::from_f32(&[0.0; 256], DType::BF16, [1, 2, 1, 128]).unwrap());
    let cache = KvCache::dense(k.view(), k.view(), &[2]);
    let opts = ForwardOptions::default().variant(Variant::Fa3).backend(Backend::Cuda(0));
    let e = forward_kvcache(&q, &cache, &opts).unwrap_err();
    assert!(matches!(e, flash_attn::Error::VariantUnavailable { .. }), "{e:?}");
    true
}

/// The body of the FP8-cache tests on `variant`.
fn fp8_kv_cache_reads(variant: Variant) {
    let mut rng = Rng::new(24);
    let (hq, hkv, d) = (8, 2, 128);
    let lens = [300usize, 1, 0, 129];
    let row = hkv * d;
    for page in [None, Some(3usize), Some(16), Some(256)] {
        for per_token in [false, true] {
            let (slots_per_b, max_blocks) = match page {
                None => (lens.iter().copied().max().unwrap() + 5, 0),
                Some(p) => (0, lens.iter().map(|l| l.div_ceil(p)).max().unwrap().max(1)),
            };
            let num_blocks = page.map_or(lens.len(), |p| lens.iter().map(|l| l.div_ceil(p)).sum::<usize>() + 1);
            let rows_per_block = page.unwrap_or(slots_per_b);
            let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
            rng.shuffle(&mut ids);
            let mut table = vec![-1i32; lens.len() * max_blocks];
            if let Some(p) = page {
                let mut next = ids.into_iter();
                for (b, &l) in lens.iter().enumerate() {
                    for q in 0..l.div_ceil(p) {
                        table[b * max_blocks + q] = next.next().unwrap();
                    }
                }
            }
            let slot = |b: usize, j: usize| match page {
                None => b * slots_per_b + j,
                Some(p) => table[b * max_blocks + j / p] as usize * p + j % p,
            };
            let slots = num_blocks * rows_per_block;
            let per_tensor = [0.02f32, 0.015];
            let (mut codes, mut scales) = ([vec![0x7Fu8; slots * row], vec![0x7Fu8; slots * row]], [vec![f32::NAN; slots * hkv], vec![f32::NAN; slots * hkv]]);
            // Per sequence, K's and V's dequantised rows [sk][hkv][d].
            let mut deq: Vec<[Vec<f32>; 2]> = Vec::new();
            for (b, &l) in lens.iter().enumerate() {
                let mut seq = [Vec::with_capacity(l * row), Vec::with_capacity(l * row)];
                for side in 0..2 {
                    let x = values(&mut rng, l * row, DType::BF16);
                    for j in 0..l {
                        for h in 0..hkv {
                            let (s, xr) = (slot(b, j) * hkv + h, &x[(j * hkv + h) * d..][..d]);
                            let scale = if per_token { block_scale(finite_amax(xr)) } else { per_tensor[side] };
                            scales[side][s] = scale;
                            encode_e4m3(xr, scale, &mut codes[side][s * d..][..d]);
                            seq[side].extend(codes[side][s * d..][..d].iter().map(|&c| e4m3_to_f32(c) * scale));
                        }
                    }
                }
                deq.push(seq);
            }
            let seqlens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let cache = Fp8KvCache {
                k: &codes[0],
                v: &codes[1],
                shape: [num_blocks, rows_per_block, hkv, d],
                scales: if per_token {
                    KvScales::PerTokenHead { k: &scales[0], v: &scales[1] }
                } else {
                    KvScales::PerTensor { k: per_tensor[0], v: per_tensor[1] }
                },
                seqlens: &seqlens,
                block_table: page.map(|_| BlockTable { ids: &table, max_blocks_per_seq: max_blocks }),
            };
            for (dtype, sq) in [(DType::BF16, 1usize), (DType::F16, 3)] {
                let q = values(&mut rng, lens.len() * sq * hq * d, dtype);
                let opts = ForwardOptions::default().mask(Mask::Causal).return_lse(true).variant(variant).backend(Backend::Cuda(0));
                let qt = Tensor::from_f32(&q, dtype, [lens.len(), sq, hq, d]).unwrap();
                let out = forward_kvcache(&qt, &cache, &opts).unwrap();
                let want = if variant == Variant::Fa3 { "fa3" } else { "fa2" };
                assert!(out.dispatch.kernel.starts_with(want), "{variant:?}: {:?}", out.dispatch);
                let (o, lse) = (out.o.to_f32_vec(), out.lse.unwrap());
                for (b, &l) in lens.iter().enumerate() {
                    let lse_at = |h: usize, i: usize| lse[(b * hq + h) * sq + i];
                    let r = |x: &[f32]| x[b * sq * hq * d..(b + 1) * sq * hq * d].to_vec();
                    let what = format!("{variant:?} {dtype:?} page {page:?} per_token {per_token} seq {b}");
                    check_seq(dtype, (sq, l, hq, hkv, d), &r(&q), &deq[b][0], &deq[b][1], &opts, &r(&o), &lse_at, &what);
                }
            }
        }
    }
}

/// The append with a rotary through `cache_batch_idx` and `cache_leftpad` (FlashAttention's
/// `flash_attn_with_kvcache(rotary_cos=, rotary_sin=, cache_batch_idx=, cache_leftpad=)`) under
/// `Backend::Cuda` (the append kernel rotates k_new into the cache and q into scratch, then FA2
/// reads them): the cache the GPU leaves equals the CPU path's slot for slot (within one ulp:
/// both round an f32 rotation; NaN slack untouched), and each sequence's output meets the rule
/// against float64 over its keys and q rotated at the CPU's positions.
#[test]
#[ignore = "needs a CUDA GPU"]
fn kvcache_append_rotary_on_gpu() {
    append_rotary(Variant::Auto);
}

/// As `kvcache_append_rotary_on_gpu`, with FA3's stage 5 reading the cache (`Variant::Fa3`) on
/// Hopper; elsewhere `Variant::Fa3` is refused with a typed error. Run after the FA3 ladder.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fa3_serving_append_rotary() {
    if fa3_refused_here() {
        return;
    }
    append_rotary(Variant::Fa3);
}

fn append_rotary(variant: Variant) {
    for (dtype, interleaved) in [(DType::BF16, true), (DType::F16, false)] {
        match dtype {
            DType::BF16 => append_rotary_case::<half::bf16>(variant, interleaved),
            _ => append_rotary_case::<half::f16>(variant, interleaved),
        }
    }
}

/// One case of `kvcache_append_rotary_on_gpu`: 3 sequences in cache rows 4, 0, 2 of a 5-row pool
/// of capacity 48, leftpads 0, 5, 2 under 9, 20, 14 cached keys, 3 rows appended, causal.
fn append_rotary_case<T: Element>(variant: Variant, interleaved: bool) {
    let dtype = T::DTYPE;
    let (hq, hkv, d, rd) = (8, 2, 128, 64);
    let (cached, pads, rows, new) = ([9usize, 20, 14], [0usize, 5, 2], [4usize, 0, 2], 3);
    let (pool, cap) = (5, 48);
    let row = hkv * d;
    let mut rng = Rng::new(25);
    let shape = [pool, cap, hkv, d];
    let n = pool * cap * row;
    let (mut kc, mut vc) = (vec![f32::NAN; n], vec![f32::NAN; n]);
    for b in 0..3 {
        for pos in pads[b]..cached[b] {
            let at = (rows[b] * cap + pos) * row;
            kc[at..at + row].copy_from_slice(&values(&mut rng, row, dtype));
            vc[at..at + row].copy_from_slice(&values(&mut rng, row, dtype));
        }
    }
    let (knew, vnew) = (values(&mut rng, 3 * new * row, dtype), values(&mut rng, 3 * new * row, dtype));
    let qv = values(&mut rng, 3 * new * hq * d, dtype);
    let angle = |x: usize| (x / (rd / 2)) as f64 * 10000f64.powf(-2.0 * (x % (rd / 2)) as f64 / rd as f64);
    let cos: Vec<f32> = (0..cap * rd / 2).map(|x| angle(x).cos() as f32).collect();
    let sin: Vec<f32> = (0..cap * rd / 2).map(|x| angle(x).sin() as f32).collect();
    let rot = Rotary::new(&cos, &sin, rd, interleaved);
    let seqlens: Vec<i32> = cached.iter().map(|&c| c as i32).collect();
    let (idx, pad): (Vec<i32>, Vec<i32>) = (rows.iter().map(|&r| r as i32).collect(), pads.iter().map(|&p| p as i32).collect());
    let q = Tensor::from_f32(&qv, dtype, [3, new, hq, d]).unwrap();
    let kn = Tensor::from_f32(&knew, dtype, [3, new, hkv, d]).unwrap();
    let vn = Tensor::from_f32(&vnew, dtype, [3, new, hkv, d]).unwrap();
    let run = |backend: Backend| -> (Output, Vec<f32>, Vec<f32>) {
        let (mut k, mut v): (Vec<T>, Vec<T>) = (kc.iter().map(|&x| T::from_f32(x)).collect(), vc.iter().map(|&x| T::from_f32(x)).collect());
        let mut cache = KvCacheMut { k: &mut k, v: &mut v, shape, seqlens: &seqlens, block_table: None, batch_idx: Some(&idx), leftpad: Some(&pad) };
        let opts = ForwardOptions::default().mask(Mask::Causal).return_lse(true).variant(variant).backend(backend);
        let out = forward_kvcache_append_rotary(&q, &mut cache, &kn, &vn, &rot, &opts).unwrap_or_else(|e| panic!("{backend:?}: {e}"));
        (out, k.iter().map(|x| x.to_f32()).collect(), v.iter().map(|x| x.to_f32()).collect())
    };
    let (_, k_cpu, v_cpu) = run(Backend::Cpu);
    let (out, k_gpu, v_gpu) = run(Backend::Cuda(0));
    let what = format!("{variant:?} {dtype:?} interleaved {interleaved}");
    let want = if variant == Variant::Fa3 { "fa3" } else { "fa2" };
    assert!(out.dispatch.kernel.starts_with(want), "{what}: {:?}", out.dispatch);
    let ulp = if dtype == DType::BF16 { 2f32.powi(-7) } else { 2f32.powi(-10) };
    for (name, got, cpu) in [("k", &k_gpu, &k_cpu), ("v", &v_gpu, &v_cpu)] {
        for (at, (&g, &w)) in got.iter().zip(cpu).enumerate() {
            let same = g == w || (g.is_nan() && w.is_nan()) || (g - w).abs() <= ulp * g.abs().max(w.abs());
            assert!(same, "{what}: cache {name}[{at}] is {g} on the GPU, {w} on the CPU");
        }
    }
    // Per sequence: q rotated at cached[b] + i (causal: q's rows advance), keys pads[b].. of the
    // CPU's cache (the appended ones rotated by the CPU path, the specification).
    let (o, lse) = (out.o.to_f32_vec(), out.lse.unwrap());
    let half = rd / 2;
    for b in 0..3 {
        let sk = cached[b] + new - pads[b];
        let mut qb = Vec::with_capacity(new * hq * d);
        for i in 0..new {
            let pos = cached[b] + i;
            for h in 0..hq {
                let at = ((b * new + i) * hq + h) * d;
                let x: Vec<f64> = qv[at..at + d].iter().map(|&x| x as f64).collect();
                let r = rotary_f64(&x, &cos[pos * half..][..half], &sin[pos * half..][..half], interleaved);
                qb.extend(r.iter().map(|&y| dtype.round(y as f32)));
            }
        }
        let keys = |c: &[f32]| -> Vec<f32> { (pads[b]..cached[b] + new).flat_map(|pos| c[(rows[b] * cap + pos) * row..][..row].to_vec()).collect() };
        let lse_at = |h: usize, i: usize| lse[(b * hq + h) * new + i];
        let rows_of = |x: &[f32]| x[b * new * hq * d..(b + 1) * new * hq * d].to_vec();
        let opts = ForwardOptions::default().mask(Mask::Causal);
        check_seq(dtype, (new, sk, hq, hkv, d), &qb, &keys(&k_cpu), &keys(&v_cpu), &opts, &rows_of(&o), &lse_at, &format!("{what} seq {b}"));
    }
}

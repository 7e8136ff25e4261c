//! The FP8 (e4m3) KV cache in the GPU kernels (docs/serving.md "FP8 KV cache"), run in the CPU
//! emulator exactly as `Engine::launch_serving_fp8_raw` would launch them: FA2 and FA3 reading dense and
//! paged e4m3 caches with per-tensor and per-(token, head) scales, split-KV included, and the
//! append kernel quantising k_new / v_new into the cache.
//!
//! The append's codes and scales are compared bit for bit with the CPU append's
//! (`serving::append_kv` on an `Fp8KvCacheMut`; NaN codes by NaN-ness, as docs/fp8.md says of
//! the codecs). The attention is compared per sequence with the float64 reference over the
//! dequantised cache (`e4m3(code) · scale`, exact in f32), with the house rule (`max|O - ref| <=
//! 2·max|naive - ref| + floor`, LSE within 2e-3; the naive attention rounds K and V to the
//! dtype, as the kernel's dequantised tiles are). Unused slots hold NaN codes and NaN scales, so
//! a kernel that read one would produce NaN. FA3 stages 3-5 read the cache too (every tile
//! gathered by the producer, the scales through its scale slots).
//!
//! `cargo test --release --test emulator fp8_kv_cache::` runs the CI subset; `FLASH_ATTN_EMU=full`
//! adds a seeded random matrix.

use super::serving_fa2::{bits, contiguous, f32s, from_bits, merge_splits};
use crate::support::emu::addr::{K, KNEW, K_SCALE, LSE, LSE_ACC, O, O_ACC, Q, SEQUSED, TABLE, V, VNEW, V_SCALE};
use crate::support::emu::{check_sequence, run_launch, unit_exe, LaunchBuf, Mutation};
use crate::support::serving::{values, Rng};
use flash_attn::cuda::plan::{plan_append, plan_serving, Fp8CacheScales, Operands, ServingOperands};
use flash_attn::cuda::table::FAMILIES;
use flash_attn::numerics::fp8::e4m3_to_f32;
use flash_attn::numerics::quant::{block_scale, encode_e4m3, finite_amax};
use flash_attn::serving::layout::{BatchLayout, KvLayout, QueryLayout};
use flash_attn::serving::{append_kv, BlockTable, Fp8KvCacheMut, KvScalesMut};
use flash_attn::{DType, ForwardOptions, Mask, Problem, Tensor};
use std::path::Path;

fn full() -> bool {
    std::env::var("FLASH_ATTN_EMU").is_ok_and(|v| v == "full")
}

/// The scales of a case's FP8 cache.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Scales {
    /// One per tensor: k's, v's.
    PerTensor(f32, f32),
    /// One per (slot, kv head), set as the CPU append sets them.
    PerToken,
}

/// One emulated FP8-cache launch: a dense q of `sq` rows per sequence over a dense cache
/// (`page` None: capacity = longest + 3) or a paged one (shuffled blocks, two spare), sequence
/// lengths `lens` counting the `new` rows the append writes first.
#[derive(Clone, Debug)]
struct Case {
    /// The kernel row: "fa2", or an FA3 stage "fa3s3".."fa3s5".
    family: &'static str,
    dtype: DType,
    d: usize,
    /// V's head dim (d but in FA3's (192, 128) instance).
    dv: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    lens: Vec<usize>,
    page: Option<usize>,
    scales: Scales,
    mask: Mask,
    splits: usize,
    new: usize,
    seed: u64,
}

impl Case {
    fn name(&self) -> String {
        format!(
            "{} fp8-kv {:?} d{}/{} h{}/{} sq{} lens{:?} {} {:?} {:?} splits{} new{}",
            self.family,
            self.dtype,
            self.d,
            self.dv,
            self.hq,
            self.hkv,
            self.sq,
            self.lens,
            self.page.map_or("dense".to_string(), |p| format!("page{p}")),
            self.scales,
            self.mask,
            self.splits,
            self.new
        )
    }
}

fn base(dtype: DType, d: usize, hq: usize, hkv: usize, sq: usize, lens: &[usize], page: Option<usize>) -> Case {
    Case {
        family: "fa2",
        dtype,
        d,
        dv: d,
        hq,
        hkv,
        sq,
        lens: lens.to_vec(),
        page,
        scales: Scales::PerToken,
        mask: Mask::None,
        splits: 1,
        new: 0,
        seed: 11,
    }
}

/// An e4m3 NaN code (0x7F or 0xFF): the codecs agree on NaN-ness, not on the bits.
fn nan_code(c: u8) -> bool {
    c & 0x7F == 0x7F
}

/// The FP8 cache of a case: codes and scales (NaN where no key is), the block table, and per
/// sequence its keys' rows `[sk][hkv][d]` before quantisation (the append's input for the new
/// ones).
struct Store {
    shape: [usize; 4],
    k: Vec<u8>,
    v: Vec<u8>,
    k_scales: Vec<f32>,
    v_scales: Vec<f32>,
    table: Vec<i32>,
    max_blocks: usize,
    rows_k: Vec<Vec<f32>>,
    rows_v: Vec<Vec<f32>>,
}

impl Store {
    /// Where key `j` of sequence `b` lies: its (slot, kv head 0) index.
    fn slot(&self, c: &Case, b: usize, j: usize) -> usize {
        match c.page {
            None => b * self.shape[1] + j,
            Some(p) => self.table[b * self.max_blocks + j / p] as usize * p + j % p,
        }
    }
    /// The value every key row of sequence `b` stands for (`[sk][hkv][d]`, f32; d: the operand's
    /// head dim).
    fn dequantised(&self, c: &Case, b: usize, d: usize, codes: &[u8], scales: &[f32], per_tensor: f32) -> Vec<f32> {
        let hkv = c.hkv;
        let mut out = Vec::with_capacity(c.lens[b] * hkv * d);
        for j in 0..c.lens[b] {
            for h in 0..hkv {
                let s = self.slot(c, b, j) * hkv + h;
                let scale = if c.scales == Scales::PerToken { scales[s] } else { per_tensor };
                out.extend(codes[s * d..][..d].iter().map(|&x| e4m3_to_f32(x) * scale));
            }
        }
        out
    }
}

/// Rows of normal values with a magnitude per (row, head) between 1/8 and 8 (so per-token scales
/// differ), rounded to `dtype`.
fn rows(rng: &mut Rng, n_rows: usize, hkv: usize, d: usize, dtype: DType) -> Vec<f32> {
    let mut x = values(rng, n_rows * hkv * d, dtype);
    for r in x.chunks_mut(d) {
        let m = (2.0f64).powf(rng.uniform() * 6.0 - 3.0) as f32;
        r.iter_mut().for_each(|v| *v = dtype.round(*v * m));
    }
    x
}

fn build_store(c: &Case, rng: &mut Rng) -> Store {
    let (hkv, d, dv) = (c.hkv, c.d, c.dv);
    let batch = c.lens.len();
    let rows_k: Vec<Vec<f32>> = c.lens.iter().map(|&l| rows(rng, l, hkv, d, c.dtype)).collect();
    let rows_v: Vec<Vec<f32>> = c.lens.iter().map(|&l| rows(rng, l, hkv, dv, c.dtype)).collect();
    let (shape, table, max_blocks) = match c.page {
        None => ([batch, c.lens.iter().copied().max().unwrap_or(0) + 3, hkv, d], Vec::new(), 0),
        Some(p) => {
            let pages: Vec<usize> = c.lens.iter().map(|l| l.div_ceil(p)).collect();
            let num_blocks = pages.iter().sum::<usize>() + 2;
            let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
            rng.shuffle(&mut ids);
            let max_blocks = pages.iter().copied().max().unwrap_or(0).max(1);
            let mut table = vec![-1i32; batch * max_blocks];
            let mut next = ids.into_iter();
            for b in 0..batch {
                for q in 0..pages[b] {
                    table[b * max_blocks + q] = next.next().unwrap();
                }
            }
            ([num_blocks, p, hkv, d], table, max_blocks)
        }
    };
    let slots = shape[0] * shape[1] * hkv;
    let mut st = Store {
        shape,
        k: vec![0x7F; slots * d],
        v: vec![0x7F; slots * dv],
        k_scales: vec![f32::NAN; slots],
        v_scales: vec![f32::NAN; slots],
        table,
        max_blocks,
        rows_k,
        rows_v,
    };
    // The cached keys (all but each sequence's last `new`), quantised as the CPU append does.
    for b in 0..batch {
        for j in 0..c.lens[b] - c.new {
            for h in 0..hkv {
                let s = st.slot(c, b, j) * hkv + h;
                for (rows, codes, scales, side, d) in
                    [(&st.rows_k, &mut st.k, &mut st.k_scales, 0, d), (&st.rows_v, &mut st.v, &mut st.v_scales, 1, dv)]
                {
                    let row = &rows[b][(j * hkv + h) * d..][..d];
                    let scale = match c.scales {
                        Scales::PerTensor(k, v) => [k, v][side],
                        Scales::PerToken => {
                            scales[s] = block_scale(finite_amax(row));
                            scales[s]
                        }
                    };
                    encode_e4m3(row, scale, &mut codes[s * d..][..d]);
                }
            }
        }
    }
    st
}

fn run(c: &Case) -> Result<f64, String> {
    run_mutated(c, None)
}

/// Runs `c` in the emulator (on a mutated copy of the sources with `mutation`); returns the
/// worst err / bound over its sequences.
fn run_mutated(c: &Case, mutation: Option<&Mutation>) -> Result<f64, String> {
    let mut rng = Rng::new(c.seed | 1);
    let (hq, hkv, d, dv, dtype, batch) = (c.hq, c.hkv, c.d, c.dv, c.dtype, c.lens.len());
    let q_shape = [batch, c.sq, hq, d];
    let o_shape = [batch, c.sq, hq, dv];
    let qx = values(&mut rng, q_shape.iter().product(), dtype);
    let mut st = build_store(c, &mut rng);
    let seqlens: Vec<i32> = c.lens.iter().map(|&l| (l - c.new) as i32).collect();
    let table = st.table.clone();
    let kl = match c.page {
        None => KvLayout::Cache { seqlens: &seqlens, new: c.new },
        Some(_) => KvLayout::Paged { block_table: &table, max_blocks_per_seq: st.max_blocks, seqlens: &seqlens, new: c.new },
    };
    let layout = BatchLayout::new(QueryLayout::Dense, q_shape, kl, st.shape).map_err(|e| format!("layout: {e}"))?;
    let opts = ForwardOptions::default().mask(c.mask).return_lse(true);
    let p = layout.launch_problem_v(hq, hkv, (d, dv), dtype, &opts).map_err(|e| format!("problem: {e}"))?;
    let v_shape = [st.shape[0], st.shape[1], hkv, dv];
    let ops = Operands {
        ptrs: [Q, K, V, O],
        strides: [contiguous(q_shape), contiguous(st.shape), contiguous(v_shape), contiguous(o_shape)],
        lse: LSE,
        alibi: 0,
        sinks: 0,
    };
    let new_shape = [batch, c.new, hkv, d];
    let sops = ServingOperands {
        seqused_k: SEQUSED,
        block_table: TABLE,
        o_accum: O_ACC,
        lse_accum: LSE_ACC,
        knew: KNEW,
        vnew: VNEW,
        new_strides: [contiguous(new_shape); 2],
        kv_fp8: Some(Fp8CacheScales { k: K_SCALE, v: V_SCALE, per_token: c.scales == Scales::PerToken }),
        ..ServingOperands::default()
    };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(&c.name(), &mut h);
    std::hash::Hash::hash(&mutation.map(|m| m.name), &mut h);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("emu/fp8_kv_cache")
        .join(format!("{:016x}", std::hash::Hasher::finish(&h)));
    let fam = FAMILIES.iter().find(|f| f.name == c.family).unwrap();
    let scale_bytes = |s: &[f32]| s.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (k_tensor, v_tensor) = match c.scales {
        Scales::PerTensor(k, v) => (vec![k], vec![v]),
        Scales::PerToken => (Vec::new(), Vec::new()),
    };
    if c.new > 0 {
        append(c, &mut st, &layout, &p, &ops, &sops, &dir, &seqlens, mutation)?;
    }
    // Two SMs: FA3 stage 5's persistent CTAs each walk several tiles (the scale slots carry over).
    let pl = plan_serving(c.family, &p, &layout, &ops, &sops, c.splits, 2).map_err(|e| format!("plan: {e}"))?;
    let lse_rows = pl.params.lse_rows();
    let exe = unit_exe(fam, pl.tile, mutation)?;
    let (ks, vs) = match c.scales {
        Scales::PerTensor(..) => (&k_tensor, &v_tensor),
        Scales::PerToken => (&st.k_scales, &st.v_scales),
    };
    let mut bufs = vec![
        LaunchBuf::input("q", Q, bits(&qx, dtype)),
        LaunchBuf::input("k", K, st.k.clone()),
        LaunchBuf::input("v", V, st.v.clone()),
        LaunchBuf::input("k_scale", K_SCALE, scale_bytes(ks)),
        LaunchBuf::input("v_scale", V_SCALE, scale_bytes(vs)),
        LaunchBuf::output("o", O, o_shape.iter().product::<usize>() * 2),
        LaunchBuf::output("lse", LSE, lse_rows * 4),
        LaunchBuf::i32s("seqused_k", SEQUSED, &seqlens),
    ];
    if pl.params.block_table != 0 {
        bufs.push(LaunchBuf::i32s("block_table", TABLE, &st.table));
    }
    if pl.params.knew != 0 {
        // The attention does not read the new rows (the append wrote them into the cache).
        bufs.push(LaunchBuf::input("knew", KNEW, vec![0; 16]));
        bufs.push(LaunchBuf::input("vnew", VNEW, vec![0; 16]));
    }
    if c.splits > 1 {
        bufs.push(LaunchBuf::output("o_accum", O_ACC, c.splits * lse_rows * dv * 4));
        bufs.push(LaunchBuf::output("lse_accum", LSE_ACC, c.splits * lse_rows * 4));
    }
    let (log, outs) = run_launch(&exe, &dir, &pl, c.family, &[1, 2], &bufs)?;
    let (o, lse) = if c.splits > 1 {
        merge_splits(&outs, c.splits, lse_rows, o_shape, &pl.params, &p)?
    } else {
        (from_bits(&outs["o"], dtype), f32s(&outs["lse"]))
    };
    let (kt1, vt1) = match c.scales {
        Scales::PerTensor(k, v) => (k, v),
        Scales::PerToken => (0.0, 0.0),
    };
    let mut worst = 0.0f64;
    for b in 0..batch {
        let (sq, sk) = (c.sq, c.lens[b]);
        let name = || format!("sequence {b} (sq {sq}, sk {sk})");
        let (at, ot) = (b * sq * hq * d, b * sq * hq * dv);
        let (ob, qb) = (&o[ot..ot + sq * hq * dv], &qx[at..at + sq * hq * d]);
        if sk == 0 {
            if ob.iter().any(|&x| x != 0.0) {
                return Err(format!("{}: no keys but O != 0\n{log}", name()));
            }
            continue;
        }
        let kd = st.dequantised(c, b, d, &st.k, &st.k_scales, kt1);
        let vd = st.dequantised(c, b, dv, &st.v, &st.v_scales, vt1);
        let qt = Tensor::from_f32(qb, DType::F32, [1, sq, hq, d]).unwrap();
        let kt = Tensor::from_f32(&kd, DType::F32, [1, sk, hkv, d]).unwrap();
        let vt = Tensor::from_f32(&vd, DType::F32, [1, sk, hkv, dv]).unwrap();
        // The dequantised cache in f32 (the codes times their scales), the naive attention in q's dtype.
        let lse_at = |h: usize, i: usize| lse[(b * hq + h) * sq + i];
        let ratio = check_sequence((&qt.view(), &kt.view(), &vt.view()), &opts, dtype, ob, Some(&lse_at))
            .map_err(|e| format!("{}: {e}\n{log}", name()))?;
        worst = worst.max(ratio);
    }
    Ok(worst)
}

/// The append kernel on the store (the new rows' slots still NaN): checks its codes and scales
/// bit for bit against the CPU append's on the same cache, every other byte unchanged, and leaves
/// the kernel's cache in `st`.
#[allow(clippy::too_many_arguments)]
fn append(
    c: &Case,
    st: &mut Store,
    layout: &BatchLayout<'_>,
    p: &Problem,
    ops: &Operands,
    sops: &ServingOperands,
    dir: &Path,
    seqlens: &[i32],
    mutation: Option<&Mutation>,
) -> Result<(), String> {
    assert_eq!(c.d, c.dv, "{}: the append cases keep V's head dim Q/K's", c.name());
    let (hkv, d, dtype, batch) = (c.hkv, c.d, c.dtype, c.lens.len());
    let (mut knew, mut vnew) = (Vec::new(), Vec::new());
    for (b, &cached) in seqlens.iter().enumerate() {
        let at = cached as usize * hkv * d;
        knew.extend_from_slice(&st.rows_k[b][at..][..c.new * hkv * d]);
        vnew.extend_from_slice(&st.rows_v[b][at..][..c.new * hkv * d]);
    }
    // What the CPU append writes.
    let (want_k, want_v, want_ks, want_vs) = {
        let (mut k, mut v) = (st.k.clone(), st.v.clone());
        let (mut ks, mut vs) = (st.k_scales.clone(), st.v_scales.clone());
        let scales = match c.scales {
            Scales::PerTensor(k, v) => KvScalesMut::PerTensor { k, v },
            Scales::PerToken => KvScalesMut::PerTokenHead { k: &mut ks, v: &mut vs },
        };
        let table = (c.page.is_some()).then_some(BlockTable { ids: &st.table, max_blocks_per_seq: st.max_blocks });
        let mut cache = Fp8KvCacheMut { k: &mut k, v: &mut v, shape: st.shape, scales, seqlens, block_table: table };
        let nk = Tensor::from_f32(&knew, dtype, [batch, c.new, hkv, d]).unwrap();
        let nv = Tensor::from_f32(&vnew, dtype, [batch, c.new, hkv, d]).unwrap();
        append_kv(&mut cache, &nk, &nv).map_err(|e| format!("CPU append: {e}"))?;
        (k, v, ks, vs)
    };
    let pl = plan_append(p, layout, ops, sops).map_err(|e| format!("plan_append: {e}"))?;
    let fam = FAMILIES.iter().find(|f| f.name == "fa2").unwrap();
    let exe = unit_exe(fam, pl.tile, mutation)?;
    let scale_bytes = |s: &[f32]| s.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (ks, vs): (Vec<u8>, Vec<u8>) = match c.scales {
        Scales::PerTensor(k, v) => (scale_bytes(&[k]), scale_bytes(&[v])),
        Scales::PerToken => (scale_bytes(&st.k_scales), scale_bytes(&st.v_scales)),
    };
    let mut bufs = vec![
        LaunchBuf::inout("k", K, st.k.clone()),
        LaunchBuf::inout("v", V, st.v.clone()),
        LaunchBuf::inout("k_scale", K_SCALE, ks),
        LaunchBuf::inout("v_scale", V_SCALE, vs),
        LaunchBuf::input("knew", KNEW, bits(&knew, dtype)),
        LaunchBuf::input("vnew", VNEW, bits(&vnew, dtype)),
        LaunchBuf::i32s("seqused_k", SEQUSED, seqlens),
        LaunchBuf::input("q", Q, vec![0; 16]),
        LaunchBuf::input("o", O, vec![0; 16]),
        LaunchBuf::input("lse", LSE, vec![0; 16]),
    ];
    if pl.params.block_table != 0 {
        bufs.push(LaunchBuf::i32s("block_table", TABLE, &st.table));
    }
    let (log, outs) = run_launch(&exe, &dir.join("append"), &pl, "fa2", &[1, 2], &bufs)?;
    for (name, got, want) in [("k", &outs["k"], &want_k), ("v", &outs["v"], &want_v)] {
        let same = |(a, b): (&u8, &u8)| a == b || (nan_code(*a) && nan_code(*b));
        if let Some(at) = got.iter().zip(want.iter()).position(|x| !same(x)) {
            return Err(format!(
                "append: code {at} of {name} is {:#04x}, the CPU append wrote {:#04x}\n{log}",
                got[at], want[at]
            ));
        }
    }
    if c.scales == Scales::PerToken {
        for (name, got, want) in [("k", f32s(&outs["k_scale"]), &want_ks), ("v", f32s(&outs["v_scale"]), &want_vs)] {
            let same = |(a, b): (&f32, &f32)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
            if let Some(at) = got.iter().zip(want.iter()).position(|x| !same(x)) {
                return Err(format!("append: scale {at} of {name} is {:e}, the CPU append set {:e}\n{log}", got[at], want[at]));
            }
        }
    }
    (st.k, st.v) = (outs["k"].clone(), outs["v"].clone());
    if c.scales == Scales::PerToken {
        (st.k_scales, st.v_scales) = (f32s(&outs["k_scale"]), f32s(&outs["v_scale"]));
    }
    Ok(())
}

fn check(cases: &[Case]) {
    crate::support::check_each("fp8 kv cases", cases, Case::name, |c| run(c).map(|r| format!("err/bound {r:.3}")));
}

const TENSOR: Scales = Scales::PerTensor(0.02, 0.015);

/// Dense and paged caches (page sizes 1, 3, 16, 256) with per-tensor and per-(token, head)
/// scales; decode (1 query row) and a few rows under a causal mask; GQA.
#[test]
fn fa2_reads_fp8_caches() {
    let lens = [33, 0, 300, 1];
    let mut cases = vec![
        Case { mask: Mask::Causal, ..base(DType::F16, 64, 8, 2, 1, &lens, Some(3)) },
        Case { scales: TENSOR, ..base(DType::BF16, 64, 4, 2, 4, &lens, Some(16)) },
        Case { mask: Mask::Causal, ..base(DType::BF16, 128, 2, 1, 3, &lens, None) },
        Case { scales: TENSOR, mask: Mask::window(40, 0), ..base(DType::F16, 128, 4, 4, 2, &lens, Some(256)) },
    ];
    if full() {
        let mut rng = Rng::new(crate::support::emu::matrix_seed("fp8 kv cache full matrix", 0xf8c4));
        for n in 0..16 {
            let batch = 1 + rng.below(4);
            let lens: Vec<usize> = (0..batch).map(|_| [0, 1, 2 + rng.below(60), 100 + rng.below(300)][rng.below(4)]).collect();
            let page = [None, Some(1), Some(3), Some(16), Some(256), Some(1 + rng.below(40))][rng.below(6)];
            let d = [64, 128][rng.below(2)];
            let hkv = 1 + rng.below(2);
            let scales = if rng.below(2) == 0 { TENSOR } else { Scales::PerToken };
            let mask = [Mask::None, Mask::Causal, Mask::window(rng.below(50) as i64, rng.below(4) as i64)][rng.below(3)];
            cases.push(Case {
                scales,
                mask,
                splits: [1, 1, 2, 3][rng.below(4)],
                seed: n,
                ..base([DType::F16, DType::BF16][rng.below(2)], d, hkv * [1, 2, 4][rng.below(3)], hkv, 1 + rng.below(4), &lens, page)
            });
        }
    }
    check(&cases);
}

/// Split-KV over an FP8 cache: each split's partial state, merged on the host, equals the
/// reference (the combine kernel is unchanged).
#[test]
fn fa2_fp8_split_kv() {
    let lens = [300, 0, 77, 1];
    check(&[
        Case { splits: 3, mask: Mask::Causal, ..base(DType::F16, 64, 8, 2, 1, &lens, Some(16)) },
        Case { splits: 4, scales: TENSOR, ..base(DType::BF16, 128, 4, 1, 2, &lens, None) },
    ]);
}

/// The append quantises k_new / v_new into the cache bit for bit as the CPU append (codes and
/// per-(token, head) scales; a new row may open a new page), then the attention reads them.
#[test]
fn fp8_append_matches_the_cpu() {
    let lens = [35, 2, 130, 4];
    let mut cases = vec![
        Case { new: 2, mask: Mask::Causal, ..base(DType::F16, 64, 8, 2, 2, &lens, Some(3)) },
        Case { new: 1, scales: TENSOR, ..base(DType::BF16, 64, 4, 2, 1, &lens, Some(16)) },
        Case { new: 1, splits: 2, ..base(DType::BF16, 128, 4, 2, 1, &lens, None) },
    ];
    if full() {
        let lens = [35, 4, 130, 5];
        cases.push(Case { new: 3, mask: Mask::Causal, scales: TENSOR, ..base(DType::F16, 128, 4, 1, 3, &lens, Some(1)) });
        cases.push(Case { new: 4, ..base(DType::F16, 96, 2, 1, 4, &lens, Some(256)) });
        cases.push(Case { new: 2, ..base(DType::BF16, 256, 2, 2, 2, &lens, None) });
    }
    check(&cases);
}

/// The tests catch the mistakes they exist for: a K scale read for the wrong kv head, and an
/// append that picks a row's scale from twice its amax.
#[test]
fn fp8_kv_mutations_are_caught() {
    let lens = [33, 0, 300, 1];
    let muts = [
        (
            Mutation {
                name: "fp8_scale_of_head_0",
                file: "cuda/fa2_fwd.cu",
                from: "gscale[fa_kv_scale_index(p, seq, j, hk)]",
                to: "gscale[fa_kv_scale_index(p, seq, j, 0)]",
                defines: &[],
            },
            Case { mask: Mask::Causal, ..base(DType::F16, 64, 8, 2, 1, &lens, Some(16)) },
            "max |O - ref|",
        ),
        (
            Mutation {
                name: "fp8_append_scale_doubled",
                file: "cuda/common/fp8_kv.cuh",
                from: "scale = fa_block_scale(amax);",
                to: "scale = fa_block_scale(2.f * amax);",
                defines: &[],
            },
            Case { new: 1, ..base(DType::F16, 64, 4, 2, 1, &[35, 2, 130, 4], Some(16)) },
            "the CPU append",
        ),
    ];
    for (m, c, expect) in &muts {
        assert!(run(c).is_ok(), "{}: the unmutated case must pass", m.name);
        match run_mutated(c, Some(m)) {
            Ok(r) => panic!("mutation {} was not caught (err/bound {r:.3})", m.name),
            Err(e) => assert!(e.contains(expect), "mutation {}: unexpected failure {e}", m.name),
        }
    }
}

/// FA3 stages 3-5 read FP8 caches: the producer gathers every tile, converting the codes, and
/// writes each tile's scales into its scale slot; the consumers apply them to S and P. Dense and
/// paged caches, both scale kinds, GQA, masks, an append before the attention, query tiles of
/// several K/V tiles, stage 5's persistent CTAs walking many tiles (the scale slots carry over)
/// and its (192, 128) instance.
#[test]
fn fa3_reads_fp8_caches() {
    let lens = [33, 0, 300, 1];
    let mut cases = vec![
        Case { family: "fa3s5", mask: Mask::Causal, ..base(DType::BF16, 64, 8, 2, 1, &lens, Some(16)) },
        Case { family: "fa3s3", scales: TENSOR, ..base(DType::F16, 128, 4, 2, 3, &lens, Some(3)) },
        Case { family: "fa3s4", mask: Mask::Causal, ..base(DType::BF16, 64, 2, 1, 150, &[300, 140], None) },
        Case { family: "fa3s5", dv: 128, ..base(DType::BF16, 192, 4, 2, 2, &lens, Some(256)) },
        Case { family: "fa3s5", new: 2, ..base(DType::F16, 128, 4, 2, 2, &[35, 2, 270, 4], Some(7)) },
    ];
    if full() {
        let mut rng = Rng::new(crate::support::emu::matrix_seed("fa3 fp8 kv cache full matrix", 0xf8c3));
        for n in 0..12 {
            let batch = 1 + rng.below(3);
            let lens: Vec<usize> = (0..batch).map(|_| [0, 1, 2 + rng.below(60), 100 + rng.below(300)][rng.below(4)]).collect();
            let page = [None, Some(1), Some(3), Some(16), Some(128), Some(1 + rng.below(40))][rng.below(6)];
            let (d, dv) = [(64, 64), (128, 128), (192, 128)][rng.below(3)];
            let family = if d == 192 { "fa3s5" } else { ["fa3s3", "fa3s4", "fa3s5"][rng.below(3)] };
            let hkv = 1 + rng.below(2);
            let scales = if rng.below(2) == 0 { TENSOR } else { Scales::PerToken };
            let mask = [Mask::None, Mask::Causal, Mask::window(rng.below(50) as i64, rng.below(4) as i64)][rng.below(3)];
            let sq = [1, 1 + rng.below(4), 100 + rng.below(60)][rng.below(3)];
            let new = if d == dv && rng.below(3) == 0 { 1 + rng.below(2) } else { 0 };
            let lens: Vec<usize> = lens.into_iter().map(|l| l + new).collect();
            cases.push(Case {
                family,
                dv,
                scales,
                mask,
                new,
                seed: n,
                ..base([DType::F16, DType::BF16][rng.below(2)], d, hkv * [1, 2, 4][rng.below(3)], hkv, sq, &lens, page)
            });
        }
    }
    check(&cases);
}

/// The FA3 tests catch the mistakes they exist for: P scaled by K's scales instead of V's, and a
/// scale ring as deep as the K/V ring, whose slot the producer rewrites while a consumer still
/// reads it (after it released the K slot): the emulator's happens-before check of the scales'
/// shared-memory loads names it, whatever the schedule.
#[test]
fn fa3_fp8_mutations_are_caught() {
    let many_tiles = Case { family: "fa3s4", mask: Mask::Causal, ..base(DType::BF16, 64, 2, 1, 150, &[300, 140], None) };
    let muts = [
        (
            Mutation {
                name: "fa3_fp8_p_scaled_by_k",
                file: "cuda/fa3/mainloop.cuh",
                from: "reinterpret_cast<const unsigned char*>(kv_scales + Tr::kBlockN)",
                to: "reinterpret_cast<const unsigned char*>(kv_scales)",
                defines: &[],
            },
            Case { family: "fa3s5", ..base(DType::F16, 64, 4, 2, 1, &[33, 0, 300, 1], Some(16)) },
            "max |O - ref|",
        ),
        (
            Mutation {
                name: "fa3_fp8_scale_ring_too_shallow",
                file: "cuda/fa3/preamble.cuh",
                from: "(it % Tr::kScaleSlots)",
                to: "(it % Tr::kKvStages)",
                defines: &[],
            },
            many_tiles,
            "happens-before",
        ),
    ];
    for (m, c, expect) in &muts {
        assert!(run(c).is_ok(), "{}: the unmutated case must pass", m.name);
        match run_mutated(c, Some(m)) {
            Ok(r) => panic!("mutation {} was not caught (err/bound {r:.3})", m.name),
            Err(e) => {
                assert!(e.contains(expect), "mutation {}: unexpected failure {e}", m.name);
                let why = e.lines().find(|l| l.contains(expect)).unwrap_or("");
                println!("caught {}: {why}", m.name);
            }
        }
    }
}

/// FA3's plan of an FP8 cache says the tiles are gathered, and its K/V tensor maps describe the
/// codes as bytes; FA1 refuses the cache with a typed reason.
#[test]
fn fa3_plans_gather_the_fp8_cache() {
    let seqlens = [5i32, 9];
    let kl = KvLayout::Cache { seqlens: &seqlens, new: 0 };
    let layout = BatchLayout::new(QueryLayout::Dense, [2, 1, 4, 128], kl, [2, 16, 2, 128]).unwrap();
    let p = layout.launch_problem(4, 2, 128, DType::BF16, &ForwardOptions::default()).unwrap();
    let ops = Operands {
        ptrs: [Q, K, V, O],
        strides: [contiguous([2, 1, 4, 128]), contiguous([2, 16, 2, 128]), contiguous([2, 16, 2, 128]), contiguous([2, 1, 4, 128])],
        lse: 0,
        alibi: 0,
        sinks: 0,
    };
    let sops = ServingOperands {
        seqused_k: SEQUSED,
        kv_fp8: Some(Fp8CacheScales { k: K_SCALE, v: V_SCALE, per_token: true }),
        ..ServingOperands::default()
    };
    for family in ["fa3s3", "fa3s4", "fa3s5", "fa2"] {
        let pl = plan_serving(family, &p, &layout, &ops, &sops, 1, 132).unwrap();
        assert_eq!(pl.params.flags & 48, 48, "FA_FLAG_KV_FP8 | FA_FLAG_KV_SCALE_PER_TOKEN");
        assert_eq!((pl.params.k_cache_scale, pl.params.v_cache_scale), (K_SCALE, V_SCALE));
        if family != "fa2" {
            assert!(pl.note.unwrap_or("").contains("FP8 cache's codes"), "{family}: {:?}", pl.note);
            let bytes: Vec<u64> = pl.tensor_maps.iter().map(|m| m.spec.strides[0]).collect();
            assert_eq!(bytes, [256, 128, 128], "{family}: q's head stride in 16-bit elements, the codes' in bytes");
        }
    }
    let e = plan_serving("fa1", &p, &layout, &ops, &sops, 1, 132).unwrap_err();
    assert!(e.to_string().contains("FP8"), "{e}");
}

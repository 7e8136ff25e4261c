//! Attention over one long sequence whose K/V are sharded in N parts: run the forward on each
//! shard with its LSE, merge the N states with `merge_states_n`, and compare with the one-shot
//! forward. This is the building block of context-parallel (ring) attention across devices and of
//! cascade attention (shared prefix + per-request suffix).
//!
//! ```text
//! cargo run --release --example sharded_attention -- [--shards N] [--seqlen-k SK] [--seqlen-q SQ] [--causal] [--dtype f32|bf16]
//! ```
//!
//! Causal masks need care: a shard holding keys `[s, e)` of `sk` sees query `i` (at global key
//! position `i + sk - sq`, bottom-right alignment) up to local key `i + sk - sq - s`, which is the
//! shard's own bottom-right diagonal shifted right by `sk - e`: `Mask::window(-1, sk - e)`. Rows
//! that see no key of a shard get LSE −inf there and weigh nothing in the merge. (ALiBi and
//! sliding windows would need the same shift of their offsets; this example does not shard
//! them.)
//!
//! Runs on the CPU here. Across GPUs the same merge combines states gathered with NCCL; that
//! version needs more than one GPU and is described in docs/serving.md, not shipped.

use flash_attn::numerics::rng::SplitMix64;
use flash_attn::serving::merge_states_n;
use flash_attn::{forward, DType, ForwardOptions, Mask, Result, Tensor, TensorView};

/// One run of the check: the largest differences between the merged and the one-shot result.
#[derive(Clone, Copy, Debug)]
pub struct Sharded {
    pub max_o_diff: f64,
    pub max_lse_diff: f64,
    /// Max |one-shot − merged| relative to max |one-shot| (the output's scale).
    pub rel_o_diff: f64,
}

/// Shard boundaries: `n` contiguous, unequal parts of `0..sk` (the first part is the smallest).
pub fn boundaries(sk: usize, n: usize) -> Vec<usize> {
    let weights: Vec<usize> = (1..=n).collect();
    let total: usize = weights.iter().sum();
    let mut b = vec![0];
    let mut acc = 0;
    for w in &weights {
        acc += w;
        b.push(sk * acc / total);
    }
    b
}

/// The mask of a shard `[s, e)` of `sk` keys that reproduces `mask` of the whole sequence.
pub fn shard_mask(mask: Mask, sk: usize, e: usize) -> Mask {
    match mask {
        Mask::Causal => Mask::window(-1, (sk - e) as i64),
        other => other,
    }
}

/// Elements `a..b` of `t` as a contiguous view of `shape` (a shard, no copy).
fn rows_of(t: &Tensor, a: usize, b: usize, shape: [usize; 4]) -> TensorView<'_> {
    match t.data() {
        flash_attn::OwnedData::F32(x) => TensorView::new(&x[a..b], shape),
        flash_attn::OwnedData::F16(x) => TensorView::new(&x[a..b], shape),
        flash_attn::OwnedData::BF16(x) => TensorView::new(&x[a..b], shape),
    }
}

/// Runs the sharded forward and the one-shot forward on seeded inputs and compares them.
pub fn check(shards: usize, sq: usize, sk: usize, causal: bool, dtype: DType) -> Result<Sharded> {
    let (hq, hkv, d) = (8, 2, 128);
    let mut rng = SplitMix64::new(0x9E37_79B9_7F4A_7C15);
    let mut make = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal() as f32).collect() };
    let q = Tensor::from_f32(&make(sq * hq * d), dtype, [1, sq, hq, d])?;
    let k = Tensor::from_f32(&make(sk * hkv * d), dtype, [1, sk, hkv, d])?;
    let v = Tensor::from_f32(&make(sk * hkv * d), dtype, [1, sk, hkv, d])?;
    let mask = if causal { Mask::Causal } else { Mask::None };
    let opts = ForwardOptions::default().mask(mask).return_lse(true);
    let whole = forward(&q, &k, &v, &opts)?;

    // Each shard is a view into the same K/V buffers (no copy).
    let row = hkv * d;
    let bounds = boundaries(sk, shards);
    let mut outs = Vec::with_capacity(shards);
    for w in bounds.windows(2) {
        let (s, e) = (w[0], w[1]);
        let (ks, vs) = (
            rows_of(&k, s * row, e * row, [1, e - s, hkv, d]),
            rows_of(&v, s * row, e * row, [1, e - s, hkv, d]),
        );
        let shard_opts = opts.clone().mask(shard_mask(mask, sk, e));
        outs.push(forward(&q, &ks, &vs, &shard_opts)?);
    }
    let states: Vec<(TensorView<'_>, &[f32])> = outs
        .iter()
        .map(|o| (o.o.view(), o.lse.as_deref().unwrap_or(&[])))
        .collect();
    let merged = merge_states_n(&states)?;

    let (a, b) = (whole.o.to_f32_vec(), merged.o.to_f32_vec());
    let max_o_diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max);
    let scale = a.iter().map(|x| x.abs() as f64).fold(0.0, f64::max).max(1e-30);
    let la = whole.lse.unwrap_or_default();
    let max_lse_diff = la
        .iter()
        .zip(&merged.lse)
        .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() as f64 })
        .fold(0.0, f64::max);
    Ok(Sharded {
        max_o_diff,
        max_lse_diff,
        rel_o_diff: max_o_diff / scale,
    })
}

#[allow(dead_code)] // the test includes this file for `check`
fn main() -> Result<()> {
    let mut shards = 4;
    let (mut sq, mut sk, mut causal, mut dtype) = (64, 8192, false, DType::F32);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = || args.next().and_then(|x| x.parse::<usize>().ok()).unwrap_or(0);
        match a.as_str() {
            "--shards" => shards = num().max(1),
            "--seqlen-q" => sq = num().max(1),
            "--seqlen-k" => sk = num().max(1),
            "--causal" => causal = true,
            "--dtype" => {
                dtype = match args.next().as_deref() {
                    Some("bf16") => DType::BF16,
                    Some("f16") => DType::F16,
                    _ => DType::F32,
                }
            }
            other => {
                eprintln!("unknown argument {other}");
                std::process::exit(2);
            }
        }
    }
    let shards = shards.min(sk);
    let r = check(shards, sq, sk, causal, dtype)?;
    println!(
        "{shards} shards of {sk} keys (sizes {:?}), {sq} queries, causal {causal}, {dtype:?}: \
         max |one-shot - merged| = {:.2e} ({:.2e} of max |o|), max LSE diff = {:.2e}",
        boundaries(sk, shards)
            .windows(2)
            .map(|w| w[1] - w[0])
            .collect::<Vec<_>>(),
        r.max_o_diff,
        r.rel_o_diff,
        r.max_lse_diff
    );
    Ok(())
}

//! An engine's attention call written the way mistral.rs's flash-attention backend makes it:
//! packed activations, cumulative sequence lengths as u32 tensors, a sliding window on the left,
//! causal on the right, a softcap (Gemma 2), through
//! `flash_attn_varlen_alibi_windowed_softcap`. The switch from candle-flash-attn is the `use`
//! line below; this runs on the CPU, where candle-flash-attn has no backend.
//!
//! A prefill of three prompts of different lengths, then one decode step per sequence, each
//! checked against candle's own attention on every sequence alone.
//!
//! `cargo run --release --example mistralrs_style` (in integrations/candle)

use candle_core::{DType, Device, Result, Tensor, D};
use flash_attn_candle as candle_flash_attn; // was: use candle_flash_attn;
use std::time::Instant;

/// What the engine's batch builder hands the attention layer for a packed batch.
struct FlashParams {
    max_q: u32,
    max_k: u32,
    cumulative_seqlens_q: Tensor,
    cumulative_seqlens_k: Tensor,
    causal: bool,
}

/// The model's attention settings.
struct SdpaParams {
    softmax_scale: f32,
    sliding_window: Option<usize>,
    softcap: Option<f32>,
}

/// The backend's entry point: q, k, v `[1, total, heads, head_dim]` (packed sequences).
fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, fp: &FlashParams, sdpa: &SdpaParams) -> Result<Tensor> {
    let shape = q.shape().clone();
    let (q, k, v) = (q.flatten_to(1)?, k.flatten_to(1)?, v.flatten_to(1)?);
    let window_right = if fp.causal { Some(0) } else { None };
    candle_flash_attn::flash_attn_varlen_alibi_windowed_softcap(
        &q,
        &k,
        &v,
        None,
        &fp.cumulative_seqlens_q,
        &fp.cumulative_seqlens_k,
        fp.max_q as usize,
        fp.max_k as usize,
        sdpa.softmax_scale,
        sdpa.sliding_window,
        window_right,
        sdpa.softcap.unwrap_or(0.0),
    )?
    .reshape(shape)
}

fn params(lens_q: &[usize], lens_k: &[usize], dev: &Device) -> Result<FlashParams> {
    let cum = |l: &[usize]| -> Result<Tensor> {
        let c: Vec<u32> = std::iter::once(0).chain(l.iter().scan(0u32, |a, &x| { *a += x as u32; Some(*a) })).collect();
        Tensor::new(c.as_slice(), dev)
    };
    Ok(FlashParams {
        max_q: *lens_q.iter().max().unwrap_or(&0) as u32,
        max_k: *lens_k.iter().max().unwrap_or(&0) as u32,
        cumulative_seqlens_q: cum(lens_q)?,
        cumulative_seqlens_k: cum(lens_k)?,
        causal: true,
    })
}

/// candle's attention on one sequence `[1, s, h, d]` (k/v heads repeated), the same window and
/// softcap, bottom-right aligned.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, sdpa: &SdpaParams) -> Result<Tensor> {
    let (q, k, v) = (q.transpose(1, 2)?.contiguous()?, k.transpose(1, 2)?.contiguous()?, v.transpose(1, 2)?.contiguous()?);
    let (hq, sq, hk, sk) = (q.dim(1)?, q.dim(2)?, k.dim(1)?, k.dim(2)?);
    let rep = |t: &Tensor| t.repeat_interleave(hq / hk, 1);
    let (k, v) = (rep(&k)?, rep(&v)?);
    let s = (q.matmul(&k.t()?.contiguous()?)? * sdpa.softmax_scale as f64)?;
    let s = match sdpa.softcap {
        Some(c) => ((s / c as f64)?.tanh()? * c as f64)?,
        None => s,
    };
    let left = sdpa.sliding_window.unwrap_or(usize::MAX);
    let mask: Vec<f32> = (0..sq)
        .flat_map(|i| (0..sk).map(move |j| {
            let pos = i + sk - sq;
            if j > pos || pos - j > left { f32::NEG_INFINITY } else { 0.0 }
        }))
        .collect();
    let s = s.broadcast_add(&Tensor::from_vec(mask, (1, 1, sq, sk), q.device())?)?;
    let p = s.broadcast_sub(&s.max_keepdim(D::Minus1)?)?.exp()?;
    let p = p.broadcast_div(&p.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?.transpose(1, 2)
}

trait RepeatInterleave {
    fn repeat_interleave(&self, n: usize, dim: usize) -> Result<Tensor>;
}
impl RepeatInterleave for Tensor {
    fn repeat_interleave(&self, n: usize, dim: usize) -> Result<Tensor> {
        let mut dims = self.dims().to_vec();
        let t = self.unsqueeze(dim + 1)?;
        let mut b = t.dims().to_vec();
        b[dim + 1] = n;
        dims[dim] *= n;
        t.broadcast_as(b)?.contiguous()?.reshape(dims)
    }
}

/// The largest difference between the packed result and the reference run per sequence.
fn check(o: &Tensor, q: &Tensor, k: &Tensor, v: &Tensor, lq: &[usize], lk: &[usize], sdpa: &SdpaParams) -> Result<f64> {
    let (mut q0, mut k0, mut worst) = (0, 0, 0f64);
    for (&nq, &nk) in lq.iter().zip(lk) {
        let want = reference(&q.narrow(1, q0, nq)?, &k.narrow(1, k0, nk)?, &v.narrow(1, k0, nk)?, sdpa)?;
        let d = (o.narrow(1, q0, nq)?.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?;
        worst = worst.max(d.to_scalar::<f32>()? as f64);
        (q0, k0) = (q0 + nq, k0 + nk);
    }
    Ok(worst)
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let (hq, hk, d) = (8, 2, 64);
    let sdpa = SdpaParams { softmax_scale: 1.0 / (d as f32).sqrt(), sliding_window: Some(32), softcap: Some(50.0) };
    let prompts = [23usize, 7, 96];
    let total: usize = prompts.iter().sum();

    // Prefill: the prompts packed, each attending causally within its window.
    let q = Tensor::randn(0f32, 1., (1, total, hq, d), &dev)?;
    let k = Tensor::randn(0f32, 1., (1, total, hk, d), &dev)?;
    let v = Tensor::randn(0f32, 1., (1, total, hk, d), &dev)?;
    let fp = params(&prompts, &prompts, &dev)?;
    let t = Instant::now();
    let o = flash_attn(&q, &k, &v, &fp, &sdpa)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let diff = check(&o, &q, &k, &v, &prompts, &prompts, &sdpa)?;
    println!("prefill {prompts:?} tokens, {hq} q heads on {hk} kv heads, d {d}, window 32, softcap 50: {ms:.2} ms, max |diff| vs candle {diff:.2e}");

    // Decode: one new query per sequence against its prompt plus the new key (the engine's
    // cache, gathered per sequence).
    let ones = [1usize; 3];
    let lens_k: Vec<usize> = prompts.iter().map(|p| p + 1).collect();
    let kt: usize = lens_k.iter().sum();
    let qd = Tensor::randn(0f32, 1., (1, 3, hq, d), &dev)?;
    let kd = Tensor::randn(0f32, 1., (1, kt, hk, d), &dev)?;
    let vd = Tensor::randn(0f32, 1., (1, kt, hk, d), &dev)?;
    let fp = params(&ones, &lens_k, &dev)?;
    for dt in [DType::F32, DType::BF16] {
        let (q, k, v) = (qd.to_dtype(dt)?, kd.to_dtype(dt)?, vd.to_dtype(dt)?);
        let t = Instant::now();
        let o = flash_attn(&q, &k, &v, &fp, &sdpa)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let diff = check(&o, &q.to_dtype(DType::F32)?, &k.to_dtype(DType::F32)?, &v.to_dtype(DType::F32)?, &ones, &lens_k, &sdpa)?;
        println!("decode {dt:?}, keys {lens_k:?}: {ms:.2} ms, max |diff| vs candle (f32 on the same inputs) {diff:.2e}");
    }
    Ok(())
}

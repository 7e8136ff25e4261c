//! flash_attn on candle tensors: candle's `[batch, heads, seqlen, head_dim]` activations are
//! transposed to FlashAttention's layout as views (no copy), run through `flash_attn` (the
//! drop-in for candle-flash-attn's), and compared with candle's own attention (matmul, softmax,
//! matmul).
//!
//! `cargo run --release --example candle_attention` (in integrations/candle)

use candle_core::{DType, Device, Tensor, D};
use flash_attn_candle::flash_attn;
use std::time::Instant;

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let (b, h, s, d) = (1, 8, 1024, 64);
    // Candle's usual layout, [b, h, s, d]; the op takes [b, s, h, d] views of it.
    let q = Tensor::randn(0f32, 1., (b, h, s, d), &dev)?;
    let k = Tensor::randn(0f32, 1., (b, h, s, d), &dev)?;
    let v = Tensor::randn(0f32, 1., (b, h, s, d), &dev)?;
    let t = Instant::now();
    let scale = 1.0 / (d as f64).sqrt();
    let ours = flash_attn(&q.transpose(1, 2)?, &k.transpose(1, 2)?, &v.transpose(1, 2)?, scale as f32, true)?;
    let ours_ms = t.elapsed().as_secs_f64() * 1e3;

    let t = Instant::now();
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let mask: Vec<u8> = (0..s).flat_map(|i| (0..s).map(move |j| u8::from(j > i))).collect();
    let mask = Tensor::from_vec(mask, (s, s), &dev)?.broadcast_as(scores.shape())?;
    let scores = mask.where_cond(&Tensor::new(f32::NEG_INFINITY, &dev)?.broadcast_as(scores.shape())?, &scores)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let p = scores.broadcast_sub(&max)?.exp()?;
    let p = p.broadcast_div(&p.sum_keepdim(D::Minus1)?)?;
    let candle = p.matmul(&v)?.transpose(1, 2)?;
    let candle_ms = t.elapsed().as_secs_f64() * 1e3;

    let diff = (ours - candle)?.abs()?.flatten_all()?.max(0)?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    println!("[b, s, h, d] = [{b}, {s}, {h}, {d}] causal: flash_attn {ours_ms:.1} ms, candle ops {candle_ms:.1} ms, max |diff| {diff:.2e}");
    Ok(())
}

//! Training through flash attention in candle: one causal attention layer (4 heads of 8) and an
//! output projection, fitted by plain SGD to a teacher of the same shape with other weights.
//! `loss.backward()` runs flash_attn's backward pass through the drop-in `flash_attn`; the loss
//! falls.
//!
//! `cargo run --release --example train_tiny` (in integrations/candle)

use candle_core::{DType, Device, Result, Tensor, Var};
use flash_attn_candle as fa;

const B: usize = 4;
const S: usize = 16;
const DM: usize = 32;
const H: usize = 4;
const D: usize = DM / H;

/// The layer: x `[b, s, dm]` → projections → causal attention → output projection.
fn layer(x: &Tensor, w: &[Tensor; 4]) -> Result<Tensor> {
    let x2 = x.reshape((B * S, DM))?;
    let heads = |wt: &Tensor| x2.matmul(wt)?.reshape((B, S, H, D));
    let o = fa::flash_attn(&heads(&w[0])?, &heads(&w[1])?, &heads(&w[2])?, 1.0 / (D as f32).sqrt(), true)?;
    o.reshape((B * S, DM))?.matmul(&w[3])?.reshape((B, S, DM))
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let init = |s: f64| Tensor::randn(0f32, s as f32, (DM, DM), &dev);
    let teacher = [init(0.4)?, init(0.4)?, init(0.4)?, init(0.4)?];
    let weights = [Var::from_tensor(&init(0.1)?)?, Var::from_tensor(&init(0.1)?)?, Var::from_tensor(&init(0.1)?)?, Var::from_tensor(&init(0.1)?)?];
    let x = Tensor::randn(0f32, 1., (B, S, DM), &dev)?;
    let y = layer(&x, &teacher)?;
    let lr = 0.5;
    let mut losses = Vec::new();
    for step in 0..40 {
        let w = weights.clone().map(|v| v.as_tensor().clone());
        let loss = (layer(&x, &w)? - &y)?.sqr()?.mean_all()?;
        let grads = loss.backward()?;
        for v in &weights {
            let g = grads.get(v).ok_or_else(|| candle_core::Error::Msg("a weight got no gradient".into()))?;
            v.set(&(v.as_tensor() - (g * lr)?)?)?;
        }
        let l = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        if step % 5 == 0 || step == 39 {
            println!("step {step:2}: loss {l:.5}");
        }
        losses.push(l);
    }
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    println!("loss {first:.5} -> {last:.5}");
    if last >= first {
        candle_core::bail!("the loss did not fall: {first} -> {last}");
    }
    Ok(())
}

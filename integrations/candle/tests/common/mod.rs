//! candle's own attention, written with candle ops (matmul, softcap, ALiBi bias, mask, softmax,
//! matmul) in the inputs' dtype, as the reference the integration's functions are checked
//! against; and the error measures of FlashAttention's tolerance rule.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, D};

/// Which keys a query row sees: `(left, right)` window bounds as candle-flash-attn takes them
/// (`None` unbounded, (`None`, `Some(0)`) causal), aligned bottom-right.
#[derive(Clone, Copy, Debug)]
pub struct Window(pub Option<usize>, pub Option<usize>);

impl Window {
    pub const NONE: Window = Window(None, None);
    pub const CAUSAL: Window = Window(None, Some(0));
    pub fn causal(c: bool) -> Window {
        if c { Self::CAUSAL } else { Self::NONE }
    }
    pub fn sees(&self, i: usize, j: usize, sq: usize, sk: usize) -> bool {
        let (i, j, off) = (i as i64, j as i64, sk as i64 - sq as i64);
        self.0.is_none_or(|l| j >= i + off - l as i64) && self.1.is_none_or(|r| j <= i + off + r as i64)
    }
}

/// What the reference applies beyond the scaled scores.
#[derive(Clone, Debug, Default)]
pub struct Extra {
    pub slopes: Option<Vec<f32>>,
    pub softcap: Option<f32>,
}

/// `softmax(mask(softcap(scale · Q·Kᵀ) + alibi)) · V` on `[b, s, h, d]` tensors in their own
/// dtype (k/v heads repeated for GQA); rows that see no key give 0. Returns `[b, sq, hq, d]`.
pub fn naive(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, w: Window, x: &Extra) -> Result<Tensor> {
    let dt = q.dtype();
    let (q, k, v) = (q.transpose(1, 2)?.contiguous()?, k.transpose(1, 2)?.contiguous()?, v.transpose(1, 2)?.contiguous()?);
    let (_, hq, sq, _) = q.dims4()?;
    let (_, hk, sk, _) = k.dims4()?;
    let rep = |t: &Tensor| -> Result<Tensor> {
        let (b, h, s, d) = t.dims4()?;
        t.unsqueeze(2)?.broadcast_as((b, h, hq / hk, s, d))?.reshape((b, hq, s, d))
    };
    let (k, v) = (rep(&k)?, rep(&v)?);
    let mut s = (q.matmul(&k.t()?.contiguous()?)? * scale as f64)?;
    if let Some(cap) = x.softcap {
        s = ((s / cap as f64)?.tanh()? * cap as f64)?;
    }
    let dev = q.device();
    if let Some(sl) = &x.slopes {
        let off = sk as f32 - sq as f32;
        let bias: Vec<f32> = (0..hq)
            .flat_map(|h| (0..sq).flat_map(move |i| (0..sk).map(move |j| -sl[h] * (i as f32 + off - j as f32).abs())))
            .collect();
        s = s.broadcast_add(&Tensor::from_vec(bias, (1, hq, sq, sk), dev)?.to_dtype(dt)?)?;
    }
    let seen: Vec<f32> = (0..sq).flat_map(|i| (0..sk).map(move |j| if w.sees(i, j, sq, sk) { 1.0 } else { 0.0 })).collect();
    let seen = Tensor::from_vec(seen, (1, 1, sq, sk), dev)?;
    let ninf = Tensor::new(f32::NEG_INFINITY, dev)?.to_dtype(dt)?.broadcast_as(s.shape())?;
    let s = seen.broadcast_as(s.shape())?.ne(0f64)?.where_cond(&s, &ninf)?;
    // A row that sees nothing gets max 0 and sum 0: weights 0, output 0.
    let max = s.max_keepdim(D::Minus1)?.detach();
    let max = max.ne(f64::NEG_INFINITY)?.where_cond(&max, &max.zeros_like()?)?;
    let p = s.broadcast_sub(&max)?.exp()?;
    let sum = p.sum_keepdim(D::Minus1)?;
    let sum = sum.eq(0f64)?.where_cond(&sum.ones_like()?, &sum)?;
    let p = p.broadcast_div(&sum)?;
    p.matmul(&v)?.transpose(1, 2)?.contiguous()
}

/// The reference on each sequence of a packed batch: `(total, h, d)` tensors cut by cumulative
/// offsets, each run as a batch of one, concatenated.
#[allow(clippy::too_many_arguments)]
pub fn naive_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &[usize],
    cu_k: &[usize],
    scale: f32,
    w: Window,
    x: &Extra,
) -> Result<Tensor> {
    let mut outs = Vec::new();
    for b in 0..cu_q.len() - 1 {
        let (q0, q1, k0, k1) = (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]);
        if q0 == q1 {
            continue; // no query rows, nothing to compare
        }
        let cut = |t: &Tensor, a: usize, e: usize| t.narrow(0, a, e - a)?.unsqueeze(0);
        let o = naive(&cut(q, q0, q1)?, &cut(k, k0, k1)?, &cut(v, k0, k1)?, scale, w, x)?;
        outs.push(o.squeeze(0)?);
    }
    Tensor::cat(&outs, 0)
}

pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap();
    d.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

pub fn randn(shape: &[usize], dev: &Device) -> Tensor {
    Tensor::randn(0f32, 1., shape, dev).unwrap()
}

/// FlashAttention's rule for a low-precision result `got`: its error against the f32 reference
/// on the same (rounded) inputs is at most twice the error of candle's attention run in that
/// precision, plus `floor`. `run_ref(dtype)` runs the reference with inputs in `dtype`.
pub fn check_low_precision(what: &str, got: &Tensor, run_ref: impl Fn(DType) -> Result<Tensor>, floor: f64) {
    let exact = run_ref(DType::F32).unwrap();
    let same = run_ref(got.dtype()).unwrap();
    let (err, base) = (max_diff(got, &exact), max_diff(&same, &exact));
    assert!(err <= 2.0 * base + floor, "{what} {:?}: max |err| {err:.2e}, candle's own attention in that dtype {base:.2e}", got.dtype());
}

//! The op against candle's own attention on the CPU (matmul, masked softmax, matmul in f32),
//! on candle's usual `[b, h, s, d]` tensors viewed as `[b, s, h, d]` (strided, no copy), with
//! causal masks and GQA; bf16 within FlashAttention's tolerance rule; wrong inputs are errors.

use candle_core::{DType, Device, Tensor, D};
use flash_attn::ForwardOptions;
use flash_attn_candle::flash_attn;

/// candle's attention on `[b, h, s, d]` f32 tensors (k/v heads repeated for GQA), causal
/// aligned bottom-right, returned as `[b, s, h, d]`.
fn candle_attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> candle_core::Result<Tensor> {
    let (q, k, v) = (&q.contiguous()?, &k.contiguous()?, &v.contiguous()?);
    let (_, hq, sq, d) = q.dims4()?;
    let (_, hk, sk, _) = k.dims4()?;
    let rep = |t: &Tensor| -> candle_core::Result<Tensor> {
        let (b, h, s, d) = t.dims4()?;
        t.unsqueeze(2)?.broadcast_as((b, h, hq / hk, s, d))?.reshape((b, hq, s, d))
    };
    let (k, v) = (rep(k)?, rep(v)?);
    let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    let scores = if causal {
        let off = sk - sq;
        let mask: Vec<u8> = (0..sq).flat_map(|i| (0..sk).map(move |j| u8::from(j > i + off))).collect();
        let mask = Tensor::from_vec(mask, (sq, sk), q.device())?.broadcast_as(scores.shape())?;
        let ninf =
            Tensor::new(f32::NEG_INFINITY, q.device())?.to_dtype(scores.dtype())?.broadcast_as(scores.shape())?;
        mask.where_cond(&ninf, &scores)?
    } else {
        scores
    };
    let p = scores.broadcast_sub(&scores.max_keepdim(D::Minus1)?)?.exp()?;
    let p = p.broadcast_div(&p.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?.transpose(1, 2)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap();
    d.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

#[test]
fn matches_candle_attention_on_transposed_views() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    for (b, hq, hk, sq, sk, d, causal) in
        [(1, 4, 4, 64, 64, 64, true), (2, 8, 2, 37, 91, 32, true), (1, 6, 3, 50, 50, 128, false)]
    {
        let q = Tensor::randn(0f32, 1., (b, hq, sq, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (b, hk, sk, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (b, hk, sk, d), &dev)?;
        let want = candle_attention(&q, &k, &v, causal)?;
        let (tq, tk, tv) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
        assert!(!tq.is_contiguous(), "the op must read the strided view as it is");
        let got = flash_attn(&tq, &tk, &tv, ForwardOptions::default().causal(causal))?;
        assert_eq!(got.dims(), &[b, sq, hq, d]);
        let err = max_diff(&got, &want);
        assert!(err < 1e-5, "f32 [{b},{sq},{hq},{d}] kv {hk} causal {causal}: max |diff| {err:.2e}");

        // bf16 inputs: within FlashAttention's rule against the f32 result (2x the error of
        // candle's attention in bf16, plus the bf16 floor).
        let (bq, bk, bv) = (tq.to_dtype(DType::BF16)?, tk.to_dtype(DType::BF16)?, tv.to_dtype(DType::BF16)?);
        let got16 = flash_attn(&bq, &bk, &bv, ForwardOptions::default().causal(causal))?;
        assert_eq!(got16.dtype(), DType::BF16);
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap().transpose(1, 2).unwrap();
        let want32 = candle_attention(&f(&bq), &f(&bk), &f(&bv), causal)?;
        let naive16 = candle_attention(
            &f(&bq).to_dtype(DType::BF16)?,
            &f(&bk).to_dtype(DType::BF16)?,
            &f(&bv).to_dtype(DType::BF16)?,
            causal,
        )?;
        let (err16, naive) = (max_diff(&got16, &want32), max_diff(&naive16, &want32));
        assert!(err16 <= 2.0 * naive + 1.6e-2, "bf16: err {err16:.2e}, candle bf16 {naive:.2e}");
    }
    Ok(())
}

#[test]
fn bad_inputs_are_candle_errors() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (1, 8, 2, 16), &dev)?;
    // head_dim not contiguous
    let e = flash_attn(&q.transpose(2, 3)?, &q, &q, ForwardOptions::default()).unwrap_err();
    assert!(e.to_string().contains("contiguous"), "{e}");
    // not 4-D
    let e = flash_attn(&q.flatten_to(1)?, &q, &q, ForwardOptions::default()).unwrap_err();
    assert!(e.to_string().contains("[batch, seqlen, heads, head_dim]"), "{e}");
    // mixed dtypes
    let e = flash_attn(&q, &q.to_dtype(DType::F16)?, &q, ForwardOptions::default()).unwrap_err();
    assert!(e.to_string().contains("f32, f16 or bf16"), "{e}");
    // flash_attn's own validation comes through: heads not divisible
    let k = Tensor::randn(0f32, 1., (1, 8, 3, 16), &dev)?;
    let e = flash_attn(&q, &k, &k, ForwardOptions::default()).unwrap_err();
    assert!(e.to_string().contains("heads"), "{e}");
    Ok(())
}

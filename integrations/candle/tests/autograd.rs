//! candle's autograd through the attention op: `loss.backward()` gives the gradients candle's
//! own attention (candle ops, CPU) gives, for q, k, v read as transposed views, with causal and
//! window masks, softcap, ALiBi, GQA and seqlen_q != seqlen_k; in f32 to 1e-4 and in bf16
//! within FlashAttention's gradient rule (three times the error of candle's attention run in
//! bf16, plus a floor); and through the varlen functions on packed sequences.

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::{max_diff, naive, naive_varlen, randn, Extra, Window};
use flash_attn_candle as fa;

struct Case {
    b: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hk: usize,
    d: usize,
    w: Window,
    alibi: bool,
    softcap: Option<f32>,
}

const CASES: [Case; 4] = [
    Case { b: 2, sq: 13, sk: 21, hq: 4, hk: 2, d: 16, w: Window::CAUSAL, alibi: false, softcap: None },
    Case { b: 1, sq: 24, sk: 24, hq: 2, hk: 2, d: 32, w: Window(Some(5), Some(0)), alibi: true, softcap: Some(4.0) },
    Case { b: 1, sq: 9, sk: 30, hq: 3, hk: 1, d: 24, w: Window::NONE, alibi: false, softcap: Some(2.0) },
    Case { b: 2, sq: 17, sk: 17, hq: 2, hk: 1, d: 64, w: Window(Some(3), Some(6)), alibi: true, softcap: None },
];

/// The gradients of `sum(attention(q, k, v) ∘ w)` with respect to q, k, v (vars in candle's
/// `[b, h, s, d]`, passed transposed) for attention `f`.
fn grads(
    vars: &[Var; 3],
    w: &Tensor,
    dtype: DType,
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<[Tensor; 3]> {
    let t = |v: &Var| v.as_tensor().to_dtype(dtype)?.transpose(1, 2);
    let o = f(&t(&vars[0])?, &t(&vars[1])?, &t(&vars[2])?)?;
    let loss = (o.to_dtype(DType::F32)? * w)?.sum_all()?;
    let g = loss.backward()?;
    let get = |v: &Var| g.get(v).cloned().ok_or_else(|| candle_core::Error::Msg("no gradient".into()));
    Ok([get(&vars[0])?, get(&vars[1])?, get(&vars[2])?])
}

#[test]
fn backward_matches_candle_autograd() -> Result<()> {
    let dev = Device::Cpu;
    for c in CASES {
        let scale = 1.0 / (c.d as f32).sqrt();
        let slopes: Vec<f32> = (0..c.hq).map(|h| 0.3 / (h + 1) as f32).collect();
        let st = Tensor::new(slopes.as_slice(), &dev)?;
        let x = Extra { slopes: c.alibi.then(|| slopes.clone()), softcap: c.softcap };
        let vars = [
            Var::from_tensor(&randn(&[c.b, c.hq, c.sq, c.d], &dev))?,
            Var::from_tensor(&randn(&[c.b, c.hk, c.sk, c.d], &dev))?,
            Var::from_tensor(&randn(&[c.b, c.hk, c.sk, c.d], &dev))?,
        ];
        let w = randn(&[c.b, c.sq, c.hq, c.d], &dev);
        let ours = |q: &Tensor, k: &Tensor, v: &Tensor| {
            fa::flash_attn_alibi_windowed_softcap(q, k, v, c.alibi.then_some(&st), scale, c.w.0, c.w.1, c.softcap.unwrap_or(0.0))
        };
        let theirs = |q: &Tensor, k: &Tensor, v: &Tensor| naive(q, k, v, scale, c.w, &x);
        let (g, want) = (grads(&vars, &w, DType::F32, ours)?, grads(&vars, &w, DType::F32, theirs)?);
        for (name, a, b) in [("dq", &g[0], &want[0]), ("dk", &g[1], &want[1]), ("dv", &g[2], &want[2])] {
            assert_eq!(a.dims(), b.dims(), "{name}");
            let err = max_diff(a, b);
            assert!(err < 1e-4, "{name} f32 [{} {} {} {} {} {}] {:?}: max |diff| {err:.2e}", c.b, c.sq, c.sk, c.hq, c.hk, c.d, c.w);
        }
        // bf16 inputs: gradients within three times candle's own bf16 error, plus the floor.
        let (g16, base16) = (grads(&vars, &w, DType::BF16, ours)?, grads(&vars, &w, DType::BF16, theirs)?);
        for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
            let (err, base) = (max_diff(&g16[i], &want[i]), max_diff(&base16[i], &want[i]));
            let scale = want[i].abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64;
            assert!(err <= 3.0 * base + 2e-2 * scale.max(1.0), "{name} bf16: max |diff| {err:.2e}, candle bf16 {base:.2e}");
        }
    }
    Ok(())
}

/// The op with flash_attn's options (GQA 4:1, causal) through `flash_attn_with_options`, and the
/// `FlashAttn` struct applied by hand, are differentiable too.
#[test]
fn options_op_and_struct_are_differentiable() -> Result<()> {
    let dev = Device::Cpu;
    let vars = [
        Var::from_tensor(&randn(&[1, 4, 11, 16], &dev))?,
        Var::from_tensor(&randn(&[1, 1, 11, 16], &dev))?,
        Var::from_tensor(&randn(&[1, 1, 11, 16], &dev))?,
    ];
    let w = randn(&[1, 11, 4, 16], &dev);
    let want = grads(&vars, &w, DType::F32, |q, k, v| naive(q, k, v, 0.25, Window::CAUSAL, &Extra::default()))?;
    let opts = fa::ForwardOptions::default().causal(true);
    let a = grads(&vars, &w, DType::F32, |q, k, v| fa::flash_attn_with_options(q, k, v, &opts))?;
    let b = grads(&vars, &w, DType::F32, |q, k, v| {
        let op = fa::FlashAttn { softmax_scale: 0.25, alibi_slopes: None, window_size_left: None, window_size_right: Some(0), softcap: None };
        q.apply_op3(k, v, op)
    })?;
    for i in 0..3 {
        assert!(max_diff(&a[i], &want[i]) < 1e-4 && max_diff(&b[i], &want[i]) < 1e-4, "gradient {i}");
    }
    Ok(())
}

/// The varlen functions are differentiable too: packed sequences of different lengths (one with
/// no query row) with a causal window, softcap and GQA, against candle's autograd through its
/// attention run on each sequence.
#[test]
fn varlen_backward_matches_candle_autograd() -> Result<()> {
    let dev = Device::Cpu;
    let (lq, lk) = ([7usize, 0, 19, 1], [12usize, 4, 19, 9]);
    let cum = |l: &[usize]| -> Vec<usize> { std::iter::once(0).chain(l.iter().scan(0, |a, &x| { *a += x; Some(*a) })).collect() };
    let (cu_q, cu_k) = (cum(&lq), cum(&lk));
    let u = |c: &[usize]| Tensor::new(c.iter().map(|&x| x as u32).collect::<Vec<_>>().as_slice(), &dev);
    let (sq, sk) = (u(&cu_q)?, u(&cu_k)?);
    let (tq, tk) = (cu_q[4], cu_k[4]);
    let vars = [
        Var::from_tensor(&randn(&[tq, 4, 16], &dev))?,
        Var::from_tensor(&randn(&[tk, 2, 16], &dev))?,
        Var::from_tensor(&randn(&[tk, 2, 16], &dev))?,
    ];
    let w = randn(&[tq, 4, 16], &dev);
    let x = Extra { slopes: None, softcap: Some(3.0) };
    let win = Window(Some(4), Some(0));
    let run = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>| -> Result<[Tensor; 3]> {
        let o = f(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor())?;
        let g = (o * &w)?.sum_all()?.backward()?;
        let get = |v: &Var| g.get(v).cloned().ok_or_else(|| candle_core::Error::Msg("no gradient".into()));
        Ok([get(&vars[0])?, get(&vars[1])?, get(&vars[2])?])
    };
    let ours = run(&|q, k, v| fa::flash_attn_varlen_alibi_windowed_softcap(q, k, v, None, &sq, &sk, 19, 19, 0.25, win.0, win.1, 3.0))?;
    let want = run(&|q, k, v| naive_varlen(q, k, v, &cu_q, &cu_k, 0.25, win, &x))?;
    for i in 0..3 {
        let err = max_diff(&ours[i], &want[i]);
        assert!(err < 1e-4, "varlen gradient {i}: max |diff| {err:.2e}");
    }
    Ok(())
}

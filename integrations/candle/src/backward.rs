//! The backward pass of the [`crate::Attention`] op for candle's autograd, dense and varlen: from
//! q, k, v, the forward's o and LSE and the output gradient dO, flash_attn's backward
//! (FlashAttention 2's algorithm: P recomputed from the LSE, no `seqlen_q × seqlen_k` matrix
//! kept) gives dq, dk, dv in the inputs' dtype and shapes (dk, dv summed over each GQA group).
//!
//! CPU tensors run flash_attn's CPU backward; CUDA tensors are an error (no GPU backward is
//! wired to candle's storage).

use crate::convert::{err, same_dtype, view, with_float};
use crate::op::Keys;
use candle_core::{bail, Device, Layout, Result, Storage, Tensor};
use flash_attn::serving::Varlen;
use flash_attn::{Backend, ForwardOptions};

/// dq, dk, dv of attention with `opts` at (q, k, v) laid out as `keys` (dense or varlen), given
/// the forward's output `o`, its LSE (recomputed by a dense forward when `None`) and `d_o`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gradients(
    opts: &ForwardOptions,
    keys: &Keys,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    d_o: &Tensor,
    lse: Option<Tensor>,
) -> Result<(Tensor, Tensor, Tensor)> {
    for (n, t) in [("q", q), ("k", k), ("v", v), ("the output gradient", d_o)] {
        if !t.device().is_cpu() {
            bail!("flash_attn: the backward pass takes CPU tensors ({n} is on {:?})", t.device().location())
        }
    }
    let dtype = same_dtype(&[("q", q.dtype()), ("k", k.dtype()), ("v", v.dtype()), ("o", o.dtype())])?;
    // The incoming gradient may be a broadcast (a sum's backward) or of another dtype.
    let d_o = d_o.to_dtype(dtype)?;
    let d_o = if d_o.stride().last() == Some(&1) { d_o } else { d_o.contiguous()? };
    let opts = opts.clone().backend(Backend::Cpu);
    let lse = match (lse, keys) {
        (Some(l), _) => l,
        (None, Keys::Dense) => crate::op::flash_attn_lse(q, k, v, &opts)?.1,
        (None, _) => bail!("flash_attn: the varlen backward needs the forward's LSE"),
    };
    let rank = keys.ranks().0;
    let lse = lse.flatten_all()?.to_vec1::<f32>()?;
    let ts = [q, k, v, o, &d_o];
    let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let cpu = |i: usize| -> Result<(&candle_core::CpuStorage, &Layout)> {
        match &*guards[i].0 {
            Storage::Cpu(c) => Ok((c, guards[i].1)),
            _ => bail!("flash_attn: the backward pass takes CPU tensors"),
        }
    };
    let names = ["q", "k", "v", "o", "d_o"];
    with_float!(dtype, "q, k, v", T => {
        let mut views = Vec::with_capacity(5);
        for (i, name) in names.iter().enumerate() {
            let (s, l) = cpu(i)?;
            views.push(view(s.as_slice::<T>()?, l, rank, name)?);
        }
        let (q_, k_, v_, o_, d_o_) = (&views[0], &views[1], &views[2], &views[3], &views[4]);
        let g = match keys {
            Keys::Dense => flash_attn::backward(q_, k_, v_, o_, d_o_, &lse, &opts),
            Keys::Varlen { cu_q, cu_k, max_q, max_k } => {
                let seqs = Varlen { cu_seqlens_q: cu_q, cu_seqlens_k: cu_k, max_seqlen_q: *max_q, max_seqlen_k: *max_k };
                flash_attn::serving::backward_varlen(q_, k_, v_, o_, d_o_, &lse, &seqs, &opts)
            }
            _ => bail!("flash_attn: the KV-cache attention has no backward pass"),
        }
        .map_err(err)?;
        let t = |x: flash_attn::Tensor, like: &Tensor| -> Result<Tensor> {
            Tensor::from_vec(x.into_vec::<T>().map_err(err)?, like.dims(), &Device::Cpu)
        };
        Ok((t(g.dq, q)?, t(g.dk, k)?, t(g.dv, v)?))
    })
}

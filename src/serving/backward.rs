//! `backward_varlen`: the backward pass of [`super::forward_varlen`].

use super::layout::{CacheRows, KvLayout, QueryLayout};
use super::validate::{check_view, prepare};
use super::varlen::Varlen;
use crate::backward::{check_lse, check_like_o, cpu_dispatch, route_cpu_only, run_cpu, Gradients};
use crate::cpu::backward::{Inputs, Span};
use crate::error::{Operand, Result};
use crate::options::ForwardOptions;
use crate::tensor::{AsTensorView, Tensor};

/// The gradients of [`super::forward_varlen`] (FlashAttention's `flash_attn_varlen_func`
/// backward): q packed `[1, total_q, heads_q, head_dim]`, `o`, `d_o` packed `[1, total_q,
/// heads_q, head_dim_v]`, k and v packed `[1, total_k, heads_kv, head_dim]` and `[1, total_k,
/// heads_kv, head_dim_v]` (`head_dim_v`, v's head_dim, is q/k's unless v's differs), `lse` in the
/// forward's packed layout `[heads_q, total_q]`, the sequences given by `seqs`. Returns dq in q's
/// shape, dk in k's and dv in v's, in the inputs' dtype. Each sequence is the dense [`crate::backward`] of its own rows (bit for bit); rows of
/// keys no query sees, and of queries that see no key, get zero gradients.
///
/// # Errors
/// Malformed offsets are [`crate::Error::InvalidSeqLayout`]; everything else as
/// [`crate::backward`], with the LSE's length `heads_q · total_q`.
#[allow(clippy::too_many_arguments)]
pub fn backward_varlen(
    q: &impl AsTensorView,
    k: &impl AsTensorView,
    v: &impl AsTensorView,
    o: &impl AsTensorView,
    d_o: &impl AsTensorView,
    lse: &[f32],
    seqs: &Varlen<'_>,
    opts: &ForwardOptions,
) -> Result<Gradients> {
    let (q, k, v, o, d_o) = (q.as_view(), k.as_view(), v.as_view(), o.as_view(), d_o.as_view());
    for (t, op) in [(&o, Operand::O), (&d_o, Operand::DO)] {
        check_view(t, op, true)?;
        check_like_o(t, &q, &v, op)?;
    }
    let ql = QueryLayout::Varlen { cu_seqlens: seqs.cu_seqlens_q, max_seqlen: seqs.max_seqlen_q };
    let kl = KvLayout::Varlen { cu_seqlens: seqs.cu_seqlens_k, max_seqlen: seqs.max_seqlen_k };
    let (p, layout) = prepare(&q, &k, &v, (ql, kl, CacheRows::default()), opts)?;
    let total_q = q.shape()[1];
    check_lse(lse, p.heads_q * total_q, "[heads_q, total_q]")?;
    let why = route_cpu_only(opts)?;
    let spans: Vec<Span> = (0..layout.batch())
        .map(|b| {
            let q0 = layout.q_row(b, 0).1;
            Span {
                b: 0,
                q0,
                sq: layout.seqlen_q(b),
                k0: layout.kv_row(b, 0).1,
                sk: layout.seqlen_k(b),
                lse0: q0,
                lse_head: total_q,
            }
        })
        .collect();
    let mut dq = Tensor::zeros(p.dtype, q.shape())?;
    let mut dk = Tensor::zeros(p.dtype, k.shape())?;
    let mut dv = Tensor::zeros(p.dtype, v.shape())?;
    let x = Inputs { q, k, v, o, d_o, lse };
    let out = (dq.data_mut().as_data_mut(), dk.data_mut().as_data_mut(), dv.data_mut().as_data_mut());
    let mut d_sinks = p.sinks.as_ref().map(|_| vec![0.0f32; p.heads_q]);
    let kernel = run_cpu(&p, &spans, &x, opts, out, d_sinks.as_deref_mut())?;
    let dispatch = cpu_dispatch(kernel, format!("{why}; varlen: {} sequences", layout.batch()));
    Ok(Gradients { dq, dk, dv, d_sinks, dispatch })
}

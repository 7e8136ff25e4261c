//! `backward`: the gradients of the attention forward pass, validated, on the CPU backend.

use crate::cpu;
use crate::cpu::backward::{GradsOut, Inputs, Span};
use crate::error::{Error, Operand, Result};
use crate::options::{Backend, ForwardOptions, Precision, Variant};
use crate::output::Dispatch;
use crate::problem::Problem;
use crate::tensor::{numel, AsTensorView, DType, DataMut, Element, Tensor, TensorView};

/// The result of [`backward`]: the gradients of the loss with respect to q, k and v.
#[derive(Clone, Debug)]
pub struct Gradients {
    /// `[batch, seqlen_q, heads_q, head_dim]`, q's dtype.
    pub dq: Tensor,
    /// `[batch, seqlen_k, heads_kv, head_dim]`, summed over each GQA group's query heads.
    pub dk: Tensor,
    /// As `dk`, with v's head_dim: `[batch, seqlen_k, heads_kv, head_dim_v]`.
    pub dv: Tensor,
    pub dispatch: Dispatch,
}

/// Checks a forward output or output gradient against q and v: q's batch, seqlen and heads, v's
/// head_dim, q's dtype (its layout is the caller's to check).
pub(crate) fn check_like_o(t: &TensorView, q: &TensorView, v: &TensorView, op: Operand) -> Result<()> {
    let [b, s, h, d] = q.shape();
    let want = [b, s, h, v.head_dim()];
    if t.shape() != want {
        return Err(Error::ShapeMismatch {
            what: op.to_string(),
            got: format!("{:?}", t.shape()),
            expected: if want[3] == d {
                format!("{:?} (the shape of q)", q.shape())
            } else {
                format!("{want:?} (q's batch, seqlen and heads; v's head_dim)")
            },
        });
    }
    if t.dtype() != q.dtype() {
        return Err(Error::DTypeMismatch { operand: op, got: t.dtype(), expected: q.dtype() });
    }
    Ok(())
}

/// Checks the LSE the forward returned: `n` values, each finite or −inf (a row that sees no key).
pub(crate) fn check_lse(lse: &[f32], n: usize, layout: &str) -> Result<()> {
    if lse.len() != n {
        return Err(Error::ShapeMismatch {
            what: "lse".into(),
            got: format!("{} f32", lse.len()),
            expected: format!("{n} f32 ({layout}, as the forward returns it)"),
        });
    }
    if let Some((i, x)) = lse.iter().enumerate().find(|(_, x)| x.is_nan() || **x == f32::INFINITY) {
        return Err(Error::InvalidOption {
            option: "lse",
            got: format!("{x} at index {i}"),
            expected: "finite values, or -inf for a row that sees no key (the forward's LSE)".into(),
        });
    }
    Ok(())
}

/// The options the backward refuses, and where it runs: the reason for the CPU.
pub(crate) fn route(opts: &ForwardOptions) -> Result<String> {
    if opts.precision != Precision::Native {
        return Err(Error::InvalidOption {
            option: "precision",
            got: format!("{:?}", opts.precision),
            expected: "Precision::Native (the backward has no FP8 path)".into(),
        });
    }
    if let Some(sinks) = &opts.sinks {
        return Err(Error::InvalidOption {
            option: "sinks",
            got: format!("{} sink logits", sinks.len()),
            expected: "no sinks (the backward has no gradient for the sink logits)".into(),
        });
    }
    if opts.variant != Variant::Auto {
        return Err(Error::VariantUnavailable {
            variant: opts.variant,
            reason: "the backward runs on the CPU backend only (use Variant::Auto)".into(),
        });
    }
    match opts.backend {
        Backend::Cuda(dev) => Err(Error::BackendUnavailable {
            backend: format!("cuda:{dev}"),
            reason: "the backward runs on the CPU backend only (use Backend::Auto or Backend::Cpu)".into(),
        }),
        Backend::Cpu => Ok("Backend::Cpu requested".into()),
        _ => Ok("the backward runs on the CPU backend".into()),
    }
}

/// The dispatch of a CPU backward.
pub(crate) fn cpu_dispatch(kernel: &str, why: String) -> Dispatch {
    Dispatch {
        backend: "cpu".into(),
        kernel: kernel.into(),
        reason: format!(
            "{why}; deterministic: dq is summed over at most {} key chunks per row in a fixed order, \
             whatever the thread count",
            cpu::backward::MAX_KEY_CHUNKS
        ),
    }
}

/// Validated inputs of a dense backward call.
struct Checked<'a> {
    p: Problem,
    x: Inputs<'a>,
    spans: Vec<Span>,
    why: String,
}

fn check<'a>(
    (q, k, v, o, d_o): (TensorView<'a>, TensorView<'a>, TensorView<'a>, TensorView<'a>, TensorView<'a>),
    lse: &'a [f32],
    opts: &ForwardOptions,
) -> Result<Checked<'a>> {
    let p = Problem::new(&q, &k, &v, opts)?;
    for (t, op) in [(&o, Operand::O), (&d_o, Operand::DO)] {
        check_like_o(t, &q, &v, op)?;
        t.check_layout(op)?;
    }
    check_lse(lse, p.batch * p.heads_q * p.seqlen_q, "[batch, heads_q, seqlen_q]")?;
    let why = route(opts)?;
    let spans = (0..p.batch)
        .map(|b| Span {
            b,
            q0: 0,
            sq: p.seqlen_q,
            k0: 0,
            sk: p.seqlen_k,
            lse0: b * p.heads_q * p.seqlen_q,
            lse_head: p.seqlen_q,
        })
        .collect();
    Ok(Checked { p, x: Inputs { q, k, v, o, d_o, lse }, spans, why })
}

/// The CPU backward of validated inputs into the gradient buffers (of the inputs' dtype).
pub(crate) fn run_cpu(
    p: &Problem,
    spans: &[Span],
    x: &Inputs<'_>,
    opts: &ForwardOptions,
    out: (DataMut<'_>, DataMut<'_>, DataMut<'_>),
) -> Result<&'static str> {
    let threads = cpu::threads(opts.cpu_threads);
    match out {
        (DataMut::F32(dq), DataMut::F32(dk), DataMut::F32(dv)) => cpu::backward::run(p, spans, x, threads, GradsOut { dq, dk, dv }),
        (DataMut::F16(dq), DataMut::F16(dk), DataMut::F16(dv)) => cpu::backward::run(p, spans, x, threads, GradsOut { dq, dk, dv }),
        (DataMut::BF16(dq), DataMut::BF16(dk), DataMut::BF16(dv)) => {
            cpu::backward::run(p, spans, x, threads, GradsOut { dq, dk, dv })
        }
        (dq, _, _) => Err(Error::DTypeMismatch { operand: Operand::O, got: dq.dtype(), expected: p.dtype }),
    }
}

/// The backward pass of [`crate::forward`]: given q, k, v, the forward's output `o` and LSE, and
/// `d_o` (the gradient of the loss with respect to `o`), the gradients dq, dk, dv in the inputs'
/// dtype (f32 accumulation), contiguous `[batch, seqlen, heads, head_dim]` (dv, like v, o and
/// `d_o`, with v's head_dim, which may differ from q/k's).
///
/// FlashAttention-2's algorithm: `D = rowsum(dO ∘ O)`; per block of keys, S and P are recomputed
/// from the LSE, `dV += Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − D)`, `dK += dSᵀ·Q`,
/// `dQ += dS·K` (scaled); no `seqlen_q × seqlen_k` matrix is held, the extra memory is O(N).
/// Every option of the forward applies as it did there: causal and window masks (bottom-right),
/// softcap (its gradient through tanh), ALiBi (constant slopes), GQA/MQA (dk and dv summed over
/// each group's query heads), the softmax scale. Rows that see no key (LSE −inf) get zero
/// gradients. `opts` must be those of the forward call; `return_lse`, `exp2`, `rescale` and
/// `num_splits` do not matter here (P is recomputed with the accurate exp2).
///
/// Runs on the CPU backend, deterministic: the gradients are bit-identical from run to run and
/// for any `cpu_threads` (see [`ForwardOptions::deterministic`]).
///
/// ```
/// use flash_attn::{backward, forward, ForwardOptions, Tensor};
/// let (b, s, h, d) = (1, 32, 2, 16);
/// let x: Vec<f32> = (0..b * s * h * d).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
/// let q = Tensor::from_vec(x.clone(), [b, s, h, d])?;
/// let opts = ForwardOptions::default().causal(true).return_lse(true);
/// let out = forward(&q, &q, &q, &opts)?;
/// let d_o = Tensor::from_vec(vec![1.0f32; b * s * h * d], [b, s, h, d])?;
/// let g = backward(&q, &q, &q, &out.o, &d_o, out.lse.as_deref().unwrap_or_default(), &opts)?;
/// assert_eq!(g.dk.shape(), [b, s, h, d]);
/// # Ok::<(), flash_attn::Error>(())
/// ```
///
/// # Errors
/// Everything [`crate::forward`] refuses; [`Error::ShapeMismatch`] / [`Error::DTypeMismatch`]
/// / [`Error::InvalidLayout`] when `o` or `d_o` is not o's shape (q's, with v's head_dim), q's
/// dtype and a valid view, or
/// `lse` is not `batch · heads_q · seqlen_q` values; [`Error::InvalidOption`] for an LSE holding
/// NaN or +inf, or an FP8 precision; [`Error::BackendUnavailable`] / [`Error::VariantUnavailable`]
/// for a GPU backend or kernel family. Nothing panics.
pub fn backward(
    q: &impl AsTensorView,
    k: &impl AsTensorView,
    v: &impl AsTensorView,
    o: &impl AsTensorView,
    d_o: &impl AsTensorView,
    lse: &[f32],
    opts: &ForwardOptions,
) -> Result<Gradients> {
    let c = check((q.as_view(), k.as_view(), v.as_view(), o.as_view(), d_o.as_view()), lse, opts)?;
    let p = &c.p;
    let mut dq = Tensor::zeros(p.dtype, [p.batch, p.seqlen_q, p.heads_q, p.head_dim])?;
    let mut dk = Tensor::zeros(p.dtype, [p.batch, p.seqlen_k, p.heads_kv, p.head_dim])?;
    let mut dv = Tensor::zeros(p.dtype, [p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v])?;
    let out = (dq.data_mut().as_data_mut(), dk.data_mut().as_data_mut(), dv.data_mut().as_data_mut());
    let kernel = run_cpu(p, &c.spans, &c.x, opts, out)?;
    Ok(Gradients { dq, dk, dv, dispatch: cpu_dispatch(kernel, c.why) })
}

/// Checks a caller's gradient buffer: `T` is the inputs' dtype, `len` the elements of `shape`.
pub(crate) fn check_grad_buffer<T: Element>(what: &str, buf: &[T], shape: [usize; 4], dtype: DType) -> Result<()> {
    if T::DTYPE != dtype {
        return Err(Error::DTypeMismatch { operand: Operand::O, got: T::DTYPE, expected: dtype });
    }
    let n = numel(shape, what)?;
    if buf.len() != n {
        return Err(Error::ShapeMismatch {
            what: format!("backward_into {what} buffer"),
            got: format!("{} elements", buf.len()),
            expected: format!("{n} elements (contiguous {shape:?})"),
        });
    }
    Ok(())
}

/// As [`backward`], writing the gradients into the caller's buffers: `dq` contiguous
/// `[batch, seqlen_q, heads_q, head_dim]`, `dk` contiguous `[batch, seqlen_k, heads_kv,
/// head_dim]` and `dv` `[batch, seqlen_k, heads_kv, head_dim_v]`, all of q's element type (e.g. an engine's reused gradient buffers).
/// Every element is written.
///
/// # Errors
/// As [`backward`]; [`Error::DTypeMismatch`] when `T` is not q's element type and
/// [`Error::ShapeMismatch`] when a buffer has the wrong length.
#[allow(clippy::too_many_arguments)]
pub fn backward_into<T: Element>(
    q: &impl AsTensorView,
    k: &impl AsTensorView,
    v: &impl AsTensorView,
    o: &impl AsTensorView,
    d_o: &impl AsTensorView,
    lse: &[f32],
    (dq, dk, dv): (&mut [T], &mut [T], &mut [T]),
    opts: &ForwardOptions,
) -> Result<Dispatch> {
    let c = check((q.as_view(), k.as_view(), v.as_view(), o.as_view(), d_o.as_view()), lse, opts)?;
    let p = &c.p;
    check_grad_buffer("dq", dq, [p.batch, p.seqlen_q, p.heads_q, p.head_dim], p.dtype)?;
    check_grad_buffer("dk", dk, [p.batch, p.seqlen_k, p.heads_kv, p.head_dim], p.dtype)?;
    check_grad_buffer("dv", dv, [p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v], p.dtype)?;
    let kernel = run_cpu(p, &c.spans, &c.x, opts, (T::wrap_mut(dq), T::wrap_mut(dk), T::wrap_mut(dv)))?;
    Ok(cpu_dispatch(kernel, c.why))
}

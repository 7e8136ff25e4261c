//! `backward`: the gradients of the attention forward pass, validated, on the CPU backend.

use crate::cpu;
use crate::cpu::backward::{GradsOut, Inputs, Span};
use crate::error::{Error, Operand, Result};
use crate::options::{Backend, ForwardOptions, Precision, Variant};
use crate::output::Dispatch;
use crate::problem::Problem;
use crate::tensor::{numel, AsTensorView, DType, DataMut, Element, Tensor, TensorView};

/// The result of [`backward`]: the gradients of the loss with respect to q, k and v, and to the
/// attention sinks' logits when the call has them.
#[derive(Clone, Debug)]
pub struct Gradients {
    /// `[batch, seqlen_q, heads_q, head_dim]`, q's dtype.
    pub dq: Tensor,
    /// `[batch, seqlen_k, heads_kv, head_dim]`, summed over each GQA group's query heads.
    pub dk: Tensor,
    /// As `dk`, with v's head_dim: `[batch, seqlen_k, heads_kv, head_dim_v]`.
    pub dv: Tensor,
    /// `[heads_q]`: the gradient of each head's sink logit (`opts.sinks`), summed over batch and
    /// rows (0 for a head whose sink is −inf); `None` without sinks.
    pub d_sinks: Option<Vec<f32>>,
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

/// Where a backward runs: the CPU with the reason, or a CUDA device (an explicit variant).
pub(crate) enum Route {
    Cpu(String),
    Gpu(usize),
}

/// The options the backward refuses, and where it runs. `Variant::Auto` runs the CPU backward
/// (on `Backend::Cuda` the engine refuses it until a GPU run verifies the kernels); an explicit
/// `Variant::Fa2` / `Variant::Fa3` runs the GPU kernels and needs a CUDA backend.
pub(crate) fn route(opts: &ForwardOptions) -> Result<Route> {
    if opts.precision != Precision::Native {
        return Err(Error::InvalidOption {
            option: "precision",
            got: format!("{:?}", opts.precision),
            expected: "Precision::Native (the backward has no FP8 path)".into(),
        });
    }
    match (opts.variant, opts.backend) {
        (_, Backend::Cuda(dev)) => Ok(Route::Gpu(dev)),
        (Variant::Auto, Backend::Cpu) => Ok(Route::Cpu("Backend::Cpu requested".into())),
        (Variant::Auto, _) => Ok(Route::Cpu(
            "Variant::Auto runs the CPU backward (the GPU backward kernels are not verified on a GPU yet: name \
             Variant::Fa2 or Variant::Fa3 to run them)"
                .into(),
        )),
        (variant, Backend::Cpu) => Err(Error::VariantUnavailable {
            variant,
            reason: "GPU kernel families run only on a CUDA backend; this call asks for Backend::Cpu (use Variant::Auto)".into(),
        }),
        (variant, _) => crate::cuda_host::any_device().map(Route::Gpu).map_err(|why| Error::VariantUnavailable {
            variant,
            reason: format!("the GPU backward kernels need a CUDA device: {why} (use Variant::Auto for the CPU backward)"),
        }),
    }
}

/// The route of a call that runs on the CPU only (the varlen backward): its reason, or the error
/// of a GPU route.
pub(crate) fn route_cpu_only(opts: &ForwardOptions) -> Result<String> {
    match route(opts)? {
        Route::Cpu(why) => Ok(why),
        Route::Gpu(dev) => Err(match opts.variant {
            Variant::Auto => Error::BackendUnavailable {
                backend: format!("cuda:{dev}"),
                reason: "this backward runs on the CPU backend only (use Backend::Auto or Backend::Cpu)".into(),
            },
            variant => Error::VariantUnavailable {
                variant,
                reason: "this backward runs on the CPU backend only (use Variant::Auto)".into(),
            },
        }),
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
    route: Route,
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
    let route = route(opts)?;
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
    Ok(Checked { p, x: Inputs { q, k, v, o, d_o, lse }, spans, route })
}

/// The CPU backward of validated inputs into the gradient buffers (of the inputs' dtype), and
/// the sink gradient into `d_sinks` (`heads_q` values) when given.
pub(crate) fn run_cpu(
    p: &Problem,
    spans: &[Span],
    x: &Inputs<'_>,
    opts: &ForwardOptions,
    out: (DataMut<'_>, DataMut<'_>, DataMut<'_>),
    d_sinks: Option<&mut [f32]>,
) -> Result<&'static str> {
    let threads = cpu::threads(opts.cpu_threads);
    match out {
        (DataMut::F32(dq), DataMut::F32(dk), DataMut::F32(dv)) => {
            cpu::backward::run(p, spans, x, threads, GradsOut { dq, dk, dv, d_sinks })
        }
        (DataMut::F16(dq), DataMut::F16(dk), DataMut::F16(dv)) => {
            cpu::backward::run(p, spans, x, threads, GradsOut { dq, dk, dv, d_sinks })
        }
        (DataMut::BF16(dq), DataMut::BF16(dk), DataMut::BF16(dv)) => {
            cpu::backward::run(p, spans, x, threads, GradsOut { dq, dk, dv, d_sinks })
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
/// With `Variant::Auto` (the default) it runs on the CPU backend, deterministic: the gradients
/// are bit-identical from run to run and for any `cpu_threads` (see
/// [`ForwardOptions::deterministic`]). An explicit `Variant::Fa2` or `Variant::Fa3` runs the
/// GPU backward kernels on `Backend::Cuda(n)` (or the first device with `Backend::Auto`) through
/// [`crate::cuda::Engine::backward`]: the inputs are uploaded, the gradients downloaded, and
/// `Dispatch` says which kernel ran and whether dq was summed with f32 atomics (the default) or
/// deterministically (`opts.deterministic(true)`). Those kernels ran in the CPU emulator and
/// were compile-checked; none has run on a GPU, which is why `Variant::Auto` does not pick them.
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
/// when the GPU route cannot run (no `cuda` feature, driver or device; `Variant::Auto` on
/// `Backend::Cuda`; a kernel family without a backward, or one the device or problem rules out);
/// the engine's errors on the GPU route. Nothing panics.
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
    let mut d_sinks = p.sinks.as_ref().map(|_| vec![0.0f32; p.heads_q]);
    let dispatch = run(&c, opts, out, d_sinks.as_deref_mut())?;
    Ok(Gradients { dq, dk, dv, d_sinks, dispatch })
}

/// Runs a checked dense backward where its route says, into `out` (and `d_sinks`).
fn run(
    c: &Checked<'_>,
    opts: &ForwardOptions,
    out: (DataMut<'_>, DataMut<'_>, DataMut<'_>),
    d_sinks: Option<&mut [f32]>,
) -> Result<Dispatch> {
    match &c.route {
        Route::Cpu(why) => Ok(cpu_dispatch(run_cpu(&c.p, &c.spans, &c.x, opts, out, d_sinks)?, why.clone())),
        Route::Gpu(dev) => {
            let x = &c.x;
            crate::cuda_host::backward_host_into([&x.q, &x.k, &x.v, &x.o, &x.d_o], x.lse, out, d_sinks, opts, *dev)
        }
    }
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
    if let Some(sinks) = &p.sinks {
        return Err(Error::InvalidOption {
            option: "sinks",
            got: format!("{} sink logits", sinks.len()),
            expected: "no sinks in backward_into (it has no buffer for the sink gradient: use backward, whose \
                       Gradients::d_sinks holds it)"
                .into(),
        });
    }
    run(&c, opts, (T::wrap_mut(dq), T::wrap_mut(dk), T::wrap_mut(dv)), None)
}

//! `forward`: validate, pick a backend, run.

use crate::cpu;
use crate::error::{Error, Operand, Result};
use crate::options::{Backend, ForwardOptions, Variant};
use crate::output::{Dispatch, Output};
use crate::problem::Problem;
use crate::tensor::{numel, AsTensorView, Element, TensorView};

/// Where a host-memory call runs: a CUDA device, or the CPU with the reason.
enum Route {
    Gpu(usize),
    Cpu(String),
}

fn route(p: &Problem, opts: &ForwardOptions) -> Result<Route> {
    let route = match opts.backend {
        Backend::Cpu => Route::Cpu("Backend::Cpu requested".to_string()),
        Backend::Auto => match crate::cuda_host::auto_device(p, opts) {
            Ok(dev) => Route::Gpu(dev),
            Err(why) => Route::Cpu(format!("no usable GPU: {why}")),
        },
        Backend::Cuda(dev) => Route::Gpu(dev),
    };
    if matches!(route, Route::Cpu(_)) && opts.variant != Variant::Auto {
        return Err(Error::VariantUnavailable {
            variant: opts.variant,
            reason: "GPU kernel families run only on a CUDA backend; this call runs on the CPU (use Variant::Auto)"
                .into(),
        });
    }
    Ok(route)
}

/// Attention forward pass: `softmax(mask(scale · Q·Kᵀ)) · V` per (batch, head), with the
/// options' mask, softcap, ALiBi, GQA and precision.
///
/// # Errors
/// Every invalid input or unavailable backend/variant is an [`Error`]; nothing panics.
pub fn forward(
    q: &impl AsTensorView,
    k: &impl AsTensorView,
    v: &impl AsTensorView,
    opts: &ForwardOptions,
) -> Result<Output> {
    let (q, k, v) = (q.as_view(), k.as_view(), v.as_view());
    let p = Problem::new(&q, &k, &v, opts)?;
    crate::problem::check_num_splits(opts)?;
    let why_cpu = match route(&p, opts)? {
        Route::Gpu(dev) => return crate::cuda_host::forward_host(&p, &q, &k, &v, opts, dev),
        Route::Cpu(why) => why,
    };
    let threads = cpu::threads(opts.cpu_threads);
    if let Some(dense) = cpu_dense_inplace(&p, (&q, &k, &v), opts, threads, &why_cpu)? {
        return Ok(dense);
    }
    let out = cpu::run(&p, &q, &k, &v, threads)?;
    Ok(Output {
        o: out.o,
        lse: p.return_lse.then_some(out.lse),
        dispatch: Dispatch { backend: "cpu".into(), kernel: out.kernel.into(), reason: why_cpu },
    })
}

/// A CPU call with few query rows (decode), which reads K/V in place rather than packing them for
/// 16-row panels: its output, or `None` when the call is not one (then the tiled path runs).
/// `forward` and `forward_into` both route through here, so both take the same path.
fn cpu_dense_inplace(
    p: &Problem,
    (q, k, v): (&TensorView<'_>, &TensorView<'_>, &TensorView<'_>),
    opts: &ForwardOptions,
    threads: usize,
    why_cpu: &str,
) -> Result<Option<Output>> {
    if !cpu::inplace::prefers_dense(p) {
        return Ok(None);
    }
    let layout = crate::serving::BatchLayout::dense(p.batch, p.seqlen_q, p.seqlen_k);
    let run = cpu::inplace::RunOpts { threads, splits: opts.num_splits, skip: &[], fp8: None };
    let out = crate::serving::run_inplace(p, &layout, (q, k, v), run)?;
    Ok(Some(Output {
        o: out.o,
        lse: p.return_lse.then_some(out.lse),
        dispatch: Dispatch {
            backend: "cpu".into(),
            kernel: cpu::inplace::path_name().into(),
            reason: format!(
                "{why_cpu}; seqlen_q {} <= {}: the in-place decode path, {} key split(s)",
                p.seqlen_q,
                cpu::inplace::DENSE_MAX_SEQLEN_Q,
                out.splits
            ),
        },
    }))
}

/// As [`forward`], writing the output into the caller's buffer instead of allocating one:
/// `out` is contiguous `[batch, seqlen_q, heads_q, head_dim_v]` (v's head_dim) of q's element type (e.g. a
/// candle CPU tensor's storage, or an engine's reused activation buffer). `lse`, when given,
/// receives the natural-log LSE `[batch, heads_q, seqlen_q]` (`opts.return_lse` is then
/// implied). The CPU backend writes the output straight into `out`; a GPU run downloads into it.
///
/// # Errors
/// As [`forward`]; [`Error::DTypeMismatch`] when `T` is not q's element type and
/// [`Error::ShapeMismatch`] when `out` or `lse` has the wrong length.
pub fn forward_into<T: Element>(
    q: &impl AsTensorView,
    k: &impl AsTensorView,
    v: &impl AsTensorView,
    out: &mut [T],
    lse: Option<&mut [f32]>,
    opts: &ForwardOptions,
) -> Result<Dispatch> {
    let (q, k, v) = (q.as_view(), k.as_view(), v.as_view());
    let mut p = Problem::new(&q, &k, &v, opts)?;
    p.return_lse = lse.is_some();
    if T::DTYPE != p.dtype {
        return Err(Error::DTypeMismatch { operand: Operand::O, got: T::DTYPE, expected: p.dtype });
    }
    let o_shape = [p.batch, p.seqlen_q, p.heads_q, p.head_dim_v];
    let n_o = numel(o_shape, "output")?;
    if out.len() != n_o {
        return Err(Error::ShapeMismatch {
            what: "forward_into output buffer".into(),
            got: format!("{} elements", out.len()),
            expected: format!("{n_o} elements (contiguous {o_shape:?})"),
        });
    }
    let n_lse = p.batch * p.heads_q * p.seqlen_q;
    if let Some(l) = &lse {
        if l.len() != n_lse {
            return Err(Error::ShapeMismatch {
                what: "forward_into lse buffer".into(),
                got: format!("{} f32", l.len()),
                expected: format!("{n_lse} f32 ([batch, heads_q, seqlen_q])"),
            });
        }
    }
    let why_cpu = match route(&p, opts)? {
        Route::Gpu(dev) => {
            return crate::cuda_host::forward_host_into(&p, &q, &k, &v, T::wrap_mut(out), lse, opts, dev)
        }
        Route::Cpu(why) => why,
    };
    let threads = cpu::threads(opts.cpu_threads);
    if let Some(dense) = cpu_dense_inplace(&p, (&q, &k, &v), opts, threads, &why_cpu)? {
        // The decode path's output is a few rows per sequence: copied, not worth a second path.
        out.copy_from_slice(&dense.o.into_vec::<T>()?);
        if let (Some(l), Some(lse_v)) = (lse, dense.lse) {
            l.copy_from_slice(&lse_v);
        }
        return Ok(dense.dispatch);
    }
    let (lse_v, kernel) = cpu::run_into(&p, &q, &k, &v, threads, T::wrap_mut(out))?;
    if let Some(l) = lse {
        l.copy_from_slice(&lse_v);
    }
    Ok(Dispatch { backend: "cpu".into(), kernel: kernel.into(), reason: why_cpu })
}

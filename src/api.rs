//! `forward`: validate, pick a backend, run.

use crate::cpu;
use crate::error::{Error, Result};
use crate::options::{Backend, ForwardOptions, Variant};
use crate::problem::Problem;
use crate::tensor::{AsTensorView, Tensor};

/// Where a forward pass ran and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dispatch {
    /// "cpu" or "cuda:N".
    pub backend: String,
    /// The kernel family or CPU path that ran, e.g. "cpu-tiled-avx2".
    pub kernel: String,
    /// Why this one was chosen.
    pub reason: String,
}

/// The result of [`forward`].
#[derive(Clone, Debug)]
pub struct Output {
    /// `[batch, seqlen_q, heads_q, head_dim]`, q's dtype.
    pub o: Tensor,
    /// `[batch, heads_q, seqlen_q]`, natural log, −inf for rows that see no key; present when
    /// `return_lse` was set.
    pub lse: Option<Vec<f32>>,
    pub dispatch: Dispatch,
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
    let (gpu, why_cpu) = match opts.backend {
        Backend::Cpu => (None, "Backend::Cpu requested".to_string()),
        Backend::Auto => match crate::cuda_host::auto_device(&p, opts) {
            Ok(dev) => (Some(dev), String::new()),
            Err(why) => (None, format!("no usable GPU: {why}")),
        },
        Backend::Cuda(dev) => (Some(dev), String::new()),
    };
    if let Some(dev) = gpu {
        return crate::cuda_host::forward_host(&p, &q, &k, &v, opts, dev);
    }
    if opts.variant != Variant::Auto {
        return Err(Error::VariantUnavailable {
            variant: opts.variant,
            reason: "GPU kernel families run only on a CUDA backend; this call runs on the CPU (use Variant::Auto)"
                .into(),
        });
    }
    let threads = cpu::threads(opts.cpu_threads);
    let out = cpu::run(&p, &q, &k, &v, threads)?;
    Ok(Output {
        o: out.o,
        lse: p.return_lse.then_some(out.lse),
        dispatch: Dispatch {
            backend: "cpu".into(),
            kernel: out.kernel.into(),
            reason: why_cpu,
        },
    })
}

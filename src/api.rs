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
    crate::serving::check_num_splits(opts)?;
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
    if cpu::inplace::prefers_dense(&p) {
        // Few query rows (decode): read K/V in place rather than pack them for 16-row panels.
        let layout = crate::serving::BatchLayout::dense(p.batch, p.seqlen_q, p.seqlen_k);
        let run = cpu::inplace::RunOpts { threads, splits: opts.num_splits, skip: &[] };
        let out = crate::serving::run_inplace(&p, &layout, (&q, &k, &v), run)?;
        return Ok(Output {
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
        });
    }
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

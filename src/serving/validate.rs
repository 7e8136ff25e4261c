//! What every serving entry point validates before it runs, forward and backward: the tensors'
//! memory, dtypes and shapes, the sequence layout and the options.

use super::layout::{BatchLayout, CacheRows, KvLayout, QueryLayout};
use crate::error::{Error, Operand, Result};
use crate::options::{Backend, ForwardOptions, Precision, Variant};
use crate::problem::Problem;
use crate::tensor::{Shape, TensorView};

/// Checks a tensor's memory; with `packed`, the seqlen dimension may be 0 (nothing is read).
pub(super) fn check_view(t: &TensorView<'_>, op: Operand, packed: bool) -> Result<()> {
    let [b, s, h, d] = t.shape();
    if packed && s == 0 && b > 0 && h > 0 && d > 0 {
        return Ok(());
    }
    t.check_layout(op)
}

/// Everything a serving call validates, in the order a caller would fix it: memory, dtypes,
/// shapes, the sequence layout (with each sequence's cache row and first key), then the options.
pub(super) fn prepare<'a>(
    q: &TensorView<'a>,
    k: &TensorView<'a>,
    v: &TensorView<'a>,
    (ql, kl, rows): (QueryLayout<'a>, KvLayout<'a>, CacheRows<'a>),
    opts: &ForwardOptions,
) -> Result<(Problem, BatchLayout<'a>)> {
    let q_packed = matches!(ql, QueryLayout::Varlen { .. });
    // A packed k and a dense cache may have 0 rows (nothing is read: the layout checks the
    // lengths); a paged cache with page size 0 is reported by the layout.
    let k_empty_ok = matches!(
        kl,
        KvLayout::Varlen { .. } | KvLayout::Cache { .. } | KvLayout::Paged { .. }
    );
    check_view(q, Operand::Q, q_packed)?;
    check_view(k, Operand::K, k_empty_ok)?;
    check_view(v, Operand::V, k_empty_ok)?;
    let dtype = q.dtype();
    for (op, t) in [(Operand::K, k), (Operand::V, v)] {
        if t.dtype() != dtype {
            return Err(Error::DTypeMismatch {
                operand: op,
                got: t.dtype(),
                expected: dtype,
            });
        }
    }
    // v may have its own head_dim (the output's); its other dimensions are k's.
    let [kb, ks, kh, _] = k.shape();
    if v.shape()[..3] != k.shape()[..3] {
        return Err(Error::ShapeMismatch {
            what: "v".into(),
            got: format!("{:?}", v.shape()),
            expected: format!(
                "{:?} (the shape of k), or [{kb}, {ks}, {kh}, head_dim_v] for a head_dim of v's own",
                k.shape()
            ),
        });
    }
    problem(q, k.shape(), v.shape()[3], (ql, kl, rows), opts)
}

/// The second half of [`prepare`], once k's and v's memory is known good (views, or an FP8
/// cache's codes): shapes, the sequence layout, then the options. `head_dim_v`: v's head_dim.
pub(super) fn problem<'a>(
    q: &TensorView<'a>,
    k_shape: Shape,
    head_dim_v: usize,
    (ql, kl, rows): (QueryLayout<'a>, KvLayout<'a>, CacheRows<'a>),
    opts: &ForwardOptions,
) -> Result<(Problem, BatchLayout<'a>)> {
    let dtype = q.dtype();
    let [_, _, hq, d] = q.shape();
    let [_, _, hkv, kd] = k_shape;
    if kd != d {
        return Err(Error::ShapeMismatch {
            what: "k".into(),
            got: format!("{k_shape:?}"),
            expected: format!("head_dim {d} (the head_dim of q)"),
        });
    }
    let layout = BatchLayout::with_cache_rows(ql, q.shape(), kl, k_shape, rows)?;
    let p = layout.launch_problem_v(hq, hkv, (d, head_dim_v), dtype, opts)?;
    if let Precision::Fp8 { .. } = p.precision {
        return Err(Error::InvalidOption {
            option: "precision",
            got: "Precision::Fp8".into(),
            expected: "Precision::Native on the varlen / KV-cache paths (the FP8 emulation runs on the dense forward)"
                .into(),
        });
    }
    crate::problem::check_num_splits(opts)?;
    if opts.variant != Variant::Auto && !matches!(opts.backend, Backend::Cuda(_)) {
        return Err(Error::VariantUnavailable {
            variant: opts.variant,
            reason: "GPU kernel families run only on a CUDA backend (Backend::Cuda); under Backend::Auto / Cpu the \
                     varlen / KV-cache paths run on the CPU (use Variant::Auto)"
                .into(),
        });
    }
    Ok((p, layout))
}

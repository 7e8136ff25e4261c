//! The bridge from host-memory `forward` to the CUDA backend. Without the `cuda` feature (or
//! without a driver, a device or built kernels) it reports why and the CPU runs instead.

use crate::error::{Error, Result};
use crate::options::ForwardOptions;
use crate::problem::Problem;
use crate::tensor::TensorView;

/// The device `Backend::Auto` uses, if any.
pub(crate) fn auto_device() -> Option<usize> {
    None
}

/// Why `Backend::Auto` did not pick a GPU.
pub(crate) fn why_no_gpu() -> String {
    "the CUDA backend is not built into this crate yet".into()
}

pub(crate) fn forward_host(
    _p: &Problem,
    _q: &TensorView,
    _k: &TensorView,
    _v: &TensorView,
    _opts: &ForwardOptions,
    dev: usize,
) -> Result<crate::Output> {
    Err(Error::BackendUnavailable { backend: format!("cuda:{dev}"), reason: why_no_gpu() })
}

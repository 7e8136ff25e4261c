//! What a forward pass returns: [`Output`] and [`Dispatch`]. Below both backends (the CPU
//! backend and the CUDA `Engine` build them) and the `forward` API that returns them.

use crate::tensor::Tensor;

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

/// The result of [`crate::forward`].
#[derive(Clone, Debug)]
pub struct Output {
    /// `[batch, seqlen_q, heads_q, head_dim]`, q's dtype.
    pub o: Tensor,
    /// `[batch, heads_q, seqlen_q]`, natural log, −inf for rows that see no key; present when
    /// `return_lse` was set.
    pub lse: Option<Vec<f32>>,
    pub dispatch: Dispatch,
}

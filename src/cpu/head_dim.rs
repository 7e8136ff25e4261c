//! The CPU backend's head_dim limit, checked by every path before it reads any input.

use crate::error::{Error, Result};
use crate::problem::Problem;

/// Largest head_dim the CPU backend accepts, on q/k's side and on v's: 576, the q/k head_dim of
/// DeepSeek MLA's absorbed decode (a 512-wide latent plus 64 rotary dims, with v's 512).
pub const MAX_HEAD_DIM: usize = 576;

/// [`Error::UnsupportedHeadDim`] when q/k's or v's head_dim is past [`MAX_HEAD_DIM`] (each on
/// its own: any pair within the limit runs), which both paths check before reading any input
/// (the tiled path's row of zeros is `MAX_HEAD_DIM` long).
pub(crate) fn check_head_dim(p: &Problem) -> Result<()> {
    for (head_dim, of) in [(p.head_dim, "q and k"), (p.head_dim_v, "v")] {
        if head_dim > MAX_HEAD_DIM {
            return Err(Error::UnsupportedHeadDim {
                head_dim,
                backend: "the CPU backend".into(),
                supported: format!("1..={MAX_HEAD_DIM} (for the head_dim of {of})"),
            });
        }
    }
    Ok(())
}

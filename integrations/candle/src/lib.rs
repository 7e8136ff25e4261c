//! FlashAttention for candle: a drop-in for `candle-flash-attn`, plus what it lacks.
//!
//! - [`dropin`]: every public function of candle-flash-attn 0.11 with the same name, arguments
//!   and semantics (`flash_attn`, `flash_attn_windowed`, ..., `flash_attn_varlen_alibi_windowed_softcap`),
//!   re-exported at the root: `use candle_flash_attn as fa;` → `use flash_attn_candle as fa;`.
//! - [`Attention`]: the candle `CustomOp3` behind them, with flash_attn's [`ForwardOptions`];
//!   [`flash_attn_with_options`] and [`flash_attn_lse`] apply it (the LSE comes out too).
//! - [`serving`]: varlen with LSE, attention over dense and paged KV caches, the KV append into
//!   candle cache tensors, `merge_states`.
//!
//! On CPU storage the ops borrow candle's buffers as strided views and run flash_attn's CPU
//! backend, handing the output `Vec` back to candle (no copy of inputs or output). On CUDA
//! storage (feature `cuda`) the dense op launches flash_attn's kernels on candle's stream.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use flash_attn_candle as fa;
//! # fn main() -> candle_core::Result<()> {
//! let q = Tensor::randn(0f32, 1., (1, 64, 4, 32), &Device::Cpu)?; // [b, s, h, d]
//! let o = fa::flash_attn(&q, &q, &q, 1.0 / (32f32).sqrt(), true)?;
//! assert_eq!(o.dims(), &[1, 64, 4, 32]);
//! # Ok(()) }
//! ```

mod backward;
mod convert;
#[cfg(feature = "cuda")]
mod cuda;
pub mod dropin;
mod op;
pub mod serving;

pub use dropin::*;
pub use flash_attn::{ForwardOptions, Mask};
pub use op::{flash_attn_lse, flash_attn_with_options, Attention};

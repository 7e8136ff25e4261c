//! # flash_attn
//!
//! FlashAttention forward passes for Rust engines: `flash_attn::forward(&q, &k, &v, &opts)`
//! picks the best kernel for the GPU it finds at run time, or runs the multi-threaded CPU
//! backend (the same tiled online-softmax algorithm) when there is none.
//!
//! [`backward`] gives the gradients dq, dk, dv of a forward call on the CPU backend
//! (FlashAttention-2's algorithm, deterministic; docs/backward.md).
//!
//! Layout is FlashAttention's `[batch, seqlen, heads, head_dim]`; causal masks are aligned to the
//! bottom-right corner; GQA/MQA by fewer kv heads; softcap, ALiBi, sliding windows; LSE output.
//!
//! ```
//! use flash_attn::{forward, ForwardOptions, Mask, Tensor};
//! let (b, s, h, d) = (1, 64, 4, 64);
//! let x: Vec<f32> = (0..b * s * h * d).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
//! let q = Tensor::from_vec(x.clone(), [b, s, h, d])?;
//! let k = Tensor::from_vec(x.clone(), [b, s, h, d])?;
//! let v = Tensor::from_vec(x, [b, s, h, d])?;
//! let out = forward(&q, &k, &v, &ForwardOptions::default().mask(Mask::Causal).return_lse(true))?;
//! assert_eq!(out.o.shape(), [b, s, h, d]);
//! # Ok::<(), flash_attn::Error>(())
//! ```
//!
//! | module | role |
//! |---|---|
//! | [`reference`](mod@reference) | naive float64 attention, used only to check |
//! | `cpu` | the CPU backend (tiled online softmax in 16-query panels, 6×16 AVX2 micro-kernel, std threads) |
//! | [`numerics`] | exp2 polynomial, FP8, Hadamard: shared constants with `cuda/common/` |
//! | `cuda` (feature `cuda`) | kernel table, dispatch, device-memory `Engine` over embedded cubins (docs/cuda.md) |
//! | `bench` (feature `bench`) | measurement tooling: FLOP/byte model, roofline ceilings, FP8 baselines |
//! | [`serving`] | varlen batches, dense and paged KV caches with append, split-KV decode, `merge_states` (docs/serving.md) |

#![cfg_attr(docsrs, feature(doc_cfg))]

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

mod api;
mod backward;
mod batch_layout;
#[cfg(feature = "bench")]
#[cfg_attr(docsrs, doc(cfg(feature = "bench")))]
pub mod bench;
mod convert;
mod cpu;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
mod cuda_host;
mod dtype;
mod error;
mod fp8_kv_host;
mod names;
pub mod numerics;
mod options;
mod output;
mod problem;
pub mod reference;
mod rotary_positions;
pub mod serving;
mod splits;
mod tensor;

pub use api::{forward, forward_into};
pub use backward::{backward, backward_into, Gradients};
pub use output::{Dispatch, Output};
pub use error::{Error, Operand, Result};
pub use options::{Backend, Exp2, Fp8Scaling, ForwardOptions, Mask, Precision, Rescale, Variant};
pub use problem::{Problem, LOG2E, MIN_SOFTMAX_SCALE};
pub use tensor::{AsTensorView, DType, Data, DataMut, Element, OwnedData, Shape, Tensor, TensorView};

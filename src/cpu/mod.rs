//! The CPU backend: FlashAttention's algorithm on the host, in two paths over shared parts.
//!
//! - [`tiled`]: the dense forward. K and V of each (batch, kv head) are packed once, and blocks
//!   of query rows stream over key tiles through a 6×16 register micro-kernel.
//! - [`inplace`]: attention that reads K and V where they lie (dense, a KV cache, a paged cache,
//!   variable-length batches), for decode and serving.
//!
//! Both use the instruction set detected at run time ([`isa`]), the online-softmax verbs
//! ([`softmax`]) with the native arithmetic ([`native`]), the score formation ([`score`]), the
//! persistent worker pool ([`parallel`]), the reused buffers ([`pool`]) and the rule for how the
//! caller's K/V rows lie ([`rows`]). The products are in [`gemm`] (the tiled micro-kernel),
//! [`row_products`] (dot products and `o += p·v` along head_dim) and [`simd`] (the tiled path's
//! AVX-512 kernels).

pub(crate) mod backward;
pub(crate) mod gemm;
pub(crate) mod head_dim;
pub(crate) mod inplace;
pub(crate) mod isa;
pub(crate) mod native;
pub(crate) mod parallel;
pub(crate) mod pool;
pub(crate) mod row_products;
pub mod row_state;
pub(crate) mod rows;
pub(crate) mod score;
pub(crate) mod simd;
pub mod softmax;
pub(crate) mod tiled;

pub(crate) use native::Native;
pub(crate) use parallel::threads;
#[cfg(any(test, feature = "bench"))]
pub(crate) use tiled::forward_with;
pub(crate) use tiled::{path_name, run, run_into};


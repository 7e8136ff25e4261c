//! The caches the KV-cache entry points take, behind two sealed traits: [`ReadKvCache`] for
//! [`forward_kvcache`](super::forward_kvcache) and
//! [`forward_varlen_kvcache`](super::forward_varlen_kvcache), [`WriteKvCache`] for
//! [`append_kv`](super::append_kv) and [`forward_kvcache_append`](super::forward_kvcache_append).
//! Each is implemented by the f32 / f16 / bf16 caches ([`KvCache`](super::KvCache),
//! [`KvCacheMut`](super::KvCacheMut)) and the FP8 ones ([`Fp8KvCache`](super::Fp8KvCache),
//! [`Fp8KvCacheMut`](super::Fp8KvCacheMut)).

use super::kv_scales::KvScales;
use super::layout::{CacheRows, KvLayout};
use super::rotary::Rotary;
use crate::error::Result;
use crate::options::ForwardOptions;
use crate::output::Output;
use crate::tensor::{Shape, TensorView};

/// A paged cache's block table: `[batch, max_blocks_per_seq]` block ids, row-major.
#[derive(Clone, Copy, Debug)]
pub struct BlockTable<'a> {
    pub ids: &'a [i32],
    pub max_blocks_per_seq: usize,
}

/// Where a call reads K and V.
#[derive(Clone, Copy, Debug)]
pub enum KvSource<'a> {
    /// f32 / f16 / bf16 views.
    Views(TensorView<'a>, TensorView<'a>),
    /// An FP8 cache: contiguous e4m3 codes of `shape` and their scales.
    Fp8 {
        k: &'a [u8],
        v: &'a [u8],
        shape: Shape,
        scales: KvScales<'a>,
    },
}

impl<'a> KvSource<'a> {
    /// The views the layout and the CPU path index K and V by: the views themselves, or for an
    /// FP8 cache views of its shape that hold no elements (its rows are read from the codes).
    pub(super) fn views(&self) -> (TensorView<'a>, TensorView<'a>) {
        match *self {
            KvSource::Views(k, v) => (k, v),
            KvSource::Fp8 { shape, .. } => {
                let none: &'static [f32] = &[];
                (TensorView::new(none, shape), TensorView::new(none, shape))
            }
        }
    }
}

/// The sequence layout of a cache: sequence `b` has `seqlens[b] + new` keys.
pub(super) fn cache_layout<'a>(seqlens: &'a [i32], block_table: Option<BlockTable<'a>>, new: usize) -> KvLayout<'a> {
    match block_table {
        None => KvLayout::Cache { seqlens, new },
        Some(bt) => KvLayout::Paged {
            block_table: bt.ids,
            max_blocks_per_seq: bt.max_blocks_per_seq,
            seqlens,
            new,
        },
    }
}

pub(super) mod sealed {
    use super::*;

    /// A cache to read.
    pub trait Read {
        /// Its K and V, and its layout with `new` more keys per sequence than `seqlens` counts.
        fn source(&self, new: usize) -> (KvSource<'_>, KvLayout<'_>);
        /// Each sequence's cache row and first key (`batch_idx`, `leftpad`; none by default).
        fn rows(&self) -> CacheRows<'_> {
            CacheRows::default()
        }
    }

    /// A cache to append to.
    pub trait Write: Read {
        /// Validates an append of `k_new`, `v_new`; returns the element offset of every row to
        /// write, in (sequence, new row) order. Writes nothing.
        fn check_append(&self, k_new: &TensorView<'_>, v_new: &TensorView<'_>) -> Result<Vec<usize>>;
        /// Writes the rows [`Write::check_append`] accepted at its `slots`; with `rotary`, each
        /// k row rotated to its cache position (`seqlens[b] + i`) first, in f32.
        fn write_rows(&mut self, k_new: &TensorView<'_>, v_new: &TensorView<'_>, slots: &[usize], rotary: Option<&Rotary<'_>>);
        /// The append (rotating with `rotary`) and the attention of `q` on CUDA device `dev`, for
        /// an append [`Write::check_append`] accepted: the cache is written only when every
        /// launch succeeded.
        fn append_on_device(
            &mut self,
            q: &TensorView<'_>,
            new: (&TensorView<'_>, &TensorView<'_>),
            rotary: Option<&Rotary<'_>>,
            opts: &ForwardOptions,
            dev: usize,
        ) -> Result<Output>;
    }
}

/// A KV cache that [`forward_kvcache`](super::forward_kvcache) and
/// [`forward_varlen_kvcache`](super::forward_varlen_kvcache) read: [`KvCache`](super::KvCache)
/// (f32 / f16 / bf16) or [`Fp8KvCache`](super::Fp8KvCache) (e4m3 with f32 scales). Sealed.
pub trait ReadKvCache: sealed::Read {}

/// A KV cache that [`append_kv`](super::append_kv) and
/// [`forward_kvcache_append`](super::forward_kvcache_append) write:
/// [`KvCacheMut`](super::KvCacheMut) (f32 / f16 / bf16) or [`Fp8KvCacheMut`](super::Fp8KvCacheMut)
/// (e4m3 with f32 scales). Sealed.
pub trait WriteKvCache: sealed::Write {}

impl<T: sealed::Read> ReadKvCache for T {}
impl<T: sealed::Write> WriteKvCache for T {}

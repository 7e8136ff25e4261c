//! Serving shapes: variable-length batches, KV caches (dense or paged, with append), split-KV
//! decode, and merging attention states. FlashAttention's semantics
//! (`flash_attn_varlen_func`, `flash_attn_with_kvcache`) and FlashInfer's `merge_state`;
//! docs/serving.md has the full description and the plan for the GPU kernels.
//!
//! | function | FlashAttention / FlashInfer | q | k, v |
//! |---|---|---|---|
//! | [`forward_varlen`] | `flash_attn_varlen_func` | packed `[1, total_q, hq, d]` | packed `[1, total_k, hkv, d]` |
//! | [`forward_kvcache`] | `flash_attn_with_kvcache` | `[batch, seqlen_q, hq, d]` | dense or paged cache |
//! | [`forward_varlen_kvcache`] | `flash_attn_varlen_func(block_table=..)` | packed | dense or paged cache |
//! | [`forward_kvcache_append`] | `flash_attn_with_kvcache(k=.., v=..)` | `[batch, seqlen_new, hq, d]` | cache, written then read |
//! | [`forward_kvcache_append_rotary`] | the same with `rotary_cos`, `rotary_sin` | `[batch, seqlen_new, hq, d]` | cache, written then read |
//! | [`merge_states`], [`merge_states_n`] | `merge_state`, `merge_states` | | |
//! | [`backward_varlen`] | `flash_attn_varlen_func` (backward) | packed | packed |
//!
//! Every mask, softcap, ALiBi slope, GQA group and LSE applies per sequence, with causal and
//! window masks aligned to the bottom-right of each sequence's own score matrix. Sequences of
//! length 0 are allowed (no output rows; a query that sees no key gives 0 and LSE −inf).
//! A dense cache also takes FlashAttention's `cache_batch_idx` and `cache_leftpad`
//! ([`KvCache::batch_idx`], [`KvCache::leftpad`]).
//!
//! These run on the CPU backend (the in-place path: no repack of the cache per call, all
//! query heads of a GQA group in one pass over their K/V, split-KV when the workers would idle).
//!
//! Every cache entry point also takes an FP8 cache ([`Fp8KvCache`], [`Fp8KvCacheMut`]: e4m3
//! codes with per-tensor or per-(token, head) f32 scales), dequantised as it is read and
//! quantised as rows are appended; see [`Fp8KvCache`] and docs/serving.md.
//!
//! ```
//! # fn main() -> Result<(), flash_attn::Error> {
//! use flash_attn::serving::{forward_kvcache_append, BlockTable, KvCacheMut};
//! use flash_attn::{ForwardOptions, Mask, Tensor};
//! // 2 sequences, 8 query heads on 2 kv heads, head_dim 64, pages of 16 keys, 8 blocks.
//! let (hq, hkv, d, page) = (8, 2, 64, 16);
//! let mut k_cache = vec![0.0f32; 8 * page * hkv * d];
//! let mut v_cache = k_cache.clone();
//! let table = [3, 0, 5, -1, 1, 7, 2, 6]; // [batch, 4 blocks per sequence], any order
//! let seqlens = [20, 33]; // keys already cached
//! let q = Tensor::from_vec(vec![0.1f32; 2 * hq * d], [2, 1, hq, d])?; // one new token each
//! let k_new = Tensor::from_vec(vec![0.2f32; 2 * hkv * d], [2, 1, hkv, d])?;
//! let mut cache = KvCacheMut {
//!     k: &mut k_cache,
//!     v: &mut v_cache,
//!     shape: [8, page, hkv, d],
//!     seqlens: &seqlens,
//!     block_table: Some(BlockTable { ids: &table, max_blocks_per_seq: 4 }),
//!     batch_idx: None,
//!     leftpad: None,
//! };
//! let opts = ForwardOptions::default().mask(Mask::Causal).return_lse(true);
//! let out = forward_kvcache_append(&q, &mut cache, &k_new, &k_new, &opts)?;
//! assert_eq!(out.o.shape(), [2, 1, hq, d]); // the caller now counts 21 and 34 cached keys
//! # Ok(())
//! # }
//! ```

mod append;
mod backward;
mod cache_source;
mod fp8_cache;
mod kv_scales;
mod rotary;
mod validate;
mod varlen;
pub mod layout;
// The merge is shared with the backends, which sit below this API: it lives in `numerics`.
pub(crate) use crate::numerics::merge;

pub use backward::backward_varlen;
pub use cache_source::{BlockTable, ReadKvCache, WriteKvCache};
pub use fp8_cache::{Fp8KvCache, Fp8KvCacheMut};
pub use kv_scales::{KvScales, KvScalesMut};
pub use layout::{BatchLayout, CacheRows, KvLayout, QueryLayout};
pub use rotary::Rotary;
pub use varlen::Varlen;
pub use merge::{merge_states, merge_states_n, AttentionState};

use crate::output::{Dispatch, Output};
use crate::cpu;
use crate::cpu::inplace;
use crate::error::{Error, Operand, Result};
use crate::numerics::softmax_math::SoftmaxMath;
use crate::options::{Backend, ForwardOptions};
use crate::problem::Problem;
use crate::tensor::{numel, AsTensorView, Data, Element, OwnedData, Shape, TensorView};
use append::{append_slots, for_new_rows};
use cache_source::{cache_layout, sealed, KvSource};
use fp8_cache::{check_buffers, check_read_scales};
use validate::{check_view, prepare, problem};

/// A KV cache to attend over (read only).
///
/// - Dense: `k`, `v` are `[batch, capacity, heads_kv, head_dim]`; sequence `b` uses its first
///   `seqlens[b]` rows.
/// - Paged: `k`, `v` are `[num_blocks, page_size, heads_kv, head_dim]` (any page size),
///   `block_table` maps each sequence's pages to blocks, in any order, shared or not.
///
/// `batch_idx` and `leftpad` (dense caches only, as in FlashAttention) place each sequence in
/// the cache: see [`CacheRows`].
#[derive(Clone, Copy, Debug)]
pub struct KvCache<'a> {
    pub k: TensorView<'a>,
    pub v: TensorView<'a>,
    /// Keys per sequence (FlashAttention's `cache_seqlens`), counted from cache position 0.
    pub seqlens: &'a [i32],
    pub block_table: Option<BlockTable<'a>>,
    /// Sequence `b` uses cache row `batch_idx[b]` (FlashAttention's `cache_batch_idx`; `None`:
    /// row `b`). The cache may then hold more rows than the batch has sequences.
    pub batch_idx: Option<&'a [i32]>,
    /// Sequence `b`'s keys start at cache position `leftpad[b] <= seqlens[b]` (FlashAttention's
    /// `cache_leftpad`; `None`: 0): it sees `seqlens[b] - leftpad[b]` keys, and masks and ALiBi
    /// count them from there.
    pub leftpad: Option<&'a [i32]>,
}

impl<'a> KvCache<'a> {
    /// A dense cache `[batch, capacity, heads_kv, head_dim]`.
    pub fn dense(k: TensorView<'a>, v: TensorView<'a>, seqlens: &'a [i32]) -> Self {
        KvCache {
            k,
            v,
            seqlens,
            block_table: None,
            batch_idx: None,
            leftpad: None,
        }
    }
    /// A paged cache `[num_blocks, page_size, heads_kv, head_dim]` with its block table.
    pub fn paged(k: TensorView<'a>, v: TensorView<'a>, seqlens: &'a [i32], block_table: BlockTable<'a>) -> Self {
        KvCache {
            k,
            v,
            seqlens,
            block_table: Some(block_table),
            batch_idx: None,
            leftpad: None,
        }
    }
}

/// A KV cache this call may write (contiguous buffers), for [`append_kv`] and
/// [`forward_kvcache_append`]. `shape` is k's: `[batch, capacity, heads_kv, head_dim]` (dense) or
/// `[num_blocks, page_size, heads_kv, head_dim]` (paged, with `block_table`). v has the same
/// rows with its own head_dim, the one its buffer's length gives (`v.len() / (shape[0] ·
/// shape[1] · shape[2])`, which must divide exactly): `head_dim` for the usual cache, another
/// for a V head_dim that differs from Q/K's (see [`KvCacheMut::head_dim_v`]). `batch_idx` and
/// `leftpad` as [`KvCache`]'s (dense caches only).
#[derive(Debug)]
pub struct KvCacheMut<'a, T: Element> {
    pub k: &'a mut [T],
    pub v: &'a mut [T],
    pub shape: Shape,
    /// Keys already cached per sequence; new rows go to positions `seqlens[b]..`. Not updated
    /// by the call (as FlashAttention's `cache_seqlens`): add the appended count yourself.
    pub seqlens: &'a [i32],
    pub block_table: Option<BlockTable<'a>>,
    /// Sequence `b` reads and writes cache row `batch_idx[b]` (FlashAttention's
    /// `cache_batch_idx`); an append refuses two sequences on one row.
    pub batch_idx: Option<&'a [i32]>,
    /// Sequence `b`'s keys start at cache position `leftpad[b]` (FlashAttention's
    /// `cache_leftpad`); new rows still go to `seqlens[b]..`.
    pub leftpad: Option<&'a [i32]>,
}

impl<T: Element> KvCacheMut<'_, T> {
    fn views(&self) -> (TensorView<'_>, TensorView<'_>) {
        let [n, cap, h, d] = self.shape;
        let dv = self.head_dim_v().unwrap_or(d);
        (TensorView::new(self.k, self.shape), TensorView::new(self.v, [n, cap, h, dv]))
    }

    /// v's head_dim: its buffer's length over the cache's rows (`shape[0] · shape[1] ·
    /// shape[2]`), or k's head_dim for a cache without rows; `None` when the rows do not divide
    /// the length or it is 0 (a buffer of no shape of these rows).
    pub fn head_dim_v(&self) -> Option<usize> {
        let [n, cap, h, d] = self.shape;
        let rows = n.checked_mul(cap)?.checked_mul(h)?;
        match rows {
            0 => self.v.is_empty().then_some(d),
            _ => (!self.v.is_empty() && self.v.len().is_multiple_of(rows)).then_some(self.v.len() / rows),
        }
    }
}

impl sealed::Read for KvCache<'_> {
    fn source(&self, new: usize) -> (KvSource<'_>, KvLayout<'_>) {
        (KvSource::Views(self.k, self.v), cache_layout(self.seqlens, self.block_table, new))
    }
    fn rows(&self) -> CacheRows<'_> {
        CacheRows {
            batch_idx: self.batch_idx,
            leftpad: self.leftpad,
        }
    }
}

impl<T: Element> sealed::Read for KvCacheMut<'_, T> {
    fn source(&self, new: usize) -> (KvSource<'_>, KvLayout<'_>) {
        let (k, v) = self.views();
        (KvSource::Views(k, v), cache_layout(self.seqlens, self.block_table, new))
    }
    fn rows(&self) -> CacheRows<'_> {
        CacheRows {
            batch_idx: self.batch_idx,
            leftpad: self.leftpad,
        }
    }
}

impl<T: Element> sealed::Write for KvCacheMut<'_, T> {
    fn check_append(&self, k_new: &TensorView<'_>, v_new: &TensorView<'_>) -> Result<Vec<usize>> {
        check_append(self, k_new, v_new)
    }
    fn write_rows(&mut self, k_new: &TensorView<'_>, v_new: &TensorView<'_>, slots: &[usize], rotary: Option<&Rotary<'_>>) {
        write_rows(self, k_new, v_new, slots, rotary)
    }
    fn append_on_device(
        &mut self,
        q: &TensorView<'_>,
        new: (&TensorView<'_>, &TensorView<'_>),
        rotary: Option<&Rotary<'_>>,
        opts: &ForwardOptions,
        dev: usize,
    ) -> Result<Output> {
        append_on_device(self, q, new, rotary, opts, dev)
    }
}

/// [`sealed::Write::append_on_device`] of an f32 / f16 / bf16 cache: the kernels write a device
/// copy of the cache (rotating k_new and q with a rotary), which replaces the caller's once every
/// launch succeeded.
fn append_on_device<T: Element>(
    cache: &mut KvCacheMut<'_, T>,
    q: &TensorView<'_>,
    new: (&TensorView<'_>, &TensorView<'_>),
    rotary: Option<&Rotary<'_>>,
    opts: &ForwardOptions,
    dev: usize,
) -> Result<Output> {
    let (out, k, v) = {
        let (kv, vv) = cache.views();
        let kl = cache_layout(cache.seqlens, cache.block_table, new.0.seqlen());
        let rows = sealed::Read::rows(cache);
        let rot = rotary.map(|r| (r.cos, r.sin, r.rotary_dim, r.interleaved));
        crate::cuda_host::serving_append_host((q, &kv, &vv), new, rot, (QueryLayout::Dense, kl, rows), opts, dev)?
    };
    match (T::unwrap_owned(k), T::unwrap_owned(v)) {
        (Ok(k), Ok(v)) if k.len() == cache.k.len() && v.len() == cache.v.len() => {
            cache.k.copy_from_slice(&k);
            cache.v.copy_from_slice(&v);
            Ok(out)
        }
        _ => Err(Error::DTypeMismatch { operand: Operand::K, got: out.o.dtype(), expected: T::DTYPE }),
    }
}

/// Attention over a variable-length batch: q `[1, total_q, heads_q, head_dim]`, k and v
/// `[1, total_k, heads_kv, head_dim]`, sequences given by `seqs` (FlashAttention's
/// `flash_attn_varlen_func`). Returns `o` as `[1, total_q, heads_q, head_dim]` and the LSE in
/// FlashAttention's packed layout `[heads_q, total_q]`.
///
/// # Errors
/// Malformed offsets are [`Error::InvalidSeqLayout`] (see [`BatchLayout::new`] for the rules),
/// everything else as [`crate::forward`].
pub fn forward_varlen(
    q: &impl AsTensorView,
    k: &impl AsTensorView,
    v: &impl AsTensorView,
    seqs: &Varlen<'_>,
    opts: &ForwardOptions,
) -> Result<Output> {
    let ql = QueryLayout::Varlen {
        cu_seqlens: seqs.cu_seqlens_q,
        max_seqlen: seqs.max_seqlen_q,
    };
    let kl = KvLayout::Varlen {
        cu_seqlens: seqs.cu_seqlens_k,
        max_seqlen: seqs.max_seqlen_k,
    };
    let src = KvSource::Views(k.as_view(), v.as_view());
    run(&q.as_view(), &src, (ql, kl, CacheRows::default()), 0, opts, "varlen")
}

/// Attention of `q` `[batch, seqlen_q, heads_q, head_dim]` over a KV cache, sequence `b` seeing
/// its `cache.seqlens[b]` keys (from `cache.leftpad[b]`, in row `cache.batch_idx[b]`), causal
/// masks aligned to each sequence's last key (FlashAttention's `flash_attn_with_kvcache`
/// without `k`/`v`). LSE as `[batch, heads_q, seqlen_q]`.
///
/// # Errors
/// As [`forward_varlen`]; a `cache_seqlens` beyond the cache, a block id or `batch_idx` entry
/// outside it, a `leftpad` above its `seqlens`, and `batch_idx` or `leftpad` with a paged cache
/// are [`Error::InvalidSeqLayout`]; an FP8 cache's scale that is not a finite number > 0 (per
/// tensor, or of a slot the call reads) is an [`Error::InvalidScale`]. Under `Backend::Cuda`,
/// an FP8 cache runs on FA2's kernels (FA3's stages 3-5 with `Variant::Fa3`).
pub fn forward_kvcache(q: &impl AsTensorView, cache: &impl ReadKvCache, opts: &ForwardOptions) -> Result<Output> {
    let (src, kl) = cache.source(0);
    run(&q.as_view(), &src, (QueryLayout::Dense, kl, cache.rows()), 0, opts, "kvcache")
}

/// A packed batch of queries `[1, total_q, heads_q, head_dim]` (`cu_seqlens_q`,
/// `max_seqlen_q`) over a KV cache (chunked prefill against a paged cache; FlashAttention's
/// `flash_attn_varlen_func` with `block_table`). Output and LSE as [`forward_varlen`]. A dense
/// cache's `batch_idx` and `leftpad` apply as in [`forward_kvcache`].
///
/// # Errors
/// As [`forward_varlen`] and [`forward_kvcache`].
pub fn forward_varlen_kvcache(
    q: &impl AsTensorView,
    cu_seqlens_q: &[i32],
    max_seqlen_q: usize,
    cache: &impl ReadKvCache,
    opts: &ForwardOptions,
) -> Result<Output> {
    let ql = QueryLayout::Varlen {
        cu_seqlens: cu_seqlens_q,
        max_seqlen: max_seqlen_q,
    };
    let (src, kl) = cache.source(0);
    run(&q.as_view(), &src, (ql, kl, cache.rows()), 0, opts, "varlen-kvcache")
}

/// Writes this step's keys and values into the cache: row `i` of sequence `b` of `k_new`,
/// `v_new` (`[batch, seqlen_new, heads_kv, head_dim]`, the cache's dtype; any one float dtype
/// for an FP8 cache, which quantises them) goes to key position `cache.seqlens[b] + i`, in the
/// block the block table names for it (or in row `cache.batch_idx[b]` of a dense cache).
/// `cache.seqlens` is not changed.
///
/// Everything is validated before the first write: on error the cache is untouched.
///
/// # Errors
/// Shapes and dtypes as [`crate::forward`]; positions past the cache's capacity, block ids or
/// `batch_idx` entries out of range, two sequences writing the same slot (a block shared by
/// both) or the same cache row (`batch_idx`), and `leftpad` as in [`forward_kvcache`] are
/// [`Error::InvalidSeqLayout`]; an FP8 cache's per-tensor scale that is not a finite number > 0
/// is an [`Error::InvalidScale`].
pub fn append_kv(cache: &mut impl WriteKvCache, k_new: &impl AsTensorView, v_new: &impl AsTensorView) -> Result<()> {
    let (k_new, v_new) = (k_new.as_view(), v_new.as_view());
    let slots = cache.check_append(&k_new, &v_new)?;
    cache.write_rows(&k_new, &v_new, &slots, None);
    Ok(())
}

/// `flash_attn_with_kvcache` with `k`, `v`: appends `k_new`, `v_new` to the cache as
/// [`append_kv`] does, then attends `q` `[batch, seqlen_q, heads_q, head_dim]` over the
/// `seqlens[b] + seqlen_new` keys of each sequence (old and new), in one call. Output and LSE as
/// [`forward_kvcache`]. With a rotary embedding: [`forward_kvcache_append_rotary`].
///
/// Every argument (the attention's too) is validated before the cache is written.
///
/// # Errors
/// As [`append_kv`] and [`forward_kvcache`].
pub fn forward_kvcache_append(
    q: &impl AsTensorView,
    cache: &mut impl WriteKvCache,
    k_new: &impl AsTensorView,
    v_new: &impl AsTensorView,
    opts: &ForwardOptions,
) -> Result<Output> {
    append_then_attend(&q.as_view(), cache, &k_new.as_view(), &v_new.as_view(), None, opts)
}

/// [`forward_kvcache_append`] with a rotary embedding (`flash_attn_with_kvcache` with
/// `rotary_cos`, `rotary_sin`, `rotary_interleaved`): row `i` of `k_new` for sequence `b` is
/// rotated to position `seqlens[b] + i` before it is written, and q is rotated before the
/// attention (in a copy: the caller's q is not changed), row `i` to `seqlens[b] + i` under a
/// causal or window mask, every row to `seqlens[b]` otherwise (FlashAttention's rule). Positions
/// count cache rows from 0, `leftpad` included. v is not rotated.
///
/// # Errors
/// As [`forward_kvcache_append`]; a `rotary_dim` that is odd or above head_dim, tables of
/// another shape, and tables without a row for every position rotated at are
/// [`Error::InvalidOption`]. The cache is untouched on error.
///
/// Under `Backend::Cuda` the append kernel rotates and writes the rows on a device copy of the
/// cache, the attention reads it, and the cache is written back once every launch succeeded
/// (compile-checked only; the kernels ran in the emulator).
pub fn forward_kvcache_append_rotary(
    q: &impl AsTensorView,
    cache: &mut impl WriteKvCache,
    k_new: &impl AsTensorView,
    v_new: &impl AsTensorView,
    rotary: &Rotary<'_>,
    opts: &ForwardOptions,
) -> Result<Output> {
    append_then_attend(&q.as_view(), cache, &k_new.as_view(), &v_new.as_view(), Some(rotary), opts)
}

fn append_then_attend(
    q: &TensorView<'_>,
    cache: &mut impl WriteKvCache,
    k_new: &TensorView<'_>,
    v_new: &TensorView<'_>,
    rotary: Option<&Rotary<'_>>,
    opts: &ForwardOptions,
) -> Result<Output> {
    let slots = cache.check_append(k_new, v_new)?;
    let new = k_new.seqlen();
    // Everything is checked, and q's rotated copy made, before the first write. The rows about
    // to be written are not checked (an FP8 cache's scales for them are set by the write).
    let on_device = match opts.backend {
        Backend::Cuda(dev) => Some(dev),
        _ => None,
    };
    let q_rot = {
        let (src, kl) = cache.source(new);
        prepare_source(q, &src, (QueryLayout::Dense, kl, cache.rows()), new, opts)?;
        match rotary {
            Some(rot) => {
                let (advance, seqlens) = check_rotary(rot, q, new, &src, kl, opts)?;
                // On the GPU the append kernel rotates q (and k_new) itself.
                on_device.is_none().then(|| rotary::rotated_q(q, rot, seqlens, advance)).transpose()?
            }
            None => None,
        }
    };
    if let Some(dev) = on_device {
        return cache.append_on_device(q, (k_new, v_new), rotary, opts, dev);
    }
    cache.write_rows(k_new, v_new, &slots, rotary);
    let (src, kl) = cache.source(new);
    let q = q_rot.as_ref().map_or(*q, |t| t.view());
    run(&q, &src, (QueryLayout::Dense, kl, cache.rows()), 0, opts, "kvcache-append")
}

/// Validates a rotary embedding against the call (`new` rows appended to the cache `src` laid
/// out as `kl`); returns whether q's rows advance (FlashAttention's causal-or-local rule) and the
/// cache's `seqlens`.
fn check_rotary<'a>(
    rot: &Rotary<'_>,
    q: &TensorView<'_>,
    new: usize,
    src: &KvSource<'_>,
    kl: KvLayout<'a>,
    opts: &ForwardOptions,
) -> Result<(bool, &'a [i32])> {
    rot.check(q.head_dim())?;
    let seqlens = match kl {
        KvLayout::Paged { seqlens, .. } | KvLayout::Cache { seqlens, .. } => seqlens,
        // A writable cache is laid out as one of the two above.
        KvLayout::Dense | KvLayout::Varlen { .. } => &[][..],
    };
    let capacity = crate::rotary_positions::cache_capacity(kl, src.views().0.shape());
    let advance = crate::rotary_positions::q_rows_advance(opts.mask, capacity);
    // Positions seqlens[b] + i for the new keys, and for q's rows (or seqlens[b] alone).
    crate::rotary_positions::check_covers(rot.seqlen_ro(), seqlens, new, q.seqlen(), advance)?;
    Ok((advance, seqlens))
}

/// Validates an append; returns the element offset of every row to write, in (b, i) order.
fn check_append<T: Element>(
    cache: &KvCacheMut<'_, T>,
    k_new: &TensorView<'_>,
    v_new: &TensorView<'_>,
) -> Result<Vec<usize>> {
    let n = numel(cache.shape, "cache")?;
    if cache.k.len() != n {
        return Err(Error::InvalidLayout {
            operand: Operand::K,
            reason: format!(
                "the cache buffer holds {} elements, but its shape {:?} needs {n} (a writable cache is contiguous)",
                cache.k.len(),
                cache.shape
            ),
        });
    }
    let [cn, ccap, chk, cd] = cache.shape;
    let Some(cdv) = cache.head_dim_v() else {
        return Err(Error::InvalidLayout {
            operand: Operand::V,
            reason: format!(
                "the cache buffer holds {} elements, not a whole number of rows of {:?} (a writable cache is \
                 contiguous [{cn}, {ccap}, {chk}, head_dim_v]; {n} elements for head_dim_v {cd})",
                cache.v.len(),
                [cn, ccap, chk]
            ),
        });
    };
    // A cache of capacity 0 and an append of 0 rows are allowed (nothing is written).
    let (kc, _) = cache.views();
    check_view(&kc, Operand::K, true)?;
    for (op, t) in [(Operand::K, k_new), (Operand::V, v_new)] {
        if t.dtype() != T::DTYPE {
            return Err(Error::DTypeMismatch {
                operand: op,
                got: t.dtype(),
                expected: T::DTYPE,
            });
        }
    }
    append_slots(
        cache.shape,
        cdv,
        cache_layout(cache.seqlens, cache.block_table, k_new.seqlen()),
        sealed::Read::rows(cache),
        k_new,
        v_new,
    )
}

/// Writes the validated rows; with `rotary`, each k row rotated to its cache position first
/// (`seqlens[b] + i`), in f32, rounded once to the cache's dtype.
fn write_rows<T: Element>(
    cache: &mut KvCacheMut<'_, T>,
    k_new: &TensorView<'_>,
    v_new: &TensorView<'_>,
    slots: &[usize],
    rotary: Option<&Rotary<'_>>,
) {
    let (d, dv) = (k_new.head_dim(), v_new.head_dim());
    let (mut krow, mut vrow) = (vec![0.0f32; d], vec![0.0f32; dv]);
    for_new_rows(k_new, slots, |b, i, h, at| {
        // `at`: the row's offset in k; the same row of v (the same slot and kv head) is at
        // `at / d * dv`.
        let vat = at / d.max(1) * dv;
        k_new.read_row(b, i, h, &mut krow);
        if let Some(rot) = rotary {
            rot.rotate(&mut krow, cache.seqlens[b] as usize + i);
        }
        store(&mut cache.k[at..at + d], &krow);
        v_new.read_row(b, i, h, &mut vrow);
        store(&mut cache.v[vat..vat + dv], &vrow);
    });
}

fn store<T: Element>(dst: &mut [T], src: &[f32]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = T::from_f32(x);
    }
}

/// [`prepare`] for any source of K and V. An FP8 cache's codes and scales are checked before the
/// shapes; the per (slot, kv head) scales of every key the call reads, after the layout, except
/// each sequence's last `unwritten` keys (rows an append is about to write, and so to scale).
fn prepare_source<'a>(
    q: &TensorView<'a>,
    src: &KvSource<'a>,
    layouts: (QueryLayout<'a>, KvLayout<'a>, CacheRows<'a>),
    unwritten: usize,
    opts: &ForwardOptions,
) -> Result<(Problem, BatchLayout<'a>)> {
    match src {
        KvSource::Views(k, v) => prepare(q, k, v, layouts, opts),
        KvSource::Fp8 { k, v, shape, scales } => {
            check_view(q, Operand::Q, matches!(layouts.0, QueryLayout::Varlen { .. }))?;
            check_buffers(k.len(), v.len(), *shape, scales)?;
            let (p, layout) = problem(q, *shape, shape[3], layouts, opts)?;
            check_read_scales(&layout, *shape, scales, unwritten)?;
            Ok((p, layout))
        }
    }
}

/// Attention of `q` over `src` (`unwritten`: see [`prepare_source`]).
fn run(
    q: &TensorView<'_>,
    src: &KvSource<'_>,
    layouts: (QueryLayout<'_>, KvLayout<'_>, CacheRows<'_>),
    unwritten: usize,
    opts: &ForwardOptions,
    what: &str,
) -> Result<Output> {
    let (ql, kl, rows) = layouts;
    let (p, layout) = prepare_source(q, src, layouts, unwritten, opts)?;
    let (k, v) = &src.views();
    let fp8 = match *src {
        KvSource::Views(..) => None,
        KvSource::Fp8 { k, v, scales, .. } => Some(fp8_cache::rows(k, v, scales)),
    };
    if let Backend::Cuda(dev) = opts.backend {
        // The FA2 serving kernels (docs/serving.md "GPU"; this path is compile-checked only),
        // which dequantise an FP8 cache's tiles as they load them.
        let host_fp8 = match src {
            KvSource::Fp8 { k, v, scales, .. } => Some(fp8_cache::host(k, v, scales)),
            KvSource::Views(..) => None,
        };
        return crate::cuda_host::serving_host((q, k, v), ql, kl, rows, host_fp8, opts, dev);
    }
    let threads = cpu::threads(opts.cpu_threads);
    // Long query sequences whose keys lie in one contiguous run (packed k/v or a dense cache)
    // go to the tiled path one by one: with many rows its packing pays off. The rest, every
    // paged sequence and every FP8 cache (its rows are dequantised as the in-place path reads
    // them), run in place in one call.
    let tiled: Vec<bool> = (0..layout.batch()).map(|b| fp8.is_none() && tiled_fits(&layout, b)).collect();
    let n_tiled = tiled.iter().filter(|&&t| t).count();
    let run = inplace::RunOpts {
        threads,
        splits: opts.num_splits,
        skip: &tiled,
        fp8,
    };
    let mut out = run_inplace(&p, &layout, (q, k, v), run)?;
    for b in (0..layout.batch()).filter(|&b| tiled[b]) {
        run_tiled(&p, &layout, b, (q, k, v), threads, &mut out)?;
    }
    let reason = match opts.backend {
        Backend::Cpu => "Backend::Cpu requested".to_string(),
        _ => "Backend::Auto runs varlen / KV-cache attention on the CPU (the GPU serving kernels ran in the emulator \
              only; ask for Backend::Cuda to use them)"
            .to_string(),
    };
    let (kernel, tiled_note) = if n_tiled > 0 {
        (
            format!("{} + {}", inplace::path_name(), cpu::path_name()),
            format!(
                ", {n_tiled} sequence(s) of more than {} query rows on the tiled path",
                inplace::DENSE_MAX_SEQLEN_Q
            ),
        )
    } else {
        (inplace::path_name().to_string(), String::new())
    };
    Ok(Output {
        o: out.o,
        lse: p.return_lse.then_some(out.lse),
        dispatch: Dispatch {
            backend: "cpu".into(),
            kernel,
            reason: format!(
                "{reason}; {what}: {} sequences, {} key split(s){tiled_note}",
                layout.batch(),
                out.splits
            ),
        },
    })
}

/// Whether sequence `b` runs on the tiled path: more query rows than the in-place path is
/// meant for, at least one key, and its keys contiguous in memory.
fn tiled_fits(layout: &BatchLayout<'_>, b: usize) -> bool {
    matches!(
        layout.kv_layout(),
        KvLayout::Varlen { .. } | KvLayout::Cache { .. } | KvLayout::Dense
    ) && layout.seqlen_q(b) > inplace::DENSE_MAX_SEQLEN_Q
        && layout.seqlen_k(b) > 0
}

/// Rows `row0..row0 + rows` of batch entry `outer` of `t`, as a `[1, rows, heads, head_dim]`
/// view of the same memory.
fn rows_view<'a>(t: &TensorView<'a>, outer: usize, row0: usize, rows: usize) -> TensorView<'a> {
    let [_, _, h, d] = t.shape();
    let off = t.offset(outer, row0, 0);
    let shape = [1, rows, h, d];
    match t.data() {
        Data::F32(x) => TensorView::with_strides(&x[off..], shape, t.strides()),
        Data::F16(x) => TensorView::with_strides(&x[off..], shape, t.strides()),
        Data::BF16(x) => TensorView::with_strides(&x[off..], shape, t.strides()),
    }
}

/// Sequence `b` through the tiled path (`cpu::run`, its own problem), written into `out`.
fn run_tiled(
    p: &Problem,
    layout: &BatchLayout<'_>,
    b: usize,
    (q, k, v): (&TensorView<'_>, &TensorView<'_>, &TensorView<'_>),
    threads: usize,
    out: &mut inplace::InplaceOutput,
) -> Result<()> {
    let (sq, sk) = (layout.seqlen_q(b), layout.seqlen_k(b));
    let (qo, q0) = layout.q_row(b, 0);
    let (ko, k0) = layout.kv_row(b, 0);
    let qs = rows_view(q, qo, q0, sq);
    let (ks, vs) = (rows_view(k, ko, k0, sk), rows_view(v, ko, k0, sk));
    let ps = Problem {
        batch: 1,
        seqlen_q: sq,
        seqlen_k: sk,
        ..p.clone()
    };
    let r = cpu::run(&ps, &qs, &ks, &vs, threads)?;
    let (hq, d, q_rows) = (p.heads_q, p.head_dim_v, layout.q_rows());
    let t0 = (qo * q_rows + q0) * hq * d;
    let n = sq * hq * d;
    match (out.o.data_mut(), r.o.data()) {
        (OwnedData::F32(dst), OwnedData::F32(src)) => dst[t0..t0 + n].copy_from_slice(src),
        (OwnedData::F16(dst), OwnedData::F16(src)) => dst[t0..t0 + n].copy_from_slice(src),
        (OwnedData::BF16(dst), OwnedData::BF16(src)) => dst[t0..t0 + n].copy_from_slice(src),
        _ => {
            return Err(Error::DTypeMismatch {
                operand: Operand::O,
                got: r.o.dtype(),
                expected: out.o.dtype(),
            });
        }
    }
    for h in 0..hq {
        let at = (qo * hq + h) * q_rows + q0;
        out.lse[at..at + sq].copy_from_slice(&r.lse[h * sq..(h + 1) * sq]);
    }
    Ok(())
}

/// The in-place CPU path with the problem's arithmetic (native, or the emulated exp2 / lazy
/// rescale; FP8 is refused before this).
pub(crate) fn run_inplace(
    p: &Problem,
    layout: &BatchLayout<'_>,
    qkv: (&TensorView<'_>, &TensorView<'_>, &TensorView<'_>),
    run: inplace::RunOpts<'_>,
) -> Result<inplace::InplaceOutput> {
    let math = SoftmaxMath::for_problem(p);
    if math.is_native() {
        inplace::forward(p, layout, qkv, cpu::Native, run)
    } else {
        inplace::forward(p, layout, qkv, math, run)
    }
}

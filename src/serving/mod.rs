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
//! | [`merge_states`], [`merge_states_n`] | `merge_state`, `merge_states` | | |
//! | [`backward_varlen`] | `flash_attn_varlen_func` (backward) | packed | packed |
//!
//! Every mask, softcap, ALiBi slope, GQA group and LSE applies per sequence, with causal and
//! window masks aligned to the bottom-right of each sequence's own score matrix. Sequences of
//! length 0 are allowed (no output rows; a query that sees no key gives 0 and LSE −inf).
//!
//! These run on the CPU backend (the in-place path: no repack of the cache per call, all
//! query heads of a GQA group in one pass over their K/V, split-KV when the workers would idle).
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
//! };
//! let opts = ForwardOptions::default().mask(Mask::Causal).return_lse(true);
//! let out = forward_kvcache_append(&q, &mut cache, &k_new, &k_new, &opts)?;
//! assert_eq!(out.o.shape(), [2, 1, hq, d]); // the caller now counts 21 and 34 cached keys
//! # Ok(())
//! # }
//! ```

mod backward;
mod validate;
mod varlen;
pub mod layout;
// The merge is shared with the backends, which sit below this API: it lives in `numerics`.
pub(crate) use crate::numerics::merge;

pub use backward::backward_varlen;
pub use layout::{BatchLayout, KvLayout, QueryLayout};
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
use validate::{check_view, prepare};

/// A paged cache's block table: `[batch, max_blocks_per_seq]` block ids, row-major.
#[derive(Clone, Copy, Debug)]
pub struct BlockTable<'a> {
    pub ids: &'a [i32],
    pub max_blocks_per_seq: usize,
}

/// A KV cache to attend over (read only).
///
/// - Dense: `k`, `v` are `[batch, capacity, heads_kv, head_dim]`; sequence `b` uses its first
///   `seqlens[b]` rows.
/// - Paged: `k`, `v` are `[num_blocks, page_size, heads_kv, head_dim]` (any page size),
///   `block_table` maps each sequence's pages to blocks, in any order, shared or not.
#[derive(Clone, Copy, Debug)]
pub struct KvCache<'a> {
    pub k: TensorView<'a>,
    pub v: TensorView<'a>,
    /// Keys per sequence (FlashAttention's `cache_seqlens`).
    pub seqlens: &'a [i32],
    pub block_table: Option<BlockTable<'a>>,
}

impl<'a> KvCache<'a> {
    /// A dense cache `[batch, capacity, heads_kv, head_dim]`.
    pub fn dense(k: TensorView<'a>, v: TensorView<'a>, seqlens: &'a [i32]) -> Self {
        KvCache {
            k,
            v,
            seqlens,
            block_table: None,
        }
    }
    /// A paged cache `[num_blocks, page_size, heads_kv, head_dim]` with its block table.
    pub fn paged(k: TensorView<'a>, v: TensorView<'a>, seqlens: &'a [i32], block_table: BlockTable<'a>) -> Self {
        KvCache {
            k,
            v,
            seqlens,
            block_table: Some(block_table),
        }
    }
}

/// A KV cache this call may write (contiguous buffers), for [`append_kv`] and
/// [`forward_kvcache_append`]. `shape` is k's: `[batch, capacity, heads_kv, head_dim]` (dense) or
/// `[num_blocks, page_size, heads_kv, head_dim]` (paged, with `block_table`). v has the same
/// rows with its own head_dim, the one its buffer's length gives (`v.len() / (shape[0] ·
/// shape[1] · shape[2])`, which must divide exactly): `head_dim` for the usual cache, another
/// for a V head_dim that differs from Q/K's (see [`KvCacheMut::head_dim_v`]).
#[derive(Debug)]
pub struct KvCacheMut<'a, T: Element> {
    pub k: &'a mut [T],
    pub v: &'a mut [T],
    pub shape: Shape,
    /// Keys already cached per sequence; new rows go to positions `seqlens[b]..`. Not updated
    /// by the call (as FlashAttention's `cache_seqlens`): add the appended count yourself.
    pub seqlens: &'a [i32],
    pub block_table: Option<BlockTable<'a>>,
}

impl<T: Element> KvCacheMut<'_, T> {
    fn kv_layout(&self, new: usize) -> KvLayout<'_> {
        match self.block_table {
            None => KvLayout::Cache {
                seqlens: self.seqlens,
                new,
            },
            Some(bt) => KvLayout::Paged {
                block_table: bt.ids,
                max_blocks_per_seq: bt.max_blocks_per_seq,
                seqlens: self.seqlens,
                new,
            },
        }
    }
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

fn cache_layout<'a>(c: &KvCache<'a>) -> KvLayout<'a> {
    match c.block_table {
        None => KvLayout::Cache {
            seqlens: c.seqlens,
            new: 0,
        },
        Some(bt) => KvLayout::Paged {
            block_table: bt.ids,
            max_blocks_per_seq: bt.max_blocks_per_seq,
            seqlens: c.seqlens,
            new: 0,
        },
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
    run(&q.as_view(), &k.as_view(), &v.as_view(), ql, kl, opts, "varlen")
}

/// Attention of `q` `[batch, seqlen_q, heads_q, head_dim]` over a KV cache, sequence `b` seeing
/// its `cache.seqlens[b]` keys, causal masks aligned to each sequence's last key
/// (FlashAttention's `flash_attn_with_kvcache` without `k`/`v`). LSE as `[batch, heads_q,
/// seqlen_q]`.
///
/// # Errors
/// As [`forward_varlen`]; a `cache_seqlens` beyond the cache or a block id outside it is an
/// [`Error::InvalidSeqLayout`].
pub fn forward_kvcache(q: &impl AsTensorView, cache: &KvCache<'_>, opts: &ForwardOptions) -> Result<Output> {
    run(
        &q.as_view(),
        &cache.k,
        &cache.v,
        QueryLayout::Dense,
        cache_layout(cache),
        opts,
        "kvcache",
    )
}

/// A packed batch of queries `[1, total_q, heads_q, head_dim]` (`cu_seqlens_q`,
/// `max_seqlen_q`) over a KV cache (chunked prefill against a paged cache; FlashAttention's
/// `flash_attn_varlen_func` with `block_table`). Output and LSE as [`forward_varlen`].
///
/// # Errors
/// As [`forward_varlen`] and [`forward_kvcache`].
pub fn forward_varlen_kvcache(
    q: &impl AsTensorView,
    cu_seqlens_q: &[i32],
    max_seqlen_q: usize,
    cache: &KvCache<'_>,
    opts: &ForwardOptions,
) -> Result<Output> {
    let ql = QueryLayout::Varlen {
        cu_seqlens: cu_seqlens_q,
        max_seqlen: max_seqlen_q,
    };
    run(
        &q.as_view(),
        &cache.k,
        &cache.v,
        ql,
        cache_layout(cache),
        opts,
        "varlen-kvcache",
    )
}

/// Writes this step's keys and values into the cache: row `i` of sequence `b` of `k_new`,
/// `v_new` (`[batch, seqlen_new, heads_kv, head_dim]`, the cache's dtype) goes to key position
/// `cache.seqlens[b] + i`, in the block the block table names for it. `cache.seqlens` is not
/// changed.
///
/// Everything is validated before the first write: on error the cache is untouched.
///
/// # Errors
/// Shapes and dtypes as [`crate::forward`]; positions past the cache's capacity, block ids out of
/// range, and two sequences writing the same slot (a block shared by both) are
/// [`Error::InvalidSeqLayout`].
pub fn append_kv<T: Element>(
    cache: &mut KvCacheMut<'_, T>,
    k_new: &impl AsTensorView,
    v_new: &impl AsTensorView,
) -> Result<()> {
    let (k_new, v_new) = (k_new.as_view(), v_new.as_view());
    let slots = check_append(cache, &k_new, &v_new)?;
    write_rows(cache, &k_new, &v_new, &slots);
    Ok(())
}

/// `flash_attn_with_kvcache` with `k`, `v`: appends `k_new`, `v_new` to the cache as
/// [`append_kv`] does, then attends `q` `[batch, seqlen_q, heads_q, head_dim]` over the
/// `seqlens[b] + seqlen_new` keys of each sequence (old and new), in one call. Output and LSE as
/// [`forward_kvcache`].
///
/// Every argument (the attention's too) is validated before the cache is written.
///
/// # Errors
/// As [`append_kv`] and [`forward_kvcache`].
pub fn forward_kvcache_append<T: Element>(
    q: &impl AsTensorView,
    cache: &mut KvCacheMut<'_, T>,
    k_new: &impl AsTensorView,
    v_new: &impl AsTensorView,
    opts: &ForwardOptions,
) -> Result<Output> {
    let (q, k_new, v_new) = (q.as_view(), k_new.as_view(), v_new.as_view());
    let slots = check_append(cache, &k_new, &v_new)?;
    let new = k_new.seqlen();
    {
        let (kc, vc) = cache.views();
        prepare(&q, &kc, &vc, QueryLayout::Dense, cache.kv_layout(new), opts)?;
    }
    // Rotary embedding goes here when it comes: rotate k_new before the write and q before the
    // attention, at positions seqlens[b] + i (docs/serving.md).
    write_rows(cache, &k_new, &v_new, &slots);
    let (kc, vc) = cache.views();
    run(
        &q,
        &kc,
        &vc,
        QueryLayout::Dense,
        cache.kv_layout(new),
        opts,
        "kvcache-append",
    )
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
    check_view(k_new, Operand::K, true)?;
    check_view(v_new, Operand::V, true)?;
    for (op, t) in [(Operand::K, k_new), (Operand::V, v_new)] {
        if t.dtype() != T::DTYPE {
            return Err(Error::DTypeMismatch {
                operand: op,
                got: t.dtype(),
                expected: T::DTYPE,
            });
        }
    }
    let [batch, new, hkv, d] = k_new.shape();
    if v_new.shape() != [batch, new, hkv, cdv] {
        return Err(Error::ShapeMismatch {
            what: "v_new".into(),
            got: format!("{:?}", v_new.shape()),
            expected: format!("{:?} (k_new's batch, rows and heads; the cache's v head_dim {cdv})", [batch, new, hkv, cdv]),
        });
    }
    if (hkv, d) != (chk, cd) {
        return Err(Error::ShapeMismatch {
            what: "k_new".into(),
            got: format!("{:?}", k_new.shape()),
            expected: format!("[batch, seqlen_new, {chk}, {cd}] (heads_kv and head_dim of the cache)"),
        });
    }
    let layout = BatchLayout::new(QueryLayout::Dense, k_new.shape(), cache.kv_layout(new), cache.shape)?;
    let mut slots = Vec::with_capacity(batch * new);
    let mut owner = Vec::with_capacity(batch * new);
    for b in 0..batch {
        let start = cache.seqlens[b] as usize;
        layout.for_kv_rows(b, start, start + new, |i, outer, row| {
            slots.push(kc.offset(outer, row, 0));
            owner.push((outer, row, b, i));
        });
    }
    // Two sequences writing one slot (a shared block appended to by both) is a caller bug whose
    // result would depend on the write order.
    owner.sort_unstable();
    for w in owner.windows(2) {
        let ((o, r, b0, i0), (_, _, b1, i1)) = (w[0], w[1]);
        if (w[0].0, w[0].1) == (w[1].0, w[1].1) {
            return Err(Error::InvalidSeqLayout {
                what: "block_table".into(),
                got: format!(
                    "sequence {b0} (new row {i0}) and sequence {b1} (new row {i1}) both write slot {r} of block {o}"
                ),
                expected: "distinct cache slots for every appended row (a block shared between sequences is read-only)"
                    .into(),
            });
        }
    }
    Ok(slots)
}

fn write_rows<T: Element>(
    cache: &mut KvCacheMut<'_, T>,
    k_new: &TensorView<'_>,
    v_new: &TensorView<'_>,
    slots: &[usize],
) {
    let [batch, new, hkv, d] = k_new.shape();
    let dv = v_new.head_dim();
    let (mut krow, mut vrow) = (vec![0.0f32; d], vec![0.0f32; dv]);
    let mut it = slots.iter();
    for b in 0..batch {
        for i in 0..new {
            // `base`: the slot's offset in k; the same slot of v is `base / d * dv` (the same
            // row of hkv heads).
            let Some(&base) = it.next() else { return };
            let vbase = base / d.max(1) * dv;
            for h in 0..hkv {
                let (at, vat) = (base + h * d, vbase + h * dv);
                k_new.read_row(b, i, h, &mut krow);
                store(&mut cache.k[at..at + d], &krow);
                v_new.read_row(b, i, h, &mut vrow);
                store(&mut cache.v[vat..vat + dv], &vrow);
            }
        }
    }
}

fn store<T: Element>(dst: &mut [T], src: &[f32]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = T::from_f32(x);
    }
}

fn run(
    q: &TensorView<'_>,
    k: &TensorView<'_>,
    v: &TensorView<'_>,
    ql: QueryLayout<'_>,
    kl: KvLayout<'_>,
    opts: &ForwardOptions,
    what: &str,
) -> Result<Output> {
    let (p, layout) = prepare(q, k, v, ql, kl, opts)?;
    if let Backend::Cuda(dev) = opts.backend {
        // The FA2 serving kernels (docs/serving.md "GPU"; this path is compile-checked only).
        return crate::cuda_host::serving_host((q, k, v), ql, kl, opts, dev);
    }
    let threads = cpu::threads(opts.cpu_threads);
    // Long query sequences whose keys lie in one contiguous run (packed k/v or a dense cache)
    // go to the tiled path one by one: with many rows its packing pays off. The rest, and every
    // paged sequence, run in place in one call.
    let tiled: Vec<bool> = (0..layout.batch()).map(|b| tiled_fits(&layout, b)).collect();
    let n_tiled = tiled.iter().filter(|&&t| t).count();
    let run = inplace::RunOpts {
        threads,
        splits: opts.num_splits,
        skip: &tiled,
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

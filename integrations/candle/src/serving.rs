//! What candle-flash-attn lacks, on candle tensors, mapped onto `flash_attn::serving`: the LSE of
//! a varlen call, attention over a dense or paged KV cache, the KV append (written in place into
//! candle's cache tensors), and `merge_states`. Layouts and semantics as docs/serving.md: caches
//! `[batch, capacity, heads_kv, head_dim]` (dense) or `[num_blocks, page_size, heads_kv,
//! head_dim]` (paged, with a `(batch, max_blocks)` block table), `cache_seqlens` `(batch)` keys
//! already cached, index tensors u32, i32 or i64.
//!
//! On CUDA tensors (feature `cuda`), `flash_attn_kvcache` and `flash_attn_kvcache_append` run
//! flash_attn's serving kernels on candle's stream and `merge_states` its combine kernel
//! (compile-checked only); `append_kv` alone takes CPU tensors.

use crate::convert::{bshd, contiguous_range, cumulative, err, index_vec, same_dtype, view, with_float, Float};
use crate::op::{Attention, Keys};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Device, InplaceOp1, Layout, Result, Storage, Tensor};
use flash_attn::serving::{self as fs, BlockTable, KvCacheMut};
use flash_attn::ForwardOptions;
use std::cell::Cell;

/// [`crate::flash_attn_varlen`] with flash_attn's options, returning `(o, lse)`: o
/// `(total_q, heads_q, head_dim)`, LSE `(heads_q, total_q)` f32 (FlashAttention's packed layout).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    opts: &ForwardOptions,
) -> Result<(Tensor, Tensor)> {
    let (cu_q, cu_k) = cumulative(seqlens_q, seqlens_k)?;
    let keys = Keys::Varlen { cu_q, cu_k, max_q: max_seqlen_q, max_k: max_seqlen_k };
    Attention::with_keys(opts.clone(), keys).run(q, k, v)
}

/// A block table tensor `(batch, max_blocks)` as host ids and its width.
fn block_table(t: &Tensor) -> Result<(Vec<i32>, usize)> {
    match t.dims() {
        &[_, m] => Ok((index_vec(t, "block_table")?, m)),
        d => bail!("flash_attn: block_table must be (batch, max_blocks), got shape {d:?}"),
    }
}

/// Attention of q `[batch, seqlen_q, heads_q, head_dim]` over a KV cache (FlashAttention's
/// `flash_attn_with_kvcache` without new rows): sequence `b` sees its `cache_seqlens[b]` keys,
/// masks aligned to its last key. Returns `(o, lse)`, LSE `[batch, heads_q, seqlen_q]` f32.
pub fn flash_attn_kvcache(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    cache_seqlens: &Tensor,
    block_table: Option<&Tensor>,
    opts: &ForwardOptions,
) -> Result<(Tensor, Tensor)> {
    let seqlens = index_vec(cache_seqlens, "cache_seqlens")?;
    let table = block_table.map(self::block_table).transpose()?;
    Attention::with_keys(opts.clone(), Keys::Cache { seqlens, table }).run(q, k_cache, v_cache)
}

/// Writes this step's rows into the caches, in place: row `i` of sequence `b` of `k_new`,
/// `v_new` (`[batch, seqlen_new, heads_kv, head_dim]`, the caches' dtype) goes to key position
/// `cache_seqlens[b] + i`, in the block the table names. `cache_seqlens` is not changed (add
/// `seqlen_new` yourself, as with FlashAttention). Everything is validated before the first
/// write: on error the caches are untouched. The caches must be contiguous CPU tensors.
pub fn append_kv(
    k_cache: &Tensor,
    v_cache: &Tensor,
    cache_seqlens: &Tensor,
    block_table: Option<&Tensor>,
    k_new: &Tensor,
    v_new: &Tensor,
) -> Result<()> {
    let seqlens = index_vec(cache_seqlens, "cache_seqlens")?;
    let table = block_table.map(self::block_table).transpose()?;
    check_cpu(&[("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)])?;
    let dtype = same_dtype(&[
        ("k_cache", k_cache.dtype()),
        ("v_cache", v_cache.dtype()),
        ("k_new", k_new.dtype()),
        ("v_new", v_new.dtype()),
    ])?;
    check_distinct(k_cache, v_cache, &[k_new, v_new])?;
    let (kn, lkn) = k_new.storage_and_layout();
    let (vn, lvn) = v_new.storage_and_layout();
    with_caches_mut(k_cache, v_cache, |caches| {
        let (kc, lk, vc, lv) = match caches {
            CachesMut::Cpu { k, lk, v, lv } => (k, lk, v, lv),
            #[cfg(feature = "cuda")]
            CachesMut::Cuda { .. } => {
                bail!("flash_attn: append_kv takes CPU tensors; on CUDA the append runs fused in flash_attn_kvcache_append")
            }
        };
        with_float!(dtype, "the caches", T => {
            let (k_new, v_new) = (view(cpu(&kn)?.as_slice::<T>()?, lkn, 4, "k_new")?, view(cpu(&vn)?.as_slice::<T>()?, lvn, 4, "v_new")?);
            let mut cache = cache_mut::<T>((kc, lk), (vc, lv), &seqlens, table.as_ref())?;
            fs::append_kv(&mut cache, &k_new, &v_new).map_err(err)
        })
    })
}

/// FlashAttention's `flash_attn_with_kvcache(k=, v=)`: appends `k_new`, `v_new` as
/// [`append_kv`] does, then attends q `[batch, seqlen_q, heads_q, head_dim]` over the
/// `cache_seqlens[b] + seqlen_new` keys of each sequence, in one call (every argument validated
/// before the caches are written). Returns `(o, lse)` as [`flash_attn_kvcache`].
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_kvcache_append(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    cache_seqlens: &Tensor,
    block_table: Option<&Tensor>,
    k_new: &Tensor,
    v_new: &Tensor,
    opts: &ForwardOptions,
) -> Result<(Tensor, Tensor)> {
    let seqlens = index_vec(cache_seqlens, "cache_seqlens")?;
    let table = block_table.map(self::block_table).transpose()?;
    let all = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)];
    if let Some((n, t)) = all.iter().find(|(_, t)| !t.device().same_device(q.device())) {
        bail!("flash_attn: {n} is on {:?}, q on {:?}; all must be on one device", t.device().location(), q.device().location())
    }
    let dtype = same_dtype(&all.map(|(n, t)| (n, t.dtype())))?;
    check_distinct(k_cache, v_cache, &[q, k_new, v_new])?;
    let (qs, lq) = q.storage_and_layout();
    let (kn, lkn) = k_new.storage_and_layout();
    let (vn, lvn) = v_new.storage_and_layout();
    let mut result = None;
    with_caches_mut(k_cache, v_cache, |caches| {
        let (kc, lk, vc, lv) = match caches {
            CachesMut::Cpu { k, lk, v, lv } => (k, lk, v, lv),
            #[cfg(feature = "cuda")]
            CachesMut::Cuda { k, lk, v, lv } => {
                let (q, k_new, v_new) = (cuda(&qs)?, cuda(&kn)?, cuda(&vn)?);
                let (o, lse) = crate::cuda::kvcache_append(
                    (q, lq),
                    (k_new, lkn),
                    (v_new, lvn),
                    (k, lk),
                    (v, lv),
                    (&seqlens, table.as_ref()),
                    opts,
                )?;
                result = Some((o, lse));
                return Ok(());
            }
        };
        with_float!(dtype, "q and the caches", T => {
            let q = view(cpu(&qs)?.as_slice::<T>()?, lq, 4, "q")?;
            let (k_new, v_new) = (view(cpu(&kn)?.as_slice::<T>()?, lkn, 4, "k_new")?, view(cpu(&vn)?.as_slice::<T>()?, lvn, 4, "v_new")?);
            let mut cache = cache_mut::<T>((kc, lk), (vc, lv), &seqlens, table.as_ref())?;
            let opts = opts.clone().backend(flash_attn::Backend::Cpu).return_lse(true);
            let out = fs::forward_kvcache_append(&q, &mut cache, &k_new, &v_new, &opts).map_err(err)?;
            let o = Tensor::from_vec(out.o.into_vec::<T>().map_err(err)?, lq.dims(), &Device::Cpu)?;
            let [b, s, h, _] = bshd(lq, 4, "q")?.0;
            result = Some((o, Tensor::from_vec(out.lse.unwrap_or_default(), (b, h, s), &Device::Cpu)?));
            Ok(())
        })
    })?;
    match result {
        Some(r) => Ok(r),
        None => bail!("flash_attn: the cache write did not run"),
    }
}

/// Merges two attention states of the same queries over disjoint key sets (FlashInfer's
/// `merge_state`): o `[batch, seqlen, heads, head_dim]` or packed `(total, heads, head_dim)`,
/// LSE `[batch, heads, seqlen]` or `(heads, total)` f32, as this crate's functions return them.
/// Returns the merged `(o, lse)`, o in the inputs' dtype (computed in f64 on the CPU; on CUDA
/// tensors by the combine kernel in f32, compile-checked only).
pub fn merge_states(o_a: &Tensor, lse_a: &Tensor, o_b: &Tensor, lse_b: &Tensor) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if o_a.device().is_cuda() {
        return crate::cuda::merge_states(o_a, lse_a, o_b, lse_b);
    }
    check_cpu(&[("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)])?;
    let dtype = same_dtype(&[("o_a", o_a.dtype()), ("o_b", o_b.dtype())])?;
    let lse = |t: &Tensor| -> Result<Vec<f32>> {
        if t.dtype() != candle_core::DType::F32 {
            bail!("flash_attn: an LSE must be f32, got {:?}", t.dtype())
        }
        t.flatten_all()?.to_vec1::<f32>()
    };
    let (la, lb) = (lse(lse_a)?, lse(lse_b)?);
    let rank = o_a.rank();
    let (sa, l_a) = o_a.storage_and_layout();
    let (sb, l_b) = o_b.storage_and_layout();
    let merged = with_float!(dtype, "o_a, o_b", T => {
        let (va, vb) = (view(cpu(&sa)?.as_slice::<T>()?, l_a, rank, "o_a")?, view(cpu(&sb)?.as_slice::<T>()?, l_b, rank, "o_b")?);
        let m = fs::merge_states(&va, &la, &vb, &lb).map_err(err)?;
        (Tensor::from_vec(m.o.into_vec::<T>().map_err(err)?, l_a.dims(), &Device::Cpu)?, m.lse)
    });
    let (o, lse) = merged;
    Ok((o, Tensor::from_vec(lse, lse_a.dims(), &Device::Cpu)?))
}

fn cpu(s: &Storage) -> Result<&CpuStorage> {
    match s {
        Storage::Cpu(c) => Ok(c),
        _ => bail!("flash_attn: this call takes CPU tensors"),
    }
}

#[cfg(feature = "cuda")]
fn cuda(s: &Storage) -> Result<&candle_core::CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => bail!("flash_attn: q, k_new and v_new must be on the caches' device"),
    }
}

fn check_cpu(ts: &[(&str, &Tensor)]) -> Result<()> {
    for (n, t) in ts {
        if !t.device().is_cpu() {
            bail!("flash_attn: {n} is on {:?}; the KV-cache and merge functions take CPU tensors", t.device().location())
        }
    }
    Ok(())
}

/// The storage a tensor lives in, as an address (tensors that share it give the same one).
fn storage_addr(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    &*s as *const Storage as usize
}

/// The caches are written while the other operands are read: they must not share storage.
fn check_distinct(k_cache: &Tensor, v_cache: &Tensor, others: &[&Tensor]) -> Result<()> {
    let (k, v) = (storage_addr(k_cache), storage_addr(v_cache));
    if k == v {
        bail!("flash_attn: k_cache and v_cache share one storage; pass separate tensors")
    }
    if others.iter().map(|t| storage_addr(t)).any(|a| a == k || a == v) {
        bail!("flash_attn: a tensor read by the call shares storage with a cache it writes")
    }
    Ok(())
}

/// The caches as flash_attn's writable cache: contiguous `[batch or blocks, rows, heads_kv,
/// head_dim]` buffers.
fn cache_mut<'a, T: Float>(
    (kc, lk): (&'a mut CpuStorage, &Layout),
    (vc, lv): (&'a mut CpuStorage, &Layout),
    seqlens: &'a [i32],
    table: Option<&'a (Vec<i32>, usize)>,
) -> Result<KvCacheMut<'a, T>> {
    let (shape, _) = bshd(lk, 4, "k_cache")?;
    if lv.dims() != lk.dims() {
        bail!("flash_attn: v_cache has shape {:?}, k_cache {:?}; they must match", lv.dims(), lk.dims())
    }
    let (rk, rv) = (contiguous_range(lk, "k_cache")?, contiguous_range(lv, "v_cache")?);
    let k = slice_mut::<T>(kc)?.get_mut(rk).unwrap_or_default();
    let v = slice_mut::<T>(vc)?.get_mut(rv).unwrap_or_default();
    let block_table = table.map(|(ids, m)| BlockTable { ids, max_blocks_per_seq: *m });
    Ok(KvCacheMut { k, v, shape, seqlens, block_table, batch_idx: None, leftpad: None })
}

fn slice_mut<T: Float>(s: &mut CpuStorage) -> Result<&mut [T]> {
    let dtype = s.dtype();
    let any: &mut dyn std::any::Any = match s {
        CpuStorage::F32(x) => x,
        CpuStorage::F16(x) => x,
        CpuStorage::BF16(x) => x,
        _ => bail!("flash_attn: a cache must be f32, f16 or bf16, got {dtype:?}"),
    };
    match any.downcast_mut::<Vec<T>>() {
        Some(v) => Ok(v),
        None => bail!("flash_attn: a cache is {dtype:?}, not the dtype of the other operands"),
    }
}

/// Write access to both caches' storage, on the CPU or on a CUDA device.
enum CachesMut<'a> {
    Cpu { k: &'a mut CpuStorage, lk: &'a Layout, v: &'a mut CpuStorage, lv: &'a Layout },
    #[cfg(feature = "cuda")]
    Cuda { k: &'a mut candle_core::CudaStorage, lk: &'a Layout, v: &'a mut candle_core::CudaStorage, lv: &'a Layout },
}

/// The k cache's storage, held while the v cache's is taken.
enum KHalf<'a> {
    Cpu(&'a mut CpuStorage),
    #[cfg(feature = "cuda")]
    Cuda(&'a mut candle_core::CudaStorage),
}

/// Runs `f` with write access to both caches' storage: an in-place op on `k_cache` whose body
/// runs an in-place op on `v_cache` (candle hands out one writable storage per op).
fn with_caches_mut<F>(k_cache: &Tensor, v_cache: &Tensor, f: F) -> Result<()>
where
    F: for<'x> FnOnce(CachesMut<'x>) -> Result<()>,
{
    k_cache.inplace_op1(&WriteK { v_cache, f: Cell::new(Some(f)) })
}

struct WriteK<'a, F> {
    v_cache: &'a Tensor,
    f: Cell<Option<F>>,
}

impl<F> WriteK<'_, F>
where
    F: for<'x> FnOnce(CachesMut<'x>) -> Result<()>,
{
    fn then_v(&self, k: KHalf<'_>, lk: &Layout) -> Result<()> {
        let Some(f) = self.f.take() else { bail!("flash_attn: the cache write ran twice") };
        self.v_cache.inplace_op1(&WriteV { k: Cell::new(Some(k)), lk, f: Cell::new(Some(f)) })
    }
}

impl<F> InplaceOp1 for WriteK<'_, F>
where
    F: for<'x> FnOnce(CachesMut<'x>) -> Result<()>,
{
    fn name(&self) -> &'static str {
        "flash-attn-kv-write"
    }
    fn cpu_fwd(&self, k: &mut CpuStorage, lk: &Layout) -> Result<()> {
        self.then_v(KHalf::Cpu(k), lk)
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, k: &mut candle_core::CudaStorage, lk: &Layout) -> Result<()> {
        self.then_v(KHalf::Cuda(k), lk)
    }
}

struct WriteV<'a, F> {
    k: Cell<Option<KHalf<'a>>>,
    lk: &'a Layout,
    f: Cell<Option<F>>,
}

impl<F> WriteV<'_, F>
where
    F: for<'x> FnOnce(CachesMut<'x>) -> Result<()>,
{
    fn parts(&self) -> Result<(KHalf<'_>, F)> {
        match (self.k.take(), self.f.take()) {
            (Some(k), Some(f)) => Ok((k, f)),
            _ => bail!("flash_attn: the cache write ran twice"),
        }
    }
}

impl<F> InplaceOp1 for WriteV<'_, F>
where
    F: for<'x> FnOnce(CachesMut<'x>) -> Result<()>,
{
    fn name(&self) -> &'static str {
        "flash-attn-kv-write"
    }
    fn cpu_fwd(&self, v: &mut CpuStorage, lv: &Layout) -> Result<()> {
        match self.parts()? {
            (KHalf::Cpu(k), f) => f(CachesMut::Cpu { k, lk: self.lk, v, lv }),
            #[cfg(feature = "cuda")]
            _ => bail!("flash_attn: k_cache and v_cache are on different devices"),
        }
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, v: &mut candle_core::CudaStorage, lv: &Layout) -> Result<()> {
        match self.parts()? {
            (KHalf::Cuda(k), f) => f(CachesMut::Cuda { k, lk: self.lk, v, lv }),
            _ => bail!("flash_attn: k_cache and v_cache are on different devices"),
        }
    }
}

//! [`Attention`] on candle's CUDA storage (feature `cuda`): flash_attn's kernels launched on
//! candle's own stream over candle's `CudaSlice`s (read in place), the output and the LSE in new
//! candle buffers. Dense calls go through `Engine::launch`; varlen, paged and cache calls through
//! `Engine::launch_serving_raw`, with the host index arrays uploaded on the same stream.
//!
//! Type-checked against candle-core's CUDA backend by `scripts/check/candle-cuda.sh`; nothing
//! here has run on a GPU.

use crate::convert::{bshd, err, same_dtype};
use crate::op::{Attention, Keys};
use candle_core::backend::BackendStorage;
// candle's own cudarc (the one its storage is made of), re-exported by candle.
use candle_core::cuda_backend::cudarc;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use flash_attn::cuda::{DeviceAppend, DeviceIndex, DeviceKv, DeviceLse, DeviceLseRef, DeviceTensor, DeviceTensorMut, Engine};
use flash_attn::{Element, ForwardOptions};
use std::sync::{Arc, Mutex};

/// One engine per CUDA context, kept: it holds the ALiBi slopes it uploaded (freeing them
/// would synchronize) and shares the loaded kernels of the primary context.
static ENGINES: Mutex<Vec<Arc<Engine>>> = Mutex::new(Vec::new());

fn engine_for(ctx: &Arc<cudarc::driver::CudaContext>) -> Result<Arc<Engine>> {
    let mut engines = ENGINES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = engines.iter().find(|e| e.device().context().cu_ctx() == ctx.cu_ctx()) {
        return Ok(e.clone());
    }
    let e = Arc::new(Engine::from_context(ctx.clone()).map_err(err)?);
    engines.push(e.clone());
    Ok(e)
}

pub(crate) fn forward(
    op: &Attention,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    match same_dtype(&[("q", q.0.dtype()), ("k", k.0.dtype()), ("v", v.0.dtype())])? {
        DType::F16 => run::<half::f16>(op, q, k, v),
        DType::BF16 => run::<half::bf16>(op, q, k, v),
        d => bail!("flash_attn on CUDA: q, k, v must be f16 or bf16, got {d:?}"),
    }
}

fn run<T>(
    op: &Attention,
    (q, lq): (&CudaStorage, &Layout),
    (k, lk): (&CudaStorage, &Layout),
    (v, lv): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)>
where
    T: Element + CudaDType + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
{
    let dev = q.device.clone();
    let stream = dev.cuda_stream();
    let engine = engine_for(stream.context())?;
    let (qr, kr) = op.keys.ranks();
    let ((sq, stq), (sk, stk), (sv, stv)) = (bshd(lq, qr, "q")?, bshd(lk, kr, "k")?, bshd(lv, kr, "v")?);
    let (dq, dk, dv) = (q.as_cuda_slice::<T>()?, k.as_cuda_slice::<T>()?, v.as_cuda_slice::<T>()?);
    let (vq, vk, vv) = (dq.slice(lq.start_offset()..), dk.slice(lk.start_offset()..), dv.slice(lv.start_offset()..));
    let mut o = dev.alloc_zeros::<T>(sq.iter().product())?;
    let lse_shape = op.lse_shape(lq.dims());
    let mut lse = dev.alloc_zeros::<f32>(lse_shape.elem_count())?;
    {
        let tq = DeviceTensor::new(&vq, &stream, sq).with_strides(stq);
        let tk = DeviceTensor::new(&vk, &stream, sk).with_strides(stk);
        let tv = DeviceTensor::new(&vv, &stream, sv).with_strides(stv);
        let mut to = DeviceTensorMut::new(&mut o, &stream, sq);
        let mut tl = DeviceLse::new(&mut lse, &stream);
        let opts = op.opts.clone().return_lse(true);
        match &op.keys {
            Keys::Dense => engine.launch(&stream, &tq, &tk, &tv, &mut to, Some(&mut tl), &opts).map_err(err)?,
            keys => serving(&engine, &dev, &stream, keys, (&tq, &tk, &tv), &mut to, &mut tl, &opts)?,
        }
    }
    let lse = CudaStorage::wrap_cuda_slice(lse, dev.clone());
    op.keep_lse(Tensor::from_storage(Storage::Cuda(lse), lse_shape, BackpropOp::none(), false));
    Ok((CudaStorage::wrap_cuda_slice(o, dev), lq.shape().clone()))
}

/// The serving layouts through `Engine::launch_serving_raw`: the host index arrays (already
/// validated against by the engine) uploaded on candle's stream; their buffers are freed
/// stream-ordered after the launch.
#[allow(clippy::too_many_arguments)]
fn serving(
    engine: &Engine,
    dev: &CudaDevice,
    stream: &Arc<CudaStream>,
    keys: &Keys,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    o: &mut DeviceTensorMut,
    lse: &mut DeviceLse,
    opts: &ForwardOptions,
) -> Result<()> {
    let up = |h: &[i32]| -> Result<CudaSlice<i32>> { dev.clone_htod(h) };
    let ptr = |s: &CudaSlice<i32>| -> u64 { s.device_ptr(stream).0 };
    let empty = [0i32];
    let nonempty = |h: &'_ [i32]| -> Vec<i32> { if h.is_empty() { empty.to_vec() } else { h.to_vec() } };
    let (a, b, c): (Vec<i32>, Vec<i32>, Vec<i32>) = match keys {
        Keys::Dense => bail!("flash_attn: the dense layout has no index arrays"),
        Keys::Varlen { cu_q, cu_k, .. } => (cu_q.clone(), cu_k.clone(), Vec::new()),
        Keys::VarlenPaged { cu_q, seqlens, table, .. } => (cu_q.clone(), seqlens.clone(), table.clone()),
        Keys::Cache { seqlens, table } => (Vec::new(), seqlens.clone(), table.as_ref().map(|t| t.0.clone()).unwrap_or_default()),
    };
    let (da, db, dc) = (up(&nonempty(&a))?, up(&nonempty(&b))?, up(&nonempty(&c))?);
    // SAFETY: each pointer is a device buffer of this stream's context holding exactly the host
    // mirror it is paired with (just uploaded on this stream, so ordered before the launch), and
    // it lives until this function returns, after the launch is enqueued (its free is
    // stream-ordered).
    let (ia, ib, ic) = unsafe {
        (DeviceIndex::from_raw(&a, ptr(&da)), DeviceIndex::from_raw(&b, ptr(&db)), DeviceIndex::from_raw(&c, ptr(&dc)))
    };
    let (cu_q, kv) = match keys {
        Keys::Varlen { max_q, max_k, .. } => (Some((ia, *max_q)), DeviceKv::Varlen { cu_seqlens: ib, max_seqlen: *max_k }),
        Keys::VarlenPaged { max_q, max_blocks, .. } => {
            (Some((ia, *max_q)), DeviceKv::Paged { seqlens: ib, block_table: ic, max_blocks_per_seq: *max_blocks })
        }
        Keys::Cache { table: Some((_, m)), .. } => (None, DeviceKv::Paged { seqlens: ib, block_table: ic, max_blocks_per_seq: *m }),
        Keys::Cache { table: None, .. } => (None, DeviceKv::Cache { seqlens: ib, batch_idx: None, leftpad: None }),
        Keys::Dense => bail!("flash_attn: the dense layout has no index arrays"),
    };
    // SAFETY: `stream` is candle's live stream of the engine's context; the index arrays are as
    // `DeviceIndex::from_raw` requires (above); no append, so k and v are only read.
    unsafe { engine.launch_serving_raw(stream.cu_stream(), q, cu_q, k, v, kv, None, o, Some(lse), opts) }
        .map(|_| ())
        .map_err(err)
}

/// `flash_attn_with_kvcache(k=, v=)` on candle's CUDA storage: `Engine::launch_serving_raw` with
/// the append (the append kernel writes the new rows into the caches, then the attention reads
/// them, on candle's stream). Returns `(o, lse)` as new candle tensors.
#[allow(clippy::type_complexity)]
pub(crate) fn kvcache_append(
    q: (&CudaStorage, &Layout),
    k_new: (&CudaStorage, &Layout),
    v_new: (&CudaStorage, &Layout),
    k: (&mut CudaStorage, &Layout),
    v: (&mut CudaStorage, &Layout),
    index: (&[i32], Option<&(Vec<i32>, usize)>),
    opts: &ForwardOptions,
) -> Result<(Tensor, Tensor)> {
    match q.0.dtype() {
        DType::F16 => append_run::<half::f16>(q, k_new, v_new, k, v, index, opts),
        DType::BF16 => append_run::<half::bf16>(q, k_new, v_new, k, v, index, opts),
        d => bail!("flash_attn on CUDA: q and the caches must be f16 or bf16, got {d:?}"),
    }
}

#[allow(clippy::type_complexity)]
fn append_run<T>(
    (q, lq): (&CudaStorage, &Layout),
    (kn, lkn): (&CudaStorage, &Layout),
    (vn, lvn): (&CudaStorage, &Layout),
    (k, lk): (&mut CudaStorage, &Layout),
    (v, lv): (&mut CudaStorage, &Layout),
    (seqlens, table): (&[i32], Option<&(Vec<i32>, usize)>),
    opts: &ForwardOptions,
) -> Result<(Tensor, Tensor)>
where
    T: Element + CudaDType + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
{
    let dev = q.device.clone();
    let stream = dev.cuda_stream();
    let engine = engine_for(stream.context())?;
    let [sq, skn, svn, sk, sv] =
        [bshd(lq, 4, "q")?, bshd(lkn, 4, "k_new")?, bshd(lvn, 4, "v_new")?, bshd(lk, 4, "k_cache")?, bshd(lv, 4, "v_cache")?];
    let (dq, dkn, dvn) = (q.as_cuda_slice::<T>()?, kn.as_cuda_slice::<T>()?, vn.as_cuda_slice::<T>()?);
    let (dk, dv) = (k.as_cuda_slice::<T>()?, v.as_cuda_slice::<T>()?);
    let (vq, vkn, vvn) = (dq.slice(lq.start_offset()..), dkn.slice(lkn.start_offset()..), dvn.slice(lvn.start_offset()..));
    let (vk, vv) = (dk.slice(lk.start_offset()..), dv.slice(lv.start_offset()..));
    let [b, s, h, _] = sq.0;
    let mut o = dev.alloc_zeros::<T>(sq.0.iter().product())?;
    let mut lse = dev.alloc_zeros::<f32>(b * h * s)?;
    let ids: Vec<i32> = table.map(|t| t.0.clone()).unwrap_or_default();
    let up = |h: &[i32]| -> Result<CudaSlice<i32>> { dev.clone_htod(if h.is_empty() { &[0i32][..] } else { h }) };
    let (d_seqlens, d_ids) = (up(seqlens)?, up(&ids)?);
    {
        let t = |view, (shape, strides)| DeviceTensor::new(view, &stream, shape).with_strides(strides);
        let (tq, tkn, tvn, tk, tv) = (t(&vq, sq), t(&vkn, skn), t(&vvn, svn), t(&vk, sk), t(&vv, sv));
        let mut to = DeviceTensorMut::new(&mut o, &stream, sq.0);
        let mut tl = DeviceLse::new(&mut lse, &stream);
        // SAFETY: each pointer is a device buffer of this stream's context holding its host mirror
        // (uploaded on this stream before the launch), alive until after the launch is enqueued.
        let (is, it) = unsafe {
            (DeviceIndex::from_raw(seqlens, d_seqlens.device_ptr(&stream).0), DeviceIndex::from_raw(&ids, d_ids.device_ptr(&stream).0))
        };
        let kv = match table {
            Some((_, m)) => DeviceKv::Paged { seqlens: is, block_table: it, max_blocks_per_seq: *m },
            None => DeviceKv::Cache { seqlens: is, batch_idx: None, leftpad: None },
        };
        let append = Some(DeviceAppend { k_new: &tkn, v_new: &tvn, rotary: None });
        let opts = opts.clone().return_lse(true);
        // SAFETY: `stream` is candle's live stream of the engine's context; the index arrays are as
        // `DeviceIndex::from_raw` requires (above); the caches are written, and this call holds them
        // exclusively (candle's in-place ops handed out `&mut` to their storage).
        unsafe { engine.launch_serving_raw(stream.cu_stream(), &tq, None, &tk, &tv, kv, append, &mut to, Some(&mut tl), &opts) }
            .map_err(err)?;
    }
    let wrap = |s: CudaStorage, shape: Shape| Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false);
    let o = wrap(CudaStorage::wrap_cuda_slice(o, dev.clone()), lq.shape().clone());
    let lse = wrap(CudaStorage::wrap_cuda_slice(lse, dev), Shape::from((b, h, s)));
    Ok((o, lse))
}

/// `merge_states` on candle's CUDA storage: the combine kernel (`Engine::merge_states`, computed
/// in f32) on candle's stream; o in the inputs' dtype, the merged LSE f32, as new candle tensors.
pub(crate) fn merge_states(o_a: &Tensor, lse_a: &Tensor, o_b: &Tensor, lse_b: &Tensor) -> Result<(Tensor, Tensor)> {
    let (la, lb) = (lse_a.contiguous()?, lse_b.contiguous()?);
    let (sa, l_a) = o_a.storage_and_layout();
    let (sb, l_b) = o_b.storage_and_layout();
    let (sla, lla) = la.storage_and_layout();
    let (slb, llb) = lb.storage_and_layout();
    let (Storage::Cuda(a), Storage::Cuda(b), Storage::Cuda(xa), Storage::Cuda(xb)) = (&*sa, &*sb, &*sla, &*slb) else {
        bail!("flash_attn: merge_states takes o and LSE tensors all on one device")
    };
    let rank = o_a.rank();
    let dtype = same_dtype(&[("o_a", a.dtype()), ("o_b", b.dtype())])?;
    let (o, lse) = crate::convert::with_float!(dtype, "o_a, o_b", T => {
        merge_run::<T>((a, l_a), (b, l_b), (xa, lla), (xb, llb), rank)?
    });
    Ok((o, lse.reshape(lse_a.shape())?))
}

fn merge_run<T>(
    (a, la): (&CudaStorage, &Layout),
    (b, lb): (&CudaStorage, &Layout),
    (xa, lxa): (&CudaStorage, &Layout),
    (xb, lxb): (&CudaStorage, &Layout),
    rank: usize,
) -> Result<(Tensor, Tensor)>
where
    T: Element + CudaDType + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
{
    let dev = a.device.clone();
    let stream = dev.cuda_stream();
    let engine = engine_for(stream.context())?;
    let ((sha, sta), (shb, stb)) = (bshd(la, rank, "o_a")?, bshd(lb, rank, "o_b")?);
    let (da, db) = (a.as_cuda_slice::<T>()?, b.as_cuda_slice::<T>()?);
    let (va, vb) = (da.slice(la.start_offset()..), db.slice(lb.start_offset()..));
    let lse_range = |l: &Layout| crate::convert::contiguous_range(l, "an LSE");
    let (ra, rb) = (lse_range(lxa)?, lse_range(lxb)?);
    let rows = ra.len();
    let (dla, dlb) = (xa.as_cuda_slice::<f32>()?, xb.as_cuda_slice::<f32>()?);
    let (vla, vlb) = (dla.slice(ra), dlb.slice(rb));
    let mut o = dev.alloc_zeros::<T>(sha.iter().product())?;
    let mut lse = dev.alloc_zeros::<f32>(rows)?;
    {
        let (ta, tb) = (DeviceTensor::new(&va, &stream, sha).with_strides(sta), DeviceTensor::new(&vb, &stream, shb).with_strides(stb));
        let (ra, rb) = (DeviceLseRef::new(&vla, &stream), DeviceLseRef::new(&vlb, &stream));
        let mut to = DeviceTensorMut::new(&mut o, &stream, sha);
        let mut tl = DeviceLse::new(&mut lse, &stream);
        engine.merge_states(&stream, &ta, &ra, &tb, &rb, &mut to, Some(&mut tl)).map_err(err)?;
    }
    let wrap = |s: CudaStorage, shape: Shape| Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false);
    Ok((wrap(CudaStorage::wrap_cuda_slice(o, dev.clone()), la.shape().clone()), wrap(CudaStorage::wrap_cuda_slice(lse, dev), Shape::from(rows))))
}

//! Host-memory problems on the GPU (`crate::forward` with `Backend::Auto` / `Backend::Cuda`,
//! `crate::backward` with an explicit variant on a CUDA backend): upload, launch through an
//! [`Engine`], download.

use super::backward::{BackwardGrads, BackwardInputs};
use super::handle::Engine;
use super::tensors::{DeviceLse, DeviceLseRef, DeviceTensor, DeviceTensorMut};
use crate::cuda::device::cuda_err;
use crate::error::Result;
use crate::options::ForwardOptions;
use crate::output::{Dispatch, Output};
use crate::problem::Problem;
use crate::tensor::Element;
use cudarc::driver::DeviceRepr;

/// Runs a host-memory problem on the GPU: upload, launch, download (used by
/// [`crate::forward`] with `Backend::Auto`/`Backend::Cuda`).
pub(crate) fn forward_host_typed<T>(
    engine: &Engine,
    p: &Problem,
    q: &crate::tensor::TensorView,
    k: &crate::tensor::TensorView,
    v: &crate::tensor::TensorView,
    data: [&[T]; 3],
    opts: &ForwardOptions,
) -> Result<Output>
where
    T: Element + DeviceRepr + cudarc::driver::ValidAsZeroBits,
{
    let o_shape = [p.batch, p.seqlen_q, p.heads_q, p.head_dim_v]; // q's shape with v's head_dim
    let mut o_host = vec![T::default(); crate::tensor::numel(o_shape, "output")?];
    let mut lse_host = p.return_lse.then(|| vec![0f32; p.batch * p.heads_q * p.seqlen_q]);
    let dispatch = forward_host_into_typed(engine, p, q, k, v, data, &mut o_host, lse_host.as_deref_mut(), opts)?;
    Ok(Output { o: crate::tensor::Tensor::from_vec(o_host, o_shape)?, lse: lse_host, dispatch })
}

/// As [`forward_host_typed`], downloading into the caller's buffers (`o_dst` contiguous
/// `[batch, seqlen_q, heads_q, head_dim_v]`, `lse_dst` `[batch, heads_q, seqlen_q]`; lengths
/// checked by the caller).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_host_into_typed<T>(
    engine: &Engine,
    p: &Problem,
    q: &crate::tensor::TensorView,
    k: &crate::tensor::TensorView,
    v: &crate::tensor::TensorView,
    data: [&[T]; 3],
    o_dst: &mut [T],
    lse_dst: Option<&mut [f32]>,
    opts: &ForwardOptions,
) -> Result<Dispatch>
where
    T: Element + DeviceRepr + cudarc::driver::ValidAsZeroBits,
{
    let stream = engine.device().default_stream();
    let up = |s: &[T]| stream.clone_htod(s).map_err(cuda_err("cuMemcpyHtoDAsync"));
    let (dq, dk, dv) = (up(data[0])?, up(data[1])?, up(data[2])?);
    let o_shape = [p.batch, p.seqlen_q, p.heads_q, p.head_dim_v]; // q's shape with v's head_dim
    let mut d_o = stream.alloc_zeros::<T>(o_dst.len()).map_err(cuda_err("cuMemAllocAsync(o)"))?;
    let n_lse = p.batch * p.heads_q * p.seqlen_q;
    let mut d_lse = match lse_dst {
        Some(_) => Some(stream.alloc_zeros::<f32>(n_lse).map_err(cuda_err("cuMemAllocAsync(lse)"))?),
        None => None,
    };
    let dispatch = {
        let tq = DeviceTensor::new(&dq, &stream, q.shape()).with_strides(q.strides());
        let tk = DeviceTensor::new(&dk, &stream, k.shape()).with_strides(k.strides());
        let tv = DeviceTensor::new(&dv, &stream, v.shape()).with_strides(v.strides());
        let mut to = DeviceTensorMut::new(&mut d_o, &stream, o_shape);
        let mut tl = d_lse.as_mut().map(|l| DeviceLse::new(l, &stream));
        engine.forward(&stream, &tq, &tk, &tv, &mut to, tl.as_mut(), opts)?
    };
    stream.memcpy_dtoh(&d_o, o_dst).map_err(cuda_err("cuMemcpyDtoHAsync(o)"))?;
    if let (Some(l), Some(dst)) = (&d_lse, lse_dst) {
        stream.memcpy_dtoh(l, dst).map_err(cuda_err("cuMemcpyDtoHAsync(lse)"))?;
    }
    // Kernel faults surface here, as an error of the synchronize.
    stream.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
    Ok(dispatch)
}

/// A host-memory backward on the GPU (`crate::backward` / `backward_into` with an explicit
/// variant on a CUDA backend): uploads q, k, v, o, dO (each view's buffer, its strides kept) and
/// the LSE, runs [`Engine::backward`], downloads dq, dk, dv (and the sink gradient where
/// `d_sinks_dst` is given) into the caller's contiguous buffers (lengths checked by the caller).
/// Compile-checked only.
pub(crate) fn backward_host_into_typed<T>(
    engine: &Engine,
    views: [&crate::tensor::TensorView; 5],
    data: [&[T]; 5],
    lse: &[f32],
    (dq_dst, dk_dst, dv_dst): (&mut [T], &mut [T], &mut [T]),
    d_sinks_dst: Option<&mut [f32]>,
    opts: &ForwardOptions,
) -> Result<Dispatch>
where
    T: Element + DeviceRepr + cudarc::driver::ValidAsZeroBits,
{
    let stream = engine.device().default_stream();
    let up = |s: &[T]| stream.clone_htod(s).map_err(cuda_err("cuMemcpyHtoDAsync"));
    let d_in = [up(data[0])?, up(data[1])?, up(data[2])?, up(data[3])?, up(data[4])?];
    let d_lse = stream.clone_htod(lse).map_err(cuda_err("cuMemcpyHtoDAsync(lse)"))?;
    let zeros = |n: usize| stream.alloc_zeros::<T>(n).map_err(cuda_err("cuMemAllocAsync(gradient)"));
    let (mut d_dq, mut d_dk, mut d_dv) = (zeros(dq_dst.len())?, zeros(dk_dst.len())?, zeros(dv_dst.len())?);
    let mut d_ds = match &d_sinks_dst {
        Some(dst) => Some(stream.alloc_zeros::<f32>(dst.len()).map_err(cuda_err("cuMemAllocAsync(d_sinks)"))?),
        None => None,
    };
    let (q_shape, k_shape) = (views[0].shape(), views[1].shape());
    let dispatch = {
        let t: Vec<DeviceTensor> =
            views.iter().zip(&d_in).map(|(v, d)| DeviceTensor::new(d, &stream, v.shape()).with_strides(v.strides())).collect();
        let tl = DeviceLseRef::new(&d_lse, &stream);
        let x = BackwardInputs { q: &t[0], k: &t[1], v: &t[2], o: &t[3], d_o: &t[4], lse: &tl };
        let mut tdq = DeviceTensorMut::new(&mut d_dq, &stream, q_shape);
        let mut tdk = DeviceTensorMut::new(&mut d_dk, &stream, k_shape);
        let mut tdv = DeviceTensorMut::new(&mut d_dv, &stream, k_shape);
        let mut tds = d_ds.as_mut().map(|d| DeviceLse::new(d, &stream));
        engine.backward(&stream, x, BackwardGrads { dq: &mut tdq, dk: &mut tdk, dv: &mut tdv, d_sinks: tds.as_mut() }, opts)?
    };
    stream.memcpy_dtoh(&d_dq, dq_dst).map_err(cuda_err("cuMemcpyDtoHAsync(dq)"))?;
    stream.memcpy_dtoh(&d_dk, dk_dst).map_err(cuda_err("cuMemcpyDtoHAsync(dk)"))?;
    stream.memcpy_dtoh(&d_dv, dv_dst).map_err(cuda_err("cuMemcpyDtoHAsync(dv)"))?;
    if let (Some(d), Some(dst)) = (&d_ds, d_sinks_dst) {
        stream.memcpy_dtoh(d, dst).map_err(cuda_err("cuMemcpyDtoHAsync(d_sinks)"))?;
    }
    // Kernel faults surface here, as an error of the synchronize.
    stream.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
    Ok(dispatch)
}

//! flash_attn's forward as a candle op.
//!
//! [`FlashAttn`] implements candle's `CustomOp3` over (q, k, v) in FlashAttention's layout
//! `[batch, seqlen, heads, head_dim]` (candle's usual `[b, h, s, d]` is a `transpose(1, 2)`
//! away, and the op reads that transposed view in place: any strides work as long as
//! `head_dim` is contiguous).
//!
//! - On CPU storage the op borrows candle's buffers as strided `flash_attn::TensorView`s and
//!   hands the output `Vec` back to candle as its storage: no copy of inputs or output.
//! - On CUDA storage (feature `cuda`) it launches on candle's own stream, reading candle's
//!   `CudaSlice`s in place and writing a fresh candle buffer.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use flash_attn::ForwardOptions;
//! use flash_attn_candle::flash_attn;
//! # fn main() -> candle_core::Result<()> {
//! let q = Tensor::randn(0f32, 1., (1, 64, 4, 32), &Device::Cpu)?; // [b, s, h, d]
//! let o = flash_attn(&q, &q, &q, ForwardOptions::default().causal(true))?;
//! assert_eq!(o.dims(), &[1, 64, 4, 32]);
//! # Ok(()) }
//! ```

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use flash_attn::{Backend, Element, ForwardOptions, TensorView};

/// The forward pass as a candle op, with flash_attn's options (mask, softcap, ALiBi, scale...).
#[derive(Clone, Debug, Default)]
pub struct FlashAttn {
    pub opts: ForwardOptions,
}

/// `softmax(mask(scale · Q·Kᵀ)) · V` on candle tensors `[batch, seqlen, heads, head_dim]` (f32,
/// f16 or bf16 on the CPU; f16 or bf16 on CUDA). GQA by fewer k/v heads.
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, opts: ForwardOptions) -> candle_core::Result<Tensor> {
    q.apply_op3_no_bwd(k, v, &FlashAttn { opts })
}

fn err(e: flash_attn::Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// The 4-D shape and the strides of batch, seqlen and heads of a candle layout whose last
/// dimension is contiguous.
fn bshd(l: &Layout, what: &str) -> candle_core::Result<([usize; 4], [usize; 3])> {
    let (dims, stride) = (l.dims(), l.stride());
    match (dims, stride) {
        (&[b, s, h, d], &[sb, ss, sh, 1]) => Ok(([b, s, h, d], [sb, ss, sh])),
        (&[_, _, _, _], _) => Err(candle_core::Error::Msg(format!(
            "flash_attn: {what} must have a contiguous last (head_dim) dimension, got strides {stride:?}; call .contiguous()"
        ))),
        _ => Err(candle_core::Error::Msg(format!(
            "flash_attn: {what} must be [batch, seqlen, heads, head_dim], got shape {dims:?}"
        ))),
    }
}

/// A borrowed, strided view of candle CPU data (starting at the layout's offset).
fn view<'a, T: Element>(data: &'a [T], l: &Layout, what: &str) -> candle_core::Result<TensorView<'a>> {
    let (shape, strides) = bshd(l, what)?;
    let data = data.get(l.start_offset()..).unwrap_or(&[]);
    Ok(TensorView::with_strides(data, shape, strides))
}

fn cpu_run<T: Element>(
    opts: &ForwardOptions,
    (q, lq): (&[T], &Layout),
    (k, lk): (&[T], &Layout),
    (v, lv): (&[T], &Layout),
) -> candle_core::Result<(Vec<T>, Shape)> {
    let (qv, kv, vv) = (view(q, lq, "q")?, view(k, lk, "k")?, view(v, lv, "v")?);
    // Candle chose the CPU for these tensors: run there (not on a GPU behind candle's back).
    let out = flash_attn::forward(&qv, &kv, &vv, &opts.clone().backend(Backend::Cpu)).map_err(err)?;
    let shape = Shape::from(out.o.shape().to_vec());
    Ok((out.o.into_vec().map_err(err)?, shape))
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flash-attn"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                let (o, shape) = cpu_run(&self.opts, (q, l1), (k, l2), (v, l3))?;
                Ok((CpuStorage::F32(o), shape))
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                let (o, shape) = cpu_run(&self.opts, (q, l1), (k, l2), (v, l3))?;
                Ok((CpuStorage::F16(o), shape))
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                let (o, shape) = cpu_run(&self.opts, (q, l1), (k, l2), (v, l3))?;
                Ok((CpuStorage::BF16(o), shape))
            }
            _ => Err(candle_core::Error::Msg(format!(
                "flash_attn: q, k, v must all be f32, f16 or bf16, got {:?}, {:?}, {:?}",
                s1.dtype(),
                s2.dtype(),
                s3.dtype()
            ))),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::DType;
        match (s1.dtype(), s2.dtype(), s3.dtype()) {
            (DType::F16, DType::F16, DType::F16) => cuda::run::<half::f16>(&self.opts, (s1, l1), (s2, l2), (s3, l3)),
            (DType::BF16, DType::BF16, DType::BF16) => {
                cuda::run::<half::bf16>(&self.opts, (s1, l1), (s2, l2), (s3, l3))
            }
            (a, b, c) => Err(candle_core::Error::Msg(format!(
                "flash_attn on CUDA: q, k, v must all be f16 or bf16, got {a:?}, {b:?}, {c:?}"
            ))),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{bshd, err};
    // candle's own cudarc (the one its storage is made of), re-exported by candle.
    use candle_core::cuda_backend::cudarc;
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaStorage, Layout, Shape};
    use flash_attn::cuda::{DeviceTensor, DeviceTensorMut, Engine};
    use flash_attn::{Element, ForwardOptions};
    use std::sync::{Arc, Mutex};

    /// One engine per CUDA context, kept: it holds the ALiBi slopes it uploaded (freeing them
    /// would synchronize) and shares the loaded kernels of the primary context.
    static ENGINES: Mutex<Vec<Arc<Engine>>> = Mutex::new(Vec::new());

    fn engine_for(ctx: &Arc<cudarc::driver::CudaContext>) -> candle_core::Result<Arc<Engine>> {
        let mut engines = ENGINES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = engines.iter().find(|e| e.device().context().cu_ctx() == ctx.cu_ctx()) {
            return Ok(e.clone());
        }
        let e = Arc::new(Engine::from_context(ctx.clone()).map_err(err)?);
        engines.push(e.clone());
        Ok(e)
    }

    pub(super) fn run<T>(
        opts: &ForwardOptions,
        (q, lq): (&CudaStorage, &Layout),
        (k, lk): (&CudaStorage, &Layout),
        (v, lv): (&CudaStorage, &Layout),
    ) -> candle_core::Result<(CudaStorage, Shape)>
    where
        T: Element + CudaDType + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
    {
        let dev = q.device.clone();
        let stream = dev.cuda_stream();
        let engine = engine_for(stream.context())?;
        let ((sq, stq), (sk, stk), (sv, stv)) = (bshd(lq, "q")?, bshd(lk, "k")?, bshd(lv, "v")?);
        let (dq, dk, dv) = (q.as_cuda_slice::<T>()?, k.as_cuda_slice::<T>()?, v.as_cuda_slice::<T>()?);
        let (vq, vk, vv) =
            (dq.slice(lq.start_offset()..), dk.slice(lk.start_offset()..), dv.slice(lv.start_offset()..));
        let n: usize = sq.iter().product();
        let mut o = dev.alloc_zeros::<T>(n)?;
        {
            let tq = DeviceTensor::new(&vq, &stream, sq).with_strides(stq);
            let tk = DeviceTensor::new(&vk, &stream, sk).with_strides(stk);
            let tv = DeviceTensor::new(&vv, &stream, sv).with_strides(stv);
            let mut to = DeviceTensorMut::new(&mut o, &stream, sq);
            engine.launch(&stream, &tq, &tk, &tv, &mut to, None, opts).map_err(err)?;
        }
        Ok((CudaStorage::wrap_cuda_slice(o, dev), Shape::from(sq.to_vec())))
    }
}

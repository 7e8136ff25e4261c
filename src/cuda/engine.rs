//! The device-memory API for engines: borrowed device tensors, a caller-chosen stream, output
//! into a caller-provided buffer. After the first call of a given kernel (module load) and of a
//! given ALiBi slope set (one upload), `Engine::forward` allocates nothing and never
//! synchronizes: it validates, picks the kernel (a table lookup) and enqueues one launch.
//!
//! ```no_run
//! # fn main() -> flash_attn::Result<()> {
//! use flash_attn::cuda::{DeviceTensor, DeviceTensorMut, Engine};
//! use flash_attn::ForwardOptions;
//! use half::bf16;
//! let engine = Engine::new(0)?;
//! let stream = engine.device().default_stream();
//! let shape = [1, 128, 8, 64];
//! let n = shape.iter().product::<usize>();
//! let q = stream.clone_htod(&vec![bf16::ONE; n]).unwrap();
//! let (k, v) = (q.clone(), q.clone());
//! let mut o = stream.alloc_zeros::<bf16>(n).unwrap();
//! engine.forward(
//!     &stream,
//!     &DeviceTensor::new(&q, &stream, shape),
//!     &DeviceTensor::new(&k, &stream, shape),
//!     &DeviceTensor::new(&v, &stream, shape),
//!     &mut DeviceTensorMut::new(&mut o, &stream, shape),
//!     None,
//!     &ForwardOptions::default().causal(true),
//! )?;
//! # Ok(()) }
//! ```

use super::device::{cuda_err, Device};
use super::dispatch::{self, Choice};
use super::params::{FwdParams, FLAG_ALIBI, FLAG_RETURN_LSE, FLAG_SOFTCAP};
use crate::api::Dispatch;
use crate::error::{Error, Operand, Result};
use crate::options::ForwardOptions;
use crate::problem::{Problem, LOG2E};
use crate::tensor::{contiguous_strides, DType, Element, Shape};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// Largest grid y/z dimension (heads on y, batch on z).
const MAX_GRID_YZ: usize = 65535;
/// Longest sequence the kernels index (int32 positions with room for a row, the diagonal offset
/// and a tile).
const MAX_SEQLEN: usize = 1 << 30;

/// A borrowed device tensor `[batch, seqlen, heads, head_dim]` (head_dim contiguous), read by
/// the kernel.
#[derive(Debug)]
pub struct DeviceTensor<'a> {
    ptr: u64,
    len: usize,
    dtype: DType,
    shape: Shape,
    strides: [usize; 3],
    /// The stream the tensor was bound to (None for raw pointers).
    stream: Option<cudarc::driver::sys::CUstream>,
    /// cudarc's read record: dropped after the launch, so later writers wait for the kernel.
    _guard: Option<SyncOnDrop<'a>>,
    _borrow: PhantomData<&'a ()>,
}

/// A borrowed device tensor the kernel writes (the output).
#[derive(Debug)]
pub struct DeviceTensorMut<'a> {
    ptr: u64,
    len: usize,
    dtype: DType,
    shape: Shape,
    strides: [usize; 3],
    stream: Option<cudarc::driver::sys::CUstream>,
    _guard: Option<SyncOnDrop<'a>>,
    _borrow: PhantomData<&'a mut ()>,
}

/// A borrowed f32 device buffer for the LSE, `[batch, heads_q, seqlen_q]` contiguous.
#[derive(Debug)]
pub struct DeviceLse<'a> {
    ptr: u64,
    len: usize,
    stream: Option<cudarc::driver::sys::CUstream>,
    _guard: Option<SyncOnDrop<'a>>,
    _borrow: PhantomData<&'a mut ()>,
}

fn strides_of(shape: Shape) -> [usize; 3] {
    contiguous_strides(shape).unwrap_or([usize::MAX; 3])
}

impl<'a> DeviceTensor<'a> {
    /// A contiguous tensor over a cudarc buffer (`CudaSlice` or `CudaView`), to be used on
    /// `stream`: the stream waits for the buffer's earlier writes, and the buffer's later writers
    /// wait for this read (cudarc's event tracking) once the tensor is dropped.
    pub fn new<T: Element + DeviceRepr, S: DevicePtr<T>>(data: &'a S, stream: &'a CudaStream, shape: Shape) -> Self {
        let (ptr, guard) = data.device_ptr(stream);
        DeviceTensor {
            ptr,
            len: data.len(),
            dtype: T::DTYPE,
            shape,
            strides: strides_of(shape),
            stream: Some(stream.cu_stream()),
            _guard: Some(guard),
            _borrow: PhantomData,
        }
    }

    /// A tensor over a raw device address, for engines that do not use cudarc.
    ///
    /// # Safety
    /// 1. `ptr` is a device address in the context of the device the engine runs on, valid for
    ///    `len` elements of `dtype` for as long as the launched kernel runs.
    /// 2. The caller orders the launch stream after every write of this memory and keeps the
    ///    memory alive until the kernel is done (the crate cannot track raw pointers).
    pub unsafe fn from_raw(ptr: u64, len: usize, dtype: DType, shape: Shape) -> Self {
        DeviceTensor { ptr, len, dtype, shape, strides: strides_of(shape), stream: None, _guard: None, _borrow: PhantomData }
    }

    /// Element strides of batch, seqlen and heads (head_dim stays contiguous); checked against
    /// the buffer length by `forward`.
    pub fn with_strides(mut self, strides: [usize; 3]) -> Self {
        self.strides = strides;
        self
    }
    pub fn shape(&self) -> Shape {
        self.shape
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

impl<'a> DeviceTensorMut<'a> {
    /// A contiguous output tensor over a cudarc buffer, written on `stream` (see
    /// [`DeviceTensor::new`]).
    pub fn new<T: Element + DeviceRepr, S: DevicePtrMut<T>>(data: &'a mut S, stream: &'a CudaStream, shape: Shape) -> Self {
        let len = data.len();
        let (ptr, guard) = data.device_ptr_mut(stream);
        DeviceTensorMut {
            ptr,
            len,
            dtype: T::DTYPE,
            shape,
            strides: strides_of(shape),
            stream: Some(stream.cu_stream()),
            _guard: Some(guard),
            _borrow: PhantomData,
        }
    }

    /// An output over a raw device address.
    ///
    /// # Safety
    /// As [`DeviceTensor::from_raw`], and nothing else reads or writes the memory while the
    /// kernel runs.
    pub unsafe fn from_raw(ptr: u64, len: usize, dtype: DType, shape: Shape) -> Self {
        DeviceTensorMut { ptr, len, dtype, shape, strides: strides_of(shape), stream: None, _guard: None, _borrow: PhantomData }
    }

    pub fn with_strides(mut self, strides: [usize; 3]) -> Self {
        self.strides = strides;
        self
    }
    pub fn shape(&self) -> Shape {
        self.shape
    }
}

impl<'a> DeviceLse<'a> {
    /// An LSE output over a cudarc f32 buffer, written on `stream`.
    pub fn new<S: DevicePtrMut<f32>>(data: &'a mut S, stream: &'a CudaStream) -> Self {
        let len = data.len();
        let (ptr, guard) = data.device_ptr_mut(stream);
        DeviceLse { ptr, len, stream: Some(stream.cu_stream()), _guard: Some(guard), _borrow: PhantomData }
    }

    /// # Safety
    /// As [`DeviceTensorMut::from_raw`], for `len` f32 values.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Self {
        DeviceLse { ptr, len, stream: None, _guard: None, _borrow: PhantomData }
    }
}

/// Checks that shape and strides address only elements inside `len` (as the host
/// `TensorView::check_layout`), without allocating on success.
fn check_layout(op: Operand, shape: Shape, strides: [usize; 3], len: usize) -> Result<()> {
    let [b, s, h, d] = shape;
    for (dim, n) in [("batch", b), ("seqlen", s), ("heads", h), ("head_dim", d)] {
        if n == 0 {
            return Err(Error::EmptyDimension { operand: op, dim });
        }
    }
    let last = [(b, strides[0]), (s, strides[1]), (h, strides[2])]
        .iter()
        .try_fold(d - 1, |acc, &(n, st)| (n - 1).checked_mul(st).and_then(|x| x.checked_add(acc)));
    match last {
        Some(last) if last < len => Ok(()),
        _ => Err(Error::InvalidLayout {
            operand: op,
            reason: format!("shape {shape:?} with strides {strides:?} reaches past the {len} elements of the buffer"),
        }),
    }
}

fn check_stream(op: Operand, bound: Option<cudarc::driver::sys::CUstream>, launch: &CudaStream) -> Result<()> {
    match bound {
        Some(s) if s != launch.cu_stream() => Err(Error::InvalidLayout {
            operand: op,
            reason: "the tensor was bound to another stream than the one `forward` launches on".into(),
        }),
        _ => Ok(()),
    }
}

/// Runs the forward kernels on one device.
#[derive(Debug)]
pub struct Engine {
    dev: Arc<Device>,
    /// ALiBi slope sets already uploaded (each kept alive while the engine lives, so a kernel
    /// still reading an older set never sees it freed).
    alibi: Mutex<Vec<AlibiOnDevice>>,
}

/// A host slope set and its device copy.
type AlibiOnDevice = (Arc<[f32]>, CudaSlice<f32>);

impl Engine {
    /// An engine on CUDA device `ordinal`.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] without a driver, built kernels or such a device.
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(Engine { dev: Device::get(ordinal)?, alibi: Mutex::new(Vec::new()) })
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Which kernel `forward` would run for these shapes and options, and why.
    ///
    /// # Errors
    /// As `forward`'s validation and dispatch.
    pub fn dispatch(&self, q_shape: Shape, k_shape: Shape, dtype: DType, opts: &ForwardOptions) -> Result<Dispatch> {
        let p = Problem::from_shapes(q_shape, k_shape, k_shape, dtype, opts)?;
        let c = dispatch::choose(&*self.dev, &p, opts.variant)?;
        Ok(self.record(&c, opts))
    }

    fn record(&self, c: &Choice, opts: &ForwardOptions) -> Dispatch {
        Dispatch {
            backend: format!("cuda:{}", self.dev.ordinal()),
            kernel: super::kernels::kernel_symbol(c.family.name, c.tile.head_dim, c.dtype),
            reason: dispatch::reason(&*self.dev, c, opts.variant),
        }
    }

    /// Attention forward on device memory: `o = softmax(mask(scale · Q·Kᵀ)) · V`, enqueued on
    /// `stream`. q, k, v and o are f16 or bf16 (one dtype); `lse`, when given, receives the
    /// natural-log LSE `[batch, heads_q, seqlen_q]` (and `opts.return_lse` is then implied).
    /// `opts.backend` is ignored (the engine is bound to its device); `opts.variant` selects
    /// the family. Returns without waiting for the kernel.
    ///
    /// # Errors
    /// Validation errors as [`crate::forward`], dtype/layout errors of the device tensors,
    /// dispatch errors, [`Error::Cuda`] when the launch fails.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        stream: &CudaStream,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &mut DeviceTensorMut,
        lse: Option<&mut DeviceLse>,
        opts: &ForwardOptions,
    ) -> Result<Dispatch> {
        let c = self.forward_inner(stream, q, k, v, o, lse, opts)?;
        Ok(self.record(&c, opts))
    }

    /// As [`Engine::forward`], returning nothing, so the hot path allocates nothing.
    ///
    /// # Errors
    /// As [`Engine::forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        stream: &CudaStream,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &mut DeviceTensorMut,
        lse: Option<&mut DeviceLse>,
        opts: &ForwardOptions,
    ) -> Result<()> {
        self.forward_inner(stream, q, k, v, o, lse, opts).map(|_| ())
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_inner(
        &self,
        stream: &CudaStream,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &mut DeviceTensorMut,
        lse: Option<&mut DeviceLse>,
        opts: &ForwardOptions,
    ) -> Result<Choice> {
        if !Arc::ptr_eq(stream.context(), self.dev.context()) {
            return Err(Error::BackendUnavailable {
                backend: format!("cuda:{}", self.dev.ordinal()),
                reason: "the stream belongs to another device's context".into(),
            });
        }
        for (op, t) in [(Operand::Q, q), (Operand::K, k), (Operand::V, v)] {
            check_layout(op, t.shape, t.strides, t.len)?;
            check_stream(op, t.stream, stream)?;
        }
        check_layout(Operand::O, o.shape, o.strides, o.len)?;
        check_stream(Operand::O, o.stream, stream)?;
        for (op, dt) in [(Operand::K, k.dtype), (Operand::V, v.dtype), (Operand::O, o.dtype)] {
            if dt != q.dtype {
                return Err(Error::DTypeMismatch { operand: op, got: dt, expected: q.dtype });
            }
        }
        if o.shape != q.shape {
            return Err(Error::ShapeMismatch {
                what: "o".into(),
                got: format!("{:?}", o.shape),
                expected: format!("{:?} (the shape of q)", q.shape),
            });
        }
        let p = Problem::from_shapes(q.shape, k.shape, v.shape, q.dtype, opts)?;
        let mut c = dispatch::choose(&*self.dev, &p, opts.variant)?;
        let (ptrs, strides) = ([q.ptr, k.ptr, v.ptr, o.ptr], [q.strides, k.strides, v.strides, o.strides]);
        if let Some(why) = dispatch::layout_unmet(c.family, ptrs, strides) {
            c = dispatch::fall_back(&*self.dev, &p, opts.variant, &c, why)?;
        }

        let lse_ptr = match lse {
            Some(l) => {
                let need = p.batch * p.heads_q * p.seqlen_q;
                if l.len < need {
                    return Err(Error::ShapeMismatch {
                        what: "lse buffer".into(),
                        got: format!("{} f32", l.len),
                        expected: format!("at least {need} f32 ([batch, heads_q, seqlen_q])"),
                    });
                }
                check_stream(Operand::O, l.stream, stream)?;
                l.ptr
            }
            None => 0,
        };
        let alibi_ptr = match &p.alibi {
            Some(slopes) => self.alibi_on_device(slopes, stream)?,
            None => 0,
        };
        // Kernels index rows, keys and tiles in int32: seqlens up to 2^30 leave room for a row
        // plus the diagonal offset plus a tile, and the persistent FA3 stage counts
        // ceil(seqlen_q / 64) * heads * batch tiles in an int32.
        let tiles = p.seqlen_q.div_ceil(64) as u128 * p.heads_q as u128 * p.batch as u128;
        if p.heads_q > MAX_GRID_YZ
            || p.batch > MAX_GRID_YZ
            || p.seqlen_q.max(p.seqlen_k) > MAX_SEQLEN
            || tiles > i32::MAX as u128
        {
            return Err(Error::TooLarge {
                what: format!(
                    "batch {} / heads {} (at most {MAX_GRID_YZ} each), seqlens {} / {} (at most 2^30), or {tiles} \
                     (query tile, head, batch) tiles (at most i32::MAX) for the CUDA kernels",
                    p.batch, p.heads_q, p.seqlen_q, p.seqlen_k
                ),
            });
        }
        let st = |s: usize| s as i64; // strides were checked to address inside the buffer: they fit
        // Problem::new clamped the bounds to the sequence (<= 2^30 here); mask.cuh is 64-bit anyway.
        let window = |w: Option<usize>| w.map_or(-1, |x| x.min(MAX_SEQLEN) as i32);
        let mut flags = 0;
        if lse_ptr != 0 {
            flags |= FLAG_RETURN_LSE;
        }
        if p.softcap.is_some() {
            flags |= FLAG_SOFTCAP;
        }
        if alibi_ptr != 0 {
            flags |= FLAG_ALIBI;
        }
        let params = FwdParams {
            q: q.ptr,
            k: k.ptr,
            v: v.ptr,
            o: o.ptr,
            lse: lse_ptr,
            alibi_slopes: alibi_ptr,
            q_batch_stride: st(q.strides[0]),
            q_row_stride: st(q.strides[1]),
            q_head_stride: st(q.strides[2]),
            k_batch_stride: st(k.strides[0]),
            k_row_stride: st(k.strides[1]),
            k_head_stride: st(k.strides[2]),
            v_batch_stride: st(v.strides[0]),
            v_row_stride: st(v.strides[1]),
            v_head_stride: st(v.strides[2]),
            o_batch_stride: st(o.strides[0]),
            o_row_stride: st(o.strides[1]),
            o_head_stride: st(o.strides[2]),
            batch: p.batch as i32,
            seqlen_q: p.seqlen_q as i32,
            seqlen_k: p.seqlen_k as i32,
            heads_q: p.heads_q as i32,
            heads_kv: p.heads_kv as i32,
            head_dim: p.head_dim as i32,
            window_left: window(p.left),
            window_right: window(p.right),
            softmax_scale: p.scale,
            // Score units -> log2 units (softmax_fwd.cuh): natural-unit scores with softcap or
            // ALiBi, raw q·k otherwise.
            softmax_scale_log2: if p.softcap.is_some() || p.alibi.is_some() { LOG2E } else { p.scale * LOG2E },
            softcap: p.softcap.unwrap_or(0.0),
            flags,
            ..FwdParams::default()
        };
        self.launch_params(stream, &c, params)?;
        Ok(c)
    }

    /// The device copy of a slope set, uploaded (and synchronized, so any stream may read it)
    /// the first time this set is seen.
    fn alibi_on_device(&self, slopes: &Arc<[f32]>, stream: &CudaStream) -> Result<u64> {
        let mut cache = self.alibi.lock().unwrap_or_else(|e| e.into_inner());
        let found = cache.iter().position(|(s, _)| Arc::ptr_eq(s, slopes) || s[..] == slopes[..]);
        let i = match found {
            Some(i) => i,
            None => {
                let ds = self.dev.default_stream();
                let buf = ds.clone_htod(&slopes[..]).map_err(cuda_err("cuMemcpyHtoDAsync(alibi)"))?;
                ds.synchronize().map_err(cuda_err("cuStreamSynchronize(alibi)"))?;
                cache.push((slopes.clone(), buf));
                cache.len() - 1
            }
        };
        let (ptr, _record) = cache[i].1.device_ptr(stream);
        Ok(ptr)
    }

    fn launch_params(&self, stream: &CudaStream, c: &Choice, mut params: FwdParams) -> Result<()> {
        if let Some(stage) = super::kernels::fa3_stage(c.family.name) {
            return super::fa3::launch(&self.dev, stream, c, stage, params);
        }
        let f = self.dev.function(c.family, c.tile, c.dtype)?;
        let grid = (
            params.seqlen_q.unsigned_abs().div_ceil(f.tile.block_m),
            params.heads_q.unsigned_abs(),
            params.batch.unsigned_abs(),
        );
        let block = (f.tile.threads, 1, 1);
        self.dev.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        let mut args = [&mut params as *mut FwdParams as *mut std::ffi::c_void];
        // SAFETY: the kernel takes exactly one parameter, `const __grid_constant__ FwdParams`,
        // whose layout FwdParams mirrors (size and offsets asserted on both sides); `args`
        // points at it for the duration of the call (cuLaunchKernel copies parameters). Every
        // address in it was checked above to cover the elements the shapes and strides reach,
        // and the kernel is launched with the block size and dynamic shared memory its
        // instance was compiled for (the kernel traps otherwise).
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.func.cu_function(),
                grid,
                block,
                f.smem_bytes,
                stream.cu_stream(),
                &mut args,
            )
        }
        .map_err(cuda_err("cuLaunchKernel"))
    }
}

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
) -> Result<crate::Output>
where
    T: Element + DeviceRepr + cudarc::driver::ValidAsZeroBits,
{
    let stream = engine.device().default_stream();
    let up = |s: &[T]| stream.clone_htod(s).map_err(cuda_err("cuMemcpyHtoDAsync"));
    let (dq, dk, dv) = (up(data[0])?, up(data[1])?, up(data[2])?);
    let o_shape = q.shape();
    let n_o = crate::tensor::numel(o_shape, "output")?;
    let mut d_o = stream.alloc_zeros::<T>(n_o).map_err(cuda_err("cuMemAllocAsync(o)"))?;
    let n_lse = p.batch * p.heads_q * p.seqlen_q;
    let mut d_lse = if p.return_lse {
        Some(stream.alloc_zeros::<f32>(n_lse).map_err(cuda_err("cuMemAllocAsync(lse)"))?)
    } else {
        None
    };
    let dispatch = {
        let tq = DeviceTensor::new(&dq, &stream, q.shape()).with_strides(q.strides());
        let tk = DeviceTensor::new(&dk, &stream, k.shape()).with_strides(k.strides());
        let tv = DeviceTensor::new(&dv, &stream, v.shape()).with_strides(v.strides());
        let mut to = DeviceTensorMut::new(&mut d_o, &stream, o_shape);
        let mut tl = d_lse.as_mut().map(|l| DeviceLse::new(l, &stream));
        engine.forward(&stream, &tq, &tk, &tv, &mut to, tl.as_mut(), opts)?
    };
    let o_host: Vec<T> = stream.clone_dtoh(&d_o).map_err(cuda_err("cuMemcpyDtoHAsync(o)"))?;
    let lse_host = match &d_lse {
        Some(l) => Some(stream.clone_dtoh(l).map_err(cuda_err("cuMemcpyDtoHAsync(lse)"))?),
        None => None,
    };
    // Kernel faults surface here, as an error of the synchronize.
    stream.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
    Ok(crate::Output { o: crate::tensor::Tensor::from_vec(o_host, o_shape)?, lse: lse_host, dispatch })
}

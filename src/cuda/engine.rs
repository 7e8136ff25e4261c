//! The device-memory API for engines: borrowed device tensors, the caller's stream (a cudarc
//! `CudaStream` of any `Arc` of the same context, e.g. candle's, or a raw `CUstream` for
//! engines that do not use cudarc), output into a caller-provided buffer. After the first call
//! of a given kernel (module load) and of a given ALiBi slope set (one asynchronous upload on
//! the caller's stream, or [`Engine::prepare_alibi`] beforehand), `Engine::launch` allocates
//! nothing and never synchronizes: it validates, picks the kernel (a table lookup) and enqueues
//! one launch, so it can be captured in a CUDA graph.
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
use super::fp8::{self, Fp8Scratch};
use super::combine;
use super::launch::{launch, launch_combine, launch_fp8_prepass, plan_launch};
use super::params::{FwdParams, Operands};
use super::select::{self, Choice};
use super::table::{kernel_symbol, KernelOptions};
use crate::error::{Error, Operand, Result};
use crate::options::{ForwardOptions, Fp8Scaling, Precision};
use crate::output::{Dispatch, Output};
use crate::problem::Problem;
use crate::tensor::{check_extent, contiguous_strides, DType, Element, Shape};
use cudarc::driver::{result, sys, CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

mod serving;
pub use serving::{DeviceAppend, DeviceIndex, DeviceKv};
pub(crate) use serving::serving_host_typed;

/// A `CUstream` handle kept as an address, so the tensors that remember theirs are `Send`
/// (only compared, never dereferenced).
type StreamId = usize;

fn stream_id(s: sys::CUstream) -> StreamId {
    s as StreamId
}

/// Largest grid y/z dimension (heads on y, batch on z).
const MAX_GRID_YZ: usize = 65535;
/// Longest sequence the kernels index (int32 positions with room for a row, the diagonal offset
/// and a tile).
const MAX_SEQLEN: usize = 1 << 30;

/// What every borrowed device buffer records: where it lives, what it holds, the stream it was
/// bound to (None for raw pointers) and cudarc's access record, dropped after the launch so that
/// later accesses wait for the kernel.
#[derive(Debug)]
struct Bound<'a> {
    ptr: u64,
    len: usize,
    dtype: DType,
    shape: Shape,
    strides: [usize; 3],
    stream: Option<StreamId>,
    _guard: Option<SyncOnDrop<'a>>,
}

impl<'a> Bound<'a> {
    /// A contiguous `shape` over a cudarc buffer's `(ptr, guard)`, used on `stream`.
    fn cudarc((ptr, guard): (u64, SyncOnDrop<'a>), len: usize, dtype: DType, shape: Shape, stream: &CudaStream) -> Self {
        let stream = Some(stream_id(stream.cu_stream()));
        Bound { ptr, len, dtype, shape, strides: strides_of(shape), stream, _guard: Some(guard) }
    }

    /// A contiguous `shape` over a raw device address.
    fn raw(ptr: u64, len: usize, dtype: DType, shape: Shape) -> Self {
        Bound { ptr, len, dtype, shape, strides: strides_of(shape), stream: None, _guard: None }
    }
}

/// A borrowed device tensor `[batch, seqlen, heads, head_dim]` (head_dim contiguous), read by
/// the kernel.
#[derive(Debug)]
pub struct DeviceTensor<'a> {
    b: Bound<'a>,
    _borrow: PhantomData<&'a ()>,
}

/// A borrowed device tensor the kernel writes (the output).
#[derive(Debug)]
pub struct DeviceTensorMut<'a> {
    b: Bound<'a>,
    _borrow: PhantomData<&'a mut ()>,
}

/// A borrowed f32 device buffer for the LSE, `[batch, heads_q, seqlen_q]` contiguous.
#[derive(Debug)]
pub struct DeviceLse<'a> {
    b: Bound<'a>,
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
        let b = Bound::cudarc(data.device_ptr(stream), data.len(), T::DTYPE, shape, stream);
        DeviceTensor { b, _borrow: PhantomData }
    }

    /// A tensor over a raw device address, for engines that do not use cudarc.
    ///
    /// # Safety
    /// 1. `ptr` is a device address in the context of the device the engine runs on, valid for
    ///    `len` elements of `dtype` for as long as the launched kernel runs.
    /// 2. The caller orders the launch stream after every write of this memory and keeps the
    ///    memory alive until the kernel is done (the crate cannot track raw pointers).
    pub unsafe fn from_raw(ptr: u64, len: usize, dtype: DType, shape: Shape) -> Self {
        DeviceTensor { b: Bound::raw(ptr, len, dtype, shape), _borrow: PhantomData }
    }

    /// Element strides of batch, seqlen and heads (head_dim stays contiguous); checked against
    /// the buffer length by `forward`.
    pub fn with_strides(mut self, strides: [usize; 3]) -> Self {
        self.b.strides = strides;
        self
    }
    pub fn shape(&self) -> Shape {
        self.b.shape
    }
    pub fn dtype(&self) -> DType {
        self.b.dtype
    }
}

impl<'a> DeviceTensorMut<'a> {
    /// A contiguous output tensor over a cudarc buffer, written on `stream` (see
    /// [`DeviceTensor::new`]).
    pub fn new<T: Element + DeviceRepr, S: DevicePtrMut<T>>(data: &'a mut S, stream: &'a CudaStream, shape: Shape) -> Self {
        let len = data.len();
        let b = Bound::cudarc(data.device_ptr_mut(stream), len, T::DTYPE, shape, stream);
        DeviceTensorMut { b, _borrow: PhantomData }
    }

    /// An output over a raw device address.
    ///
    /// # Safety
    /// As [`DeviceTensor::from_raw`], and nothing else reads or writes the memory while the
    /// kernel runs.
    pub unsafe fn from_raw(ptr: u64, len: usize, dtype: DType, shape: Shape) -> Self {
        DeviceTensorMut { b: Bound::raw(ptr, len, dtype, shape), _borrow: PhantomData }
    }

    pub fn with_strides(mut self, strides: [usize; 3]) -> Self {
        self.b.strides = strides;
        self
    }
    pub fn shape(&self) -> Shape {
        self.b.shape
    }
}

impl<'a> DeviceLse<'a> {
    /// An LSE output over a cudarc f32 buffer, written on `stream`.
    pub fn new<S: DevicePtrMut<f32>>(data: &'a mut S, stream: &'a CudaStream) -> Self {
        let len = data.len();
        let b = Bound::cudarc(data.device_ptr_mut(stream), len, DType::F32, [1, 1, 1, len], stream);
        DeviceLse { b, _borrow: PhantomData }
    }

    /// # Safety
    /// As [`DeviceTensorMut::from_raw`], for `len` f32 values.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Self {
        DeviceLse { b: Bound::raw(ptr, len, DType::F32, [1, 1, 1, len]), _borrow: PhantomData }
    }
}

/// A borrowed f32 device buffer read as an LSE: a state's input of [`Engine::merge_states`],
/// `[batch, heads, seqlen]` contiguous (a packed batch: `[heads, total_q]`), as the forward
/// writes it.
#[derive(Debug)]
pub struct DeviceLseRef<'a> {
    b: Bound<'a>,
    _borrow: PhantomData<&'a ()>,
}

impl<'a> DeviceLseRef<'a> {
    /// An LSE input over a cudarc f32 buffer, read on `stream` (see [`DeviceTensor::new`]).
    pub fn new<S: DevicePtr<f32>>(data: &'a S, stream: &'a CudaStream) -> Self {
        let len = data.len();
        let b = Bound::cudarc(data.device_ptr(stream), len, DType::F32, [1, 1, 1, len], stream);
        DeviceLseRef { b, _borrow: PhantomData }
    }

    /// # Safety
    /// As [`DeviceTensor::from_raw`], for `len` f32 values.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Self {
        DeviceLseRef { b: Bound::raw(ptr, len, DType::F32, [1, 1, 1, len]), _borrow: PhantomData }
    }
}

/// The device address of the LSE output (0: none), checked to hold [batch, heads_q, seqlen_q] f32
/// and to be bound to the launch's stream.
fn lse_address(lse: Option<&DeviceLse>, p: &Problem, sid: StreamId) -> Result<u64> {
    let Some(l) = lse.map(|l| &l.b) else { return Ok(0) };
    let need = p.batch * p.heads_q * p.seqlen_q;
    if l.len < need {
        return Err(Error::ShapeMismatch {
            what: "lse buffer".into(),
            got: format!("{} f32", l.len),
            expected: format!("at least {need} f32 ([batch, heads_q, seqlen_q])"),
        });
    }
    check_stream(Operand::O, l.stream, sid)?;
    Ok(l.ptr)
}

fn check_stream(op: Operand, bound: Option<StreamId>, launch: StreamId) -> Result<()> {
    match bound {
        Some(s) if s != launch => Err(Error::StreamMismatch {
            what: format!("{op} (a tensor bound with `new(.., stream, ..)`)"),
            got: format!("bound to stream {s:#x}"),
            expected: format!("the stream the launch is enqueued on ({launch:#x}); bind it to that stream"),
        }),
        _ => Ok(()),
    }
}

/// e4m3 codes an engine quantised itself, for [`Engine::launch_fp8_codes_raw`] (FlashAttention-3's
/// FP8 input, with V transposed): device addresses, contiguous.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Codes {
    /// e4m3 codes of Q `[batch, seqlen_q, heads_q, head_dim]` and K `[batch, seqlen_k, heads_kv,
    /// head_dim]`, 16-byte aligned.
    pub q: u64,
    pub k: u64,
    /// e4m3 codes of Vᵀ `[batch, heads_kv, head_dim, vt_row_stride]` (keys contiguous; keys past
    /// seqlen_k are not read), 16-byte aligned.
    pub vt: u64,
    /// Bytes between head_dim rows of Vᵀ: at least seqlen_k, a multiple of 16.
    pub vt_row_stride: usize,
    /// f32 descales (code · descale = value): Q `[batch, heads_q]` (FA3's per-(batch, kv-head)
    /// Q descale repeated over each group of query heads), K and V `[batch, heads_kv]`.
    pub q_descale: u64,
    pub k_descale: u64,
    pub v_descale: u64,
}

/// Runs the forward kernels on one device (one CUDA context).
#[derive(Debug)]
pub struct Engine {
    dev: Arc<Device>,
    /// ALiBi slope sets already uploaded, each kept while the engine lives (a kernel still
    /// reading an older set never sees it freed).
    alibi: Mutex<Vec<AlibiOnDevice>>,
}

/// A slope set on the device: uploaded once, asynchronously, on the stream of the call that
/// first used it; `ready` is recorded after the copy so a launch on another stream can wait for
/// it while it is still in flight.
#[derive(Debug)]
struct AlibiOnDevice {
    /// The host copy: compared with later sets, and the source of the asynchronous copy (so it
    /// must outlive it).
    host: Arc<[f32]>,
    ptr: sys::CUdeviceptr,
    ready: sys::CUevent,
    uploaded_on: StreamId,
    ctx: Arc<CudaContext>,
}

// SAFETY: the device pointer and the event are driver handles of `ctx`, used only through
// driver calls (thread-safe) with the context bound; the host slopes are immutable.
unsafe impl Send for AlibiOnDevice {}

impl Drop for AlibiOnDevice {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` and `ready` were created in `ctx` by `Engine::alibi_on_device` and are
            // released once, here. cuMemFree waits for the device work that may still read the
            // slopes (it synchronizes), so no kernel sees them freed.
            unsafe {
                let _ = result::event::destroy(self.ready);
                let _ = result::free_sync(self.ptr);
            }
        }
    }
}

impl Engine {
    /// An engine on CUDA device `ordinal` (its primary context, the one cudarc's
    /// `CudaContext::new(ordinal)` and candle use).
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] without a driver, built kernels or such a device.
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(Engine { dev: Device::get(ordinal)?, alibi: Mutex::new(Vec::new()) })
    }

    /// An engine on a context the caller already holds, e.g. candle's
    /// `cuda_device.cuda_stream().context().clone()`. For a primary context this shares the
    /// kernels [`Engine::new`] loads; streams of that context are accepted whichever `Arc` they
    /// came through (contexts are compared by their `CUcontext` handle).
    ///
    /// # Errors
    /// As [`Engine::new`].
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Self> {
        Ok(Engine { dev: Device::for_context(ctx)?, alibi: Mutex::new(Vec::new()) })
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
        let c = select::choose(&*self.dev, &p, opts.variant)?;
        Ok(self.record(&c, opts))
    }

    fn record(&self, c: &Choice, opts: &ForwardOptions) -> Dispatch {
        Dispatch {
            backend: format!("cuda:{}", self.dev.ordinal()),
            kernel: kernel_symbol(c.family.name, c.tile.head_dim, c.dtype),
            reason: select::reason(&*self.dev, c, opts.variant),
        }
    }

    /// `stream` as a raw handle, after checking it belongs to the engine's context.
    fn own_stream(&self, stream: &CudaStream) -> Result<sys::CUstream> {
        let (got, want) = (stream.context().cu_ctx(), self.dev.context().cu_ctx());
        if got != want {
            return Err(Error::StreamMismatch {
                what: "stream".into(),
                got: format!("a stream of context {:#x} (device {})", got as usize, stream.context().ordinal()),
                expected: format!("a stream of the engine's context {:#x} (device {})", want as usize, self.dev.ordinal()),
            });
        }
        Ok(stream.cu_stream())
    }

    /// Attention forward on device memory: `o = softmax(mask(scale · Q·Kᵀ)) · V`, enqueued on
    /// `stream`. q, k, v and o are f16 or bf16 (one dtype); `lse`, when given, receives the
    /// natural-log LSE `[batch, heads_q, seqlen_q]` (and `opts.return_lse` is then implied).
    /// `opts.backend` is ignored (the engine is bound to its device); `opts.variant` selects
    /// the family. Returns without waiting for the kernel.
    ///
    /// # Errors
    /// Validation errors as [`crate::forward`], dtype/layout errors of the device tensors,
    /// [`Error::StreamMismatch`] for a stream of another context or a tensor bound to another
    /// stream, dispatch errors, [`Error::Cuda`] when the launch fails.
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
        let raw = self.own_stream(stream)?;
        let c = self.forward_inner(raw, q, k, v, o, lse, opts)?;
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
        let raw = self.own_stream(stream)?;
        self.forward_inner(raw, q, k, v, o, lse, opts).map(|_| ())
    }

    /// As [`Engine::launch`] on a raw `CUstream`, for engines that do not use cudarc (their
    /// tensors come from [`DeviceTensor::from_raw`]). The stream's context is checked against
    /// the engine's (`cuStreamGetCtx`).
    ///
    /// # Safety
    /// `stream` is a valid stream handle (or null, the context's legacy default stream) that
    /// stays alive until the launch is enqueued; the caller orders it with the work of its
    /// owner as for any launch.
    ///
    /// # Errors
    /// As [`Engine::forward`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_raw(
        &self,
        stream: sys::CUstream,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &mut DeviceTensorMut,
        lse: Option<&mut DeviceLse>,
        opts: &ForwardOptions,
    ) -> Result<()> {
        // SAFETY: `stream` is a valid handle (this function's contract).
        unsafe { self.bind_raw_stream(stream) }?;
        self.forward_inner(stream, q, k, v, o, lse, opts).map(|_| ())
    }

    /// Makes the engine's context current and checks that a caller's raw `stream` belongs to it
    /// (`cuStreamGetCtx`): the first step of every `*_raw` entry point.
    ///
    /// # Safety
    /// `stream` is a valid stream handle (or null, the context's legacy default stream).
    pub(crate) unsafe fn bind_raw_stream(&self, stream: sys::CUstream) -> Result<()> {
        self.dev.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `stream` is a valid handle (the caller's contract); `ctx` is a valid out pointer.
        unsafe { sys::cuStreamGetCtx(stream, &mut ctx) }.result().map_err(cuda_err("cuStreamGetCtx"))?;
        let want = self.dev.context().cu_ctx();
        if ctx != want {
            return Err(Error::StreamMismatch {
                what: "raw stream".into(),
                got: format!("a stream of context {:#x}", ctx as usize),
                expected: format!("a stream of the engine's context {:#x} (device {})", want as usize, self.dev.ordinal()),
            });
        }
        Ok(())
    }

    /// Uploads an ALiBi slope set (one per query head) on `stream` without synchronizing, so
    /// later launches with the same set (`opts.alibi_slopes`, compared by content) upload
    /// nothing; call it before capturing launches into a CUDA graph (a set first seen during a
    /// capture is an error, since a host-to-device copy from pageable memory cannot be
    /// captured). Without it, the first launch with a set uploads it the same way on its stream.
    ///
    /// # Errors
    /// [`Error::InvalidAlibi`] for a non-finite slope, [`Error::StreamMismatch`], [`Error::Cuda`].
    pub fn prepare_alibi(&self, stream: &CudaStream, slopes: &[f32]) -> Result<()> {
        if let Some(bad) = slopes.iter().find(|x| !x.is_finite()) {
            return Err(Error::InvalidAlibi {
                got: slopes.len(),
                expected: slopes.len(),
                reason: format!("slope {bad} is not finite"),
            });
        }
        let raw = self.own_stream(stream)?;
        self.dev.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        self.alibi_on_device(&Arc::from(slopes), raw).map(|_| ())
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_inner(
        &self,
        stream: sys::CUstream,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        o: &mut DeviceTensorMut,
        lse: Option<&mut DeviceLse>,
        opts: &ForwardOptions,
    ) -> Result<Choice> {
        let (q, k, v, o) = (&q.b, &k.b, &v.b, &o.b);
        let sid = stream_id(stream);
        for (op, t) in [(Operand::Q, q), (Operand::K, k), (Operand::V, v)] {
            check_extent(op, t.shape, t.strides, t.len)?;
            check_stream(op, t.stream, sid)?;
        }
        check_extent(Operand::O, o.shape, o.strides, o.len)?;
        check_stream(Operand::O, o.stream, sid)?;
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
        let mut ops = Operands {
            ptrs: [q.ptr, k.ptr, v.ptr, o.ptr],
            strides: [q.strides, k.strides, v.strides, o.strides],
            lse: 0,
            alibi: 0,
        };
        let c = select::choose_for(&*self.dev, &p, opts.variant, &ops)?;

        ops.lse = lse_address(lse.as_deref(), &p, sid)?;
        self.dev.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        ops.alibi = match &p.alibi {
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
        if c.family.options.contains(KernelOptions::FP8) {
            self.fp8_forward(stream, &p, &ops, &c)?;
            return Ok(c);
        }
        // Strides were checked above to address inside the buffers, seqlens to fit i32.
        let plan = plan_launch(c.family, c.tile, p.dtype, FwdParams::for_launch(&p, &ops), self.dev.sm_count())?;
        let f = self.dev.function(c.family, c.tile, c.dtype)?;
        launch(&f, stream, &plan)?;
        Ok(c)
    }

    /// Merges two attention states of the same queries over disjoint key sets on the device
    /// (FlashInfer's `merge_state`; the device form of [`crate::serving::merge_states`], same
    /// rules): `lse = log(exp(lse_a) + exp(lse_b))`, `o = exp(lse_a − lse)·o_a +
    /// exp(lse_b − lse)·o_b`; a state with LSE −inf weighs nothing (its o is not read), all −inf
    /// gives o = 0 and LSE −inf, NaN in an LSE makes the row NaN. `o_a`, `o_b` and `o` are
    /// `[batch, seqlen, heads, head_dim]` (strides allowed) of one dtype (f32, f16 or bf16),
    /// head_dim at most 256; the LSEs `[batch, heads, seqlen]` f32 (packed: `[1, total_q, ..]`
    /// and `[heads, total_q]`), as the forward writes them; `lse` (optional) receives the
    /// merged one. Computed in f32 (the host merges in f64; docs/serving.md gives the bound).
    /// One launch of the combine kernel on `stream`, without waiting.
    ///
    /// # Errors
    /// As the host `merge_states` ([`Error::ShapeMismatch`], [`Error::DTypeMismatch`],
    /// [`Error::InvalidLayout`]), for the output too; [`Error::UnsupportedHeadDim`] above 256;
    /// [`Error::StreamMismatch`]; [`Error::Cuda`].
    #[allow(clippy::too_many_arguments)]
    pub fn merge_states(
        &self,
        stream: &CudaStream,
        o_a: &DeviceTensor,
        lse_a: &DeviceLseRef,
        o_b: &DeviceTensor,
        lse_b: &DeviceLseRef,
        o: &mut DeviceTensorMut,
        lse: Option<&mut DeviceLse>,
    ) -> Result<()> {
        self.merge_states_n(stream, &[(o_a, lse_a), (o_b, lse_b)], o, lse)
    }

    /// The n-way [`Engine::merge_states`] (FlashInfer's `merge_states`): one state per disjoint
    /// key set, in any order, at most 64 per call (merging is associative: merge longer lists
    /// in groups, keeping the groups' results in f32).
    ///
    /// # Errors
    /// As [`Engine::merge_states`], [`Error::InvalidOption`] for an empty list or more than 64
    /// states.
    pub fn merge_states_n(
        &self,
        stream: &CudaStream,
        states: &[(&DeviceTensor, &DeviceLseRef)],
        o: &mut DeviceTensorMut,
        lse: Option<&mut DeviceLse>,
    ) -> Result<()> {
        let raw = self.own_stream(stream)?;
        let sid = stream_id(raw);
        let rows = crate::serving::merge::check_states(
            states.len(),
            |i| (states[i].0.b.shape, states[i].0.b.dtype, states[i].1.b.len),
            |i| check_extent(Operand::O, states[i].0.b.shape, states[i].0.b.strides, states[i].0.b.len),
        )?;
        combine::check_state_count(states.len())?;
        let (shape, dtype) = (states[0].0.b.shape, states[0].0.b.dtype);
        for (t, l) in states {
            check_stream(Operand::O, t.b.stream, sid)?;
            check_stream(Operand::O, l.b.stream, sid)?;
        }
        let (o, lse) = (&o.b, lse.map(|l| &l.b));
        if o.shape != shape {
            return Err(Error::ShapeMismatch {
                what: "o".into(),
                got: format!("{:?}", o.shape),
                expected: format!("{shape:?} (the shape of state 0)"),
            });
        }
        if o.dtype != dtype {
            return Err(Error::DTypeMismatch { operand: Operand::O, got: o.dtype, expected: dtype });
        }
        check_stream(Operand::O, o.stream, sid)?;
        if let Some(l) = lse {
            if l.len != rows {
                let [b, s, h, _] = shape;
                return Err(Error::ShapeMismatch {
                    what: "lse".into(),
                    got: format!("{} values", l.len),
                    expected: format!("{rows} = batch {b} x heads {h} x seqlen {s} ([batch, heads, seqlen])"),
                });
            }
            check_stream(Operand::O, l.stream, sid)?;
        }
        if rows == 0 {
            return Ok(()); // nothing to merge (as the host's empty result)
        }
        check_extent(Operand::O, o.shape, o.strides, o.len)?;
        let mut list = [combine::StateRows::default(); combine::MAX_INPUTS];
        for (dst, (t, l)) in list.iter_mut().zip(states) {
            *dst = combine::StateRows { o: combine::Rows { ptr: t.b.ptr, strides: t.b.strides }, lse: l.b.ptr };
        }
        let out = combine::Rows { ptr: o.ptr, strides: o.strides };
        let plan = combine::merge_plan(shape, dtype, dtype, &list[..states.len()], out, lse.map_or(0, |l| l.ptr))?;
        self.dev.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        let f = self.dev.standalone_function(combine::row(), plan.kernel)?;
        launch_combine(&f, raw, &plan)
    }

    /// The FP8 consumer on e4m3 codes the caller quantised itself (FlashAttention-3's FP8
    /// input): no pre-pass. `q_shape` / `k_shape` are `[batch, seqlen, heads, head_dim]`;
    /// `opts.precision` must be `Precision::Fp8 { scaling: Fp8Scaling::PerTensor, .. }` (one
    /// descale per (batch, head): the consumer's `descale_block = 0` layout; `hadamard` is the
    /// caller's business: a rotation of Q and K leaves Q·Kᵀ unchanged) and `opts.variant`
    /// `Variant::Fa3` (or `Auto` once the FP8 row is GPU-verified). `o` (bf16/f16, `q_shape`)
    /// and `lse` as in [`Engine::forward`]. Enqueued on `stream` without waiting.
    ///
    /// # Safety
    /// `stream` is a valid stream of the engine's context (checked, as in
    /// [`Engine::launch_raw`]); every address of `codes` holds what [`Fp8Codes`] says, on this
    /// device, until the kernel has run.
    ///
    /// # Errors
    /// Validation and dispatch errors as [`Engine::forward`]; [`Error::InvalidOption`] for
    /// another scaling or a chosen family that is not FP8; [`Error::InvalidLayout`] for
    /// addresses or a `vt_row_stride` that are not multiples of 16 bytes; [`Error::Cuda`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_fp8_codes_raw(
        &self,
        stream: sys::CUstream,
        q_shape: Shape,
        k_shape: Shape,
        codes: &Fp8Codes,
        o: &mut DeviceTensorMut,
        lse: Option<&mut DeviceLse>,
        opts: &ForwardOptions,
    ) -> Result<()> {
        if !matches!(opts.precision, Precision::Fp8 { scaling: Fp8Scaling::PerTensor, .. }) {
            return Err(Error::InvalidOption {
                option: "precision",
                got: format!("{:?}", opts.precision),
                expected: "Precision::Fp8 with Fp8Scaling::PerTensor (one descale per (batch, head))".into(),
            });
        }
        // SAFETY: `stream` is a valid handle (this function's contract).
        unsafe { self.bind_raw_stream(stream) }?;
        let (o, sid) = (&o.b, stream_id(stream));
        check_extent(Operand::O, o.shape, o.strides, o.len)?;
        check_stream(Operand::O, o.stream, sid)?;
        if o.shape != q_shape {
            return Err(Error::ShapeMismatch {
                what: "o".into(),
                got: format!("{:?}", o.shape),
                expected: format!("{q_shape:?} (the shape of q)"),
            });
        }
        let p = Problem::from_shapes(q_shape, k_shape, k_shape, o.dtype, opts)?;
        let c = select::choose(&*self.dev, &p, opts.variant)?;
        if !c.family.options.contains(KernelOptions::FP8) {
            return Err(Error::InvalidOption {
                option: "variant",
                got: format!("{:?} (chose {})", opts.variant, c.family.name),
                expected: "a variant whose family runs FP8 codes (Variant::Fa3 on sm_90a)".into(),
            });
        }
        let lse_ptr = lse_address(lse.as_deref(), &p, sid)?;
        let (d, hq, hk) = (p.head_dim, p.heads_q, p.heads_kv);
        let ops = fp8::ConsumerOperands {
            q: codes.q,
            q_strides: [p.seqlen_q * hq * d, hq * d, d],
            k: codes.k,
            k_strides: [p.seqlen_k * hk * d, hk * d, d],
            vt: codes.vt,
            vt_strides: [hk * d * codes.vt_row_stride, codes.vt_row_stride, d * codes.vt_row_stride],
            o: o.ptr,
            o_strides: o.strides,
            lse: lse_ptr,
            descales: [codes.q_descale, codes.k_descale, codes.v_descale],
        };
        if codes.vt_row_stride < p.seqlen_k {
            return Err(Error::InvalidLayout {
                operand: Operand::V,
                reason: format!("Vᵀ row stride {} is below seqlen_k {}", codes.vt_row_stride, p.seqlen_k),
            });
        }
        let params = fp8::consumer_params(&p, &ops)?;
        let plan = plan_launch(c.family, c.tile, p.dtype, params, self.dev.sm_count())?;
        let f = self.dev.function(c.family, c.tile, c.dtype)?;
        launch(&f, stream, &plan)
    }

    /// The FP8 forward of `p` (chosen family `c`, an FP8 row) on the caller's bf16/f16 tensors:
    /// scratch for the e4m3 codes and scales allocated on `stream` (stream-ordered, no
    /// synchronization), the pre-pass of Q and K, the pre-pass of V into Vᵀ, the consumer into
    /// the caller's output, and the scratch freed on `stream` after them. The context is current;
    /// extents, streams, dtypes and the family's layout rule were checked by the caller.
    fn fp8_forward(&self, stream: sys::CUstream, p: &Problem, ops: &Operands, c: &Choice) -> Result<()> {
        let layout = Fp8Scratch::of(p)?;
        let prepass = self.dev.fp8_prepass_function(c.family, c.tile, c.dtype)?;
        let consumer = self.dev.function(c.family, c.tile, c.dtype)?;
        // SAFETY: a stream-ordered allocation of `layout.bytes` on a valid stream of the current
        // context (checked by the caller); freed below on the same stream, after the launches
        // that use it, whatever they return.
        let scratch = unsafe { result::malloc_async(stream, layout.bytes.max(1)) }.map_err(cuda_err("cuMemAllocAsync(fp8 scratch)"))?;
        let run = || -> Result<()> {
            let (qk, v, params) = fp8::forward_plans(p, ops, scratch, &layout)?;
            let plan = plan_launch(c.family, c.tile, p.dtype, params, self.dev.sm_count())?;
            launch_fp8_prepass(&prepass, stream, &qk)?;
            launch_fp8_prepass(&prepass, stream, &v)?;
            launch(&consumer, stream, &plan)
        };
        let ran = run();
        // SAFETY: `scratch` came from cuMemAllocAsync on `stream` above; freeing it on the same
        // stream orders the free after every launch enqueued there.
        let freed = unsafe { result::free_async(scratch, stream) }.map_err(cuda_err("cuMemFreeAsync(fp8 scratch)"));
        ran.and(freed)
    }

    /// The device copy of a slope set: uploaded on `stream` (no synchronization) the first time
    /// the set is seen; a launch on another stream waits (on the device) for that upload while
    /// it is still in flight. The context is current.
    fn alibi_on_device(&self, slopes: &Arc<[f32]>, stream: sys::CUstream) -> Result<u64> {
        let mut cache = self.alibi.lock().unwrap_or_else(|e| e.into_inner());
        let found = cache.iter().position(|a| Arc::ptr_eq(&a.host, slopes) || a.host[..] == slopes[..]);
        let Some(i) = found else {
            // SAFETY: `stream` is a valid stream of the current context (checked by the caller).
            let capturing = unsafe { result::stream::is_capturing(stream) }.map_err(cuda_err("cuStreamIsCapturing"))?;
            if capturing != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                return Err(Error::InvalidOption {
                    option: "alibi_slopes",
                    got: format!("a slope set of {} heads first seen while the stream is being captured", slopes.len()),
                    expected: "slopes uploaded before the capture (Engine::prepare_alibi, or one launch with them)".into(),
                });
            }
            let bytes = std::mem::size_of_val(&slopes[..]);
            // SAFETY: plain driver calls in the current context; `host` (an Arc of the slopes,
            // kept in the cache entry) outlives the asynchronous copy, and `ptr` holds `bytes`.
            let entry = unsafe {
                let ptr = result::malloc_sync(bytes).map_err(cuda_err("cuMemAlloc(alibi)"))?;
                let ready = match result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = result::free_sync(ptr);
                        return Err(cuda_err("cuEventCreate(alibi)")(e));
                    }
                };
                let entry = AlibiOnDevice {
                    host: slopes.clone(),
                    ptr,
                    ready,
                    uploaded_on: stream_id(stream),
                    ctx: self.dev.context().clone(),
                };
                result::memcpy_htod_async(entry.ptr, &entry.host[..], stream).map_err(cuda_err("cuMemcpyHtoDAsync(alibi)"))?;
                result::event::record(entry.ready, stream).map_err(cuda_err("cuEventRecord(alibi)"))?;
                entry
            };
            let ptr = entry.ptr;
            cache.push(entry);
            return Ok(ptr);
        };
        let a = &cache[i];
        if a.uploaded_on != stream_id(stream) {
            // SAFETY: `a.ready` is an event of the current context, recorded after the upload.
            match unsafe { result::event::query(a.ready) } {
                Ok(()) => {} // the upload is done: nothing to wait for (and nothing to capture)
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => {
                    // SAFETY: as above; `stream` is a valid stream of the current context.
                    unsafe { result::stream::wait_event(stream, a.ready, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                        .map_err(cuda_err("cuStreamWaitEvent(alibi)"))?;
                }
                Err(e) => return Err(cuda_err("cuEventQuery(alibi)")(e)),
            }
        }
        Ok(a.ptr)
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
) -> Result<Output>
where
    T: Element + DeviceRepr + cudarc::driver::ValidAsZeroBits,
{
    let o_shape = q.shape();
    let mut o_host = vec![T::default(); crate::tensor::numel(o_shape, "output")?];
    let mut lse_host = p.return_lse.then(|| vec![0f32; p.batch * p.heads_q * p.seqlen_q]);
    let dispatch = forward_host_into_typed(engine, p, q, k, v, data, &mut o_host, lse_host.as_deref_mut(), opts)?;
    Ok(Output { o: crate::tensor::Tensor::from_vec(o_host, o_shape)?, lse: lse_host, dispatch })
}

/// As [`forward_host_typed`], downloading into the caller's buffers (`o_dst` contiguous
/// `[batch, seqlen_q, heads_q, head_dim]`, `lse_dst` `[batch, heads_q, seqlen_q]`; lengths
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
    let o_shape = q.shape();
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

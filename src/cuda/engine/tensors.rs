//! The device buffers an engine call borrows ([`DeviceTensor`], [`DeviceTensorMut`],
//! [`DeviceLse`], [`DeviceLseRef`], [`Fp8Codes`]): address, extent, dtype, shape, strides and the
//! stream each is bound to, with the checks every launch makes of them.

use crate::error::{Error, Operand, Result};
use crate::problem::Problem;
use crate::tensor::{contiguous_strides, DType, Element, Shape};
use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};
use std::marker::PhantomData;

/// A `CUstream` handle kept as an address, so the tensors that remember theirs are `Send`
/// (only compared, never dereferenced).
pub(super) type StreamId = usize;

pub(super) fn stream_id(s: sys::CUstream) -> StreamId {
    s as StreamId
}

/// Largest grid y/z dimension (heads on y, batch on z).
pub(super) const MAX_GRID_YZ: usize = 65535;
/// Longest sequence the kernels index (int32 positions with room for a row, the diagonal offset
/// and a tile).
pub(super) const MAX_SEQLEN: usize = 1 << 30;

/// What every borrowed device buffer records: where it lives, what it holds, the stream it was
/// bound to (None for raw pointers) and cudarc's access record, dropped after the launch so that
/// later accesses wait for the kernel.
#[derive(Debug)]
pub(super) struct Bound<'a> {
    pub(super) ptr: u64,
    pub(super) len: usize,
    pub(super) dtype: DType,
    pub(super) shape: Shape,
    pub(super) strides: [usize; 3],
    pub(super) stream: Option<StreamId>,
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
    pub(super) b: Bound<'a>,
    _borrow: PhantomData<&'a ()>,
}

/// A borrowed device tensor the kernel writes (the output).
#[derive(Debug)]
pub struct DeviceTensorMut<'a> {
    pub(super) b: Bound<'a>,
    _borrow: PhantomData<&'a mut ()>,
}

/// A borrowed f32 device buffer the kernels write: the forward's LSE, `[batch, heads_q,
/// seqlen_q]` contiguous, or the backward's sink gradient, `[heads_q]`.
#[derive(Debug)]
pub struct DeviceLse<'a> {
    pub(super) b: Bound<'a>,
    _borrow: PhantomData<&'a mut ()>,
}

pub(super) fn strides_of(shape: Shape) -> [usize; 3] {
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

/// A borrowed f32 device buffer read as an LSE: a state's input of
/// [`Engine::merge_states`](super::Engine::merge_states), `[batch, heads, seqlen]` contiguous (a
/// packed batch: `[heads, total_q]`), as the forward writes it.
#[derive(Debug)]
pub struct DeviceLseRef<'a> {
    pub(super) b: Bound<'a>,
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
pub(super) fn lse_address(lse: Option<&DeviceLse>, p: &Problem, sid: StreamId) -> Result<u64> {
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

pub(super) fn check_stream(op: Operand, bound: Option<StreamId>, launch: StreamId) -> Result<()> {
    match bound {
        Some(s) if s != launch => Err(Error::StreamMismatch {
            what: format!("{op} (a tensor bound with `new(.., stream, ..)`)"),
            got: format!("bound to stream {s:#x}"),
            expected: format!("the stream the launch is enqueued on ({launch:#x}); bind it to that stream"),
        }),
        _ => Ok(()),
    }
}

/// e4m3 codes an engine quantised itself, for
/// [`Engine::launch_fp8_codes_raw`](super::Engine::launch_fp8_codes_raw) (FlashAttention-3's FP8
/// input, with V transposed): device addresses, contiguous.
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

//! The [`Engine`]: one device (one CUDA context), its kernels, its stream checks and the
//! per-head f32 lists (ALiBi slopes, sink logits) it keeps on the device.

use super::tensors::{StreamId, stream_id};
use crate::cuda::device::{cuda_err, Device};
use crate::cuda::select::{self, Choice};
use crate::cuda::table::kernel_symbol;
use crate::error::{Error, Result};
use crate::options::ForwardOptions;
use crate::output::Dispatch;
use crate::problem::Problem;
use crate::tensor::{DType, Shape};
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::sync::{Arc, Mutex};

/// Runs the forward kernels on one device (one CUDA context).
#[derive(Debug)]
pub struct Engine {
    pub(super) dev: Arc<Device>,
    /// Per-head f32 lists (ALiBi slope sets, sink logits) already uploaded, each kept while the
    /// engine lives (a kernel still reading an older list never sees it freed).
    pub(super) head_lists: Mutex<Vec<HeadListOnDevice>>,
}

/// A per-head f32 list on the device: uploaded once, asynchronously, on the stream of the call
/// that first used it; `ready` is recorded after the copy so a launch on another stream can wait
/// for it while it is still in flight. Lists are found by content, whatever option they came from.
#[derive(Debug)]
pub(super) struct HeadListOnDevice {
    /// The host copy: compared with later lists, and the source of the asynchronous copy (so it
    /// must outlive it).
    host: Arc<[f32]>,
    ptr: sys::CUdeviceptr,
    ready: sys::CUevent,
    uploaded_on: StreamId,
    ctx: Arc<CudaContext>,
}

// SAFETY: the device pointer and the event are driver handles of `ctx`, used only through
// driver calls (thread-safe) with the context bound; the host list is immutable.
unsafe impl Send for HeadListOnDevice {}

impl Drop for HeadListOnDevice {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` and `ready` were created in `ctx` by `Engine::head_list_on_device` and
            // are released once, here. cuMemFree waits for the device work that may still read the
            // list (it synchronizes), so no kernel sees it freed.
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
        Ok(Engine { dev: Device::get(ordinal)?, head_lists: Mutex::new(Vec::new()) })
    }

    /// An engine on a context the caller already holds, e.g. candle's
    /// `cuda_device.cuda_stream().context().clone()`. For a primary context this shares the
    /// kernels [`Engine::new`] loads; streams of that context are accepted whichever `Arc` they
    /// came through (contexts are compared by their `CUcontext` handle).
    ///
    /// # Errors
    /// As [`Engine::new`].
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Self> {
        Ok(Engine { dev: Device::for_context(ctx)?, head_lists: Mutex::new(Vec::new()) })
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

    pub(super) fn record(&self, c: &Choice, opts: &ForwardOptions) -> Dispatch {
        Dispatch {
            backend: format!("cuda:{}", self.dev.ordinal()),
            kernel: kernel_symbol(c.family.name, c.tile.head_dim, c.dtype),
            reason: select::reason(&*self.dev, c, opts.variant),
        }
    }

    /// `stream` as a raw handle, after checking it belongs to the engine's context.
    pub(super) fn own_stream(&self, stream: &CudaStream) -> Result<sys::CUstream> {
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
        self.head_list_on_device(&Arc::from(slopes), "alibi_slopes", raw).map(|_| ())
    }

    /// As [`Engine::prepare_alibi`], for attention-sink logits (`opts.sinks`, one per query
    /// head): uploaded once on `stream`, so that a graph capture of forward or backward launches
    /// with these sinks uploads nothing.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a NaN or `+inf` logit, [`Error::StreamMismatch`],
    /// [`Error::Cuda`].
    pub fn prepare_sinks(&self, stream: &CudaStream, sinks: &[f32]) -> Result<()> {
        if let Some((h, x)) = sinks.iter().enumerate().find(|(_, x)| x.is_nan() || **x == f32::INFINITY) {
            return Err(Error::InvalidOption {
                option: "sinks",
                got: format!("{x} for query head {h}"),
                expected: "a finite logit, or -inf for no sink".into(),
            });
        }
        let raw = self.own_stream(stream)?;
        self.dev.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        self.head_list_on_device(&Arc::from(sinks), "sinks", raw).map(|_| ())
    }

    /// The device copy of a per-head f32 list (`option` names it in errors: "alibi_slopes",
    /// "sinks"): uploaded on `stream` (no synchronization) the first time the list is seen; a
    /// launch on another stream waits (on the device) for that upload while it is still in
    /// flight. The context is current.
    pub(super) fn head_list_on_device(&self, list: &Arc<[f32]>, option: &'static str, stream: sys::CUstream) -> Result<u64> {
        let mut cache = self.head_lists.lock().unwrap_or_else(|e| e.into_inner());
        let found = cache.iter().position(|a| Arc::ptr_eq(&a.host, list) || a.host[..] == list[..]);
        let Some(i) = found else {
            // SAFETY: `stream` is a valid stream of the current context (checked by the caller).
            let capturing = unsafe { result::stream::is_capturing(stream) }.map_err(cuda_err("cuStreamIsCapturing"))?;
            if capturing != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                return Err(Error::InvalidOption {
                    option,
                    got: format!("a list of {} heads first seen while the stream is being captured", list.len()),
                    expected: "the list uploaded before the capture (one launch with it; Engine::prepare_alibi for slopes, \
                               Engine::prepare_sinks for sinks)"
                        .into(),
                });
            }
            let bytes = std::mem::size_of_val(&list[..]);
            // SAFETY: plain driver calls in the current context; `host` (an Arc of the list,
            // kept in the cache entry) outlives the asynchronous copy, and `ptr` holds `bytes`.
            let entry = unsafe {
                let ptr = result::malloc_sync(bytes).map_err(cuda_err("cuMemAlloc(per-head list)"))?;
                let ready = match result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = result::free_sync(ptr);
                        return Err(cuda_err("cuEventCreate(per-head list)")(e));
                    }
                };
                let entry = HeadListOnDevice {
                    host: list.clone(),
                    ptr,
                    ready,
                    uploaded_on: stream_id(stream),
                    ctx: self.dev.context().clone(),
                };
                result::memcpy_htod_async(entry.ptr, &entry.host[..], stream).map_err(cuda_err("cuMemcpyHtoDAsync(per-head list)"))?;
                result::event::record(entry.ready, stream).map_err(cuda_err("cuEventRecord(per-head list)"))?;
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
                        .map_err(cuda_err("cuStreamWaitEvent(per-head list)"))?;
                }
                Err(e) => return Err(cuda_err("cuEventQuery(per-head list)")(e)),
            }
        }
        Ok(a.ptr)
    }
}

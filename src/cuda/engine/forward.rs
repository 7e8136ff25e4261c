//! [`Engine::forward`] and its raw and FP8-code forms: validate, choose the kernel, enqueue
//! one launch (the FP8 path: the pre-pass, then the consumer).

use super::handle::Engine;
use super::tensors::{
    check_stream, lse_address, stream_id, DeviceLse, DeviceTensor, DeviceTensorMut, Fp8Codes, MAX_GRID_YZ, MAX_SEQLEN,
};
use crate::cuda::device::cuda_err;
use crate::cuda::driver::{launch, launch_fp8_prepass};
use crate::cuda::fp8::{self, Fp8Scratch};
use crate::cuda::params::{FwdParams, Operands};
use crate::cuda::plan::plan_instance;
use crate::cuda::select::{self, Choice};
use crate::cuda::table::KernelOptions;
use crate::error::{Error, Operand, Result};
use crate::options::{ForwardOptions, Fp8Scaling, Precision};
use crate::output::Dispatch;
use crate::problem::Problem;
use crate::tensor::{check_extent, Shape};
use cudarc::driver::{result, sys, CudaStream};

impl Engine {
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_inner(
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
        let p = Problem::from_shapes(q.shape, k.shape, v.shape, q.dtype, opts)?;
        // o is q's shape with v's head_dim.
        let want_o = [p.batch, p.seqlen_q, p.heads_q, p.head_dim_v];
        if o.shape != want_o {
            return Err(Error::ShapeMismatch {
                what: "o".into(),
                got: format!("{:?}", o.shape),
                expected: format!("{want_o:?} (q's batch, seqlen and heads; v's head_dim)"),
            });
        }
        let mut ops = Operands {
            ptrs: [q.ptr, k.ptr, v.ptr, o.ptr],
            strides: [q.strides, k.strides, v.strides, o.strides],
            lse: 0,
            alibi: 0,
            sinks: 0,
        };
        let c = select::choose_for(&*self.dev, &p, opts.variant, &ops)?;

        ops.lse = lse_address(lse.as_deref(), &p, sid)?;
        self.dev.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        ops.alibi = match &p.alibi {
            Some(slopes) => self.head_list_on_device(slopes, "alibi_slopes", stream)?,
            None => 0,
        };
        ops.sinks = match &p.sinks {
            Some(sinks) => self.head_list_on_device(sinks, "sinks", stream)?,
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
        let plan = plan_instance(c.family, c.tile, p.dtype, FwdParams::for_launch(&p, &ops), self.dev.sm_count())?;
        let f = self.dev.function(c.family, c.tile, c.dtype)?;
        launch(&f, stream, &plan)?;
        Ok(c)
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
        let plan = plan_instance(c.family, c.tile, p.dtype, params, self.dev.sm_count())?;
        let f = self.dev.function(c.family, c.tile, c.dtype)?;
        launch(&f, stream, &plan)
    }

    /// The FP8 forward of `p` (chosen family `c`, an FP8 row) on the caller's bf16/f16 tensors:
    /// scratch for the e4m3 codes and scales allocated on `stream` (stream-ordered, no
    /// synchronization), the pre-pass of Q and K, the pre-pass of V into Vᵀ, the consumer into
    /// the caller's output, and the scratch freed on `stream` after them. The context is current;
    /// extents, streams, dtypes and the family's layout rule were checked by the caller.
    pub(super) fn fp8_forward(&self, stream: sys::CUstream, p: &Problem, ops: &Operands, c: &Choice) -> Result<()> {
        let layout = Fp8Scratch::of(p)?;
        let prepass = self.dev.fp8_prepass_function(c.family, c.tile, c.dtype)?;
        let consumer = self.dev.function(c.family, c.tile, c.dtype)?;
        // SAFETY: a stream-ordered allocation of `layout.bytes` on a valid stream of the current
        // context (checked by the caller); freed below on the same stream, after the launches
        // that use it, whatever they return.
        let scratch = unsafe { result::malloc_async(stream, layout.bytes.max(1)) }.map_err(cuda_err("cuMemAllocAsync(fp8 scratch)"))?;
        let run = || -> Result<()> {
            let (qk, v, params) = fp8::forward_plans(p, ops, scratch, &layout)?;
            let plan = plan_instance(c.family, c.tile, p.dtype, params, self.dev.sm_count())?;
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
}

//! [`Engine::backward`]: the gradients dq, dk, dv (and the attention sinks' logits) of device
//! tensors with the FA2 or FA3-style backward kernels (validate, choose by variant, enqueue the
//! plan's launches).

use super::handle::Engine;
use super::tensors::{check_stream, stream_id, Bound, DeviceLse, DeviceLseRef, DeviceTensor, DeviceTensorMut};
use crate::cuda::bwd_params::BwdOperands;
use crate::cuda::bwd_select::{self, BwdChoice, BwdFamily};
use crate::cuda::device::cuda_err;
use crate::cuda::driver::launch_backward;
use crate::cuda::fa2_bwd::{self, BwdPlan, MAIN_LAUNCH};
use crate::cuda::fa3_bwd;
use crate::cuda::launch::TensorMapArgs;
use crate::error::{Error, Operand, Result};
use crate::options::ForwardOptions;
use crate::output::Dispatch;
use crate::problem::Problem;
use crate::tensor::{check_extent, DType, Shape};
use cudarc::driver::{result, sys, CudaStream};

/// The inputs of a device backward: q, k, v, the forward's output `o`, the output gradient
/// `d_o` (q's shape and dtype) and the forward's LSE (`[batch, heads_q, seqlen_q]` f32, natural
/// log, as [`Engine::forward`] writes it).
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs<'r, 'a> {
    pub q: &'r DeviceTensor<'a>,
    pub k: &'r DeviceTensor<'a>,
    pub v: &'r DeviceTensor<'a>,
    pub o: &'r DeviceTensor<'a>,
    pub d_o: &'r DeviceTensor<'a>,
    pub lse: &'r DeviceLseRef<'a>,
}

/// The gradient outputs of a device backward: `dq` q's shape, `dk` and `dv` k's (summed over
/// each GQA group's query heads), all of q's dtype; and, when given, `d_sinks`: f32 `[heads_q]`,
/// the gradient of each head's sink logit (`opts.sinks`), summed over batch and rows, 0 for a
/// head without a sink (all 0 for a call without sinks), as the CPU's `Gradients::d_sinks`.
/// `None` skips it (dq, dk, dv do not depend on it).
#[derive(Debug)]
pub struct BackwardGrads<'r, 'a> {
    pub dq: &'r mut DeviceTensorMut<'a>,
    pub dk: &'r mut DeviceTensorMut<'a>,
    pub dv: &'r mut DeviceTensorMut<'a>,
    pub d_sinks: Option<&'r mut DeviceLse<'a>>,
}

/// A backward's plan: FA2's launches, or the FA3-style ones with the main kernel's tensor maps.
struct Planned {
    bwd: BwdPlan,
    maps: Option<[TensorMapArgs; 4]>,
}

/// Bytes from the start of the scratch to `dq_accum` (after `d_sum`), aligned for 16-byte loads.
fn dq_accum_offset(d_sum_floats: usize) -> usize {
    (d_sum_floats * 4).div_ceil(256) * 256
}

impl Engine {
    /// The backward pass on device memory: given the forward's inputs, output and LSE and the
    /// output gradient, writes dq, dk, dv (FlashAttention-2's algorithm, docs/backward.md) and,
    /// where `g.d_sinks` is given, the sink logits' gradient (one more small launch, a
    /// fixed-order sum: deterministic in either mode), enqueued on `stream` without waiting.
    /// `opts` are the forward call's; `opts.variant` names the kernel: `Variant::Fa2` (sm_80+,
    /// every option of the forward, head dims 32, 64, 96, 128, 192, 256) or `Variant::Fa3`
    /// (sm_90a, head dims 64 and 128, no softcap or
    /// ALiBi). `Variant::Auto` is refused: no GPU run has verified these kernels yet (the CPU
    /// backward, [`crate::backward`], runs every problem). `opts.deterministic(true)` sums dq
    /// without floating-point atomics (bit-identical run to run, more scratch); the default uses
    /// f32 atomics. The returned [`Dispatch`] names the main kernel and which dq sum ran.
    ///
    /// f32 scratch (D = rowsum(dO ∘ O) and the dq accumulator: `batch·heads_q·seqlen_q·(1 +
    /// head_dim·splits)` floats, splits = 1, or the key blocks when deterministic) is allocated
    /// and freed on `stream`, stream-ordered. The kernels ran in the CPU emulator and were
    /// compile-checked; none has run on a GPU.
    ///
    /// # Errors
    /// Validation errors as [`crate::backward`] (shapes, dtypes, LSE length); dtype, layout and
    /// extent errors of the device tensors ([`Error::InvalidLayout`] for strides or addresses the
    /// kernels cannot load: 16-byte aligned, strides multiples of 8 elements);
    /// [`Error::ShapeMismatch`] for a `d_sinks` buffer shorter than `heads_q`;
    /// [`Error::StreamMismatch`]; [`Error::VariantUnavailable`] for Auto, a family without a
    /// backward or one this device or problem cannot run; [`Error::Cuda`] when a launch fails.
    pub fn backward(
        &self,
        stream: &CudaStream,
        x: BackwardInputs<'_, '_>,
        g: BackwardGrads<'_, '_>,
        opts: &ForwardOptions,
    ) -> Result<Dispatch> {
        let raw = self.own_stream(stream)?;
        let (p, c) = self.backward_checked(raw, &x, &g, opts)?;
        self.backward_launch(raw, &p, &c, &x, &g, opts.deterministic)?;
        Ok(self.backward_record(&c, opts))
    }

    /// Which backward kernel [`Engine::backward`] would run for these shapes and options, and
    /// why.
    ///
    /// # Errors
    /// As [`Engine::backward`]'s validation and choice.
    pub fn backward_dispatch(&self, q_shape: Shape, k_shape: Shape, dtype: DType, opts: &ForwardOptions) -> Result<Dispatch> {
        let p = Problem::from_shapes(q_shape, k_shape, k_shape, dtype, opts)?;
        let c = bwd_select::choose(&*self.dev, &p, opts.variant)?;
        Ok(self.backward_record(&c, opts))
    }

    fn backward_record(&self, c: &BwdChoice, opts: &ForwardOptions) -> Dispatch {
        Dispatch {
            backend: format!("cuda:{}", self.dev.ordinal()),
            kernel: c.row.name.into(),
            reason: bwd_select::reason(&*self.dev, c, opts.variant, opts.deterministic),
        }
    }

    /// Checks every tensor (extent, stream, dtype, shape) and chooses the kernel.
    fn backward_checked(
        &self,
        stream: sys::CUstream,
        x: &BackwardInputs<'_, '_>,
        g: &BackwardGrads<'_, '_>,
        opts: &ForwardOptions,
    ) -> Result<(Problem, BwdChoice)> {
        let sid = stream_id(stream);
        let (q, k) = (&x.q.b, &x.k.b);
        let ins: [(Operand, &Bound); 5] = [(Operand::Q, q), (Operand::K, k), (Operand::V, &x.v.b), (Operand::O, &x.o.b), (Operand::DO, &x.d_o.b)];
        let outs: [(&str, &Bound, Shape); 3] = [("dq", &g.dq.b, q.shape), ("dk", &g.dk.b, k.shape), ("dv", &g.dv.b, k.shape)];
        for (op, t) in ins.iter().copied().chain(outs.iter().map(|(_, t, _)| (Operand::O, *t))) {
            check_extent(op, t.shape, t.strides, t.len)?;
            check_stream(op, t.stream, sid)?;
            if t.dtype != q.dtype {
                return Err(Error::DTypeMismatch { operand: op, got: t.dtype, expected: q.dtype });
            }
        }
        for (what, t) in [("o", &x.o.b), ("d_o", &x.d_o.b)] {
            if t.shape != q.shape {
                return Err(Error::ShapeMismatch {
                    what: what.into(),
                    got: format!("{:?}", t.shape),
                    expected: format!("{:?} (the shape of q)", q.shape),
                });
            }
        }
        for (what, t, want) in outs {
            if t.shape != want {
                return Err(Error::ShapeMismatch {
                    what: format!("{what} (backward output)"),
                    got: format!("{:?}", t.shape),
                    expected: format!("{want:?} (the shape of {})", if what == "dq" { "q" } else { "k" }),
                });
            }
        }
        let p = Problem::from_shapes(q.shape, k.shape, x.v.b.shape, q.dtype, opts)?;
        let need = p.batch * p.heads_q * p.seqlen_q;
        if x.lse.b.len < need {
            return Err(Error::ShapeMismatch {
                what: "lse".into(),
                got: format!("{} f32", x.lse.b.len),
                expected: format!("at least {need} f32 ([batch, heads_q, seqlen_q], as the forward writes it)"),
            });
        }
        check_stream(Operand::O, x.lse.b.stream, sid)?;
        if let Some(ds) = &g.d_sinks {
            if ds.b.len < p.heads_q {
                return Err(Error::ShapeMismatch {
                    what: "d_sinks (backward output)".into(),
                    got: format!("{} f32", ds.b.len),
                    expected: format!("at least {} f32 (one per query head)", p.heads_q),
                });
            }
            check_stream(Operand::O, ds.b.stream, sid)?;
        }
        let c = bwd_select::choose(&*self.dev, &p, opts.variant)?;
        Ok((p, c))
    }

    /// Plans and enqueues the launches of `c` on `stream`, with their scratch.
    fn backward_launch(
        &self,
        stream: sys::CUstream,
        p: &Problem,
        c: &BwdChoice,
        x: &BackwardInputs<'_, '_>,
        g: &BackwardGrads<'_, '_>,
        deterministic: bool,
    ) -> Result<()> {
        let ts = [&x.q.b, &x.k.b, &x.v.b, &x.o.b, &x.d_o.b, &g.dq.b, &g.dk.b, &g.dv.b];
        let mut ops = BwdOperands {
            ptrs: ts.map(|t| t.ptr),
            strides: ts.map(|t| t.strides),
            lse: x.lse.b.ptr,
            d_sum: 0,
            dq_accum: 0,
            alibi: 0,
            sinks: 0,
            d_sinks: g.d_sinks.as_ref().map_or(0, |d| d.b.ptr),
        };
        // Planned once before anything is allocated, so a refusal costs nothing.
        let plan = |ops: &BwdOperands| -> Result<Planned> {
            Ok(match c.family {
                BwdFamily::Fa2 => Planned { bwd: fa2_bwd::plan(p, ops, deterministic)?, maps: None },
                BwdFamily::Fa3 => {
                    let f = fa3_bwd::plan(p, ops, deterministic)?;
                    Planned { bwd: f.bwd, maps: Some(f.tensor_maps) }
                }
            })
        };
        let sized = plan(&ops)?;
        self.dev.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        let mut functions = Vec::with_capacity(sized.bwd.launches.len());
        // The FA3-style plan runs FA2's row kernels (preprocess, conversion, sink gradient) around
        // its own main kernel: each symbol loads from the image that holds it.
        let fa2_row = bwd_select::row(BwdFamily::Fa2);
        for l in &sized.bwd.launches {
            let found = [c.row, fa2_row].into_iter().find_map(|row| row.kernels.iter().copied().find(|k| *k == l.kernel).map(|k| (row, k)));
            let (row, symbol) = found.ok_or_else(|| Error::BackendUnavailable {
                backend: format!("cuda:{}", self.dev.ordinal()),
                reason: format!("kernel {} is not in the {} image", l.kernel, c.row.name),
            })?;
            functions.push(self.dev.standalone_function_smem(row, symbol, l.smem_bytes)?);
        }
        if let Some(slopes) = &p.alibi {
            ops.alibi = self.head_list_on_device(slopes, "alibi_slopes", stream)?;
        }
        // Only the sink launch reads the logits (dq, dk, dv need only the LSE).
        if let (Some(sinks), true) = (&p.sinks, ops.d_sinks != 0) {
            ops.sinks = self.head_list_on_device(sinks, "sinks", stream)?;
        }
        let offset = dq_accum_offset(sized.bwd.d_sum_floats);
        let bytes = sized
            .bwd
            .dq_accum_floats
            .checked_mul(4)
            .and_then(|b| b.checked_add(offset))
            .ok_or_else(|| Error::TooLarge { what: format!("backward scratch of {} floats", sized.bwd.dq_accum_floats) })?;
        // SAFETY: a stream-ordered allocation of `bytes` on a valid stream of the current
        // context (checked by the caller); freed below on the same stream, after the launches
        // that use it, whatever they return.
        let scratch = unsafe { result::malloc_async(stream, bytes.max(1)) }.map_err(cuda_err("cuMemAllocAsync(backward scratch)"))?;
        let run = || -> Result<()> {
            let planned = plan(&BwdOperands { d_sum: scratch, dq_accum: scratch + offset as u64, ..ops })?;
            let maps = planned.maps.as_ref().map_or(&[][..], |m| &m[..]);
            for (i, (l, f)) in planned.bwd.launches.iter().zip(&functions).enumerate() {
                // Only the main kernel takes tensor maps.
                launch_backward(f, stream, l, planned.bwd.params, if i == MAIN_LAUNCH { maps } else { &[] })?;
            }
            Ok(())
        };
        let ran = run();
        // SAFETY: `scratch` came from cuMemAllocAsync on `stream` above; freeing it on the same
        // stream orders the free after every launch enqueued there.
        let freed = unsafe { result::free_async(scratch, stream) }.map_err(cuda_err("cuMemFreeAsync(backward scratch)"));
        ran.and(freed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dq_accum_follows_d_sum_aligned() {
        assert_eq!(dq_accum_offset(0), 0);
        assert_eq!(dq_accum_offset(1), 256);
        assert_eq!(dq_accum_offset(64), 256);
        assert_eq!(dq_accum_offset(65), 512);
    }
}

//! [`Engine::merge_states`] / [`Engine::merge_states_n`]: the combine kernel over attention
//! states in device memory.

use super::handle::Engine;
use super::tensors::{stream_id, DeviceTensor, DeviceTensorMut, DeviceLse, DeviceLseRef, check_stream};
use crate::cuda::device::cuda_err;
use crate::cuda::driver::launch_combine;
use crate::cuda::combine;
use crate::error::{Error, Operand, Result};
use crate::tensor::check_extent;
use cudarc::driver::CudaStream;

impl Engine {
    /// Merges two attention states of the same queries over disjoint key sets on the device
    /// (FlashInfer's `merge_state`; the device form of [`crate::serving::merge_states`], same
    /// rules): `lse = log(exp(lse_a) + exp(lse_b))`, `o = exp(lse_a − lse)·o_a +
    /// exp(lse_b − lse)·o_b`; a state with LSE −inf weighs nothing (its o is not read), all −inf
    /// gives o = 0 and LSE −inf, NaN in an LSE makes the row NaN. `o_a`, `o_b` and `o` are
    /// `[batch, seqlen, heads, head_dim]` (strides allowed) of one dtype (f32, f16 or bf16),
    /// head_dim at most 512; the LSEs `[batch, heads, seqlen]` f32 (packed: `[1, total_q, ..]`
    /// and `[heads, total_q]`), as the forward writes them; `lse` (optional) receives the
    /// merged one. Computed in f32 (the host merges in f64; docs/serving.md gives the bound).
    /// One launch of the combine kernel on `stream`, without waiting.
    ///
    /// # Errors
    /// As the host `merge_states` ([`Error::ShapeMismatch`], [`Error::DTypeMismatch`],
    /// [`Error::InvalidLayout`]), for the output too; [`Error::UnsupportedHeadDim`] above 512;
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
        let rows = crate::numerics::merge::check_states(
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
}

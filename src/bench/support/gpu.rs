//! The boundary between the GPU benches and the CUDA runtime: the [`GpuHarness`] trait and
//! [`open`], implemented on the crate's device-memory API (`crate::cuda::Engine`,
//! `DeviceTensor`, `Engine::launch` on the caller's stream) with cudarc for buffers, events and
//! a device-to-device copy.
//!
//! [`open`] returns `Err` (with the reason) and never panics when there is no driver, no such
//! device, or no kernels built into the crate; `benches/gpu.rs` and `examples/bench.rs --backend
//! cuda` then print "no CUDA GPU present" and exit 0.
//!
//! Timing: inputs are uploaded once into `sets` independent device buffers (set 0 holds the
//! caller's tensors; the others are copies at other addresses, so that one pass over the sets
//! is at least twice the L2 and no launch reads inputs left in L2 by the previous one). Each
//! repetition is a pair of CUDA events on the launch stream around a batch of launches cycling
//! through the sets; per-launch ms = elapsed / launches.

use super::Case;
use crate::{Dispatch, ForwardOptions, Output, Tensor};

/// What the report prints about the GPU.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuInfo {
    pub ordinal: usize,
    /// As the driver reports it (`cuDeviceGetName`).
    pub name: String,
    /// Compute capability (major, minor).
    pub sm: (u32, u32),
    pub sm_count: u32,
    pub l2_bytes: usize,
    /// e.g. "CUDA driver API 13.0, driver 580.82".
    pub driver: String,
    /// Current clocks from `nvidia-smi` when it is there.
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
}

impl GpuInfo {
    /// "SM 1980 MHz, memory 3201 MHz" or "unknown".
    pub fn clocks(&self) -> String {
        match (self.sm_clock_mhz, self.mem_clock_mhz) {
            (None, None) => "unknown".into(),
            (s, m) => format!(
                "SM {} MHz, memory {} MHz",
                s.map_or("?".into(), |x| x.to_string()),
                m.map_or("?".into(), |x| x.to_string())
            ),
        }
    }
}

/// One timed configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuTiming {
    /// Milliseconds per launch, one entry per repetition (each the mean over a batch of launches
    /// between two events). The bench reports their median.
    pub ms_per_launch: Vec<f64>,
    /// The kernel that ran (`Dispatch::kernel`).
    pub kernel: String,
}

/// The CUDA runtime as the benches see it.
pub trait GpuHarness {
    fn info(&self) -> &GpuInfo;

    /// Device-to-device copy of `bytes` bytes, timed with CUDA events after a warm-up: (bytes
    /// read + written) / time, best of a few.
    fn copy_bandwidth(&mut self, bytes: usize) -> Result<f64, String>;

    /// Prepares q, k, v (f16 or bf16) with `opts` (variant, mask, ...) for timing: asks the
    /// dispatch first (a variant or dtype this GPU does not run is `Err` with the crate's reason,
    /// before anything is uploaded), then uploads `sets` copies of the inputs (see
    /// [`rotating_sets`]), allocates one output per set and runs one probe launch, waiting for
    /// it. Replaces the previously prepared case.
    fn prepare(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        opts: &ForwardOptions,
        sets: usize,
    ) -> Result<Dispatch, String>;

    /// As [`GpuHarness::prepare`] for the backward (`Engine::backward`, the variant `opts`
    /// names): each set also gets an output gradient (q's values), the forward's output and LSE
    /// (one forward per set, `Variant::Auto`) and the gradient buffers; the probe is one
    /// backward. `time` then times backward launches.
    fn prepare_backward(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        opts: &ForwardOptions,
        sets: usize,
    ) -> Result<Dispatch, String>;

    /// Times the prepared case: `warmup` launches, then `reps` repetitions, each an event,
    /// `launches_per_rep` launches cycling through the input sets, another event; per-launch ms
    /// = elapsed / launches_per_rep.
    fn time(&mut self, warmup: usize, reps: usize, launches_per_rep: usize) -> Result<GpuTiming, String>;

    /// Downloads the output of set 0 (the caller's inputs) of the prepared case, once, for the
    /// sampled error check.
    fn output(&mut self) -> Result<Output, String>;
}

/// The harness for CUDA device `ordinal`, or why there is none. Never panics: the driver is
/// looked for before any other driver call, and a panic inside cudarc (e.g. a symbol an old
/// driver lacks) is caught and reported as the reason.
pub fn open(ordinal: usize) -> Result<Box<dyn GpuHarness>, String> {
    #[cfg(feature = "cuda")]
    {
        if !crate::cuda::driver_present() {
            return Err("no CUDA driver (libcuda.so) was found".into());
        }
        let quiet = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let opened = std::panic::catch_unwind(|| cuda::Harness::open(ordinal));
        std::panic::set_hook(quiet);
        match opened {
            Ok(r) => r.map(|h| Box::new(h) as Box<dyn GpuHarness>),
            Err(p) => Err(format!(
                "the CUDA driver failed while opening device {ordinal}: {}",
                p.downcast_ref::<String>().map(String::as_str).or(p.downcast_ref::<&str>().copied()).unwrap_or("panic")
            )),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err("built without the `cuda` feature".into())
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{GpuHarness, GpuInfo, GpuTiming};
    use cudarc::driver::sys::{self, CUdevice_attribute as Attr};
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
    use crate::cuda::{BackwardGrads, BackwardInputs, DeviceLse, DeviceLseRef, DeviceTensor, DeviceTensorMut, Engine};
    use crate::{Dispatch, Element, ForwardOptions, Output, OwnedData, Shape, Tensor};
    use half::{bf16, f16};
    use std::sync::Arc;

    /// Repetitions of the bandwidth copy; the best is kept.
    const COPY_REPS: usize = 5;

    /// One input set and its output.
    struct Set<T> {
        q: CudaSlice<T>,
        k: CudaSlice<T>,
        v: CudaSlice<T>,
        o: CudaSlice<T>,
        /// The backward's extra buffers (a backward case only).
        bwd: Option<BwdSet<T>>,
    }

    /// A backward set's output gradient, the forward's LSE and the gradients.
    struct BwdSet<T> {
        d_o: CudaSlice<T>,
        lse: CudaSlice<f32>,
        dq: CudaSlice<T>,
        dk: CudaSlice<T>,
        dv: CudaSlice<T>,
    }

    /// The device buffers of the prepared case, by dtype.
    enum Sets {
        F16(Vec<Set<f16>>),
        BF16(Vec<Set<bf16>>),
    }

    /// The prepared case.
    struct Prepared {
        sets: Sets,
        q_shape: Shape,
        k_shape: Shape,
        v_shape: Shape,
        opts: ForwardOptions,
        dispatch: Dispatch,
        /// The next set to launch on (rotation continues across `time` calls).
        next: usize,
    }

    pub(super) struct Harness {
        info: GpuInfo,
        engine: Engine,
        /// The context's default stream: the only stream used, so cudarc tracks no events per
        /// buffer use and the launches are ordered after the uploads.
        stream: Arc<CudaStream>,
        case: Option<Prepared>,
    }

    fn err(call: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
        move |e| format!("{call}: {e:?}")
    }

    fn attr(ctx: &CudaContext, a: Attr) -> Option<i32> {
        ctx.attribute(a).ok()
    }

    /// The driver's CUDA API version, "13.0".
    fn driver_api_version() -> Option<String> {
        let mut v = 0i32;
        // SAFETY: cuDriverGetVersion writes one int through the pointer, which is valid; the
        // driver library is present (checked by `open`).
        let r = unsafe { sys::cuDriverGetVersion(&mut v) };
        (r == sys::CUresult::CUDA_SUCCESS).then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
    }

    /// `nvidia-smi --query-gpu=FIELDS` for the GPU at this PCI address (nvidia-smi's indices
    /// need not match CUDA ordinals), one string per field.
    fn smi(pci: &str, fields: &str) -> Option<Vec<String>> {
        let out = std::process::Command::new("nvidia-smi")
            .args([&format!("--query-gpu={fields}"), "--format=csv,noheader,nounits", "-i", pci])
            .output()
            .ok()?;
        let text = String::from_utf8(out.stdout).ok()?;
        let line = text.lines().next()?.trim().to_string();
        (out.status.success() && !line.is_empty()).then(|| line.split(',').map(|s| s.trim().to_string()).collect())
    }

    impl Harness {
        pub(super) fn open(ordinal: usize) -> Result<Harness, String> {
            // Engine::new checks the driver, the device count and that kernels were built.
            let engine = Engine::new(ordinal).map_err(|e| e.to_string())?;
            let dev = engine.device().clone();
            let ctx = dev.context().clone();
            let (major, minor) = dev.compute_capability();
            let pci = match (
                attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID),
                attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID),
                attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID),
            ) {
                (Some(d), Some(b), Some(s)) => format!("{d:08X}:{b:02X}:{s:02X}.0"),
                _ => ordinal.to_string(),
            };
            let smi_vals = smi(&pci, "driver_version,clocks.sm,clocks.mem");
            let field = |i: usize| smi_vals.as_ref().and_then(|v| v.get(i)).cloned();
            let api = driver_api_version().unwrap_or_else(|| "?".into());
            let driver = match field(0) {
                Some(d) => format!("CUDA driver API {api}, driver {d}"),
                None => format!("CUDA driver API {api}"),
            };
            let info = GpuInfo {
                ordinal,
                name: dev.name().to_string(),
                sm: (major.max(0) as u32, minor.max(0) as u32),
                sm_count: attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).unwrap_or(0).max(0) as u32,
                l2_bytes: attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE).unwrap_or(0).max(0) as usize,
                driver,
                sm_clock_mhz: field(1).and_then(|s| s.parse().ok()),
                mem_clock_mhz: field(2).and_then(|s| s.parse().ok()),
            };
            let stream = dev.default_stream();
            Ok(Harness { info, engine, stream, case: None })
        }

        /// A forward or backward case: the dispatch asked first, the sets uploaded (with the
        /// backward's buffers), one probe launch waited for.
        fn prepare_case(
            &mut self,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            opts: &ForwardOptions,
            sets: usize,
            backward: bool,
        ) -> Result<Dispatch, String> {
            self.case = None; // free the previous case's buffers first
            self.stream.synchronize().map_err(err("cuStreamSynchronize"))?;
            let dispatch = if backward {
                self.engine.backward_dispatch(q.shape(), k.shape(), q.dtype(), opts)
            } else {
                self.engine.dispatch(q.shape(), k.shape(), q.dtype(), opts)
            }
            .map_err(|e| e.to_string())?;
            let sets = sets.max(1);
            let mut sets = match (q.data(), k.data(), v.data()) {
                (OwnedData::F16(q), OwnedData::F16(k), OwnedData::F16(v)) => {
                    Sets::F16(upload(&self.stream, q, k, v, sets)?)
                }
                (OwnedData::BF16(q), OwnedData::BF16(k), OwnedData::BF16(v)) => {
                    Sets::BF16(upload(&self.stream, q, k, v, sets)?)
                }
                _ => return Err(format!("the GPU kernels take f16 or bf16 (one dtype), not {:?}", q.dtype())),
            };
            let shapes = (q.shape(), k.shape(), v.shape());
            if backward {
                match &mut sets {
                    Sets::F16(s) => add_backward(&self.engine, &self.stream, s, shapes, opts)?,
                    Sets::BF16(s) => add_backward(&self.engine, &self.stream, s, shapes, opts)?,
                }
            }
            self.case = Some(Prepared {
                sets,
                q_shape: q.shape(),
                k_shape: k.shape(),
                v_shape: v.shape(),
                opts: opts.clone(),
                dispatch: dispatch.clone(),
                next: 0,
            });
            // The probe: loads the module, and a fault shows here rather than in the timing.
            self.launch(0)?;
            self.stream.synchronize().map_err(err("cuStreamSynchronize (probe launch)"))?;
            Ok(dispatch)
        }

        fn event(&self) -> Result<cudarc::driver::CudaEvent, String> {
            self.stream.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err("cuEventCreate"))
        }

        /// One launch on set `i` of the prepared case.
        fn launch(&mut self, i: usize) -> Result<(), String> {
            let c = self.case.as_mut().ok_or("nothing prepared")?;
            let (engine, stream) = (&self.engine, &self.stream);
            let shapes = (c.q_shape, c.k_shape, c.v_shape);
            match &mut c.sets {
                Sets::F16(s) => launch_set(engine, stream, &mut s[i], shapes, &c.opts),
                Sets::BF16(s) => launch_set(engine, stream, &mut s[i], shapes, &c.opts),
            }
        }

        fn n_sets(&self) -> usize {
            match self.case.as_ref().map(|c| &c.sets) {
                Some(Sets::F16(s)) => s.len(),
                Some(Sets::BF16(s)) => s.len(),
                None => 0,
            }
        }
    }

    /// Enqueues one forward on `set` (no allocation, no synchronization: `Engine::launch`), or
    /// one backward on a backward set (`Engine::backward`: its scratch is allocated and freed
    /// on the stream).
    fn launch_set<T: Element + DeviceRepr>(
        engine: &Engine,
        stream: &Arc<CudaStream>,
        set: &mut Set<T>,
        (q_shape, k_shape, v_shape): (Shape, Shape, Shape),
        opts: &ForwardOptions,
    ) -> Result<(), String> {
        let q = DeviceTensor::new(&set.q, stream, q_shape);
        let k = DeviceTensor::new(&set.k, stream, k_shape);
        let v = DeviceTensor::new(&set.v, stream, v_shape);
        let Some(b) = &mut set.bwd else {
            let mut o = DeviceTensorMut::new(&mut set.o, stream, q_shape);
            return engine.launch(stream, &q, &k, &v, &mut o, None, opts).map_err(|e| e.to_string());
        };
        let o = DeviceTensor::new(&set.o, stream, q_shape);
        let d_o = DeviceTensor::new(&b.d_o, stream, q_shape);
        let lse = DeviceLseRef::new(&b.lse, stream);
        let x = BackwardInputs { q: &q, k: &k, v: &v, o: &o, d_o: &d_o, lse: &lse };
        let mut dq = DeviceTensorMut::new(&mut b.dq, stream, q_shape);
        let mut dk = DeviceTensorMut::new(&mut b.dk, stream, k_shape);
        let mut dv = DeviceTensorMut::new(&mut b.dv, stream, k_shape);
        engine.backward(stream, x, BackwardGrads { dq: &mut dq, dk: &mut dk, dv: &mut dv, d_sinks: None }, opts).map(|_| ()).map_err(|e| e.to_string())
    }

    /// Gives every set of a forward case the backward's buffers: dO (q's values), the forward's
    /// output and LSE (one `Variant::Auto` forward per set, waited for) and the gradients.
    fn add_backward<T: Element + DeviceRepr + ValidAsZeroBits>(
        engine: &Engine,
        stream: &Arc<CudaStream>,
        sets: &mut [Set<T>],
        (q_shape, k_shape, v_shape): (Shape, Shape, Shape),
        opts: &ForwardOptions,
    ) -> Result<(), String> {
        let fwd = ForwardOptions { variant: crate::Variant::Auto, ..opts.clone() };
        let rows = q_shape[0] * q_shape[1] * q_shape[2];
        for set in sets {
            let mut lse = stream.alloc_zeros::<f32>(rows).map_err(err("cuMemAlloc(lse)"))?;
            {
                let q = DeviceTensor::new(&set.q, stream, q_shape);
                let k = DeviceTensor::new(&set.k, stream, k_shape);
                let v = DeviceTensor::new(&set.v, stream, v_shape);
                let mut o = DeviceTensorMut::new(&mut set.o, stream, q_shape);
                let mut l = DeviceLse::new(&mut lse, stream);
                engine.forward(stream, &q, &k, &v, &mut o, Some(&mut l), &fwd).map_err(|e| format!("the forward before the backward: {e}"))?;
            }
            let mut d_o = stream.alloc_zeros(set.q.len()).map_err(err("cuMemAlloc(d_o)"))?;
            stream.memcpy_dtod(&set.q, &mut d_o).map_err(err("cuMemcpyDtoD"))?;
            set.bwd = Some(BwdSet {
                d_o,
                lse,
                dq: stream.alloc_zeros(set.q.len()).map_err(err("cuMemAlloc(dq)"))?,
                dk: stream.alloc_zeros(set.k.len()).map_err(err("cuMemAlloc(dk)"))?,
                dv: stream.alloc_zeros(set.v.len()).map_err(err("cuMemAlloc(dv)"))?,
            });
        }
        stream.synchronize().map_err(err("cuStreamSynchronize (forward before the backward)"))
    }

    /// `sets` copies of (q, k, v) on the device, each with a zeroed output.
    fn upload<T: DeviceRepr + ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        q: &[T],
        k: &[T],
        v: &[T],
        sets: usize,
    ) -> Result<Vec<Set<T>>, String> {
        let first = Set {
            q: stream.clone_htod(q).map_err(err("cuMemcpyHtoD(q)"))?,
            k: stream.clone_htod(k).map_err(err("cuMemcpyHtoD(k)"))?,
            v: stream.clone_htod(v).map_err(err("cuMemcpyHtoD(v)"))?,
            o: stream.alloc_zeros(q.len()).map_err(err("cuMemAlloc(o)"))?,
            bwd: None,
        };
        let mut all = Vec::with_capacity(sets);
        for _ in 1..sets.max(1) {
            // Same values at other addresses: what matters for L2 is that the bytes differ in
            // place, and device copies are far faster than re-uploading.
            let copy = |s: &CudaSlice<T>| -> Result<CudaSlice<T>, String> {
                let mut d = stream.alloc_zeros(s.len()).map_err(err("cuMemAlloc"))?;
                stream.memcpy_dtod(s, &mut d).map_err(err("cuMemcpyDtoD"))?;
                Ok(d)
            };
            all.push(Set {
                q: copy(&first.q)?,
                k: copy(&first.k)?,
                v: copy(&first.v)?,
                o: stream.alloc_zeros(q.len()).map_err(err("cuMemAlloc(o)"))?,
                bwd: None,
            });
        }
        all.insert(0, first);
        Ok(all)
    }

    impl GpuHarness for Harness {
        fn info(&self) -> &GpuInfo {
            &self.info
        }

        fn copy_bandwidth(&mut self, bytes: usize) -> Result<f64, String> {
            let src = self.stream.alloc_zeros::<u8>(bytes).map_err(err("cuMemAlloc"))?;
            let mut dst = self.stream.alloc_zeros::<u8>(bytes).map_err(err("cuMemAlloc"))?;
            self.stream.memcpy_dtod(&src, &mut dst).map_err(err("cuMemcpyDtoD"))?; // warm-up
            let (a, b) = (self.event()?, self.event()?);
            let mut best = f64::INFINITY;
            for _ in 0..COPY_REPS {
                a.record(&self.stream).map_err(err("cuEventRecord"))?;
                self.stream.memcpy_dtod(&src, &mut dst).map_err(err("cuMemcpyDtoD"))?;
                b.record(&self.stream).map_err(err("cuEventRecord"))?;
                best = best.min(a.elapsed_ms(&b).map_err(err("cuEventElapsedTime"))? as f64);
            }
            // Bytes read + bytes written.
            Ok(2.0 * bytes as f64 / (best * 1e-3))
        }

        fn prepare(
            &mut self,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            opts: &ForwardOptions,
            sets: usize,
        ) -> Result<Dispatch, String> {
            self.prepare_case(q, k, v, opts, sets, false)
        }

        fn prepare_backward(
            &mut self,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            opts: &ForwardOptions,
            sets: usize,
        ) -> Result<Dispatch, String> {
            self.prepare_case(q, k, v, opts, sets, true)
        }

        fn time(&mut self, warmup: usize, reps: usize, launches_per_rep: usize) -> Result<GpuTiming, String> {
            let n = self.n_sets();
            if n == 0 {
                return Err("nothing prepared".into());
            }
            let mut next = self.case.as_ref().map_or(0, |c| c.next);
            for _ in 0..warmup {
                self.launch(next % n)?;
                next += 1;
            }
            let (a, b) = (self.event()?, self.event()?);
            let per = launches_per_rep.max(1);
            let mut ms = Vec::with_capacity(reps);
            for _ in 0..reps.max(1) {
                a.record(&self.stream).map_err(err("cuEventRecord"))?;
                for _ in 0..per {
                    self.launch(next % n)?;
                    next += 1;
                }
                b.record(&self.stream).map_err(err("cuEventRecord"))?;
                // elapsed_ms waits for both events: a kernel fault surfaces here.
                ms.push(a.elapsed_ms(&b).map_err(err("cuEventElapsedTime"))? as f64 / per as f64);
            }
            let c = self.case.as_mut().expect("checked above");
            c.next = next;
            Ok(GpuTiming { ms_per_launch: ms, kernel: c.dispatch.kernel.clone() })
        }

        fn output(&mut self) -> Result<Output, String> {
            let c = self.case.as_ref().ok_or("nothing prepared")?;
            let o = match &c.sets {
                Sets::F16(s) => {
                    Tensor::from_vec(self.stream.clone_dtoh(&s[0].o).map_err(err("cuMemcpyDtoH"))?, c.q_shape)
                }
                Sets::BF16(s) => {
                    Tensor::from_vec(self.stream.clone_dtoh(&s[0].o).map_err(err("cuMemcpyDtoH"))?, c.q_shape)
                }
            }
            .map_err(|e| e.to_string())?;
            self.stream.synchronize().map_err(err("cuStreamSynchronize"))?;
            Ok(Output { o, lse: None, dispatch: c.dispatch.clone() })
        }
    }
}

#[allow(unused_imports)] // used by benches/gpu.rs only
pub use crate::bench::roofline::rotating_sets;

/// The GPU sweep (FA3 paper style): batch × seqlen = `tokens` (16K), seqlen 512..=16K, head_dim
/// 64/128/256 with hidden 2048 (32/16/8 heads, as FA3's paper), causal and not, in `dtype`.
/// `quick` is the short sweep of the one-command GPU check: hdim 64 and 128 at seqlen 4K (the
/// same shapes as `scripts/bench/gpu-peers-torch.py --quick` and `scripts/bench/gpu-peers.sh`).
pub fn sweep(dtype: crate::DType, tokens: usize, quick: bool) -> Vec<Case> {
    const HIDDEN: usize = 2048;
    let seqlens: &[usize] = if quick { &[4096] } else { &[512, 1024, 2048, 4096, 8192, 16384] };
    let dims: &[usize] = if quick { &[64, 128] } else { &[64, 128, 256] };
    let mut cases = Vec::new();
    for &d in dims {
        for &s in seqlens {
            for causal in [false, true] {
                cases.push(Case::square((tokens / s).max(1), s, HIDDEN / d, d, dtype, causal));
            }
        }
    }
    cases
}

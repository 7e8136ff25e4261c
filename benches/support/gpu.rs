//! The boundary between the GPU benches and the CUDA runtime.
//!
//! Everything GPU-specific the benches need is the [`GpuHarness`] trait and [`open`]. Until the
//! CUDA backend is wired here, [`open`] reports that no GPU is usable, and `benches/gpu.rs` and
//! `examples/bench.rs --backend cuda` print "no CUDA GPU present" and exit 0.
//!
//! TODO(lead, after merging the CUDA runtime): implement [`GpuHarness`] for the crate's CUDA
//! context and return it from [`open`]. It needs:
//! - device properties: name (`cuDeviceGetName`), compute capability, SM count, L2 size
//!   (`CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE`), driver version (`cuDriverGetVersion`), current SM
//!   and memory clocks if available (NVML or `nvidia-smi --query-gpu=clocks.sm,clocks.mem`);
//! - device buffers: [`rotating_sets`] sets of q, k, v, o (and LSE) uploaded once, so that
//!   successive launches read inputs that are not in L2;
//! - a launch entry point taking device pointers (not the host `forward`, whose copies would be
//!   timed), returning the kernel name it chose (`Dispatch::kernel`);
//! - CUDA events (`cuEventCreate`/`cuEventRecord`/`cuEventElapsedTime`) on the launch stream;
//! - a device-to-device copy (`cuMemcpyDtoDAsync`) for the bandwidth ceiling.

use super::Case;
use flash_attn::{ForwardOptions, Output, Tensor};

/// What the report prints about the GPU.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub sm: (u32, u32),
    pub sm_count: u32,
    pub l2_bytes: usize,
    /// e.g. "CUDA driver 13.0 (580.82)".
    pub driver: String,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
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

    /// Prepares `case` with `opts` (variant, precision, ...) for timing: uploads `sets`
    /// independent sets of random inputs (see [`rotating_sets`]), allocates outputs and runs one
    /// probe launch. An unsupported variant/precision on this GPU is `Err` with the crate's
    /// reason (the bench skips it). Replaces the previously prepared case.
    fn prepare(&mut self, case: &Case, opts: &ForwardOptions, sets: usize) -> Result<(), String>;

    /// Times the prepared case: `warmup` launches, then `reps` repetitions, each an event,
    /// `launches_per_rep` launches cycling through the input sets, another event; per-launch ms
    /// = elapsed / launches_per_rep.
    fn time(&mut self, warmup: usize, reps: usize, launches_per_rep: usize) -> Result<GpuTiming, String>;

    /// One forward pass on these host inputs on this GPU (for the sampled error check).
    fn forward_once(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, opts: &ForwardOptions) -> Result<Output, String>;
}

/// The harness for CUDA device `ordinal`, or why there is none.
pub fn open(ordinal: usize) -> Result<Box<dyn GpuHarness>, String> {
    // TODO(lead): when the CUDA runtime is merged, build the harness here; keep returning Err
    // (with the runtime's reason) when there is no driver or no device.
    let _ = ordinal;
    Err("the CUDA runtime is not wired into the benches yet (benches/support/gpu.rs: open)".into())
}

#[allow(unused_imports)] // used by benches/gpu.rs only
pub use flash_attn::roofline::rotating_sets;

/// The GPU sweep of the issue: batch × seqlen = `tokens` (16K), seqlen 512..=16K, head_dim
/// 64/128/256 with hidden 2048 (32/16/8 heads, as FA3's paper), causal and not, in `dtype`.
/// `quick` keeps hdim 128 at 1K and 8K tokens for the one-command GPU check.
pub fn sweep(dtype: flash_attn::DType, tokens: usize, quick: bool) -> Vec<Case> {
    const HIDDEN: usize = 2048;
    let seqlens: &[usize] = if quick { &[1024, 8192] } else { &[512, 1024, 2048, 4096, 8192, 16384] };
    let dims: &[usize] = if quick { &[128] } else { &[64, 128, 256] };
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

//! Roofline ceilings: the peak dense FLOP/s and memory bandwidth a run is measured against.
//!
//! GPUs come from a small table keyed by device name (and, failing that, by SM version) with the
//! source of every number; the benches refine the bandwidth by measuring a device-to-device copy on
//! the spot. A CPU has no table: its compute ceiling is the machine's own f32 GEMM rate measured
//! in the same run (by a well-kept GEMM crate in the benches) and its bandwidth a multi-threaded
//! copy measured here ([`measure_copy_bandwidth`]).
//!
//! Every peak is **dense** (without 2:4 sparsity): datasheets print the sparse figure first, and
//! it is twice the dense one.

use crate::options::Precision;
use crate::tensor::DType;
use std::time::Instant;

/// The arithmetic a run's products use, which picks the compute ceiling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Math {
    /// f32 inputs: CUDA cores on a GPU (no TF32 in this crate), FMA units on a CPU.
    F32,
    F16,
    BF16,
    /// e4m3 products (`Precision::Fp8`).
    Fp8,
}

impl Math {
    /// The math of a run with inputs of `dtype` at `precision`.
    pub fn of(dtype: DType, precision: Precision) -> Math {
        match (precision, dtype) {
            (Precision::Fp8 { .. }, _) => Math::Fp8,
            (_, DType::F16) => Math::F16,
            (_, DType::BF16) => Math::BF16,
            _ => Math::F32,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Math::F32 => "f32",
            Math::F16 => "f16",
            Math::BF16 => "bf16",
            Math::Fp8 => "fp8",
        }
    }
}

/// Spec sheet of one GPU model. FLOP/s and bytes/s; `None` where the part has no such unit (FP8
/// before Ada/Hopper) or the figure is not published.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuSpec {
    /// What the table calls it.
    pub model: &'static str,
    /// Substrings of `cudaDeviceProp::name` / `cuDeviceGetName` that select this entry (checked
    /// in table order, so more specific names come first).
    pub names: &'static [&'static str],
    /// Compute capability (major, minor).
    pub sm: (u32, u32),
    /// Dense f16/bf16 tensor-core peak with f32 accumulation.
    pub bf16: f64,
    /// Dense FP8 tensor-core peak with f32 accumulation.
    pub fp8: Option<f64>,
    /// Non-tensor f32 (CUDA-core FMA) peak.
    pub f32: Option<f64>,
    /// Memory bandwidth from the spec sheet.
    pub bandwidth: f64,
    /// Where the numbers come from.
    pub source: &'static str,
}

impl GpuSpec {
    /// The dense compute peak for `math`, if the part has it.
    pub fn peak(&self, math: Math) -> Option<f64> {
        match math {
            Math::F16 | Math::BF16 => Some(self.bf16),
            Math::Fp8 => self.fp8,
            Math::F32 => self.f32,
        }
    }
}

const T: f64 = 1e12;
const TB: f64 = 1e12;

/// Known GPUs. Sparse datasheet figures are halved to dense ones.
pub const GPUS: &[GpuSpec] = &[
    GpuSpec {
        model: "B200",
        names: &["B200"],
        sm: (10, 0),
        bf16: 2250.0 * T,
        fp8: Some(4500.0 * T),
        f32: None,
        bandwidth: 8.0 * TB,
        source: "NVIDIA HGX B200 datasheet (per GPU, dense: 2.25 PF BF16, 4.5 PF FP8, 8 TB/s HBM3e); \
                 FA4 reports 1605 TFLOP/s = 71 % of it",
    },
    GpuSpec {
        model: "H200 NVL",
        names: &["H200 NVL"],
        sm: (9, 0),
        bf16: 835.5 * T,
        fp8: Some(1671.0 * T),
        f32: Some(60.0 * T),
        bandwidth: 4.8 * TB,
        source: "NVIDIA H200 datasheet, NVL column (dense = sparse / 2)",
    },
    GpuSpec {
        model: "H200 SXM",
        names: &["H200"],
        sm: (9, 0),
        bf16: 989.4 * T,
        fp8: Some(1978.9 * T),
        f32: Some(66.9 * T),
        bandwidth: 4.8 * TB,
        source: "NVIDIA H200 datasheet, SXM column (dense = sparse / 2); same SM array as H100 SXM, \
                 HBM3e 4.8 TB/s spec (a device-to-device copy reaches about 4.3 TB/s)",
    },
    GpuSpec {
        model: "GH200",
        names: &["GH200"],
        sm: (9, 0),
        bf16: 989.4 * T,
        fp8: Some(1978.9 * T),
        f32: Some(66.9 * T),
        bandwidth: 4.0 * TB,
        source: "NVIDIA GH200 datasheet (96 GB HBM3 part: 4.0 TB/s; the 144 GB HBM3e part has 4.9 TB/s)",
    },
    GpuSpec {
        model: "H100 NVL",
        names: &["H100 NVL"],
        sm: (9, 0),
        bf16: 835.5 * T,
        fp8: Some(1670.5 * T),
        f32: Some(60.0 * T),
        bandwidth: 3.9 * TB,
        source: "NVIDIA H100 datasheet, NVL column (dense = sparse / 2)",
    },
    GpuSpec {
        model: "H100 PCIe",
        names: &["H100 PCIe"],
        sm: (9, 0),
        bf16: 756.5 * T,
        fp8: Some(1513.0 * T),
        f32: Some(51.2 * T),
        bandwidth: 2.0 * TB,
        source: "NVIDIA H100 datasheet, PCIe column (dense = sparse / 2)",
    },
    GpuSpec {
        model: "H100 SXM",
        names: &["H100"],
        sm: (9, 0),
        bf16: 989.4 * T,
        fp8: Some(1978.9 * T),
        f32: Some(66.9 * T),
        bandwidth: 3.35 * TB,
        source: "NVIDIA H100 datasheet, SXM column (dense = sparse / 2); FA3's paper uses 989 TFLOP/s",
    },
    GpuSpec {
        model: "L40S",
        names: &["L40S"],
        sm: (8, 9),
        bf16: 362.05 * T,
        fp8: Some(733.0 * T),
        f32: Some(91.6 * T),
        bandwidth: 0.864 * TB,
        source: "NVIDIA L40S datasheet (dense = sparse / 2)",
    },
    GpuSpec {
        model: "L4",
        names: &["L4"],
        sm: (8, 9),
        bf16: 121.0 * T,
        fp8: Some(242.5 * T),
        f32: Some(30.3 * T),
        bandwidth: 0.300 * TB,
        source: "NVIDIA L4 datasheet (dense = sparse / 2)",
    },
    GpuSpec {
        model: "RTX 4090",
        names: &["RTX 4090"],
        sm: (8, 9),
        bf16: 165.2 * T,
        fp8: Some(330.3 * T),
        f32: Some(82.6 * T),
        bandwidth: 1.008 * TB,
        source: "NVIDIA Ada whitepaper, RTX 4090 (tensor peaks with f32 accumulate, dense)",
    },
    GpuSpec {
        model: "A100 SXM4 80GB",
        names: &["A100-SXM4-80GB", "A100 SXM4 80GB"],
        sm: (8, 0),
        bf16: 312.0 * T,
        fp8: None,
        f32: Some(19.5 * T),
        bandwidth: 2.039 * TB,
        source: "NVIDIA A100 datasheet, 80GB SXM column (dense)",
    },
    GpuSpec {
        model: "A100 PCIe 80GB",
        names: &["A100 80GB PCIe", "A100-PCIE-80GB"],
        sm: (8, 0),
        bf16: 312.0 * T,
        fp8: None,
        f32: Some(19.5 * T),
        bandwidth: 1.935 * TB,
        source: "NVIDIA A100 datasheet, 80GB PCIe column (dense)",
    },
    GpuSpec {
        model: "A100 40GB",
        names: &["A100"],
        sm: (8, 0),
        bf16: 312.0 * T,
        fp8: None,
        f32: Some(19.5 * T),
        bandwidth: 1.555 * TB,
        source: "NVIDIA A100 datasheet, 40GB columns (dense)",
    },
    GpuSpec {
        model: "A10",
        names: &["A10"],
        sm: (8, 6),
        bf16: 125.0 * T,
        fp8: None,
        f32: Some(31.2 * T),
        bandwidth: 0.600 * TB,
        source: "NVIDIA A10 datasheet (dense = sparse / 2)",
    },
    GpuSpec {
        model: "RTX 3090",
        names: &["RTX 3090"],
        sm: (8, 6),
        bf16: 71.0 * T,
        fp8: None,
        f32: Some(35.6 * T),
        bandwidth: 0.936 * TB,
        source: "NVIDIA Ampere GA102 whitepaper, RTX 3090 (tensor peak with f32 accumulate, dense)",
    },
];

/// How a [`GpuSpec`] was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matched {
    /// The device name contains one of the entry's names.
    ByName,
    /// Unknown name; the first entry with the same SM version is assumed (say so in reports).
    BySm,
}

/// The spec of the GPU called `name` with compute capability `sm`, if known.
pub fn lookup_gpu(name: &str, sm: (u32, u32)) -> Option<(&'static GpuSpec, Matched)> {
    let by_name = GPUS.iter().find(|g| g.names.iter().any(|n| name.contains(n)));
    match by_name {
        Some(g) => Some((g, Matched::ByName)),
        None => GPUS.iter().find(|g| g.sm == sm).map(|g| (g, Matched::BySm)),
    }
}

/// The two ceilings of one machine and dtype: `min(peak, bandwidth · intensity)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Roofline {
    /// The machine, e.g. "NVIDIA H200 (sm_90)" or "AMD EPYC (2 threads)".
    pub machine: String,
    pub math: Math,
    /// Compute ceiling, FLOP/s.
    pub peak_flops: f64,
    /// Where `peak_flops` comes from.
    pub peak_source: String,
    /// Bandwidth ceiling, bytes/s.
    pub bandwidth: f64,
    /// Where `bandwidth` comes from.
    pub bandwidth_source: String,
}

impl Roofline {
    /// The roofline of a known GPU for `math`, from the spec sheet; `None` when the part has no
    /// such unit or the figure is unpublished.
    pub fn gpu(spec: &GpuSpec, matched: Matched, math: Math) -> Option<Roofline> {
        let assumed = match matched {
            Matched::ByName => "",
            Matched::BySm => " [ASSUMED from the SM version: the device name is not in the table]",
        };
        Some(Roofline {
            machine: spec.model.to_string(),
            math,
            peak_flops: spec.peak(math)?,
            peak_source: format!("{}{assumed}", spec.source),
            bandwidth: spec.bandwidth,
            bandwidth_source: format!("spec sheet ({}){assumed}", spec.model),
        })
    }

    /// A CPU's roofline: its measured f32 GEMM rate and measured copy bandwidth.
    pub fn cpu(machine: String, gemm_flops: f64, gemm_source: String, bandwidth: f64) -> Roofline {
        Roofline {
            machine,
            math: Math::F32,
            peak_flops: gemm_flops,
            peak_source: gemm_source,
            bandwidth,
            bandwidth_source: "multi-threaded copy measured in this run (bytes read + written)".into(),
        }
    }

    /// Replace the bandwidth ceiling by one measured on the spot (a device-to-device copy).
    pub fn with_measured_bandwidth(mut self, bytes_per_s: f64, how: &str) -> Roofline {
        self.bandwidth_source = format!("measured: {how} (spec {:.2} TB/s)", self.bandwidth / TB);
        self.bandwidth = bytes_per_s;
        self
    }

    /// The attainable FLOP/s at arithmetic intensity `ai` (FLOPs per byte).
    pub fn ceiling(&self, ai: f64) -> f64 {
        self.peak_flops.min(self.bandwidth * ai)
    }

    /// The intensity where the two ceilings meet.
    pub fn ridge(&self) -> f64 {
        self.peak_flops / self.bandwidth
    }

    /// `achieved` as a percentage of the ceiling at `ai`.
    pub fn percent(&self, achieved: f64, ai: f64) -> f64 {
        100.0 * achieved / self.ceiling(ai)
    }
}

/// The CPU's model name (from /proc/cpuinfo on Linux) and the threads available.
pub fn cpu_name() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{model} ({threads} threads)")
}

/// Measures the host's copy bandwidth (bytes read + written per second) with `threads` threads
/// each copying its slice of a `bytes`-sized buffer; best of `reps` passes after one warm-up.
/// Use a buffer well above the last-level cache (e.g. 256 MiB).
pub fn measure_copy_bandwidth(bytes: usize, threads: usize, reps: usize) -> f64 {
    let n = bytes / std::mem::size_of::<f32>();
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let threads = threads.max(1);
    let chunk = n.div_ceil(threads);
    let mut best = f64::INFINITY;
    for rep in 0..=reps {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, x) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(x));
            }
        });
        let dt = t.elapsed().as_secs_f64();
        if rep > 0 {
            best = best.min(dt);
        }
    }
    std::hint::black_box(&dst);
    2.0 * (n * std::mem::size_of::<f32>()) as f64 / best
}

/// How many input sets a GPU bench rotates so that one pass over all of them is at least twice
/// the L2 (no launch finds its inputs cached by the previous ones); at least 2.
pub fn rotating_sets(bytes_per_set: u64, l2_bytes: usize) -> usize {
    let need = (2 * l2_bytes as u64).div_ceil(bytes_per_set.max(1));
    (need as usize + 1).max(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_covers_twice_l2() {
        assert_eq!(rotating_sets(1 << 30, 50 << 20), 2);
        assert_eq!(rotating_sets(10 << 20, 50 << 20), 11);
    }

    #[test]
    fn lookup_prefers_specific_names_and_falls_back_to_sm() {
        let (g, m) = lookup_gpu("NVIDIA H100 80GB HBM3", (9, 0)).unwrap();
        assert_eq!((g.model, m), ("H100 SXM", Matched::ByName));
        assert_eq!(lookup_gpu("NVIDIA H100 PCIe", (9, 0)).unwrap().0.model, "H100 PCIe");
        assert_eq!(lookup_gpu("NVIDIA H200 NVL", (9, 0)).unwrap().0.model, "H200 NVL");
        assert_eq!(lookup_gpu("NVIDIA H200", (9, 0)).unwrap().0.model, "H200 SXM");
        assert_eq!(lookup_gpu("NVIDIA A100-SXM4-80GB", (8, 0)).unwrap().0.model, "A100 SXM4 80GB");
        assert_eq!(lookup_gpu("NVIDIA L40S", (8, 9)).unwrap().0.model, "L40S");
        let (g, m) = lookup_gpu("Some Future Hopper", (9, 0)).unwrap();
        assert_eq!(m, Matched::BySm);
        assert_eq!(g.sm, (9, 0));
        assert!(lookup_gpu("Unknown", (7, 5)).is_none());
    }

    #[test]
    fn ceilings_meet_at_the_ridge() {
        let (g, m) = lookup_gpu("NVIDIA H200", (9, 0)).unwrap();
        let r = Roofline::gpu(g, m, Math::BF16).unwrap();
        assert_eq!(r.peak_flops, 989.4e12);
        let ridge = r.ridge();
        assert!((r.ceiling(ridge) - r.peak_flops).abs() / r.peak_flops < 1e-12);
        assert!((r.ceiling(ridge / 2.0) - r.peak_flops / 2.0).abs() / r.peak_flops < 1e-12);
        assert!((r.percent(r.peak_flops / 4.0, 10.0 * ridge) - 25.0).abs() < 1e-9);
        let measured = r.with_measured_bandwidth(4.3e12, "test");
        assert_eq!(measured.bandwidth, 4.3e12);
        assert!(Roofline::gpu(lookup_gpu("NVIDIA A100-SXM4-80GB", (8, 0)).unwrap().0, m, Math::Fp8).is_none());
    }

    #[test]
    fn copy_bandwidth_is_positive() {
        assert!(measure_copy_bandwidth(1 << 20, 2, 1) > 0.0);
    }
}

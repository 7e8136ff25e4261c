//! One measured run as one JSON line.

use crate::bench::flops;
use crate::bench::roofline::{Math, Roofline};
use crate::Mask;
use serde_json::{json, Map, Value};
use super::Case;

/// One measured run, printed as one JSON line (the format `scripts/bench/gpu-peers-torch.py` also writes
/// and `scripts/bench/report.py` reads).
#[derive(Clone, Debug)]
pub struct Record {
    /// "flash_attn", "torch-sdpa-flash", "torch-sdpa-cudnn", "gemm".
    pub impl_name: String,
    pub machine: String,
    /// "cpu" or "cuda:N".
    pub backend: String,
    /// Kernel from `Output::dispatch` (or the peer's backend).
    pub kernel: String,
    /// The requested variant ("auto", "fa2", ...).
    pub variant: String,
    pub case: Case,
    pub precision: String,
    pub cost: flops::Cost,
    /// Median milliseconds per run.
    pub ms: f64,
    /// Fastest run (ms): on a shared machine the closest to the unloaded rate.
    pub ms_min: Option<f64>,
    pub runs: usize,
    pub roofline: Option<Roofline>,
    pub max_err: Option<f64>,
    pub err_rows: usize,
    /// The f32 GEMM rate (FLOP/s, CPU) the run is compared with: in `benches/cpu.rs` the
    /// 2048×2048×128 sgemm timed interleaved with this case's samples (median).
    pub gemm_flops: Option<f64>,
    /// The best (fastest-run) rate of that GEMM, FLOP/s.
    pub gemm_flops_best: Option<f64>,
    /// Median of the per-run attention ÷ GEMM ratios with time-matched GEMM blocks alternating
    /// with the runs ([`paired_ratio`]): the steadiest comparison on a loaded machine.
    pub gemm_ratio_paired: Option<f64>,
    /// Rates per CPU-second × threads (attention, GEMM), FLOP/s: what the run would do with the
    /// cores to itself ([`process_cpu_seconds`]).
    pub cpu_time_rates: Option<(f64, f64)>,
}

impl Record {
    pub fn flops_per_s(&self) -> f64 {
        flops::flops_per_second(self.cost.flops, self.ms)
    }

    pub fn json(&self) -> String {
        self.json_with([])
    }

    /// [`Record::json`] with extra fields, e.g. the GPU's driver and clocks, which
    /// `scripts/bench/report.py` prints per machine.
    pub fn json_with<const N: usize>(&self, extra: [(&str, Value); N]) -> String {
        let mut fields = self.json_fields();
        fields.extend(extra.into_iter().map(|(k, v)| (k.to_string(), v)));
        Value::Object(fields).to_string()
    }

    /// The fields of the JSON object (a non-finite number is `null`).
    fn json_fields(&self) -> Map<String, Value> {
        let c = &self.case;
        let (window_left, window_right) = match c.mask {
            Mask::Window { left, right, .. } => (Some(left), Some(right)),
            _ => (None, None),
        };
        let ai = self.cost.intensity();
        let rate = self.flops_per_s();
        let roof = self.roofline.as_ref();
        let tera = |x: Option<f64>| x.map(|x| x / 1e12);
        let math = Math::of(c.dtype, crate::Precision::Native);
        let json = json!({
            "impl": self.impl_name,
            "machine": self.machine,
            "backend": self.backend,
            "kernel": self.kernel,
            "variant": self.variant,
            "dtype": c.dtype.to_string(),
            "precision": self.precision,
            "math": if self.precision == "native" { math.name() } else { "fp8" },
            "batch": c.batch,
            "seqlen_q": c.seqlen_q,
            "seqlen_k": c.seqlen_k,
            "heads_q": c.heads_q,
            "heads_kv": c.heads_kv,
            "head_dim": c.head_dim,
            "causal": c.causal(),
            "window_left": window_left,
            "window_right": window_right,
            "flops": self.cost.flops,
            "bytes": self.cost.bytes,
            "intensity": ai,
            "ms": self.ms,
            "ms_min": self.ms_min,
            "runs": self.runs,
            "tflops": rate / 1e12,
            "peak_tflops": tera(roof.map(|r| r.peak_flops)),
            "bandwidth_tbs": tera(roof.map(|r| r.bandwidth)),
            "pct_roofline": roof.map(|r| r.percent(rate, ai)),
            "roofline_source": roof.map(|r| format!("{} | {}", r.peak_source, r.bandwidth_source)),
            "gemm_tflops": tera(self.gemm_flops),
            "gemm_tflops_best": tera(self.gemm_flops_best),
            "gemm_ratio_paired": self.gemm_ratio_paired,
            "tflops_cputime": tera(self.cpu_time_rates.map(|r| r.0)),
            "gemm_tflops_cputime": tera(self.cpu_time_rates.map(|r| r.1)),
            "max_err": self.max_err,
            "err_rows": self.err_rows,
        });
        match json {
            Value::Object(m) => m,
            _ => unreachable!("json! of an object literal"),
        }
    }
}

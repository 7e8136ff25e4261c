//! Shared by `benches/cpu.rs`, `benches/gpu.rs` and `examples/bench.rs`: the bench cases,
//! inputs, timing statistics, the f32 GEMM reference rate, the sampled error check and the
//! one-line JSON record every tool prints.

mod cases;
mod gemm;
pub mod gpu;
mod record;
mod stats;

pub use cases::{kv_bytes, sampled_max_error, Case, HeadMajor, PagedKv};
pub use gemm::{cpu_roofline, gemm_use_all_cores, Gemm, GEMM_SHAPES};
pub use record::Record;
pub use stats::{median, paired_ratio, process_cpu_seconds, time_ms};

//! Measurement tooling (feature `bench`), for the crate's benches, examples and tests: nothing
//! here is used by `forward`, and nothing here is covered by semver.
//!
//! | module | role |
//! |---|---|
//! | [`flops`] | the FLOP/byte model every bench and report counts with |
//! | [`roofline`] | per-device ceilings (a GPU spec table, the CPU's measured copy bandwidth) |
//! | [`fp8_baseline`] | the naive FP8 attention of FA3's accuracy table and the P-scale ablation |
//! | [`support`] | bench cases and inputs, statistics, the GEMM rate, JSON records, the GPU harness |

pub mod flops;
pub mod fp8_baseline;
pub mod roofline;
pub mod support;

//! Tests that need nothing but Rust: the CPU backend, the serving API and the numerics against
//! the float64 reference, property tests included (docs/testing.md). `cargo test --test cpu`;
//! a module by its path, e.g. `cargo test --test cpu domain_edges::`.
//!
//! No test here sets process-wide state (environment, thread pools), so all share one binary.
//! Modules that use the measurement tooling (`flash_attn::bench`) need the `bench` feature, which
//! the repository's dev-dependency turns on (the published crate: `--features bench`).

#[path = "../support/mod.rs"]
mod support;

/// The backward against the float64 gradient over random shapes and options (properties).
mod backward_props;
/// Window bounds over all of i64, scores up to f32::MAX, overflowing options, NaN/inf (properties).
mod domain_edges;
/// Named edge cases against the float64 reference.
mod edge_cases;
/// Every bad input of `forward` is a typed error naming what was given and expected.
mod errors;
/// A V head_dim different from Q/K's on every CPU path against float64, and its refusals.
mod head_dim_v;
/// The dense forward over random shapes and options (properties).
#[cfg(feature = "bench")]
mod forward_props;
/// FP8 KV caches: reads against the reference on the dequantised cache, appends, bad scales.
mod fp8_kv_cache;
/// FlashAttention-3's FP8 accuracy claim on the CPU FP8 path.
#[cfg(feature = "bench")]
mod fp8_accuracy;
/// `forward_into` and buffers handed out without a copy.
#[cfg(feature = "bench")]
mod host_api;
/// Rotary embedding in the append, cache_batch_idx and cache_leftpad against float64 (properties).
mod kvcache_rotary;
/// `merge_states` is the exact softmax recombination (properties).
mod merge_states;
/// FP8 codecs, block quantisation, Hadamard, software exp2, lazy rescaling.
#[cfg(feature = "bench")]
mod numerics;
/// Many threads on shared read-only and distinct writable caches, bit-identical to one at a time.
mod serving_concurrency;
/// Every malformed serving argument is a typed error naming what was given and expected.
mod serving_errors;
/// The serving API over random, possibly malformed layouts (properties).
mod serving_fuzz;
/// No import cycle in src/: between files, between top-level modules, or between the backends.
mod module_layers;
/// Attention sinks on every CPU path against float64, and their domain edges (properties).
mod sinks;
/// Varlen, dense and paged caches, append and split-KV against float64 per sequence (properties).
mod serving_props;

//! Tests that need g++: the kernel sources run in the CPU emulator (cuda/test/emu,
//! docs/emulator.md) against the float64 reference, and the host C++ models of the kernels'
//! layouts. A representative subset by default; `FLASH_ATTN_EMU=full` for the whole matrices
//! (scripts/emulate.sh). `cargo test --test emulator`; a module by its path, e.g.
//! `cargo test --test emulator serving_fa3::`.
//!
//! The modules share one build cache of emulator programs (support/emu.rs: built once per
//! process and content, under distinct names) and read the environment only; none sets it.

#[path = "../support/mod.rs"]
mod support;

/// The FA2 and FA3-style backward's launches (sinks' gradient included) against the float64
/// gradient, and their mutations.
#[cfg(feature = "cuda")]
mod backward;
/// The combine kernel (split-KV's second pass, device `merge_states`) against the host merge.
#[cfg(feature = "cuda")]
mod combine;
/// The FA2 kernel's layout test on the host (cuda/fa2_fwd.cu with g++).
mod fa2_layout;
/// The FA3 host layout model (cuda/test/fa3_layout_sim.cpp).
#[cfg(feature = "cuda")]
mod fa3_layout;
/// Every forward family (FA1-FA4) and the emulator's self-tests, layout checks and mutations.
#[cfg(feature = "cuda")]
mod forward;
/// FA3 stage 5's (192, 128) instance (V head_dim unlike Q/K's): dense and serving launches.
#[cfg(feature = "cuda")]
mod head_dim_v_fa3;
/// FA2's head_dim 512 instance: prefill and decode (split-KV through the combine, paged caches).
#[cfg(feature = "cuda")]
mod head_dim_512;
/// FA2 with V's head dim below Q/K's (DeepSeek's MLA (192, 128) and (576, 512)): prefill,
/// decode through the combine kernel, the append, mutations.
#[cfg(feature = "cuda")]
mod head_dim_v;
/// The FP8 pre-pass and consumers bit for bit against the CPU oracle, and FA3's FP8 accuracy.
#[cfg(all(feature = "cuda", feature = "bench"))]
mod fp8;
/// The rotary embedding, cache_batch_idx and cache_leftpad in the append kernel, FA2 and FA3.
#[cfg(feature = "cuda")]
mod kvcache_rotary;
/// The hang-check wait policy and report text on the host, with a fake clock.
mod hang_check;
/// The header build.rs generates for the kernels holds exactly the Rust constants.
mod numerics_header;
/// Attention sinks in FA1, FA2, FA3 and FA4 (dense), and in FA1's and FA2's serving and split-KV
/// launches.
#[cfg(feature = "cuda")]
mod sinks;
/// FA1 on the serving layouts, split-KV through the combine kernel.
#[cfg(feature = "cuda")]
mod serving_fa1;
/// FA2 on the serving layouts: varlen, caches, pages, split-KV, the KV append kernel.
#[cfg(feature = "cuda")]
mod serving_fa2;
/// The FP8 (e4m3) KV cache: FA2 reading dense and paged caches, the append quantising into one.
#[cfg(feature = "cuda")]
mod fp8_kv_cache;
/// FA3 stages 3-5 on the serving layouts.
#[cfg(feature = "cuda")]
mod serving_fa3;

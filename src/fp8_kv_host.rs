//! The host buffers of an FP8 KV cache as the GPU path uploads them, below both the serving
//! API that fills them and the CUDA host path that reads them.

/// An FP8 KV cache's host buffers for a serving call on the GPU: e4m3 codes (contiguous, of the
/// k/v views' shape) and f32 scales, `[1]` each or with `per_token` one per (slot, kv head).
#[derive(Clone, Copy, Debug)]
// A CPU-only build fills it and hands it to a path that refuses the GPU unread.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Fp8Host<'a> {
    pub k: &'a [u8],
    pub v: &'a [u8],
    pub k_scales: &'a [f32],
    pub v_scales: &'a [f32],
    pub per_token: bool,
}

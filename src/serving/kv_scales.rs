//! The scales of an FP8 KV cache: a code `c` with scale `s` stands for `e4m3(c) · s`.

/// The scales of an FP8 cache.
#[derive(Clone, Copy, Debug)]
pub enum KvScales<'a> {
    /// One scale for all of K and one for all of V.
    PerTensor { k: f32, v: f32 },
    /// One scale per (slot, kv head), laid out as the cache without head_dim: `[batch,
    /// capacity, heads_kv]` (dense) or `[num_blocks, page_size, heads_kv]` (paged).
    PerTokenHead { k: &'a [f32], v: &'a [f32] },
}

/// The scales of an FP8 cache this call may write: per (slot, kv head) scales are set for the
/// rows it appends.
#[derive(Debug)]
pub enum KvScalesMut<'a> {
    /// One scale for all of K and one for all of V, fixed by the caller.
    PerTensor { k: f32, v: f32 },
    /// One scale per (slot, kv head), laid out as [`KvScales::PerTokenHead`].
    PerTokenHead { k: &'a mut [f32], v: &'a mut [f32] },
}

impl KvScalesMut<'_> {
    pub(super) fn reborrow(&self) -> KvScales<'_> {
        match self {
            KvScalesMut::PerTensor { k, v } => KvScales::PerTensor { k: *k, v: *v },
            KvScalesMut::PerTokenHead { k, v } => KvScales::PerTokenHead { k, v },
        }
    }
}

//! The sequence offsets of a variable-length batch.

/// The sequence offsets of a variable-length batch (FlashAttention's `cu_seqlens_q`,
/// `cu_seqlens_k`, `max_seqlen_q`, `max_seqlen_k`).
#[derive(Clone, Copy, Debug)]
pub struct Varlen<'a> {
    /// `batch + 1` offsets into q's rows: sequence `b` is rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]`.
    pub cu_seqlens_q: &'a [i32],
    /// `batch + 1` offsets into k's and v's rows.
    pub cu_seqlens_k: &'a [i32],
    /// At least the longest query sequence.
    pub max_seqlen_q: usize,
    /// At least the longest key sequence.
    pub max_seqlen_k: usize,
}

//! The online softmax's running state of one query row, shared by the scalar verbs
//! ([`super::softmax`]) and the AVX-512 ones ([`super::simd`]).

/// Running state of one query row.
#[derive(Clone, Copy, Debug)]
pub struct RowState {
    /// Running max (log2 units), possibly stale under lazy rescaling.
    pub m: f32,
    /// Running sum of `exp2(s - m + offset)`.
    pub l: f32,
}

impl RowState {
    pub const EMPTY: RowState = RowState { m: f32::NEG_INFINITY, l: 0.0 };
}

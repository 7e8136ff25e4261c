//! Typed errors. Every message says what was given and what was expected.

use std::fmt;

/// Which of the three attention inputs an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    Q,
    K,
    V,
    /// The caller-provided output buffer, or the forward output given to the backward.
    O,
    /// The gradient of the output, given to the backward.
    DO,
}

impl fmt::Display for Operand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Operand::Q => "q",
            Operand::K => "k",
            Operand::V => "v",
            Operand::O => "o",
            Operand::DO => "d_o",
        })
    }
}

/// Everything `flash_attn` can refuse or fail with.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A tensor's shape does not match what the others imply.
    ShapeMismatch { what: String, got: String, expected: String },
    /// q, k and v (or the output buffer) have different element types.
    DTypeMismatch { operand: Operand, got: crate::DType, expected: crate::DType },
    /// A dimension is zero.
    EmptyDimension { operand: Operand, dim: &'static str },
    /// heads_q is not a multiple of heads_kv (GQA/MQA needs it).
    HeadsNotDivisible { heads_q: usize, heads_kv: usize },
    /// The head dimension is not supported by the chosen backend or kernel.
    UnsupportedHeadDim { head_dim: usize, backend: String, supported: String },
    /// The element type is not supported by the chosen backend or kernel.
    UnsupportedDType { dtype: crate::DType, backend: String, supported: String },
    /// Strides or buffer length do not describe valid memory for the shape.
    InvalidLayout { operand: Operand, reason: String },
    /// The softmax scale is NaN, infinite, not positive, below [`crate::MIN_SOFTMAX_SCALE`], or so
    /// large that `scale * log2(e)` overflows f32.
    InvalidSoftmaxScale(f32),
    /// A window bound below -1 (-1 means unbounded).
    NegativeWindow { side: &'static str, value: i64 },
    /// A window that contradicts another option (e.g. causal with a positive right window).
    InconsistentWindow(String),
    /// The softcap is NaN, infinite, not positive, or subnormal (its reciprocal overflows f32).
    InvalidSoftcap(f32),
    /// The ALiBi slope list does not have one entry per query head, holds a non-finite slope, or
    /// a slope whose bias at the largest query-key distance overflows f32.
    InvalidAlibi { got: usize, expected: usize, reason: String },
    /// An option value outside its documented range (FP8 block size, exp2 degree, ...).
    InvalidOption { option: &'static str, got: String, expected: String },
    /// The requested backend is not available on this machine or build.
    BackendUnavailable { backend: String, reason: String },
    /// The requested kernel variant cannot run here.
    VariantUnavailable { variant: crate::Variant, reason: String },
    /// A size overflows `usize` or the address space, an allocation failed, or a problem exceeds
    /// a kernel's limits. `what` names the object and its size.
    TooLarge { what: String },
    /// A sequence-layout argument of the varlen / paged / KV-cache API is malformed: `cu_seqlens`,
    /// `block_table`, `cache_seqlens`, page size, max seqlens, cache capacity (docs/serving.md).
    InvalidSeqLayout { what: String, got: String, expected: String },
    /// A quantisation scale (an FP8 KV cache's, docs/serving.md) is not a finite number > 0.
    InvalidScale { what: String, got: String, expected: String },
    /// A CUDA driver call failed.
    Cuda { call: String, message: String },
    /// A stream of another CUDA context than the engine's, or a device tensor bound to another
    /// stream than the one the launch is enqueued on.
    StreamMismatch { what: String, got: String, expected: String },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::ShapeMismatch { what, got, expected } => {
                write!(f, "shape mismatch for {what}: got {got}, expected {expected}")
            }
            Error::DTypeMismatch { operand, got, expected } => write!(
                f,
                "dtype mismatch: {operand} is {got:?}, expected {expected:?} (the dtype of q)"
            ),
            Error::EmptyDimension { operand, dim } => {
                write!(f, "{operand} has a zero-sized {dim}; every dimension must be at least 1")
            }
            Error::HeadsNotDivisible { heads_q, heads_kv } => write!(
                f,
                "heads_q = {heads_q} is not a multiple of heads_kv = {heads_kv}; GQA/MQA needs heads_q % heads_kv == 0"
            ),
            Error::UnsupportedHeadDim { head_dim, backend, supported } => write!(
                f,
                "head_dim {head_dim} is not supported by {backend}; supported: {supported}"
            ),
            Error::UnsupportedDType { dtype, backend, supported } => {
                write!(f, "dtype {dtype:?} is not supported by {backend}; supported: {supported}")
            }
            Error::InvalidLayout { operand, reason } => write!(f, "invalid layout for {operand}: {reason}"),
            Error::InvalidSoftmaxScale(s) => write!(
                f,
                "softmax scale {s:e} is invalid; expected a value in [2^-120, f32::MAX / log2(e)] \
                 (scale * log2(e) must be a finite f32; the default is 1 / sqrt(head_dim))"
            ),
            Error::NegativeWindow { side, value } => write!(
                f,
                "window {side} = {value} is invalid; expected >= 0, or -1 for unbounded"
            ),
            Error::InconsistentWindow(why) => write!(f, "inconsistent window: {why}"),
            Error::InvalidSoftcap(c) => write!(
                f,
                "softcap {c:e} is invalid; expected a finite value >= f32::MIN_POSITIVE (a normal f32 > 0, \
                 so that 1 / softcap is finite)"
            ),
            Error::InvalidAlibi { got, expected, reason } => write!(
                f,
                "invalid ALiBi slopes ({reason}): got {got} slopes, expected {expected} (one per query head), \
                 each finite with |slope| * (max(seqlen_q, seqlen_k) - 1) <= f32::MAX"
            ),
            Error::InvalidOption { option, got, expected } => {
                write!(f, "option {option} = {got} is invalid; expected {expected}")
            }
            Error::BackendUnavailable { backend, reason } => {
                write!(f, "backend {backend} is not available: {reason}")
            }
            Error::VariantUnavailable { variant, reason } => {
                write!(f, "kernel variant {variant:?} is not available: {reason}")
            }
            Error::TooLarge { what } => write!(f, "too large: {what}"),
            Error::InvalidSeqLayout { what, got, expected } => {
                write!(f, "invalid {what}: got {got}, expected {expected}")
            }
            Error::InvalidScale { what, got, expected } => {
                write!(f, "invalid scale {what}: got {got}, expected {expected}")
            }
            Error::Cuda { call, message } => write!(f, "CUDA error in {call}: {message}"),
            Error::StreamMismatch { what, got, expected } => {
                write!(f, "stream mismatch for {what}: got {got}, expected {expected}")
            }
        }
    }
}

impl std::error::Error for Error {}

/// Shorthand used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

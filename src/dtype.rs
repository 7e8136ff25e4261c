//! [`DType`], the element types of q, k, v and o: named by the errors and every layer above
//! them, so it depends on nothing in the crate.

use half::{bf16, f16};

/// Element types of q, k, v and o.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Round an f32 to this type and back (the identity for F32).
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::F32 => x,
            DType::F16 => f16::from_f32(x).to_f32(),
            DType::BF16 => bf16::from_f32(x).to_f32(),
        }
    }
}

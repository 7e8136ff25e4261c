//! The kernel table (build/instances.rs) and the images build.rs compiled from it.
// Some table items serve build.rs only (image stems, the FA3 row constants).
#![allow(dead_code)]

use crate::options::Variant;

include!("../../build/instances.rs");

impl From<KernelVariant> for Variant {
    /// The public name of a table row's algorithm (the only conversion between the two).
    fn from(v: KernelVariant) -> Variant {
        match v {
            KernelVariant::Fa1 => Variant::Fa1,
            KernelVariant::Fa2 => Variant::Fa2,
            KernelVariant::Fa3 => Variant::Fa3,
            KernelVariant::Fa4 => Variant::Fa4,
        }
    }
}

/// One compiled image: a cubin (SASS) or PTX text of one (family, head_dim) for one target,
/// holding the kernels of every dtype.
#[derive(Clone, Copy, Debug)]
pub struct Image {
    pub family: &'static str,
    pub head_dim: u32,
    pub target: Target,
    pub bytes: &'static [u8],
    /// nvcc's stderr with `-Xptxas -v` (registers, shared memory, spills); empty for PTX.
    pub report: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

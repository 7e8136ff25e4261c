//! The kernel table (build/instances.rs) and the images build.rs compiled from it.
#![allow(dead_code)]

include!("../../build/instances.rs");

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

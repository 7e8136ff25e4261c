//! The CUDA backend.
pub mod kernels;
pub mod params;

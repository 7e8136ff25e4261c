//! The CUDA backend (feature `cuda`): embedded kernels, loaded through cudarc (with dynamic
//! loading under the default `cuda-dynamic-loading` feature, so the crate builds and runs with
//! no CUDA present; with the bare `cuda` feature the application's cudarc links the driver).
//!
//! | module | role |
//! |---|---|
//! | `kernels` | the one table of instances (build/instances.rs) and the images build.rs embedded |
//! | `params` | `FwdParams`, the FFI struct mirrored from `cuda/include/fa_params.h` |
//! | `device` | driver detection, contexts, compute capability, lazily loaded module cache |
//! | `dispatch` | (SM, dtype, head_dim, options, variant) -> kernel instance |
//! | `fa3`, `fa3_tma` | the FA3 stage ladder's refusals, layout checks, TMA tensor maps and launch |
//! | `fa4` | the FA4 (tcgen05, sm_100a) ladder's refusals, tensor maps and launch |
//! | `plan` | one launch as data (symbol, grid, block, smem, params, tensor-map arguments), for the CPU emulator |
//! | `engine` | the device-memory API: [`Engine`], [`DeviceTensor`], caller's stream (cudarc or raw) and output |
//! | `fa2` | the FA2 family's host-side preconditions (its launch is the generic one) |

mod device;
mod dispatch;
mod engine;
mod fa2;
mod fa3;
mod fa3_tma;
mod fa4;
#[doc(hidden)]
pub mod kernels;
pub mod params;
#[doc(hidden)]
pub mod plan;

pub use device::{device_count, driver_present, Device};
pub use engine::{DeviceLse, DeviceTensor, DeviceTensorMut, Engine};

pub(crate) use device::why_unusable;
pub(crate) use dispatch::choose;
pub(crate) use engine::{forward_host_into_typed, forward_host_typed};

//! The CUDA backend (feature `cuda`): embedded kernels, loaded through cudarc (with dynamic
//! loading under the default `cuda-dynamic-loading` feature, so the crate builds and runs with
//! no CUDA present; with the bare `cuda` feature the application's cudarc links the driver).
//!
//! | module | role |
//! |---|---|
//! | `table` | the one table of instances (build/instances.rs) and the images build.rs embedded |
//! | `select` | (SM, dtype, head_dim, options, variant, layout) -> kernel instance |
//! | `family` | `FamilyHost`, the trait each family's module implements, and the rules families share |
//! | `fa2`, `fa3`, `fa4` | the families' host rules (FA1 has none beyond its table row) |
//! | `params` | `FwdParams`, the FFI struct mirrored from `cuda/common/params.h` |
//! | `launch` | one launch as data (`LaunchPlan`), and the one kernel launch |
//! | `plan` | launch plans of a named family, for the CPU emulator |
//! | `fp8` | the Hopper FP8 pre-pass and consumer launches as data |
//! | `device` | driver detection, contexts, compute capability, lazily loaded module cache |
//! | `engine` | the device-memory API: [`Engine`], [`DeviceTensor`], caller's stream (cudarc or raw) and output |

mod device;
mod engine;
mod fa2;
mod fa3;
mod fa4;
mod family;
#[doc(hidden)]
pub mod fp8;
mod launch;
mod params;
#[doc(hidden)]
pub mod plan;
mod select;
#[doc(hidden)]
pub mod table;

pub use device::{device_count, driver_present, Device};
pub use engine::{DeviceAppend, DeviceIndex, DeviceKv, DeviceLse, DeviceTensor, DeviceTensorMut, Engine, Fp8Codes};

pub(crate) use device::why_unusable;
pub(crate) use engine::{forward_host_into_typed, forward_host_typed, serving_host_typed};
pub(crate) use select::choose;

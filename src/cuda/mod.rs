//! The CUDA backend (feature `cuda`): embedded kernels, loaded through cudarc (with dynamic
//! loading under the default `cuda-dynamic-loading` feature, so the crate builds and runs with
//! no CUDA present; with the bare `cuda` feature the application's cudarc links the driver).
//!
//! Imports go one way (tests/cpu/module_layers.rs checks it): `engine` over `plan`, `driver`,
//! `select` and `device`; those over `hosts`, the family modules, `family`, `launch`, `params`;
//! everything over `table`, which is plain data.
//!
//! | module | role |
//! |---|---|
//! | `table` | the one table of instances (build/instances.rs, plain data) and the images build.rs embedded |
//! | `select` | (SM, dtype, head_dim, options, variant, layout) -> kernel instance |
//! | `family` | `FamilyHost`, the trait each family's module implements, and the rules families share |
//! | `fa1`, `fa2`, `fa3`, `fa4`, `fp8` | the families' host rules (FA1: its serving paths) |
//! | `hosts` | the map from a row's `Pipeline` to its family's `FamilyHost` |
//! | `params` | `FwdParams`, the FFI struct mirrored from `cuda/common/params.h` |
//! | `bwd_params`, `fa2_bwd`, `fa3_bwd` | `BwdParams` (`cuda/common/bwd_params.h`) and the FA2 / FA3-style backward's launches as data (the `Engine` and the CPU emulator run the same plans) |
//! | `bwd_select` | (SM, problem, variant) -> backward kernel; `Variant::Auto` refused until a GPU run verifies them |
//! | `launch` | the launch vocabulary, data only: `LaunchPlan`, tensor-map arguments |
//! | `plan` | building `LaunchPlan`s: of a chosen instance (`Engine`), of a named family (the CPU emulator) |
//! | `driver` | the driver calls of a launch: tensor-map encoding and the one `cuLaunchKernel` |
//! | `fp8` | the Hopper FP8 pre-pass and consumer launches as data |
//! | `combine` | the combine kernel's launches as data (split-KV's second pass, device `merge_states`), the GPU split count |
//! | `device` | driver detection, contexts, compute capability, lazily loaded module cache |
//! | `engine` | the device-memory API: [`Engine`], [`DeviceTensor`], caller's stream (cudarc or raw) and output |

#[doc(hidden)]
pub mod combine;
mod device;
mod driver;
mod engine;
mod fa1;
mod fa2;
#[doc(hidden)]
pub mod fa2_bwd;
#[doc(hidden)]
pub mod fa3_bwd;
mod bwd_select;
mod fa3;
mod fa4;
mod family;
mod hosts;
#[doc(hidden)]
pub mod fp8;
mod launch;
mod params;
#[doc(hidden)]
pub mod bwd_params;
#[doc(hidden)]
pub mod plan;
mod select;
#[doc(hidden)]
pub mod table;

pub use device::{device_count, driver_present, Device};
pub use engine::{
    BackwardGrads, BackwardInputs, DeviceAppend, DeviceFp8Cache, DeviceIndex, DeviceKv, DeviceKvScales, DeviceLse, DeviceRotary,
    DeviceLseRef, DeviceTensor,
    DeviceTensorMut, Engine, Fp8Codes,
};

pub(crate) use device::why_unusable;
pub(crate) use engine::{backward_host_into_typed, forward_host_into_typed, forward_host_typed, serving_host_typed, HostAppend};
pub(crate) use select::choose;

//! The device-memory API for engines: borrowed device tensors, the caller's stream (a cudarc
//! `CudaStream` of any `Arc` of the same context, e.g. candle's, or a raw `CUstream` for
//! engines that do not use cudarc), output into a caller-provided buffer. After the first call
//! of a given kernel (module load) and of a given ALiBi slope set or sink list (one asynchronous
//! upload on the caller's stream, or [`Engine::prepare_alibi`] beforehand), `Engine::launch` allocates
//! nothing and never synchronizes: it validates, picks the kernel (a table lookup) and enqueues
//! one launch, so it can be captured in a CUDA graph.
//!
//! ```no_run
//! # fn main() -> flash_attn::Result<()> {
//! use flash_attn::cuda::{DeviceTensor, DeviceTensorMut, Engine};
//! use flash_attn::ForwardOptions;
//! use half::bf16;
//! let engine = Engine::new(0)?;
//! let stream = engine.device().default_stream();
//! let shape = [1, 128, 8, 64];
//! let n = shape.iter().product::<usize>();
//! let q = stream.clone_htod(&vec![bf16::ONE; n]).unwrap();
//! let (k, v) = (q.clone(), q.clone());
//! let mut o = stream.alloc_zeros::<bf16>(n).unwrap();
//! engine.forward(
//!     &stream,
//!     &DeviceTensor::new(&q, &stream, shape),
//!     &DeviceTensor::new(&k, &stream, shape),
//!     &DeviceTensor::new(&v, &stream, shape),
//!     &mut DeviceTensorMut::new(&mut o, &stream, shape),
//!     None,
//!     &ForwardOptions::default().causal(true),
//! )?;
//! # Ok(()) }
//! ```
//!
//! | file | role |
//! |---|---|
//! | `tensors` | the borrowed device buffers and their checks |
//! | `handle` | [`Engine`]: device, dispatch, stream checks, ALiBi slopes on the device |
//! | `forward` | `forward`, `launch`, `launch_raw`, `launch_fp8_codes_raw` |
//! | `backward` | `backward`, `backward_dispatch`: the FA2 / FA3-style backward kernels |
//! | `merge` | `merge_states`, `merge_states_n` |
//! | `serving` | `serving`, `launch_serving_raw`, the device index and KV types |
//! | `host` | host-memory problems through an engine (`crate::forward`, `crate::backward` on the GPU) |

mod backward;
mod forward;
mod handle;
mod host;
mod merge;
mod serving;
mod tensors;

pub use handle::Engine;
pub use backward::{BackwardGrads, BackwardInputs};
pub(crate) use host::{backward_host_into_typed, forward_host_into_typed, forward_host_typed};
pub use serving::{DeviceAppend, DeviceFp8Cache, DeviceIndex, DeviceKv, DeviceKvScales, DeviceRotary};
pub(crate) use serving::{serving_host_typed, HostAppend};
pub use tensors::{DeviceLse, DeviceLseRef, DeviceTensor, DeviceTensorMut, Fp8Codes};

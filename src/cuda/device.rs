//! CUDA devices: driver detection, contexts, compute capability, and a lazily loaded cache of
//! the embedded kernel images per context. Every CUDA status becomes [`Error::Cuda`].

use super::table::{Family, Image, Standalone, Target, Tile, IMAGES, STANDALONE_HEAD_DIM, WHY_NO_KERNELS};
use crate::error::{Error, Result};
use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex, OnceLock};

/// The default dynamic shared memory limit; more needs the per-function opt-in attribute.
const DEFAULT_SMEM_LIMIT: u32 = 48 * 1024;

/// Turns a driver status into [`Error::Cuda`], naming the call.
pub(crate) fn cuda_err(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda { call: call.into(), message: format!("{e:?}") }
}

/// Whether the CUDA driver library can be called.
///
/// With the `cuda-dynamic-loading` feature (the default) cudarc loads libcuda at the first call
/// and panics when it is missing, so this looks for it first. With the bare `cuda` feature the
/// application chose cudarc's linking mode (candle: `dynamic-linking`): the driver is linked
/// into the process, so it is present whenever the process runs. An application that uses
/// cudarc's dynamic loading with the bare feature should enable `cuda-dynamic-loading` too, so a
/// machine without a driver is reported instead of reaching cudarc's panic.
pub fn driver_present() -> bool {
    #[cfg(feature = "cuda-dynamic-loading")]
    {
        // SAFETY: is_culib_present only tries to dlopen libcuda; it has no preconditions.
        unsafe { sys::is_culib_present() }
    }
    #[cfg(not(feature = "cuda-dynamic-loading"))]
    {
        true
    }
}

/// Why no CUDA device can be used, or `None` when the driver is present and kernels were built.
pub(crate) fn why_unusable() -> Option<String> {
    if IMAGES.is_empty() {
        return Some(format!("no CUDA kernels were built into this crate ({WHY_NO_KERNELS})"));
    }
    if !driver_present() {
        return Some("no CUDA driver (libcuda.so) was found".into());
    }
    None
}

/// The number of CUDA devices (0 when the driver is missing or has none).
pub fn device_count() -> usize {
    // Checked first because every other driver call panics without libcuda.
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)
}

/// The best image of (family, head_dim) among `images` for a GPU of compute capability
/// (major, minor): its own SASS (sm_90a on 9.0, sm_100a on 10.0, sm_80 on 8.x), else the PTX.
pub(crate) fn pick_image(images: &'static [Image], family: &str, head_dim: u32, cc: (i32, i32)) -> Option<&'static Image> {
    let (major, minor) = cc;
    let of = |t: Target| images.iter().find(|i| i.family == family && i.head_dim == head_dim && i.target == t);
    [Target::Sm90a, Target::Sm100a, Target::Sm80, Target::Ptx80]
        .into_iter()
        .filter(|t| t.runs_on(major, minor))
        .find_map(of)
}

/// A loaded module, unloaded in its context when the last function of it is dropped.
#[derive(Debug)]
struct Module {
    raw: sys::CUmodule,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUmodule is a driver handle, usable from any thread once its context is current
// (every use binds it first); the driver API is thread-safe.
unsafe impl Send for Module {}
// SAFETY: as above; the handle is never mutated after the load.
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `raw` was loaded by cuModuleLoadData in `ctx` and is unloaded once, here;
            // every function of it is held through an Arc of this module, so none is used after.
            let _ = unsafe { result::module::unload(self.raw) };
        }
    }
}

/// (family, head_dim, dtype, which kernel of the image); a standalone kernel's is (name,
/// STANDALONE_HEAD_DIM, its symbol, Symbol::Standalone).
type FunctionKey = (&'static str, u32, &'static str, Symbol);

/// A function ready to launch: the kernel and its module (kept loaded).
#[derive(Clone, Debug)]
pub(crate) struct Loaded {
    pub func: sys::CUfunction,
    _module: Arc<Module>,
}

// SAFETY: a CUfunction is a driver handle into `_module`, which this value keeps loaded; it is
// only passed to cuLaunchKernel/cuFuncSetAttribute, which are thread-safe.
unsafe impl Send for Loaded {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for Loaded {}

/// One CUDA context (a device's primary context, or one an engine brought) with the kernels
/// loaded into it so far.
#[derive(Debug)]
pub struct Device {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    cc: (i32, i32),
    name: String,
    max_smem_optin: u32,
    sm_count: u32,
    /// (family, head_dim) -> loaded module, loaded at first use.
    modules: Mutex<HashMap<(&'static str, u32), Arc<Module>>>,
    /// (family, head_dim, dtype name) -> function with its shared memory attribute set.
    functions: Mutex<HashMap<FunctionKey, Loaded>>,
}

/// The devices opened on primary contexts, once per process (a primary context lives as long
/// as the process retains it, so caching it costs nothing). Contexts an engine brings are not
/// cached here: their modules go when the engine goes, and the engine's context can be destroyed.
static PRIMARY: OnceLock<Mutex<Vec<Arc<Device>>>> = OnceLock::new();

impl Device {
    /// The device with this ordinal, on its primary context, opened once per process.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] without driver, kernels or such a device;
    /// [`Error::Cuda`] when a driver call fails.
    pub fn get(ordinal: usize) -> Result<Arc<Device>> {
        let backend = || format!("cuda:{ordinal}");
        if let Some(why) = why_unusable() {
            return Err(Error::BackendUnavailable { backend: backend(), reason: why });
        }
        let map = PRIMARY.get_or_init(|| Mutex::new(Vec::new()));
        let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = map.iter().find(|d| d.ordinal == ordinal) {
            return Ok(d.clone());
        }
        let count = CudaContext::device_count().map_err(cuda_err("cuDeviceGetCount"))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::BackendUnavailable {
                backend: backend(),
                reason: format!("the driver reports {count} CUDA device(s)"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        let dev = Arc::new(Device::open(ctx)?);
        map.push(dev.clone());
        Ok(dev)
    }

    /// The device of a context an engine already holds (candle's `CudaDevice::cuda_stream()
    /// .context()`, or any `CudaContext`). A primary context is matched by its `CUcontext`
    /// handle with the one [`Device::get`] opened (cudarc hands out a fresh `Arc` for the same
    /// primary context on every `CudaContext::new`), so its loaded kernels are shared; another
    /// context gets its own module cache, released with the returned value.
    ///
    /// # Errors
    /// As [`Device::get`].
    pub fn for_context(ctx: Arc<CudaContext>) -> Result<Arc<Device>> {
        if let Some(why) = why_unusable() {
            return Err(Error::BackendUnavailable { backend: format!("cuda:{}", ctx.ordinal()), reason: why });
        }
        if ctx.is_primary() {
            let primary = Device::get(ctx.ordinal())?;
            if primary.ctx.cu_ctx() == ctx.cu_ctx() {
                return Ok(primary);
            }
        }
        Ok(Arc::new(Device::open(ctx)?))
    }

    fn open(ctx: Arc<CudaContext>) -> Result<Device> {
        let cc = ctx.compute_capability().map_err(cuda_err("cuDeviceGetAttribute(COMPUTE_CAPABILITY)"))?;
        let name = ctx.name().map_err(cuda_err("cuDeviceGetName"))?;
        let max_smem_optin = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(cuda_err("cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)"))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err("cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)"))?;
        Ok(Device {
            ordinal: ctx.ordinal(),
            ctx,
            cc,
            name,
            max_smem_optin: max_smem_optin.max(0) as u32,
            sm_count: sm_count.max(1) as u32,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    /// (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }
    /// major * 10 + minor, as `Family::min_sm`.
    pub fn sm(&self) -> u32 {
        (self.cc.0 * 10 + self.cc.1).max(0) as u32
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Largest dynamic shared memory a block may opt in to, in bytes.
    pub fn max_smem_optin(&self) -> u32 {
        self.max_smem_optin
    }
    /// Streaming multiprocessors (the size of a persistent grid).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The context's default stream (used by the host-memory `forward`).
    pub fn default_stream(&self) -> Arc<CudaStream> {
        self.ctx.default_stream()
    }

    /// The best built image of (family, head_dim) this GPU can load: its own SASS, else PTX.
    pub(crate) fn image_for(&self, family: &str, head_dim: u32) -> Option<&'static Image> {
        pick_image(IMAGES, family, head_dim, self.cc)
    }

    /// The kernel of (family, tile, dtype), loading its module at first use and opting in to
    /// its dynamic shared memory. Later calls are a hash lookup.
    pub(crate) fn function(&self, family: &'static Family, tile: &'static Tile, dtype: &'static str) -> Result<Loaded> {
        self.load(family, tile, dtype, Symbol::Forward)
    }

    /// The kernel a launch plan names: the forward, or the serving KV append kernel the
    /// `APPEND_KV_FAMILY` images hold beside it (build/instances.rs `append_kv_symbol`).
    pub(crate) fn plan_function(&self, plan: &super::launch::LaunchPlan) -> Result<Loaded> {
        let sym = if plan.append_kv { Symbol::AppendKv } else { Symbol::Forward };
        self.load(plan.family, plan.tile, plan.dtype, sym)
    }

    /// The FP8 pre-pass an FP8 family's image holds beside its forward kernel (build/instances.rs,
    /// `image_kernel_symbols`), from the same module.
    pub(crate) fn fp8_prepass_function(&self, family: &'static Family, tile: &'static Tile, dtype: &'static str) -> Result<Loaded> {
        self.load(family, tile, dtype, Symbol::Fp8Prepass)
    }

    /// A kernel of a standalone image (build/instances.rs `STANDALONE`: the combine), by symbol,
    /// loading its module at first use. It takes no dynamic shared memory.
    pub(crate) fn standalone_function(&self, row: &'static Standalone, symbol: &'static str) -> Result<Loaded> {
        self.standalone_function_smem(row, symbol, 0)
    }

    /// As [`Device::standalone_function`] for a kernel that takes `smem_bytes` of dynamic shared
    /// memory (a backward plan's launch; one size per symbol), opted in at its first load.
    pub(crate) fn standalone_function_smem(&self, row: &'static Standalone, symbol: &'static str, smem_bytes: u32) -> Result<Loaded> {
        let key = (row.name, STANDALONE_HEAD_DIM, symbol, Symbol::Standalone);
        let mut functions = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = functions.get(&key) {
            return Ok(f.clone());
        }
        let module = self.module(row.name, STANDALONE_HEAD_DIM)?;
        let func = get_function(&module, symbol.to_string())?;
        opt_in_smem(func, smem_bytes)?;
        let loaded = Loaded { func, _module: module };
        functions.insert(key, loaded.clone());
        Ok(loaded)
    }

    /// The loaded module of the image (name, head_dim), loaded at first use.
    fn module(&self, name: &'static str, head_dim: u32) -> Result<Arc<Module>> {
        let image = self.image_for(name, head_dim).ok_or_else(|| Error::BackendUnavailable {
            backend: format!("cuda:{}", self.ordinal),
            reason: if head_dim == STANDALONE_HEAD_DIM {
                format!("no {name} image loads on sm_{}", self.sm())
            } else {
                format!("no {name} image for head_dim {head_dim} loads on sm_{}", self.sm())
            },
        })?;
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = modules.get(&(name, head_dim)) {
            return Ok(m.clone());
        }
        let mut bytes = image.bytes.to_vec();
        if image.target == Target::Ptx80 {
            bytes.push(0); // cuModuleLoadData reads PTX as a NUL-terminated string
        }
        self.ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: `bytes` is a whole cubin, or PTX text with its NUL terminator, as nvcc wrote
        // it (build.rs), alive for the call (the driver copies the image).
        let raw = unsafe { result::module::load_data(bytes.as_ptr().cast()) }.map_err(cuda_err("cuModuleLoadData"))?;
        let m = Arc::new(Module { raw, ctx: self.ctx.clone() });
        modules.insert((name, head_dim), m.clone());
        Ok(m)
    }

    fn load(&self, family: &'static Family, tile: &'static Tile, dtype: &'static str, sym: Symbol) -> Result<Loaded> {
        let key = (family.name, tile.head_dim, dtype, sym);
        let mut functions = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = functions.get(&key) {
            return Ok(f.clone());
        }
        let module = self.module(family.name, tile.head_dim)?;
        let symbol = match sym {
            Symbol::Forward => super::table::kernel_symbol(family.name, tile.head_dim, dtype),
            Symbol::Fp8Prepass => super::table::fp8_prepass_symbol(tile.head_dim, dtype),
            Symbol::AppendKv => super::table::append_kv_symbol(tile.head_dim, dtype),
            Symbol::Standalone => unreachable!("standalone kernels load through standalone_function"),
        };
        let func = get_function(&module, symbol)?;
        // The pre-pass and the append take no dynamic shared memory.
        let smem_bytes = if sym == Symbol::Forward { family.smem_bytes(tile) } else { 0 };
        opt_in_smem(func, smem_bytes)?;
        let loaded = Loaded { func, _module: module };
        functions.insert(key, loaded.clone());
        Ok(loaded)
    }
}

/// Opts `func` (a function of a loaded module, its context current) in to `smem_bytes` of
/// dynamic shared memory when that is above the default limit.
fn opt_in_smem(func: sys::CUfunction, smem_bytes: u32) -> Result<()> {
    if smem_bytes > DEFAULT_SMEM_LIMIT {
        // SAFETY: `func` is a function of a loaded module (the caller's contract).
        unsafe {
            result::function::set_function_attribute(
                func,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_bytes as i32,
            )
        }
        .map_err(cuda_err("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)"))?;
    }
    Ok(())
}

/// The function `symbol` of a loaded module; its context is current (the engine binds it before
/// asking for a kernel, and `Device::module` did when it loaded the image).
fn get_function(module: &Module, symbol: String) -> Result<sys::CUfunction> {
    let c_symbol = CString::new(symbol).map_err(|e| Error::Cuda {
        call: "cuModuleGetFunction".into(),
        message: format!("kernel symbol with a NUL byte: {e}"),
    })?;
    // SAFETY: `module.raw` is loaded (the caller's Arc keeps it so) in the current context.
    unsafe { result::module::get_function(module.raw, c_symbol) }.map_err(cuda_err("cuModuleGetFunction"))
}

/// Which kernel of an image: a family's forward, FP8 pre-pass or KV append, or a standalone
/// kernel (by its symbol).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Symbol {
    Forward,
    Fp8Prepass,
    AppendKv,
    Standalone,
}

//! The bridge from host-memory `forward` to the CUDA backend. Without the `cuda` feature (or
//! without a driver, a device or built kernels) it reports why, and `Backend::Auto` runs the CPU.

use crate::error::{Error, Result};
use crate::options::ForwardOptions;
use crate::problem::Problem;
use crate::tensor::{DataMut, TensorView};

/// The device `Backend::Auto` uses for this problem, or why none (then the CPU runs).
/// Auto takes the GPU only when a kernel runs the problem there: f32 inputs, or options no
/// kernel implements, run on the CPU instead.
#[cfg(feature = "cuda")]
pub(crate) fn auto_device(p: &Problem, opts: &ForwardOptions) -> std::result::Result<usize, String> {
    use crate::cuda::{choose, device_count, why_unusable, Device};
    if let Some(why) = why_unusable() {
        return Err(why);
    }
    if device_count() == 0 {
        return Err("the CUDA driver reports no device".into());
    }
    let dev = Device::get(0).map_err(|e| e.to_string())?;
    choose(&*dev, p, opts.variant).map_err(|e| format!("no GPU kernel for this problem: {e}"))?;
    Ok(0)
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn auto_device(_p: &Problem, _opts: &ForwardOptions) -> std::result::Result<usize, String> {
    Err("the crate was built without the `cuda` feature".into())
}

/// Runs `p` on CUDA device `dev`: upload, launch, download.
#[cfg(feature = "cuda")]
pub(crate) fn forward_host(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    opts: &ForwardOptions,
    dev: usize,
) -> Result<crate::Output> {
    use crate::tensor::Data;
    let engine = crate::cuda::Engine::new(dev)?;
    match (q.data(), k.data(), v.data()) {
        (Data::F16(a), Data::F16(b), Data::F16(c)) => {
            crate::cuda::forward_host_typed(&engine, p, q, k, v, [a, b, c], opts)
        }
        (Data::BF16(a), Data::BF16(b), Data::BF16(c)) => {
            crate::cuda::forward_host_typed(&engine, p, q, k, v, [a, b, c], opts)
        }
        // f32 is refused rather than converted: a silent f32 -> f16/bf16 rounding would change
        // the numerics the caller asked for. Convert explicitly, or use Backend::Cpu.
        _ => Err(Error::UnsupportedDType {
            dtype: p.dtype,
            backend: format!("cuda:{dev}"),
            supported: "F16, BF16 (convert f32 inputs, or use Backend::Cpu)".into(),
        }),
    }
}

/// As [`forward_host`], into the caller's buffers (lengths and dtype checked by the caller).
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_host_into(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    out: DataMut<'_>,
    lse: Option<&mut [f32]>,
    opts: &ForwardOptions,
    dev: usize,
) -> Result<crate::Dispatch> {
    use crate::tensor::Data;
    let engine = crate::cuda::Engine::new(dev)?;
    match (q.data(), k.data(), v.data(), out) {
        (Data::F16(a), Data::F16(b), Data::F16(c), DataMut::F16(o)) => {
            crate::cuda::forward_host_into_typed(&engine, p, q, k, v, [a, b, c], o, lse, opts)
        }
        (Data::BF16(a), Data::BF16(b), Data::BF16(c), DataMut::BF16(o)) => {
            crate::cuda::forward_host_into_typed(&engine, p, q, k, v, [a, b, c], o, lse, opts)
        }
        _ => Err(Error::UnsupportedDType {
            dtype: p.dtype,
            backend: format!("cuda:{dev}"),
            supported: "F16, BF16 (convert f32 inputs, or use Backend::Cpu)".into(),
        }),
    }
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_host_into(
    _p: &Problem,
    _q: &TensorView,
    _k: &TensorView,
    _v: &TensorView,
    _out: DataMut<'_>,
    _lse: Option<&mut [f32]>,
    _opts: &ForwardOptions,
    dev: usize,
) -> Result<crate::Dispatch> {
    Err(Error::BackendUnavailable {
        backend: format!("cuda:{dev}"),
        reason: "the crate was built without the `cuda` feature".into(),
    })
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn forward_host(
    _p: &Problem,
    _q: &TensorView,
    _k: &TensorView,
    _v: &TensorView,
    _opts: &ForwardOptions,
    dev: usize,
) -> Result<crate::Output> {
    Err(Error::BackendUnavailable {
        backend: format!("cuda:{dev}"),
        reason: "the crate was built without the `cuda` feature".into(),
    })
}

/// Runs a serving call (varlen / KV cache, host memory) on CUDA device `dev`: upload, the FA2
/// serving launch, download (`cuda::Engine::launch_serving_raw`; with `fp8`, k and v are views
/// of the cache's shape only and the codes and scales are `fp8`'s). Compile-checked only.
#[cfg(feature = "cuda")]
pub(crate) fn serving_host(
    views: (&TensorView, &TensorView, &TensorView),
    ql: crate::batch_layout::QueryLayout<'_>,
    kl: crate::batch_layout::KvLayout<'_>,
    rows: crate::batch_layout::CacheRows<'_>,
    fp8: Option<crate::fp8_kv_host::Fp8Host<'_>>,
    opts: &ForwardOptions,
    dev: usize,
) -> Result<crate::Output> {
    use crate::tensor::Data;
    let engine = crate::cuda::Engine::new(dev)?;
    let (q, k, v) = views;
    match (q.data(), k.data(), v.data(), fp8) {
        (Data::F16(a), Data::F16(b), Data::F16(c), None) => {
            crate::cuda::serving_host_typed(&engine, views, [a, b, c], ql, kl, rows, None, None, opts).map(|(o, _)| o)
        }
        (Data::BF16(a), Data::BF16(b), Data::BF16(c), None) => {
            crate::cuda::serving_host_typed(&engine, views, [a, b, c], ql, kl, rows, None, None, opts).map(|(o, _)| o)
        }
        (Data::F16(a), _, _, Some(f)) => {
            crate::cuda::serving_host_typed(&engine, views, [a, &[], &[]], ql, kl, rows, None, Some(f), opts).map(|(o, _)| o)
        }
        (Data::BF16(a), _, _, Some(f)) => {
            crate::cuda::serving_host_typed(&engine, views, [a, &[], &[]], ql, kl, rows, None, Some(f), opts).map(|(o, _)| o)
        }
        _ => Err(unsupported_serving_dtype(q.dtype(), dev)),
    }
}

/// A KV append then attention (host memory) on CUDA device `dev`: the cache (`views.1`,
/// `views.2`: k's and v's whole buffers) uploaded, the append kernel writing `new` (k_new, v_new)
/// into it (rotating k_new and q with `rotary`: cos, sin, rotary_dim, interleaved), the attention,
/// and the cache downloaded; returns the output and the cache as the kernels left it (the caller
/// writes it back). Compile-checked only.
#[cfg(feature = "cuda")]
#[allow(clippy::type_complexity)]
pub(crate) fn serving_append_host(
    views: (&TensorView, &TensorView, &TensorView),
    new: (&TensorView, &TensorView),
    rotary: Option<(&[f32], &[f32], usize, bool)>,
    (ql, kl, rows): (crate::batch_layout::QueryLayout<'_>, crate::batch_layout::KvLayout<'_>, crate::batch_layout::CacheRows<'_>),
    opts: &ForwardOptions,
    dev: usize,
) -> Result<(crate::Output, crate::tensor::OwnedData, crate::tensor::OwnedData)> {
    use crate::cuda::HostAppend;
    use crate::tensor::{Data, OwnedData};
    let engine = crate::cuda::Engine::new(dev)?;
    let (q, k, v) = views;
    let (kn, vn) = new;
    let no_cache = || Error::BackendUnavailable {
        backend: format!("cuda:{dev}"),
        reason: "the append launch returned no cache".into(),
    };
    match (q.data(), k.data(), v.data(), kn.data(), vn.data()) {
        (Data::F16(a), Data::F16(b), Data::F16(c), Data::F16(d), Data::F16(e)) => {
            let app = HostAppend { k_new: (kn, d), v_new: (vn, e), rotary };
            let (o, cache) = crate::cuda::serving_host_typed(&engine, views, [a, b, c], ql, kl, rows, Some(app), None, opts)?;
            let (ck, cv) = cache.ok_or_else(no_cache)?;
            Ok((o, OwnedData::F16(ck), OwnedData::F16(cv)))
        }
        (Data::BF16(a), Data::BF16(b), Data::BF16(c), Data::BF16(d), Data::BF16(e)) => {
            let app = HostAppend { k_new: (kn, d), v_new: (vn, e), rotary };
            let (o, cache) = crate::cuda::serving_host_typed(&engine, views, [a, b, c], ql, kl, rows, Some(app), None, opts)?;
            let (ck, cv) = cache.ok_or_else(no_cache)?;
            Ok((o, OwnedData::BF16(ck), OwnedData::BF16(cv)))
        }
        _ => Err(unsupported_serving_dtype(q.dtype(), dev)),
    }
}

#[cfg(feature = "cuda")]
fn unsupported_serving_dtype(dtype: crate::DType, dev: usize) -> Error {
    Error::UnsupportedDType {
        dtype,
        backend: format!("cuda:{dev}"),
        supported: "F16, BF16 (convert f32 inputs, or use Backend::Cpu)".into(),
    }
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn serving_host(
    _views: (&TensorView, &TensorView, &TensorView),
    _ql: crate::batch_layout::QueryLayout<'_>,
    _kl: crate::batch_layout::KvLayout<'_>,
    _rows: crate::batch_layout::CacheRows<'_>,
    _fp8: Option<crate::fp8_kv_host::Fp8Host<'_>>,
    _opts: &ForwardOptions,
    dev: usize,
) -> Result<crate::Output> {
    Err(Error::BackendUnavailable {
        backend: format!("cuda:{dev}"),
        reason: "the crate was built without the `cuda` feature".into(),
    })
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::type_complexity)]
pub(crate) fn serving_append_host(
    _views: (&TensorView, &TensorView, &TensorView),
    _new: (&TensorView, &TensorView),
    _rotary: Option<(&[f32], &[f32], usize, bool)>,
    _layouts: (crate::batch_layout::QueryLayout<'_>, crate::batch_layout::KvLayout<'_>, crate::batch_layout::CacheRows<'_>),
    _opts: &ForwardOptions,
    dev: usize,
) -> Result<(crate::Output, crate::tensor::OwnedData, crate::tensor::OwnedData)> {
    Err(Error::BackendUnavailable {
        backend: format!("cuda:{dev}"),
        reason: "the crate was built without the `cuda` feature".into(),
    })
}

/// A host-memory backward on CUDA device `dev` (an explicit variant): upload, the backward
/// launches (`cuda::Engine::backward`), download into `out` and `d_sinks` (contiguous, lengths
/// checked by the caller). Compile-checked only.
#[cfg(feature = "cuda")]
pub(crate) fn backward_host_into(
    views: [&TensorView; 5],
    lse: &[f32],
    out: (DataMut<'_>, DataMut<'_>, DataMut<'_>),
    d_sinks: Option<&mut [f32]>,
    opts: &ForwardOptions,
    dev: usize,
) -> Result<crate::Dispatch> {
    use crate::tensor::Data;
    let engine = crate::cuda::Engine::new(dev)?;
    let [q, k, v, o, d_o] = views;
    match ([q.data(), k.data(), v.data(), o.data(), d_o.data()], out) {
        ([Data::F16(a), Data::F16(b), Data::F16(c), Data::F16(d), Data::F16(e)], (DataMut::F16(x), DataMut::F16(y), DataMut::F16(z))) => {
            crate::cuda::backward_host_into_typed(&engine, views, [a, b, c, d, e], lse, (x, y, z), d_sinks, opts)
        }
        (
            [Data::BF16(a), Data::BF16(b), Data::BF16(c), Data::BF16(d), Data::BF16(e)],
            (DataMut::BF16(x), DataMut::BF16(y), DataMut::BF16(z)),
        ) => crate::cuda::backward_host_into_typed(&engine, views, [a, b, c, d, e], lse, (x, y, z), d_sinks, opts),
        _ => Err(Error::UnsupportedDType {
            dtype: q.dtype(),
            backend: format!("cuda:{dev}"),
            supported: "F16, BF16 (convert f32 inputs, or run the CPU backward)".into(),
        }),
    }
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn backward_host_into(
    _views: [&TensorView; 5],
    _lse: &[f32],
    _out: (DataMut<'_>, DataMut<'_>, DataMut<'_>),
    _d_sinks: Option<&mut [f32]>,
    _opts: &ForwardOptions,
    dev: usize,
) -> Result<crate::Dispatch> {
    Err(Error::BackendUnavailable {
        backend: format!("cuda:{dev}"),
        reason: "the crate was built without the `cuda` feature".into(),
    })
}

/// The device an explicit-variant backward with `Backend::Auto` runs on, or why none.
#[cfg(feature = "cuda")]
pub(crate) fn any_device() -> std::result::Result<usize, String> {
    use crate::cuda::{device_count, why_unusable};
    if let Some(why) = why_unusable() {
        return Err(why);
    }
    if device_count() == 0 {
        return Err("the CUDA driver reports no device".into());
    }
    Ok(0)
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn any_device() -> std::result::Result<usize, String> {
    Err("the crate was built without the `cuda` feature".into())
}

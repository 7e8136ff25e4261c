//! The serving entry point of [`Engine`] on device memory (docs/serving.md "Device API"):
//! varlen, dense or paged KV caches, the KV append. Compile-checked only: the kernels it
//! launches ran in the emulator (tests/emulator/serving_fa2.rs), this launch path has not run on a
//! GPU.
//!
//! Index arrays come as [`DeviceIndex`]: the device address a kernel reads and a host mirror of
//! the same contents, from which the call is validated exactly as the CPU API validates it
//! (`BatchLayout::new`), with no device copy and no synchronisation.

use super::handle::Engine;
use super::tensors::{check_stream, stream_id, DeviceLse, DeviceTensor, DeviceTensorMut, MAX_GRID_YZ, MAX_SEQLEN};
use crate::cuda::device::cuda_err;
use crate::cuda::combine;
use crate::cuda::driver::{launch, launch_combine};
use crate::cuda::hosts::family_host;
use crate::cuda::params::{Fp8CacheScales, FwdParams, Operands, RotaryOperands, ServingOperands};
use crate::cuda::plan::{plan_append, plan_instance};
use crate::cuda::select;
use crate::error::{Error, Operand, Result};
use crate::options::{ForwardOptions, Precision, Variant};
use crate::problem::Problem;
use crate::output::Dispatch;
use crate::batch_layout::{check_distinct_cache_rows, BatchLayout, CacheRows, KvLayout, QueryLayout};
use crate::rotary_positions;
use crate::tensor::{check_extent, DType, Shape};
use cudarc::driver::{result, sys};

/// An i32 index array of a serving call (`cu_seqlens`, `cache_seqlens`, `block_table`) as the
/// kernels read it: its device address, with a host mirror of the same contents that the call
/// is validated against.
#[derive(Clone, Copy, Debug)]
pub struct DeviceIndex<'a> {
    host: &'a [i32],
    ptr: u64,
}

impl<'a> DeviceIndex<'a> {
    /// # Safety
    /// `ptr` is a device address of the engine's context holding `host.len()` i32 equal to
    /// `host`, alive and unchanged until the launches that read it have run.
    pub unsafe fn from_raw(host: &'a [i32], ptr: u64) -> Self {
        DeviceIndex { host, ptr }
    }
}

/// Where each sequence's keys are, for [`Engine::launch_serving_raw`] (the device form of
/// [`KvLayout`]).
#[derive(Clone, Copy, Debug)]
pub enum DeviceKv<'a> {
    /// k, v packed `[1, total_k, heads_kv, head_dim]` (v: its own head_dim, as below).
    Varlen { cu_seqlens: DeviceIndex<'a>, max_seqlen: usize },
    /// k, v caches `[batch, capacity, heads_kv, head_dim]` holding `seqlens[b]` keys; with
    /// `batch_idx` sequence b uses cache row `batch_idx[b]` (the cache may have more rows), with
    /// `leftpad` its keys start at position `leftpad[b]` (FlashAttention's `cache_batch_idx`,
    /// `cache_leftpad`; `serving::KvCache` says how masks and ALiBi count them).
    Cache { seqlens: DeviceIndex<'a>, batch_idx: Option<DeviceIndex<'a>>, leftpad: Option<DeviceIndex<'a>> },
    /// k, v paged `[num_blocks, page_size, heads_kv, head_dim]` through `block_table`
    /// `[batch, max_blocks_per_seq]`.
    Paged { seqlens: DeviceIndex<'a>, block_table: DeviceIndex<'a>, max_blocks_per_seq: usize },
}

/// The rows a call appends to a cache before attending (the write half of
/// `flash_attn_with_kvcache(k=, v=)`): `[batch, seqlen_new, heads_kv, head_dim]` each (v_new
/// with v's head_dim), with an optional rotary embedding of k_new and q.
#[derive(Clone, Copy, Debug)]
pub struct DeviceAppend<'t, 'a> {
    pub k_new: &'t DeviceTensor<'a>,
    pub v_new: &'t DeviceTensor<'a>,
    pub rotary: Option<DeviceRotary>,
}

/// The rotary embedding of an append on device memory (`rotary_cos`, `rotary_sin`,
/// `rotary_interleaved` of `flash_attn_with_kvcache`; `serving::Rotary` on the host): f32 tables
/// `[seqlen_ro, rotary_dim / 2]`, row-major. The append kernel rotates k_new's row i to cache
/// position `seqlens[b] + i` as it writes it, and q into stream-ordered scratch that the attention
/// reads (row i at `seqlens[b] + i` under a causal or local mask, else every row at
/// `seqlens[b]`); the caller's q is not changed.
#[derive(Clone, Copy, Debug)]
pub struct DeviceRotary {
    cos: u64,
    sin: u64,
    seqlen_ro: usize,
    rotary_dim: usize,
    interleaved: bool,
}

impl DeviceRotary {
    /// Tables of `seqlen_ro` rows of `rotary_dim / 2` f32 at `cos` and `sin`; `interleaved` pairs
    /// features `(2t, 2t + 1)`, else `(t, t + rotary_dim / 2)`.
    ///
    /// # Safety
    /// `cos` and `sin` are device addresses of the engine's context, each holding `seqlen_ro *
    /// (rotary_dim / 2)` f32, alive and unchanged until the launches that read them have run.
    pub unsafe fn from_raw(cos: u64, sin: u64, seqlen_ro: usize, rotary_dim: usize, interleaved: bool) -> Self {
        DeviceRotary { cos, sin, seqlen_ro, rotary_dim, interleaved }
    }
}

/// An FP8 (e4m3) KV cache on the device, for [`Engine::launch_serving_fp8_raw`]: contiguous
/// codes `[batch, capacity, heads_kv, head_dim]` (dense) or `[num_blocks, page_size, heads_kv,
/// head_dim]` (paged) for K and V, and their f32 scales (a code c with scale s stands for
/// e4m3(c)·s, as [`crate::serving::Fp8KvCache`]).
#[derive(Debug)]
pub struct DeviceFp8Cache<'a> {
    k: DeviceTensor<'a>,
    v: DeviceTensor<'a>,
    scales: DeviceKvScales,
}

/// The device addresses of an FP8 cache's f32 scales.
#[derive(Clone, Copy, Debug)]
pub enum DeviceKvScales {
    /// One scale each for K and V (`[1]` each).
    PerTensor { k: u64, v: u64 },
    /// One per (slot, kv head), `[batch, capacity, heads_kv]` / `[num_blocks, page_size,
    /// heads_kv]` each; an append sets the ones of the rows it writes.
    PerTokenHead { k: u64, v: u64 },
}

impl<'a> DeviceFp8Cache<'a> {
    /// # Safety
    /// `k` and `v` are device addresses of the engine's context holding `shape`'s element count
    /// of e4m3 codes each (contiguous), the scales what [`DeviceKvScales`] says; all alive and
    /// unchanged by others until the launches that use them have run (an append writes the codes
    /// and per-(slot, kv head) scales of its rows).
    pub unsafe fn from_raw(k: u64, v: u64, shape: Shape, scales: DeviceKvScales) -> Self {
        let n = shape.iter().try_fold(1usize, |a, &x| a.checked_mul(x)).unwrap_or(usize::MAX);
        // SAFETY: this function's contract; the codes' dtype is never read (FP8 is checked apart).
        let (k, v) = unsafe { (DeviceTensor::from_raw(k, n, DType::F16, shape), DeviceTensor::from_raw(v, n, DType::F16, shape)) };
        DeviceFp8Cache { k, v, scales }
    }
}

impl Engine {
    /// Serving attention on device memory, enqueued on `stream` without waiting: a packed q
    /// (`cu_seqlens_q` with `max_seqlen_q`) or a dense one, over packed k/v or a dense or paged
    /// cache (`kv`), optionally appending `append`'s rows to the cache first (the append kernel,
    /// then the attention, on the same stream). v may have a head_dim of its own (DeepSeek's
    /// MLA: the fa2v pairs (192, 128), (576, 512)); `o` has q's shape with v's head_dim; `lse` holds
    /// `[batch, heads_q, seqlen_q]` (dense q) or `[heads_q, total_q]` (packed) f32. Semantics
    /// as [`crate::serving`]'s CPU functions, validated the same way from the host mirrors.
    ///
    /// Runs on the FA2 kernels (under `Variant::Auto` a family without a serving path is passed
    /// over; `Variant::Fa1` runs FA1's). Split-KV: `opts.num_splits`, or the split heuristic on
    /// this GPU's SMs; the splits' partial states go to stream-ordered scratch, the combine
    /// kernel merges them. A dense cache may place each sequence (`DeviceKv::Cache`'s
    /// `batch_idx`, `leftpad`); with `DeviceAppend::rotary` the append kernel rotates k_new as it
    /// writes it and q into stream-ordered scratch the attention reads (the caller's q is kept).
    ///
    /// # Safety
    /// As [`Engine::launch_raw`]; the index arrays as [`DeviceIndex::from_raw`] says; with
    /// `append`, `k` and `v` are written (the caller holds them exclusively until the launches
    /// have run).
    ///
    /// # Errors
    /// The CPU API's validation errors (`Error::InvalidSeqLayout`, `ShapeMismatch`, ...),
    /// device-tensor dtype/extent/stream errors, `Error::VariantUnavailable` /
    /// `Error::InvalidOption` for what the kernels do not take, `Error::Cuda`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_serving_raw(
        &self,
        stream: sys::CUstream,
        q: &DeviceTensor,
        cu_seqlens_q: Option<(DeviceIndex, usize)>,
        k: &DeviceTensor,
        v: &DeviceTensor,
        kv: DeviceKv,
        append: Option<DeviceAppend>,
        o: &mut DeviceTensorMut,
        lse: Option<&mut DeviceLse>,
        opts: &ForwardOptions,
    ) -> Result<Dispatch> {
        // SAFETY: this function's contract.
        unsafe { self.serving_raw(stream, q, cu_seqlens_q, (k, v, None), kv, append, o, lse, opts) }
    }

    /// [`Engine::launch_serving_raw`] over an FP8 (e4m3) KV cache: `kv` a dense or paged cache
    /// layout, `append`'s rows (q's dtype) quantised into it as the CPU append quantises them
    /// (per (slot, kv head) scales set for the rows written). Runs on the FA2 kernels, or FA3's
    /// stages 3-5 under `Variant::Fa3`, which turn each K/V tile's codes into 16-bit values as
    /// they load it and apply the scales in f32; under `Variant::Auto` a family that does not
    /// read an FP8 cache (FA1) is passed over and `Dispatch::reason` says so.
    ///
    /// # Safety
    /// As [`Engine::launch_serving_raw`] and [`DeviceFp8Cache::from_raw`].
    ///
    /// # Errors
    /// As [`Engine::launch_serving_raw`]; packed k/v are an `Error::InvalidSeqLayout` (an FP8
    /// cache is a dense or paged cache), head dims the chosen family lacks
    /// `Error::VariantUnavailable`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_serving_fp8_raw(
        &self,
        stream: sys::CUstream,
        q: &DeviceTensor,
        cu_seqlens_q: Option<(DeviceIndex, usize)>,
        cache: &DeviceFp8Cache,
        kv: DeviceKv,
        append: Option<DeviceAppend>,
        o: &mut DeviceTensorMut,
        lse: Option<&mut DeviceLse>,
        opts: &ForwardOptions,
    ) -> Result<Dispatch> {
        let scales = match cache.scales {
            DeviceKvScales::PerTensor { k, v } => Fp8CacheScales { k, v, per_token: false },
            DeviceKvScales::PerTokenHead { k, v } => Fp8CacheScales { k, v, per_token: true },
        };
        // SAFETY: this function's contract.
        unsafe { self.serving_raw(stream, q, cu_seqlens_q, (&cache.k, &cache.v, Some(scales)), kv, append, o, lse, opts) }
    }

    /// The one body of [`Engine::launch_serving_raw`] and [`Engine::launch_serving_fp8_raw`]
    /// (`fp8`: k, v hold e4m3 codes with these scales).
    ///
    /// # Safety
    /// As [`Engine::launch_serving_fp8_raw`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn serving_raw(
        &self,
        stream: sys::CUstream,
        q: &DeviceTensor,
        cu_seqlens_q: Option<(DeviceIndex, usize)>,
        (k, v, fp8): (&DeviceTensor, &DeviceTensor, Option<Fp8CacheScales>),
        kv: DeviceKv,
        append: Option<DeviceAppend>,
        o: &mut DeviceTensorMut,
        lse: Option<&mut DeviceLse>,
        opts: &ForwardOptions,
    ) -> Result<Dispatch> {
        // SAFETY: `stream` is a valid handle (this function's contract).
        unsafe { self.bind_raw_stream(stream) }?;
        let sid = stream_id(stream);
        let (qb, kb, vb, ob) = (&q.b, &k.b, &v.b, &o.b);
        for (op, t) in [(Operand::Q, qb), (Operand::K, kb), (Operand::V, vb), (Operand::O, ob)] {
            check_extent(op, t.shape, t.strides, t.len)?;
            check_stream(op, t.stream, sid)?;
            // An FP8 cache's k, v hold codes, not q's dtype.
            let codes = fp8.is_some() && matches!(op, Operand::K | Operand::V);
            if t.dtype != qb.dtype && !codes {
                return Err(Error::DTypeMismatch { operand: op, got: t.dtype, expected: qb.dtype });
            }
        }
        // v: k's shape with its own head_dim (d_v); o: q's shape with d_v.
        let dv = vb.shape[3];
        let want_o = [qb.shape[0], qb.shape[1], qb.shape[2], dv];
        if ob.shape != want_o || vb.shape[..3] != kb.shape[..3] {
            return Err(Error::ShapeMismatch {
                what: "o / v".into(),
                got: format!("o {:?}, v {:?}", ob.shape, vb.shape),
                expected: format!(
                    "o {want_o:?} (q's shape with v's head_dim), v [{}, {}, {}, head_dim_v] (k's shape, a head_dim of its own)",
                    kb.shape[0], kb.shape[1], kb.shape[2]
                ),
            });
        }
        let new = match &append {
            Some(a) => {
                for (op, t) in [(Operand::K, &a.k_new.b), (Operand::V, &a.v_new.b)] {
                    check_extent(op, t.shape, t.strides, t.len)?;
                    check_stream(op, t.stream, sid)?;
                    if t.dtype != qb.dtype {
                        return Err(Error::DTypeMismatch { operand: op, got: t.dtype, expected: qb.dtype });
                    }
                }
                let [b, n, hkv, d] = a.k_new.b.shape;
                if a.v_new.b.shape != [b, n, hkv, dv] || hkv != kb.shape[2] || d != kb.shape[3] {
                    return Err(Error::ShapeMismatch {
                        what: "k_new / v_new".into(),
                        got: format!("{:?} / {:?}", a.k_new.b.shape, a.v_new.b.shape),
                        expected: format!("[{b}, seqlen_new, {}, {}] / [{b}, seqlen_new, {}, {dv}]", kb.shape[2], kb.shape[3], kb.shape[2]),
                    });
                }
                if matches!(kv, DeviceKv::Varlen { .. }) {
                    return Err(Error::InvalidSeqLayout {
                        what: "append".into(),
                        got: "packed k/v".into(),
                        expected: "a dense or paged cache to append into".into(),
                    });
                }
                n
            }
            None => 0,
        };
        // The FP8 append quantises the rows as given and the FP8 cache's scales are indexed by
        // its own rows: a rotary or cache rows of their own are refused, as the CPU's FP8 cache
        // takes no cache rows either.
        if fp8.is_some() {
            let rotary = append.as_ref().is_some_and(|a| a.rotary.is_some());
            let rows = matches!(kv, DeviceKv::Cache { batch_idx: Some(_), .. } | DeviceKv::Cache { leftpad: Some(_), .. });
            if rotary || rows {
                return Err(Error::InvalidOption {
                    option: "FP8 KV cache",
                    got: if rotary { "a rotary in the append".into() } else { "cache_batch_idx / cache_leftpad".into() },
                    expected: "neither on the GPU's FP8 cache (the CPU path rotates into an FP8 cache)".into(),
                });
            }
        }
        let ql = match &cu_seqlens_q {
            Some((cu, max_seqlen)) => QueryLayout::Varlen { cu_seqlens: cu.host, max_seqlen: *max_seqlen },
            None => QueryLayout::Dense,
        };
        let kl = match &kv {
            DeviceKv::Varlen { cu_seqlens, max_seqlen } => {
                KvLayout::Varlen { cu_seqlens: cu_seqlens.host, max_seqlen: *max_seqlen }
            }
            DeviceKv::Cache { seqlens, .. } => KvLayout::Cache { seqlens: seqlens.host, new },
            DeviceKv::Paged { seqlens, block_table, max_blocks_per_seq } => KvLayout::Paged {
                block_table: block_table.host,
                max_blocks_per_seq: *max_blocks_per_seq,
                seqlens: seqlens.host,
                new,
            },
        };
        let cache_rows = match &kv {
            DeviceKv::Cache { batch_idx, leftpad, .. } => {
                CacheRows { batch_idx: batch_idx.map(|i| i.host), leftpad: leftpad.map(|i| i.host) }
            }
            _ => CacheRows::default(),
        };
        let layout = BatchLayout::with_cache_rows(ql, qb.shape, kl, kb.shape, cache_rows)?;
        if let (Some(idx), true) = (cache_rows.batch_idx, new > 0) {
            check_distinct_cache_rows(idx)?;
        }
        if let Some(a) = &append {
            if a.k_new.b.shape[0] != layout.batch() {
                return Err(Error::ShapeMismatch {
                    what: "k_new".into(),
                    got: format!("{:?}", a.k_new.b.shape),
                    expected: format!("batch {} (one row block per sequence)", layout.batch()),
                });
            }
        }
        let [_, _, hq, d] = qb.shape;
        let [_, _, hkv, _] = kb.shape;
        let (b, msq, msk) = (layout.batch(), layout.max_seqlen_q(), layout.max_seqlen_k());
        let p = layout.launch_problem_v(hq, hkv, (d, dv), qb.dtype, opts)?;
        if let Precision::Fp8 { .. } = p.precision {
            return Err(Error::InvalidOption {
                option: "precision",
                got: "Precision::Fp8".into(),
                expected: "Precision::Native on the varlen / KV-cache paths".into(),
            });
        }
        crate::problem::check_num_splits(opts)?;
        if p.heads_q > MAX_GRID_YZ || b > MAX_GRID_YZ || msq.max(msk) > MAX_SEQLEN {
            return Err(Error::TooLarge {
                what: format!("batch {b} / heads {hq} (at most {MAX_GRID_YZ}), seqlens {msq} / {msk} (at most 2^30)"),
            });
        }
        let idx = |i: Option<&DeviceIndex>| i.map_or(0, |i| i.ptr);
        let (cu_k, seqused, table) = match &kv {
            DeviceKv::Varlen { cu_seqlens, .. } => (Some(cu_seqlens), None, None),
            DeviceKv::Cache { seqlens, .. } => (None, Some(seqlens), None),
            DeviceKv::Paged { seqlens, block_table, .. } => (None, Some(seqlens), Some(block_table)),
        };
        let (batch_idx, leftpad) = match &kv {
            DeviceKv::Cache { batch_idx, leftpad, .. } => (batch_idx.as_ref(), leftpad.as_ref()),
            _ => (None, None),
        };
        // The rotary's checks (the CPU API's), before anything is enqueued.
        let rotary = match append.as_ref().and_then(|a| a.rotary) {
            Some(r) => {
                if cu_seqlens_q.is_some() {
                    return Err(Error::InvalidOption {
                        option: "rotary_cos",
                        got: "a packed q (cu_seqlens_q)".into(),
                        expected: "a dense q [batch, seqlen_q, heads_q, head_dim] (rows rotate at seqlens[b] + i)".into(),
                    });
                }
                rotary_positions::check_dim(r.rotary_dim, d)?;
                let advance = rotary_positions::q_rows_advance(opts.mask, rotary_positions::cache_capacity(kl, kb.shape));
                let seqlens = seqused.map_or(&[][..], |s| s.host);
                rotary_positions::check_covers(r.seqlen_ro, seqlens, new, msq, advance)?;
                Some((r, advance))
            }
            None => None,
        };
        let new_ptrs = append.as_ref().map_or([0, 0], |a| [a.k_new.b.ptr, a.v_new.b.ptr]);
        let new_strides = append.as_ref().map_or([[0; 3]; 2], |a| [a.k_new.b.strides, a.v_new.b.strides]);
        let mut sops = ServingOperands {
            cu_seqlens_q: idx(cu_seqlens_q.as_ref().map(|c| &c.0)),
            cu_seqlens_k: idx(cu_k),
            seqused_k: idx(seqused),
            block_table: idx(table),
            knew: new_ptrs[0],
            vnew: new_ptrs[1],
            new_strides,
            cache_batch_idx: idx(batch_idx),
            cache_leftpad: idx(leftpad),
            kv_fp8: fp8,
            ..ServingOperands::default()
        };
        let mut ops = Operands {
            ptrs: [qb.ptr, kb.ptr, vb.ptr, ob.ptr],
            strides: [qb.strides, kb.strides, vb.strides, ob.strides],
            lse: 0,
            alibi: 0,
            sinks: 0,
        };
        // A family with a serving path: under Auto, FA2 when the fastest one has none.
        let mut c = select::choose_for(&*self.dev, &p, opts.variant, &ops)?;
        let probe = FwdParams::for_serving(&p, &layout, &ops, &sops, 1)?;
        let mut passed_over = None;
        if let Some(why) = family_host(c.family).serving_refusal(c.family, c.tile, &probe) {
            if opts.variant != Variant::Auto {
                return Err(Error::VariantUnavailable { variant: opts.variant, reason: format!("{} {why}", c.family.name) });
            }
            passed_over = Some(format!("{} {why}", c.family.name));
            c = select::choose_for(&*self.dev, &p, Variant::Fa2, &ops)?;
        }
        if let Some(l) = lse {
            let need = probe.lse_rows();
            if l.b.len < need {
                return Err(Error::ShapeMismatch {
                    what: "lse buffer".into(),
                    got: format!("{} f32", l.b.len),
                    expected: format!("at least {need} f32 (the serving LSE layout, docs/serving.md)"),
                });
            }
            check_stream(Operand::O, l.b.stream, sid)?;
            ops.lse = l.b.ptr;
        }
        ops.alibi = match &p.alibi {
            Some(slopes) => self.head_list_on_device(slopes, "alibi_slopes", stream)?,
            None => 0,
        };
        ops.sinks = match &p.sinks {
            Some(sinks) => self.head_list_on_device(sinks, "sinks", stream)?,
            None => 0,
        };
        // Split-KV (flash-decoding): the caller's count, else the one heuristic on this GPU's
        // SMs (combine::gpu_num_splits). The splits write f32 partial states into stream-ordered
        // scratch; the combine kernel merges them into o and the LSE.
        let splits = match opts.num_splits {
            Some(n) => n,
            None => {
                let ctas_per_sm = (self.dev.max_smem_optin() / c.family.smem_bytes(c.tile).max(1)).max(1);
                let q_tiles = msq.div_ceil(c.tile.block_m as usize);
                combine::gpu_num_splits(self.dev.sm_count(), ctas_per_sm, b, hq, q_tiles, msk)
            }
        };
        // With a rotary, the append launch also writes q rotated into stream-ordered scratch of
        // q's shape (contiguous), which the attention reads as its q; freed on `stream` after.
        let q_rot = match rotary {
            Some(_) => {
                let bytes = qb.shape.iter().product::<usize>() * qb.dtype.size();
                // SAFETY: a stream-ordered allocation on a valid stream of the current context
                // (bound above); freed below on the same stream after the launches reading it.
                Some(unsafe { result::malloc_async(stream, bytes.max(1)) }.map_err(cuda_err("cuMemAllocAsync(rotated q)"))?)
            }
            None => None,
        };
        if let (Some((r, advance)), Some(q_rot)) = (rotary, q_rot) {
            let (cos, sin, rotary_dim, interleaved) = (r.cos, r.sin, r.rotary_dim, r.interleaved);
            sops.rotary = Some(RotaryOperands { cos, sin, rotary_dim, interleaved, q_rows_advance: advance, q_rot });
        }
        let rows = probe.lse_rows();
        let mut run = || -> Result<Option<&'static str>> {
            if new > 0 {
                let pl = plan_append(&p, &layout, &ops, &sops)?;
                launch(&self.dev.plan_function(&pl)?, stream, &pl)?;
            }
            if let Some(r) = sops.rotary {
                let [_, sq, hq, d] = qb.shape;
                (ops.ptrs[0], ops.strides[0]) = (r.q_rot, [sq * hq * d, hq * d, d]);
            }
            // The attention's parameters do not carry the rotary (the append applied it).
            let sops = ServingOperands { rotary: None, ..sops };
            // What the launch did that the family's name does not say (FA3: the K/V load path).
            if splits <= 1 || rows == 0 {
                let params = FwdParams::for_serving(&p, &layout, &ops, &sops, 1)?;
                let plan = plan_instance(c.family, c.tile, p.dtype, params, self.dev.sm_count())?;
                // An empty batch (no query rows) launches nothing.
                if plan.grid.0 > 0 && plan.grid.2 > 0 {
                    launch(&self.dev.plan_function(&plan)?, stream, &plan)?;
                }
                Ok(plan.note)
            } else {
                self.split_kv(stream, (&p, &layout, &ops, sops), &c, splits, ob.shape)?;
                Ok(None)
            }
        };
        let ran = run();
        let note = match q_rot {
            Some(q_rot) => {
                // SAFETY: `q_rot` came from cuMemAllocAsync on `stream` above; freeing it on the
                // same stream orders the free after every launch enqueued there.
                let freed = unsafe { result::free_async(q_rot, stream) }.map_err(cuda_err("cuMemFreeAsync(rotated q)"));
                ran.and_then(|n| freed.map(|()| n))?
            }
            None => ran?,
        };
        let mut d = self.record(&c, opts);
        d.reason = format!(
            "{}; serving: {} sequences{}{}{}{}{}",
            d.reason,
            b,
            passed_over.map_or(String::new(), |w| format!(" ({w}: passed over for FA2)")),
            fp8.map_or(String::new(), |s| {
                let per = if s.per_token { "per (slot, kv head)" } else { "per tensor" };
                format!(", an FP8 KV cache (e4m3 codes, scales {per}) dequantised as its tiles load")
            }),
            match (new, rotary.is_some()) {
                (0, _) => String::new(),
                (_, false) => format!(", {new} row(s) appended first (fa_append_kv)"),
                (_, true) => format!(", {new} row(s) appended first, k_new and q rotated (fa_append_kv)"),
            },
            if splits > 1 { format!(", {splits} key splits merged by the combine kernel") } else { String::new() },
            note.map_or(String::new(), |n| format!("; {n}"))
        );
        Ok(d)
    }

    /// The split-KV launches of a serving call: f32 scratch for `splits` partial states
    /// (`o_accum [splits, lse rows, d_v]`, `lse_accum [splits, lse rows]`) allocated on `stream`
    /// (stream-ordered, no synchronisation), the attention writing them, the combine kernel
    /// merging them into `ops`' o and LSE (`shape`: o's), the scratch freed on `stream` after.
    /// Validation, streams and the context are the caller's.
    fn split_kv(
        &self,
        stream: sys::CUstream,
        (p, layout, ops, mut sops): (&Problem, &BatchLayout<'_>, &Operands, ServingOperands),
        c: &select::Choice,
        splits: usize,
        shape: crate::tensor::Shape,
    ) -> Result<()> {
        let rows = FwdParams::for_serving(p, layout, ops, &sops, 1)?.lse_rows();
        let d = p.head_dim_v;
        let o_bytes = splits.checked_mul(rows).and_then(|n| n.checked_mul(d * 4));
        let Some(bytes) = o_bytes.and_then(|o| o.checked_add(splits * rows * 4)) else {
            return Err(Error::TooLarge { what: format!("split-KV scratch of {splits} splits x {rows} rows x {d}") });
        };
        let o_bytes = o_bytes.unwrap_or(0);
        // SAFETY: a stream-ordered allocation on a valid stream of the current context (the
        // caller checked both); freed below on the same stream after the launches using it.
        let scratch = unsafe { result::malloc_async(stream, bytes) }.map_err(cuda_err("cuMemAllocAsync(split-KV)"))?;
        (sops.o_accum, sops.lse_accum) = (scratch, scratch + o_bytes as u64);
        let run = || -> Result<()> {
            let params = FwdParams::for_serving(p, layout, ops, &sops, splits)?;
            let plan = plan_instance(c.family, c.tile, p.dtype, params, self.dev.sm_count())?;
            launch(&self.dev.plan_function(&plan)?, stream, &plan)?;
            let out = combine::Rows { ptr: ops.ptrs[3], strides: ops.strides[3] };
            let merge = combine::splits_plan(shape, splits, sops.o_accum, sops.lse_accum, p.dtype, out, ops.lse, ops.sinks)?;
            let f = self.dev.standalone_function(combine::row(), merge.kernel)?;
            launch_combine(&f, stream, &merge)
        };
        let ran = run();
        // SAFETY: `scratch` came from cuMemAllocAsync on `stream` above; freeing it on the same
        // stream orders the free after every launch enqueued there.
        let freed = unsafe { result::free_async(scratch, stream) }.map_err(cuda_err("cuMemFreeAsync(split-KV)"));
        ran.and(freed)
    }
}

/// A cache's k and v buffers as an append left them, downloaded.
pub(crate) type HostCache<T> = (Vec<T>, Vec<T>);

/// The append half of a host-memory serving call on the GPU: k_new and v_new (views and their
/// buffers) and the rotary, as plain tables (`cos`, `sin`, `rotary_dim`, `interleaved`).
pub(crate) struct HostAppend<'a, T> {
    pub k_new: (&'a crate::tensor::TensorView<'a>, &'a [T]),
    pub v_new: (&'a crate::tensor::TensorView<'a>, &'a [T]),
    pub rotary: Option<(&'a [f32], &'a [f32], usize, bool)>,
}

/// Runs a host-memory serving call on the GPU (the CPU API with `Backend::Cuda`): uploads q,
/// k, v (each view's whole buffer, its strides kept; with `fp8`, the FP8 cache's codes and
/// scales instead of k, v) and the index arrays, launches [`Engine::launch_serving_raw`] (or
/// [`Engine::launch_serving_fp8_raw`]), downloads o and the LSE. With `append` (16-bit caches),
/// the append kernel writes the uploaded cache (rotating with a rotary) before the attention, and
/// the cache as it left it (k's and v's whole buffers) is returned, downloaded after every launch
/// succeeded. Compile-checked only.
#[allow(clippy::too_many_arguments)]
pub(crate) fn serving_host_typed<T>(
    engine: &Engine,
    views: (&crate::tensor::TensorView, &crate::tensor::TensorView, &crate::tensor::TensorView),
    data: [&[T]; 3],
    ql: QueryLayout<'_>,
    kl: KvLayout<'_>,
    rows: CacheRows<'_>,
    append: Option<HostAppend<'_, T>>,
    fp8: Option<crate::fp8_kv_host::Fp8Host<'_>>,
    opts: &ForwardOptions,
) -> Result<(crate::output::Output, Option<HostCache<T>>)>
where
    T: crate::tensor::Element + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
{
    use cudarc::driver::{CudaSlice, DevicePtr};
    let (q, k, v) = views;
    if matches!(kl, KvLayout::Dense) {
        return Err(Error::InvalidSeqLayout {
            what: "kv layout".into(),
            got: "dense k/v".into(),
            expected: "packed k/v or a cache (dense attention is `forward`)".into(),
        });
    }
    let stream = engine.device().default_stream();
    let up = |s: &[T]| stream.clone_htod(s).map_err(cuda_err("cuMemcpyHtoDAsync"));
    let up_i32 = |s: &[i32]| stream.clone_htod(s).map_err(cuda_err("cuMemcpyHtoDAsync(index)"));
    let dq = up(data[0])?;
    // K and V on the device: the views' buffers, or the FP8 cache's codes and scales.
    enum Kv<T> {
        Views(CudaSlice<T>, CudaSlice<T>),
        Fp8(CudaSlice<u8>, CudaSlice<u8>, CudaSlice<f32>, CudaSlice<f32>, bool),
    }
    let d_kv = match fp8 {
        None => Kv::Views(up(data[1])?, up(data[2])?),
        Some(_) if append.is_some() => {
            return Err(Error::InvalidOption {
                option: "append",
                got: "rows to append into an FP8 cache on the device path".into(),
                expected: "no append on the host-memory path (an FP8 cache's append from host memory runs on the CPU)".into(),
            })
        }
        Some(f) => {
            let codes = |s: &[u8]| stream.clone_htod(s).map_err(cuda_err("cuMemcpyHtoDAsync(FP8 codes)"));
            let scales = |s: &[f32]| stream.clone_htod(s).map_err(cuda_err("cuMemcpyHtoDAsync(FP8 scales)"));
            Kv::Fp8(codes(f.k)?, codes(f.v)?, scales(f.k_scales)?, scales(f.v_scales)?, f.per_token)
        }
    };
    let d_new = match &append {
        Some(a) => Some((up(a.k_new.1)?, up(a.v_new.1)?)),
        None => None,
    };
    let up_f32 = |s: &[f32]| stream.clone_htod(s).map_err(cuda_err("cuMemcpyHtoDAsync(rotary tables)"));
    let d_tables = match append.as_ref().and_then(|a| a.rotary) {
        Some((cos, sin, ..)) => Some((up_f32(cos)?, up_f32(sin)?)),
        None => None,
    };
    // o: q's shape with v's head_dim.
    let [qb, qs, qh, _] = q.shape();
    let o_shape = [qb, qs, qh, v.shape()[3]];
    let o_len = crate::tensor::numel(o_shape, "output")?;
    let mut d_o = stream.alloc_zeros::<T>(o_len).map_err(cuda_err("cuMemAllocAsync(o)"))?;
    // The index arrays, uploaded; their host slices stay the mirrors the call is validated on.
    let (cu_q_host, max_q): (&[i32], usize) = match ql {
        QueryLayout::Varlen { cu_seqlens, max_seqlen } => (cu_seqlens, max_seqlen),
        _ => (&[], 0),
    };
    let (a_host, b_host): (&[i32], &[i32]) = match kl {
        KvLayout::Varlen { cu_seqlens, .. } => (cu_seqlens, &[]),
        KvLayout::Cache { seqlens, .. } => (seqlens, &[]),
        KvLayout::Paged { seqlens, block_table, .. } => (seqlens, block_table),
        _ => (&[], &[]),
    };
    let keep = |s: &[i32]| -> Result<Option<cudarc::driver::CudaSlice<i32>>> {
        if s.is_empty() {
            Ok(None)
        } else {
            up_i32(s).map(Some)
        }
    };
    let (d_cu_q, d_a, d_b) = (keep(cu_q_host)?, keep(a_host)?, keep(b_host)?);
    // cache_batch_idx / cache_leftpad (an empty batch reads neither: none is passed).
    let rows = CacheRows {
        batch_idx: rows.batch_idx.filter(|i| !i.is_empty()),
        leftpad: rows.leftpad.filter(|i| !i.is_empty()),
    };
    let (d_idx, d_pad) = (keep(rows.batch_idx.unwrap_or(&[]))?, keep(rows.leftpad.unwrap_or(&[]))?);
    let ptr = |s: &Option<cudarc::driver::CudaSlice<i32>>| s.as_ref().map_or(0, |s| s.device_ptr(&stream).0);
    // Probe the layout for the LSE size (the same validation the launch repeats).
    let layout = BatchLayout::with_cache_rows(ql, q.shape(), kl, k.shape(), rows)?;
    let lse_rows = match ql {
        QueryLayout::Varlen { .. } => q.shape()[2] * layout.q_rows(),
        _ => layout.batch() * q.shape()[2] * layout.q_rows(),
    };
    let mut d_lse = match opts.return_lse {
        true => Some(stream.alloc_zeros::<f32>(lse_rows.max(1)).map_err(cuda_err("cuMemAllocAsync(lse)"))?),
        false => None,
    };
    let dispatch = {
        let tq = DeviceTensor::new(&dq, &stream, q.shape()).with_strides(q.strides());
        let mut to = DeviceTensorMut::new(&mut d_o, &stream, o_shape);
        let mut tl = d_lse.as_mut().map(|l| DeviceLse::new(l, &stream));
        // SAFETY: every address below is a buffer just uploaded on `stream` from the very host
        // slices given as mirrors, alive until after the synchronize below; `stream` is the
        // engine's own default stream.
        let (cu_q, kv) = unsafe {
            let cu_q = (!cu_q_host.is_empty()).then(|| (DeviceIndex::from_raw(cu_q_host, ptr(&d_cu_q)), max_q));
            let a = DeviceIndex::from_raw(a_host, ptr(&d_a));
            let kv = match kl {
                KvLayout::Varlen { max_seqlen, .. } => DeviceKv::Varlen { cu_seqlens: a, max_seqlen },
                KvLayout::Paged { max_blocks_per_seq, .. } => DeviceKv::Paged {
                    seqlens: a,
                    block_table: DeviceIndex::from_raw(b_host, ptr(&d_b)),
                    max_blocks_per_seq,
                },
                _ => DeviceKv::Cache {
                    seqlens: a,
                    batch_idx: rows.batch_idx.map(|h| DeviceIndex::from_raw(h, ptr(&d_idx))),
                    leftpad: rows.leftpad.map(|h| DeviceIndex::from_raw(h, ptr(&d_pad))),
                },
            };
            (cu_q, kv)
        };
        let new = match (&append, &d_new) {
            (Some(a), Some((dkn, dvn))) => Some((
                DeviceTensor::new(dkn, &stream, a.k_new.0.shape()).with_strides(a.k_new.0.strides()),
                DeviceTensor::new(dvn, &stream, a.v_new.0.shape()).with_strides(a.v_new.0.strides()),
            )),
            _ => None,
        };
        let rotary = match (append.as_ref().and_then(|a| a.rotary), &d_tables) {
            (Some((cos, _, rotary_dim, interleaved)), Some((dc, ds))) => {
                let ptr = |t: &cudarc::driver::CudaSlice<f32>| t.device_ptr(&stream).0;
                // SAFETY: both tables were just uploaded on `stream` from these host slices
                // (`cos.len()` f32 each, checked equal by the caller's validation) and live
                // until after the synchronize below.
                Some(unsafe { DeviceRotary::from_raw(ptr(dc), ptr(ds), cos.len() / (rotary_dim / 2).max(1), rotary_dim, interleaved) })
            }
            _ => None,
        };
        let dev_append = new.as_ref().map(|(k_new, v_new)| DeviceAppend { k_new, v_new, rotary });
        match &d_kv {
            Kv::Views(dk, dv) => {
                let tk = DeviceTensor::new(dk, &stream, k.shape()).with_strides(k.strides());
                let tv = DeviceTensor::new(dv, &stream, v.shape()).with_strides(v.strides());
                // SAFETY: as above; with an append, k and v are the buffers just uploaded, written
                // only by this call's launches.
                unsafe {
                    engine.launch_serving_raw(stream.cu_stream(), &tq, cu_q, &tk, &tv, kv, dev_append, &mut to, tl.as_mut(), opts)?
                }
            }
            Kv::Fp8(ck, cv, sk, sv, per_token) => {
                let at = |c: &CudaSlice<u8>| c.device_ptr(&stream).0;
                let at_f32 = |c: &CudaSlice<f32>| c.device_ptr(&stream).0;
                let (sk, sv) = (at_f32(sk), at_f32(sv));
                let scales = match per_token {
                    true => DeviceKvScales::PerTokenHead { k: sk, v: sv },
                    false => DeviceKvScales::PerTensor { k: sk, v: sv },
                };
                // SAFETY: the codes and scales were just uploaded on `stream` from the cache's
                // host buffers (validated by the caller against its shape), alive until after
                // the synchronize below; nothing is appended (the cache is only read).
                unsafe {
                    let cache = DeviceFp8Cache::from_raw(at(ck), at(cv), k.shape(), scales);
                    engine.launch_serving_fp8_raw(stream.cu_stream(), &tq, cu_q, &cache, kv, None, &mut to, tl.as_mut(), opts)?
                }
            }
        }
    };
    // The cache as the append kernel left it, downloaded before the synchronize and returned only
    // after it succeeded.
    let cache = match (&append, &d_kv) {
        (Some(_), Kv::Views(dk, dv)) => {
            let (mut k_host, mut v_host) = (vec![T::default(); data[1].len()], vec![T::default(); data[2].len()]);
            stream.memcpy_dtoh(dk, &mut k_host).map_err(cuda_err("cuMemcpyDtoHAsync(k cache)"))?;
            stream.memcpy_dtoh(dv, &mut v_host).map_err(cuda_err("cuMemcpyDtoHAsync(v cache)"))?;
            Some((k_host, v_host))
        }
        _ => None,
    };
    let mut o_host = vec![T::default(); o_len];
    stream.memcpy_dtoh(&d_o, &mut o_host).map_err(cuda_err("cuMemcpyDtoHAsync(o)"))?;
    let mut lse_host = vec![0f32; lse_rows];
    if let Some(l) = &d_lse {
        if lse_rows > 0 {
            stream.memcpy_dtoh(&l.slice(0..lse_rows), &mut lse_host).map_err(cuda_err("cuMemcpyDtoHAsync(lse)"))?;
        }
    }
    // Kernel faults surface here, as an error of the synchronize.
    stream.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
    let out = crate::output::Output {
        o: crate::tensor::Tensor::from_vec(o_host, o_shape)?,
        lse: opts.return_lse.then_some(lse_host),
        dispatch,
    };
    Ok((out, cache))
}

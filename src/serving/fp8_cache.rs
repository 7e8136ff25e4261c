//! FP8 KV caches: K and V stored as e4m3 codes with f32 scales, one per tensor or one per
//! (slot, kv head), dequantised as the CPU path reads them and quantised as rows are appended
//! (docs/serving.md, "FP8 KV cache").
//!
//! A code `c` with scale `s` stands for `e4m3(c) · s`. Appending quantises each new row: with a
//! per-tensor scale, `x / s` rounded to e4m3; with per-(token, head) scales, the row's scale is
//! first set to `amax / 448` over its finite values (1 for a row of zeros), so its largest
//! magnitude lands on e4m3's largest value. In both, ±inf and values past ±448 saturate to ±448
//! and NaN stays NaN (what [`crate::numerics::quant`] does): an infinite input becomes the
//! largest value the row's scale can stand for, a NaN is read back as NaN.

use super::append::{append_slots, for_new_rows};
use super::cache_source::{cache_layout, sealed, BlockTable, KvSource};
use super::kv_scales::{KvScales, KvScalesMut};
use super::layout::{BatchLayout, CacheRows, KvLayout};
use super::rotary::Rotary;
use crate::cpu::inplace::{Fp8Kv, Fp8Rows, RowScales};
use crate::error::{Error, Operand, Result};
use crate::numerics::quant::{block_scale, encode_e4m3, finite_amax};
use crate::options::ForwardOptions;
use crate::output::Output;
use crate::tensor::{numel, Shape, TensorView};

/// An FP8 KV cache to attend over (read only): `k`, `v` are contiguous e4m3 codes
/// `[batch, capacity, heads_kv, head_dim]` (dense) or `[num_blocks, page_size, heads_kv,
/// head_dim]` (paged, with `block_table`), as [`KvCache`](super::KvCache)'s views are.
#[derive(Clone, Copy, Debug)]
pub struct Fp8KvCache<'a> {
    pub k: &'a [u8],
    pub v: &'a [u8],
    pub shape: Shape,
    pub scales: KvScales<'a>,
    /// Keys per sequence (FlashAttention's `cache_seqlens`).
    pub seqlens: &'a [i32],
    pub block_table: Option<BlockTable<'a>>,
}

/// An FP8 KV cache this call may write, for [`append_kv`](super::append_kv) and
/// [`forward_kvcache_append`](super::forward_kvcache_append): as [`Fp8KvCache`], with the codes
/// (and per (slot, kv head) scales) writable.
#[derive(Debug)]
pub struct Fp8KvCacheMut<'a> {
    pub k: &'a mut [u8],
    pub v: &'a mut [u8],
    pub shape: Shape,
    pub scales: KvScalesMut<'a>,
    /// Keys already cached per sequence; new rows go to positions `seqlens[b]..`. Not updated
    /// by the call: add the appended count yourself.
    pub seqlens: &'a [i32],
    pub block_table: Option<BlockTable<'a>>,
}

impl sealed::Read for Fp8KvCache<'_> {
    fn source(&self, new: usize) -> (KvSource<'_>, KvLayout<'_>) {
        let src = KvSource::Fp8 {
            k: self.k,
            v: self.v,
            shape: self.shape,
            scales: self.scales,
        };
        (src, cache_layout(self.seqlens, self.block_table, new))
    }
}

impl sealed::Read for Fp8KvCacheMut<'_> {
    fn source(&self, new: usize) -> (KvSource<'_>, KvLayout<'_>) {
        let src = KvSource::Fp8 {
            k: self.k,
            v: self.v,
            shape: self.shape,
            scales: self.scales.reborrow(),
        };
        (src, cache_layout(self.seqlens, self.block_table, new))
    }
}

impl sealed::Write for Fp8KvCacheMut<'_> {
    fn check_append(&self, k_new: &TensorView<'_>, v_new: &TensorView<'_>) -> Result<Vec<usize>> {
        check_buffers(self.k.len(), self.v.len(), self.shape, &self.scales.reborrow())?;
        if v_new.dtype() != k_new.dtype() {
            return Err(Error::DTypeMismatch {
                operand: Operand::V,
                got: v_new.dtype(),
                expected: k_new.dtype(),
            });
        }
        let layout = cache_layout(self.seqlens, self.block_table, k_new.seqlen());
        append_slots(self.shape, self.shape[3], layout, CacheRows::default(), k_new, v_new)
    }

    fn append_on_device(
        &mut self,
        _q: &TensorView<'_>,
        _new: (&TensorView<'_>, &TensorView<'_>),
        _rotary: Option<&Rotary<'_>>,
        _opts: &ForwardOptions,
        dev: usize,
    ) -> Result<Output> {
        Err(Error::BackendUnavailable {
            backend: format!("Cuda({dev})"),
            reason: "an append into an FP8 KV cache from host memory runs on the CPU (Backend::Auto or \
                     Backend::Cpu); on device memory, Engine::launch_serving_fp8_raw appends with the kernels"
                .into(),
        })
    }

    fn write_rows(&mut self, k_new: &TensorView<'_>, v_new: &TensorView<'_>, slots: &[usize], rotary: Option<&Rotary<'_>>) {
        let d = self.shape[3];
        let mut row = vec![0.0f32; d];
        let seqlens = self.seqlens;
        for_new_rows(k_new, slots, |b, i, h, at| {
            for (new, codes, side) in [(k_new, &mut *self.k, 0), (v_new, &mut *self.v, 1)] {
                new.read_row(b, i, h, &mut row);
                if let (Some(rot), 0) = (rotary, side) {
                    rot.rotate(&mut row, seqlens[b] as usize + i);
                }
                let scale = match &mut self.scales {
                    KvScalesMut::PerTensor { k, v } => [*k, *v][side],
                    KvScalesMut::PerTokenHead { k, v } => {
                        let s = block_scale(finite_amax(&row));
                        [&mut **k, &mut **v][side][at / d] = s;
                        s
                    }
                };
                encode_e4m3(&row, scale, &mut codes[at..at + d]);
            }
        });
    }
}

/// The rows reader of the CPU path for an FP8 source.
pub(super) fn rows<'a>(k: &'a [u8], v: &'a [u8], scales: KvScales<'a>) -> Fp8Kv<'a> {
    let (ks, vs) = match scales {
        KvScales::PerTensor { k, v } => (RowScales::One(k), RowScales::One(v)),
        KvScales::PerTokenHead { k, v } => (RowScales::PerRow(k), RowScales::PerRow(v)),
    };
    Fp8Kv {
        k: Fp8Rows { codes: k, scales: ks },
        v: Fp8Rows { codes: v, scales: vs },
    }
}

/// The buffers of an FP8 source for the GPU path (`Backend::Cuda`): a per-tensor scale as a
/// one-element slice.
pub(super) fn host<'a>(k: &'a [u8], v: &'a [u8], scales: &'a KvScales<'a>) -> crate::fp8_kv_host::Fp8Host<'a> {
    let (k_scales, v_scales, per_token) = match scales {
        KvScales::PerTensor { k, v } => (std::slice::from_ref(k), std::slice::from_ref(v), false),
        KvScales::PerTokenHead { k, v } => (*k, *v, true),
    };
    crate::fp8_kv_host::Fp8Host { k, v, k_scales, v_scales, per_token }
}

/// Checks an FP8 cache's buffers against its shape: `numel(shape)` codes each for K and V (the
/// cache is contiguous), no empty dimension but the capacity, and either two valid per-tensor
/// scales or one per (slot, kv head) for each.
pub(super) fn check_buffers(k_len: usize, v_len: usize, shape: Shape, scales: &KvScales<'_>) -> Result<()> {
    let n = numel(shape, "FP8 cache")?;
    for (op, len) in [(Operand::K, k_len), (Operand::V, v_len)] {
        if len != n {
            return Err(Error::InvalidLayout {
                operand: op,
                reason: format!(
                    "the FP8 cache holds {len} codes, but its shape {shape:?} needs {n} (an FP8 cache is contiguous)"
                ),
            });
        }
    }
    let [b, _, h, d] = shape;
    for (dim, x) in [("batch", b), ("heads", h), ("head_dim", d)] {
        if x == 0 {
            return Err(Error::EmptyDimension { operand: Operand::K, dim });
        }
    }
    match *scales {
        KvScales::PerTensor { k, v } => {
            check_scale(k, || "KvScales::PerTensor k".into())?;
            check_scale(v, || "KvScales::PerTensor v".into())
        }
        KvScales::PerTokenHead { k, v } => {
            for (side, len) in [("k", k.len()), ("v", v.len())] {
                if len != n / d {
                    return Err(Error::ShapeMismatch {
                        what: format!("KvScales::PerTokenHead {side}"),
                        got: format!("{len} scales"),
                        expected: format!("{} (one per (slot, kv head) of the cache shape {shape:?})", n / d),
                    });
                }
            }
            Ok(())
        }
    }
}

/// Checks the per (slot, kv head) scales of the rows a call reads that are already written
/// (every key of each sequence but its last `unwritten`, the rows an append is about to write).
pub(super) fn check_read_scales(layout: &BatchLayout<'_>, shape: Shape, scales: &KvScales<'_>, unwritten: usize) -> Result<()> {
    let KvScales::PerTokenHead { k, v } = *scales else {
        return Ok(());
    };
    let [_, cap, h, _] = shape;
    let mut bad = None;
    for b in 0..layout.batch() {
        let keys = layout.seqlen_k(b).saturating_sub(unwritten);
        layout.for_kv_rows(b, 0, keys, |j, outer, row| {
            for hk in 0..h {
                let at = (outer * cap + row) * h + hk;
                for (side, s) in [("k", k[at]), ("v", v[at])] {
                    if bad.is_none() && !(s.is_finite() && s > 0.0) {
                        bad = Some((side, b, j, hk, s));
                    }
                }
            }
        });
        if let Some((side, b, j, hk, s)) = bad {
            return check_scale(s, || format!("KvScales::PerTokenHead {side} of sequence {b}, key {j}, kv head {hk}"));
        }
    }
    Ok(())
}

/// A scale must be a finite number > 0: codes times it are then the values they stand for.
fn check_scale(s: f32, what: impl FnOnce() -> String) -> Result<()> {
    if s.is_finite() && s > 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidScale {
            what: what(),
            got: format!("{s:e}"),
            expected: "a finite number > 0".into(),
        })
    }
}

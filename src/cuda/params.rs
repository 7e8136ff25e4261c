//! `FwdParams`: the one FFI struct between Rust and every forward kernel, mirrored field for
//! field from `cuda/common/params.h`. Both sides assert the size and the offsets, so a change
//! on one side alone fails the build. [`Operands`]: where q, k, v, o, the LSE, the ALiBi
//! slopes and the sink logits live, from which the parameters are built.

use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::batch_layout::{BatchLayout, KvLayout, QueryLayout};
use std::mem::size_of;

/// Bits of [`FwdParams::flags`] (FA_FLAG_* in cuda/common/params.h).
pub const FLAG_RETURN_LSE: u32 = 1;
pub const FLAG_SOFTCAP: u32 = 2;
pub const FLAG_ALIBI: u32 = 4;

/// Where q, k, v, o live: device addresses and element strides of (batch, seqlen, heads), plus
/// the LSE, ALiBi and sink buffers (0: none).
#[derive(Clone, Copy, Debug)]
pub struct Operands {
    pub ptrs: [u64; 4],
    pub strides: [[usize; 3]; 4],
    pub lse: u64,
    pub alibi: u64,
    /// f32 `[heads_q]` sink logits (`Problem::sinks`), or 0.
    pub sinks: u64,
}

/// Where a serving launch's index and split buffers live (device addresses, 0: none), beside
/// [`Operands`]: the i32 arrays of the [`BatchLayout`] (`cu_seqlens_q/k`, `cache_seqlens`,
/// `block_table`), the f32 split-KV partial states, and the rows an append writes.
#[derive(Clone, Copy, Debug, Default)]
pub struct ServingOperands {
    pub cu_seqlens_q: u64,
    pub cu_seqlens_k: u64,
    /// `cache_seqlens` (i32 `[batch]`).
    pub seqused_k: u64,
    pub block_table: u64,
    /// f32 `[num_splits, lse rows, head_dim]` and `[num_splits, lse rows]` (docs/serving.md).
    pub o_accum: u64,
    pub lse_accum: u64,
    /// k_new, v_new `[batch, seqlen_new, heads_kv, head_dim]` (append) and their element strides
    /// of (batch, seqlen, heads).
    pub knew: u64,
    pub vnew: u64,
    pub new_strides: [[usize; 3]; 2],
}

/// Asserts at compile time the size of a `#[repr(C)]` parameter struct and the offset of each
/// named field: the numbers of its C header's static_asserts, plus every other offset, so that a
/// change on one side alone fails the build (and the failure names the field).
macro_rules! assert_c_layout {
    ($ty:ident, size $size:expr, { $($field:ident: $offset:literal),* $(,)? }) => {
        const _: () = {
            assert!(
                ::std::mem::size_of::<$ty>() == $size,
                concat!("size of ", stringify!($ty), " is not ", stringify!($size))
            );
            $(assert!(
                ::std::mem::offset_of!($ty, $field) == $offset,
                concat!(stringify!($ty), "::", stringify!($field), " is not at offset ", stringify!($offset))
            );)*
        };
    };
}
pub(crate) use assert_c_layout;

/// Kernel parameters, passed by value as `const __grid_constant__ FwdParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FwdParams {
    /// Device addresses. q, k, v, o: `[batch, seqlen, heads, head_dim]`, head_dim contiguous.
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    /// f32 `[batch, heads_q, seqlen_q]`, or 0.
    pub lse: u64,
    /// f32 `[heads_q]`, or 0.
    pub alibi_slopes: u64,
    /// FP8 descales (f32), or 0.
    pub q_descale: u64,
    pub k_descale: u64,
    pub v_descale: u64,
    /// Element strides of batch, seqlen and heads.
    pub q_batch_stride: i64,
    pub q_row_stride: i64,
    pub q_head_stride: i64,
    pub k_batch_stride: i64,
    pub k_row_stride: i64,
    pub k_head_stride: i64,
    pub v_batch_stride: i64,
    pub v_row_stride: i64,
    pub v_head_stride: i64,
    pub o_batch_stride: i64,
    pub o_row_stride: i64,
    pub o_head_stride: i64,
    pub batch: i32,
    pub seqlen_q: i32,
    pub seqlen_k: i32,
    pub heads_q: i32,
    pub heads_kv: i32,
    pub head_dim: i32,
    /// -1 = unbounded; causal: window_right = 0.
    pub window_left: i32,
    pub window_right: i32,
    /// Rows per FP8 scale block (0 when unused).
    pub descale_block: i32,
    /// Natural units, multiplies q·k.
    pub softmax_scale: f32,
    /// Score units to log2 units (`Problem::score_units`): softmax_scale·log2(e) for raw q·k
    /// scores; log2(e) for natural-unit scores (softcap or ALiBi on).
    pub softmax_scale_log2: f32,
    /// The cap (0 when off).
    pub softcap: f32,
    /// FLAG_* bits.
    pub flags: u32,
    pub reserved: u32,
    // ---- serving (docs/serving.md "GPU"; cuda/common/seqlen.cuh reads them): all 0 on a dense
    // launch. With any set, `batch`/`seqlen_q`/`seqlen_k` are the batch and the longest sequences.
    /// i32 `[batch + 1]`: q/o packed `[1, total_q, heads, dim]`; the LSE then `[heads_q, total_q]`.
    pub cu_seqlens_q: u64,
    /// i32 `[batch + 1]`: k/v packed `[1, total_k, heads_kv, dim]`.
    pub cu_seqlens_k: u64,
    /// i32 `[batch]`: keys cached before this call's `seqlen_new` rows (`cache_seqlens`).
    pub seqused_k: u64,
    /// i32 `[batch, block_table_batch_stride]`: k/v are paged `[num_blocks, page_size, hkv, d]`.
    pub block_table: u64,
    /// `[batch, seqlen_new, heads_kv, head_dim]`: rows the append kernel writes into the cache.
    pub knew: u64,
    pub vnew: u64,
    /// f32 `[num_splits, lse rows, head_dim]`: split-KV partial outputs (normalised per split).
    pub o_accum: u64,
    /// f32 `[num_splits, lse rows]`: their LSEs (natural log; -inf: the split saw no key).
    pub lse_accum: u64,
    pub knew_batch_stride: i64,
    pub knew_row_stride: i64,
    pub knew_head_stride: i64,
    pub vnew_batch_stride: i64,
    pub vnew_row_stride: i64,
    pub vnew_head_stride: i64,
    /// Entries per row of `block_table` (`max_blocks_per_seq`).
    pub block_table_batch_stride: i32,
    /// Keys per block (any >= 1); 0 = not paged.
    pub page_size: i32,
    /// Key splits; 0 or 1 = none.
    pub num_splits: i32,
    /// Rows appended per sequence by this call.
    pub seqlen_new: i32,
    /// Rows of a packed q (the packed LSE's head stride); 0 when dense.
    pub total_q: i32,
    /// k/v's outer extents `[kv_batches, kv_rows, hkv, d]` ([`BatchLayout::k_dims`]): `(1,
    /// total_k)` packed, `(batch, capacity)` a cache, `(num_blocks, page_size)` paged; 0 on a
    /// dense launch. Host-side (the TMA maps of FA3 need the tensor's extent).
    pub kv_rows: i32,
    pub kv_batches: i32,
    pub reserved2: u32,
    /// f32 `[heads_q]`: one attention-sink logit per query head (natural units, -inf: none), or
    /// 0. A split-KV launch's splits leave it to the combine kernel, which folds it once.
    pub sinks: u64,
    // ---- what engines' serving paths need beside the layout (0: off).
    /// V's and O's head dim; 0 = `head_dim` (Q/K's).
    pub head_dim_v: i32,
    /// Rotary embedding of k_new (append) and q over their first `rotary_dim` dims, at
    /// positions `seqlens[b] + i`; 0 = none. Pairing: FA_FLAG_ROTARY_INTERLEAVED.
    pub rotary_dim: i32,
    /// f32 `[seqlen_ro, rotary_dim / 2]`.
    pub rotary_cos: u64,
    pub rotary_sin: u64,
    /// i32 `[batch]`: sequence b reads and writes cache row `cache_batch_idx[b]`.
    pub cache_batch_idx: u64,
    /// i32 `[batch]`: sequence b's keys start at cache position `cache_leftpad[b]`.
    pub cache_leftpad: u64,
    /// FP8 KV cache (FA_FLAG_KV_FP8): a code c with scale s stands for e4m3(c)·s. f32 `[1]`
    /// each, or with FA_FLAG_KV_SCALE_PER_TOKEN `[kv_batches, kv_rows, heads_kv]`.
    pub k_cache_scale: u64,
    pub v_cache_scale: u64,
}

// The same numbers as the static_asserts in cuda/common/params.h, plus every other offset.
assert_c_layout!(FwdParams, size 432, {
    q: 0,
    lse: 32,
    alibi_slopes: 40,
    v_descale: 64,
    q_batch_stride: 72,
    k_batch_stride: 96,
    v_batch_stride: 120,
    o_batch_stride: 144,
    o_head_stride: 160,
    batch: 168,
    head_dim: 188,
    window_left: 192,
    window_right: 196,
    descale_block: 200,
    softmax_scale: 204,
    softmax_scale_log2: 208,
    softcap: 212,
    flags: 216,
    reserved: 220,
    cu_seqlens_q: 224,
    cu_seqlens_k: 232,
    seqused_k: 240,
    block_table: 248,
    knew: 256,
    vnew: 264,
    o_accum: 272,
    lse_accum: 280,
    knew_batch_stride: 288,
    vnew_batch_stride: 312,
    vnew_head_stride: 328,
    block_table_batch_stride: 336,
    page_size: 340,
    num_splits: 344,
    seqlen_new: 348,
    total_q: 352,
    kv_rows: 356,
    kv_batches: 360,
    reserved2: 364,
    sinks: 368,
    head_dim_v: 376,
    rotary_dim: 380,
    rotary_cos: 384,
    rotary_sin: 392,
    cache_batch_idx: 400,
    cache_leftpad: 408,
    k_cache_scale: 416,
    v_cache_scale: 424,
});

impl FwdParams {
    /// The parameters of a launch of `p` on `ops`: the one place they are built, for
    /// `Engine`'s launches and for the emulator's launch plans. The caller has checked that
    /// seqlens fit `i32` and that the strides address inside their buffers (so they fit `i64`).
    pub(crate) fn for_launch(p: &Problem, ops: &Operands) -> Self {
        let Operands { ptrs, strides, lse, alibi, sinks } = *ops;
        let st = |s: usize| s as i64;
        // An unbounded side is -1. Problem::new clamps bounds to the sequence (<= 2^30 on the
        // GPU); a bound past i32::MAX would see the same keys as i32::MAX, and mask.cuh forms
        // its sums in 64 bits anyway.
        let window = |w: Option<usize>| w.map_or(-1, |x| x.min(i32::MAX as usize) as i32);
        let mut flags = 0;
        if lse != 0 {
            flags |= FLAG_RETURN_LSE;
        }
        if p.softcap.is_some() {
            flags |= FLAG_SOFTCAP;
        }
        if alibi != 0 {
            flags |= FLAG_ALIBI;
        }
        let [q, k, v, o] = strides;
        FwdParams {
            q: ptrs[0],
            k: ptrs[1],
            v: ptrs[2],
            o: ptrs[3],
            lse,
            alibi_slopes: alibi,
            q_batch_stride: st(q[0]),
            q_row_stride: st(q[1]),
            q_head_stride: st(q[2]),
            k_batch_stride: st(k[0]),
            k_row_stride: st(k[1]),
            k_head_stride: st(k[2]),
            v_batch_stride: st(v[0]),
            v_row_stride: st(v[1]),
            v_head_stride: st(v[2]),
            o_batch_stride: st(o[0]),
            o_row_stride: st(o[1]),
            o_head_stride: st(o[2]),
            batch: p.batch as i32,
            seqlen_q: p.seqlen_q as i32,
            seqlen_k: p.seqlen_k as i32,
            heads_q: p.heads_q as i32,
            heads_kv: p.heads_kv as i32,
            head_dim: p.head_dim as i32,
            window_left: window(p.left),
            window_right: window(p.right),
            softmax_scale: p.scale,
            softmax_scale_log2: p.score_units().to_log2,
            softcap: p.softcap.unwrap_or(0.0),
            flags,
            sinks,
            head_dim_v: if p.head_dim_v == p.head_dim { 0 } else { p.head_dim_v as i32 },
            ..FwdParams::default()
        }
    }

    /// The parameters of a serving launch: [`FwdParams::for_launch`] of `p` (built from the
    /// layout's batch and longest sequences, as `serving::prepare` builds it) plus the fields of
    /// the validated `layout`, mirrored one to one (docs/serving.md "GPU"), the split count and
    /// the append's rows. The one place a `BatchLayout` becomes kernel parameters.
    ///
    /// # Errors
    /// `Error::InvalidSeqLayout` when `p` does not describe `layout` (batch, longest sequences)
    /// or a buffer the layout needs has no device address (e.g. a packed q without
    /// `cu_seqlens_q`, splits without `o_accum`/`lse_accum`); `Error::TooLarge` when an index
    /// does not fit the kernels' i32.
    pub fn for_serving(
        p: &Problem,
        layout: &BatchLayout<'_>,
        ops: &Operands,
        s: &ServingOperands,
        num_splits: usize,
    ) -> Result<Self> {
        let bad = |what: &str, got: String, expected: &str| Error::InvalidSeqLayout {
            what: what.to_string(),
            got,
            expected: expected.to_string(),
        };
        let dims = (layout.batch(), layout.max_seqlen_q(), layout.max_seqlen_k());
        if (p.batch, p.seqlen_q, p.seqlen_k) != dims {
            return Err(bad(
                "problem",
                format!("batch {}, seqlen_q {}, seqlen_k {}", p.batch, p.seqlen_q, p.seqlen_k),
                "the layout's batch and longest sequences (serving::prepare builds the problem so)",
            ));
        }
        let need = |addr: u64, what: &str| -> Result<u64> {
            if addr == 0 {
                return Err(bad(what, "no device address (0)".into(), "the device buffer the layout names"));
            }
            Ok(addr)
        };
        let i32_of = |x: usize, what: &str| -> Result<i32> {
            i32::try_from(x).map_err(|_| Error::TooLarge { what: format!("{what} {x} (the kernels index with i32)") })
        };
        let mut f = FwdParams::for_launch(p, ops);
        if let QueryLayout::Varlen { .. } = layout.query_layout() {
            f.cu_seqlens_q = need(s.cu_seqlens_q, "cu_seqlens_q")?;
            f.total_q = i32_of(layout.q_rows(), "total_q")?;
        }
        if !matches!(layout.kv_layout(), KvLayout::Dense) {
            let [kb, kr] = layout.k_dims();
            (f.kv_batches, f.kv_rows) = (i32_of(kb, "k/v blocks or batch")?, i32_of(kr, "k/v rows")?);
        }
        let new = match layout.kv_layout() {
            KvLayout::Varlen { .. } => {
                f.cu_seqlens_k = need(s.cu_seqlens_k, "cu_seqlens_k")?;
                0
            }
            KvLayout::Cache { new, .. } => {
                f.seqused_k = need(s.seqused_k, "cache_seqlens")?;
                new
            }
            KvLayout::Paged { max_blocks_per_seq, new, .. } => {
                f.seqused_k = need(s.seqused_k, "cache_seqlens")?;
                f.block_table = need(s.block_table, "block_table")?;
                f.block_table_batch_stride = i32_of(max_blocks_per_seq, "max_blocks_per_seq")?;
                f.page_size = i32_of(layout.page_size(), "page size")?;
                new
            }
            _ => 0,
        };
        if new > 0 {
            f.seqlen_new = i32_of(new, "seqlen_new")?;
            f.knew = need(s.knew, "k_new")?;
            f.vnew = need(s.vnew, "v_new")?;
            let st = |x: usize| x as i64;
            let [kn, vn] = s.new_strides;
            (f.knew_batch_stride, f.knew_row_stride, f.knew_head_stride) = (st(kn[0]), st(kn[1]), st(kn[2]));
            (f.vnew_batch_stride, f.vnew_row_stride, f.vnew_head_stride) = (st(vn[0]), st(vn[1]), st(vn[2]));
        }
        if num_splits > 1 {
            f.num_splits = i32_of(num_splits, "num_splits")?;
            f.o_accum = need(s.o_accum, "o_accum")?;
            f.lse_accum = need(s.lse_accum, "lse_accum")?;
        }
        Ok(f)
    }

    /// Whether any serving field is set (a varlen, cache, paged, append or split-KV launch).
    pub fn is_serving(&self) -> bool {
        self.cu_seqlens_q != 0
            || self.cu_seqlens_k != 0
            || self.seqused_k != 0
            || self.block_table != 0
            || self.seqlen_new != 0
            || self.num_splits > 1
    }

    /// Rows of the LSE (and of each split's partial state): `batch * heads_q * seqlen_q` dense,
    /// `heads_q * total_q` packed (FlashAttention's layouts).
    pub fn lse_rows(&self) -> usize {
        if self.cu_seqlens_q != 0 {
            self.heads_q as usize * self.total_q as usize
        } else {
            self.batch as usize * self.heads_q as usize * self.seqlen_q as usize
        }
    }

    /// The struct's bytes as the kernel receives them (native endianness, `cuda/common/params.h` layout).
    pub fn to_bytes(self) -> [u8; size_of::<FwdParams>()] {
        let mut out = [0u8; size_of::<FwdParams>()];
        let mut at = 0;
        let mut put = |b: &[u8]| {
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        for x in [self.q, self.k, self.v, self.o, self.lse, self.alibi_slopes, self.q_descale, self.k_descale, self.v_descale] {
            put(&x.to_ne_bytes());
        }
        for x in [
            self.q_batch_stride,
            self.q_row_stride,
            self.q_head_stride,
            self.k_batch_stride,
            self.k_row_stride,
            self.k_head_stride,
            self.v_batch_stride,
            self.v_row_stride,
            self.v_head_stride,
            self.o_batch_stride,
            self.o_row_stride,
            self.o_head_stride,
        ] {
            put(&x.to_ne_bytes());
        }
        for x in [
            self.batch,
            self.seqlen_q,
            self.seqlen_k,
            self.heads_q,
            self.heads_kv,
            self.head_dim,
            self.window_left,
            self.window_right,
            self.descale_block,
        ] {
            put(&x.to_ne_bytes());
        }
        for x in [self.softmax_scale, self.softmax_scale_log2, self.softcap] {
            put(&x.to_ne_bytes());
        }
        put(&self.flags.to_ne_bytes());
        put(&self.reserved.to_ne_bytes());
        for x in [
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            self.seqused_k,
            self.block_table,
            self.knew,
            self.vnew,
            self.o_accum,
            self.lse_accum,
        ] {
            put(&x.to_ne_bytes());
        }
        for x in [
            self.knew_batch_stride,
            self.knew_row_stride,
            self.knew_head_stride,
            self.vnew_batch_stride,
            self.vnew_row_stride,
            self.vnew_head_stride,
        ] {
            put(&x.to_ne_bytes());
        }
        for x in [
            self.block_table_batch_stride,
            self.page_size,
            self.num_splits,
            self.seqlen_new,
            self.total_q,
            self.kv_rows,
            self.kv_batches,
        ] {
            put(&x.to_ne_bytes());
        }
        put(&self.reserved2.to_ne_bytes());
        put(&self.sinks.to_ne_bytes());
        put(&self.head_dim_v.to_ne_bytes());
        put(&self.rotary_dim.to_ne_bytes());
        for x in [
            self.rotary_cos,
            self.rotary_sin,
            self.cache_batch_idx,
            self.cache_leftpad,
            self.k_cache_scale,
            self.v_cache_scale,
        ] {
            put(&x.to_ne_bytes());
        }
        debug_assert_eq!(at, size_of::<FwdParams>());
        out
    }
}

// SAFETY: FwdParams is #[repr(C)], Copy, made only of integers and floats with no padding
// (size and every offset asserted above to match cuda/common/params.h), so its bytes are a valid kernel
// argument of type `FwdParams`.
unsafe impl cudarc::driver::DeviceRepr for FwdParams {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    /// Every field lands at the offset the layout asserts say (bytes written in field order).
    #[test]
    fn to_bytes_follows_the_c_layout() {
        let p = FwdParams {
            q: 0x1111,
            batch: 7,
            window_left: -1,
            softmax_scale: 0.5,
            flags: 3,
            reserved: 9,
            o_head_stride: 64,
            ..FwdParams::default()
        };
        let b = p.to_bytes();
        let at = |o: usize, n: usize| &b[o..o + n];
        assert_eq!(at(offset_of!(FwdParams, q), 8), &0x1111u64.to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, o_head_stride), 8), &64i64.to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, batch), 4), &7i32.to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, window_left), 4), &(-1i32).to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, softmax_scale), 4), &0.5f32.to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, flags), 4), &3u32.to_ne_bytes());
        assert_eq!(at(offset_of!(FwdParams, reserved), 4), &9u32.to_ne_bytes());
        assert!(b[offset_of!(FwdParams, cu_seqlens_q)..].iter().all(|&x| x == 0), "dense: serving fields 0");
    }

    /// The serving fields land at their offsets too (each a distinct value).
    #[test]
    fn serving_fields_follow_the_c_layout() {
        let p = FwdParams {
            cu_seqlens_q: 0xA1,
            cu_seqlens_k: 0xA2,
            seqused_k: 0xA3,
            block_table: 0xA4,
            knew: 0xA5,
            vnew: 0xA6,
            o_accum: 0xA7,
            lse_accum: 0xA8,
            knew_batch_stride: 11,
            knew_row_stride: 12,
            knew_head_stride: 13,
            vnew_batch_stride: 14,
            vnew_row_stride: 15,
            vnew_head_stride: 16,
            block_table_batch_stride: 17,
            page_size: 18,
            num_splits: 19,
            seqlen_new: 20,
            total_q: 21,
            kv_rows: 23,
            kv_batches: 24,
            reserved2: 22,
            ..FwdParams::default()
        };
        let b = p.to_bytes();
        let u64_at = |o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap());
        let i32_at = |o: usize| i32::from_ne_bytes(b[o..o + 4].try_into().unwrap());
        assert_eq!(u64_at(offset_of!(FwdParams, cu_seqlens_q)), 0xA1);
        assert_eq!(u64_at(offset_of!(FwdParams, cu_seqlens_k)), 0xA2);
        assert_eq!(u64_at(offset_of!(FwdParams, seqused_k)), 0xA3);
        assert_eq!(u64_at(offset_of!(FwdParams, block_table)), 0xA4);
        assert_eq!(u64_at(offset_of!(FwdParams, knew)), 0xA5);
        assert_eq!(u64_at(offset_of!(FwdParams, vnew)), 0xA6);
        assert_eq!(u64_at(offset_of!(FwdParams, o_accum)), 0xA7);
        assert_eq!(u64_at(offset_of!(FwdParams, lse_accum)), 0xA8);
        assert_eq!(u64_at(offset_of!(FwdParams, knew_batch_stride)), 11);
        assert_eq!(u64_at(offset_of!(FwdParams, vnew_head_stride)), 16);
        assert_eq!(i32_at(offset_of!(FwdParams, block_table_batch_stride)), 17);
        assert_eq!(i32_at(offset_of!(FwdParams, page_size)), 18);
        assert_eq!(i32_at(offset_of!(FwdParams, num_splits)), 19);
        assert_eq!(i32_at(offset_of!(FwdParams, seqlen_new)), 20);
        assert_eq!(i32_at(offset_of!(FwdParams, total_q)), 21);
        assert_eq!(i32_at(offset_of!(FwdParams, kv_rows)), 23);
        assert_eq!(i32_at(offset_of!(FwdParams, kv_batches)), 24);
        assert_eq!(i32_at(offset_of!(FwdParams, reserved2)), 22);
        assert!(p.is_serving() && !FwdParams::default().is_serving());
    }

    /// A paged, appending, split layout becomes the matching fields; missing buffers are refused.
    #[test]
    fn for_serving_mirrors_the_layout() {
        use crate::options::ForwardOptions;
        use crate::tensor::DType;
        let table = [2, 0, 1, -1, 1, 2, -1, -1];
        let seqlens = [7, 4];
        let kv = KvLayout::Paged { block_table: &table, max_blocks_per_seq: 4, seqlens: &seqlens, new: 1 };
        let cu = [0, 3, 5];
        let ql = QueryLayout::Varlen { cu_seqlens: &cu, max_seqlen: 3 };
        let l = BatchLayout::new(ql, [1, 5, 4, 8], kv, [3, 3, 2, 8]).unwrap();
        let p = Problem::from_shapes([2, 3, 4, 8], [2, 8, 2, 8], [2, 8, 2, 8], DType::F16, &ForwardOptions::default())
            .unwrap();
        let ops = Operands { ptrs: [0x100, 0x200, 0x300, 0x400], strides: [[0, 32, 8], [48, 16, 8], [48, 16, 8], [0, 32, 8]], lse: 0x500, alibi: 0, sinks: 0 };
        let s = ServingOperands {
            cu_seqlens_q: 0x600,
            seqused_k: 0x700,
            block_table: 0x800,
            knew: 0x900,
            vnew: 0xA00,
            new_strides: [[16, 16, 8]; 2],
            o_accum: 0xB00,
            lse_accum: 0xC00,
            ..ServingOperands::default()
        };
        let f = FwdParams::for_serving(&p, &l, &ops, &s, 3).unwrap();
        assert_eq!((f.cu_seqlens_q, f.total_q, f.cu_seqlens_k), (0x600, 5, 0));
        assert_eq!((f.seqused_k, f.block_table, f.block_table_batch_stride, f.page_size), (0x700, 0x800, 4, 3));
        assert_eq!((f.kv_batches, f.kv_rows), (3, 3)); // [num_blocks, page_size]
        assert_eq!((f.seqlen_new, f.knew, f.vnew, f.knew_row_stride), (1, 0x900, 0xA00, 16));
        assert_eq!((f.num_splits, f.o_accum, f.lse_accum), (3, 0xB00, 0xC00));
        assert_eq!((f.batch, f.seqlen_q, f.seqlen_k, f.lse_rows()), (2, 3, 8, 20));
        let e = FwdParams::for_serving(&p, &l, &ops, &ServingOperands { block_table: 0, ..s }, 3).unwrap_err();
        assert!(e.to_string().contains("block_table"), "{e}");
        let e = FwdParams::for_serving(&p, &l, &ops, &ServingOperands { o_accum: 0, ..s }, 2).unwrap_err();
        assert!(e.to_string().contains("o_accum"), "{e}");
        assert!(FwdParams::for_serving(&p, &l, &ops, &ServingOperands { o_accum: 0, ..s }, 1).is_ok());
    }
}

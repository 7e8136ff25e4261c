//! Between candle and flash_attn: candle layouts as flash_attn's strided views, candle index and
//! slope tensors as host vectors, candle-flash-attn's window and softcap arguments as
//! `ForwardOptions`, flash_attn's errors as candle errors.

use candle_core::{bail, DType, Layout, Result, Tensor, WithDType};
use flash_attn::{Element, ForwardOptions, Mask, TensorView};

/// A dtype both crates store: f32, f16, bf16.
pub(crate) trait Float: Element + WithDType {}
impl Float for f32 {}
impl Float for half::f16 {}
impl Float for half::bf16 {}

/// Runs `$body` with `$T` the Rust type of candle dtype `$dtype` (f32, f16 or bf16); any other
/// dtype is an error naming `$what`.
macro_rules! with_float {
    ($dtype:expr, $what:expr, $T:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            candle_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            d => candle_core::bail!("flash_attn: {} must be f32, f16 or bf16, got {d:?}", $what),
        }
    };
}
pub(crate) use with_float;

pub(crate) fn err(e: flash_attn::Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// Checks that q, k, v (and any further tensor of the call) share one dtype.
pub(crate) fn same_dtype(dtypes: &[(&str, DType)]) -> Result<DType> {
    let (_, first) = dtypes[0];
    if dtypes.iter().any(|&(_, d)| d != first) {
        let got: Vec<String> = dtypes.iter().map(|(n, d)| format!("{n} {d:?}")).collect();
        bail!("flash_attn: {} must all be f32, f16 or bf16 and the same, got {}", names(dtypes), got.join(", "))
    }
    Ok(first)
}

fn names(dtypes: &[(&str, DType)]) -> String {
    dtypes.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
}

/// A candle layout as flash_attn's `[batch, seqlen, heads, head_dim]` shape and the strides of
/// its first three dimensions: rank 4 as it is, rank 3 `(total, heads, head_dim)` (a packed
/// varlen tensor) as `[1, total, heads, head_dim]`. The last dimension must be contiguous.
pub(crate) fn bshd(l: &Layout, rank: usize, what: &str) -> Result<([usize; 4], [usize; 3])> {
    let (dims, stride) = (l.dims(), l.stride());
    let expected = if rank == 4 { "[batch, seqlen, heads, head_dim]" } else { "(total, heads, head_dim)" };
    if dims.len() != rank {
        bail!("flash_attn: {what} must be {expected}, got shape {dims:?}")
    }
    if stride.last() != Some(&1) && dims.last() != Some(&1) {
        bail!("flash_attn: {what} must have a contiguous last (head_dim) dimension, got strides {stride:?}; call .contiguous()")
    }
    Ok(match (dims, stride) {
        (&[b, s, h, d], &[sb, ss, sh, _]) => ([b, s, h, d], [sb, ss, sh]),
        (&[t, h, d], &[st, sh, _]) => ([1, t, h, d], [t.max(1).saturating_mul(st), st, sh]),
        _ => bail!("flash_attn: {what} must be {expected}, got shape {dims:?}"),
    })
}

/// A borrowed, strided view of candle CPU data from the layout's offset on.
pub(crate) fn view<'a, T: Element>(data: &'a [T], l: &Layout, rank: usize, what: &str) -> Result<TensorView<'a>> {
    let (shape, strides) = bshd(l, rank, what)?;
    let data = data.get(l.start_offset()..).unwrap_or(&[]);
    Ok(TensorView::with_strides(data, shape, strides))
}

/// The contiguous candle buffer a layout names (a writable cache must be one block).
pub(crate) fn contiguous_range(l: &Layout, what: &str) -> Result<std::ops::Range<usize>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(a..b),
        None => bail!("flash_attn: {what} must be contiguous (it is written in place), got strides {:?}", l.stride()),
    }
}

/// An index tensor (u32, i32 or i64, any rank, any device) as host i32s, flash_attn's index
/// type; a value outside i32 is an error.
pub(crate) fn index_vec(t: &Tensor, what: &str) -> Result<Vec<i32>> {
    let flat = t.flatten_all()?;
    let wide: Vec<i64> = match t.dtype() {
        DType::U32 => flat.to_vec1::<u32>()?.into_iter().map(i64::from).collect(),
        DType::I32 => flat.to_vec1::<i32>()?.into_iter().map(i64::from).collect(),
        DType::I64 => flat.to_vec1::<i64>()?,
        d => bail!("flash_attn: {what} must be u32, i32 or i64, got {d:?}"),
    };
    wide.into_iter()
        .map(|x| i32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("flash_attn: {what} holds {x}, outside i32"))))
        .collect()
}

/// The sequence offsets of a varlen call: `seqlens_q`, `seqlens_k` cumulative (`batch + 1`
/// entries, u32 as candle-flash-attn takes them, or i32/i64), on any device.
pub(crate) fn cumulative(seqlens_q: &Tensor, seqlens_k: &Tensor) -> Result<(Vec<i32>, Vec<i32>)> {
    let (cu_q, cu_k) = (index_vec(seqlens_q, "seqlens_q")?, index_vec(seqlens_k, "seqlens_k")?);
    if cu_q.len() != cu_k.len() {
        bail!(
            "flash_attn: seqlens_q and seqlens_k must have the same number of entries (batch + 1), got {} and {}",
            cu_q.len(),
            cu_k.len()
        )
    }
    Ok((cu_q, cu_k))
}

/// ALiBi slopes as candle-flash-attn takes them: an f32 tensor of shape `(num_heads_q)`.
pub(crate) fn slopes_vec(t: &Tensor) -> Result<Vec<f32>> {
    if t.dtype() != DType::F32 {
        bail!("flash_attn: alibi_slopes must be f32, got {:?}", t.dtype())
    }
    if t.rank() != 1 {
        bail!("flash_attn: alibi_slopes must be (num_heads_q), got shape {:?}", t.dims())
    }
    t.to_vec1::<f32>()
}

/// candle-flash-attn's window arguments as a mask: `None` is an unbounded side;
/// (`None`, `Some(0)`) is causal; any other pair a window aligned bottom-right, as FlashAttention
/// 2 (a bound past the sequence sees what an unbounded side sees).
pub(crate) fn window_mask(left: Option<usize>, right: Option<usize>) -> Mask {
    let side = |w: Option<usize>| w.map_or(-1, |w| i64::try_from(w).unwrap_or(i64::MAX));
    match (side(left), side(right)) {
        (-1, -1) => Mask::None,
        (-1, 0) => Mask::Causal,
        (l, r) => Mask::window(l, r),
    }
}

/// The options of a candle-flash-attn call: its scale, window, ALiBi slopes and softcap (0.0 is
/// no softcap, as FlashAttention 2; a negative or NaN cap is refused by flash_attn's checks).
pub(crate) fn dropin_options(
    softmax_scale: f32,
    left: Option<usize>,
    right: Option<usize>,
    alibi_slopes: Option<&Tensor>,
    softcap: Option<f32>,
) -> Result<ForwardOptions> {
    let mut opts = ForwardOptions::default().softmax_scale(softmax_scale).mask(window_mask(left, right));
    if let Some(s) = alibi_slopes {
        opts = opts.alibi_slopes(slopes_vec(s)?);
    }
    match softcap {
        Some(c) if c != 0.0 => Ok(opts.softcap(c)),
        _ => Ok(opts),
    }
}

//! candle-flash-attn 0.11's public API, name for name and argument for argument, so that
//! `use candle_flash_attn as fa;` becomes `use flash_attn_candle as fa;` and nothing else
//! changes. Same semantics: q, k, v `(batch, seq_len, num_heads, head_size)` (varlen:
//! `(total, num_heads, head_size)` with cumulative `seqlens_q`/`seqlens_k` of `batch + 1`
//! entries), GQA by fewer k/v heads, `softmax_scale` as given, windows as `Option<usize>`
//! (`None` unbounded; `window_size_left = None, window_size_right = Some(0)` is causal; both
//! sides aligned to the bottom-right of each sequence's score matrix, as FlashAttention 2), ALiBi
//! slopes an f32 tensor `(num_heads_q)`, `softcap` 0.0 for none.
//!
//! What differs: CPU tensors work (flash_attn's CPU backend; candle-flash-attn has none), f32
//! too, any head size and page size, and the dense functions are differentiable.

use crate::convert::{cumulative, dropin_options, index_vec};
use crate::op::{flash_attn_with_options, Attention, Keys};
use crate::serving::flash_attn_varlen_lse;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

/// candle-flash-attn's op struct, with its public fields; as a `CustomOp3` it runs
/// [`Attention`] with these options.
pub struct FlashAttn {
    pub softmax_scale: f32,
    pub alibi_slopes: Option<Tensor>,
    pub window_size_left: Option<usize>,
    pub window_size_right: Option<usize>,
    pub softcap: Option<f32>,
}

impl FlashAttn {
    fn attention(&self) -> Result<Attention> {
        let opts = dropin_options(
            self.softmax_scale,
            self.window_size_left,
            self.window_size_right,
            self.alibi_slopes.as_ref(),
            self.softcap,
        )?;
        Ok(Attention::new(opts))
    }
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flash-attn"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.attention()?.cpu_fwd(s1, l1, s2, l2, s3, l3)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.attention()?.cuda_fwd(s1, l1, s2, l2, s3, l3)
    }

    /// dq, dk, dv as [`Attention`]'s (the forward's LSE is recomputed: a `FlashAttn` applied by
    /// hand keeps none; the functions of this module apply [`Attention`], which does).
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.attention()?.bwd(q, k, v, o, d_o)
    }
}

fn dense(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
) -> Result<Tensor> {
    let opts = dropin_options(softmax_scale, window.0, window.1, alibi_slopes, softcap)?;
    flash_attn_with_options(q, k, v, &opts)
}

fn causal_window(causal: bool) -> (Option<usize>, Option<usize>) {
    (None, if causal { Some(0) } else { None })
}

/// `softmax(Q @ K^T · softmax_scale) @ V` over q `(batch, seq_len_q, num_heads_q, head_size)`,
/// k, v `(batch, seq_len_kv, num_heads_kv, head_size)`; causal aligned bottom-right. Returns
/// `(batch, seq_len_q, num_heads_q, head_size)`.
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32, causal: bool) -> Result<Tensor> {
    dense(q, k, v, None, softmax_scale, causal_window(causal), None)
}

/// [`flash_attn()`] with a sliding window: query `i` sees keys
/// `i + sk - sq - window_size_left ..= i + sk - sq + window_size_right`, `None` unbounded.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    dense(q, k, v, None, softmax_scale, (window_size_left, window_size_right), None)
}

/// [`flash_attn()`] with ALiBi: `alibi_slopes` f32 `(num_heads_q)`; the scores get
/// `-slope · |i + sk - sq - j|`.
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    dense(q, k, v, Some(alibi_slopes), softmax_scale, causal_window(causal), None)
}

/// [`flash_attn_windowed`] with ALiBi.
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    dense(q, k, v, Some(alibi_slopes), softmax_scale, (window_size_left, window_size_right), None)
}

/// [`flash_attn_windowed`] with optional ALiBi and a softcap: scores become
/// `softcap · tanh(scores / softcap)` (0.0: none).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    dense(q, k, v, alibi_slopes, softmax_scale, (window_size_left, window_size_right), Some(softcap))
}

#[allow(clippy::too_many_arguments)]
fn varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    (seqlens_q, seqlens_k): (&Tensor, &Tensor),
    (max_q, max_k): (usize, usize),
    softmax_scale: f32,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
) -> Result<Tensor> {
    let opts = dropin_options(softmax_scale, window.0, window.1, alibi_slopes, softcap)?;
    Ok(flash_attn_varlen_lse(q, k, v, seqlens_q, seqlens_k, max_q, max_k, &opts)?.0)
}

/// Attention over a variable-length batch: q `(total_q, num_heads_q, head_size)`, k, v
/// `(total_kv, num_heads_kv, head_size)`; sequence `b` is rows `seqlens_q[b]..seqlens_q[b + 1]`
/// of q and `seqlens_k[b]..seqlens_k[b + 1]` of k and v; `max_seqlen_q`/`max_seqlen_k` at least
/// the longest. Masks apply per sequence. Returns `(total_q, num_heads_q, head_size)`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let (s, m) = ((seqlens_q, seqlens_k), (max_seqlen_q, max_seqlen_k));
    varlen(q, k, v, None, s, m, softmax_scale, causal_window(causal), None)
}

/// [`flash_attn_varlen`] with a sliding window (as [`flash_attn_windowed`], per sequence).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let (s, m) = ((seqlens_q, seqlens_k), (max_seqlen_q, max_seqlen_k));
    varlen(q, k, v, None, s, m, softmax_scale, (window_size_left, window_size_right), None)
}

/// A varlen batch of queries over a paged KV cache: q `(total_q, num_heads_q, head_size)`, k, v
/// `(num_blocks, page_block_size, num_heads_kv, head_size)`, sequence `b` holding
/// `seqlens_k[b + 1] - seqlens_k[b]` keys in the blocks `block_table[b]` names
/// (`(batch, max_blocks)`, u32 or i32). Any page size works here.
///
/// `mm_prefix_ranges` (key ranges a query inside them sees whole, past the causal/window mask)
/// is not supported: `Some` with a non-empty range is an error.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    if let Some(r) = mm_prefix_ranges {
        let ranges = index_vec(r, "mm_prefix_ranges")?;
        if ranges.chunks(2).any(|p| p.len() == 2 && p[0] < p[1]) {
            bail!("flash_attn: mm_prefix_ranges (mask bypass ranges) are not supported; pass None")
        }
    }
    let opts = dropin_options(softmax_scale, window_size_left, window_size_right, None, softcap)?;
    let (cu_q, cu_k) = cumulative(seqlens_q, seqlens_k)?;
    if cu_k.first().is_some_and(|&c| c != 0) {
        bail!("flash_attn: seqlens_k must start at 0, got {}", cu_k[0])
    }
    if let Some(b) = cu_k.windows(2).position(|w| w[1] < w[0]) {
        bail!("flash_attn: seqlens_k must not decrease, got {} then {} at entry {b}", cu_k[b], cu_k[b + 1])
    }
    let seqlens: Vec<i32> = cu_k.windows(2).map(|w| w[1] - w[0]).collect();
    if k.rank() == 4 && k.dim(1)? != page_block_size {
        bail!("flash_attn: page_block_size {page_block_size} does not match k's shape {:?}", k.dims())
    }
    let (bt_rows, max_blocks) = match block_table.dims() {
        &[b, m] => (b, m),
        d => bail!("flash_attn: block_table must be (batch, max_blocks), got shape {d:?}"),
    };
    if bt_rows != seqlens.len() {
        bail!("flash_attn: block_table has {bt_rows} rows, seqlens_k describes {} sequences", seqlens.len())
    }
    let table = index_vec(block_table, "block_table")?;
    if let Some(&longest) = seqlens.iter().max() {
        if longest as usize > max_seqlen_k {
            bail!("flash_attn: max_seqlen_k {max_seqlen_k} is below the longest key sequence {longest}")
        }
    }
    let keys = Keys::VarlenPaged { cu_q, max_q: max_seqlen_q, seqlens, table, max_blocks };
    Ok(Attention::with_keys(opts, keys).run(q, k, v)?.0)
}

/// [`flash_attn_varlen`] with ALiBi.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let (s, m) = ((seqlens_q, seqlens_k), (max_seqlen_q, max_seqlen_k));
    varlen(q, k, v, Some(alibi_slopes), s, m, softmax_scale, causal_window(causal), None)
}

/// [`flash_attn_varlen_windowed`] with ALiBi.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let (s, m) = ((seqlens_q, seqlens_k), (max_seqlen_q, max_seqlen_k));
    varlen(q, k, v, Some(alibi_slopes), s, m, softmax_scale, (window_size_left, window_size_right), None)
}

/// [`flash_attn_varlen_windowed`] with optional ALiBi and a softcap (0.0: none); mistral.rs's
/// call.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let (s, m) = ((seqlens_q, seqlens_k), (max_seqlen_q, max_seqlen_k));
    varlen(q, k, v, alibi_slopes, s, m, softmax_scale, (window_size_left, window_size_right), Some(softcap))
}

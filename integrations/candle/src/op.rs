//! [`Attention`]: the candle `CustomOp3` over (q, k, v) that every function of this crate
//! applies. It runs flash_attn where candle's tensors are (CPU storage: the CPU backend on
//! borrowed views; CUDA storage: the kernels on candle's stream), keeps the softmax LSE of its
//! forward, and hands (q, k, v, o, dO, LSE) to the backward pass (`backward.rs`).

use crate::convert::{err, same_dtype, view, with_float, Float};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Device, Layout, Result, Shape, Tensor, WithDType};
use flash_attn::serving::{self, BlockTable, KvCache, Varlen};
use flash_attn::{Backend, ForwardOptions};
use std::sync::{Arc, Mutex};

/// Where the keys of a call are, beside q (all index arrays on the host, i32).
#[derive(Clone, Debug)]
pub(crate) enum Keys {
    /// q `[b, sq, hq, d]`, k and v `[b, sk, hkv, d]`.
    Dense,
    /// q `(total_q, hq, d)`, k and v `(total_k, hkv, d)`, sequences by cumulative offsets.
    Varlen { cu_q: Vec<i32>, cu_k: Vec<i32>, max_q: usize, max_k: usize },
    /// q `(total_q, hq, d)` by cumulative offsets over a paged cache
    /// `[num_blocks, page, hkv, d]` holding `seqlens[b]` keys of sequence `b`.
    VarlenPaged { cu_q: Vec<i32>, max_q: usize, seqlens: Vec<i32>, table: Vec<i32>, max_blocks: usize },
    /// q `[b, sq, hq, d]` over a dense `[b, capacity, hkv, d]` or paged cache.
    Cache { seqlens: Vec<i32>, table: Option<(Vec<i32>, usize)> },
}

impl Keys {
    /// The rank of q, and of k and v.
    pub(crate) fn ranks(&self) -> (usize, usize) {
        match self {
            Keys::Dense | Keys::Cache { .. } => (4, 4),
            Keys::Varlen { .. } => (3, 3),
            Keys::VarlenPaged { .. } => (3, 4),
        }
    }
    fn packed_q(&self) -> bool {
        matches!(self, Keys::Varlen { .. } | Keys::VarlenPaged { .. })
    }
}

/// flash_attn's forward as a candle op, with flash_attn's options (mask, softcap, ALiBi,
/// scale...) on tensors in FlashAttention's layout `[batch, seqlen, heads, head_dim]` (any
/// strides with a contiguous `head_dim`: candle's `[b, h, s, d]` is a `transpose(1, 2)` view).
///
/// Applied with `apply_op3` it is differentiable (its `bwd` runs flash_attn's backward with the
/// LSE this forward kept); [`Attention::lse`] gives that LSE, `[batch, heads_q, seqlen_q]` f32.
#[derive(Clone, Debug)]
pub struct Attention {
    pub(crate) opts: ForwardOptions,
    pub(crate) keys: Keys,
    lse: Arc<Mutex<Option<Tensor>>>,
}

impl Attention {
    /// The dense op with these options.
    pub fn new(opts: ForwardOptions) -> Self {
        Self::with_keys(opts, Keys::Dense)
    }
    pub(crate) fn with_keys(opts: ForwardOptions, keys: Keys) -> Self {
        Attention { opts, keys, lse: Arc::new(Mutex::new(None)) }
    }
    pub fn options(&self) -> &ForwardOptions {
        &self.opts
    }
    /// The LSE of the last forward this op (or a clone of it) ran: natural log, f32,
    /// `[batch, heads_q, seqlen_q]` (dense q) or `[heads_q, total_q]` (packed q), −inf for rows
    /// that see no key.
    pub fn lse(&self) -> Option<Tensor> {
        self.lse.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    pub(crate) fn keep_lse(&self, lse: Tensor) {
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
    }

    /// Applies the op: `(o, lse)`, recorded for the backward pass in the dense and varlen
    /// layouts (attention over a KV cache has none).
    pub(crate) fn run(self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let stash = self.lse.clone();
        let o = match self.keys {
            Keys::Dense | Keys::Varlen { .. } => q.apply_op3(k, v, self)?,
            _ => q.apply_op3_no_bwd(k, v, &self)?,
        };
        let lse = stash.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match lse {
            Some(lse) => Ok((o, lse)),
            None => bail!("flash_attn: the forward kept no LSE"),
        }
    }

    /// The LSE's shape for q's dims.
    pub(crate) fn lse_shape(&self, q_dims: &[usize]) -> Shape {
        match (self.keys.packed_q(), q_dims) {
            (true, &[t, h, _]) => Shape::from((h, t)),
            (false, &[b, s, h, _]) => Shape::from((b, h, s)),
            _ => Shape::from(q_dims.to_vec()),
        }
    }

    fn cpu_run<T: Float>(
        &self,
        (q, lq): (&[T], &Layout),
        (k, lk): (&[T], &Layout),
        (v, lv): (&[T], &Layout),
    ) -> Result<(Vec<T>, Shape)> {
        let (qr, kr) = self.keys.ranks();
        let (qv, kv, vv) = (view(q, lq, qr, "q")?, view(k, lk, kr, "k")?, view(v, lv, kr, "v")?);
        // Candle chose the CPU for these tensors: run there (not on a GPU behind candle's back).
        let opts = self.opts.clone().backend(Backend::Cpu).return_lse(true);
        let out = match &self.keys {
            Keys::Dense => flash_attn::forward(&qv, &kv, &vv, &opts),
            Keys::Varlen { cu_q, cu_k, max_q, max_k } => {
                let seqs = Varlen { cu_seqlens_q: cu_q, cu_seqlens_k: cu_k, max_seqlen_q: *max_q, max_seqlen_k: *max_k };
                serving::forward_varlen(&qv, &kv, &vv, &seqs, &opts)
            }
            Keys::VarlenPaged { cu_q, max_q, seqlens, table, max_blocks } => {
                let bt = BlockTable { ids: table, max_blocks_per_seq: *max_blocks };
                serving::forward_varlen_kvcache(&qv, cu_q, *max_q, &KvCache::paged(kv, vv, seqlens, bt), &opts)
            }
            Keys::Cache { seqlens, table } => {
                let cache = match table {
                    Some((ids, m)) => KvCache::paged(kv, vv, seqlens, BlockTable { ids, max_blocks_per_seq: *m }),
                    None => KvCache::dense(kv, vv, seqlens),
                };
                serving::forward_kvcache(&qv, &cache, &opts)
            }
        }
        .map_err(err)?;
        let lse = out.lse.unwrap_or_default();
        self.keep_lse(Tensor::from_vec(lse, self.lse_shape(lq.dims()), &Device::Cpu)?);
        Ok((out.o.into_vec::<T>().map_err(err)?, lq.shape().clone()))
    }
}

impl CustomOp3 for Attention {
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
        let dtype = same_dtype(&[("q", s1.dtype()), ("k", s2.dtype()), ("v", s3.dtype())])?;
        with_float!(dtype, "q, k, v", T => {
            let (o, shape) = self.cpu_run::<T>((s1.as_slice()?, l1), (s2.as_slice()?, l2), (s3.as_slice()?, l3))?;
            Ok((T::to_cpu_storage_owned(o), shape))
        })
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
        crate::cuda::forward(self, (s1, l1), (s2, l2), (s3, l3))
    }

    /// dq, dk, dv by flash_attn's backward from the LSE this forward kept (`backward.rs`; dense and
    /// varlen).
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = crate::backward::gradients(&self.opts, &self.keys, q, k, v, o, d_o, self.lse())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// `softmax(mask(scale · Q·Kᵀ)) · V` with flash_attn's options on candle tensors
/// `[batch, seqlen, heads, head_dim]` (f32, f16 or bf16 on the CPU; f16 or bf16 on CUDA), GQA by
/// fewer k/v heads. Differentiable.
pub fn flash_attn_with_options(q: &Tensor, k: &Tensor, v: &Tensor, opts: &ForwardOptions) -> Result<Tensor> {
    Ok(flash_attn_lse(q, k, v, opts)?.0)
}

/// [`flash_attn_with_options`] returning `(o, lse)`: the LSE `[batch, heads_q, seqlen_q]` f32,
/// natural log, −inf for rows that see no key (gradients flow through o only).
pub fn flash_attn_lse(q: &Tensor, k: &Tensor, v: &Tensor, opts: &ForwardOptions) -> Result<(Tensor, Tensor)> {
    Attention::new(opts.clone()).run(q, k, v)
}

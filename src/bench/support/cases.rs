//! The bench cases: shapes and inputs, the paged copy of a case's K/V, the sampled error check.

use crate::numerics::rng::SplitMix64 as Rng;
use crate::reference::attention_f64_rows;
use crate::serving::{BlockTable, KvCache};
use crate::{DType, Data, ForwardOptions, Mask, Output, Problem, Tensor, TensorView};

/// One benchmark shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub dtype: DType,
    pub mask: Mask,
}

impl Case {
    /// Self-attention with `heads` heads (MHA).
    pub fn square(batch: usize, seqlen: usize, heads: usize, head_dim: usize, dtype: DType, causal: bool) -> Case {
        Case {
            batch,
            seqlen_q: seqlen,
            seqlen_k: seqlen,
            heads_q: heads,
            heads_kv: heads,
            head_dim,
            dtype,
            mask: if causal { Mask::Causal } else { Mask::None },
        }
    }

    pub fn causal(&self) -> bool {
        matches!(self.mask, Mask::Causal | Mask::Window { causal: true, .. })
    }

    /// A short id for criterion and tables: `b1_s2048_h8_d128_f32_causal`.
    pub fn id(&self) -> String {
        let seq = if self.seqlen_q == self.seqlen_k {
            format!("s{}", self.seqlen_q)
        } else {
            format!("sq{}_sk{}", self.seqlen_q, self.seqlen_k)
        };
        let heads = if self.heads_q == self.heads_kv {
            format!("h{}", self.heads_q)
        } else {
            format!("h{}kv{}", self.heads_q, self.heads_kv)
        };
        let mask = match self.mask {
            Mask::None => "full".to_string(),
            Mask::Causal => "causal".to_string(),
            Mask::Window { left, right, causal } => format!("win{left}_{right}{}", if causal { "c" } else { "" }),
        };
        format!("b{}_{seq}_{heads}_d{}_{}_{mask}", self.batch, self.head_dim, self.dtype)
    }

    /// Seeded normal inputs q, k, v.
    pub fn inputs(&self, seed: u64) -> (Tensor, Tensor, Tensor) {
        let mut rng = Rng::new(seed);
        let mut make = |s: usize, h: usize| {
            let shape = [self.batch, s, h, self.head_dim];
            let vals: Vec<f32> = (0..shape.iter().product::<usize>()).map(|_| rng.normal() as f32).collect();
            Tensor::from_f32(&vals, self.dtype, shape).expect("shape is consistent")
        };
        let q = make(self.seqlen_q, self.heads_q);
        let k = make(self.seqlen_k, self.heads_kv);
        let v = make(self.seqlen_k, self.heads_kv);
        (q, k, v)
    }

    /// The validated problem (for the FLOP model and the reference).
    pub fn problem(&self, q: &Tensor, k: &Tensor, v: &Tensor, opts: &ForwardOptions) -> Problem {
        Problem::new(&q.view(), &k.view(), &v.view(), opts).expect("bench case is valid")
    }
}

/// The K/V of a dense case copied into a paged cache `[num_blocks, page_size, heads_kv,
/// head_dim]` whose blocks are shuffled (seeded), as an engine's allocator leaves them: the
/// decode benchmark of the paged path reads the same keys as the dense one.
pub struct PagedKv {
    pub k: Tensor,
    pub v: Tensor,
    pub table: Vec<i32>,
    pub seqlens: Vec<i32>,
    pub pages_per_seq: usize,
}

impl PagedKv {
    pub fn new(k: &Tensor, v: &Tensor, page_size: usize, seed: u64) -> PagedKv {
        let [b, sk, hkv, d] = k.shape();
        let pages = sk.div_ceil(page_size);
        let nb = b * pages;
        let mut ids: Vec<i32> = (0..nb as i32).collect();
        let mut rng = Rng::new(seed);
        rng.shuffle(&mut ids);
        let row = hkv * d;
        let (kf, vf) = (k.to_f32_vec(), v.to_f32_vec());
        let (mut kc, mut vc) = (vec![0.0f32; nb * page_size * row], vec![0.0f32; nb * page_size * row]);
        for bi in 0..b {
            for j in 0..sk {
                let at = (ids[bi * pages + j / page_size] as usize * page_size + j % page_size) * row;
                let from = (bi * sk + j) * row;
                kc[at..at + row].copy_from_slice(&kf[from..from + row]);
                vc[at..at + row].copy_from_slice(&vf[from..from + row]);
            }
        }
        let shape = [nb, page_size, hkv, d];
        PagedKv {
            k: Tensor::from_f32(&kc, k.dtype(), shape).expect("shape is consistent"),
            v: Tensor::from_f32(&vc, k.dtype(), shape).expect("shape is consistent"),
            table: ids,
            seqlens: vec![sk as i32; b],
            pages_per_seq: pages,
        }
    }

    pub fn cache(&self) -> KvCache<'_> {
        let table = BlockTable { ids: &self.table, max_blocks_per_seq: self.pages_per_seq };
        KvCache::paged(self.k.view(), self.v.view(), &self.seqlens, table)
    }
}

/// A tensor's values stored head-major, `[batch, heads, seqlen, head_dim]` (the layout of torch's
/// SDPA and onnxruntime's Attention), read back as `forward`'s `[batch, seqlen, heads, head_dim]`
/// through [`TensorView::heads_major`]: the same problem in the other memory layout.
pub struct HeadMajor(Tensor);

impl HeadMajor {
    pub fn new(t: &Tensor) -> HeadMajor {
        let [b, s, h, d] = t.shape();
        let x = t.to_f32_vec();
        let mut out = Vec::with_capacity(x.len());
        for bi in 0..b {
            for hi in 0..h {
                for si in 0..s {
                    let at = ((bi * s + si) * h + hi) * d;
                    out.extend_from_slice(&x[at..at + d]);
                }
            }
        }
        HeadMajor(Tensor::from_f32(&out, t.dtype(), [b, h, s, d]).expect("shape is consistent"))
    }

    /// The stored values as a `[batch, seqlen, heads, head_dim]` view (strided, no copy).
    pub fn view(&self) -> TensorView<'_> {
        let bhsd = self.0.shape();
        match self.0.view().data() {
            Data::F32(x) => TensorView::heads_major(x, bhsd),
            Data::F16(x) => TensorView::heads_major(x, bhsd),
            Data::BF16(x) => TensorView::heads_major(x, bhsd),
        }
    }
}

/// Bytes of K and V a decode step reads (each key and value once).
pub fn kv_bytes(case: &Case) -> u64 {
    2 * (case.batch * case.seqlen_k * case.heads_kv * case.head_dim * case.dtype.size()) as u64
}

/// Max |ours − float64 reference| over `n` sampled (batch, head, row) triples, spread over the
/// problem (first and last rows always included: they see the fewest/most keys under a mask).
pub fn sampled_max_error(p: &Problem, q: &Tensor, k: &Tensor, v: &Tensor, out: &Output, n: usize, seed: u64) -> f64 {
    let mut rng = Rng::new(seed);
    let mut rows = vec![(0, 0, 0), (p.batch - 1, p.heads_q - 1, p.seqlen_q - 1)];
    while rows.len() < n.max(2) {
        rows.push((rng.below(p.batch), rng.below(p.heads_q), rng.below(p.seqlen_q)));
    }
    let want = attention_f64_rows(p, &q.view(), &k.view(), &v.view(), &rows).expect("float64 reference");
    let o = out.o.data().as_data();
    let d = p.head_dim_v;
    let mut err = 0.0f64;
    for (&(b, h, i), w) in rows.iter().zip(&want) {
        let base = ((b * p.seqlen_q + i) * p.heads_q + h) * d;
        for (x, wx) in w.iter().enumerate() {
            let got = o.get_f32(base + x) as f64;
            let e = if got.is_nan() != wx.is_nan() { f64::INFINITY } else { (got - wx).abs() };
            if !e.is_nan() {
                err = err.max(e);
            }
        }
    }
    err
}

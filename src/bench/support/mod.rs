//! Shared by `benches/cpu.rs`, `benches/gpu.rs` and `examples/bench.rs`: the bench cases,
//! inputs, timing statistics, the f32 GEMM reference rate, the sampled error check and the
//! one-line JSON record every tool prints.

pub mod gpu;

use crate::numerics::rng::SplitMix64 as Rng;
use crate::reference::attention_f64_rows;
use crate::bench::roofline::{Math, Roofline};
use crate::serving::{BlockTable, KvCache};
use crate::bench::flops;
use crate::{DType, ForwardOptions, Mask, Output, Problem, Tensor};
use serde_json::{json, Map, Value};
use std::time::Instant;

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

/// Bytes of K and V a decode step reads (each key and value once).
pub fn kv_bytes(case: &Case) -> u64 {
    2 * (case.batch * case.seqlen_k * case.heads_kv * case.head_dim * case.dtype.size()) as u64
}

/// Median of a non-empty sample (mean of the two middle values for an even count).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
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
    let d = p.head_dim;
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

/// Makes `matrixmultiply` use every core (it reads `MATMUL_NUM_THREADS` once, defaulting to the
/// physical cores, at most 4). Call before the first GEMM; an explicit setting is kept.
pub fn gemm_use_all_cores() -> usize {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    if std::env::var_os("MATMUL_NUM_THREADS").is_none() {
        std::env::set_var("MATMUL_NUM_THREADS", n.to_string());
    }
    n
}

/// Row-major f32 operands of an `m×k · k×n` GEMM.
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Runs so far (to count the FLOPs of a block).
    pub runs_done: u64,
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

impl Gemm {
    pub fn new(m: usize, n: usize, k: usize) -> Gemm {
        let mut rng = Rng::new((m * 31 + n * 17 + k) as u64);
        let a = (0..m * k).map(|_| rng.normal() as f32).collect();
        let b = (0..k * n).map(|_| rng.normal() as f32).collect();
        Gemm { m, n, k, runs_done: 0, a, b, c: vec![0.0; m * n] }
    }
    pub fn flops(&self) -> u64 {
        2 * (self.m * self.n * self.k) as u64
    }
    pub fn id(&self) -> String {
        format!("m{}_n{}_k{}", self.m, self.n, self.k)
    }
    /// C = A·B with `matrixmultiply::sgemm` (multi-threaded).
    pub fn run(&mut self) {
        let (m, n, k) = (self.m, self.n, self.k);
        // SAFETY: a is m×k (row stride k), b is k×n (row stride n), c is m×n (row stride n), all
        // row-major with column stride 1 and allocated at exactly those sizes in `new`.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                self.a.as_ptr(),
                k as isize,
                1,
                self.b.as_ptr(),
                n as isize,
                1,
                0.0,
                self.c.as_mut_ptr(),
                n as isize,
                1,
            );
        }
        std::hint::black_box(&self.c);
        self.runs_done += 1;
    }
    /// Runs back to back for at least `ms` milliseconds (at least once); returns the FLOP/s of
    /// the block. Used as the time-matched GEMM beside an attention run.
    pub fn rate_for(&mut self, ms: f64) -> f64 {
        let t = Instant::now();
        let mut n = 0u64;
        loop {
            self.run();
            n += 1;
            if t.elapsed().as_secs_f64() * 1e3 >= ms {
                break;
            }
        }
        (n * self.flops()) as f64 / t.elapsed().as_secs_f64()
    }

    /// Median FLOP/s over `reps` runs after one warm-up.
    pub fn rate(&mut self, reps: usize) -> f64 {
        self.run();
        let ms: Vec<f64> = (0..reps.max(1)).map(|_| time_ms(|| self.run())).collect();
        flops::flops_per_second(self.flops(), median(&ms))
    }
}

/// The GEMM shapes measured beside attention: the attention products' shapes for a 2048-row
/// block at head_dim 128 (S = Q·Kᵀ: M=N=2048, K=128; O = P·V: M=2048, N=128, K=2048) and a large
/// square one (the machine's f32 rate).
pub const GEMM_SHAPES: [(usize, usize, usize); 3] = [(2048, 2048, 128), (2048, 128, 2048), (2048, 2048, 2048)];

/// The paired ratio of attention to GEMM on a shared machine: GEMM blocks and attention runs
/// alternate (`gemm[0], att[0], gemm[1], att[1], ...`), each attention rate is divided by the
/// mean of the GEMM blocks on either side of it (the one before when it is the last), and the
/// median of those ratios is returned. Load that changes slowly cancels out of each pair.
pub fn paired_ratio(gemm: &[f64], att: &[f64]) -> f64 {
    let ratios: Vec<f64> = att
        .iter()
        .enumerate()
        .filter_map(|(i, a)| {
            let before = *gemm.get(i)?;
            let g = gemm.get(i + 1).map_or(before, |after| 0.5 * (before + after));
            Some(a / g)
        })
        .collect();
    median(&ratios)
}

/// CPU seconds this process has used so far, all threads included (also finished ones):
/// utime + stime of /proc/self/stat, in USER_HZ = 100 ticks (fixed by the kernel ABI). `None`
/// off Linux. On a shared machine, work per CPU-second is what the code would do with the cores
/// to itself (less the cache and SMT sharing that remains).
pub fn process_cpu_seconds() -> Option<f64> {
    const USER_HZ: f64 = 100.0;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at field 3 (state); utime and
    // stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

/// Wall time of `f` in milliseconds.
pub fn time_ms(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e3
}

/// The CPU roofline of this run: the best measured GEMM rate as the compute ceiling and a
/// multi-threaded copy (256 MiB, beyond any LLC) as the bandwidth.
pub fn cpu_roofline(best_gemm: f64, gemm_what: &str) -> Roofline {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let bw = crate::bench::roofline::measure_copy_bandwidth(256 << 20, threads, 3);
    Roofline::cpu(
        crate::bench::roofline::cpu_name(),
        best_gemm,
        format!("matrixmultiply f32 sgemm measured in this run ({gemm_what})"),
        bw,
    )
}

/// One measured run, printed as one JSON line (the format `scripts/peers_torch.py` also writes
/// and `scripts/report.py` reads).
#[derive(Clone, Debug)]
pub struct Record {
    /// "flash_attn", "torch-sdpa-flash", "torch-sdpa-cudnn", "gemm".
    pub impl_name: String,
    pub machine: String,
    /// "cpu" or "cuda:N".
    pub backend: String,
    /// Kernel from `Output::dispatch` (or the peer's backend).
    pub kernel: String,
    /// The requested variant ("auto", "fa2", ...).
    pub variant: String,
    pub case: Case,
    pub precision: String,
    pub cost: flops::Cost,
    /// Median milliseconds per run.
    pub ms: f64,
    /// Fastest run (ms): on a shared machine the closest to the unloaded rate.
    pub ms_min: Option<f64>,
    pub runs: usize,
    pub roofline: Option<Roofline>,
    pub max_err: Option<f64>,
    pub err_rows: usize,
    /// The f32 GEMM rate (FLOP/s, CPU) the run is compared with: in `benches/cpu.rs` the
    /// 2048×2048×128 sgemm timed interleaved with this case's samples (median).
    pub gemm_flops: Option<f64>,
    /// The best (fastest-run) rate of that GEMM, FLOP/s.
    pub gemm_flops_best: Option<f64>,
    /// Median of the per-run attention ÷ GEMM ratios with time-matched GEMM blocks alternating
    /// with the runs ([`paired_ratio`]): the steadiest comparison on a loaded machine.
    pub gemm_ratio_paired: Option<f64>,
    /// Rates per CPU-second × threads (attention, GEMM), FLOP/s: what the run would do with the
    /// cores to itself ([`process_cpu_seconds`]).
    pub cpu_time_rates: Option<(f64, f64)>,
}

impl Record {
    pub fn flops_per_s(&self) -> f64 {
        flops::flops_per_second(self.cost.flops, self.ms)
    }

    pub fn json(&self) -> String {
        self.json_with([])
    }

    /// [`Record::json`] with extra fields, e.g. the GPU's driver and clocks, which
    /// `scripts/report.py` prints per machine.
    pub fn json_with<const N: usize>(&self, extra: [(&str, Value); N]) -> String {
        let mut fields = self.json_fields();
        fields.extend(extra.into_iter().map(|(k, v)| (k.to_string(), v)));
        Value::Object(fields).to_string()
    }

    /// The fields of the JSON object (a non-finite number is `null`).
    fn json_fields(&self) -> Map<String, Value> {
        let c = &self.case;
        let (window_left, window_right) = match c.mask {
            Mask::Window { left, right, .. } => (Some(left), Some(right)),
            _ => (None, None),
        };
        let ai = self.cost.intensity();
        let rate = self.flops_per_s();
        let roof = self.roofline.as_ref();
        let tera = |x: Option<f64>| x.map(|x| x / 1e12);
        let math = Math::of(c.dtype, crate::Precision::Native);
        let json = json!({
            "impl": self.impl_name,
            "machine": self.machine,
            "backend": self.backend,
            "kernel": self.kernel,
            "variant": self.variant,
            "dtype": c.dtype.to_string(),
            "precision": self.precision,
            "math": if self.precision == "native" { math.name() } else { "fp8" },
            "batch": c.batch,
            "seqlen_q": c.seqlen_q,
            "seqlen_k": c.seqlen_k,
            "heads_q": c.heads_q,
            "heads_kv": c.heads_kv,
            "head_dim": c.head_dim,
            "causal": c.causal(),
            "window_left": window_left,
            "window_right": window_right,
            "flops": self.cost.flops,
            "bytes": self.cost.bytes,
            "intensity": ai,
            "ms": self.ms,
            "ms_min": self.ms_min,
            "runs": self.runs,
            "tflops": rate / 1e12,
            "peak_tflops": tera(roof.map(|r| r.peak_flops)),
            "bandwidth_tbs": tera(roof.map(|r| r.bandwidth)),
            "pct_roofline": roof.map(|r| r.percent(rate, ai)),
            "roofline_source": roof.map(|r| format!("{} | {}", r.peak_source, r.bandwidth_source)),
            "gemm_tflops": tera(self.gemm_flops),
            "gemm_tflops_best": tera(self.gemm_flops_best),
            "gemm_ratio_paired": self.gemm_ratio_paired,
            "tflops_cputime": tera(self.cpu_time_rates.map(|r| r.0)),
            "gemm_tflops_cputime": tera(self.cpu_time_rates.map(|r| r.1)),
            "max_err": self.max_err,
            "err_rows": self.err_rows,
        });
        match json {
            Value::Object(m) => m,
            _ => unreachable!("json! of an object literal"),
        }
    }
}

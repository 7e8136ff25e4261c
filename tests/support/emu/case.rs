//! One emulated launch of a problem: the case, its run under several scheduler seeds against the
//! float64 reference with the GPU tests' rule, and many cases on worker threads.

use super::*;

/// One emulated launch of a problem.
#[derive(Clone, Debug)]
pub struct Case {
    pub family: &'static str,
    pub dtype: DType,
    pub q: [usize; 4],
    pub k: [usize; 4],
    /// V's (and O's) head dim: k's, unless set (the fa2v row's pairs).
    pub dv: usize,
    pub opts: ForwardOptions,
    /// Inputs are N(0, scale^2): large scales give large-magnitude scores.
    pub input_scale: f32,
    pub seeds: Vec<u64>,
    /// Persistent grid size (stage 5).
    pub sm_count: u32,
    /// Tensors laid out [b, h, s, d] in memory (strides differ from the contiguous [b, s, h, d]).
    pub bhsd: bool,
    pub label: String,
    /// The edges of the input domain (README): the softmax scale that makes the largest |q·k|
    /// this value (e.g. near f32::MAX, where log2-unit scores overflow), compared with the naive
    /// f32 softmax (a 16-bit one overflows) and LSEs relative to their size.
    pub max_score: Option<f64>,
    /// Every V set to this value (inf or NaN): rows that see no key must be exactly 0 with LSE
    /// -inf, rows that see keys non-finite.
    pub v_fill: Option<f32>,
    /// FA4's softmax rows (docs/fa4.md, "Part 1"): also compare O with the CPU backend run with
    /// the row's softmax as options (`Exp2::Poly(degree)` where the row has a share,
    /// `Rescale::Lazy { tau }` where it has a threshold), the oracle of the exponent sequence.
    pub cpu_oracle: bool,
}

impl Case {
    pub fn new(family: &'static str, dtype: DType, q: [usize; 4], k: [usize; 4], mut opts: ForwardOptions) -> Self {
        // An FA4 stage runs only when `fa4_stage` names it (its host refuses the plan otherwise):
        // ask for the row the case names, as a caller would.
        if let Some(row) = FAMILIES.iter().find(|f| f.name == family && f.variant == KernelVariant::Fa4) {
            opts.variant = Variant::Fa4;
            opts.fa4_stage = row.ladder_stage();
        }
        Case {
            family,
            dtype,
            q,
            k,
            dv: k[3],
            opts,
            input_scale: 1.0,
            seeds: vec![1, 2, 3],
            sm_count: 1,
            bhsd: false,
            label: String::new(),
            max_score: None,
            v_fill: None,
            cpu_oracle: false,
        }
    }
    pub fn name(&self) -> String {
        format!(
            "{} {:?} q{:?} k{:?}{}{} {:?}{}{}{} sms{}{}",
            self.family,
            self.dtype,
            self.q,
            self.k,
            if self.dv == self.k[3] { String::new() } else { format!(" dv{}", self.dv) },
            if self.bhsd { " [b,h,s,d]" } else { "" },
            self.opts.mask,
            self.opts.softcap.map_or(String::new(), |c| format!(" softcap{c}")),
            if self.opts.return_lse { " lse" } else { "" },
            if self.opts.alibi_slopes.is_some() { " alibi" } else { "" },
            self.sm_count,
            if self.label.is_empty() { String::new() } else { format!(" [{}]", self.label) }
        )
    }
}

/// A passing case: max error over its bound, and the emulator's log.
#[derive(Clone, Debug)]
pub struct Pass {
    pub ratio: f64,
    /// With `Case::cpu_oracle`: max |O - O_cpu| over max |O_ref| (both outputs 16-bit), in
    /// units of the dtype's epsilon.
    pub oracle_ulps: Option<f64>,
    pub log: String,
    /// The launch the run made.
    pub plan: LaunchPlan,
}
/// The outcome of one case: Ok, or Err(why, with the emulator's log).
pub type Outcome = Result<Pass, String>;

fn bits_of(t: &Tensor) -> Vec<u8> {
    match t.view().data() {
        Data::F16(s) => s.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        Data::BF16(s) => s.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        _ => panic!("the emulated kernels take f16/bf16"),
    }
}

/// Runs `c` under the emulator (with `mutation` if any) and compares with the reference.
pub fn run_case(c: &Case, mutation: Option<&Mutation>) -> Outcome {
    let mut h = DefaultHasher::new();
    c.name().hash(&mut h);
    let mut rng = Rng::new(h.finish() | 1);
    let mut gen = |shape: [usize; 4]| {
        let t = randn(&mut rng, c.dtype, shape);
        if c.input_scale == 1.0 {
            t
        } else {
            let v: Vec<f32> = t.to_f32_vec().iter().map(|x| x * c.input_scale).collect();
            Tensor::from_f32(&v, c.dtype, shape).unwrap()
        }
    };
    // [b, h, s, d] storage: generate that shape, view it as [b, s, h, d] with its strides.
    let bhsd = |s: [usize; 4]| if c.bhsd { [s[0], s[2], s[1], s[3]] } else { s };
    // v: k's shape with V's head dim; o: q's with V's head dim.
    let (v_shape, o_shape) = ([c.k[0], c.k[1], c.k[2], c.dv], [c.q[0], c.q[1], c.q[2], c.dv]);
    let (q, k, mut v) = (gen(bhsd(c.q)), gen(bhsd(c.k)), gen(bhsd(v_shape)));
    if let Some(x) = c.v_fill {
        v = Tensor::from_f32(&vec![x; v.numel()], c.dtype, v.shape()).unwrap();
    }
    let mut opts = c.opts.clone();
    if let Some(target) = c.max_score {
        assert!(!c.bhsd, "max_score cases use the contiguous layout");
        let ([b, sq, hq, d], [_, sk, hk, _]) = (c.q, c.k);
        let (qx, kx) = (q.to_f32_vec(), k.to_f32_vec());
        let mut max_dot = 0.0f64;
        for bi in 0..b {
            for h in 0..hq {
                for i in 0..sq {
                    let qr = &qx[((bi * sq + i) * hq + h) * d..][..d];
                    for j in 0..sk {
                        let kr = &kx[((bi * sk + j) * hk + h / (hq / hk)) * d..][..d];
                        let dot: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                        max_dot = max_dot.max(dot.abs());
                    }
                }
            }
        }
        opts.softmax_scale = Some((target / max_dot) as f32);
    }
    fn view<'a>(t: &'a Tensor, s: [usize; 4], bhsd: bool) -> TensorView<'a> {
        if !bhsd {
            return t.view();
        }
        let st = [s[2] * s[1] * s[3], s[3], s[1] * s[3]];
        match t.view().data() {
            Data::F16(d) => TensorView::with_strides(d, s, st),
            Data::BF16(d) => TensorView::with_strides(d, s, st),
            _ => unreachable!(),
        }
    }
    let (qv, kv, vv) = (view(&q, c.q, c.bhsd), view(&k, c.k, c.bhsd), view(&v, v_shape, c.bhsd));
    // O is laid out as Q is ([b, s, h, d] or [b, h, s, d]), with V's head dim.
    let o_strides = if c.bhsd {
        [o_shape[2] * o_shape[1] * o_shape[3], o_shape[3], o_shape[1] * o_shape[3]]
    } else {
        [o_shape[1] * o_shape[2] * o_shape[3], o_shape[2] * o_shape[3], o_shape[3]]
    };
    let p = Problem::new(&qv, &kv, &vv, &opts).map_err(|e| format!("problem: {e}"))?;
    use addr::{ALIBI, K, LSE, O, Q, SINKS, V};
    let ops = Operands {
        ptrs: [Q, K, V, O],
        strides: [qv.strides(), kv.strides(), vv.strides(), o_strides],
        lse: if c.opts.return_lse { LSE } else { 0 },
        alibi: if c.opts.alibi_slopes.is_some() { ALIBI } else { 0 },
        sinks: if p.sinks.is_some() { SINKS } else { 0 },
    };
    let pl: LaunchPlan = plan(c.family, &p, &ops, c.sm_count).map_err(|e| format!("plan: {e}"))?;
    let fam = FAMILIES.iter().find(|f| f.name == c.family).unwrap();
    let exe = unit_exe(fam, pl.tile, mutation)?;

    let dir = work_dir().join("runs").join(format!("{:016x}{}", h.finish(), mutation.map_or("", |m| m.name)));
    let n_o = o_shape.iter().product::<usize>() * 2;
    let mut bufs = vec![
        LaunchBuf::input("q", Q, bits_of(&q)),
        LaunchBuf::input("k", K, bits_of(&k)),
        LaunchBuf::input("v", V, bits_of(&v)),
        LaunchBuf::output("o", O, n_o),
    ];
    let n_lse = p.batch * p.heads_q * p.seqlen_q;
    if c.opts.return_lse {
        bufs.push(LaunchBuf::output("lse", LSE, n_lse * 4));
    }
    if let Some(s) = &c.opts.alibi_slopes {
        bufs.push(LaunchBuf::input("alibi", ALIBI, s.iter().flat_map(|x| x.to_le_bytes()).collect()));
    }
    if let Some(s) = &p.sinks {
        bufs.push(LaunchBuf::input("sinks", SINKS, s.iter().flat_map(|x| x.to_le_bytes()).collect()));
    }
    let (log, outs) = run_launch(&exe, &dir, &pl, c.family, &c.seeds, &bufs)?;
    // Outputs against the float64 reference, with the GPU tests' rule.
    let o_bytes = &outs["o"];
    let stored: Vec<f64> = o_bytes
        .chunks_exact(2)
        .map(|b| {
            let bits = u16::from_le_bytes([b[0], b[1]]);
            match c.dtype {
                DType::BF16 => half::bf16::from_bits(bits).to_f64(),
                _ => half::f16::from_bits(bits).to_f64(),
            }
        })
        .collect();
    // O has Q's layout: back to [b, s, h, dv] order for the comparison.
    let [ob, os, oh, od] = o_shape;
    let mut o = vec![0.0; stored.len()];
    for b in 0..ob {
        for si in 0..os {
            for h in 0..oh {
                let src = if c.bhsd { ((b * oh + h) * os + si) * od } else { ((b * os + si) * oh + h) * od };
                let dst = ((b * os + si) * oh + h) * od;
                o[dst..dst + od].copy_from_slice(&stored[src..src + od]);
            }
        }
    }
    let r = attention_f64(&p, &qv, &kv, &vv).unwrap();
    let lse_out = || -> Vec<f64> {
        let lb = &outs["lse"];
        lb.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64).collect()
    };
    if c.v_fill.is_some() {
        // Rows that see no key: exactly 0 and LSE -inf; rows that see an inf/NaN V: not finite.
        let d = p.head_dim_v;
        for (idx, (&got, &want)) in o.iter().zip(&r.o).enumerate() {
            let i = (idx / d / p.heads_q) % p.seqlen_q;
            let (lo, hi) = p.key_range(i);
            if lo >= hi && got != 0.0 {
                return Err(format!("row {i} sees no key but O = {got} at element {idx}\n{log}"));
            }
            if lo < hi && !want.is_finite() && got.is_finite() {
                return Err(format!("row {i} sees a non-finite V but O = {got} at element {idx}\n{log}"));
            }
        }
        if c.opts.return_lse {
            let bad = lse_out().iter().zip(&r.lse).position(|(&g, &w)| w == f64::NEG_INFINITY && g != w);
            if let Some(at) = bad {
                return Err(format!("LSE {at} of a row that sees no key is not -inf\n{log}"));
            }
        }
        return Ok(Pass { ratio: 0.0, oracle_ulps: None, log, plan: pl });
    }
    // Scores near f32::MAX: the straightforward softmax in f32 is the yardstick (in a 16-bit
    // dtype its scores overflow).
    let naive_dtype = if c.max_score.is_some() { DType::F32 } else { c.dtype };
    let naive = attention_naive(&p, &qv, &kv, &vv, naive_dtype).unwrap();
    if c.max_score.is_some() && o.iter().any(|x| !x.is_finite()) && naive.iter().all(|x| x.is_finite()) {
        return Err(format!("the naive f32 softmax is finite, the kernel's output is not\n{log}"));
    }
    let mut err = max_abs_diff(&o, &r.o);
    let bound = 2.0 * max_abs_diff(&naive, &r.o) + floor_for(c.dtype);
    if err > bound && c.max_score.is_some() {
        // Rows of a near tie may differ from the reference (near_tie_row_ok); every other row is
        // held to the bound.
        let (qx, kx, vx) = (q.to_f32_vec(), k.to_f32_vec(), v.to_f32_vec());
        let d = p.head_dim_v;
        let mut rest = 0.0f64;
        let mut all_ok = true;
        for (row, (got, want)) in o.chunks_exact(d).zip(r.o.chunks_exact(d)).enumerate() {
            let e = max_abs_diff(got, want);
            if e <= bound {
                rest = rest.max(e);
            } else if !near_tie_row_ok(&p, &qx, &kx, &vx, row, got, bound) {
                all_ok = false;
            }
        }
        if all_ok {
            err = rest;
        }
    }
    // max_abs_diff counts a NaN where the reference has a number as infinitely wrong.
    if err > bound {
        let worst = o.iter().zip(&r.o).enumerate().max_by(|a, b| {
            let e = |x: &(usize, (&f64, &f64))| if x.1 .0.is_nan() { f64::INFINITY } else { (x.1 .0 - x.1 .1).abs() };
            e(a).total_cmp(&e(b))
        });
        return Err(format!("max |O - ref| {err:.3e} > bound {bound:.3e} (worst at {worst:?})\n{log}"));
    }
    if c.opts.return_lse {
        let lse = lse_out();
        // Large scores: the LSE is as large, compared relative to its size and rounded to f32.
        let (lerr, tol) = match c.max_score {
            None => (max_abs_diff(&lse, &r.lse), LSE_TOL),
            Some(t) => {
                let r32: Vec<f64> = r.lse.iter().map(|&x| x as f32 as f64).collect();
                (max_abs_diff(&lse, &r32), 1e-6 * t.max(1e3))
            }
        };
        if lerr > tol {
            return Err(format!("max |LSE - ref| {lerr:.3e} > {tol:e}\n{log}"));
        }
    }
    let oracle_ulps = if c.cpu_oracle { Some(cpu_oracle_ulps(c, &opts, &qv, &kv, &vv, &o, &r.o)?) } else { None };
    Ok(Pass { ratio: err / bound, oracle_ulps, log, plan: pl })
}

/// Runs cases on up to `threads` worker threads; returns (case name, outcome) in order.
pub fn run_all(cases: &[Case], mutation: Option<&Mutation>, threads: usize) -> Vec<(String, Outcome)> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Mutex<Vec<(usize, String, Outcome)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.max(1).min(cases.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(c) = cases.get(i) else { break };
                let t0 = std::time::Instant::now();
                let r = run_case(c, mutation);
                let name = format!("{} ({:.1} s)", c.name(), t0.elapsed().as_secs_f64());
                results.lock().unwrap().push((i, name, r));
            });
        }
    });
    let mut v = results.into_inner().unwrap();
    v.sort_by_key(|x| x.0);
    v.into_iter().map(|(_, n, r)| (n, r)).collect()
}

//! The f32 GEMM reference rate (matrixmultiply) and the CPU roofline built from it.

use crate::bench::flops;
use crate::bench::roofline::Roofline;
use crate::numerics::rng::SplitMix64 as Rng;
use super::{median, time_ms};
use std::time::Instant;

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

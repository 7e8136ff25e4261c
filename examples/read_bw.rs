//! The machine's memory read rate, for the decode rows of `scripts/bench/cpu-peers.sh`: a decode step
//! reads every K/V row once, so its GB/s of K/V read is bounded by how fast the cores can stream
//! from DRAM, and the table says how close to that it comes.
//!
//! ```text
//! cargo run --release --example read_bw -- [--mib 512] [--threads N] [--reps 10]
//! ```
//! Each of `threads` workers first fills its own share of a `mib` MiB f32 buffer (far above the
//! last-level cache), then all of them sum their shares together, `reps` times, started and stopped
//! by a barrier; one JSON line: the median and the best repetition as GB/s of the whole buffer.
//! The sum keeps 32 independent lanes (8 vector accumulators), so the loop is bound by the loads,
//! not by the latency of the additions.

use std::sync::Barrier;
use std::time::Instant;

/// Sum of a slice in 32 independent lanes (vectorises with no reordering of any one lane's sum).
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 32];
    let chunks = x.chunks_exact(32);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn main() {
    let (mut mib, mut threads, mut reps) = (512usize, 0usize, 10usize);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let val = it.next().and_then(|v| v.parse::<usize>().ok());
        match (flag.as_str(), val) {
            ("--mib", Some(v)) => mib = v.max(1),
            ("--threads", Some(v)) => threads = v,
            ("--reps", Some(v)) => reps = v.max(1),
            _ => {
                eprintln!("usage: read_bw [--mib 512] [--threads N] [--reps 10] (bad or missing value at {flag})");
                std::process::exit(2);
            }
        }
    }
    if threads == 0 {
        threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    }
    let per = mib * (1 << 20) / 4 / threads;
    // Each worker times its own passes (a timer thread of its own would share the cores and be
    // descheduled at the wrong moments); a repetition lasts from the first start to the last end.
    let barrier = Barrier::new(threads);
    let mut total = 0.0f32;
    let spans: Vec<Vec<(Instant, Instant)>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = &barrier;
                s.spawn(move || {
                    // Filled by the thread that reads it (its pages, its core's caches).
                    let buf = vec![1.0f32; per];
                    let mut t = 0.0f32;
                    let mut own = Vec::with_capacity(reps + 1);
                    for _ in 0..reps + 1 {
                        barrier.wait();
                        let t0 = Instant::now();
                        t += std::hint::black_box(sum(std::hint::black_box(&buf)));
                        own.push((t0, Instant::now()));
                    }
                    (t, own)
                })
            })
            .collect();
        workers
            .into_iter()
            .filter_map(|w| w.join().ok())
            .map(|(t, own)| {
                total += t;
                own
            })
            .collect()
    });
    if spans.len() != threads {
        eprintln!("read_bw: a worker thread failed");
        std::process::exit(1);
    }
    // The first pass is a warm-up.
    let mut times: Vec<f64> = (1..=reps)
        .map(|r| {
            let t0 = spans.iter().map(|w| w[r].0).min();
            let t1 = spans.iter().map(|w| w[r].1).max();
            t0.zip(t1).map_or(f64::NAN, |(a, b)| b.duration_since(a).as_secs_f64())
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let bytes = (per * threads * 4) as f64;
    let med = times[times.len() / 2];
    println!(
        "{{\"read_bw\": true, \"mib\": {mib}, \"threads\": {threads}, \"reps\": {reps}, \"ms\": {:.3}, \
         \"gbps\": {:.2}, \"gbps_best\": {:.2}, \"checksum\": {total}}}",
        med * 1e3,
        bytes / med / 1e9,
        bytes / times[0] / 1e9
    );
}

//! Timing statistics: medians, the paired attention/GEMM ratio, process CPU time.

use std::time::Instant;

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

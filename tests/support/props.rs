//! The one proptest configuration of every property test, so that a plain `cargo test` (and CI)
//! is reproducible and the fuzz command (`scripts/fuzz.sh`) runs the same properties at random.
//!
//! - Seed: `FLASH_ATTN_PROPTEST_SEED` = a u64, or `random` (a fresh seed, printed); unset, the
//!   fixed [`CI_SEED`], so a failure in CI is a failure of the change, not of the draw.
//! - Cases: each property's own count times `FLASH_ATTN_PROPTEST_SCALE` (a positive number,
//!   default 1).
//! - Regressions: failures are saved beside the test source (`tests/cpu/domain_edges.rs` saves
//!   `tests/cpu/domain_edges.proptest-regressions`, committed) and every saved case runs first on
//!   every later run, whatever the seed.
//!
//! The seed and the case count are printed (the test harness shows them with a failure), so a
//! failing run is reproduced by setting the same seed.
//!
//! Beside it, the strategies several modules draw from ([`mask_strategy`]).
#![allow(dead_code)]

use flash_attn::Mask;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, RngSeed};

/// The seed of a run that sets none.
pub const CI_SEED: u64 = 0x5eed_f1a5_4a77_2026;

/// The environment's seed: fixed unless `FLASH_ATTN_PROPTEST_SEED` says otherwise.
fn seed() -> u64 {
    match std::env::var("FLASH_ATTN_PROPTEST_SEED") {
        Err(_) => CI_SEED,
        Ok(s) if s == "random" => {
            // Distinct per test in one process: the clock and a per-call counter.
            static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut rng = flash_attn::numerics::rng::SplitMix64::new(now ^ (std::process::id() as u64) << 32 ^ n);
            rng.next_u64()
        }
        Ok(s) => s.parse().unwrap_or_else(|_| panic!("FLASH_ATTN_PROPTEST_SEED={s:?}: expected a u64 or `random`")),
    }
}

/// `cases` scaled by `FLASH_ATTN_PROPTEST_SCALE`.
fn scaled(cases: u32) -> u32 {
    match std::env::var("FLASH_ATTN_PROPTEST_SCALE") {
        Err(_) => cases,
        Ok(s) => {
            let k: f64 = s
                .parse()
                .ok()
                .filter(|k: &f64| *k > 0.0 && k.is_finite())
                .unwrap_or_else(|| panic!("FLASH_ATTN_PROPTEST_SCALE={s:?}: expected a positive number"));
            ((cases as f64 * k).round() as u32).max(1)
        }
    }
}

/// The configuration of a property in `source_file` (pass `file!()`) with `cases` cases at
/// scale 1. Prints the seed and count under `name`.
pub fn config(name: &str, source_file: &'static str, cases: u32) -> Config {
    let seed = seed();
    let cases = scaled(cases);
    // Rejected draws (`prop_assume!`) in proportion to the cases: a fixed cap aborts a scaled run.
    let defaults = Config::default();
    println!("proptest {name}: seed {seed}, {cases} cases (FLASH_ATTN_PROPTEST_SEED={seed} reruns them)");
    Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        source_file: Some(source_file),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        max_global_rejects: defaults.max_global_rejects.max(cases),
        max_local_rejects: defaults.max_local_rejects.max(cases.saturating_mul(16)),
        ..defaults
    }
}

/// Every mask kind: none, causal, and windows (plain and causal) whose sides run from -1
/// (unbounded) to `bound - 1`.
pub fn mask_strategy(bound: i64) -> impl Strategy<Value = Mask> {
    prop_oneof![
        Just(Mask::None),
        Just(Mask::Causal),
        (-1i64..bound, -1i64..bound).prop_map(|(l, r)| Mask::window(l, r)),
        (-1i64..bound).prop_map(Mask::causal_window),
    ]
}

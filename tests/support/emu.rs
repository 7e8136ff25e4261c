//! Running kernel sources in the CPU emulator (cuda/test/emu) from Rust: building one program
//! per (family, head dim) unit with g++ (cached under the target dir by a hash of every source and
//! flag), turning a problem into the crate's own launch plan (`flash_attn::cuda::plan`), writing
//! it as a launch file with the inputs, running it under several scheduler seeds, and checking the
//! outputs against the float64 reference with the GPU tests' rule.
#![allow(dead_code)]

use super::{floor_for, randn, Rng};
use flash_attn::cuda::plan::{plan, LaunchPlan, Operands, TensorMapArgs};
use flash_attn::cuda::table::{
    append_kv_symbol, kernel_symbol, APPEND_KV_FAMILY, targets_for, unit_source, Family, KernelVariant, Tile, DTYPE_NAMES, FAMILIES, IMAGES,
};
use flash_attn::reference::{attention_f64, attention_naive, max_abs_diff};
use flash_attn::{DType, Data, ForwardOptions, Problem, Tensor, TensorView, Variant};
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

/// Building emulator programs with g++: kernel units, tools, mutated trees; cached by content.
mod build;
/// One emulated launch of a problem: the case, its run against the reference, many on threads.
mod case;
/// Launch files: buffers at device addresses, the run of a program on one.
mod launch;
/// The reference rule on one sequence, and what an emulated result may differ by beyond it: the
/// CPU oracle's bound, near ties at huge scores.
mod oracle;

pub use build::*;
pub use case::*;
pub use launch::*;
pub use oracle::*;

/// LSE tolerance of the GPU tests (tests/gpu/): f32 softmax statistics.
pub const LSE_TOL: f64 = 2e-3;

pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}
fn work_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("emu");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The seed of a full matrix's random configurations: `FLASH_ATTN_EMU_SEED` (a u64, or `random`
/// for a fresh one), else `fixed`, so the full matrix is reproducible and the fuzz command can
/// draw new configurations. Printed under `what`, so a failing draw can be replayed.
pub fn matrix_seed(what: &str, fixed: u64) -> u64 {
    let seed = match std::env::var("FLASH_ATTN_EMU_SEED") {
        Err(_) => fixed,
        Ok(s) if s == "random" => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            Rng::new(now ^ (std::process::id() as u64) << 32 ^ fixed).next_u64()
        }
        Ok(s) => s.parse().unwrap_or_else(|_| panic!("FLASH_ATTN_EMU_SEED={s:?}: expected a u64 or `random`")),
    };
    println!("{what}: random configurations from seed {seed} (FLASH_ATTN_EMU_SEED={seed} replays them)");
    seed
}

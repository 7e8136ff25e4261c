//! The FA2 backward's launches as data (`cuda/fa2_bwd.cu`, the standalone row "fa2_bwd" of
//! build/instances.rs; docs/fa2-backward.md): three kernels on one stream sharing one
//! [`BwdParams`]: the preprocess (D = rowsum(dO ∘ O), the dq accumulator zeroed), the main kernel
//! over key blocks (dK, dV, dQ accumulated), the dq conversion; and a fourth, the attention
//! sinks' gradient from D and the LSE, when the caller takes it (`BwdOperands::d_sinks`). The
//! CPU emulator runs exactly
//! these plans (`tests/emulator/backward.rs`), and `Engine::backward` launches them for an
//! explicit `Variant::Fa2`; the kernels have run in the emulator and been compile-checked, never
//! on a GPU, so `Variant::Auto` does not pick them (build/instances.rs `BACKWARD_AUTO`).
//!
//! Preconditions the plan checks (typed errors, never a panic): f16/bf16; head_dim one of the
//! instance dims (no tail masking); every tensor 16-byte aligned with strides that are multiples
//! of 8 elements (16-byte cp.async rows); grid limits (heads and batch at most 65535, seqlens
//! within the kernels' i32 with room for a tile).

use super::bwd_params::{BwdOperands, BwdParams};
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::{DType, Variant};

/// One instance of the main kernel: (head_dim, query rows per iteration, keys per CTA,
/// threads, dynamic shared memory bytes). Mirrors `Fa2BwdTile` (cuda/fa2/bwd_traits.cuh); the
/// kernel source static_asserts the same numbers.
pub const TILES: [(u32, u32, u32, u32, u32); 6] = [
    (32, 64, 64, 128, 30208),
    (64, 64, 64, 128, 46592),
    (96, 64, 64, 128, 62976),
    (128, 32, 64, 128, 57088),
    (192, 64, 32, 128, 82432),
    (256, 32, 32, 128, 70400),
];

/// Threads and query rows per CTA of the preprocess and convert kernels (kBwdRowThreads,
/// kBwdRowsPerCta).
const ROW_THREADS: u32 = 128;
const ROWS_PER_CTA: usize = 16;
/// The sink gradient's kernel (one CTA of ROW_THREADS per query head) and its dynamic shared
/// memory, one f32 per warp (`kBwdSinkSmemBytes`, cuda/fa2/bwd_sink_grad.cuh).
pub const SINK_GRAD_KERNEL: &str = "fa2_bwd_sink_grad";
const SINK_GRAD_SMEM: u32 = ROW_THREADS / 32 * 4;
/// The main kernel's place in [`BwdPlan::launches`] (the one that takes tensor maps).
pub const MAIN_LAUNCH: usize = 1;

/// One kernel launch of the sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct BwdLaunch {
    pub kernel: String,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub smem_bytes: u32,
}

/// The backward of one problem: the launches in order (preprocess, main, dq conversion, and the
/// sink gradient when `d_sinks` is set), their parameters and the f32 scratch they need.
#[derive(Clone, Debug)]
pub struct BwdPlan {
    pub launches: Vec<BwdLaunch>,
    pub params: BwdParams,
    /// Floats of `dq_accum`: `splits × batch × heads_q × seqlen_q × head_dim`.
    pub dq_accum_floats: usize,
    /// Floats of `d_sum`: `batch × heads_q × seqlen_q`.
    pub d_sum_floats: usize,
}

fn refuse(reason: String) -> Error {
    Error::VariantUnavailable { variant: Variant::Fa2, reason: format!("fa2 backward: {reason}") }
}

/// The launches of `p`'s backward over `ops`. `deterministic`: dq from per-key-block partials
/// summed in order (bit-identical run to run) instead of f32 atomics.
///
/// # Errors
/// `Error::UnsupportedDType` for dtypes other than f16/bf16, `Error::VariantUnavailable` naming
/// the reason for a head dim without an instance or a misaligned tensor, `Error::TooLarge` past
/// the grid or index limits.
pub fn plan(p: &Problem, ops: &BwdOperands, deterministic: bool) -> Result<BwdPlan> {
    let dtype = match p.dtype {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => {
            return Err(Error::UnsupportedDType {
                dtype: other,
                backend: "the FA2 backward kernels".into(),
                supported: "F16, BF16".into(),
            })
        }
    };
    let Some(&(head_dim, _block_m, block_n, threads, smem)) = TILES.iter().find(|t| t.0 as usize == p.head_dim) else {
        return Err(refuse(format!("head_dim {} has no instance (32, 64, 96, 128, 192, 256)", p.head_dim)));
    };
    const NAMES: [&str; 8] = ["q", "k", "v", "o", "dO", "dq", "dk", "dv"];
    for ((name, &ptr), strides) in NAMES.iter().zip(&ops.ptrs).zip(&ops.strides) {
        if !ptr.is_multiple_of(16) || strides.iter().any(|s| !s.is_multiple_of(8)) {
            return Err(refuse(format!(
                "{name} at {ptr:#x} with strides {strides:?}: needs 16-byte alignment and strides that are multiples of 8 elements"
            )));
        }
    }
    for (what, n) in [("batch", p.batch), ("heads_q", p.heads_q)] {
        if n > 65535 {
            return Err(Error::TooLarge { what: format!("{what} {n} (grid limit 65535)") });
        }
    }
    for (what, n) in [("seqlen_q", p.seqlen_q), ("seqlen_k", p.seqlen_k)] {
        if n > 1 << 30 {
            return Err(Error::TooLarge { what: format!("{what} {n} (the kernels index rows with i32, up to 2^30)") });
        }
    }
    let key_blocks = p.seqlen_k.div_ceil(block_n as usize);
    let splits = if deterministic { key_blocks } else { 1 };
    let rows = p.batch * p.heads_q * p.seqlen_q;
    let dq_accum_floats = splits
        .checked_mul(rows)
        .and_then(|x| x.checked_mul(p.head_dim))
        .ok_or_else(|| Error::TooLarge { what: format!("dq accumulator of {splits} x {rows} rows") })?;
    let params = BwdParams::for_launch(p, ops, deterministic, splits, block_n);
    let row_grid = (p.seqlen_q.div_ceil(ROWS_PER_CTA) as u32, p.heads_q as u32, p.batch as u32);
    let row_launch = |kernel: String| BwdLaunch { kernel, grid: row_grid, block: (ROW_THREADS, 1, 1), smem_bytes: 0 };
    let mut launches = vec![
        row_launch(format!("fa2_bwd_preprocess_{dtype}")),
        BwdLaunch {
            kernel: format!("fa2_bwd_hd{head_dim}_{dtype}"),
            grid: (key_blocks as u32, p.heads_kv as u32, p.batch as u32),
            block: (threads, 1, 1),
            smem_bytes: smem,
        },
        row_launch(format!("fa2_bwd_convert_dq_{dtype}")),
    ];
    if ops.d_sinks != 0 {
        // After the preprocess (it reads D); last, so the main kernel keeps MAIN_LAUNCH.
        launches.push(BwdLaunch {
            kernel: SINK_GRAD_KERNEL.into(),
            grid: (p.heads_q as u32, 1, 1),
            block: (ROW_THREADS, 1, 1),
            smem_bytes: SINK_GRAD_SMEM,
        });
    }
    Ok(BwdPlan {
        launches,
        params,
        dq_accum_floats,
        d_sum_floats: rows,
    })
}

/// Every kernel symbol of the image (build/instances.rs lists the same).
pub fn kernel_symbols() -> Vec<String> {
    let mut v = Vec::new();
    for dt in ["f16", "bf16"] {
        v.push(format!("fa2_bwd_preprocess_{dt}"));
        v.push(format!("fa2_bwd_convert_dq_{dt}"));
        v.extend(TILES.iter().map(|t| format!("fa2_bwd_hd{}_{dt}", t.0)));
    }
    v.push(SINK_GRAD_KERNEL.into());
    v
}

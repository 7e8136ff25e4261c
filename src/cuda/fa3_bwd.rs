//! The FA3-style backward's launches as data (`cuda/fa3_bwd_sm90.cu`, the standalone row
//! "fa3_bwd" of build/instances.rs; docs/fa3-backward.md): FA2's preprocess and dq conversion
//! ([`super::fa2_bwd::plan`]) around the sm_90a main kernel, which takes the [`BwdParams`] and
//! four tensor maps (Q, K, V, dO). The engine launches these plans and the CPU emulator runs
//! their launches (`tests/emulator/backward.rs`), so the two cannot drift; the kernel source
//! static_asserts the same shared-memory sizes, threads and keys per CTA.
//!
//! Preconditions the plan checks (typed errors, never a panic): everything FA2's plan checks;
//! head_dim 64 or 128; no softcap and no ALiBi (the kernel has neither); the tensor-map limits
//! of every operand.

use super::bwd_params::{BwdOperands, BwdParams};
use super::fa2_bwd::{self, BwdLaunch, BwdPlan};
use super::fa3::tma::{tma_spec, OperandLayout};
use super::launch::{TensorMapArgs, TMA_DTYPE_BFLOAT16, TMA_DTYPE_FLOAT16};
use crate::error::{Error, Operand, Result};
use crate::problem::Problem;
use crate::{DType, Variant};

/// The main kernel's instances: (head_dim, dynamic shared memory bytes), mirroring
/// `Fa3BwdTraits<D>::kSmemBytes` (cuda/fa3/bwd_traits.cuh; the launch table of
/// cuda/fa3_bwd_sm90.cu static_asserts the same numbers).
pub const TILES: [(u32, u32); 2] = [(64, 85032), (128, 150568)];

/// Threads per CTA: one producer and two consumer warpgroups (`Fa3BwdTraits::kThreads`).
pub const THREADS: u32 = 384;
/// Keys per CTA: 64 per consumer warpgroup (`Fa3BwdTraits::kBlockN`): the K and V box rows.
pub const BLOCK_N: u32 = 128;
/// Query rows per ring slot (`Fa3BwdTraits::kBlockM`): the Q and dO box rows.
pub const BLOCK_M: u32 = 64;
/// Keys per dq partial the consumers write (each consumer warpgroup's 64 keys): the
/// `BwdParams::block_n` the dq conversion sums over in the deterministic mode.
pub const DQ_PARTIAL_KEYS: u32 = 64;

/// The backward of one problem with the FA3-style main kernel: the launches (FA2's preprocess,
/// this main kernel, FA2's conversion and, with `d_sinks`, FA2's sink gradient), their
/// parameters and scratch, and the main
/// kernel's four tensor maps (Q, K, V, dO), in argument order.
#[derive(Clone, Debug)]
pub struct Fa3BwdPlan {
    pub bwd: BwdPlan,
    pub tensor_maps: [TensorMapArgs; 4],
}

fn refuse(reason: String) -> Error {
    Error::VariantUnavailable { variant: Variant::Fa3, reason: format!("fa3 backward: {reason}") }
}

/// Whether the FA3-style kernel runs `p` (head dim, softcap, ALiBi); `Err` says why not.
pub fn supports(p: &Problem) -> Result<()> {
    if !TILES.iter().any(|t| t.0 as usize == p.head_dim) {
        return Err(refuse(format!("head_dim {} has no instance (64, 128)", p.head_dim)));
    }
    if p.softcap.is_some() {
        return Err(refuse("softcap is not implemented by this kernel (Variant::Fa2 has it)".into()));
    }
    if p.alibi.is_some() {
        return Err(refuse("ALiBi is not implemented by this kernel (Variant::Fa2 has it)".into()));
    }
    Ok(())
}

/// The launches of `p`'s backward over `ops` with the FA3-style main kernel. `deterministic`:
/// dq from per-64-key partials summed in order instead of f32 atomics.
///
/// # Errors
/// As [`fa2_bwd::plan`]; `Error::VariantUnavailable` for a head dim without an instance,
/// softcap or ALiBi; `Error::InvalidLayout` for an operand no tensor map can describe.
pub fn plan(p: &Problem, ops: &BwdOperands, deterministic: bool) -> Result<Fa3BwdPlan> {
    supports(p)?;
    let mut bwd = fa2_bwd::plan(p, ops, deterministic)?;
    if bwd.params.block_n as u32 != DQ_PARTIAL_KEYS {
        // FA2's tile at head dims 64 and 128 has 64 keys: the partial width of both kernels.
        return Err(refuse(format!(
            "FA2's conversion sums {}-key dq partials, this kernel writes {DQ_PARTIAL_KEYS}-key ones",
            bwd.params.block_n
        )));
    }
    let smem = TILES.iter().find(|t| t.0 as usize == p.head_dim).map_or(0, |t| t.1);
    let dtype = if p.dtype == DType::BF16 { "bf16" } else { "f16" };
    bwd.launches[fa2_bwd::MAIN_LAUNCH] = BwdLaunch {
        kernel: format!("fa3_bwd_hd{}_{dtype}", p.head_dim),
        grid: (p.seqlen_k.div_ceil(BLOCK_N as usize) as u32, p.heads_kv as u32, p.batch as u32),
        block: (THREADS, 1, 1),
        smem_bytes: smem,
    };
    let tensor_maps = tensor_maps(p, &bwd.params)?;
    Ok(Fa3BwdPlan { bwd, tensor_maps })
}

/// The maps of Q, K, V and dO: {64 columns, 1 head, rows, 1 batch} boxes with the 128-byte
/// swizzle, as the forward's, with [`BLOCK_M`] rows for Q and dO and [`BLOCK_N`] for K and V.
fn tensor_maps(p: &Problem, bp: &BwdParams) -> Result<[TensorMapArgs; 4]> {
    let data_type = if p.dtype == DType::BF16 { TMA_DTYPE_BFLOAT16 } else { TMA_DTYPE_FLOAT16 };
    let e = p.dtype.size() as u64;
    let layout = |i: usize, seqlen: usize, heads: usize| {
        let [b, r, h] = bp.strides[i];
        OperandLayout {
            batch: p.batch,
            seqlen,
            heads,
            head_dim: p.head_dim,
            batch_stride: b as usize,
            row_stride: r as usize,
            head_stride: h as usize,
        }
    };
    // BwdParams' operand order: q, k, v, o, dO, dq, dk, dv.
    let maps = [
        (Operand::Q, 0, bp.q, p.seqlen_q, p.heads_q, BLOCK_M),
        (Operand::K, 1, bp.k, p.seqlen_k, p.heads_kv, BLOCK_N),
        (Operand::V, 2, bp.v, p.seqlen_k, p.heads_kv, BLOCK_N),
        (Operand::DO, 4, bp.d_o, p.seqlen_q, p.heads_q, BLOCK_M),
    ];
    let mut out = [TensorMapArgs::default(); 4];
    for (dst, (op, i, addr, seqlen, heads, rows)) in out.iter_mut().zip(maps) {
        let spec = tma_spec(op, &layout(i, seqlen, heads), rows, data_type, e)?;
        *dst = TensorMapArgs { global_address: addr, spec };
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ForwardOptions;

    fn ops(q: [usize; 4], k: [usize; 4]) -> BwdOperands {
        let s = |x: [usize; 4]| [x[1] * x[2] * x[3], x[2] * x[3], x[3]];
        BwdOperands {
            ptrs: [0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000, 0x7000, 0x8000],
            strides: [s(q), s(k), s(k), s(q), s(q), s(q), s(k), s(k)],
            lse: 0x9000,
            d_sum: 0xa000,
            dq_accum: 0xb000,
            alibi: 0,
            sinks: 0,
            d_sinks: 0,
        }
    }

    fn problem(q: [usize; 4], k: [usize; 4], opts: &ForwardOptions) -> Problem {
        Problem::from_shapes(q, k, k, DType::BF16, opts).unwrap()
    }

    /// The main launch is this kernel's (grid over 128-key blocks, 384 threads, the traits'
    /// shared memory); the preprocess and conversion stay FA2's, with 64-key partials.
    #[test]
    fn plan_swaps_in_the_main_kernel() {
        let (q, k) = ([2, 70, 4, 128], [2, 300, 2, 128]);
        let p = problem(q, k, &ForwardOptions::default().causal(true));
        let pl = plan(&p, &ops(q, k), true).unwrap();
        let l = &pl.bwd.launches;
        assert_eq!(l[0].kernel, "fa2_bwd_preprocess_bf16");
        assert_eq!((l[1].kernel.as_str(), l[1].grid, l[1].block.0, l[1].smem_bytes), ("fa3_bwd_hd128_bf16", (3, 2, 2), 384, 150568));
        assert_eq!(l[2].kernel, "fa2_bwd_convert_dq_bf16");
        assert_eq!((pl.bwd.params.block_n, pl.bwd.params.dq_accum_splits), (64, 5));
        let rows: Vec<u32> = pl.tensor_maps.iter().map(|m| m.spec.box_dims[2]).collect();
        assert_eq!(rows, [64, 128, 128, 64]);
        assert_eq!(pl.tensor_maps[3].global_address, 0x5000);
        assert_eq!(pl.tensor_maps[1].spec.dims, [128, 2, 300, 2]);
    }

    #[test]
    fn refuses_what_the_kernel_lacks() {
        let (q, k) = ([1, 16, 2, 64], [1, 16, 2, 64]);
        for opts in [ForwardOptions::default().softcap(5.0), ForwardOptions::default().alibi_slopes(vec![0.5f32, 0.25])] {
            let e = plan(&problem(q, k, &opts), &ops(q, k), false).unwrap_err();
            assert!(matches!(e, Error::VariantUnavailable { variant: Variant::Fa3, .. }), "{e}");
        }
        let (q, k) = ([1, 16, 2, 96], [1, 16, 2, 96]);
        let e = plan(&problem(q, k, &ForwardOptions::default()), &ops(q, k), false).unwrap_err();
        assert!(e.to_string().contains("head_dim 96"), "{e}");
    }
}

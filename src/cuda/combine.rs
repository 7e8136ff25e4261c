//! The combine kernel's launches as data (`cuda/combine.cu`, the standalone row "combine" of
//! build/instances.rs): merging n attention states of the same rows into one, for the device
//! `merge_states` / `merge_states_n` ([`merge_plan`]) and for the second pass of split-KV
//! ([`splits_plan`]: the f32 partials `o_accum [splits, batch, hq, seqlen_q, d]`,
//! `lse_accum [splits, batch, hq, seqlen_q]` into the forward's output and LSE). The CPU emulator
//! runs exactly these launches (tests/emulator/combine.rs); [`gpu_num_splits`] is the split count
//! of a GPU split-KV launch.
//!
//! Arithmetic: `numerics::merge::merge_row`'s recombination and −inf / NaN rules, in f32 on the
//! device (the host's is f64); docs/serving.md gives the tolerance.

use super::params::assert_c_layout;
use super::table::{Standalone, STANDALONE};
use crate::error::{Error, Result};
use crate::tensor::{DType, Shape};
use std::mem::size_of;

/// Warps per CTA (FA_COMBINE_WARPS); each merges one row.
pub const WARPS: u32 = 4;
/// Input descriptors one launch carries (FA_COMBINE_MAX_INPUTS): the most states of the list
/// form (`merge_states_n`).
pub const MAX_INPUTS: usize = 64;
/// Largest head_dim (FA_COMBINE_MAX_HEAD_DIM).
pub const MAX_HEAD_DIM: usize = 512;
/// Most states of a stacked input (split-KV partials): FlashAttention's split limit, and the
/// CPU's (`ForwardOptions::num_splits`).
pub const MAX_SPLITS: usize = crate::splits::MAX_SPLITS;

/// One input of the combine, mirrored from `CombineInput` (cuda/common/combine_params.h).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CombineInput {
    pub o: u64,
    pub lse: u64,
    /// Element strides of o over (batch, seqlen, heads).
    pub o_strides: [i64; 3],
}

/// The combine's parameters, mirrored from `CombineParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CombineParams {
    pub out_o: u64,
    /// 0: the merged LSE is not written.
    pub out_lse: u64,
    pub out_strides: [i64; 3],
    pub out_lse_strides: [i64; 3],
    /// Every input's LSE strides over (batch, seqlen, heads).
    pub lse_strides: [i64; 3],
    /// Elements between consecutive states of one input's o and LSE.
    pub o_state_stride: i64,
    pub lse_state_stride: i64,
    pub batch: i32,
    pub seqlen: i32,
    pub heads: i32,
    pub head_dim: i32,
    pub n_inputs: i32,
    pub states_per_input: i32,
    /// f32 `[heads]`: a sink logit per head, merged into each row as the state `(o = 0, lse =
    /// sink)` (−inf: none); 0: no sinks. Split-KV passes the forward's sinks here.
    pub sinks: u64,
    pub inputs: [CombineInput; MAX_INPUTS],
}

// The same numbers as the static_asserts of cuda/common/combine_params.h.
assert_c_layout!(CombineInput, size 40, {});
assert_c_layout!(CombineParams, size 136 + 40 * MAX_INPUTS, {
    out_strides: 16,
    lse_strides: 64,
    o_state_stride: 88,
    batch: 104,
    n_inputs: 120,
    sinks: 128,
    inputs: 136,
});

impl CombineParams {
    /// The struct's bytes as the kernel receives them (native endianness).
    pub fn to_bytes(&self) -> [u8; size_of::<CombineParams>()] {
        let mut out = [0u8; size_of::<CombineParams>()];
        let mut at = 0;
        let mut put = |b: &[u8]| {
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        put(&self.out_o.to_ne_bytes());
        put(&self.out_lse.to_ne_bytes());
        for x in self.out_strides.iter().chain(&self.out_lse_strides).chain(&self.lse_strides) {
            put(&x.to_ne_bytes());
        }
        put(&self.o_state_stride.to_ne_bytes());
        put(&self.lse_state_stride.to_ne_bytes());
        for x in [self.batch, self.seqlen, self.heads, self.head_dim, self.n_inputs, self.states_per_input] {
            put(&x.to_ne_bytes());
        }
        put(&self.sinks.to_ne_bytes());
        for i in &self.inputs {
            put(&i.o.to_ne_bytes());
            put(&i.lse.to_ne_bytes());
            for x in i.o_strides {
                put(&x.to_ne_bytes());
            }
        }
        debug_assert_eq!(at, out.len());
        out
    }
}

/// The standalone row of the combine kernel.
pub fn row() -> &'static Standalone {
    STANDALONE.iter().find(|s| s.name == "combine").expect("build/instances.rs has the combine row")
}

fn dtype_suffix(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

/// The kernel merging `input` states into an `output` tensor: f32 into any dtype, a 16-bit
/// dtype into itself.
///
/// # Errors
/// [`Error::UnsupportedDType`] for another pair.
pub fn kernel_symbol(input: DType, output: DType) -> Result<&'static str> {
    let name = format!("fa_combine_{}_{}", dtype_suffix(input), dtype_suffix(output));
    row().kernels.iter().copied().find(|k| *k == name).ok_or_else(|| Error::UnsupportedDType {
        dtype: output,
        backend: format!("cuda combine of {input:?} states"),
        supported: match input {
            DType::F32 => "F32, F16, BF16".into(),
            other => format!("{other:?} (the states' dtype)"),
        },
    })
}

/// One launch of the combine, as data.
#[derive(Clone, Copy, Debug)]
pub struct CombineLaunch {
    pub kernel: &'static str,
    pub grid: u32,
    pub block: u32,
    pub params: CombineParams,
}

/// Where a tensor of `[batch, seqlen, heads, head_dim]` rows lives: a device address and its
/// element strides over (batch, seqlen, heads) (head_dim contiguous).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rows {
    pub ptr: u64,
    pub strides: [usize; 3],
}

/// One state of the list form: its o rows and its LSE (f32, the forward's layout).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateRows {
    pub o: Rows,
    pub lse: u64,
}

/// The element strides over (batch, seqlen, heads) of the forward's LSE `[batch, heads, seqlen]`
/// (a packed batch, `[heads, total_q]`, is batch 1).
pub fn lse_strides(shape: Shape) -> [usize; 3] {
    let [_, s, h, _] = shape;
    [h * s, 1, s]
}

fn to_i64(x: usize, what: &str) -> Result<i64> {
    i64::try_from(x).map_err(|_| Error::TooLarge { what: format!("{what} {x} (the combine indexes in i64)") })
}

fn strides_i64(s: [usize; 3], what: &str) -> Result<[i64; 3]> {
    Ok([to_i64(s[0], what)?, to_i64(s[1], what)?, to_i64(s[2], what)?])
}

/// The geometry shared by both forms: rows `shape` (`[batch, seqlen, heads, head_dim]`), the
/// output and its LSE (`lse`: device address, 0 for none, in the forward's layout).
fn base(
    shape: Shape,
    input: DType,
    output: DType,
    out: Rows,
    out_lse: u64,
) -> Result<(&'static str, u32, CombineParams)> {
    let kernel = kernel_symbol(input, output)?;
    let [b, s, h, d] = shape;
    if d == 0 || d > MAX_HEAD_DIM {
        return Err(Error::UnsupportedHeadDim {
            head_dim: d,
            backend: "cuda combine".into(),
            supported: format!("1..={MAX_HEAD_DIM}"),
        });
    }
    let int = |x: usize, what: &str| {
        i32::try_from(x).map_err(|_| Error::TooLarge { what: format!("{what} {x} (the combine takes i32 extents)") })
    };
    let rows = (b as u128) * (s as u128) * (h as u128);
    let grid = rows.div_ceil(WARPS as u128);
    if grid > i32::MAX as u128 {
        return Err(Error::TooLarge {
            what: format!("{rows} rows to merge (at most {} per launch)", i32::MAX as u128 * WARPS as u128),
        });
    }
    let params = CombineParams {
        out_o: out.ptr,
        out_lse,
        out_strides: strides_i64(out.strides, "output stride")?,
        out_lse_strides: strides_i64(lse_strides(shape), "lse stride")?,
        lse_strides: [0; 3],
        o_state_stride: 0,
        lse_state_stride: 0,
        batch: int(b, "batch")?,
        seqlen: int(s, "seqlen")?,
        heads: int(h, "heads")?,
        head_dim: int(d, "head_dim")?,
        n_inputs: 0,
        states_per_input: 1,
        sinks: 0,
        inputs: [CombineInput::default(); MAX_INPUTS],
    };
    Ok((kernel, grid as u32, params))
}

/// Refuses a list of states the list form cannot carry: none, or more than [`MAX_INPUTS`].
///
/// # Errors
/// [`Error::InvalidOption`].
pub fn check_state_count(n: usize) -> Result<()> {
    if n == 0 || n > MAX_INPUTS {
        return Err(Error::InvalidOption {
            option: "merge_states_n states",
            got: format!("{n} states"),
            expected: format!(
                "1..={MAX_INPUTS} states per device merge (merge larger lists in groups of at most {MAX_INPUTS})"
            ),
        });
    }
    Ok(())
}

/// The list form (`merge_states` / `merge_states_n` on device tensors): `states` of rows
/// `shape` in `input` dtype, LSEs in the forward's layout, merged into `out` (`output` dtype)
/// and `out_lse` (0: none). Shapes, extents and streams are the caller's to check.
///
/// # Errors
/// [`Error::InvalidOption`] for no state or more than [`MAX_INPUTS`]; the dtype pair, head_dim
/// and size errors of the kernel.
pub fn merge_plan(
    shape: Shape,
    input: DType,
    output: DType,
    states: &[StateRows],
    out: Rows,
    out_lse: u64,
) -> Result<CombineLaunch> {
    check_state_count(states.len())?;
    let (kernel, grid, mut params) = base(shape, input, output, out, out_lse)?;
    params.lse_strides = strides_i64(lse_strides(shape), "lse stride")?;
    params.n_inputs = states.len() as i32;
    for (dst, st) in params.inputs.iter_mut().zip(states) {
        *dst = CombineInput { o: st.o.ptr, lse: st.lse, o_strides: strides_i64(st.o.strides, "o stride")? };
    }
    Ok(CombineLaunch { kernel, grid, block: WARPS * 32, params })
}

/// The split-KV form: `splits` f32 partial states stacked as `o_accum [splits, batch, heads,
/// seqlen, d]` and `lse_accum [splits, batch, heads, seqlen]` (contiguous; `shape` is the
/// output's `[batch, seqlen, heads, d]`, a packed varlen batch being batch 1, seqlen total_q),
/// merged into `out` (`output` dtype) and `out_lse` (the forward's LSE layout; 0: none).
/// `sinks`: the forward's f32 sink logits `[heads]` (0: none), folded here once per row, since
/// each split's state is of its own keys only.
///
/// # Errors
/// [`Error::InvalidOption`] for 0 or more than [`MAX_SPLITS`] splits; the kernel's dtype,
/// head_dim and size errors.
#[allow(clippy::too_many_arguments)]
pub fn splits_plan(
    shape: Shape,
    splits: usize,
    o_accum: u64,
    lse_accum: u64,
    output: DType,
    out: Rows,
    out_lse: u64,
    sinks: u64,
) -> Result<CombineLaunch> {
    if splits == 0 || splits > MAX_SPLITS {
        return Err(Error::InvalidOption {
            option: "num_splits",
            got: splits.to_string(),
            expected: format!("1..={MAX_SPLITS}"),
        });
    }
    let (kernel, grid, mut params) = base(shape, DType::F32, output, out, out_lse)?;
    let [b, s, h, d] = shape;
    let lse_per_split = (b as u128) * (h as u128) * (s as u128);
    let o_per_split = lse_per_split * d as u128;
    let fits = |x: u128| x * splits as u128 <= i64::MAX as u128;
    if !fits(o_per_split) {
        return Err(Error::TooLarge {
            what: format!("o_accum of {splits} splits x {o_per_split} f32 (the combine indexes in i64)"),
        });
    }
    params.lse_strides = strides_i64(lse_strides(shape), "lse stride")?;
    params.o_state_stride = o_per_split as i64;
    params.lse_state_stride = lse_per_split as i64;
    params.n_inputs = 1;
    params.states_per_input = splits as i32;
    params.sinks = sinks;
    params.inputs[0] =
        CombineInput { o: o_accum, lse: lse_accum, o_strides: strides_i64([h * s * d, d, s * d], "o_accum stride")? };
    Ok(CombineLaunch { kernel, grid, block: WARPS * 32, params })
}

/// The split count of a GPU split-KV launch: the CPU's heuristic (`splits::num_splits`,
/// FlashAttention's `num_splits_heuristic`), the one function for both, with `workers` = SMs ×
/// CTAs of the forward kernel per SM and `items` = batch × heads × query blocks, the CTAs of the
/// unsplit launch (`heads`: the heads its grid spans, heads_q for FA1 and FA2, which run one CTA
/// per query head; the CPU counts kv heads because its items are per kv head); `keys` the
/// longest sequence's.
pub fn gpu_num_splits(
    sm_count: u32,
    ctas_per_sm: u32,
    batch: usize,
    heads: usize,
    query_blocks: usize,
    keys: usize,
) -> usize {
    let workers = (sm_count as usize).saturating_mul(ctas_per_sm.max(1) as usize);
    let items = batch.saturating_mul(heads).saturating_mul(query_blocks);
    crate::splits::num_splits(items, workers, keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_of_the_row_is_reachable() {
        let mut named: Vec<&str> = Vec::new();
        for (i, o) in [
            (DType::F32, DType::F32),
            (DType::F32, DType::F16),
            (DType::F32, DType::BF16),
            (DType::F16, DType::F16),
            (DType::BF16, DType::BF16),
        ] {
            named.push(kernel_symbol(i, o).unwrap());
        }
        named.sort();
        let mut row: Vec<&str> = row().kernels.to_vec();
        row.sort();
        assert_eq!(named, row);
        let e = kernel_symbol(DType::BF16, DType::F32).unwrap_err().to_string();
        assert!(e.contains("BF16"), "{e}");
    }

    #[test]
    fn params_bytes_follow_the_header_offsets() {
        let out = Rows { ptr: 0x1000, strides: [70, 7, 1] };
        let st = StateRows { o: Rows { ptr: 0x2000, strides: [9, 8, 7] }, lse: 0x3000 };
        let l = merge_plan([2, 3, 4, 5], DType::F16, DType::F16, &[st, st], out, 0x4000).unwrap();
        let b = l.params.to_bytes();
        let u64_at = |o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap());
        let i32_at = |o: usize| i32::from_ne_bytes(b[o..o + 4].try_into().unwrap());
        assert_eq!((u64_at(0), u64_at(8), u64_at(16)), (0x1000, 0x4000, 70));
        // LSE [batch, heads, seqlen]: (b, s, h) strides (h·s, 1, s).
        assert_eq!((u64_at(40), u64_at(48), u64_at(56)), (12, 1, 3));
        assert_eq!((i32_at(104), i32_at(116), i32_at(120), i32_at(124)), (2, 5, 2, 1));
        assert_eq!((u64_at(128), u64_at(136), u64_at(144), u64_at(152), u64_at(176)), (0, 0x2000, 0x3000, 9, 0x2000));
        assert_eq!((l.grid, l.block, l.kernel), (6, 128, "fa_combine_f16_f16"));
    }

    #[test]
    fn plans_refuse_what_the_kernel_cannot_run() {
        let out = Rows { ptr: 1, strides: [1, 1, 1] };
        let st = StateRows { o: out, lse: 1 };
        assert!(matches!(
            merge_plan([1, 1, 1, 8], DType::F32, DType::F32, &[], out, 0),
            Err(Error::InvalidOption { .. })
        ));
        let many = vec![st; MAX_INPUTS + 1];
        assert!(matches!(
            merge_plan([1, 1, 1, 8], DType::F32, DType::F32, &many, out, 0),
            Err(Error::InvalidOption { .. })
        ));
        assert!(matches!(
            merge_plan([1, 1, 1, 513], DType::F32, DType::F32, &[st], out, 0),
            Err(Error::UnsupportedHeadDim { .. })
        ));
        assert!(matches!(splits_plan([1, 1, 1, 8], 0, 1, 1, DType::F16, out, 0, 0), Err(Error::InvalidOption { .. })));
        assert!(matches!(splits_plan([1, 1, 1, 8], 129, 1, 1, DType::F16, out, 0, 0), Err(Error::InvalidOption { .. })));
        let l = splits_plan([2, 1, 8, 64], 3, 0x10, 0x20, DType::BF16, out, 0, 0).unwrap();
        assert_eq!(
            (l.params.o_state_stride, l.params.lse_state_stride, l.params.states_per_input),
            (2 * 8 * 64, 16, 3)
        );
        assert_eq!(l.params.inputs[0].o_strides, [8 * 64, 64, 64]);
    }

    #[test]
    fn gpu_split_count_is_the_cpu_heuristic_on_sms() {
        // 132 SMs x 1 CTA, one sequence, 8 kv heads, one query block, 32K keys: 8 items leave
        // most SMs idle, so it splits (and within the 512-key minimum per split).
        let s = gpu_num_splits(132, 1, 1, 8, 1, 32768);
        assert!(s > 1 && s <= 64, "{s}");
        assert_eq!(s, crate::splits::num_splits(8, 132, 32768));
        // Items that fill the SMs: no split.
        assert_eq!(gpu_num_splits(132, 1, 64, 8, 4, 32768), 1);
    }
}

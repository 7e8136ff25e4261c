//! The rules of a rotary embedding in a KV append that the CPU API (`serving::Rotary`) and the
//! device API (`cuda::DeviceRotary`) share: which `rotary_dim` is valid, at which cache
//! positions q's rows rotate, and that the tables cover every position a row rotates at.

use crate::batch_layout::KvLayout;
use crate::error::{Error, Result};
use crate::options::Mask;
use crate::tensor::Shape;

/// `rotary_dim` even, in `2..=head_dim`: features rotate in pairs.
pub(crate) fn check_dim(rotary_dim: usize, head_dim: usize) -> Result<()> {
    let r = rotary_dim;
    if r < 2 || !r.is_multiple_of(2) || r > head_dim {
        return Err(Error::InvalidOption {
            option: "rotary_dim",
            got: r.to_string(),
            expected: format!("an even number in 2..={head_dim} (head_dim): features rotate in pairs"),
        });
    }
    Ok(())
}

/// Whether query row `i` of a sequence rotates at `seqlens[b] + i` (true) or every row at
/// `seqlens[b]` (false): FlashAttention's "causal or local" rule. A window side counts as bounded
/// when it is below `capacity` (the cache's keys per sequence), as FlashAttention turns larger
/// bounds into unbounded ones before it decides.
pub(crate) fn q_rows_advance(mask: Mask, capacity: usize) -> bool {
    let bounded = |x: i64| usize::try_from(x).is_ok_and(|x| x < capacity);
    match mask {
        Mask::None => false,
        Mask::Causal => true,
        Mask::Window { left, right, causal } => causal || bounded(left) || bounded(right),
    }
}

/// Keys per sequence a writable cache holds: its capacity (dense), or the blocks a table row
/// names times the page size (paged). `k_shape` is the cache's.
pub(crate) fn cache_capacity(kl: KvLayout<'_>, k_shape: Shape) -> usize {
    match kl {
        KvLayout::Paged { max_blocks_per_seq, .. } => max_blocks_per_seq.saturating_mul(k_shape[1]),
        _ => k_shape[1],
    }
}

/// Checks that tables of `seqlen_ro` rows cover every position rotated at: `seqlens[b]..` for
/// `new` rows of k and `sq` rows of q (`advance`), or `seqlens[b]` alone for q.
pub(crate) fn check_covers(seqlen_ro: usize, seqlens: &[i32], new: usize, sq: usize, advance: bool) -> Result<()> {
    let span = new.max(if advance { sq } else { sq.min(1) });
    if span == 0 {
        return Ok(());
    }
    for (b, &s) in seqlens.iter().enumerate() {
        let last = s.max(0) as usize + span - 1;
        if last >= seqlen_ro {
            return Err(Error::InvalidOption {
                option: "rotary_cos",
                got: format!("{seqlen_ro} positions (rows of the tables)"),
                expected: format!("at least {}: sequence {b} rotates a row at position {last}", last + 1),
            });
        }
    }
    Ok(())
}

//! How many key splits a split-KV (flash-decoding) call uses: FlashAttention's
//! `num_splits_heuristic`, the one rule both backends follow (the CPU on its worker threads,
//! the GPU on its SMs), so it lives below both.

/// A split of the keys must hold at least this many: below it the split's fixed costs (loading
/// the queries, the merge, a worker's wake-up) outweigh the parallelism it buys.
pub const MIN_SPLIT_KEYS: usize = 512;
/// Most splits of one item's keys (FlashAttention's limit too).
pub const MAX_SPLITS: usize = 128;
/// A split count is accepted when its worker efficiency is within this fraction of the best one
/// (FlashAttention's `num_splits_heuristic` uses 0.85), so the smallest good count wins.
const SPLIT_EFFICIENCY: f64 = 0.85;

/// Number of key splits per work item (flash-decoding), FlashAttention's rule.
///
/// `items` work items (each a pass over one kv head's keys) go to `workers` threads. Without
/// splitting, the last round of items leaves `workers - items % workers` threads idle; with `s`
/// splits there are `items · s` pieces and the efficiency is
/// `items·s / (ceil(items·s / workers) · workers)`. Candidates are `s = 1 ..=
/// min(MAX_SPLITS, keys / MIN_SPLIT_KEYS)` and the smallest `s` whose efficiency is within
/// 85 % of the best wins. So: never with one worker, never when the keys are too few for two
/// splits of [`MIN_SPLIT_KEYS`], and never when the items already fill the workers (8 kv heads
/// on 2 cores: 1 split; 1 kv head with 4096 keys on 2 cores: 2 splits).
pub fn num_splits(items: usize, workers: usize, keys: usize) -> usize {
    let max_s = MAX_SPLITS.min(keys / MIN_SPLIT_KEYS).max(1);
    if workers <= 1 || items == 0 || max_s == 1 {
        return 1;
    }
    let eff = |s: usize| {
        let pieces = items * s;
        pieces as f64 / (pieces.div_ceil(workers) * workers) as f64
    };
    let best = (1..=max_s).map(eff).fold(0.0, f64::max);
    (1..=max_s).find(|&s| eff(s) >= SPLIT_EFFICIENCY * best).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_heuristic() {
        // Enough items for the workers: never split.
        assert_eq!(num_splits(8, 2, 4096), 1);
        assert_eq!(num_splits(17, 2, 1 << 20), 1);
        // One worker, or too few keys: never split.
        assert_eq!(num_splits(1, 1, 1 << 20), 1);
        assert_eq!(num_splits(1, 2, 2 * MIN_SPLIT_KEYS - 1), 1);
        // One item, two workers: two splits; five items on two workers: ten pieces.
        assert_eq!(num_splits(1, 2, 4096), 2);
        assert_eq!(num_splits(5, 2, 4096), 2);
        // Many workers, one long sequence: about one split per worker (the smallest count
        // within 85 % of the best efficiency: 14 of 16).
        assert_eq!(num_splits(1, 16, 1 << 20), 14);
        assert!(num_splits(1, 1000, 1 << 20) <= MAX_SPLITS);
    }
}

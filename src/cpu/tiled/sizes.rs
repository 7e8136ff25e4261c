//! The tiled path's block and tile sizes, and the rounding its buffers are sized with.

/// Query rows per work item, a multiple of the 16-query panels: every packed K/V tile the block
/// reads serves all of its panels.
pub(crate) const BLOCK_ROWS: usize = 96;
/// Keys per tile, a multiple of the micro-kernel's 6-key strips: the products and the softmax
/// step of one tile run on every panel of the block before the next tile is read.
pub(crate) const TILE_KEYS: usize = 96;

/// `x` rounded up to a multiple of `m`.
pub(super) fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

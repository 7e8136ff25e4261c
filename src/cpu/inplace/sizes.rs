//! The in-place path's work-item and chunk sizes.

/// Query rows per work item (4 panels of 16): each chunk of K/V rows an item reads serves them all.
pub const ITEM_ROWS: usize = 64;
/// Keys per chunk: the K and V rows of a chunk stay in L1/L2 while every panel of the item uses
/// them.
pub const CHUNK_KEYS: usize = 64;
/// Keys per chunk when the items of all kv heads sweep the keys together (decode): a chunk of
/// every head then spans this many whole rows of all heads (`[.., seqlen, heads, head_dim]`),
/// few enough concurrent streams for the hardware prefetchers, and each head's chunk is
/// prefetched while the previous head's is computed.
pub const SWEEP_CHUNK_KEYS: usize = 16;

//! The host side of the FA1 family (cuda/fa1_fwd.cu): no rules beyond its table row for dense
//! launches; it runs every serving launch (docs/serving.md "GPU"): varlen q and k/v, dense and
//! paged KV caches of any page size (its K/V tiles are copied row by row, each row's address
//! looked up through the block table), and split-KV into `o_accum` / `lse_accum` (merged by the
//! combine kernel, `cuda::combine::splits_plan`). The append (`knew`/`vnew`) is not the
//! attention kernel's: the cache it reads holds the new rows already. An FP8 cache is refused:
//! FA1's tiles are 16-bit copies of the rows (FA2 dequantises one as it loads it).

use super::family::FamilyHost;
use super::params::{FwdParams, FLAG_KV_FP8};
use super::table::{Family, Tile};

/// The FA1 family's host rules.
#[derive(Debug)]
pub(crate) struct Fa1;

impl FamilyHost for Fa1 {
    fn serving_refusal(&self, _fam: &Family, _tile: &Tile, params: &FwdParams) -> Option<&'static str> {
        (params.flags & FLAG_KV_FP8 != 0).then_some("reads f16 / bf16 caches only (an FP8 KV cache runs on FA2 or FA3)")
    }
}

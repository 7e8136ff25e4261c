//! The edges of the input domain on the GPU.

use super::support::Rng;
use super::util::*;
use flash_attn::{DType, Variant};

#[test]
#[ignore = "needs a CUDA GPU"]
fn domain_edges() {
    let engine = engine();
    let stream = engine.device().context().new_stream().unwrap();
    let mut rng = Rng::new(0xed9e);
    for dtype in [DType::F16, DType::BF16] {
        for var in variants(&engine) {
            for d in [64usize, 128] {
                if var == Variant::Fa2 && !fa2_dims().contains(&d) {
                    continue;
                }
                for ([q, k, v], opts, what) in edge_inputs(&mut rng, dtype, d, false) {
                    let what = format!("{dtype:?} {var:?} d{d} {what}");
                    check_edges(&engine, &stream, [&q, &k, &v], &opts.variant(var), &what);
                }
            }
        }
    }
}

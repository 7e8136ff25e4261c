mod common;
use common::*;
use flash_attn::*;

#[test]
fn smoke() {
    let mut rng = Rng(42);
    for (sq, sk, d, mask) in [(1, 1, 32, Mask::None), (100, 203, 64, Mask::Causal), (203, 100, 128, Mask::Causal), (77, 77, 80, Mask::window(5, 3))] {
        let q = randn(&mut rng, DType::F32, [2, sq, 4, d]);
        let k = randn(&mut rng, DType::F32, [2, sk, 2, d]);
        let v = randn(&mut rng, DType::F32, [2, sk, 2, d]);
        let (_, c) = check_forward(&q, &k, &v, &ForwardOptions::default().mask(mask).return_lse(true));
        println!("{sq} {sk} {d} {mask:?} {c:?}");
        assert!(c.err <= c.bound, "{c:?}");
    }
}

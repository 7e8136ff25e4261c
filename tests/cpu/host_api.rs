//! The host API an engine uses without copies: `forward_into` writes into the caller's buffer
//! (the same values as `forward`), `Tensor::into_vec`/`into_data` hand the buffer out without a
//! copy, and wrong buffers are typed errors.

use crate::support::*;
use flash_attn::{forward, forward_into, Backend, DType, Error, ForwardOptions, Mask, Operand, OwnedData, Tensor};
use half::bf16;

#[test]
fn forward_into_writes_what_forward_returns() {
    let mut rng = Rng::new(41);
    // 33 query rows: the tiled path; 1 and 4 (decode, GQA): the in-place decode path, which
    // `forward_into` must take as `forward` does (same kernel, same bits).
    for (dtype, sq) in [(DType::F32, 33), (DType::BF16, 33), (DType::F32, 1), (DType::BF16, 1), (DType::F32, 4)] {
        let q = randn(&mut rng, dtype, [2, sq, 4, 64]);
        let k = randn(&mut rng, dtype, [2, 47, 2, 64]);
        let v = randn(&mut rng, dtype, [2, 47, 2, 64]);
        let opts = ForwardOptions::default().mask(Mask::Causal).return_lse(true).backend(Backend::Cpu);
        let want = forward(&q, &k, &v, &opts).unwrap();
        let mut lse = vec![f32::NAN; 2 * 4 * sq];
        let d = match dtype {
            DType::F32 => {
                let mut out = vec![f32::NAN; q.numel()];
                let d = forward_into(&q, &k, &v, &mut out, Some(&mut lse), &opts).unwrap();
                assert_eq!(OwnedData::F32(out), *want.o.data());
                d
            }
            _ => {
                let mut out = vec![bf16::NAN; q.numel()];
                let d = forward_into(&q, &k, &v, &mut out, Some(&mut lse), &opts).unwrap();
                assert_eq!(OwnedData::BF16(out), *want.o.data());
                d
            }
        };
        assert_eq!(lse, want.lse.unwrap());
        assert_eq!(d, want.dispatch);
    }
}

#[test]
fn forward_into_refuses_wrong_buffers() {
    let mut rng = Rng::new(43);
    let q = randn(&mut rng, DType::F32, [1, 8, 2, 32]);
    let opts = ForwardOptions::default();
    let mut short = vec![0f32; q.numel() - 1];
    let e = forward_into(&q, &q, &q, &mut short, None, &opts).unwrap_err();
    assert!(matches!(&e, Error::ShapeMismatch { got, .. } if got.contains(&(q.numel() - 1).to_string())), "{e}");
    let mut wrong_type = vec![bf16::ZERO; q.numel()];
    let e = forward_into(&q, &q, &q, &mut wrong_type, None, &opts).unwrap_err();
    assert_eq!(e, Error::DTypeMismatch { operand: Operand::O, got: DType::BF16, expected: DType::F32 });
    let mut out = vec![0f32; q.numel()];
    let mut lse = vec![0f32; 3];
    let e = forward_into(&q, &q, &q, &mut out, Some(&mut lse), &opts).unwrap_err();
    assert!(matches!(&e, Error::ShapeMismatch { what, .. } if what.contains("lse")), "{e}");
}

#[test]
fn into_vec_and_into_data_do_not_copy() {
    let v: Vec<f32> = (0..2 * 3 * 4 * 5).map(|i| i as f32).collect();
    let ptr = v.as_ptr();
    let t = Tensor::from_vec(v, [2, 3, 4, 5]).unwrap();
    let back: Vec<f32> = t.clone().into_vec().unwrap();
    assert_eq!(back, t.to_f32_vec());
    let back = t.into_vec::<f32>().unwrap();
    assert_eq!(back.as_ptr(), ptr, "the same allocation comes back");

    let t = Tensor::zeros(DType::F16, [1, 1, 1, 4]).unwrap();
    assert!(matches!(t.clone().into_data(), OwnedData::F16(v) if v.len() == 4));
    let e = t.into_vec::<f32>().unwrap_err();
    assert!(matches!(&e, Error::UnsupportedDType { dtype: DType::F32, supported, .. } if supported == "F16"), "{e}");
}

#[test]
fn heads_major_views_read_head_major_storage() {
    use flash_attn::bench::support::HeadMajor;
    use flash_attn::TensorView;
    let mut rng = Rng::new(47);
    let q = randn(&mut rng, DType::F32, [2, 5, 3, 8]);
    let stored = HeadMajor::new(&q); // its view is `TensorView::heads_major` over the storage
    let v = stored.view();
    assert_eq!((v.shape(), v.strides()), ([2, 5, 3, 8], [3 * 5 * 8, 8, 5 * 8]));
    let opts = ForwardOptions::default().backend(Backend::Cpu);
    let want = forward(&q, &q, &q, &opts).unwrap();
    assert_eq!(forward(&v, &v, &v, &opts).unwrap().o, want.o);
    // Dimensions whose strides overflow: a typed error when used, not a panic.
    let huge = TensorView::heads_major(&[0f32; 8], [1, usize::MAX / 2, 3, 8]);
    assert!(forward(&huge, &huge, &huge, &opts).is_err());
}

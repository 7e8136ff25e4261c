//! Every bad input returns its typed error, with a message naming what was given and expected.

use flash_attn::*;

fn t(shape: [usize; 4]) -> Tensor {
    Tensor::zeros(DType::F32, shape).unwrap()
}

fn err(q: &Tensor, k: &Tensor, v: &Tensor, opts: &ForwardOptions) -> Error {
    let e = forward(q, k, v, opts).expect_err("must be refused");
    assert!(!e.to_string().is_empty());
    e
}

#[test]
fn mismatched_shapes() {
    let q = t([2, 8, 4, 64]);
    let e = err(&q, &t([1, 8, 4, 64]), &t([1, 8, 4, 64]), &ForwardOptions::default());
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let e = err(&q, &t([2, 8, 4, 32]), &t([2, 8, 4, 32]), &ForwardOptions::default());
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let e = err(&q, &t([2, 8, 4, 64]), &t([2, 9, 4, 64]), &ForwardOptions::default());
    assert!(matches!(&e, Error::ShapeMismatch { what, .. } if what == "v"), "{e}");
    assert!(e.to_string().contains("[2, 9, 4, 64]") && e.to_string().contains("[2, 8, 4, 64]"));
}

#[test]
fn mismatched_dtypes() {
    let q = t([1, 8, 2, 32]);
    let k = Tensor::zeros(DType::BF16, [1, 8, 2, 32]).unwrap();
    let e = err(&q, &k, &t([1, 8, 2, 32]), &ForwardOptions::default());
    assert!(matches!(e, Error::DTypeMismatch { operand: Operand::K, got: DType::BF16, expected: DType::F32 }), "{e}");
}

#[test]
fn heads_not_divisible() {
    let e = err(&t([1, 8, 6, 32]), &t([1, 8, 4, 32]), &t([1, 8, 4, 32]), &ForwardOptions::default());
    assert_eq!(e, Error::HeadsNotDivisible { heads_q: 6, heads_kv: 4 });
    assert!(e.to_string().contains("6") && e.to_string().contains("4"));
}

#[test]
fn zero_sized_dimensions() {
    for (i, dim) in ["batch", "seqlen", "heads", "head_dim"].iter().enumerate() {
        let mut s = [1, 8, 2, 32];
        s[i] = 0;
        let e = err(&t(s), &t([1, 8, 2, 32]), &t([1, 8, 2, 32]), &ForwardOptions::default());
        assert_eq!(e, Error::EmptyDimension { operand: Operand::Q, dim }, "{e}");
        let e = err(&t([1, 8, 2, 32]), &t(s), &t([1, 8, 2, 32]), &ForwardOptions::default());
        assert!(matches!(e, Error::EmptyDimension { operand: Operand::K, .. }), "{e}");
    }
}

#[test]
fn unsupported_head_dim_on_cpu() {
    let s = [1, 2, 1, 1024];
    let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().backend(Backend::Cpu));
    assert!(matches!(e, Error::UnsupportedHeadDim { head_dim: 1024, .. }), "{e}");
}

#[test]
fn bad_softmax_scale() {
    let s = [1, 4, 1, 32];
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().softmax_scale(bad));
        assert!(matches!(e, Error::InvalidSoftmaxScale(_)), "{e}");
    }
}

#[test]
fn bad_windows() {
    let s = [1, 4, 1, 32];
    let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().mask(Mask::window(-2, 0)));
    assert_eq!(e, Error::NegativeWindow { side: "left", value: -2 });
    let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().mask(Mask::window(0, -5)));
    assert_eq!(e, Error::NegativeWindow { side: "right", value: -5 });
    let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().mask(Mask::Window { left: 4, right: 3, causal: true }));
    assert!(matches!(e, Error::InconsistentWindow(_)), "{e}");
}

#[test]
fn bad_softcap() {
    let s = [1, 4, 1, 32];
    for bad in [0.0, -3.0, f32::NAN, f32::NEG_INFINITY] {
        let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().softcap(bad));
        assert!(matches!(e, Error::InvalidSoftcap(_)), "{e}");
    }
}

#[test]
fn bad_alibi() {
    let s = [1, 4, 2, 32];
    let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().alibi_slopes(vec![0.5]));
    assert!(matches!(e, Error::InvalidAlibi { got: 1, expected: 2, .. }), "{e}");
    let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().alibi_slopes(vec![0.5, f32::NAN]));
    assert!(matches!(e, Error::InvalidAlibi { got: 2, expected: 2, .. }), "{e}");
}

#[test]
fn buffer_too_short_for_shape_or_strides() {
    let data = vec![0.0f32; 100];
    let q = TensorView::new(&data, [1, 4, 1, 32]); // needs 128
    let k = TensorView::new(&data[..64], [1, 2, 1, 32]);
    let e = forward(&q, &k, &k, &ForwardOptions::default()).unwrap_err();
    assert!(matches!(e, Error::InvalidLayout { operand: Operand::Q, .. }), "{e}");
    let q = TensorView::with_strides(&data, [1, 2, 1, 32], [0, usize::MAX / 2, 0]);
    let e = forward(&q, &k, &k, &ForwardOptions::default()).unwrap_err();
    assert!(matches!(e, Error::InvalidLayout { operand: Operand::Q, .. }), "{e}");
    assert!(Tensor::from_vec(vec![0.0f32; 3], [1, 1, 1, 4]).is_err());
    assert!(Tensor::zeros(DType::F32, [usize::MAX, 2, 2, 2]).is_err());
}

#[test]
fn gpu_variant_on_cpu_is_refused() {
    let s = [1, 4, 1, 32];
    for v in [Variant::Fa1, Variant::Fa2, Variant::Fa3, Variant::Fa4] {
        let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().backend(Backend::Cpu).variant(v));
        assert!(matches!(e, Error::VariantUnavailable { .. }), "{e}");
    }
}

#[test]
fn bad_numerics_options() {
    let s = [1, 4, 1, 32];
    let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().exp2(Exp2::Poly(7)));
    assert!(matches!(e, Error::InvalidOption { .. }), "{e}");
    let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().rescale(Rescale::Lazy { threshold: f32::NAN }));
    assert!(matches!(e, Error::InvalidOption { .. }), "{e}");
}

#[test]
fn unavailable_backend_is_refused() {
    // No machine has CUDA device 999: with or without a GPU this is a typed error.
    let s = [1, 4, 1, 32];
    let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().backend(Backend::Cuda(999)));
    assert!(matches!(e, Error::BackendUnavailable { .. } | Error::Cuda { .. }), "{e}");
}

#[test]
fn fa3_stage_is_validated_before_any_backend() {
    let s = [1, 4, 1, 64];
    for (variant, stage) in [(Variant::Fa3, 0), (Variant::Fa3, 6), (Variant::Auto, 2), (Variant::Fa2, 1)] {
        let e = err(&t(s), &t(s), &t(s), &ForwardOptions::default().variant(variant).fa3_stage(stage));
        assert!(matches!(e, Error::InvalidOption { option: "fa3_stage", .. }), "{variant:?} stage {stage}: {e}");
    }
    // A valid stage gets past validation: the CPU then refuses the GPU variant.
    let opts = ForwardOptions::default().backend(Backend::Cpu).variant(Variant::Fa3).fa3_stage(3);
    assert!(matches!(err(&t(s), &t(s), &t(s), &opts), Error::VariantUnavailable { .. }));
}

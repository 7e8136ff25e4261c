use flash_attn::numerics::rng::{fa3_outlier_values, SplitMix64};
use flash_attn::numerics::hadamard::Rotation;
use flash_attn::numerics::quant::{quantize_e4m3};
use flash_attn::reference::{attention_f64, rmse};
use flash_attn::{DType, ForwardOptions, Problem, Tensor};
fn main() {
    let a: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let shape = [1, a[0], a[1], a[2]];
    let n: usize = shape.iter().product();
    let mut g = SplitMix64::new(0);
    let mk = |g: &mut SplitMix64| fa3_outlier_values(g, n).iter().map(|&x| half::f16::from_f32(x).to_f32()).collect::<Vec<f32>>();
    let (q, k, v) = (mk(&mut g), mk(&mut g), mk(&mut g));
    let t = |x: &Vec<f32>| Tensor::from_f32(x, DType::F32, shape).unwrap();
    let p = Problem::new(&t(&q).view(), &t(&k).view(), &t(&v).view(), &ForwardOptions::default()).unwrap();
    let r = attention_f64(&p, &t(&q).view(), &t(&k).view(), &t(&v).view());
    let fq = |x: &Vec<f32>, rot: bool, rows: usize| { let mut b = x.clone(); if rot { Rotation::new(shape[3], 5).unwrap().apply_rows(&mut b);} quantize_e4m3(&b, shape, rows).dequantize() };
    let rotate = |x: &Vec<f32>| { let mut b = x.clone(); Rotation::new(shape[3], 5).unwrap().apply_rows(&mut b); b };
    let s = shape[1];
    for (name, qq, kk, vv) in [
        ("qk pt", fq(&q,false,s), fq(&k,false,s), v.clone()),
        ("qk had", fq(&q,true,s), fq(&k,true,s), v.clone()),
        ("qk rot no quant", rotate(&q), rotate(&k), v.clone()),
        ("v only", q.clone(), k.clone(), fq(&v,false,s)),
    ] {
        let o = attention_f64(&p, &t(&qq).view(), &t(&kk).view(), &t(&vv).view());
        println!("{name}: {:.3e}", rmse(&o.o, &r.o));
    }
}

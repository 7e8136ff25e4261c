//! Every function of candle-flash-attn 0.11's API against candle's own attention (candle ops,
//! CPU) on the same tensors (the dense ones on transposed `[b, h, s, d]` views, read in place): f32 to 1e-5, f16 and bf16 within FlashAttention's rule (at most
//! twice the error of candle's attention in that dtype, plus a floor). Causal, windows on
//! either side, ALiBi, softcap, GQA, seqlen_q != seqlen_k, varlen with sequences of different
//! lengths (one empty), a paged cache with a shuffled block table.

mod common;

use candle_core::{CustomOp3, DType, Device, Result, Tensor};
use common::{check_low_precision, max_diff, naive, naive_varlen, randn, Extra, Window};
use flash_attn_candle as fa;

const DTYPES: [(DType, f64); 2] = [(DType::F16, 2e-3), (DType::BF16, 1.6e-2)];

/// One dense call: the function under test as `f(q, k, v)` against the reference with window
/// `w` and extras `x`, in f32 and in each 16-bit dtype.
fn check_dense(what: &str, shape: (usize, usize, usize, usize, usize, usize), w: Window, x: &Extra, f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>) {
    check_dense_scaled(what, shape, 1.0 / (shape.5 as f32).sqrt(), w, x, f)
}

fn check_dense_scaled(
    what: &str,
    shape: (usize, usize, usize, usize, usize, usize),
    scale: f32,
    w: Window,
    x: &Extra,
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) {
    let (b, sq, sk, hq, hk, d) = shape;
    let dev = Device::Cpu;
    // candle's usual [b, h, s, d] activations, passed as [b, s, h, d] views (strided, no copy).
    let bhsd = |s, h| randn(&[b, h, s, d], &dev).transpose(1, 2).unwrap();
    let (q, k, v) = (bhsd(sq, hq), bhsd(sk, hk), bhsd(sk, hk));
    assert!(!q.is_contiguous() || hq == 1 || sq == 1);
    let got = f(&q, &k, &v).unwrap();
    assert_eq!(got.dims(), &[b, sq, hq, d], "{what}");
    let err = max_diff(&got, &naive(&q, &k, &v, scale, w, x).unwrap());
    assert!(err < 1e-5, "{what} f32 {shape:?}: max |diff| {err:.2e}");
    for (dt, floor) in DTYPES {
        let (q, k, v) = (q.to_dtype(dt).unwrap(), k.to_dtype(dt).unwrap(), v.to_dtype(dt).unwrap());
        let got = f(&q, &k, &v).unwrap();
        assert_eq!(got.dtype(), dt);
        let r = |t: &Tensor, d: DType| t.to_dtype(d);
        check_low_precision(what, &got, |d| naive(&r(&q, d)?, &r(&k, d)?, &r(&v, d)?, scale, w, x), floor);
    }
}

const SHAPES: [(usize, usize, usize, usize, usize, usize); 3] =
    [(2, 37, 53, 4, 2, 32), (1, 64, 64, 6, 6, 64), (1, 50, 21, 2, 1, 40)];

fn slopes(h: usize) -> (Vec<f32>, Tensor) {
    let s: Vec<f32> = (0..h).map(|i| 0.5f32.powi(i as i32 + 1)).collect();
    let t = Tensor::new(s.as_slice(), &Device::Cpu).unwrap();
    (s, t)
}

#[test]
fn flash_attn_causal_and_not() {
    for shape in SHAPES {
        for causal in [false, true] {
            let scale = 1.0 / (shape.5 as f32).sqrt();
            check_dense("flash_attn", shape, Window::causal(causal), &Extra::default(), |q, k, v| {
                fa::flash_attn(q, k, v, scale, causal)
            });
        }
    }
}

const WINDOWS: [Window; 6] = [
    Window(Some(5), Some(0)),
    Window(Some(3), Some(7)),
    Window(None, Some(4)),
    Window(Some(9), None),
    Window(Some(0), Some(0)),
    Window(Some(1000), Some(1000)),
];

#[test]
fn flash_attn_windowed_every_side() {
    for shape in SHAPES {
        for w in WINDOWS {
            let scale = 1.0 / (shape.5 as f32).sqrt();
            check_dense("flash_attn_windowed", shape, w, &Extra::default(), |q, k, v| {
                fa::flash_attn_windowed(q, k, v, scale, w.0, w.1)
            });
        }
    }
}

#[test]
fn flash_attn_alibi_and_alibi_windowed() {
    for shape in SHAPES {
        let (s, st) = slopes(shape.3);
        let x = Extra { slopes: Some(s), softcap: None };
        let scale = 1.0 / (shape.5 as f32).sqrt();
        for causal in [false, true] {
            check_dense("flash_attn_alibi", shape, Window::causal(causal), &x, |q, k, v| {
                fa::flash_attn_alibi(q, k, v, &st, scale, causal)
            });
        }
        for w in [WINDOWS[0], WINDOWS[1]] {
            check_dense("flash_attn_alibi_windowed", shape, w, &x, |q, k, v| {
                fa::flash_attn_alibi_windowed(q, k, v, &st, scale, w.0, w.1)
            });
        }
    }
}

#[test]
fn flash_attn_alibi_windowed_softcap_with_and_without_alibi() {
    for shape in SHAPES {
        let (s, st) = slopes(shape.3);
        let scale = 0.3;
        for (w, alibi, cap) in [(WINDOWS[0], true, 5.0), (Window::NONE, false, 2.0), (WINDOWS[1], true, 0.0)] {
            let x = Extra { slopes: alibi.then(|| s.clone()), softcap: (cap > 0.0).then_some(cap) };
            check_dense_scaled("flash_attn_alibi_windowed_softcap", shape, scale, w, &x, |q, k, v| {
                fa::flash_attn_alibi_windowed_softcap(q, k, v, alibi.then_some(&st), scale, w.0, w.1, cap)
            });
        }
    }
}

#[test]
fn flash_attn_struct_as_custom_op() -> Result<()> {
    let (dev, (b, s, h, d)) = (Device::Cpu, (1, 33, 4, 16));
    let (q, k, v) = (randn(&[b, s, h, d], &dev), randn(&[b, s, h, d], &dev), randn(&[b, s, h, d], &dev));
    let (sl, st) = slopes(h);
    let op = fa::FlashAttn {
        softmax_scale: 0.25,
        alibi_slopes: Some(st),
        window_size_left: Some(6),
        window_size_right: Some(0),
        softcap: Some(3.0),
    };
    assert_eq!(op.name(), "flash-attn");
    let got = q.apply_op3(&k, &v, op)?;
    let want = naive(&q, &k, &v, 0.25, Window(Some(6), Some(0)), &Extra { slopes: Some(sl), softcap: Some(3.0) })?;
    assert!(max_diff(&got, &want) < 1e-5);
    Ok(())
}

/// A packed batch: sequences of `lens_q`/`lens_k` rows, tensors `(total, h, d)`, the cumulative
/// offsets as u32 tensors (as candle-flash-attn takes them).
struct Packed {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Vec<usize>,
    cu_k: Vec<usize>,
    seqlens_q: Tensor,
    seqlens_k: Tensor,
    max_q: usize,
    max_k: usize,
}

fn packed(lens_q: &[usize], lens_k: &[usize], hq: usize, hk: usize, d: usize) -> Packed {
    let cum = |l: &[usize]| -> Vec<usize> { std::iter::once(0).chain(l.iter().scan(0, |a, &x| { *a += x; Some(*a) })).collect() };
    let (cu_q, cu_k) = (cum(lens_q), cum(lens_k));
    let dev = Device::Cpu;
    let u = |c: &[usize]| Tensor::new(c.iter().map(|&x| x as u32).collect::<Vec<_>>().as_slice(), &dev).unwrap();
    Packed {
        q: randn(&[*cu_q.last().unwrap(), hq, d], &dev),
        k: randn(&[*cu_k.last().unwrap(), hk, d], &dev),
        v: randn(&[*cu_k.last().unwrap(), hk, d], &dev),
        seqlens_q: u(&cu_q),
        seqlens_k: u(&cu_k),
        max_q: *lens_q.iter().max().unwrap(),
        max_k: *lens_k.iter().max().unwrap(),
        cu_q,
        cu_k,
    }
}

/// Sequences of different lengths, one with no query row, seqlen_q <= seqlen_k (every row sees
/// a key under a causal mask).
const LENS: ([usize; 4], [usize; 4]) = ([17, 1, 0, 40], [30, 9, 5, 40]);

fn check_varlen(what: &str, w: Window, x: &Extra, f: impl Fn(&Packed, &Tensor, &Tensor, &Tensor) -> Result<Tensor>) {
    let p = packed(&LENS.0, &LENS.1, 4, 2, 32);
    let scale = 1.0 / 32f32.sqrt();
    let got = f(&p, &p.q, &p.k, &p.v).unwrap();
    assert_eq!(got.dims(), p.q.dims(), "{what}");
    let want = naive_varlen(&p.q, &p.k, &p.v, &p.cu_q, &p.cu_k, scale, w, x).unwrap();
    let err = max_diff(&got, &want);
    assert!(err < 1e-5, "{what} f32: max |diff| {err:.2e}");
    for (dt, floor) in DTYPES {
        let (q, k, v) = (p.q.to_dtype(dt).unwrap(), p.k.to_dtype(dt).unwrap(), p.v.to_dtype(dt).unwrap());
        let got = f(&p, &q, &k, &v).unwrap();
        let r = |t: &Tensor, d: DType| t.to_dtype(d);
        check_low_precision(what, &got, |d| naive_varlen(&r(&q, d)?, &r(&k, d)?, &r(&v, d)?, &p.cu_q, &p.cu_k, scale, w, x), floor);
    }
}

#[test]
fn flash_attn_varlen_causal_and_not() {
    let scale = 1.0 / 32f32.sqrt();
    for causal in [false, true] {
        check_varlen("flash_attn_varlen", Window::causal(causal), &Extra::default(), |p, q, k, v| {
            fa::flash_attn_varlen(q, k, v, &p.seqlens_q, &p.seqlens_k, p.max_q, p.max_k, scale, causal)
        });
    }
}

#[test]
fn flash_attn_varlen_windowed_every_side() {
    let scale = 1.0 / 32f32.sqrt();
    for w in WINDOWS {
        check_varlen("flash_attn_varlen_windowed", w, &Extra::default(), |p, q, k, v| {
            fa::flash_attn_varlen_windowed(q, k, v, &p.seqlens_q, &p.seqlens_k, p.max_q, p.max_k, scale, w.0, w.1)
        });
    }
}

#[test]
fn flash_attn_varlen_alibi_family() {
    let scale = 1.0 / 32f32.sqrt();
    let (s, st) = slopes(4);
    let x = Extra { slopes: Some(s.clone()), softcap: None };
    for causal in [false, true] {
        check_varlen("flash_attn_varlen_alibi", Window::causal(causal), &x, |p, q, k, v| {
            fa::flash_attn_varlen_alibi(q, k, v, &st, &p.seqlens_q, &p.seqlens_k, p.max_q, p.max_k, scale, causal)
        });
    }
    for w in [WINDOWS[0], WINDOWS[2]] {
        check_varlen("flash_attn_varlen_alibi_windowed", w, &x, |p, q, k, v| {
            fa::flash_attn_varlen_alibi_windowed(q, k, v, &st, &p.seqlens_q, &p.seqlens_k, p.max_q, p.max_k, scale, w.0, w.1)
        });
    }
    for (w, alibi, cap) in [(WINDOWS[0], true, 4.0), (Window::CAUSAL, false, 30.0), (WINDOWS[1], false, 0.0)] {
        let x = Extra { slopes: alibi.then(|| s.clone()), softcap: (cap > 0.0).then_some(cap) };
        check_varlen("flash_attn_varlen_alibi_windowed_softcap", w, &x, |p, q, k, v| {
            fa::flash_attn_varlen_alibi_windowed_softcap(
                q, k, v, alibi.then_some(&st), &p.seqlens_q, &p.seqlens_k, p.max_q, p.max_k, scale, w.0, w.1, cap,
            )
        });
    }
}

/// `flash_attn_varlen_paged_windowed`: each sequence's keys scattered over the blocks of a
/// paged cache in shuffled order (pages of 8, a page size candle-flash-attn's kernels refuse
/// and ours take), against the reference on the packed keys.
#[test]
fn flash_attn_varlen_paged_windowed_over_shuffled_blocks() -> Result<()> {
    let (hq, hk, d, page) = (4, 2, 32, 8);
    let p = packed(&LENS.0, &LENS.1, hq, hk, d);
    let batch = LENS.0.len();
    let max_blocks = p.max_k.div_ceil(page);
    let num_blocks = batch * max_blocks + 3;
    // Block ids: a fixed shuffle of 0..num_blocks, dealt to the sequences' pages in order.
    let ids: Vec<usize> = (0..num_blocks).map(|i| (i * 7 + 3) % num_blocks).collect();
    let mut table = vec![0u32; batch * max_blocks];
    let (mut kc, mut vc) = (vec![f32::NAN; num_blocks * page * hk * d], vec![f32::NAN; num_blocks * page * hk * d]);
    let (kf, vf) = (p.k.flatten_all()?.to_vec1::<f32>()?, p.v.flatten_all()?.to_vec1::<f32>()?);
    let row = hk * d;
    for b in 0..batch {
        for j in 0..LENS.1[b] {
            let blk = ids[b * max_blocks + j / page];
            table[b * max_blocks + j / page] = blk as u32;
            let (dst, src) = ((blk * page + j % page) * row, (p.cu_k[b] + j) * row);
            kc[dst..dst + row].copy_from_slice(&kf[src..src + row]);
            vc[dst..dst + row].copy_from_slice(&vf[src..src + row]);
        }
    }
    let dev = Device::Cpu;
    let k_cache = Tensor::from_vec(kc, (num_blocks, page, hk, d), &dev)?;
    let v_cache = Tensor::from_vec(vc, (num_blocks, page, hk, d), &dev)?;
    let table = Tensor::from_vec(table, (batch, max_blocks), &dev)?;
    let scale = 1.0 / (d as f32).sqrt();
    for (w, cap) in [(Window::CAUSAL, None), (WINDOWS[0], Some(3.0)), (Window::NONE, None)] {
        let got = fa::flash_attn_varlen_paged_windowed(
            &p.q, &k_cache, &v_cache, &p.seqlens_q, &p.seqlens_k, &table, None, p.max_q, p.max_k, scale, w.0, w.1, page, cap,
        )?;
        let want = naive_varlen(&p.q, &p.k, &p.v, &p.cu_q, &p.cu_k, scale, w, &Extra { slopes: None, softcap: cap })?;
        let err = max_diff(&got, &want);
        assert!(err < 1e-5, "paged {w:?}: max |diff| {err:.2e}");
    }
    // Mask-bypass ranges are refused, not ignored.
    let ranges = Tensor::from_vec([0i32, 4].repeat(batch), (batch, 1, 2), &dev)?;
    let e = fa::flash_attn_varlen_paged_windowed(
        &p.q, &k_cache, &v_cache, &p.seqlens_q, &p.seqlens_k, &table, Some(&ranges), p.max_q, p.max_k, scale, None, Some(0), page, None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("mm_prefix_ranges"), "{e}");
    Ok(())
}

#[test]
fn bad_inputs_are_candle_errors() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[1, 8, 2, 16], &dev);
    let e = fa::flash_attn(&q.transpose(2, 3)?, &q, &q, 0.25, false).unwrap_err();
    assert!(e.to_string().contains("contiguous"), "{e}");
    let e = fa::flash_attn(&q.flatten_to(1)?, &q, &q, 0.25, false).unwrap_err();
    assert!(e.to_string().contains("[batch, seqlen, heads, head_dim]"), "{e}");
    let e = fa::flash_attn(&q, &q.to_dtype(DType::F16)?, &q, 0.25, false).unwrap_err();
    assert!(e.to_string().contains("f32, f16 or bf16"), "{e}");
    let k = randn(&[1, 8, 3, 16], &dev);
    let e = fa::flash_attn(&q, &k, &k, 0.25, false).unwrap_err();
    assert!(e.to_string().contains("heads"), "{e}");
    // ALiBi slopes: f32, one per query head.
    let e = fa::flash_attn_alibi(&q, &q, &q, &Tensor::new(&[0.5f32; 3], &dev)?, 0.25, false).unwrap_err();
    assert!(e.to_string().contains("slope") || e.to_string().contains("alibi"), "{e}");
    let e = fa::flash_attn_alibi(&q, &q, &q, &Tensor::new(&[0.5f64; 2], &dev)?, 0.25, false).unwrap_err();
    assert!(e.to_string().contains("f32"), "{e}");
    // A NaN softcap is an error, not a silent no-op.
    assert!(fa::flash_attn_alibi_windowed_softcap(&q, &q, &q, None, 0.25, None, None, f32::NAN).is_err());
    // Varlen: offsets of different batches, past the rows, a max below the longest sequence.
    let p = packed(&[3, 5], &[4, 4], 2, 2, 16);
    let short = Tensor::new(&[0u32, 3], &dev)?;
    let e = fa::flash_attn_varlen(&p.q, &p.k, &p.v, &short, &p.seqlens_k, 5, 4, 0.25, false).unwrap_err();
    assert!(e.to_string().contains("same number of entries"), "{e}");
    let past = Tensor::new(&[0u32, 3, 9], &dev)?;
    assert!(fa::flash_attn_varlen(&p.q, &p.k, &p.v, &past, &p.seqlens_k, 6, 4, 0.25, false).is_err());
    assert!(fa::flash_attn_varlen(&p.q, &p.k, &p.v, &p.seqlens_q, &p.seqlens_k, 4, 4, 0.25, false).is_err());
    let f = Tensor::new(&[0f32, 3., 8.], &dev)?;
    let e = fa::flash_attn_varlen(&p.q, &p.k, &p.v, &f, &p.seqlens_k, 5, 4, 0.25, false).unwrap_err();
    assert!(e.to_string().contains("u32, i32 or i64"), "{e}");
    Ok(())
}

//! What candle-flash-attn lacks, against candle's own attention on the CPU: the LSE out (dense
//! and varlen), attention over dense and paged KV caches, the KV append into candle cache
//! tensors (then attended, alone or fused), and merge_states of two halves of the keys.

mod common;

use candle_core::{DType, Device, Result, Tensor, D};
use common::{max_diff, naive, randn, Extra, Window};
use flash_attn_candle as fa;
use fa::{ForwardOptions, Mask};

/// The LSE of `softmax(scale · Q·Kᵀ)` with a bottom-right causal mask or none, `[b, hq, sq]`
/// (MHA inputs `[b, s, h, d]`).
fn naive_lse(q: &Tensor, k: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
    let (q, k) = (q.transpose(1, 2)?.contiguous()?, k.transpose(1, 2)?.contiguous()?);
    let (sq, sk) = (q.dim(2)?, k.dim(2)?);
    let s = (q.matmul(&k.t()?.contiguous()?)? * scale as f64)?;
    let bias: Vec<f32> =
        (0..sq).flat_map(|i| (0..sk).map(move |j| if causal && j > i + sk - sq { f32::NEG_INFINITY } else { 0.0 })).collect();
    let s = s.broadcast_add(&Tensor::from_vec(bias, (1, 1, sq, sk), q.device())?)?;
    let m = s.max_keepdim(D::Minus1)?;
    (s.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?.squeeze(D::Minus1)
}

#[test]
fn lse_out_matches_candle() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v) = (randn(&[2, 19, 3, 32], &dev), randn(&[2, 40, 3, 32], &dev), randn(&[2, 40, 3, 32], &dev));
    for causal in [false, true] {
        let opts = ForwardOptions::default().causal(causal).softmax_scale(0.2);
        let (o, lse) = fa::flash_attn_lse(&q, &k, &v, &opts)?;
        assert_eq!(lse.dims(), &[2, 3, 19]);
        assert!(max_diff(&o, &naive(&q, &k, &v, 0.2, Window::causal(causal), &Extra::default())?) < 1e-5);
        assert!(max_diff(&lse, &naive_lse(&q, &k, 0.2, causal)?) < 1e-5);
        let o2 = fa::flash_attn_with_options(&q, &k, &v, &opts)?;
        assert_eq!(max_diff(&o, &o2), 0.0);
    }
    // Varlen: the LSE in FlashAttention's packed layout (heads, total_q); each sequence's rows
    // as the dense call on that sequence alone.
    let (lq, lk) = ([5usize, 12], [9usize, 12]);
    let (qp, kp, vp) = (randn(&[17, 2, 16], &dev), randn(&[21, 2, 16], &dev), randn(&[21, 2, 16], &dev));
    let cu = |a: &[usize]| Tensor::new(&[0u32, a[0] as u32, (a[0] + a[1]) as u32], &dev);
    let opts = ForwardOptions::default().causal(true);
    let (o, lse) = fa::serving::flash_attn_varlen_lse(&qp, &kp, &vp, &cu(&lq)?, &cu(&lk)?, 12, 12, &opts)?;
    assert_eq!((o.dims(), lse.dims()), (&[17, 2, 16][..], &[2, 17][..]));
    let (mut q0, mut k0) = (0, 0);
    for b in 0..2 {
        let cut = |t: &Tensor, a, n| t.narrow(0, a, n)?.unsqueeze(0);
        let (ob, lb) = fa::flash_attn_lse(&cut(&qp, q0, lq[b])?, &cut(&kp, k0, lk[b])?, &cut(&vp, k0, lk[b])?, &opts)?;
        assert!(max_diff(&o.narrow(0, q0, lq[b])?, &ob.squeeze(0)?) < 1e-6);
        assert!(max_diff(&lse.narrow(1, q0, lq[b])?, &lb.squeeze(0)?) < 1e-6);
        (q0, k0) = (q0 + lq[b], k0 + lk[b]);
    }
    Ok(())
}

#[test]
fn dense_cache_attends_the_cached_prefix() -> Result<()> {
    let dev = Device::Cpu;
    let (b, cap, hq, hk, d) = (2, 32, 4, 2, 16);
    let (kc, vc) = (randn(&[b, cap, hk, d], &dev), randn(&[b, cap, hk, d], &dev));
    let q = randn(&[b, 3, hq, d], &dev);
    let lens = [7u32, 30];
    let seqlens = Tensor::new(&lens, &dev)?;
    let (o, lse) = fa::serving::flash_attn_kvcache(&q, &kc, &vc, &seqlens, None, &ForwardOptions::default().causal(true))?;
    assert_eq!(lse.dims(), &[b, hq, 3]);
    for (i, &n) in lens.iter().enumerate() {
        let cut = |t: &Tensor| t.narrow(0, i, 1)?.narrow(1, 0, n as usize);
        let want = naive(&q.narrow(0, i, 1)?, &cut(&kc)?, &cut(&vc)?, 0.25, Window::CAUSAL, &Extra::default())?;
        assert!(max_diff(&o.narrow(0, i, 1)?, &want) < 1e-5);
    }
    Ok(())
}

/// A paged cache of pages of 4 with a block table in reverse order: append 3 new rows per
/// sequence, then attend (separately, and fused in one call on a second copy of the cache);
/// both equal candle's attention over the old keys followed by the new ones.
#[test]
fn append_then_attend_paged_cache() -> Result<()> {
    let dev = Device::Cpu;
    let (b, page, hq, hk, d, new) = (2, 4, 4, 2, 16, 3);
    let old = [5usize, 9];
    let max_blocks = 4;
    let blocks = b * max_blocks;
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let block_of = |s: usize, j: usize| table[s * max_blocks + j / page] as usize;
    // The old keys, per sequence, and a cache holding them.
    let (ko, vo): (Vec<Tensor>, Vec<Tensor>) = old.iter().map(|&n| (randn(&[1, n, hk, d], &dev), randn(&[1, n, hk, d], &dev))).unzip();
    let mut kbuf = vec![0f32; blocks * page * hk * d];
    let mut vbuf = kbuf.clone();
    let row = hk * d;
    for s in 0..b {
        let (kf, vf) = (ko[s].flatten_all()?.to_vec1::<f32>()?, vo[s].flatten_all()?.to_vec1::<f32>()?);
        for j in 0..old[s] {
            let at = (block_of(s, j) * page + j % page) * row;
            kbuf[at..at + row].copy_from_slice(&kf[j * row..(j + 1) * row]);
            vbuf[at..at + row].copy_from_slice(&vf[j * row..(j + 1) * row]);
        }
    }
    let shape = (blocks, page, hk, d);
    let (kc, vc) = (Tensor::from_vec(kbuf.clone(), shape, &dev)?, Tensor::from_vec(vbuf.clone(), shape, &dev)?);
    let (kc2, vc2) = (Tensor::from_vec(kbuf, shape, &dev)?, Tensor::from_vec(vbuf, shape, &dev)?);
    let table = Tensor::from_vec(table.clone(), (b, max_blocks), &dev)?;
    let (kn, vn) = (randn(&[b, new, hk, d], &dev), randn(&[b, new, hk, d], &dev));
    let q = randn(&[b, new, hq, d], &dev);
    let seqlens = Tensor::new(&[old[0] as u32, old[1] as u32], &dev)?;
    let opts = ForwardOptions::default().causal(true);

    fa::serving::append_kv(&kc, &vc, &seqlens, Some(&table), &kn, &vn)?;
    let after = Tensor::new(&[(old[0] + new) as u32, (old[1] + new) as u32], &dev)?;
    let (o, _) = fa::serving::flash_attn_kvcache(&q, &kc, &vc, &after, Some(&table), &opts)?;
    let (o2, lse2) = fa::serving::flash_attn_kvcache_append(&q, &kc2, &vc2, &seqlens, Some(&table), &kn, &vn, &opts)?;
    assert_eq!(lse2.dims(), &[b, hq, new]);
    assert_eq!(max_diff(&kc, &kc2), 0.0, "the fused call writes what append_kv writes");
    for s in 0..b {
        let k_all = Tensor::cat(&[&ko[s], &kn.narrow(0, s, 1)?], 1)?;
        let v_all = Tensor::cat(&[&vo[s], &vn.narrow(0, s, 1)?], 1)?;
        let want = naive(&q.narrow(0, s, 1)?, &k_all, &v_all, 0.25, Window::CAUSAL, &Extra::default())?;
        assert!(max_diff(&o.narrow(0, s, 1)?, &want) < 1e-5);
        assert!(max_diff(&o2.narrow(0, s, 1)?, &want) < 1e-5);
    }
    Ok(())
}

#[test]
fn append_refuses_shared_or_strided_caches_and_leaves_them_untouched() -> Result<()> {
    let dev = Device::Cpu;
    let kc = Tensor::zeros((2, 8, 2, 16), DType::F32, &dev)?;
    let vc = Tensor::zeros((2, 8, 2, 16), DType::F32, &dev)?;
    let kn = randn(&[2, 1, 2, 16], &dev);
    let seqlens = Tensor::new(&[3u32, 4], &dev)?;
    let e = fa::serving::append_kv(&kc, &kc, &seqlens, None, &kn, &kn).unwrap_err();
    assert!(e.to_string().contains("share"), "{e}");
    let e = fa::serving::append_kv(&kc, &vc, &seqlens, None, &kc.narrow(1, 0, 1)?, &kn).unwrap_err();
    assert!(e.to_string().contains("shares storage"), "{e}");
    let strided = Tensor::zeros((8, 2, 2, 16), DType::F32, &dev)?.transpose(0, 1)?;
    let e = fa::serving::append_kv(&strided, &vc, &seqlens, None, &kn, &kn).unwrap_err();
    assert!(e.to_string().contains("contiguous"), "{e}");
    // Past the capacity: an error, and nothing written.
    let full = Tensor::new(&[3u32, 8], &dev)?;
    assert!(fa::serving::append_kv(&kc, &vc, &full, None, &kn, &kn).is_err());
    assert_eq!(kc.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    Ok(())
}

/// Attention over keys split in two halves, merged, equals attention over all of them (output
/// and LSE).
#[test]
fn merge_states_of_two_key_halves() -> Result<()> {
    let dev = Device::Cpu;
    let (q, k, v) = (randn(&[1, 6, 2, 32], &dev), randn(&[1, 40, 2, 32], &dev), randn(&[1, 40, 2, 32], &dev));
    let opts = ForwardOptions::default().mask(Mask::None);
    let (o, lse) = fa::flash_attn_lse(&q, &k, &v, &opts)?;
    let half = |a, n| -> Result<(Tensor, Tensor)> { fa::flash_attn_lse(&q, &k.narrow(1, a, n)?, &v.narrow(1, a, n)?, &opts) };
    let ((oa, la), (ob, lb)) = (half(0, 15)?, half(15, 25)?);
    let (om, lm) = fa::serving::merge_states(&oa, &la, &ob, &lb)?;
    assert!(max_diff(&om, &o) < 1e-5 && max_diff(&lm, &lse) < 1e-5);
    Ok(())
}

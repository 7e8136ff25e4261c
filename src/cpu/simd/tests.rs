use super::*;
use crate::cpu::gemm::{MR, NR};
use crate::cpu::softmax::RowState;
use crate::cpu::softmax::{online_softmax, panel_max, panel_scales};
use crate::cpu::Native;

/// The register transpose places every element where the scalar loop does: every head_dim
/// remainder mod 16, fewer rows than a panel (zero rows).
#[test]
fn panel_transpose_matches_the_scalar_layout() {
    if !std::is_x86_feature_detected!("avx512f") {
        eprintln!("this CPU has no AVX-512: nothing to compare");
        return;
    }
    let zeros = [0.0f32; 80];
    for d in [1usize, 5, 15, 16, 17, 24, 40, 64, 72, 80] {
        let data: Vec<f32> = (0..NR * d).map(|i| i as f32 + 0.5).collect();
        for n in [1usize, 4, 6, 11, 16] {
            let rows: [&[f32]; NR] =
                std::array::from_fn(|r| if r < n { &data[r * d..(r + 1) * d] } else { &zeros[..d] });
            let mut q = vec![-1.0f32; d * NR + 3];
            assert!(fill_panel(&rows, d, &mut q));
            for x in 0..d {
                for (r, row) in rows.iter().enumerate() {
                    assert_eq!(q[x * NR + r], row[x], "d {d} n {n} x {x} lane {r}");
                }
            }
            assert!(q[d * NR..].iter().all(|&v| v == -1.0), "d {d}: wrote past the panel");
        }
    }
}

/// `pack_strip` places every element where the scalar loop of `pack_heads` does: every
/// head_dim remainder mod 16 (partial output vectors), up to MAX_HEAD_DIM, fewer rows than a
/// strip (zero rows), rows a stride apart, NaN and infinities moved as they are.
#[test]
fn pack_strip_matches_the_scalar_layout() {
    if !std::is_x86_feature_detected!("avx512f") {
        eprintln!("this CPU has no AVX-512: nothing to compare");
        return;
    }
    let max = crate::cpu::head_dim::MAX_HEAD_DIM;
    let zeros = vec![0.0f32; max];
    for d in (1..=40).chain([47, 48, 63, 64, 65, 72, 96, 100, 128, 200, 256, max]) {
        let stride = d + 5;
        let mut data: Vec<f32> = (0..MR * stride).map(|i| i as f32 * 0.75 - 3.0).collect();
        data[stride + d - 1] = f32::NAN;
        data[2] = f32::INFINITY;
        for n in 1..=MR {
            let rows: [&[f32]; MR] =
                std::array::from_fn(|r| if r < n { &data[r * stride..r * stride + d] } else { &zeros[..d] });
            let mut k = vec![-1.0f32; d * MR + 7];
            assert!(pack_strip(&rows, d, &mut k));
            for x in 0..d {
                for (i, row) in rows.iter().enumerate() {
                    assert_eq!(k[x * MR + i].to_bits(), row[x].to_bits(), "d {d} n {n} x {x} row {i}");
                }
            }
            assert!(k[d * MR..].iter().all(|&v| v == -1.0), "d {d}: wrote past the strip");
        }
    }
}

/// `pack_v_strip` writes what the scalar copy of `pack_heads` and the padding of
/// `packed_buffers` leave: every head_dim remainder mod 6, up to MAX_HEAD_DIM, fewer rows
/// than a strip (zero rows), NaN and infinities moved as they are, nothing between strips.
#[test]
fn pack_v_strip_matches_the_scalar_layout() {
    if !std::is_x86_feature_detected!("avx512f") {
        eprintln!("this CPU has no AVX-512: nothing to compare");
        return;
    }
    let max = crate::cpu::head_dim::MAX_HEAD_DIM;
    let zeros = vec![0.0f32; max];
    for d in (1..=40).chain([63, 64, 65, 72, 100, 128, 256, max]) {
        let rs = d + 3;
        let mut data: Vec<f32> = (0..MR * rs).map(|i| i as f32 * 0.5 - 7.0).collect();
        let clean = data.clone();
        data[rs + d - 1] = f32::NAN;
        data[1] = f32::NEG_INFINITY;
        let stride = MR * MR + 12;
        let strips = d.div_ceil(MR);
        for n in 1..=MR {
            let rows: [&[f32]; MR] =
                std::array::from_fn(|r| if r < n { &data[r * rs..r * rs + d] } else { &zeros[..d] });
            let mut v = vec![-1.0f32; strips * stride];
            // Row 0 holds −inf in its second column, row 1 a NaN in its last: finite only below both.
            let finite = pack_v_strip(&rows, d, &mut v, stride);
            assert_eq!(finite, Some(d < 2 && n < 2), "d {d} n {n}");
            let finite_rows: [&[f32]; MR] = std::array::from_fn(|r| &clean[r * rs..r * rs + d]);
            assert_eq!(pack_v_strip(&finite_rows, d, &mut vec![0.0; strips * stride], stride), Some(true));
            for c in 0..strips {
                for (i, row) in rows.iter().enumerate() {
                    for col in 0..MR {
                        let want = row.get(c * MR + col).copied().unwrap_or(0.0);
                        let got = v[c * stride + i * MR + col];
                        assert_eq!(got.to_bits(), want.to_bits(), "d {d} n {n} strip {c} key {i} col {col}");
                    }
                }
                assert!(v[c * stride + MR * MR..(c + 1) * stride].iter().all(|&x| x == -1.0), "d {d}");
            }
        }
    }
}

/// `native_softmax` is the generic verbs with `Native`, bit for bit: scores spread over the
/// whole exponent range the softmax meets (differences down to −200 in log2 units), masked
/// keys (−inf), NaN scores, rows that have seen nothing, rows whose max grows by any amount
/// (or to +inf) and rows whose max does not move.
#[test]
fn native_softmax_is_the_generic_verbs_bit_for_bit() {
    let mut rng = crate::numerics::rng::SplitMix64::new(7);
    let mut checked = 0;
    for case in 0..400 {
        let keys = 1 + case % 23;
        let c = [1.0f32, std::f32::consts::LOG2_E * 0.088, 3.7, 40.0][case % 4];
        let mut panel: Vec<f32> = (0..keys * NR).map(|_| (rng.uniform() as f32 - 0.5) * 60.0).collect();
        for (i, x) in panel.iter_mut().enumerate() {
            match (i * 7 + case) % 41 {
                0 => *x = f32::NEG_INFINITY,
                1 if case % 5 == 0 => *x = f32::NAN,
                2 => *x = -1.0e30,
                3 if case % 7 == 0 => *x = f32::INFINITY,
                _ => {}
            }
        }
        let states: Vec<RowState> = (0..NR)
            .map(|q| match (q + case) % 5 {
                0 => RowState::EMPTY,
                1 => RowState { m: 1.0e6, l: 3.0 },
                2 => RowState { m: -1.0e6, l: 0.5 },
                _ => RowState { m: (rng.uniform() as f32 - 0.5) * 40.0, l: 1.0 + rng.uniform() as f32 },
            })
            .collect();
        let (mut st_a, mut p_a) = (states.clone(), panel.clone());
        // Every other case with the max taken beforehand (as `product_max` does).
        let pre = panel_max(&panel);
        let Some(sc_a) = native_softmax(&mut st_a, &mut p_a, c, (case % 2 == 1).then_some(&pre)) else {
            eprintln!("this CPU has no AVX-512F: native_softmax is compiled but not run here");
            return;
        };
        let (mut st_b, mut p_b) = (states, panel);
        let tile_max = panel_max(&p_b);
        let sc_b = panel_scales(&mut st_b, &tile_max, c, &Native);
        online_softmax::<Native, true>(&mut st_b, &sc_b, &mut p_b, c, &Native);
        let bits = |x: &[f32]| x.iter().map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() }).collect::<Vec<_>>();
        assert_eq!(bits(&sc_a), bits(&sc_b), "case {case}: scales");
        assert_eq!(bits(&p_a), bits(&p_b), "case {case}: probabilities");
        let ml = |s: &[RowState]| s.iter().flat_map(|r| [r.m, r.l]).collect::<Vec<_>>();
        assert_eq!(bits(&ml(&st_a)), bits(&ml(&st_b)), "case {case}: states");
        checked += 1;
    }
    assert_eq!(checked, 400);
}

/// `write_panel_rows` is the strided scalar loop, bit for bit, for head dims that do and do
/// not fill whole 16-column blocks, partial panels and rows that saw no key (written as 0
/// even where O holds an infinity or a NaN), into rows a stride apart (as the caller's
/// `[batch, seqlen, heads, head_dim]` rows lie) whose gaps it leaves alone.
#[test]
fn write_panel_rows_is_the_strided_loop() {
    for d in [1usize, 5, 16, 24, 40, 64, 72, 128, 130] {
        let dv = d.next_multiple_of(6);
        let op: Vec<f32> = (0..dv * NR).map(|i| ((i * 37) % 101) as f32 * 0.37 - 17.0).collect();
        let mut op = op;
        op[3 * NR + 2] = f32::INFINITY;
        op[NR + 5] = f32::NAN;
        let inv: [f32; NR] = std::array::from_fn(|r| 1.0 / (r as f32 + 1.7));
        for n in [1usize, 7, 15, 16] {
            for live in [0xffffu16, 0xb5db, 0x0004] {
                // Rows at different places in their lines (stride d + 3), and rows that all
                // start `lead` floats into a line (stride a multiple of 16, gaps either side).
                let aligned = (0..NR).map(|lead| (d.next_multiple_of(NR) + NR, lead));
                for (stride, lead) in [(d + 3, 0)].into_iter().chain(aligned) {
                    let mut whole = vec![-1.0f32; n * stride + 2 * NR];
                    let start = whole.as_ptr().align_offset(64).min(NR) + lead;
                    let buf = &mut whole[start..start + n * stride];
                    let mut rows: Vec<&mut [f32]> = buf.chunks_exact_mut(stride).map(|r| &mut r[..d]).collect();
                    if !write_panel_rows(&op, &inv, live, d, &mut rows) {
                        eprintln!("this CPU has no AVX-512F: write_panel_rows is compiled but not run here");
                        return;
                    }
                    let a: Vec<f32> = buf.chunks_exact(stride).flat_map(|r| r[..d].to_vec()).collect();
                    let gaps = buf.chunks_exact(stride).all(|r| r[d..].iter().all(|&x| x == -1.0));
                    let outside = whole[..start].iter().chain(&whole[start + n * stride..]).all(|&x| x == -1.0);
                    assert!(gaps && outside, "d {d} stride {stride} lead {lead}: wrote into a gap");
                    let b: Vec<f32> = (0..n * d)
                        .map(|i| {
                            let (r, x) = (i / d, i % d);
                            if live >> r & 1 == 0 {
                                0.0
                            } else {
                                op[x * NR + r] * inv[r]
                            }
                        })
                        .collect();
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&a), bits(&b), "d {d} n {n} live {live:#x} stride {stride} lead {lead}");
                }
            }
        }
    }
}

/// `product_max` and `scaled_product` are the generic micro-kernels strip by strip (and
/// `panel_max`, and the rescale) bit for bit, over tiles of several strips: scores with NaNs
/// and zeros for the max, P with zeros and V with an infinity for the skipping product.
#[test]
fn fused_products_are_the_generic_kernels() {
    use crate::cpu::gemm::{micro_kernel, micro_kernel_skip_zero_b, micro_kernel_x2, Acc};
    use crate::cpu::softmax::{panel_max, rescale_o};
    let bits = |x: &[f32]| x.iter().map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() }).collect::<Vec<_>>();
    // First product: 3 strips of 6 keys, head_dim 11. A NaN key row; a Q column of zeros.
    let (d, strips) = (11, 3);
    let mut k: Vec<f32> = (0..strips * d * MR).map(|i| ((i * 7) % 11) as f32 * 0.5 - 2.5).collect();
    k[d * MR + 2] = f32::NAN;
    let q0: Vec<f32> = (0..d * NR).map(|i| ((i * 5) % 13) as f32 * 0.25 - 1.5).collect();
    let mut q1: Vec<f32> = (0..d * NR).map(|i| ((i * 3) % 7) as f32 - 3.0).collect();
    for x in 0..d {
        q1[x * NR + 3] = 0.0;
    }
    let init: [f32; NR] = std::array::from_fn(|q| if q % 4 == 0 { f32::NEG_INFINITY } else { -1.0 });
    let mut s = [vec![0.0f32; strips * MR * NR], vec![0.0f32; strips * MR * NR]];
    let mut m = [init, init];
    let [s0, s1] = &mut s;
    let [m0, m1] = &mut m;
    if !product_max::<2>(KTile::Packed(&k), [&q0, &q1], [s0, s1], ([m0, m1], strips * MR)) {
        eprintln!("this CPU has no AVX-512F: the fused products are compiled but not run here");
        return;
    }
    let mut want = [vec![], vec![]];
    for st in 0..strips {
        let mut acc: [Acc; 2] = [[[0.0; NR]; MR]; 2];
        micro_kernel_x2::<true, false>(&k[st * d * MR..(st + 1) * d * MR], [&q0, &q1], &mut acc);
        want[0].extend_from_slice(acc[0].as_flattened());
        want[1].extend_from_slice(acc[1].as_flattened());
    }
    for t in 0..2 {
        assert_eq!(bits(&s[t]), bits(&want[t]), "panel {t}: scores");
        let rows = [init.as_slice(), &want[t]].concat();
        assert_eq!(bits(&m[t]), bits(&panel_max(&rows)), "panel {t}: max");
    }
    let (mut s1only, mut m1only) = (vec![0.0f32; strips * MR * NR], init);
    assert!(product_max::<1>(KTile::Packed(&k), [&q1], [&mut s1only], ([&mut m1only], strips * MR)));
    assert_eq!(bits(&s1only), bits(&want[1]), "single panel: scores");
    assert_eq!(bits(&m1only), bits(&m[1]), "single panel: max");
    // K's rows read in place (`KTile::Rows`, rows `stride` apart, the last strip's last
    // `pad` keys missing): the packed strips' bits, the packed padding being zeros.
    for pad in [0, 1, 5] {
        let (stride, n) = (d + 5, strips * MR - pad);
        let mut rows = vec![f32::NAN; 3 + n * stride];
        let mut kp = k.clone();
        for j in 0..strips * MR {
            for x in 0..d {
                let at = (j / MR * d + x) * MR + j % MR;
                if j < n {
                    rows[3 + j * stride + x] = k[at];
                } else {
                    kp[at] = 0.0;
                }
            }
        }
        let zeros = [0.0f32; 16];
        let tile = KTile::Rows { data: &rows, at: 3, stride, keys: n, zeros: &zeros };
        let mut buf = Vec::new();
        assert_eq!(bits(tile.packed(strips, d, &mut buf)), bits(&kp), "pad {pad}: gathered strips");
        for t in 0..2 {
            let q = [&q0, &q1][t];
            let (mut sr, mut sp) = (vec![0.0f32; strips * MR * NR], vec![0.0f32; strips * MR * NR]);
            let (mut mr, mut mp) = (init, init);
            assert!(product_max::<1>(tile, [q], [&mut sr], ([&mut mr], n)));
            assert!(product_max::<1>(KTile::Packed(&kp), [q], [&mut sp], ([&mut mp], n)));
            assert_eq!(bits(&sr), bits(&sp), "pad {pad} panel {t}: scores");
            assert_eq!(bits(&mr), bits(&mp), "pad {pad} panel {t}: max");
        }
    }
    // The max over the first `keys` rows only (the scores all the same).
    for keys in 0..strips * MR {
        let mut m2 = [init, init];
        let [m20, m21] = &mut m2;
        let mut s2 = [vec![0.0f32; strips * MR * NR], vec![0.0f32; strips * MR * NR]];
        let [s20, s21] = &mut s2;
        assert!(product_max::<2>(KTile::Packed(&k), [&q0, &q1], [s20, s21], ([m20, m21], keys)));
        for t in 0..2 {
            assert_eq!(bits(&s2[t]), bits(&want[t]), "keys {keys}: scores");
            let rows = [init.as_slice(), &want[t][..keys * NR]].concat();
            assert_eq!(bits(&m2[t]), bits(&panel_max(&rows)), "keys {keys} panel {t}: max");
        }
    }

    // Second product: 2 strips of 6 columns of V, 13 keys, strips `stride` apart.
    let (keys, strips, stride) = (13, 2, 13 * MR + 7);
    let mut v: Vec<f32> = (0..stride * strips).map(|i| ((i * 7) % 11) as f32 * 0.5 - 2.5).collect();
    let p0: Vec<f32> = (0..keys * NR).map(|i| ((i * 5) % 13) as f32 * 0.125).collect();
    let p1: Vec<f32> = (0..keys * NR).map(|i| if i % 5 == 0 { 0.0 } else { ((i * 3) % 7) as f32 * 0.25 }).collect();
    let sc: [f32; NR] = std::array::from_fn(|q| if q % 3 == 0 { 1.0 } else { 0.375 * q as f32 });
    let o: Vec<f32> = (0..strips * MR * NR).map(|i| ((i * 13) % 17) as f32 - 8.0).collect();
    for skip in [false, true] {
        if skip {
            v[stride + 2] = f32::INFINITY;
        }
        let (mut x0, mut x1, mut y) = (o.clone(), o.clone(), o.clone());
        let vt = (&v[..], stride, strips * MR);
        if skip {
            assert!(scaled_product::<2, true>(vt, [&p0, &p1], [&mut x0, &mut x1], [&sc, &sc]));
            assert!(scaled_product::<1, true>(vt, [&p1], [&mut y], [&sc]));
        } else {
            assert!(scaled_product::<2, false>(vt, [&p0, &p1], [&mut x0, &mut x1], [&sc, &sc]));
            assert!(scaled_product::<1, false>(vt, [&p1], [&mut y], [&sc]));
        }
        for ds in 0..strips {
            let a = &v[ds * stride..ds * stride + keys * MR];
            let blk = ds * MR * NR..(ds + 1) * MR * NR;
            let mut acc: [Acc; 2] = [[[0.0; NR]; MR]; 2];
            rescale_o(&o[blk.clone()], &sc, &mut acc[0]);
            rescale_o(&o[blk.clone()], &sc, &mut acc[1]);
            let mut one = acc[1];
            if skip {
                micro_kernel_x2::<true, true>(a, [&p0, &p1], &mut acc);
                micro_kernel_skip_zero_b::<true>(a, &p1, &mut one);
            } else {
                micro_kernel_x2::<true, false>(a, [&p0, &p1], &mut acc);
                micro_kernel::<true>(a, &p1, &mut one);
            }
            assert_eq!(bits(&x0[blk.clone()]), bits(acc[0].as_flattened()), "skip {skip} strip {ds}: panel 0");
            assert_eq!(bits(&x1[blk.clone()]), bits(acc[1].as_flattened()), "skip {skip} strip {ds}: panel 1");
            assert_eq!(bits(&y[blk]), bits(one.as_flattened()), "skip {skip} strip {ds}: single panel");
        }
    }

    // The last strip with 4 or 2 real columns (head_dim 64, 256; 32, 128): those are the
    // generic kernels' bits, the padding rows only rescaled.
    for cols in [strips * MR - 2, strips * MR - 4] {
        let (mut x0, mut x1, mut y) = (o.clone(), o.clone(), o.clone());
        let vt = (&v[..], stride, cols);
        assert!(scaled_product::<2, true>(vt, [&p0, &p1], [&mut x0, &mut x1], [&sc, &sc]));
        assert!(scaled_product::<1, true>(vt, [&p1], [&mut y], [&sc]));
        for ds in 0..strips {
            let a = &v[ds * stride..ds * stride + keys * MR];
            let blk = ds * MR * NR..(ds + 1) * MR * NR;
            let mut acc: [Acc; 2] = [[[0.0; NR]; MR]; 2];
            rescale_o(&o[blk.clone()], &sc, &mut acc[0]);
            rescale_o(&o[blk.clone()], &sc, &mut acc[1]);
            let (scaled, mut one) = (acc[1], acc[1]);
            micro_kernel_x2::<true, true>(a, [&p0, &p1], &mut acc);
            micro_kernel_skip_zero_b::<true>(a, &p1, &mut one);
            for i in 0..MR {
                let row = (ds * MR + i) * NR..(ds * MR + i + 1) * NR;
                let real = ds * MR + i < cols;
                let want = |acc: &Acc| if real { acc[i] } else { scaled[i] };
                assert_eq!(bits(&x0[row.clone()]), bits(&want(&acc[0])), "cols {cols} row {i}: panel 0");
                assert_eq!(bits(&x1[row.clone()]), bits(&want(&acc[1])), "cols {cols} row {i}: panel 1");
                if real {
                    assert_eq!(bits(&y[row]), bits(&one[i]), "cols {cols} row {i}: single panel");
                }
            }
        }
    }
}

/// Three and four panels at once (the grouping of the AVX-512 tiled path): each panel's
/// scores, max and Oᵀ are the single-panel generic kernels' bit for bit, the max over a part
/// of the keys, V with an infinity, and the last V strip with 2 or 4 real columns included.
#[test]
fn grouped_products_are_the_generic_kernels() {
    group_is_the_generic_kernels::<3>();
    group_is_the_generic_kernels::<4>();
}

fn group_is_the_generic_kernels<const G: usize>() {
    use crate::cpu::gemm::{micro_kernel, micro_kernel_skip_zero_b, Acc};
    use crate::cpu::softmax::{panel_max, rescale_o};
    let bits = |x: &[f32]| x.iter().map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() }).collect::<Vec<_>>();
    let (d, strips) = (9, 3);
    let mut k: Vec<f32> = (0..strips * d * MR).map(|i| ((i * 7) % 11) as f32 * 0.5 - 2.5).collect();
    k[2 * d * MR + 4] = f32::NAN;
    let q: [Vec<f32>; G] =
        std::array::from_fn(|t| (0..d * NR).map(|i| ((i * (3 + 2 * t)) % 13) as f32 * 0.25 - 1.5).collect());
    let init: [f32; NR] = std::array::from_fn(|l| if l % 5 == 0 { f32::NEG_INFINITY } else { -0.5 });
    let want: [Vec<f32>; G] = std::array::from_fn(|t| {
        let mut w = vec![];
        for st in 0..strips {
            let mut acc: Acc = [[0.0; NR]; MR];
            micro_kernel::<true>(&k[st * d * MR..(st + 1) * d * MR], &q[t], &mut acc);
            w.extend_from_slice(acc.as_flattened());
        }
        w
    });
    for keys in [strips * MR, strips * MR - 4, 7, 0] {
        let mut s: [Vec<f32>; G] = std::array::from_fn(|_| vec![0.0f32; strips * MR * NR]);
        let mut m = [init; G];
        let qs: [&[f32]; G] = std::array::from_fn(|t| &q[t][..]);
        if !product_max::<G>(KTile::Packed(&k), qs, s.each_mut().map(|x| &mut x[..]), (m.each_mut(), keys)) {
            eprintln!("this CPU has no AVX-512F: the fused products are compiled but not run here");
            return;
        }
        for t in 0..G {
            assert_eq!(bits(&s[t]), bits(&want[t]), "keys {keys} panel {t}: scores");
            let rows = [init.as_slice(), &want[t][..keys * NR]].concat();
            assert_eq!(bits(&m[t]), bits(&panel_max(&rows)), "keys {keys} panel {t}: max");
        }
    }

    let (keys, strips, stride) = (11, 3, 11 * MR + 5);
    let mut v: Vec<f32> = (0..stride * strips).map(|i| ((i * 7) % 11) as f32 * 0.5 - 2.5).collect();
    let p: [Vec<f32>; G] = std::array::from_fn(|t| {
        (0..keys * NR).map(|i| if (i + t) % 4 == 0 { 0.0 } else { ((i * (t + 3)) % 7) as f32 * 0.25 }).collect()
    });
    let sc: [[f32; NR]; G] = std::array::from_fn(|t| std::array::from_fn(|l| 0.125 * ((l + t) % 9) as f32 + 0.5));
    let o: Vec<f32> = (0..strips * MR * NR).map(|i| ((i * 13) % 17) as f32 - 8.0).collect();
    let all = strips * MR;
    for (skip, cols) in [(false, all), (true, all), (true, all - 2), (false, all - 4)] {
        if skip {
            v[stride + 3] = f32::INFINITY;
        }
        let mut x: [Vec<f32>; G] = std::array::from_fn(|_| o.clone());
        let vt = (&v[..], stride, cols);
        let ps: [&[f32]; G] = std::array::from_fn(|t| &p[t][..]);
        let xs = x.each_mut().map(|x| &mut x[..]);
        let scs: [&[f32; NR]; G] = std::array::from_fn(|t| &sc[t]);
        if skip {
            assert!(scaled_product::<G, true>(vt, ps, xs, scs));
        } else {
            assert!(scaled_product::<G, false>(vt, ps, xs, scs));
        }
        for ds in 0..strips {
            let a = &v[ds * stride..ds * stride + keys * MR];
            let blk = ds * MR * NR..(ds + 1) * MR * NR;
            for t in 0..G {
                let mut acc: Acc = [[0.0; NR]; MR];
                rescale_o(&o[blk.clone()], &sc[t], &mut acc);
                let scaled = acc;
                if skip {
                    micro_kernel_skip_zero_b::<true>(a, &p[t], &mut acc);
                } else {
                    micro_kernel::<true>(a, &p[t], &mut acc);
                }
                for i in 0..MR {
                    let want = if ds * MR + i < cols { acc[i] } else { scaled[i] };
                    let row = (ds * MR + i) * NR..(ds * MR + i + 1) * NR;
                    let at = format!("skip {skip} cols {cols} strip {ds} row {i} panel {t}");
                    assert_eq!(bits(&x[t][row]), bits(&want), "{G} panels: {at}");
                }
            }
        }
    }
}

//! K and V of an FP8 KV cache: e4m3 codes with f32 scales, dequantised a chunk of rows at a time
//! as the sweeps read them (each code decoded from its bits, vectorised, times the row's scale),
//! so that no f32 copy of the cache is ever made.

use crate::numerics::fp8::e4m3_decode;

/// The scales of one side (K or V) of an FP8 cache.
#[derive(Clone, Copy, Debug)]
pub enum RowScales<'a> {
    /// One scale for every row.
    One(f32),
    /// One scale per row: the row at element offset `o` has scale `[o / head_dim]` (the cache is
    /// contiguous, so this is its (slot, kv head) index).
    PerRow(&'a [f32]),
}

/// One side (K or V) of an FP8 cache: contiguous e4m3 codes laid out as the f32 / 16-bit caches
/// are, and their scales.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Rows<'a> {
    pub codes: &'a [u8],
    pub scales: RowScales<'a>,
}

/// K and V of an FP8 cache.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Kv<'a> {
    pub k: Fp8Rows<'a>,
    pub v: Fp8Rows<'a>,
}

impl Fp8Rows<'_> {
    /// The scale of the row at element offset `o`.
    #[inline(always)]
    pub fn scale(&self, o: usize, d: usize) -> f32 {
        match self.scales {
            RowScales::One(s) => s,
            RowScales::PerRow(s) => s[o / d],
        }
    }

    /// Dequantises the rows at element offsets `ofs` (each `d` codes) into consecutive rows of
    /// `buf`: `value(code) · scale`.
    #[inline(always)]
    pub fn dequantize(&self, ofs: &[usize], d: usize, buf: &mut [f32]) {
        for (dst, &o) in buf.chunks_exact_mut(d).zip(ofs) {
            let s = self.scale(o, d);
            for (x, &c) in dst.iter_mut().zip(&self.codes[o..o + d]) {
                *x = e4m3_decode(c) * s;
            }
        }
    }
}

//! Software `exp2` (FlashAttention-4's emulation on the FMA units), shared with
//! `cuda/common/exp2_poly.cuh` (same constants, same steps).
//!
//! `2^x = 2^floor(x) * 2^f`, `f = x - floor(x)` in `[0, 1)`:
//! 1. clamp `x` below at -127 (2^-127 is already below f32's normal range, so P underflows to ~0);
//! 2. `floor(x)` (the GPU gets it by adding 2^23 + 2^22 with round-down);
//! 3. `2^f` by a minimax polynomial, Horner form (FMAs);
//! 4. add `floor(x) << 23` to the bits of `2^f` (multiplies by 2^floor(x) through the exponent).
//!
//! NaN stays NaN (the clamp is written so NaN passes through). The domain is `x < 128`: above,
//! the exponent add overflows (in CUDA too) and the result is meaningless. The softmax never gets
//! there: its argument is at most the lazy threshold plus the FP8 offset (<= 64 + 8, enforced by
//! `numerics::validate`). Inputs in `[-127, -126)` give values around 2^-127 with the implicit bit
//! lost (subnormal range); their relative error is large, their absolute error below 1e-38.
//!
//! Maximum relative error over `[-126, 128)` (tests/numerics.rs measures it): the polynomial's
//! own 2.1e-3 (degree 2), 8.76e-5 (3), 3.0e-6 (4), 8.5e-8 (5), plus about one f32 ulp of
//! evaluation rounding (degree 5 measures 1.43e-7).

/// Minimax coefficients of `2^f` on `[0, 1)`, lowest degree first, indexed by degree.
///
/// Source: FlashAttention-4, `flash_attn/cute/utils.py` `POLY_EX2`, obtained with Sollya
/// `fpminimax(exp(x * log(2.0)), d, [|1,24...|], [0;1], relative)` (constant term fixed to 1).
#[allow(clippy::excessive_precision)] // FA4's exact decimal expansions of the f32 values, digit for digit
pub const POLY_EX2: [&[f32]; 6] = [
    &[1.0],
    &[1.0, 0.922497093677520751953125],
    &[1.0, 0.6657850742340087890625, 0.330107033252716064453125],
    &[1.0, 0.695146143436431884765625, 0.227564394474029541015625, 0.077119089663028717041015625],
    &[
        1.0,
        0.693042695522308349609375,
        0.2412912547588348388671875,
        5.2225358784198760986328125e-2,
        1.3434938155114650726318359375e-2,
    ],
    &[
        1.0,
        0.693151414394378662109375,
        0.24016360938549041748046875,
        5.5802188813686370849609375e-2,
        9.01452265679836273193359375e-3,
        1.86810153536498546600341796875e-3,
    ],
];

/// The lowest input: 2^-127 is subnormal, and anything below contributes nothing to P.
pub const EXP2_CLAMP_LOW: f32 = -127.0;

/// Degrees selectable through [`crate::Exp2::Poly`].
pub const POLY_DEGREES: std::ops::RangeInclusive<u8> = 2..=5;

/// Evaluate `2^f` for `f` in `[0, 1)` with the degree-`D` polynomial (Horner).
#[inline(always)]
pub fn poly_frac<const D: usize>(f: f32) -> f32 {
    let c = POLY_EX2[D];
    let mut acc = c[D];
    let mut i = D;
    while i > 0 {
        i -= 1;
        // Explicit FMA: the CUDA header uses fmaf on both sides, so all three agree bit for bit.
        acc = acc.mul_add(f, c[i]);
    }
    acc
}

/// Software `exp2` with a degree-`D` polynomial.
#[inline(always)]
pub fn exp2_poly<const D: usize>(x: f32) -> f32 {
    // `if` rather than `max`: f32::max(NaN, -127) is -127, and NaN must stay NaN.
    let x = if x < EXP2_CLAMP_LOW { EXP2_CLAMP_LOW } else { x };
    let n = x.floor();
    let f = x - n;
    let p = poly_frac::<D>(f);
    // For x in [-127, 128), n is in [-127, 127]: adding n to the exponent field of p (in [1, 2)) is exact, except at
    // n = -127 where the result is the subnormal-adjacent 2^-127 * p rounded by the bit add.
    let bits = (p.to_bits() as i32).wrapping_add((n as i32).wrapping_shl(23));
    f32::from_bits(bits as u32)
}

/// Software `exp2` with a runtime degree (2..=5); used by the emulation paths.
#[inline(always)]
pub fn exp2_poly_deg(x: f32, degree: u8) -> f32 {
    match degree {
        2 => exp2_poly::<2>(x),
        3 => exp2_poly::<3>(x),
        4 => exp2_poly::<4>(x),
        _ => exp2_poly::<5>(x),
    }
}

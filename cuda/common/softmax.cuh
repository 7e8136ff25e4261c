// The online softmax of every kernel family (FA1, FA2, FA3), written once over the family's
// fragment layout, and the scalar rules it is built from (the same verbs as src/cpu/softmax.rs:
// max_get_scale, rescale, finalize).
//
// Units, as on the CPU (src/cpu/softmax.rs, "Units"): scores s and the running max m are in score
// units (raw q.k, or natural units when softcap or ALiBi is on); every exponent is (s - m) * c
// with c = FwdParams::softmax_scale_log2 (scale * log2 e for raw scores, log2 e for natural
// ones), and u converts score units to natural units for the LSE (scale, or 1). Never m * c
// alone: rounded to f32 next to an exact s * c it is off by up to ±128 in the exponent once
// |m * c| >= 2^31, and s * c overflows above f32::MAX / log2 e.
//
// The -inf guard: while a row has seen only masked keys its max is -inf, and exponents are taken
// against 0 instead, so exp2((-inf - 0) * c) = 0 and never exp2(-inf + inf) = NaN.
//
// A fragment layout `Frag` says which scores and outputs a thread holds (one object per thread):
//   kRows               rows of the tile this thread holds a part of
//   kSCols, kOCols      score / output elements per row held by this thread
//   kLanes              lanes sharing a row (a power of two; partners by xor 1, 2, ...)
//   s(S&, r, j), o(O&, r, j)   element j of row r of the score / output array (a float&)
//   row(r), col(j)      tile-relative query row of row r and key of score element j
//
// A policy `Pol` says how exponents are taken (FaEagerMufu for FA1; FaRowPolicy, the unit's
// table row, for FA2 and FA3; FA4 stage 3's traits for FlashAttention-4's softmax):
//   kPolyEvery, kPolyDegree   score element j with j % kPolyEvery == kPolyEvery - 1 takes the
//                             degree-kPolyDegree software exp2 (FMA units), the rest MUFU (0: none)
//   kLazyTau                  the lazy rescale threshold in log2 units (< 0: eager)
#pragma once
#include <math.h>

#include "common/exp2_poly.cuh"
#include "common/numerics.cuh"
#include "common/params.h"

// ---- scalar rules (host and device) -----------------------------------------------------------

// What row exponents are taken against: the max, or 0 while it is -inf (the -inf guard).
FA_HD float fa_softmax_ref(float m) { return m == -INFINITY ? 0.f : m; }

// Whether a tile may keep the stale running max (FlashAttention-4's lazy rescale, the rule of
// max_get_scale in src/cpu/softmax.rs, proof of exactness and of no overflow there): growth =
// (tile_max - m) * c, the growth of the max in log2 units, is at most tau.
FA_HD bool fa_lazy_keeps_max(float growth, float tau) { return growth <= tau; }

// With P in e4m3 offset by 2^FA_FP8_P_SCALE_LOG2, tau + that offset must stay below log2(448) or
// P saturates while the f32 row sum still counts it (reported upstream as Dao-AILab/flash-attention#2131 and #2716).
// Written as fp8_lazy_limit() in src/numerics/mod.rs (log2(448) - 8, then compare) so the two
// agree at the boundary too.
FA_HD bool fa_fp8_lazy_threshold_ok(float tau) { return tau < log2f(FA_E4M3_MAX) - FA_FP8_P_SCALE_LOG2; }

// Folds a tile's max into the running max *m and returns the factor for O and l (1 when nothing
// changes), with the lazy rule (tau < 0: eager) and `exp2` for the factor.
template <class Exp2> FA_HD float fa_max_get_scale_with(float* m, float tile_max, float c, float tau, Exp2 exp2) {
    if (!(tile_max > *m)) return 1.0f;  // no growth, or NaN
    if (*m == -INFINITY) {              // first visible key: nothing to rescale
        *m = tile_max;
        return 1.0f;
    }
    const float growth = (tile_max - *m) * c;  // > 0, possibly +inf (then the factor is 0)
    if (tau >= 0.0f && fa_lazy_keeps_max(growth, tau)) return 1.0f;
    float scale = exp2(-growth);
    *m = tile_max;
    return scale;
}
// fa_max_get_scale_with the degree-D software exp2 (src/cpu/softmax.rs max_get_scale with
// Exp2::Poly(D)).
template <int D> FA_HD float fa_max_get_scale(float* m, float tile_max, float c, float tau) {
    return fa_max_get_scale_with(m, tile_max, c, tau, [](float x) { return fa_exp2_poly<D>(x); });
}

// The end of a row with max m (score units) and sum l: 1/l and the natural-log LSE, u converting
// the max to natural units. A row that saw no key (l = 0) is `empty`: its output is written as
// exactly 0 (not O * 0, NaN if a masked key's infinite V reached O) and its LSE is -inf,
// FlashAttention's convention. A NaN sum (a NaN score the row sees) stays NaN.
struct FaRowEnd {
    float inv_l, lse;
    bool empty;
};
FA_HD FaRowEnd fa_softmax_finalize(float m, float l, float u) {
    if (l == 0.f) return FaRowEnd{0.f, -INFINITY, true};
    return FaRowEnd{1.f / l, m * u + log2f(l) * FA_LN2, false};
}

// fa_softmax_finalize with an attention sink: the logit `sink` (natural units; -inf: none) joins
// the row's denominator with no value, i.e. the row's state gains (o = 0, lse = sink). In closed
// form, as the CPU's fold_sink (src/numerics/merge.rs): lse = lse_keys + softplus(sink - lse_keys)
// and 1/l times exp(-softplus), which never forms exp(sink - m) (it overflows once the sink is far
// above the scores). softplus(x) = max(x, 0) + log(1 + exp(-|x|)), taken in log2 units with
// exp2f / log2f only (log1pf cost FA3 stage 5's consumers a spill at head_dim 128); 1 + exp(-|x|)
// loses exp(-|x|) < 2^-24 to rounding, an absolute error below 2^-24 in the LSE. A row that saw
// no key gets output 0 and LSE `sink`; a NaN row stays NaN.
FA_HD FaRowEnd fa_softmax_finalize_sink(float m, float l, float u, float sink) {
    const FaRowEnd keys = fa_softmax_finalize(m, l, u);
    if (sink == -INFINITY) return keys;
    if (keys.empty) return FaRowEnd{0.f, sink, true};
    const float x = (sink - keys.lse) * FA_LOG2E;
    const float softplus = fmaxf(x, 0.f) + log2f(1.f + exp2f(-fabsf(x)));  // log2 units
    return FaRowEnd{keys.inv_l * exp2f(-softplus), keys.lse + softplus * FA_LN2, false};
}

// Whether scores are in natural units (softcap or ALiBi on) rather than raw q.k, and the factor
// that converts the max's score units to natural units for the LSE.
FA_HD bool fa_natural_scores(const FwdParams& p) { return (p.flags & (FA_FLAG_SOFTCAP | FA_FLAG_ALIBI)) != 0u; }
FA_HD float fa_to_natural(const FwdParams& p) { return fa_natural_scores(p) ? 1.f : p.softmax_scale; }

// ---- the score transform and the online softmax over a fragment (device) ----------------------
#if defined(__CUDACC__) || defined(FA_HOST_EMULATION)
#include "sm80/fast_math.cuh"

// The ALiBi slope of a query head (0 without ALiBi).
__device__ __forceinline__ float fa_alibi_slope(const FwdParams& p, int head) {
    return (p.flags & FA_FLAG_ALIBI) ? reinterpret_cast<const float*>(p.alibi_slopes)[head] : 0.f;
}

// The sink logit of a query head (FwdParams::sinks; -inf where there are none).
__device__ __forceinline__ float fa_sink(const FwdParams& p, int head) {
    return p.sinks != 0 ? reinterpret_cast<const float*>(p.sinks)[head] : -INFINITY;
}

// Raw q.k -> natural units in place, called only when fa_natural_scores(p) (the common case keeps
// raw q.k and pays nothing): times softmax_scale, softcap cap * tanh(v * (1 / cap)) (1 / cap is
// finite: the host refuses subnormal caps; folding scale / cap into one factor would overflow to
// inf), then minus the ALiBi bias slope * |i + seqlen_k - seqlen_q - j|. Each step as a
// straightforward f32 softmax takes it, so each is finite wherever its counterpart there is.
// kAlibi: the family takes ALiBi; kFastTanh: tanh.approx (2^-11 relative error) instead of tanhf.
// row0 / col0: the query row and key of the tile's origin; diag: seqlen_k - seqlen_q of the
// sequence (a serving launch passes each sequence's sk_b - sq_b, cuda/common/seqlen.cuh).
template <bool kAlibi, bool kFastTanh, class Frag, class S>
__device__ __forceinline__ void fa_scores_to_natural(S& s, const Frag& f, const FwdParams& p, float slope, int row0,
                                                     int col0, int diag) {
    const bool softcap = (p.flags & FA_FLAG_SOFTCAP) != 0u;
    const float inv_cap = softcap ? 1.f / p.softcap : 0.f;
    // 32-bit on purpose (64-bit cost FA2 18 registers at hdim 128): with seqlens <= 2^30 (the
    // engine's limit) |row + diag - key| <= 2^30 + 255 for every row and key of a tile, padding
    // included, and so is every partial sum.
#pragma unroll
    for (int r = 0; r < Frag::kRows; ++r)
#pragma unroll
        for (int j = 0; j < Frag::kSCols; ++j) {
            float& v = Frag::s(s, r, j);
            v *= p.softmax_scale;
            if (softcap) v = p.softcap * (kFastTanh ? fa_tanh_approx(v * inv_cap) : tanhf(v * inv_cap));
            if (kAlibi) v -= slope * static_cast<float>(abs(row0 + f.row(r) + diag - (col0 + f.col(j))));
        }
}

// A dense launch: the diagonal of the whole problem.
template <bool kAlibi, bool kFastTanh, class Frag, class S>
__device__ __forceinline__ void fa_scores_to_natural(S& s, const Frag& f, const FwdParams& p, float slope, int row0,
                                                     int col0) {
    fa_scores_to_natural<kAlibi, kFastTanh>(s, f, p, slope, row0, col0, p.seqlen_k - p.seqlen_q);
}

// Max / sum over the kLanes lanes that share a row (consecutive lanes, xor partners).
template <int kLanes> __device__ __forceinline__ float fa_lanes_max(float x) {
#pragma unroll
    for (int o = 1; o < kLanes; o *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
template <int kLanes> __device__ __forceinline__ float fa_lanes_sum(float x) {
#pragma unroll
    for (int o = 1; o < kLanes; o *= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// The exponent policy of FA1-FA3: every exponent on MUFU, the running max always moves.
struct FaEagerMufu {
    static constexpr int kPolyEvery = 0;
    static constexpr int kPolyDegree = 0;
    static constexpr float kLazyTau = -1.0f;
};

// The exponent policy of the compile unit's table row (build/instances.rs): FA4's softmax in
// the FA2 and FA3 pipelines where the row has the EXP2_POLY / LAZY_RESCALE options (the build
// then defines FA_EXP2_POLY_EVERY and FA_EXP2_POLY_DEGREE, resp. FA_LAZY_TAU), FaEagerMufu's
// values where it has not. A row may have either option alone: share 0 with the lazy rescale
// (its factor then on MUFU, as the CPU's Exp2::Accurate), or the share with the eager rescale.
struct FaRowPolicy {
#if defined(FA_EXP2_POLY_EVERY) && defined(FA_EXP2_POLY_DEGREE)
    static constexpr int kPolyEvery = FA_EXP2_POLY_EVERY;
    static constexpr int kPolyDegree = FA_EXP2_POLY_DEGREE;
#else
    static constexpr int kPolyEvery = 0;
    static constexpr int kPolyDegree = 0;
#endif
#if defined(FA_LAZY_TAU)
    static constexpr float kLazyTau = FA_LAZY_TAU;
#else
    static constexpr float kLazyTau = -1.0f;
#endif
    static_assert(kPolyEvery == 0 || (kPolyEvery >= 1 && kPolyDegree >= 2), "a software exp2 share needs its degree");
};

// Per-thread state of the rows it holds: running max m (score units, -inf before any visible
// key) and this thread's partial running sum l (reduced over the row's lanes at the end).
// update() is one tile in one call; a kernel whose row is split (across warpgroups, or over
// passes through tensor memory) composes the same steps itself: row_max, fold_max, exp_sum,
// add_sum.
template <class Frag, class Pol = FaEagerMufu>
struct FaOnlineSoftmax {
    static constexpr int kRows = Frag::kRows;
    float m[kRows];
    float l[kRows];

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            m[r] = -INFINITY;
            l[r] = 0.f;
        }
    }

    // Max of row r of a tile of scores (masked keys -inf) over this thread's elements and the
    // row's lanes.
    template <class S>
    __device__ __forceinline__ static float row_max(S& s, int r, float mx = -INFINITY) {
#pragma unroll
        for (int j = 0; j < Frag::kSCols; ++j) mx = fmaxf(mx, Frag::s(s, r, j));
        return fa_lanes_max<Frag::kLanes>(mx);
    }

    // Folds a tile's row max into m[r]; returns the factor for O and l (rescale): eager, the
    // max moves and the factor is exp2((m_old - ref) * c) (old max -inf: 0, nothing to rescale
    // yet); lazy, fa_max_get_scale's rule.
    __device__ __forceinline__ float fold_max(int r, float tile_max, float c) {
        if constexpr (Pol::kLazyTau >= 0.0f && Pol::kPolyDegree >= 2) {
            return fa_max_get_scale<Pol::kPolyDegree>(&m[r], tile_max, c, Pol::kLazyTau);
        } else if constexpr (Pol::kLazyTau >= 0.0f) {
            return fa_max_get_scale_with(&m[r], tile_max, c, Pol::kLazyTau, [](float x) { return fa_ex2_approx(x); });
        } else {
            const float mx = fmaxf(m[r], tile_max);
            const float corr = fa_ex2_approx((m[r] - fa_softmax_ref(mx)) * c);
            m[r] = mx;
            return corr;
        }
    }

    // Row r of s becomes P = exp2((s - ref) * c) in place, ref = the running max under the
    // -inf guard (masked: exp2(-inf) = 0); returns this thread's sum of the row's P.
    template <class S>
    __device__ __forceinline__ float exp_sum(S& s, int r, float c) const {
        const float ref = fa_softmax_ref(m[r]);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < Frag::kSCols; ++j) {
            float& x = Frag::s(s, r, j);
            const float e = (x - ref) * c;
            if constexpr (Pol::kPolyEvery > 0) {
                x = j % Pol::kPolyEvery == Pol::kPolyEvery - 1 ? fa_exp2_poly<Pol::kPolyDegree>(e) : fa_ex2_approx(e);
            } else {
                x = fa_ex2_approx(e);
            }
            sum += x;
        }
        return sum;
    }

    // l[r] = l[r] * corr + sum: the running sum, rescaled with the factor fold_max returned.
    __device__ __forceinline__ void add_sum(int r, float corr, float sum) { l[r] = l[r] * corr + sum; }

    // Folds one tile of scores (masked keys -inf) into the state: s becomes P = exp2((s - m) * c)
    // in place, and corr[r] receives the factor the output accumulated so far must be multiplied
    // by (rescale). Does not touch O, so a kernel may overlap it with a PV product in flight.
    template <class S>
    __device__ __forceinline__ void update(S& s, float c, float (&corr)[kRows]) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            corr[r] = fold_max(r, row_max(s, r, m[r]), c);
            add_sum(r, corr[r], exp_sum(s, r, c));
        }
    }

    // O *= corr, row by row. With the lazy rule the factors are exactly 1 on most tiles: the
    // warp skips the multiplies when every factor of its 32 lanes is 1 (warp-uniform, so every
    // lane of a warp takes the same path; every lane must call it).
    template <class O>
    __device__ __forceinline__ void rescale(O& o, const float (&corr)[kRows]) const {
        if constexpr (Pol::kLazyTau >= 0.0f) {
            bool need = false;
#pragma unroll
            for (int r = 0; r < kRows; ++r) need |= corr[r] != 1.0f;
            if (fa_lanes_max<32>(need ? 1.0f : 0.0f) == 0.0f) return;
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int j = 0; j < Frag::kOCols; ++j) Frag::o(o, r, j) *= corr[r];
    }

    // The end of row r (u: score units -> natural units), with the row's sink logit (natural
    // units; -inf: none). Every lane of the row must call it.
    __device__ __forceinline__ FaRowEnd finalize(int r, float u, float sink = -INFINITY) const {
        return fa_softmax_finalize_sink(m[r], fa_lanes_sum<Frag::kLanes>(l[r]), u, sink);
    }
};

#endif  // __CUDACC__ || FA_HOST_EMULATION

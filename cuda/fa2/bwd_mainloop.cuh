// The FA2 backward main kernel (FlashAttention-2's backward, Dao, arXiv 2307.08691, Algorithm 2)
// on mma.sync: one CTA per (key block, kv head, batch). K_j and V_j are loaded once; for every
// query head of the kv head's group and every query block that sees a key of the block:
//   S^T  = K_j Q_i^T                       (recomputed; scale, softcap, ALiBi and mask as the forward)
//   P^T  = exp2(S^T * c - LSE_i * log2 e)  (the forward's LSE: no row max or sum is needed)
//   dP^T = V_j dO_i^T
//   dS^T = P^T o (dP^T - D_i)              (times 1 - tanh^2 under softcap)
//   dV_j += P^T dO_i,  dK_j += dS^T Q_i    (f32, in registers for the CTA's whole loop)
//   dQ_i += dS K_j                         (f32 atomics into dq_accum, or the key block's partial)
// dK and dV of a kv head sum over its query heads here (the CTA loops over the group), so they
// need no atomics. dq_accum holds sum dS K without the softmax scale; the convert kernel applies it.
//
// Fragments (fa2/layout.h): S^T and dP^T are accumulators of m16 key tiles x n8 query tiles, so,
// as P in the forward, they are already the A fragments of P^T dO and dS^T Q (p_src_tile /
// p_src_elem). K and V are A operands (ldmatrix like the forward's Q), Q and dO B operands of
// S^T / dP^T (ldmatrix like the forward's K) and of dK / dV (ldmatrix.trans like the forward's V).
// dS goes through shared memory, [query][key], for dQ = dS K (A like Q, K as B with .trans).
#pragma once
#include <math.h>
#include <stdint.h>

#include "common/bwd_params.h"
#include "common/dtype.cuh"
#include "common/mask.cuh"
#include "fa2/bwd_traits.cuh"
#include "fa2/layout.h"
#include "sm80/fast_math.cuh"
#include "sm80/mma.cuh"
#include "sm80/red.cuh"

namespace fa2 {

constexpr float kBwdLog2e = 1.4426950408889634f;

// Copies rows [row0, row0 + kRows) (global pitch row_stride, kHeadDim elements each) into a
// shared tile of pitch T::kStride with 16-byte cp.async; rows at or past row_end become zeros.
template <typename T, int kRows, typename Elem>
__device__ __forceinline__ void bwd_load_rows(Elem* smem, const Elem* g, int64_t row_stride, int row0, int row_end,
                                              int tid) {
    constexpr int kChunks = T::kChunksPerRow;
#pragma unroll 1
    for (int c = tid; c < kRows * kChunks; c += T::kNThreads) {
        const int r = c / kChunks, col = (c % kChunks) * 8;
        const bool in = row0 + r < row_end;
        const Elem* src = in ? g + static_cast<int64_t>(row0 + r) * row_stride + col : g;
        cp_async_16(smem_u32(smem + r * T::kStride + col), src, in ? 16 : 0);
    }
}

// The query rows that see some key of [k0, k1) (k1 <= seqlen_k): [first, end), empty when
// end <= first. Both mask bounds are monotone in the row (common/mask.cuh), so the rows form one
// range: row i sees key k iff key_lo(i) <= k < key_hi(i).
struct FaRowRange {
    int first, end;
};
__device__ __forceinline__ FaRowRange bwd_rows_seeing(const BwdParams& p, int k0, int k1) {
    const long long diag = static_cast<long long>(p.seqlen_k) - p.seqlen_q;
    // key_hi(i) = i + right + diag + 1 > k0  <=>  i >= k0 - right - diag
    long long first = p.window_right < 0 ? 0 : static_cast<long long>(k0) - p.window_right - diag;
    // key_lo(i) = i - left + diag < k1  <=>  i < k1 + left - diag
    long long end = p.window_left < 0 ? p.seqlen_q : static_cast<long long>(k1) + p.window_left - diag;
    first = first < 0 ? 0 : (first > p.seqlen_q ? p.seqlen_q : first);
    end = end < 0 ? 0 : (end > p.seqlen_q ? p.seqlen_q : end);
    return FaRowRange{static_cast<int>(first), static_cast<int>(end)};
}

template <typename Elem, int kHeadDim>
__device__ __forceinline__ void bwd_kernel(const BwdParams& p) {
    using T = Fa2BwdTile<kHeadDim>;
    using M = Mma<Elem>;
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStride = T::kStride, kSStride = T::kSStride;
    constexpr int kQTiles = T::kQTiles, kDPartTiles = T::kDPartTiles;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    Elem* sQ = reinterpret_cast<Elem*>(smem_raw);  // [kBlockM][kStride]
    Elem* sDo = sQ + kBlockM * kStride;             // [kBlockM][kStride]
    Elem* sK = sDo + kBlockM * kStride;             // [kBlockN][kStride]
    Elem* sV = sK + kBlockN * kStride;              // [kBlockN][kStride]
    Elem* sDs = sV + kBlockN * kStride;             // [kBlockM][kSStride]: dS, query-major
    float* sLse = reinterpret_cast<float*>(sDs + kBlockM * kSStride);  // [kBlockM], log2 units
    float* sD = sLse + kBlockM;                                         // [kBlockM]

    const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int key_warp = warp % T::kKeyWarps, dpart = warp / T::kKeyWarps;
    const int n0 = n_block * kBlockN;
    const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
    const int group = p.heads_q / p.heads_kv;
    const bool softcap = (p.flags & FA_FLAG_SOFTCAP) != 0u;
    const bool alibi = (p.flags & FA_FLAG_ALIBI) != 0u;
    const bool natural = softcap || alibi;
    const bool deterministic = (p.flags & FA_BWD_FLAG_DETERMINISTIC) != 0u;
    const float inv_cap = softcap ? 1.f / p.softcap : 0.f;

    float acc_dk[kDPartTiles][4], acc_dv[kDPartTiles][4];
#pragma unroll
    for (int t = 0; t < kDPartTiles; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_dk[t][i] = acc_dv[t][i] = 0.f;

    // The query blocks holding a row that sees a key of this block (none: dK = dV = 0).
    const FaRowRange rows = bwd_rows_seeing(p, n0, min(n0 + kBlockN, seqlen_k));
    const int m_first = rows.first / kBlockM;
    const int m_end = rows.end > rows.first ? (rows.end + kBlockM - 1) / kBlockM : m_first;

    // K_j and V_j once, as the first cp.async group (waited with the first query block's), and
    // only when some block will wait for them.
    if (m_end > m_first) {
        const Elem* gK = reinterpret_cast<const Elem*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
        const Elem* gV = reinterpret_cast<const Elem*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;
        bwd_load_rows<T, kBlockN>(sK, gK, p.k_row_stride, n0, seqlen_k, tid);
        bwd_load_rows<T, kBlockN>(sV, gV, p.v_row_stride, n0, seqlen_k, tid);
        cp_async_commit();
    }

    const uint32_t sQ_u32 = smem_u32(sQ), sDo_u32 = smem_u32(sDo), sK_u32 = smem_u32(sK), sV_u32 = smem_u32(sV);
    const uint32_t sDs_u32 = smem_u32(sDs);
    // Per-lane ldmatrix addresses (bytes): A rows of this warp's keys (like the forward's Q), B
    // rows of queries (like the forward's K), B.trans rows of queries for dK / dV (like V).
    const uint32_t key_a_lane = ((16 * key_warp + ldsm_q_row(lane)) * kStride + ldsm_q_col(lane)) * 2;
    const uint32_t qry_b_lane = (ldsm_k_row(lane) * kStride + ldsm_k_col(lane)) * 2;
    const uint32_t qry_bt_lane = (ldsm_v_row(lane) * kStride + ldsm_v_col(lane) + dpart * T::kDPart) * 2;

    for (int hi = 0; hi < group; ++hi) {
        const int head = kv_head * group + hi;
        const float slope = alibi ? reinterpret_cast<const float*>(p.alibi_slopes)[head] : 0.f;
        const Elem* gQ = reinterpret_cast<const Elem*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride;
        const Elem* gDo = reinterpret_cast<const Elem*>(p.d_o) + batch * p.do_batch_stride + head * p.do_head_stride;
        const int64_t row_base = (static_cast<int64_t>(batch) * p.heads_q + head) * seqlen_q;
        for (int m_block = m_first; m_block < m_end; ++m_block) {
            const int m0 = m_block * kBlockM;
            // ---- Q_i, dO_i (cp.async), LSE_i and D_i (plain loads) ----
            bwd_load_rows<T, kBlockM>(sQ, gQ, p.q_row_stride, m0, seqlen_q, tid);
            bwd_load_rows<T, kBlockM>(sDo, gDo, p.do_row_stride, m0, seqlen_q, tid);
            cp_async_commit();
            for (int r = tid; r < kBlockM; r += T::kNThreads) {
                const bool in = m0 + r < seqlen_q;
                sLse[r] = in ? reinterpret_cast<const float*>(p.lse)[row_base + m0 + r] * kBwdLog2e : 0.f;
                sD[r] = in ? reinterpret_cast<const float*>(p.d_sum)[row_base + m0 + r] : 0.f;
            }
            cp_async_wait<0>();
            __syncthreads();  // the block's rows (and, first time, K_j and V_j) visible to every warp

            // ---- S^T = K Q^T and dP^T = V dO^T: [16 keys of this warp][kBlockM queries] ----
            float acc_s[kQTiles][4], acc_dp[kQTiles][4];
#pragma unroll
            for (int t = 0; t < kQTiles; ++t)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc_s[t][i] = acc_dp[t][i] = 0.f;
#pragma unroll
            for (int ks = 0; ks < T::kKSteps; ++ks) {
                uint32_t ka[4], va[4];
                ldmatrix_x4(ka, sK_u32 + key_a_lane + ks * 32);
                ldmatrix_x4(va, sV_u32 + key_a_lane + ks * 32);
#pragma unroll
                for (int np = 0; np < kQTiles / 2; ++np) {
                    uint32_t qb[4], ob[4];
                    ldmatrix_x4(qb, sQ_u32 + qry_b_lane + (np * 16 * kStride + ks * 16) * 2);
                    ldmatrix_x4(ob, sDo_u32 + qry_b_lane + (np * 16 * kStride + ks * 16) * 2);
                    M::run(acc_s[2 * np], ka, qb[0], qb[1]);
                    M::run(acc_s[2 * np + 1], ka, qb[2], qb[3]);
                    M::run(acc_dp[2 * np], va, ob[0], ob[1]);
                    M::run(acc_dp[2 * np + 1], va, ob[2], ob[3]);
                }
            }

            // ---- P^T and dS^T in place: element i of n-tile t is (key acc_row, query acc_col) ----
            const bool full = m0 + kBlockM <= seqlen_q &&
                              !fa_tile_needs_mask(p, m0, m0 + kBlockM - 1, n0, static_cast<long long>(n0) + kBlockN - 1);
#pragma unroll
            for (int t = 0; t < kQTiles; ++t)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = n0 + 16 * key_warp + acc_row(lane, i);
                    const int r = 8 * t + acc_col(lane, i);  // query row inside the block
                    const int query = m0 + r;
                    float s = acc_s[t][i], dtanh = 1.f;
                    if (natural) {
                        s *= p.softmax_scale;
                        if (softcap) {
                            const float th = tanhf(s * inv_cap);
                            s = p.softcap * th;
                            dtanh = 1.f - th * th;
                        }
                        if (alibi) s -= slope * static_cast<float>(abs(query + (seqlen_k - seqlen_q) - key));
                    }
                    const bool visible = full || (query < seqlen_q && fa_key_visible(p, query, key));
                    const float pr = visible ? fa_ex2_approx(fmaf(s, p.softmax_scale_log2, -sLse[r])) : 0.f;
                    acc_s[t][i] = pr;
                    acc_dp[t][i] = pr * (acc_dp[t][i] - sD[r]) * dtanh;
                }

            // ---- dV += P^T dO, dK += dS^T Q (A from the registers above) ----
#pragma unroll
            for (int kk = 0; kk < kBlockM / 16; ++kk) {
                uint32_t pa[4], dsa[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const float* ps = acc_s[2 * kk + p_src_tile(r)];
                    const float* ds = acc_dp[2 * kk + p_src_tile(r)];
                    pa[r] = fa_pack2<Elem>(ps[p_src_elem(r, 0)], ps[p_src_elem(r, 1)]);
                    dsa[r] = fa_pack2<Elem>(ds[p_src_elem(r, 0)], ds[p_src_elem(r, 1)]);
                }
#pragma unroll
                for (int dp = 0; dp < kDPartTiles / 2; ++dp) {
                    uint32_t ob[4], qb[4];
                    ldmatrix_x4_trans(ob, sDo_u32 + qry_bt_lane + (kk * 16 * kStride + dp * 16) * 2);
                    ldmatrix_x4_trans(qb, sQ_u32 + qry_bt_lane + (kk * 16 * kStride + dp * 16) * 2);
                    M::run(acc_dv[2 * dp], pa, ob[0], ob[1]);
                    M::run(acc_dv[2 * dp + 1], pa, ob[2], ob[3]);
                    M::run(acc_dk[2 * dp], dsa, qb[0], qb[1]);
                    M::run(acc_dk[2 * dp + 1], dsa, qb[2], qb[3]);
                }
            }

            // ---- dS to shared memory, query-major, for dQ (one warp per key tile writes) ----
            if (dpart == 0) {
#pragma unroll
                for (int t = 0; t < kQTiles; ++t)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        sDs[(8 * t + acc_col(lane, i)) * kSStride + 16 * key_warp + acc_row(lane, i)] =
                            fa_from_float<Elem>(acc_dp[t][i]);
            }
            __syncthreads();  // dS complete for every warp; every warp is done reading sQ / sDo

            // ---- dQ_i += dS K_j: tasks of 16 rows x kDqCols columns spread over the warps ----
            for (int task = warp; task < T::kDqTasks; task += T::kNWarps) {
                constexpr int kColBlocks = kHeadDim / T::kDqCols;
                const int mt = task / kColBlocks, c0 = (task % kColBlocks) * T::kDqCols;
                float acc_dq[T::kDqCols / 8][4];
#pragma unroll
                for (int t = 0; t < T::kDqCols / 8; ++t)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc_dq[t][i] = 0.f;
#pragma unroll
                for (int ks = 0; ks < kBlockN / 16; ++ks) {
                    uint32_t da[4];
                    ldmatrix_x4(da, sDs_u32 + ((16 * mt + ldsm_q_row(lane)) * kSStride + ks * 16 + ldsm_q_col(lane)) * 2);
#pragma unroll
                    for (int dp = 0; dp < T::kDqCols / 16; ++dp) {
                        uint32_t kb[4];
                        ldmatrix_x4_trans(kb, sK_u32 + ((ks * 16 + ldsm_v_row(lane)) * kStride + c0 + dp * 16 +
                                                        ldsm_v_col(lane)) * 2);
                        M::run(acc_dq[2 * dp], da, kb[0], kb[1]);
                        M::run(acc_dq[2 * dp + 1], da, kb[2], kb[3]);
                    }
                }
                // Deterministic: this key block's own partial, written once (each (head, row) is
                // visited once per CTA); else an f32 atomic add into the one accumulator.
                float* acc = reinterpret_cast<float*>(p.dq_accum) +
                             ((deterministic ? static_cast<int64_t>(n_block) * p.batch * p.heads_q * seqlen_q : 0) +
                              row_base) * kHeadDim;
#pragma unroll
                for (int t = 0; t < T::kDqCols / 8; ++t)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int row = m0 + 16 * mt + acc_row(lane, i);
                        if (row >= seqlen_q) continue;
                        float* dst = acc + static_cast<int64_t>(row) * kHeadDim + c0 + 8 * t + acc_col(lane, i);
                        if (deterministic)
                            *dst = acc_dq[t][i];
                        else
                            red_add_f32(dst, acc_dq[t][i]);
                    }
            }
        }
    }

    // ---- dK (times the softmax scale) and dV of this CTA's keys, straight from the registers ----
    Elem* gDk = reinterpret_cast<Elem*>(p.dk) + batch * p.dk_batch_stride + kv_head * p.dk_head_stride;
    Elem* gDv = reinterpret_cast<Elem*>(p.dv) + batch * p.dv_batch_stride + kv_head * p.dv_head_stride;
#pragma unroll
    for (int t = 0; t < kDPartTiles; ++t)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int key = n0 + 16 * key_warp + acc_row(lane, 2 * half);
            if (key >= seqlen_k) continue;
            const int col = dpart * T::kDPart + 8 * t + acc_col(lane, 0);
            *reinterpret_cast<uint32_t*>(gDk + static_cast<int64_t>(key) * p.dk_row_stride + col) =
                fa_pack2<Elem>(acc_dk[t][2 * half] * p.softmax_scale, acc_dk[t][2 * half + 1] * p.softmax_scale);
            *reinterpret_cast<uint32_t*>(gDv + static_cast<int64_t>(key) * p.dv_row_stride + col) =
                fa_pack2<Elem>(acc_dv[t][2 * half], acc_dv[t][2 * half + 1]);
        }
}

}  // namespace fa2

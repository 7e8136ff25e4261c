// Stage 3's warp roles: two Q tiles in ping-pong and FA4's softmax (software exp2 for a share of
// elements, conditional rescaling).
#pragma once
#include "fa4/roles2.cuh"

namespace fa4 {

#if defined(__CUDA_ARCH_FEAT_SM100_ALL)

// ---------------------------------------------------------------- stage 3: + two Q tiles in
// ping-pong and FA4's softmax (software exp2 for a share of elements, conditional rescaling)

struct Barriers3 {
    uint64_t *q_full, *kv_full, *kv_empty, *s_full, *p_full, *corr_full, *o_ready, *o_done, *stats_full;
    __device__ __forceinline__ explicit Barriers3(uint64_t* b) {
        q_full = b;
        kv_full = b + 1;     // [2 slots]
        kv_empty = b + 3;    // [2 slots]
        s_full = b + 5;      // [2 Q tiles] S_t = Q_t K_j^T done (commit)
        p_full = b + 7;      // [2 Q tiles] P_t written over S_t by softmax warpgroup t (128 arrivals)
        corr_full = b + 9;   // [2 Q tiles] tile j's factors of Q tile t in smem (128 arrivals)
        o_ready = b + 11;    // [2 Q tiles] O_t rescaled for tile j (128 arrivals)
        o_done = b + 13;     // [2 Q tiles] O_t += P_t V_j done (commit)
        stats_full = b + 15; // both softmax warpgroups' final max and sums in smem (256 arrivals)
    }
    __device__ __forceinline__ void init() const {
        init_ring_barriers(q_full, kv_full, kv_empty, s_full);
        for (int s = 0; s < 2; ++s) {
            mbar_init(&p_full[s], 128);
            mbar_init(&corr_full[s], 128);
            mbar_init(&o_ready[s], 128);
            mbar_init(&o_done[s], 1);
        }
        mbar_init(stats_full, 2 * 128);
    }
};

// The MMA warp's issuing thread, ping-pong over the two Q tiles: while softmax warpgroup 1 works
// on S_1 of tile j, the tensor core runs O_0 += P_0 V_j and S_0 of tile j + 1, and vice versa.
template <class Tr, class T>
__device__ __forceinline__ void mma_role3(const Barriers3& b, uint32_t tmem, uint32_t sq, uint32_t sk, uint32_t sv,
                                          int n_tiles) {
    constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
    constexpr uint32_t idesc_qk = umma_idesc_f16(kBf16, kUmmaM, Tr::kBlockN, false, false);
    constexpr uint32_t idesc_pv = umma_idesc_f16(kBf16, kUmmaM, Tr::kHeadDim, false, true);
    auto issue_s = [&](int t, int j) {
        const int slot = j % 2;
#pragma unroll
        for (int kk = 0; kk < Tr::kHeadDim / kUmmaK; ++kk) {
            const int off = t * Tr::kQTileBytes + (kk / 4) * Tr::kQSlabStride + (kk % 4) * kUmmaKBytes;
            const int koff = slot * Tr::kKvTileBytes + (kk / 4) * Tr::kKvSlabStride + (kk % 4) * kUmmaKBytes;
            umma_f16_ss(tmem_addr(tmem, 0, Tr::kTmemS + t * Tr::kBlockN), umma_desc_kmajor_sw128(sq + off),
                        umma_desc_kmajor_sw128(sk + koff), idesc_qk, kk > 0 ? 1u : 0u);
        }
        umma_commit(&b.s_full[t]);
    };
    auto issue_pv = [&](int t, int j) {
        const int slot = j % 2;
        mbar_wait(&b.p_full[t], j & 1);
        mbar_wait(&b.o_ready[t], j & 1);
        tcgen05_fence_after();
#pragma unroll
        for (int kk = 0; kk < Tr::kBlockN / kUmmaK; ++kk) {
            const uint32_t a = tmem_addr(tmem, 0, Tr::kTmemS + t * Tr::kBlockN + kk * (kUmmaK / 2));
            const int voff = slot * Tr::kKvTileBytes + kk * kUmmaK * kSwizzleBytes;
            umma_f16_ts(tmem_addr(tmem, 0, Tr::kTmemO + t * Tr::kHeadDim), a,
                        umma_desc_mnmajor_sw128(sv + voff, Tr::kKvSlabStride), idesc_pv, (j > 0 || kk > 0) ? 1u : 0u);
        }
    };
    mbar_wait(b.q_full, 0);
    mbar_wait(&b.kv_full[0], 0);
    tcgen05_fence_after();
    issue_s(0, 0);
    issue_s(1, 0);
    for (int j = 0; j < n_tiles; ++j) {
        const bool next = j + 1 < n_tiles;
        if (next) {
            mbar_wait(&b.kv_full[(j + 1) % 2], ((j + 1) / 2) & 1);
            tcgen05_fence_after();
        }
        // S_t of tile j + 1 overwrites P_t of tile j: issued after PV_t, and MMAs of one thread
        // execute in issue order.
        issue_pv(0, j);
        umma_commit(&b.o_done[0]);
        if (next) issue_s(0, j + 1);
        issue_pv(1, j);
        umma_commit(&b.kv_empty[j % 2]);  // before o_done[1]: commits arrive in order (see stage 2)
        umma_commit(&b.o_done[1]);
        if (next) issue_s(1, j + 1);
    }
}

// Softmax warpgroup t: all 128 keys of every tile for the 128 rows of Q tile t, in two passes over
// 32-key quarters of S (the row max, then exp2 and P), so S never sits in registers whole (the
// 512-thread CTA has 128 registers per thread); P quarter q goes to columns [16 q, 16 q + 16) of
// S_t, which hold keys already read.
template <class Tr, class T>
__device__ __forceinline__ void softmax_role3(const FwdParams& p, const Barriers3& b, uint8_t* smem, uint32_t tmem,
                                              int t, int r, int warp, int m0, int n_begin, int n_tiles) {
    constexpr int kQuarter = 32;
    constexpr int kQuarters = Tr::kBlockN / kQuarter;
    float* corr_s = reinterpret_cast<float*>(smem + Tr::kOffCorr);  // [Q tile][row]
    const int row = m0 + t * kUmmaM + r;
    const int col0 = Tr::kTmemS + t * Tr::kBlockN;
    const float c = p.softmax_scale_log2;
    RowSoftmax<Tr, kQuarter> st;  // FA4's softmax: Tr's poly share and lazy threshold
    st.init();
    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = (n_begin + j) * Tr::kBlockN;
        mbar_wait(&b.s_full[t], j & 1);
        __syncwarp();
        tcgen05_fence_after();
        float tile_max = -INFINITY;
#pragma unroll 1
        for (int q = 0; q < kQuarters; ++q) {
            float s[kQuarter];
            tmem_load_row<kQuarter>(tmem, warp, col0 + kQuarter * q, s);
            softcap_and_mask<kQuarter>(p, s, row, n0 + kQuarter * q);
            tile_max = st.row_max(s, 0, tile_max);
        }
        // Conditional rescaling: the running max moves only when it grew by more than tau.
        const float corr = st.fold_max(0, tile_max, c);
        float sum = 0.f;
#pragma unroll 1
        for (int q = 0; q < kQuarters; ++q) {
            float s[kQuarter];
            tmem_load_row<kQuarter>(tmem, warp, col0 + kQuarter * q, s);
            softcap_and_mask<kQuarter>(p, s, row, n0 + kQuarter * q);
            sum += st.exp_sum(s, 0, c);  // element i % kPolyEvery == kPolyEvery - 1: software exp2
            uint32_t packed[kQuarter / 2];
#pragma unroll
            for (int i = 0; i < kQuarter / 2; ++i) packed[i] = fa_pack2<T>(s[2 * i], s[2 * i + 1]);
            tmem_st_32x32b_x16(tmem_addr(tmem, 32 * (warp % 4), col0 + (kQuarter / 2) * q), packed);
        }
        st.add_sum(0, corr, sum);
        tmem_wait_st();
        corr_s[t * kUmmaM + r] = corr;
        tcgen05_fence_before();
        mbar_arrive(&b.p_full[t]);
        mbar_arrive(&b.corr_full[t]);
    }
    publish_row_end<Tr>(b, smem, st, t, r, true);
}

// The correction warpgroup: per tile and Q tile, rescales O_t only when some row of the warp
// needs it (the decision is warp-uniform: tcgen05.ld/st are warp-collective), then the epilogue
// of both Q tiles.
template <class Tr, class T>
__device__ __forceinline__ void correction_role3(const FwdParams& p, const Barriers3& b, uint8_t* smem, uint32_t tmem,
                                                 int r, int warp, int m0, const BlockCoord& bc, int n_tiles) {
    const float* corr_s = reinterpret_cast<const float*>(smem + Tr::kOffCorr);
    for (int j = 0; j < n_tiles; ++j) {
#pragma unroll
        for (int t = 0; t < Tr::kQTiles; ++t) {
            mbar_wait(&b.corr_full[t], j & 1);
            const float corr = corr_s[t * kUmmaM + r];
            if (j > 0) {
                int need = corr != 1.f;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) need |= __shfl_xor_sync(0xffffffffu, need, o);
                if (need) {
                    mbar_wait(&b.o_done[t], (j - 1) & 1);
                    __syncwarp();
                    tcgen05_fence_after();
                    rescale_o<Tr>(tmem, warp, corr, t);
                }
            }
            tcgen05_fence_before();
            mbar_arrive(&b.o_ready[t]);
        }
    }
    mbar_wait(b.stats_full, 0);
#pragma unroll
    for (int t = 0; t < Tr::kQTiles; ++t) {
        if (n_tiles > 0) {
            mbar_wait(&b.o_done[t], (n_tiles - 1) & 1);
            __syncwarp();
            tcgen05_fence_after();
        }
        const FaRowEnd end = published_row_end<Tr>(p, smem, t * kUmmaM + r, 1, bc.head);
        write_output<Tr, T>(p, end, tmem + static_cast<uint32_t>(t * Tr::kHeadDim), warp, m0 + t * kUmmaM + r,
                            bc.batch, bc.head, n_tiles > 0);
    }
}

#endif  // __CUDA_ARCH_FEAT_SM100_ALL

}  // namespace fa4

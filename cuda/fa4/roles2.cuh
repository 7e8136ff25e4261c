// Stage 2's warp roles (FA4's): the load warp, the MMA warp, two softmax warpgroups and the
// correction warpgroup, with the barriers and row-end exchange stage 3 reuses.
#pragma once
#include "fa4/tile.cuh"

namespace fa4 {

#if defined(__CUDA_ARCH_FEAT_SM100_ALL)

// ---------------------------------------------------------------- stage 2: + FA4's warp roles

// The barriers stages 2 and 3 share, one arrival each: q_full, and per slot (stage 2: K/V ring
// slot; stage 3: Q tile for s_full) kv_full, kv_empty, s_full.
__device__ __forceinline__ void init_ring_barriers(uint64_t* q_full, uint64_t* kv_full, uint64_t* kv_empty,
                                                   uint64_t* s_full) {
    mbar_init(q_full, 1);
    for (int s = 0; s < 2; ++s) {
        mbar_init(&kv_full[s], 1);
        mbar_init(&kv_empty[s], 1);
        mbar_init(&s_full[s], 1);
    }
}

// Barrier block of stage 2 (8 bytes each), in the order of Fa4Traits' comment.
struct Barriers2 {
    uint64_t *q_full, *kv_full, *kv_empty, *s_full, *p_full, *corr_full, *o_ready, *o_done, *stats_full;
    __device__ __forceinline__ explicit Barriers2(uint64_t* b) {
        q_full = b;
        kv_full = b + 1;     // [2] K and V of ring slot s landed (TMA)
        kv_empty = b + 3;    // [2] the MMAs reading slot s completed (commit)
        s_full = b + 5;      // [2] S_j in TMEM buffer j % 2 (commit)
        p_full = b + 7;      // [2] P_j written over S_j by both softmax warpgroups (256 arrivals)
        corr_full = b + 9;   // [2] tile j's correction factors in shared memory (128 arrivals)
        o_ready = b + 11;    // O rescaled for tile j by the correction warpgroup (128 arrivals)
        o_done = b + 12;     // O += P_j V_j completed (commit)
        stats_full = b + 13; // final row max and partial sums in shared memory (256 arrivals)
    }
    __device__ __forceinline__ void init() const {
        init_ring_barriers(q_full, kv_full, kv_empty, s_full);
        for (int s = 0; s < 2; ++s) {
            mbar_init(&p_full[s], 2 * 128);
            mbar_init(&corr_full[s], 128);
        }
        mbar_init(o_ready, 128);
        mbar_init(o_done, 1);
        mbar_init(stats_full, 2 * 128);
    }
};

// A softmax warpgroup's end of row r for the correction warpgroup (stages 2-3): its partial sum
// into slot `i` of the partial sums (stage 2: the warpgroup, stage 3: the Q tile), the running
// max into slot i of the maxima where `with_max`, then the stats_full arrival.
template <class Tr, class B, class St>
__device__ __forceinline__ void publish_row_end(const B& b, uint8_t* smem, const St& st, int i, int r, bool with_max) {
    reinterpret_cast<float*>(smem + Tr::kOffLsum)[i * kUmmaM + r] = st.l[0];
    if (with_max) reinterpret_cast<float*>(smem + Tr::kOffMax)[i * kUmmaM + r] = st.m[0];
    mbar_arrive(b.stats_full);
}

// The end of the row at `row` of the maxima (stats_full waited for): its max and the sum of its
// `parts` partial sums, kUmmaM apart (stage 2: one per softmax warpgroup), with the head's sink
// folded in (fa_softmax_finalize_sink, -inf: none). The max and the sum are the final ones of
// the same running state (a stale max under the lazy rescale scales both alike), so the fold is
// exact whatever the softmax skipped.
template <class Tr>
__device__ __forceinline__ FaRowEnd published_row_end(const FwdParams& p, const uint8_t* smem, int row, int parts,
                                                      int head) {
    const float* lsum = reinterpret_cast<const float*>(smem + Tr::kOffLsum);
    float l = 0.f;
    for (int i = 0; i < parts; ++i) l += lsum[i * kUmmaM + row];
    return fa_softmax_finalize_sink(reinterpret_cast<const float*>(smem + Tr::kOffMax)[row], l, fa_to_natural(p),
                                    fa_sink(p, head));
}

// The MMA warp's one issuing thread: S_0, then per tile j: S_{j+1} into the other TMEM buffer
// (overlapping tile j's softmax), and once P_j and the rescaled O are ready, O += P_j V_j with P
// read from tensor memory. MMAs of one thread execute in issue order, so S_{j+1} overwrites buffer
// (j + 1) % 2 only after PV_{j-1} has read P_{j-1} from it.
template <class Tr, class T>
__device__ __forceinline__ void mma_role(const Barriers2& b, uint32_t tmem, uint32_t sq, uint32_t sk, uint32_t sv,
                                         int n_tiles) {
    constexpr uint32_t idesc_pv =
        umma_idesc_f16(std::is_same<T, __nv_bfloat16>::value, kUmmaM, Tr::kHeadDim, false, true);
    constexpr uint32_t idesc_qk =
        umma_idesc_f16(std::is_same<T, __nv_bfloat16>::value, kUmmaM, Tr::kBlockN, false, false);
    auto issue_s = [&](int j) {
        const int slot = j % 2;
        mbar_wait(&b.kv_full[slot], (j / 2) & 1);
        tcgen05_fence_after();
#pragma unroll
        for (int kk = 0; kk < Tr::kHeadDim / kUmmaK; ++kk) {
            const int off = (kk / 4) * Tr::kQSlabStride + (kk % 4) * kUmmaKBytes;
            const int koff = slot * Tr::kKvTileBytes + (kk / 4) * Tr::kKvSlabStride + (kk % 4) * kUmmaKBytes;
            umma_f16_ss(tmem_addr(tmem, 0, Tr::kTmemS + slot * Tr::kBlockN), umma_desc_kmajor_sw128(sq + off),
                        umma_desc_kmajor_sw128(sk + koff), idesc_qk, kk > 0 ? 1u : 0u);
        }
        umma_commit(&b.s_full[slot]);
    };
    mbar_wait(b.q_full, 0);
    issue_s(0);
    for (int j = 0; j < n_tiles; ++j) {
        const int slot = j % 2;
        if (j + 1 < n_tiles) issue_s(j + 1);
        mbar_wait(&b.p_full[slot], (j / 2) & 1);
        mbar_wait(b.o_ready, j & 1);
        tcgen05_fence_after();
#pragma unroll
        for (int kk = 0; kk < Tr::kBlockN / kUmmaK; ++kk) {
            // P_j: keys 16kk.. are TMEM columns 8kk.. of buffer `slot` (two 16-bit values each).
            const uint32_t a = tmem_addr(tmem, 0, Tr::kTmemS + slot * Tr::kBlockN + kk * (kUmmaK / 2));
            const int voff = slot * Tr::kKvTileBytes + kk * kUmmaK * kSwizzleBytes;
            umma_f16_ts(tmem_addr(tmem, 0, Tr::kTmemO), a, umma_desc_mnmajor_sw128(sv + voff, Tr::kKvSlabStride),
                        idesc_pv, (j > 0 || kk > 0) ? 1u : 0u);
        }
        // The slot's release first: commits arrive in order, and the correction warpgroup's wait
        // on the last o_done then also covers the last kv_empty arrival (nothing pending at exit).
        umma_commit(&b.kv_empty[slot]);
        umma_commit(b.o_done);
    }
}

// The load warp's one thread (stages 2-3, Barriers2 or Barriers3): every Q tile once (a tile wholly
// past seqlen_q is zero-filled by TMA and its rows never written), then K/V tile j into ring slot
// j % 2 once the MMAs of tile j - 2 released it.
template <class Tr, class B>
__device__ __forceinline__ void load_role(const B& b, const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                          uint8_t* sq, uint8_t* sk, uint8_t* sv, const BlockCoord& bc, int m0,
                                          int n_begin, int n_tiles) {
    tma_prefetch_desc(tq);
    tma_prefetch_desc(tk);
    tma_prefetch_desc(tv);
    mbar_arrive_expect_tx(b.q_full, Tr::kTmaQBytes);
#pragma unroll
    for (int t = 0; t < Tr::kQTiles; ++t)
#pragma unroll
        for (int slab = 0; slab < Tr::kSlabs; ++slab)
            tma_load_4d(sq + t * Tr::kQTileBytes + slab * Tr::kQSlabStride, tq, b.q_full, slab * kSlabCols, bc.head,
                        m0 + t * kUmmaM, bc.batch);
    for (int j = 0; j < n_tiles; ++j) {
        const int slot = j % 2;
        if (j >= 2) mbar_wait(&b.kv_empty[slot], ((j - 2) / 2) & 1);
        mbar_arrive_expect_tx(&b.kv_full[slot], Tr::kTmaKvBytes);
#pragma unroll
        for (int slab = 0; slab < Tr::kSlabs; ++slab) {
            tma_load_4d(sk + slot * Tr::kKvTileBytes + slab * Tr::kKvSlabStride, tk, &b.kv_full[slot],
                        slab * kSlabCols, bc.kv_head, (n_begin + j) * Tr::kBlockN, bc.batch);
            tma_load_4d(sv + slot * Tr::kKvTileBytes + slab * Tr::kKvSlabStride, tv, &b.kv_full[slot],
                        slab * kSlabCols, bc.kv_head, (n_begin + j) * Tr::kBlockN, bc.batch);
        }
    }
}

// A softmax warpgroup (wg 0 or 1): keys [64 wg, 64 wg + 64) of every tile for the 128 rows (thread
// r of the warpgroup = TMEM lane r). The two warpgroups agree on each tile's row max through shared
// memory and named barrier 1; each keeps its partial row sum (rescaled by the same factors).
template <class Tr, class T>
__device__ __forceinline__ void softmax_role(const FwdParams& p, const Barriers2& b, uint8_t* smem, uint32_t tmem,
                                             int wg, int r, int warp, int m0, int n_begin, int n_tiles) {
    constexpr int kKeys = Tr::kKeysPerSoftmaxWg;
    float* red = reinterpret_cast<float*>(smem + Tr::kOffRed);    // [tile % 2][wg][row]
    float* corr_s = reinterpret_cast<float*>(smem + Tr::kOffCorr);  // [tile % 2][row]
    const int row = m0 + r;
    const float c = p.softmax_scale_log2;
    RowSoftmax<Tr, kKeys> st;
    st.init();
    for (int j = 0; j < n_tiles; ++j) {
        const int slot = j % 2;
        const int col0 = Tr::kTmemS + slot * Tr::kBlockN;
        mbar_wait(&b.s_full[slot], (j / 2) & 1);
        __syncwarp();
        tcgen05_fence_after();
        float s[kKeys];
        tmem_load_row<kKeys>(tmem, warp, col0 + kKeys * wg, s);
        softcap_and_mask<kKeys>(p, s, row, (n_begin + j) * Tr::kBlockN + kKeys * wg);
        red[(slot * 2 + wg) * Tr::kBlockM + r] = st.row_max(s, 0);
        // Both warpgroups' partial maxima are written, and both have read their S half out of
        // TMEM (so P may now be written over it).
        fa3::named_bar_sync<1, 256>();
        const float tile_max = fmaxf(red[(slot * 2 + 0) * Tr::kBlockM + r], red[(slot * 2 + 1) * Tr::kBlockM + r]);
        const float corr = st.fold_max(0, tile_max, c);
        st.add_sum(0, corr, st.exp_sum(s, 0, c));
        uint32_t packed[kKeys / 2];
#pragma unroll
        for (int i = 0; i < kKeys / 2; ++i) packed[i] = fa_pack2<T>(s[2 * i], s[2 * i + 1]);
        // P_j over S_j: keys 64 wg + 2c, +1 -> column col0 + 32 wg + c (A from TMEM, 16-bit).
        static_assert(kKeys / 2 == 32, "one x32 store per warpgroup");
        tmem_st_32x32b_x32(tmem_addr(tmem, 32 * (warp % 4), col0 + (kKeys / 2) * wg), packed);
        tmem_wait_st();
        if (wg == 0) corr_s[slot * Tr::kBlockM + r] = corr;
        tcgen05_fence_before();
        mbar_arrive(&b.p_full[slot]);
        if (wg == 0) mbar_arrive(&b.corr_full[slot]);
    }
    publish_row_end<Tr>(b, smem, st, wg, r, wg == 0);
}

// The correction warpgroup: before PV_j (j >= 1) rescales O in TMEM by tile j's factors, once
// PV_{j-1} completed; at the end normalises O and writes it (and LSE).
template <class Tr, class T>
__device__ __forceinline__ void correction_role(const FwdParams& p, const Barriers2& b, uint8_t* smem, uint32_t tmem,
                                                int r, int warp, int m0, const BlockCoord& bc, int n_tiles) {
    const float* corr_s = reinterpret_cast<const float*>(smem + Tr::kOffCorr);
    for (int j = 0; j < n_tiles; ++j) {
        const int slot = j % 2;
        mbar_wait(&b.corr_full[slot], (j / 2) & 1);
        const float corr = corr_s[slot * Tr::kBlockM + r];
        if (j > 0) {
            mbar_wait(b.o_done, (j - 1) & 1);
            __syncwarp();
            tcgen05_fence_after();
            rescale_o<Tr>(tmem, warp, corr);
        }
        tcgen05_fence_before();
        mbar_arrive(b.o_ready);
    }
    mbar_wait(b.stats_full, 0);
    if (n_tiles > 0) {
        mbar_wait(b.o_done, (n_tiles - 1) & 1);
        __syncwarp();
        tcgen05_fence_after();
    }
    const FaRowEnd end = published_row_end<Tr>(p, smem, r, 2, bc.head);
    write_output<Tr, T>(p, end, tmem, warp, m0 + r, bc.batch, bc.head, n_tiles > 0);
}

#endif  // __CUDA_ARCH_FEAT_SM100_ALL

}  // namespace fa4

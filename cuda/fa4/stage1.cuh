// Stage 1: tcgen05.mma with S and O in tensor memory, one warpgroup; thread 0 issues TMA and
// the MMAs, every thread owns one query row.
#pragma once
#include "fa4/tile.cuh"

namespace fa4 {

#if defined(__CUDA_ARCH_FEAT_SM100_ALL)

// ---------------------------------------------------------------- stage 1

template <class T, int D>
__device__ __forceinline__ void stage1(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                       const TmaDesc* tv) {
    using Tr = Fa4Traits<1, D>;
    extern __shared__ uint8_t smem_raw[];
    const Cta<Tr> cta(p, smem_raw);
    uint8_t *sq = cta.sq, *sk = cta.sk, *sv = cta.sv;
    uint8_t* sp = cta.smem + Tr::kOffP;
    uint64_t* q_full = cta.bars;
    uint64_t* kv_full = cta.bars + 1;
    uint64_t* s_full = cta.bars + 2;
    uint64_t* o_full = cta.bars + 3;
    const int tid = cta.tid, warp = cta.warp, m0 = cta.m0, n_tiles = cta.n_tiles;
    const BlockCoord& bc = cta.bc;
    const FaKeyTiles& kv = cta.kv;
    const bool issuer = tid == 0;
    const uint32_t tmem = cta.start([&] {
        mbar_init(q_full, 1);
        mbar_init(kv_full, 1);
        mbar_init(s_full, 1);
        mbar_init(o_full, 1);
    });

    if (issuer && n_tiles > 0) {
        tma_prefetch_desc(tq);
        tma_prefetch_desc(tk);
        tma_prefetch_desc(tv);
        mbar_arrive_expect_tx(q_full, Tr::kTmaQBytes);
#pragma unroll
        for (int slab = 0; slab < Tr::kSlabs; ++slab)
            tma_load_4d(sq + slab * Tr::kQSlabStride, tq, q_full, slab * kSlabCols, bc.head, m0, bc.batch);
    }

    const int row = m0 + tid;  // this thread's query row (TMEM lane tid)
    RowSoftmax<Tr, Tr::kBlockN> st;
    st.init();
    for (int it = 0; it < n_tiles; ++it) {
        const int n = kv.n_begin + it;
        if (issuer) {
            // K/V of tile n: the previous tile's MMAs, which read these buffers, have completed
            // (o_full waited below), so the async proxy may overwrite them.
            mbar_arrive_expect_tx(kv_full, Tr::kTmaKvBytes);
#pragma unroll
            for (int slab = 0; slab < Tr::kSlabs; ++slab) {
                tma_load_4d(sk + slab * Tr::kKvSlabStride, tk, kv_full, slab * kSlabCols, bc.kv_head,
                            n * Tr::kBlockN, bc.batch);
                tma_load_4d(sv + slab * Tr::kKvSlabStride, tv, kv_full, slab * kSlabCols, bc.kv_head,
                            n * Tr::kBlockN, bc.batch);
            }
            if (it == 0) mbar_wait(q_full, 0);
            mbar_wait(kv_full, it & 1);
            tcgen05_fence_after();
            issue_qk<Tr, T>(tmem, smem_u32(sq), smem_u32(sk));
            umma_commit(s_full);
        }
        mbar_wait(s_full, it & 1);
        __syncwarp();
        tcgen05_fence_after();

        float s[Tr::kBlockN];
        tmem_load_row<Tr::kBlockN>(tmem, warp, Tr::kTmemS, s);
        softcap_and_mask<Tr::kBlockN>(p, s, row, n * Tr::kBlockN);
        float corr[1];
        st.update(s, p.softmax_scale_log2, corr);
        store_p<Tr, T>(sp, s, tid);
        fa3::fence_proxy_async_smem();  // P (generic-proxy stores) -> visible to the MMA
        if (it > 0) rescale_o<Tr>(tmem, warp, corr[0]);
        tcgen05_fence_before();
        __syncthreads();
        if (issuer) {
            tcgen05_fence_after();
            issue_pv<Tr, T>(tmem, smem_u32(sp), smem_u32(sv), it > 0);
            umma_commit(o_full);
        }
        mbar_wait(o_full, it & 1);
        __syncwarp();
        tcgen05_fence_after();
    }
    write_output<Tr, T>(p, st.finalize(0, fa_to_natural(p), fa_sink(p, bc.head)), tmem, warp, row, bc.batch, bc.head,
                        n_tiles > 0);
    cta.finish(tmem);
}

#endif  // __CUDA_ARCH_FEAT_SM100_ALL

}  // namespace fa4

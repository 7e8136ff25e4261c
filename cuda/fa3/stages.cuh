// The five FA3 stages (docs/fa3.md), each a composition of the shared pieces: the preamble
// (preamble.cuh: shared memory, tensor-map prefetch), the scheduler (block or persistent tile
// coordinates, the K/V tiles a query tile sees), the pipeline (TMA issue, mbarriers, ring
// positions, ping-pong), the mainloop (GEMMs, softmax, the loops) and the epilogue.
#pragma once
#include "fa3/epilogue.cuh"
#include "fa3/mainloop.cuh"
#include "fa3/pipeline.cuh"
#include "fa3/preamble.cuh"
#include "fa3/scheduler.cuh"

namespace fa3 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Stage 1: wgmma only. One warpgroup; every thread copies Q once and each K/V tile into the
// single-buffered swizzled tiles with plain loads, then S, softmax, PV, all waited for.
// Tr: the tile shapes and shared-memory plan; Op: the per-tile work and loads (SyncTile, 16-bit,
// or the FP8 consumer's Fp8Tile).
template <class Tr, class T, template <class, class> class Op>
__device__ __forceinline__ void stage1_of(const FwdParams& p) {
    using TileOp = Op<Tr, T>;
    const Cta<Tr> cta;
    const int tid = threadIdx.x;
    const OneTile<Tr> tile(p);
    const TileSources<typename TileOp::Elem> src(p, tile);
    TileOp::load_q(p, cta, tile, src, tid);

    const typename Acc<Tr>::Frag frag(tid);
    Acc<Tr> acc;
    acc.init();
    TileOp op(p, frag, tile.bc, tile.m0);
    for (int n = tile.kv.n_begin; n < tile.kv.n_end; ++n) {
        __syncthreads();  // every thread's wgmmas of the previous tile have completed (wait 0)
        TileOp::load_kv(p, cta, src, n * Tr::kBlockN, tid);
        fence_proxy_async_smem();  // generic-proxy stores -> visible to wgmma (async proxy)
        __syncthreads();
        op(p, acc, frag, tile.m0, n, smem_u32(cta.sq), cta.k_slot(0), cta.v_slot(0));
    }
    op.finish(acc);
    write_output<Tr, T>(p, acc, frag, tile.m0, tile.bc.batch, tile.bc.head);
}

// Stage 2: + TMA into the 2-slot K/V ring with mbarriers. One warpgroup; thread 0 issues Q and
// the first tiles, and refills a slot once the whole CTA has passed the barrier after its use.
template <class Tr, class T, template <class, class> class Op>
__device__ __forceinline__ void stage2_of(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                          const TmaDesc* tv) {
    const Cta<Tr> cta;
    Barriers<Tr> bars(cta.smem);
    const OneTile<Tr> tile(p);
    const RingIssuer<Tr> issue{tq, tk, tv, cta.sq, cta.sk, cta.sv, bars, tile};
    const bool issuer = threadIdx.x == 0;

    if (issuer) bars.init(0);  // no kv_empty: the CTA barrier releases a slot
    __syncthreads();
    if (issuer && tile.n_tiles > 0) {
        issue.start(p.seqlen_q);
        for (int it = 0; it < min(tile.n_tiles, Tr::kKvStages); ++it) issue.kv(it);
    }
    const typename Acc<Tr>::Frag frag(threadIdx.x);
    Acc<Tr> acc;
    acc.init();
    mainloop_ring<Tr, T, Op>(p, cta, bars, acc, frag, smem_u32(cta.sq), tile.m0, tile, [&](int it, int) {
        // Both wgmma groups reading this slot were waited on by every thread; after the CTA
        // barrier the slot may be refilled (async proxy writes after async proxy reads).
        __syncthreads();
        if (issuer && it + Tr::kKvStages < tile.n_tiles) issue.kv(it + Tr::kKvStages);
    });
    write_output<Tr, T>(p, acc, frag, tile.m0, tile.bc.batch, tile.bc.head);
}

// Stage 3: + warp specialisation. Warpgroup 0 produces (setmaxnreg.dec, thread 0 issues TMA
// after each slot's release); warpgroups 1-2 consume 64 query rows each (setmaxnreg.inc) and
// release a slot through its "empty" mbarrier. With traits that serve the batch layouts
// (fa3/serving.cuh), the CTA's (query tile, head, sequence) comes from the per-sequence view,
// and on a serving launch the whole producer warpgroup runs the loop (gathered tiles).
template <class Tr, class T, template <class, class> class Op>
__device__ __forceinline__ void stage3_of(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                          const TmaDesc* tv) {
    constexpr bool kServing = ServesLayouts<Tr>::value;
    const Cta<Tr> cta;
    Barriers<Tr> bars(cta.smem);
    const BlockCoord bc = block_coord(p);
    const FaSeq seq = seq_of<kServing>(p, bc.batch);
    FwdParams own;
    const FwdParams& ps = seq_params<kServing>(p, seq, own);  // this sequence's lengths: mask, tile range
    const OneTile<Tr> tile(ps, bc);
    // The grid covers the longest sequence (max_seqlen_q): tiles past a shorter one's end exit.
    if (tile.m0 >= seq.sq) return;
    const int warpgroup = threadIdx.x / kWarpgroupThreads;

    if (threadIdx.x == 0) bars.init(Tr::kConsumerThreads);
    __syncthreads();  // the last CTA-wide barrier: roles diverge below
    if (warpgroup < Tr::kProducerWarpgroups) {
        setmaxnreg_dec<Tr::kProducerRegs>();
        const int ptid = threadIdx.x;  // the producer is warpgroup 0
        if ((ptid == 0 || (kServing && launch_is_serving(p))) && tile.n_tiles > 0) {
            if (ptid == 0) {
                prefetch_maps(tq, tk, tv);
                issue_q_rows<Tr>(tq, cta.sq, bars.q_full, seq.q_row0 + tile.m0, seq.sq - tile.m0, bc.head,
                                 seq.q_batch);
            }
            for (int it = 0; it < tile.n_tiles; ++it) {
                const int slot = it % Tr::kKvStages;
                // Use u = it / S of a slot needs use u - 1 released (its phase u - 1 done).
                if (it >= Tr::kKvStages) mbar_wait(&bars.kv_empty[slot], ((it / Tr::kKvStages) - 1) & 1);
                if constexpr (kServing)
                    produce_kv_pair<Tr, T>(p, seq, ptid, tk, tv, cta.sk, cta.sv, &bars.kv_full[slot], slot,
                                           tile.kv.n_begin + it, bc.kv_head, cta.kv_scales(it));
                else
                    issue_kv<Tr>(tk, tv, cta.sk, cta.sv, &bars.kv_full[slot], slot, tile.kv.n_begin + it, bc.kv_head,
                                 bc.batch);
            }
        }
        return;
    }
    setmaxnreg_inc<Tr::kConsumerRegs>();
    const int cw = warpgroup - Tr::kProducerWarpgroups;  // consumer index: query rows 64cw..
    const int m_first = tile.m0 + cw * kMmaM;
    const typename Acc<Tr>::Frag frag(threadIdx.x % kWarpgroupThreads);
    Acc<Tr> acc;
    acc.init();
    mainloop_ring<Tr, T, Op>(ps, cta, bars, acc, frag, smem_u32(cta.sq) + Tr::q_warpgroup_offset(cw), m_first, tile,
                             [&](int, int slot) { mbar_arrive(&bars.kv_empty[slot]); });
    write_output<Tr, T>(ps, acc, frag, m_first, seq_of<kServing>(p, bc.batch), bc.head,
                        fa_sink(p, bc.head));  // re-read: as stage45
}

// The 16-bit stages 1-3 (DV: V's head dim, D unless the instance is built for a pair).
template <class T, int D, int DV = D>
__device__ __forceinline__ void stage1(const FwdParams& p) {
    stage1_of<Fa3Traits<1, D, DV>, T, SyncTile>(p);
}
template <class T, int D, int DV = D>
__device__ __forceinline__ void stage2(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                       const TmaDesc* tv) {
    stage2_of<Fa3Traits<2, D, DV>, T, SyncTile>(p, tq, tk, tv);
}
template <class T, int D, int DV = D>
__device__ __forceinline__ void stage3(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                       const TmaDesc* tv) {
    stage3_of<Fa3Traits<3, D, DV>, T, SyncTile>(p, tq, tk, tv);
}

// Stage 4: + ping-pong and intra-warpgroup overlap, one query tile per CTA (grid as in stages
// 1-3). Stage 5: + persistent scheduling: gridDim.x CTAs (ideally the SM count) walk the tiles
// heaviest first; the K/V ring and the Q buffer carry across tiles.
// Tr, Op: as stage1_of; with traits that serve the batch layouts, as stage3_of.
template <class Tr, class T, template <class, class> class Op>
__device__ __forceinline__ void stage45_of(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                           const TmaDesc* tv) {
    constexpr bool kServing = ServesLayouts<Tr>::value;
    const Cta<Tr> cta;
    SplitBarriers<Tr> bars(cta.smem);
    const int tid = threadIdx.x;
    const int warpgroup = tid / kWarpgroupThreads;
    const TileScheduler<Tr> sched(p);

    if (tid == 0) bars.init();
    __syncthreads();  // the last CTA-wide barrier: roles diverge below

    // Tiles are numbered over max_seqlen_q blocks of every sequence; producer and consumers skip
    // the same ones (past a shorter sequence's end), so their ring positions stay in step.
    RingPos pos;
    if (warpgroup < Tr::kProducerWarpgroups) {
        setmaxnreg_dec<Tr::kProducerRegs>();
        // Dense launches: thread 0 issues every copy. Serving launches: the whole warpgroup walks
        // the tiles (gathered K/V tiles take all 128 threads; TMA stays with thread 0).
        if (tid == 0 || (kServing && launch_is_serving(p))) {
            if (tid == 0) prefetch_maps(tq, tk, tv);
            for (int t = sched.begin; t < sched.num_tiles; t += sched.step) {
                const BlockCoord bc = sched.coord(p, t);
                const FaSeq seq = seq_of<kServing>(p, bc.batch);
                if (bc.m_block * Tr::kBlockM >= seq.sq) continue;
                FwdParams own;
                produce_tile<Tr, T>(p, seq, tid, tq, tk, tv, cta, bars, bc,
                                    kv_range<Tr>(seq_params<kServing>(p, seq, own), bc), pos);
            }
#if defined(FA_HANG_CHECK)
            if (tid == 0) watch_release<Tr>(bars, pos);
#endif
        }
        return;
    }
    setmaxnreg_inc<Tr::kConsumerRegs>();
    const int cw = warpgroup - Tr::kProducerWarpgroups;
    const PingPong<Tr> turn(cw);
    const typename Acc<Tr>::Frag frag(tid % kWarpgroupThreads);
    turn.start();
    for (int t = sched.begin; t < sched.num_tiles; t += sched.step) {
        const BlockCoord bc = sched.coord(p, t);
        const FaSeq seq = seq_of<kServing>(p, bc.batch);
        if (bc.m_block * Tr::kBlockM >= seq.sq) continue;
        FwdParams own;
        const FwdParams& ps = seq_params<kServing>(p, seq, own);  // this sequence's lengths: mask, tile range
        const int m_first = bc.m_block * Tr::kBlockM + cw * kMmaM;
        Acc<Tr> acc;
        acc.init();
        mainloop_overlapped<Tr, T, Op>(ps, cta, bars, acc, frag, m_first, bc, kv_range<Tr>(ps, bc), pos, cw, turn);
        // The sequence's view again, read after the mainloop rather than kept through it (its
        // offsets would take registers the consumers do not have to spare: stage 4 spilled).
        write_output<Tr, T>(ps, acc, frag, m_first, seq_of<kServing>(p, bc.batch), bc.head, fa_sink(p, bc.head));
    }
    turn.finish();
}

// The 16-bit stages 4-5.
template <int Stage, class T, int D, int DV = D>
__device__ __forceinline__ void stage45(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                        const TmaDesc* tv) {
    stage45_of<Fa3Traits<Stage, D, DV>, T, SyncTile>(p, tq, tk, tv);
}

#else  // not sm_90a (nvcc's host pass): the instances exist but do nothing.

template <class T, int D, int DV = D>
__device__ __forceinline__ void stage1(const FwdParams&) {}
template <class T, int D, int DV = D>
__device__ __forceinline__ void stage2(const FwdParams&, const TmaDesc*, const TmaDesc*, const TmaDesc*) {}
template <class T, int D, int DV = D>
__device__ __forceinline__ void stage3(const FwdParams&, const TmaDesc*, const TmaDesc*, const TmaDesc*) {}
template <int Stage, class T, int D, int DV = D>
__device__ __forceinline__ void stage45(const FwdParams&, const TmaDesc*, const TmaDesc*, const TmaDesc*) {}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The stages that take tensor maps (2-5), by number: what the entry points call.
template <int Stage, class T, int D, int DV = D>
__device__ __forceinline__ void stage_with_maps(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                                const TmaDesc* tv) {
    if constexpr (Stage == 2)
        stage2<T, D, DV>(p, tq, tk, tv);
    else if constexpr (Stage == 3)
        stage3<T, D, DV>(p, tq, tk, tv);
    else
        stage45<Stage, T, D, DV>(p, tq, tk, tv);
}

}  // namespace fa3

// The FA3 consumer's mainloop pieces: the thread's accumulator fragment and softmax state, the
// two GEMMs (issued asynchronously, or issued and waited for), scores -> P through the shared
// score transform, mask and online softmax (common/softmax.cuh), P -> A fragments, and the
// loops the stages compose from them: stage 1's synchronous loads, the sequential ring loop of
// stages 2-3 and the overlapped ping-pong loop of stages 4-5.
#pragma once
#include "common/dtype.cuh"
#include "common/fp8_kv.cuh"
#include "common/mask.cuh"
#include "common/softmax.cuh"
#include "fa3/pipeline.cuh"
#include "fa3/preamble.cuh"
#include "fa3/traits.cuh"
#include "sm90/wgmma.cuh"

namespace fa3 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A thread's part of the wgmma accumulators S[64 x BN] and O[64 x D] (D: V's head dim) of its warpgroup (see
// sm90/wgmma.cuh "Fragments") as rows and columns, the fragment layout of the shared softmax and
// mask (softmax.cuh): rows 16w + g and 16w + g + 8; element j of a row is column j % 2 of the
// thread's pair in 8-column chunk j / 2.
template <int BN, int D>
struct AccFrag {
    static constexpr int kRows = 2, kSCols = BN / 4, kOCols = D / 4, kLanes = 4;
    int row0;  // 16w + g; the thread's second row is row0 + 8
    int col0;  // 2t: the thread's columns in chunk c are 8c + col0 + {0, 1}
    __device__ __forceinline__ explicit AccFrag(int thread_in_wg)
        : row0(16 * (thread_in_wg / 32) + thread_in_wg % 32 / 4), col0(2 * (thread_in_wg % 4)) {}
    __device__ __forceinline__ static float& s(float (&a)[BN / 2], int r, int j) {
        return a[acc_index(j / 2, r, j % 2)];
    }
    __device__ __forceinline__ static float& o(float (&a)[D / 2], int r, int j) {
        return a[acc_index(j / 2, r, j % 2)];
    }
    __device__ __forceinline__ int row(int r) const { return row0 + 8 * r; }
    __device__ __forceinline__ int col(int j) const { return 8 * (j / 2) + col0 + j % 2; }
};

// Per-warpgroup output accumulator and online-softmax state (this thread's two rows), with the
// unit's exponent policy (FaRowPolicy: FA4's softmax in the row that asks for it, docs/fa4.md).
template <class Tr>
struct Acc {
    using Frag = AccFrag<Tr::kBlockN, Tr::kHeadDimV>;
    float o[Tr::kHeadDimV / 2];
    FaOnlineSoftmax<Frag, FaRowPolicy> softmax;
    __device__ __forceinline__ void init() {
#pragma unroll
        for (int i = 0; i < Tr::kHeadDimV / 2; ++i) o[i] = 0.f;
        softmax.init();
    }
};

// ---- The two GEMMs, split into "issue" (asynchronous) and "wait" so stage 4 can overlap them.

// Issues S[64 x BN] = Q_wg[64 x D] K_tile[BN x D]^T as one wgmma group (D/16 x BN/64
// m64n64k16 instructions). q_addr: the warpgroup's first Q row in slab 0; k_addr: the K tile.
// s must not be touched until the group has been waited for.
template <class Tr, class T>
__device__ __forceinline__ void issue_qk(float (&s)[Tr::kBlockN / 2], uint32_t q_addr,
                                         uint32_t k_addr) {
    wgmma_fence();  // s was read by the previous tile's softmax
#pragma unroll
    for (int kk = 0; kk < Tr::kHeadDim / kMmaK; ++kk) {
        const uint64_t da = desc_kmajor_sw128(q_addr + Tr::qk_a_offset(kk));
#pragma unroll
        for (int nh = 0; nh < Tr::kBlockN / kMmaN; ++nh) {
            const uint64_t db = desc_kmajor_sw128(k_addr + Tr::qk_b_offset(kk, nh));
            // Keys 64nh.. accumulate into chunks 8nh.. = s[32nh ..].
            wgmma_m64n64k16_ss<T>(&s[acc_index(nh * kMmaN / 8, 0, 0)], da, db, kk > 0 ? 1 : 0);
        }
    }
    wgmma_commit();
}

// Issues O[64 x Dv] += P[64 x BN] V_tile[BN x Dv] as one wgmma group (Dv: V's head dim); P is
// given as A fragments a[k] for keys 16k..16k+15. Neither o nor a may be touched until the group
// has been waited for.
template <class Tr, class T>
__device__ __forceinline__ void issue_pv(float (&o)[Tr::kHeadDimV / 2],
                                         const uint32_t (&a)[Tr::kBlockN / kMmaK][4],
                                         uint32_t v_addr) {
    wgmma_fence();  // o was rescaled and a written by ordinary instructions
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / kMmaK; ++kk) {
#pragma unroll
        for (int nh = 0; nh < Tr::kHeadDimV / kMmaN; ++nh) {
            const uint64_t db =
                desc_mnmajor_sw128(v_addr + Tr::pv_b_offset(kk, nh), Tr::kKvSlabStride);
            // Output columns 64nh.. accumulate into chunks 8nh.. = o[32nh ..].
            wgmma_m64n64k16_rs_tb<T>(&o[acc_index(nh * kMmaN / 8, 0, 0)], a[kk], db);
        }
    }
    wgmma_commit();
}

// Synchronous forms (stages 1-3): issue, wait for everything, and pin the registers after the
// wait so the compiler cannot read them earlier.
template <class Tr, class T>
__device__ __forceinline__ void gemm_qk(float (&s)[Tr::kBlockN / 2], uint32_t q_addr,
                                        uint32_t k_addr) {
    issue_qk<Tr, T>(s, q_addr, k_addr);
    wgmma_wait<0>();
    fence_regs(s);
}
template <class Tr, class T>
__device__ __forceinline__ void gemm_pv(float (&o)[Tr::kHeadDimV / 2],
                                        const uint32_t (&a)[Tr::kBlockN / kMmaK][4],
                                        uint32_t v_addr) {
    issue_pv<Tr, T>(o, a, v_addr);
    wgmma_wait<0>();
    fence_regs(o);
}

// ---- Scores -> P: the shared score transform, mask and online softmax (softmax.cuh, mask.cuh).

// Optional softcap (natural units), then -inf for keys past seqlen_k (zero-filled loads) and
// outside the window; then the online softmax: S becomes P in place and corr receives the factor
// for O (not applied: stage 4 rescales O only after the PV product in flight has retired).
// m_first: global query row of the warpgroup's row 0; n_tile: the K/V tile index.
template <class Tr>
__device__ __forceinline__ void scores_to_p(const FwdParams& p, Acc<Tr>& acc, float (&s)[Tr::kBlockN / 2],
                                            const typename Acc<Tr>::Frag& frag, int m_first, int n_tile,
                                            float (&corr)[2]) {
    const int n0 = n_tile * Tr::kBlockN;
    // No ALiBi in FA3 (the host does not route it here); tanh.approx as FlashAttention's softcap.
    if (p.flags & FA_FLAG_SOFTCAP) fa_scores_to_natural<false, true>(s, frag, p, 0.f, m_first, n0);
    // Warpgroup-uniform: skip the element tests on tiles where nothing can be masked.
    if (!Tr::kSkipUnmaskedTiles || block_needs_mask(p, m_first, kMmaM, n0, Tr::kBlockN))
        fa_mask_fragment(s, frag, p, m_first, n0);
    acc.softmax.update(s, p.softmax_scale_log2, corr);
}

// P (exponentiated S, fp32 accumulator layout) -> 16-bit A fragments, no data movement
// between threads (sm90/wgmma.cuh, "Fragments").
template <class Tr, class T>
__device__ __forceinline__ void pack_p(const float (&s)[Tr::kBlockN / 2],
                                       uint32_t (&a)[Tr::kBlockN / kMmaK][4]) {
#pragma unroll
    for (int k = 0; k < Tr::kBlockN / kMmaK; ++k)
#pragma unroll
        for (int r = 0; r < 4; ++r)
            a[k][r] = fa_pack2<T>(s[acc_to_a_index(k, r)], s[acc_to_a_index(k, r) + 1]);
}


// ---- Stage 1: plain loads into the swizzled layout.

// Copies rows [0, rows_valid) of a [ROWS x D] tile (row stride in elements) into SW128 slabs
// with 16-byte loads; rows past rows_valid become zeros. Every thread of the CTA takes part.
template <int ROWS, int D, class T>
__device__ __forceinline__ void load_tile_sw128(uint8_t* dst, const T* src, int64_t row_stride,
                                                int rows_valid, int tid, int nthreads) {
    constexpr int kChunksPerRow = D / 8;  // 16-byte chunks
    for (int idx = tid; idx < ROWS * kChunksPerRow; idx += nthreads) {
        const int r = idx / kChunksPerRow, c = idx % kChunksPerRow;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < rows_valid) v = *reinterpret_cast<const uint4*>(src + r * row_stride + 8 * c);
        *reinterpret_cast<uint4*>(dst + sw128_offset(r, 8 * c, ROWS)) = v;  // 16-byte chunk
    }
}

// ---- The loops.

// The work on one K/V tile in the 16-bit kernels, one object per consumer thread (it holds S):
// synchronously (operator(): S = Q K^T, then consume_tile; stages 1-3), or as the pieces the
// overlapped loop of stages 4-5 interleaves (issue_qk, scores, pack, issue_pv); and stage 1's
// plain loads. The FP8 consumer has its own with the same members (Fp8Tile,
// cuda/fa3_fp8_fwd_sm90.cu), so the stage skeletons (stage1_of, mainloop_ring,
// mainloop_overlapped, stages.cuh) take either.
template <class Tr, class T>
struct SyncTile {
    using Elem = T;  // as stored in global memory
    using Frag = typename Acc<Tr>::Frag;
    using PFrag = uint32_t[Tr::kBlockN / kMmaK][4];  // P as A fragments, keys 16k.. in [k]
    float s[Tr::kBlockN / 2];
    __device__ __forceinline__ SyncTile(const FwdParams&, const Frag&, const BlockCoord&, int) {
#pragma unroll
        for (int i = 0; i < Tr::kBlockN / 2; ++i) s[i] = 0.f;
    }
    __device__ __forceinline__ static void load_q(const FwdParams& p, const Cta<Tr>& cta, const OneTile<Tr>& tile,
                                                  const TileSources<T>& src, int tid) {
        load_tile_sw128<Tr::kBlockM, Tr::kHeadDim>(cta.sq, src.q, p.q_row_stride, p.seqlen_q - tile.m0, tid,
                                                   Tr::kThreads);
    }
    __device__ __forceinline__ static void load_kv(const FwdParams& p, const Cta<Tr>& cta, const TileSources<T>& src,
                                                   int n0, int tid) {
        load_tile_sw128<Tr::kBlockN, Tr::kHeadDim>(cta.sk, src.k + n0 * p.k_row_stride, p.k_row_stride,
                                                   p.seqlen_k - n0, tid, Tr::kThreads);
        load_tile_sw128<Tr::kBlockN, Tr::kHeadDimV>(cta.sv, src.v + n0 * p.v_row_stride, p.v_row_stride,
                                                   p.seqlen_k - n0, tid, Tr::kThreads);
    }
    // One tile, synchronously (stages 1-3): S = Q K^T, S -> P, rescale O, O += P V and wait.
    // kv_scales: as scores.
    __device__ __forceinline__ void operator()(const FwdParams& p, Acc<Tr>& acc, const Frag& frag, int m_first,
                                               int n_tile, uint32_t q_addr, uint32_t k_addr, uint32_t v_addr,
                                               const float* kv_scales = nullptr) {
        gemm_qk<Tr, T>(s, q_addr, k_addr);
        float corr[2];
        scores(p, acc, frag, m_first, n_tile, corr, kv_scales);
        acc.softmax.rescale(acc.o, corr);
        PFrag a;
        pack(a);
        gemm_pv<Tr, T>(acc.o, a, v_addr);
    }
    // The overlapped loop's pieces: issue S = Q K^T; S (retired) -> P, corr for O; P -> A
    // fragments; issue O += P V (n_tile: the tile P belongs to).
    __device__ __forceinline__ void issue_qk(uint32_t q_addr, uint32_t k_addr) { fa3::issue_qk<Tr, T>(s, q_addr, k_addr); }
    // kv_scales: an FP8 cache's per-key scales of the tile (Cta::kv_scales: K's, then V's), or
    // null: the tile holds the codes' values, so K's scales multiply S before the softcap and
    // mask, and V's multiply P after the softmax took its row sums (P diag(s) V is P V).
    __device__ __forceinline__ void scores(const FwdParams& p, Acc<Tr>& acc, const Frag& frag, int m_first, int n_tile,
                                           float (&corr)[2], const float* kv_scales = nullptr) {
        if (kv_scales) fa_scale_key_columns(s, frag, reinterpret_cast<const unsigned char*>(kv_scales), 4);
        scores_to_p<Tr>(p, acc, s, frag, m_first, n_tile, corr);
        if (kv_scales)
            fa_scale_key_columns(s, frag, reinterpret_cast<const unsigned char*>(kv_scales + Tr::kBlockN), 4);
    }
    __device__ __forceinline__ void pack(PFrag& a) const { pack_p<Tr, T>(s, a); }
    __device__ __forceinline__ void issue_pv(const FwdParams&, Acc<Tr>& acc, const PFrag& a, uint32_t v_addr, int) {
        fa3::issue_pv<Tr, T>(acc.o, a, v_addr);
    }
    __device__ __forceinline__ void finish(Acc<Tr>&) const {}
};

// The scales of the K/V tile at ring position `it` of an FP8 cache's launch (Cta::kv_scales), or
// null: any other launch, and instances without the serving layouts (no scale slots).
template <class Tr>
__device__ __forceinline__ const float* fp8_cache_scales(const FwdParams& p, const Cta<Tr>& cta, int it) {
    if constexpr (ServesLayouts<Tr>::value) return fa_kv_fp8(p) ? cta.kv_scales(it) : nullptr;
    return nullptr;
}

// The sequential mainloop of stages 2-3 over the K/V ring: wait for Q, then per tile wait
// until its slot is full, the tile's synchronous work (Op: SyncTile or the FP8 one), then
// release(it, slot): this thread's wgmma reads of the slot have retired.
template <class Tr, class T, template <class, class> class Op, class Release>
__device__ __forceinline__ void mainloop_ring(const FwdParams& p, const Cta<Tr>& cta, const Barriers<Tr>& bars,
                                              Acc<Tr>& acc, const typename Acc<Tr>::Frag& frag, uint32_t q_addr,
                                              int m_first, const OneTile<Tr>& tile, Release release) {
    Op<Tr, T> op(p, frag, tile.bc, m_first);
    auto kv_scales = [&](int it) { return fp8_cache_scales<Tr>(p, cta, it); };
    if (tile.n_tiles > 0) consumer_wait(bars.q_full, 0);  // one Q per CTA: phase 0
    for (int it = 0; it < tile.n_tiles; ++it) {
        const int slot = it % Tr::kKvStages;
        consumer_wait(&bars.kv_full[slot], (it / Tr::kKvStages) & 1);
        op(p, acc, frag, m_first, tile.kv.n_begin + it, q_addr, cta.k_slot(slot), cta.v_slot(slot), kv_scales(it));
        release(it, slot);
    }
    op.finish(acc);
}

// One query tile seen by consumer warpgroup cw (its 64 rows): the overlapped mainloop
//   S_0; softmax_0 | for j >= 1: {S_j, PV_j-1} issued, wait S_j, softmax_j under PV_j-1,
//   wait PV, rescale O | PV_last
// into acc (the caller writes it out). Releases K_j as soon as S_j retires, V_j after PV_j, Q
// after the last S. Op: the tile work's pieces (SyncTile, or the FP8 consumer's Fp8Tile), one
// object per query tile; bc: the tile's coordinates.
template <class Tr, class T, template <class, class> class Op>
__device__ __forceinline__ void mainloop_overlapped(const FwdParams& p, const Cta<Tr>& cta,
                                                    SplitBarriers<Tr>& bars, Acc<Tr>& acc,
                                                    const typename Acc<Tr>::Frag& frag, int m_first,
                                                    const BlockCoord& bc, const KvRange& kv, RingPos& pos, int cw,
                                                    const PingPong<Tr>& turn) {
    constexpr int S = Tr::kKvStages;
    const int n_tiles = kv.n_end - kv.n_begin;
    Op<Tr, T> op(p, frag, bc, m_first);
    if (n_tiles > 0) {
        const uint32_t q_addr = smem_u32(cta.sq) + Tr::q_warpgroup_offset(cw);
        const int it0 = pos.kv_it;  // ring position of K/V tile 0 of this query tile
        auto slot = [&](int j) { return (it0 + j) % S; };
        auto k_addr = [&](int j) { return cta.k_slot(slot(j)); };
        auto v_addr = [&](int j) { return cta.v_slot(slot(j)); };
        auto full_parity = [&](int j) { return static_cast<uint32_t>(((it0 + j) / S) & 1); };
        // S_j -> P_j, with an FP8 cache's scales of tile j (written with K_j, read after K_j's
        // release: Fa3Traits::kScaleSlots).
        auto scores = [&](int j, float (&c)[2]) {
            op.scores(p, acc, frag, m_first, kv.n_begin + j, c, fp8_cache_scales<Tr>(p, cta, it0 + j));
        };
        typename Op<Tr, T>::PFrag a;  // P of the tile whose PV is issued next
        float corr[2];

        consumer_wait(bars.q_full, pos.q_use & 1);

        // Prologue: S_0, its softmax, P_0.
        consumer_wait(&bars.k_full[slot(0)], full_parity(0));
        turn.acquire();
        op.issue_qk(q_addr, k_addr(0));
        turn.pass();
        wgmma_wait<0>();
        fence_regs(op.s);
        mbar_arrive(&bars.k_empty[slot(0)]);
        if (n_tiles == 1) mbar_arrive(bars.q_empty);  // last read of Q has retired
        scores(0, corr);  // O is still 0: no rescale needed
        op.pack(a);

        for (int j = 1; j < n_tiles; ++j) {
            consumer_wait(&bars.k_full[slot(j)], full_parity(j));
            consumer_wait(&bars.v_full[slot(j - 1)], full_parity(j - 1));
            turn.acquire();
            op.issue_qk(q_addr, k_addr(j));                         // group 1: S_j
            op.issue_pv(p, acc, a, v_addr(j - 1), kv.n_begin + j - 1);  // group 2: O += P_j-1 V_j-1
            turn.pass();
            wgmma_wait<1>();  // groups retire in order: S_j is ready, PV may still run
            fence_regs(op.s);
            mbar_arrive(&bars.k_empty[slot(j)]);
            if (j == n_tiles - 1) mbar_arrive(bars.q_empty);
            scores(j, corr);  // overlaps PV_j-1; O untouched
            wgmma_wait<0>();
            fence_regs(acc.o);
            mbar_arrive(&bars.v_empty[slot(j - 1)]);
            acc.softmax.rescale(acc.o, corr);  // O now refers to the new row max
            op.pack(a);                        // a is free: PV_j-1 has retired
        }

        // Epilogue: PV of the last tile.
        const int last = n_tiles - 1;
        consumer_wait(&bars.v_full[slot(last)], full_parity(last));
        turn.acquire();
        op.issue_pv(p, acc, a, v_addr(last), kv.n_begin + last);
        turn.pass();
        wgmma_wait<0>();
        fence_regs(acc.o);
        mbar_arrive(&bars.v_empty[slot(last)]);

        pos.kv_it += n_tiles;
        ++pos.q_use;
    }
    op.finish(acc);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

// FP8 (e4m3) consumer of the FA3 kernels (docs/fp8.md "On Hopper"), stages 1-5 of the FA3 ladder:
// stage 1 one warpgroup per 64 query rows, Q / K / Vᵀ codes copied by plain 16-byte loads into
// SW128 shared memory, S = Q Kᵀ and O += P V as e4m3 wgmma (sm90/wgmma_fp8.cuh); stages 2-5 add
// the TMA ring, warp specialisation, ping-pong with intra-warpgroup overlap, and the persistent
// grid. Composed from the FA3 pieces (cuda/fa3/): the shared-memory carve-up, scheduler, TMA ring
// and its barriers, the stage skeletons (stage1_of .. stage45_of), the shared score transform,
// mask and online softmax (scores_to_p) and the epilogue. What is FP8's own, here:
// the tile plan (Fp8Traits: e4m3 bytes, Vᵀ), the e4m3 GEMMs, the descales on S and O, and P's
// trip through e4m3 (scaled by 2^8, moved between the lanes of a quad by acc_to_a8: the 8-bit A
// fragment does not match the f32 accumulator's layout, unlike the 16-bit pack_p).
//
// Inputs (the pre-pass's outputs, cuda/fp8_prepass.cu, or an engine's own FP8 tensors):
//   q, k   e4m3 codes [batch, seqlen, heads, head_dim] (FwdParams strides, in bytes = elements);
//   v      e4m3 codes of Vᵀ: [batch, heads_kv, head_dim, keys] with keys contiguous (FP8 wgmma
//          needs both operands K-major, and the reduction of P V runs over keys): v_head_stride
//          and v_batch_stride as usual, v_row_stride = the stride between head_dim rows (>=
//          seqlen_k, a multiple of 16); keys past seqlen_k are never read into the product;
//   q_descale, k_descale, v_descale   f32 [batch, heads(_kv), blocks]: block b covers rows
//          [b · descale_block, (b + 1) · descale_block); descale_block = 0: one per (batch, head)
//          (FA3's released layout, per-(batch, kv-head) for K and V). descale_block must be 0 or
//          a multiple of 64 (a V scale is constant over each 64-key half of a tile).
//   o      bf16 / f16 [batch, seqlen_q, heads_q, head_dim]; lse as in every kernel.
// Numerics, as the CPU path (Precision::Fp8, src/numerics): S = (Σ qc·kc) · dq(row) · dk(key)
// per element of the tile before mask and softmax; P = exp2(...) unrounded in the row sum, and
// e4m3(P · 2^8) into P V; V's descale and the 2^8 are applied to O, not to P: O is kept in units
// of the current V block's scale (O' = O / dv; a new block multiplies O' by dv_old / dv_new before
// its P V), and the epilogue multiplies by dv · 2^-8 before the normalisation.
// Host requirements: head_dim 64, 128 or 256; q/k row strides and base addresses multiples of 16 bytes;
// v_row_stride a multiple of 16.
#include "common/numerics.cuh"
#include "fa3/stages.cuh"
#include "sm90/wgmma_fp8.cuh"

namespace fa3 {

// Tile shapes, roles and shared-memory plan of FP8 stage `Stage` (1-5) at head_dim D (64, 128,
// 256), with the members the FA3 pieces read (Cta, Barriers / SplitBarriers, OneTile,
// RingIssuer, TileScheduler, PingPong, Acc, scores_to_p, the stage skeletons).
// Keys per K/Vᵀ tile: 128, or 64 at head_dim 256 (with 128 keys O's 128 f32 registers next to S
// and P spill at 240 registers, docs/fp8.md). Every e4m3 operand is K-major with swizzle rows of
// min(K extent, 128) bytes: Q and K [rows × D] SW128 slabs, or one SW64 slab at head_dim 64; Vᵀ
// [D × kBlockN keys] one SW128 slab, or one SW64 slab with 64-key tiles (head_dim 256).
template <int Stage, int D>
struct Fp8Traits {
    static_assert(D == 64 || D == 128 || D == 256, "the FP8 consumer is instantiated for head_dim 64, 128, 256");
    static_assert(Stage >= 1 && Stage <= 5, "FP8 stages 1-5");
    static constexpr int kStage = Stage;
    static constexpr int kHeadDim = D;
    static constexpr int kConsumerWarpgroups = Stage >= 3 ? 2 : 1;
    static constexpr int kProducerWarpgroups = Stage >= 3 ? 1 : 0;
    static constexpr int kThreads = kWarpgroupThreads * (kConsumerWarpgroups + kProducerWarpgroups);
    static constexpr int kConsumerThreads = kWarpgroupThreads * kConsumerWarpgroups;
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = 240;
    static constexpr int kBlockM = kMmaM * kConsumerWarpgroups;  // query rows per CTA
    static constexpr int kBlockN = D == 256 ? 64 : 128;
    static constexpr int kSwQk = D < kSlabCols8 ? D : kSlabCols8;                // Q, K swizzle row bytes
    static constexpr int kSwV = kBlockN < kSlabCols8 ? kBlockN : kSlabCols8;     // Vᵀ swizzle row bytes
    static constexpr int kStepsQk = kSwQk / kMmaK8Bytes;  // k32 steps per Q/K swizzle row
    static constexpr int kStepsV = kSwV / kMmaK8Bytes;    // ... per Vᵀ swizzle row
    static constexpr int kSlabs = D / kSwQk;              // Q / K slabs (TMA boxes per tile)
    static_assert(kBlockN == kSwV, "Vᵀ is one slab: one TMA box per tile (pipeline.cuh load_v_tile)");
    static constexpr bool kSkipUnmaskedTiles = true;
    static constexpr int kKvStages = Stage >= 2 ? 2 : 1;
    static constexpr int kQBytes = kBlockM * D;       // e4m3
    static constexpr int kKvTileBytes = kBlockN * D;  // one K or one Vᵀ tile
    // The names the shared pipeline reads (fa3/traits.cuh, where V's head dim may be narrower
    // than K's): here K and Vᵀ tiles are the same bytes, and O has D columns.
    static constexpr int kKTileBytes = kKvTileBytes, kVTileBytes = kKvTileBytes;
    static constexpr int kHeadDimV = D;
    static constexpr int kQSlabStride = kBlockM * kSwQk;
    static constexpr int kKvSlabStride = kBlockN * kSwQk;
    static constexpr int kOffQ = 0;
    static constexpr int kOffK = kQBytes;
    static constexpr int kOffV = kOffK + kKvStages * kKvTileBytes;
    static constexpr int kOffBarriers = kOffV + kKvStages * kKvTileBytes;
    // Stages 2-3: q_full, kv_full[2], kv_empty[2] (pipeline.cuh Barriers); stages 4-5: q_full,
    // k_full, v_full, k_empty, v_empty per slot, q_empty (SplitBarriers); stage 1: none.
    static constexpr bool kSplitKv = Stage >= 4;
    static constexpr int kNumBarriers = kSplitKv ? 2 + 4 * kKvStages : Stage >= 2 ? 1 + 2 * kKvStages : 0;
    // Stages 4-5: the ping-pong's named barriers (as Fa3Traits).
    static constexpr int kPingPongBarrier0 = 1;
    static constexpr int kPingPongThreads = 2 * kWarpgroupThreads;
    static constexpr int kSmemUsed = kOffBarriers + 8 * kNumBarriers;
    static constexpr int kSmemBytes = kSmemUsed + kSwizzleAtomBytes;
    static_assert(kSmemBytes <= 227 * 1024, "sm_90 opt-in shared memory");
    // TMA (stages 2-5; UINT8 maps, swizzle = box inner extent: SWIZZLE_128B, or SWIZZLE_64B for
    // 64-byte rows): Q and K as {d, heads, seqlen, batch} with boxes {kSwQk, 1, 64 | kBlockN, 1};
    // Vᵀ as {keys, d, heads, batch} with box {kBlockN, D, 1, 1} (pipeline.cuh load_v_tile), keys
    // past seqlen_k zero-filled. src/cuda/fp8.rs consumer_maps builds them.
    static constexpr int kTmaBoxCols = kSwQk;
    static constexpr int kTmaBoxRowsQ = kMmaM;
    static constexpr int kTmaQBytes = kQBytes;
    static constexpr int kTmaKvBytes = 2 * kKvTileBytes;
    static constexpr bool kVTransposed = true;
    // S = Q Kᵀ, k32 step kk: Q slab kk / kStepsQk at +32 (kk % kStepsQk); K likewise, keys 64nh..
    // 64 rows further.
    __host__ __device__ static constexpr int qk_a_offset(int kk) {
        return (kk / kStepsQk) * kQSlabStride + (kk % kStepsQk) * kMmaK8Bytes;
    }
    __host__ __device__ static constexpr int qk_b_offset(int kk, int nh) {
        return (kk / kStepsQk) * kKvSlabStride + nh * kMmaN * kSwQk + (kk % kStepsQk) * kMmaK8Bytes;
    }
    // O += P V, keys 32kk.. (kk < kBlockN / 32), output columns 64nh..: Vᵀ rows 64nh.., +32 kk bytes.
    __host__ __device__ static constexpr int pv_b_offset(int kk, int nh) {
        return nh * kMmaN * kSwV + kk * kMmaK8Bytes;
    }
    __host__ __device__ static constexpr int q_warpgroup_offset(int cw) { return cw * kMmaM * kSwQk; }
    __host__ __device__ static constexpr int q_box_offset(int slab, int rb) {
        return slab * kQSlabStride + q_warpgroup_offset(rb);
    }
    __host__ __device__ static constexpr int kv_box_offset(int slab) { return slab * kKvSlabStride; }
    static_assert(kQBytes % kSwizzleAtomBytes == 0 && kKvTileBytes % kSwizzleAtomBytes == 0, "whole atoms");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Copies a [ROWS x COLS] e4m3 tile (rows [0, rows_valid), columns [0, cols_valid) of the source;
// the rest zero) into slabs of W-byte swizzle rows (swz_offset8) with 16-byte loads (stage 1).
template <int ROWS, int COLS, int W>
__device__ __forceinline__ void load_tile8(uint8_t* dst, const uint8_t* src, int64_t row_stride, int rows_valid,
                                           int cols_valid, int tid) {
    constexpr int kChunks = COLS / 16;
    for (int idx = tid; idx < ROWS * kChunks; idx += kWarpgroupThreads) {
        const int r = idx / kChunks, c = idx % kChunks;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < rows_valid && 16 * c < cols_valid) {
            const uint8_t* s = src + r * row_stride + 16 * c;
            if (16 * c + 16 <= cols_valid) {
                v = *reinterpret_cast<const uint4*>(s);
            } else {  // the partial chunk at the end of a Vᵀ row: bytes past the last key are 0
                uint8_t b[16];
                for (int i = 0; i < 16; ++i) b[i] = 16 * c + i < cols_valid ? s[i] : 0;
                memcpy(&v, b, 16);
            }
        }
        *reinterpret_cast<uint4*>(dst + swz_offset8<W>(r, 16 * c, ROWS)) = v;
    }
}

// The descale of row/key `i` (clamped into the sequence) of (batch, head).
__device__ __forceinline__ float descale_at(uint64_t base, const FwdParams& p, int bh, int seqlen, int i) {
    const int ii = max(0, min(i, seqlen - 1));
    const int blocks = p.descale_block > 0 ? (seqlen + p.descale_block - 1) / p.descale_block : 1;
    const int blk = p.descale_block > 0 ? ii / p.descale_block : 0;
    return reinterpret_cast<const float*>(base)[static_cast<int64_t>(bh) * blocks + blk];
}

// The synchronous work on one K/V tile of the FP8 consumer, one object per consumer thread, with
// the members of SyncTile (fa3/mainloop.cuh) that stage1_of and mainloop_ring use: S, the Q
// descales of the thread's two rows (constant over the K/V loop) and the V descale O is currently
// kept in units of (O' = O / dv; 0: nothing accumulated yet).
template <class Tr, class T>
struct Fp8Tile {
    using Elem = uint8_t;  // e4m3 codes; src.v of TileSources is Vᵀ
    using Frag = typename Acc<Tr>::Frag;
    using PFrag = uint32_t[Tr::kBlockN / kMmaK8][4];  // e4m3 P as A fragments, keys 32k.. in [k]
    static constexpr int D = Tr::kHeadDim;
    float s[Tr::kBlockN / 2] = {};
    float dq[2];
    float dv = 0.f;
    int bhk;
    __device__ __forceinline__ Fp8Tile(const FwdParams& p, const Frag& frag, const BlockCoord& bc, int m_first)
        : bhk(bc.batch * p.heads_kv + bc.kv_head) {
        const int bhq = bc.batch * p.heads_q + bc.head;
#pragma unroll
        for (int r = 0; r < 2; ++r) dq[r] = descale_at(p.q_descale, p, bhq, p.seqlen_q, m_first + frag.row(r));
    }
    // Stage 1's plain loads: Q once; K tile n0.. and the Vᵀ columns (keys) n0.. .
    __device__ __forceinline__ static void load_q(const FwdParams& p, const Cta<Tr>& cta, const OneTile<Tr>& tile,
                                                  const TileSources<Elem>& src, int tid) {
        load_tile8<Tr::kBlockM, D, Tr::kSwQk>(cta.sq, src.q, p.q_row_stride, p.seqlen_q - tile.m0, D, tid);
    }
    __device__ __forceinline__ static void load_kv(const FwdParams& p, const Cta<Tr>& cta, const TileSources<Elem>& src,
                                                   int n0, int tid) {
        load_tile8<Tr::kBlockN, D, Tr::kSwQk>(cta.sk, src.k + n0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - n0, D, tid);
        load_tile8<D, Tr::kBlockN, Tr::kSwV>(cta.sv, src.v + n0, p.v_row_stride, D, p.seqlen_k - n0, tid);
    }

    // The pieces (as SyncTile's; the overlapped loop of stages 4-5 interleaves them, operator()
    // runs them in order). Issue S = Q Kᵀ (e4m3) as one wgmma group; q_addr / k_addr: the shared
    // addresses of the warpgroup's Q rows and of the K tile.
    __device__ __forceinline__ void issue_qk(uint32_t q_addr, uint32_t k_addr) {
        wgmma_fence();  // s was read by the previous tile's softmax
#pragma unroll
        for (int kk = 0; kk < D / kMmaK8; ++kk) {
            const uint64_t da = desc_kmajor8<Tr::kSwQk>(q_addr + Tr::qk_a_offset(kk));
#pragma unroll
            for (int nh = 0; nh < Tr::kBlockN / kMmaN; ++nh)
                wgmma_m64n64k32_ss_e4m3(&s[acc_index(nh * kMmaN / 8, 0, 0)], da,
                                        desc_kmajor8<Tr::kSwQk>(k_addr + Tr::qk_b_offset(kk, nh)), kk > 0 ? 1 : 0);
        }
        wgmma_commit();
    }

    // S of K/V tile n has retired: per-block descales on S, per element of the tile (before
    // softcap and mask, as on the CPU), then the shared score transform, mask and online softmax
    // (scores_to_p): S becomes P (unscaled, as the row sums saw it); corr receives O's factor.
    // The last parameter (an FP8 KV cache's scales, SyncTile's) is always null here: the FP8
    // consumer has no serving path.
    __device__ __forceinline__ void scores(const FwdParams& p, Acc<Tr>& acc, const Frag& frag, int m_first, int n,
                                           float (&corr)[2], const float* = nullptr) {
        const int n0 = n * Tr::kBlockN;
#pragma unroll
        for (int c = 0; c < Tr::kBlockN / 8; ++c)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float dk = descale_at(p.k_descale, p, bhk, p.seqlen_k, n0 + 8 * c + frag.col0 + e);
#pragma unroll
                for (int h = 0; h < 2; ++h) s[acc_index(c, h, e)] *= dq[h] * dk;
            }
        scores_to_p<Tr>(p, acc, s, frag, m_first, n, corr);
    }

    // P · 2^8 -> e4m3 A fragments (acc_to_a8 moves P between the lanes of a quad).
    __device__ __forceinline__ void pack(PFrag& a) {
        const float p_scale = exp2f(FA_FP8_P_SCALE_LOG2);
#pragma unroll
        for (int i = 0; i < Tr::kBlockN / 2; ++i) s[i] *= p_scale;
#pragma unroll
        for (int kk = 0; kk < Tr::kBlockN / kMmaK8; ++kk) acc_to_a8(&s[16 * kk], a[kk]);
    }

    // Issue O' += P V for K/V tile n (v_addr: its Vᵀ tile), per 64-key half under that half's V
    // descale: O' *= dv_old / dv_new before a half whose descale differs (warpgroup-uniform). The
    // first half's rescale touches O only after the caller retired the previous P V; a second
    // half under another descale (64-row V blocks) must wait for the first half's product, so that
    // wait (which also retires any S group issued before) sits inside. The last group is left in
    // flight for the caller to wait for.
    __device__ __forceinline__ void issue_pv(const FwdParams& p, Acc<Tr>& acc, const PFrag& a, uint32_t v_addr, int n) {
        constexpr int kHalves = Tr::kBlockN / 64;
        const int n0 = n * Tr::kBlockN;
        float ratio[kHalves];
#pragma unroll
        for (int half = 0; half < kHalves; ++half) {
            const float dv_new = descale_at(p.v_descale, p, bhk, p.seqlen_k, n0 + 64 * half);
            ratio[half] = dv == 0.f ? 1.f : dv / dv_new;
            dv = dv_new;
        }
        bool split = false;  // a later half under another descale: its own group after a wait
#pragma unroll
        for (int half = 1; half < kHalves; ++half) split |= ratio[half] != 1.f;
        if (ratio[0] != 1.f) {
#pragma unroll
            for (int i = 0; i < D / 2; ++i) acc.o[i] *= ratio[0];
        }
        if (!split) {
            pv_steps(acc, a, v_addr, 0, kHalves);
        } else {
#pragma unroll
            for (int half = 0; half < kHalves; ++half) {
                if (half > 0) {
                    wgmma_wait<0>();
                    fence_regs(acc.o);
#pragma unroll
                    for (int i = 0; i < D / 2; ++i) acc.o[i] *= ratio[half];
                }
                pv_steps(acc, a, v_addr, half, half + 1);
            }
        }
    }
    // One wgmma group of O' += P V over the 64-key halves [h0, h1) of the tile.
    __device__ __forceinline__ static void pv_steps(Acc<Tr>& acc, const PFrag& a, uint32_t v_addr, int h0, int h1) {
        wgmma_fence();  // o rescaled and a written by ordinary instructions
#pragma unroll
        for (int kk = 2 * h0; kk < 2 * h1; ++kk)
#pragma unroll
            for (int nh = 0; nh < D / kMmaN; ++nh)
                wgmma_m64n64k32_rs_e4m3(&acc.o[acc_index(nh * kMmaN / 8, 0, 0)], a[kk],
                                        desc_kmajor8<Tr::kSwV>(v_addr + Tr::pv_b_offset(kk, nh)));
        wgmma_commit();
    }

    // Stages 1-3: the whole tile, waited for (S, its descales and softmax, rescale O, P V).
    __device__ __forceinline__ void operator()(const FwdParams& p, Acc<Tr>& acc, const Frag& frag, int m_first, int n,
                                               uint32_t q_addr, uint32_t k_addr, uint32_t v_addr, const float* = nullptr) {
        issue_qk(q_addr, k_addr);
        wgmma_wait<0>();
        fence_regs(s);
        float corr[2];
        scores(p, acc, frag, m_first, n, corr);
        acc.softmax.rescale(acc.o, corr);
        PFrag a;
        pack(a);
        issue_pv(p, acc, a, v_addr, n);
        wgmma_wait<0>();
        fence_regs(acc.o);
    }

    // O = O' · dv · 2^-8; write_output then normalises by the row sum.
    __device__ __forceinline__ void finish(Acc<Tr>& acc) const {
        const float u = dv * exp2f(-FA_FP8_P_SCALE_LOG2);
#pragma unroll
        for (int i = 0; i < D / 2; ++i) acc.o[i] *= u;
    }
};

// The 16-bit stages' skeletons (fa3/stages.cuh) with the FP8 tile plan and tile work: stage 1
// (plain loads), stage 2 (+ the TMA ring, thread 0 issues), stage 3 (+ warp specialisation),
// stage 4 (+ ping-pong and intra-warpgroup overlap), stage 5 (+ the persistent grid).
template <class T, int D>
__device__ __forceinline__ void fp8_stage1(const FwdParams& p) {
    stage1_of<Fp8Traits<1, D>, T, Fp8Tile>(p);
}
template <int Stage, class T, int D>
__device__ __forceinline__ void fp8_stage_with_maps(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                                    const TmaDesc* tv) {
    if constexpr (Stage == 2)
        stage2_of<Fp8Traits<2, D>, T, Fp8Tile>(p, tq, tk, tv);
    else if constexpr (Stage == 3)
        stage3_of<Fp8Traits<3, D>, T, Fp8Tile>(p, tq, tk, tv);
    else
        stage45_of<Fp8Traits<Stage, D>, T, Fp8Tile>(p, tq, tk, tv);
}

#else  // not sm_90a: the instances exist (so every target links) but do nothing.

template <class T, int D>
__device__ __forceinline__ void fp8_stage1(const FwdParams&) {}
template <int Stage, class T, int D>
__device__ __forceinline__ void fp8_stage_with_maps(const FwdParams&, const TmaDesc*, const TmaDesc*, const TmaDesc*) {}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

// Symbols: fa3fp8s<stage>_fwd_hd<D>_<output dtype>; stages 2-5 also take the tensor maps of Q, K, Vᵀ.
#define FA3_FP8_S1(DT, T, D)                                                               \
    extern "C" __global__ void __launch_bounds__(fa3::kWarpgroupThreads, 1)                \
        fa3fp8s1_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p) {                   \
        fa3::fp8_stage1<T, D>(p);                                                          \
    }
#define FA3_FP8_SN(N, DT, T, D)                                                                          \
    extern "C" __global__ void __launch_bounds__(fa3::Fp8Traits<N, D>::kThreads, 1)                      \
        fa3fp8s##N##_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p,                               \
                                      const __grid_constant__ fa3::TmaDesc tmap_q,                       \
                                      const __grid_constant__ fa3::TmaDesc tmap_k,                       \
                                      const __grid_constant__ fa3::TmaDesc tmap_vt) {                    \
        fa3::fp8_stage_with_maps<N, T, D>(p, &tmap_q, &tmap_k, &tmap_vt);                                \
    }
#if defined(FA_FAMILY)
// A build.rs unit of a table row fa3fp8s<3..5> (build/instances.rs): the consumer of that stage
// and, in the same image, the pre-pass of its head dim (E = elements per lane, head_dim <= 32·E),
// so one loaded module holds both launches of the FP8 forward.
#define FA_FP8_PREPASS_NO_INSTANCES 1
#include "fp8_prepass.cu"
static_assert(FA_STAGE >= 3 && FA_STAGE <= 5, "fa3fp8s<3..5>: the warp-specialised consumers");
#if FA_HEAD_DIM == 64
#define FA3_FP8_PREPASS_E 2
#elif FA_HEAD_DIM == 128
#define FA3_FP8_PREPASS_E 4
#elif FA_HEAD_DIM == 256
#define FA3_FP8_PREPASS_E 8
#else
#error "fa3fp8s<3..5>: head_dim 64, 128 or 256"
#endif
// The table and the traits must agree on the launch shape.
static_assert(FA_THREADS == fa3::Fp8Traits<FA_STAGE, FA_HEAD_DIM>::kThreads, "table: threads");
static_assert(FA_BLOCK_M == fa3::Fp8Traits<FA_STAGE, FA_HEAD_DIM>::kBlockM, "table: block_m");
static_assert(FA_BLOCK_N == fa3::Fp8Traits<FA_STAGE, FA_HEAD_DIM>::kBlockN, "table: block_n");
static_assert(FA_SMEM_BYTES == fa3::Fp8Traits<FA_STAGE, FA_HEAD_DIM>::kSmemBytes,
              "table: dynamic shared memory (fa3_fp8_smem_bytes in build/instances.rs)");
#define FA3_FP8_TYPE_bf16 __nv_bfloat16
#define FA3_FP8_TYPE_f16 __half
#define FA3_FP8_UNIT_(S, DT, D, E) FA3_FP8_SN(S, DT, FA3_FP8_TYPE_##DT, D) FA_FP8_PREPASS_INSTANCE(DT, E)
#define FA3_FP8_UNIT(S, DT, D, E) FA3_FP8_UNIT_(S, DT, D, E)
#define FA_INSTANCE(DT) FA3_FP8_UNIT(FA_STAGE, DT, FA_HEAD_DIM, FA3_FP8_PREPASS_E)
#else
// Standalone (the emulator's unit, the private SASS check): every stage at head_dim 64, 128, 256.
#define FA3_FP8_ALL_STAGES(D)                        \
    FA3_FP8_S1(bf16, __nv_bfloat16, D)               \
    FA3_FP8_S1(f16, __half, D)                       \
    FA3_FP8_SN(2, bf16, __nv_bfloat16, D)            \
    FA3_FP8_SN(2, f16, __half, D)                    \
    FA3_FP8_SN(3, bf16, __nv_bfloat16, D)            \
    FA3_FP8_SN(3, f16, __half, D)                    \
    FA3_FP8_SN(4, bf16, __nv_bfloat16, D)            \
    FA3_FP8_SN(4, f16, __half, D)                    \
    FA3_FP8_SN(5, bf16, __nv_bfloat16, D)            \
    FA3_FP8_SN(5, f16, __half, D)
FA3_FP8_ALL_STAGES(64)
FA3_FP8_ALL_STAGES(128)
FA3_FP8_ALL_STAGES(256)
#endif  // FA_FAMILY

// FA2 forward: FlashAttention-2 (Dao, arXiv 2307.08691) on mma.sync tensor cores, sm_80 and newer.
//
// One CTA computes kBlockM query rows of one (batch, head): split-Q, each warp owns 16 * kMTiles
// rows and never talks to the other warps except through shared-memory barriers. At hdim 512 two
// warps share each 16 rows (Fa2Traits kColSplit): both compute the rows' S and softmax, each
// accumulates half of O's columns. K/V tiles of
// kBlockN keys stream through a two-stage shared-memory ring with cp.async (tile j-1 lands while
// tile j is computed; one barrier per tile). S stays in registers, becomes P in place
// (the accumulator fragment of Q K^T is the A fragment of P V, see fa2/layout.h), and O is
// normalised once at the end, staged through shared memory and written with 16-byte stores.
//
// Launch contract (the host mirrors fa2::Fa2Traits<D>, table in docs/fa2.md):
//   symbol      fa2_fwd_hd<D>_<f16|bf16>, D in {32, 64, 96, 128, 192, 256, 512}; fa2v_fwd_hd<D>_<f16|bf16>,
//               D in {192, 576}, with V's head dim DV 128, 512 (FwdParams::head_dim_v)
//   grid        (ceil(seqlen_q / kBlockM), heads_q, batch)
//   block       (kNWarps * 32, 1, 1)
//   dyn. smem   kSmemBytes; above 48 KiB set CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first
//     D   kBlockM kBlockN warps threads smem bytes (kMTiles = m16 tiles per warp)
//     32    128     64     4     128     30720      (2)
//     64    128     64     4     128     55296      (2)
//     96    128     64     4     128     79872      (2)
//    128    128     32     4     128     69632      (2)
//    192     64     32     4     128     76800      (1)
//    256     64     32     4     128    101376      (1)
//    512     32     16     4     128     99840      (1; 2 row groups x 2 column halves of O)
//   V's head dim below Q/K's (the fa2v row; D/DV):
//   192/128   64     32     4     128     68608      (1)
//   576/512   16     16     4     128     89344      (1; 4 column quarters of O)
//   (static_asserted at the bottom of this file, so the table cannot drift from the traits)
// Preconditions checked by the host: head_dim == D (and V's == DV); q/k/v/o 16-byte aligned and every stride a
// multiple of 8 elements (16-byte cp.async and stores); heads_q % heads_kv == 0; seqlen_q >= 1;
// lse non-null when FA_FLAG_RETURN_LSE, alibi_slopes non-null when FA_FLAG_ALIBI.
//
// Build: the crate compiles it through the units build.rs generates from build/instances.rs (one
// per head dim, FA_HEAD_DIM/FA_BLOCK_M/FA_BLOCK_N/FA_THREADS/FA_SMEM_BYTES defined, then
// FA_INSTANCE(f16) and FA_INSTANCE(bf16)); the row is static_asserted against the traits below.
#include <math.h>
#include <stdint.h>

#include "fa2/layout.h"
#include "fa2/traits.cuh"
#include "common/params.h"
#include "common/dtype.cuh"
#include "common/mask.cuh"
#include "common/seqlen.cuh"
#include "common/append_kv.cuh"
#include "common/fp8_kv.cuh"
#include "sm80/mma.cuh"
#include "common/softmax.cuh"

namespace fa2 {

// Copies `kRows` x kCols elements (global rows row0.., pitch `row_stride`) into a shared tile of
// pitch kCols + 8 (kHeadDim for Q and K, kHeadDimV for V), 16 bytes per cp.async; rows at or past
// `row_end` become zeros. Thread layout: kCols / 8 consecutive threads cover one row,
// kRowsPerPass rows per pass, so a thread's
// column is fixed and its row advances by kRowsPerPass: one running pointer per thread and no
// per-chunk index math to be hoisted into registers of the (register-bound) main loop.
template <typename T, int kRows, int kCols, typename Elem>
__device__ __forceinline__ void load_tile(Elem* smem, const Elem* gbase, int64_t row_stride, int row0,
                                          int row_end, int tid) {
    constexpr int kChunks = kCols / 8, kStride = kCols + 8;
    constexpr int kRowsPerPass = T::kNThreads / kChunks;  // hd96: 10 rows, 8 threads idle
    constexpr int kPasses = (kRows + kRowsPerPass - 1) / kRowsPerPass;
    static_assert(kRowsPerPass >= 1, "a pass must cover at least one row");
    const int r = tid / kChunks;
    const int col = (tid % kChunks) * 8;
    if (r >= kRowsPerPass) return;  // threads past the last full row of a pass
    const Elem* src = gbase + static_cast<int64_t>(row0 + r) * row_stride + col;
    uint32_t dst = smem_u32(smem + r * kStride + col);
    // Not unrolled: an unrolled pass loop would keep kPasses 64-bit addresses live next to the
    // S and O accumulators (hdim 128 spilled that way).
#pragma unroll 1
    for (int pass = 0; pass < kPasses; ++pass) {
        const int rr = r + pass * kRowsPerPass;  // row inside the tile
        if (kRows % kRowsPerPass == 0 || rr < kRows) {
            // Out-of-range rows read nothing (src-size 0) from a valid address and land as
            // zeros, so padded keys give finite S (masked later) and padded V rows give 0 in P V.
            const bool in = row0 + rr < row_end;
            cp_async_16(dst, in ? src : gbase, in ? 16 : 0);
        }
        src += kRowsPerPass * row_stride;
        dst += kRowsPerPass * kStride * 2;
    }
}

// load_tile for a paged cache: the same thread layout, but each row's address goes through the
// block table (cuda/common/seqlen.cuh fa_kv_row_offset), so any page size works, blocks in any
// order. `ghead`: the tensor's base plus the kv head's offset. Rows at or past `row_end` (the
// sequence's keys) are zeros and never looked up (table entries past its pages are not read).
template <typename T, int kRows, int kCols, typename Elem>
__device__ __forceinline__ void load_tile_paged(Elem* smem, const Elem* ghead, const FwdParams& p, const FaSeq& seq,
                                                int64_t batch_stride, int64_t row_stride, int row0, int row_end,
                                                int tid) {
    constexpr int kChunks = kCols / 8, kStride = kCols + 8;
    constexpr int kRowsPerPass = T::kNThreads / kChunks;
    constexpr int kPasses = (kRows + kRowsPerPass - 1) / kRowsPerPass;
    const int r = tid / kChunks;
    const int col = (tid % kChunks) * 8;
    if (r >= kRowsPerPass) return;
    uint32_t dst = smem_u32(smem + r * kStride + col);
#pragma unroll 1
    for (int pass = 0; pass < kPasses; ++pass) {
        const int rr = r + pass * kRowsPerPass;
        if (kRows % kRowsPerPass == 0 || rr < kRows) {
            const int j = row0 + rr;
            const bool in = j < row_end;
            const Elem* src = in ? ghead + fa_kv_row_offset(p, seq, batch_stride, row_stride, j) + col : ghead;
            cp_async_16(dst, src, in ? 16 : 0);
        }
        dst += kRowsPerPass * kStride * 2;
    }
}

// load_tile_paged for an FP8 cache (FA_FLAG_KV_FP8, common/fp8_kv.cuh): the same thread layout
// and row addresses (dense, or through the block table), but each thread reads its 8 codes with a
// plain 8-byte load and stores their values (exact in Elem) as the 16-bit chunk itself, so the
// ring holds a 16-bit tile as on every other launch (visible to all warps after the loop's
// barrier); the row's scale (`gscale`: k/v_cache_scale) goes as an f32 into the row's padding
// (element kHeadDim of the kStride pitch, which no ldmatrix reads), for fa_scale_key_columns.
// Rows at or past `row_end` are zeros with scale 0.
template <typename T, int kRows, typename Elem>
__device__ __forceinline__ void load_tile_fp8(Elem* smem, const uint8_t* ghead, const float* gscale,
                                              const FwdParams& p, const FaSeq& seq, int64_t batch_stride,
                                              int64_t row_stride, int row0, int row_end, int hk, int tid) {
    constexpr int kChunks = T::kChunksPerRow;
    constexpr int kRowsPerPass = T::kNThreads / kChunks;
    constexpr int kPasses = (kRows + kRowsPerPass - 1) / kRowsPerPass;
    const int r = tid / kChunks;
    const int col = (tid % kChunks) * 8;
    if (r >= kRowsPerPass) return;
    Elem* dst = smem + r * T::kStride + col;
#pragma unroll 1
    for (int pass = 0; pass < kPasses; ++pass) {
        const int rr = r + pass * kRowsPerPass;
        if (kRows % kRowsPerPass == 0 || rr < kRows) {
            const int j = row0 + rr;
            uint4 chunk = make_uint4(0u, 0u, 0u, 0u);
            float scale = 0.f;
            if (j < row_end) {
                const uint8_t* src = ghead + fa_kv_row_offset(p, seq, batch_stride, row_stride, j) + col;
                chunk = fa_e4m3x8<Elem>(*reinterpret_cast<const uint64_t*>(src));
                if (col == 0) scale = gscale[fa_kv_scale_index(p, seq, j, hk)];
            }
            *reinterpret_cast<uint4*>(dst) = chunk;
            if (col == 0) *reinterpret_cast<float*>(dst + T::kHeadDim) = scale;
        }
        dst += kRowsPerPass * T::kStride;
    }
}

// The scale of row 0 of ring stage `stage` of a K or V ring that load_tile_fp8 filled (rows
// T::kStride elements apart).
template <typename T, typename Elem>
__device__ __forceinline__ const unsigned char* fp8_row_scales(const Elem* ring, int stage) {
    return reinterpret_cast<const unsigned char*>(ring + (stage * T::kBlockN) * T::kStride + T::kHeadDim);
}

__device__ __forceinline__ int kv_head(const FwdParams& p) { return cta_head() / (p.heads_q / p.heads_kv); }

// This CTA's sequence, re-derived from %ctaid.z (volatile, see cta_batch) and the index arrays
// wherever it is needed, rather than kept live across the register-bound main loop (keeping
// it cost hdim 96 a spill).
__device__ __forceinline__ FaSeq cta_seq(const FwdParams& p) { return fa_seq(p, fa_batch_split(p, cta_batch()).b); }

// Issues the K and V tiles of keys [n0, n0 + kBlockN) of this CTA's sequence into one ring stage
// (caller commits). The kv head is the shared GQA/MQA head h / (heads_q / heads_kv), so K/V are
// never copied; it is re-read from %ctaid.y per tile (see cta_head) rather than kept live. An
// FP8 cache's tiles are dequantised on the way (load_tile_fp8): plain loads, so such a tile lands
// before the call returns rather than overlapping the next tile's compute.
template <typename T, typename Elem>
__device__ __forceinline__ void load_kv(Elem* sK_stage, Elem* sV_stage, const FwdParams& p, int n0, int tid) {
    const FaSeq seq = cta_seq(p);
    const int hk = kv_head(p);
    if (fa_kv_fp8(p)) {
        const uint8_t* k8 = reinterpret_cast<const uint8_t*>(p.k) + hk * p.k_head_stride;
        const uint8_t* v8 = reinterpret_cast<const uint8_t*>(p.v) + hk * p.v_head_stride;
        load_tile_fp8<T, T::kBlockN>(sK_stage, k8, reinterpret_cast<const float*>(p.k_cache_scale), p, seq,
                                     p.k_batch_stride, p.k_row_stride, n0, seq.sk, hk, tid);
        load_tile_fp8<T, T::kBlockN>(sV_stage, v8, reinterpret_cast<const float*>(p.v_cache_scale), p, seq,
                                     p.v_batch_stride, p.v_row_stride, n0, seq.sk, hk, tid);
        return;
    }
    const Elem* k = reinterpret_cast<const Elem*>(p.k) + hk * p.k_head_stride;
    const Elem* v = reinterpret_cast<const Elem*>(p.v) + hk * p.v_head_stride;
    if (p.page_size > 0) {
        load_tile_paged<T, T::kBlockN, T::kHeadDim>(sK_stage, k, p, seq, p.k_batch_stride, p.k_row_stride, n0, seq.sk,
                                                    tid);
        load_tile_paged<T, T::kBlockN, T::kHeadDimV>(sV_stage, v, p, seq, p.v_batch_stride, p.v_row_stride, n0, seq.sk,
                                                     tid);
    } else {
        load_tile<T, T::kBlockN, T::kHeadDim>(sK_stage, k + fa_kv_row_offset(p, seq, p.k_batch_stride, p.k_row_stride, 0),
                                              p.k_row_stride, n0, seq.sk, tid);
        load_tile<T, T::kBlockN, T::kHeadDimV>(sV_stage, v + fa_kv_row_offset(p, seq, p.v_batch_stride, p.v_row_stride, 0),
                                               p.v_row_stride, n0, seq.sk, tid);
    }
}

template <typename Elem, int kHeadDim, int kHeadDimV>
__device__ __forceinline__ void fwd_kernel(const FwdParams& p) {
    using T = Fa2Traits<kHeadDim, kHeadDimV>;
    using M = Mma<Elem>;
    constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStride = T::kStride, kStrideV = T::kStrideV;
    constexpr int kMTiles = T::kMTiles, kNTiles = T::kNTiles, kDTiles = T::kDTiles;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    Elem* sQ = reinterpret_cast<Elem*>(smem_raw);  // [kBlockM][kStride], later O staging ([kBlockM][kStrideV])
    Elem* sK = sQ + kBlockM * kStride;              // [kStages][kBlockN][kStride]
    Elem* sV = sK + T::kStages * kBlockN * kStride;  // [kStages][kBlockN][kStrideV]
    constexpr uint32_t kStageBytesK = kBlockN * kStride * 2, kStageBytesV = kBlockN * kStrideV * 2;  // one stage

    const int m_block = blockIdx.x, head = blockIdx.y;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    // This CTA's sequence and key split (cuda/common/seqlen.cuh; a dense launch: batch z, one
    // split, seqlen_q x seqlen_k). The grid covers the longest sequence: CTAs past this one's
    // rows have nothing to do (uniform over the CTA, before any barrier).
    const FaBatchSplit bs = fa_batch_split(p, blockIdx.z);
    const FaSeq seq = fa_seq(p, bs.b);  // the prologue's; the loop and epilogue re-derive it
    const int seqlen_q = seq.sq, seqlen_k = seq.sk;
    const int m0 = m_block * kBlockM;                  // first query row of this CTA
    if (m0 >= seqlen_q) return;
    const int m_last = min(m0 + kBlockM, seqlen_q) - 1;  // last real query row
    const FaMaskDims mask{p.window_left, p.window_right, seqlen_q, seqlen_k};  // fa_seq_mask

    const float slope = fa_alibi_slope(p, head);

    // The key tiles any row of this CTA can see, within this split's keys: [n_min, n_max).
    const FaKeyTiles tiles = fa_key_tiles(mask, m0, m_last + 1, kBlockN);
    const int splits = fa_num_splits(p);
    const FaKeyTiles split_tiles = fa_split_tiles(seq.sk, splits, bs.split, kBlockN);
    const int n_min = max(tiles.n_begin, split_tiles.n_begin);
    const int n_max = max(n_min, min(tiles.n_end, split_tiles.n_end));

    // Prologue: Q and the first K/V tile in flight, as one cp.async group. Key tiles are visited
    // from the last one down, so the diagonal/boundary tiles that need the mask come first and set
    // a sane row max early.
    load_tile<T, kBlockM, kHeadDim>(sQ, reinterpret_cast<const Elem*>(p.q) + fa_q_offset(p, seq, head, 0), p.q_row_stride, m0,
                          seqlen_q, tid);
    if (n_max > n_min) load_kv<T>(sK, sV, p, (n_max - 1) * kBlockN, tid);
    cp_async_commit();

    // Per lane: O accumulators (f32) of this warp's columns [col0, col0 + kOCols) and the softmax
    // state of its 2 rows per m-tile (row g and g + 8; the sums are reduced over the quad only at
    // the end).
    using Frag = AccFrag<kMTiles, kNTiles, kDTiles>;
    const Frag frag{lane};
    float acc_o[kMTiles][kDTiles][4];
    FaOnlineSoftmax<Frag, FaRowPolicy> softmax;  // the row's exponent policy (FA4's softmax: docs/fa4.md)
    softmax.init();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] = 0.f;

    // First CTA row and first O column of this warp (whole rows, column 0, unless kColSplit > 1:
    // written so that the other instances compile exactly as without the split).
    constexpr bool kSplitCols = T::kColSplit > 1;
    const int wrow = warp_row0(kSplitCols ? warp_row_group(warp, T::kRowWarps) : warp, kMTiles);
    const int col0 = kSplitCols ? warp_col0(warp, T::kRowWarps, T::kOCols) : 0;
    // With split columns the warps of a row group compute the same S and softmax state; one writes the LSE.
    const bool lse_writer = col0 == 0;
    const uint32_t sQ_u32 = smem_u32(sQ), sK_u32 = smem_u32(sK), sV_u32 = smem_u32(sV);
    // Per-lane ldmatrix row addresses (bytes), fixed parts; the loops add the tile offsets.
    const uint32_t q_lane = ((wrow + ldsm_q_row(lane)) * kStride + ldsm_q_col(lane)) * 2;
    const uint32_t k_lane = (ldsm_k_row(lane) * kStride + ldsm_k_col(lane)) * 2;
    const uint32_t v_lane = (ldsm_v_row(lane) * kStrideV + ldsm_v_col(lane)) * 2;

    // Two-stage K/V ring, one barrier per tile: tile j sits in stage (n_max - 1 - j) & 1; at the top
    // of its iteration every thread waits for its own copies of tile j and the barrier makes them
    // visible to all, and also proves every warp is done with tile j+1, whose stage then receives
    // tile j-1. So each load overlaps one whole tile of compute (QK^T, softmax, PV).
    for (int n_block = n_max - 1, stage = 0; n_block >= n_min; --n_block, stage ^= 1) {
        const int n0 = n_block * kBlockN;
        cp_async_wait<0>();  // tile j (and, first time, Q) landed for this thread ...
        __syncthreads();     // ... and for every thread; every warp is done with tile j+1
        if (n_block > n_min)
            load_kv<T>(sK + (stage ^ 1) * kBlockN * kStride, sV + (stage ^ 1) * kBlockN * kStrideV, p,
                       n0 - kBlockN, tid);
        cp_async_commit();
        const uint32_t sK_stage = sK_u32 + stage * kStageBytesK, sV_stage = sV_u32 + stage * kStageBytesV;

        // ---- S = Q K_j^T: acc_s[mt][nt] is the 16x8 tile (rows wrow+16mt.., keys n0+8nt..) ----
        float acc_s[kMTiles][kNTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc_s[mt][nt][i] = 0.f;
#pragma unroll
        for (int ks = 0; ks < T::kKSteps; ++ks) {
            uint32_t qa[kMTiles][4];  // A fragments of Q rows (16mt..), d = 16ks..16ks+15
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
                ldmatrix_x4(qa[mt], sQ_u32 + q_lane + (mt * 16 * kStride + ks * 16) * 2);
#pragma unroll
            for (int np = 0; np < kNTiles / 2; ++np) {
                uint32_t kb[4];  // B fragments of n-tiles 2np (kb[0], kb[1]) and 2np+1 (kb[2], kb[3])
                ldmatrix_x4(kb, sK_stage + k_lane + (np * 16 * kStride + ks * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) {
                    M::run(acc_s[mt][2 * np], qa[mt], kb[0], kb[1]);
                    M::run(acc_s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
                }
            }
        }

        // ---- scores: raw q.k, or natural units with softcap / ALiBi; mask only tiles that
        // cross a boundary (some (row, key) of the CTA's real rows hidden); then the online
        // softmax in score units (softmax.cuh), S becoming P in place ----
        // An FP8 cache's tile holds the codes' values: its keys' scales multiply S (common/fp8_kv.cuh).
        if (fa_kv_fp8(p))
            fa_scale_key_columns(acc_s, frag, fp8_row_scales<T>(sK, stage), T::kStride * 2);
        if (fa_natural_scores(p))
            fa_scores_to_natural<true, false>(acc_s, frag, p, slope, m0 + wrow, n0, seqlen_k - seqlen_q);
        if (fa_tile_needs_mask(mask, m0, m_last, n0, (long long)n0 + kBlockN - 1))
            fa_mask_fragment(acc_s, frag, mask, m0 + wrow, n0);
        float corr[Frag::kRows];
        softmax.update(acc_s, p.softmax_scale_log2, corr);
        softmax.rescale(acc_o, corr);
        // ... and V's multiply P (its row sums are taken: P V over an FP8 tile is P diag(s) V).
        if (fa_kv_fp8(p))
            fa_scale_key_columns(acc_s, frag, fp8_row_scales<T>(sV, stage), T::kStride * 2);

        // ---- O += P V_j; P's A fragment comes straight from acc_s (fa2/layout.h) ----
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            uint32_t pa[kMTiles][4];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const float* src = acc_s[mt][2 * kk + p_src_tile(r)];
                    pa[mt][r] = fa_pack2<Elem>(src[p_src_elem(r, 0)], src[p_src_elem(r, 1)]);
                }
#pragma unroll
            for (int dp = 0; dp < kDTiles / 2; ++dp) {
                uint32_t vb[4];  // B fragments of d-tiles 2dp (vb[0], vb[1]) and 2dp+1 (vb[2], vb[3])
                ldmatrix_x4_trans(vb, sV_stage + v_lane + (kk * 16 * kStrideV + col0 + dp * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) {
                    M::run(acc_o[mt][2 * dp], pa[mt], vb[0], vb[1]);
                    M::run(acc_o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
                }
            }
        }
    }

    // ---- epilogue: O / l, LSE, O through shared memory (reusing sQ) with 16-byte stores ----
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with sQ (and no cp.async is left in flight)
    const bool write_lse = (p.flags & FA_FLAG_RETURN_LSE) != 0u;
    // The LSE index of row 0 of this (sequence, head): [batch, heads_q, seqlen_q] dense,
    // [heads_q, total_q] packed (seqlen.cuh); the split-KV accumulators use the same rows.
    const FaSeq seq_out = cta_seq(p);
    const int64_t lse_row0 = fa_lse_index(seq_out, head, 0);
    const float to_natural = fa_to_natural(p);  // the max's units -> natural
    if (splits > 1) {
        // Split-KV: this split's normalised partial state in f32, straight from the fragments
        // (o_accum [splits, lse rows, head_dim_v], lse_accum [splits, lse rows]); the combine
        // kernel merges the splits into o and lse.
        const int64_t acc_row0 = static_cast<int64_t>(fa_batch_split(p, cta_batch()).split) * fa_lse_rows(p) + lse_row0;
        float* gLseAcc = reinterpret_cast<float*>(p.lse_accum) + acc_row0;
        float* gOAcc = reinterpret_cast<float*>(p.o_accum) + acc_row0 * kHeadDimV;
#pragma unroll
        for (int r = 0; r < Frag::kRows; ++r) {
            const FaRowEnd end = softmax.finalize(r, to_natural);
            const int row = m0 + wrow + frag.row(r);
            if (row >= seqlen_q) continue;
            if (lse_writer && (lane & 3) == 0) gLseAcc[row] = end.lse;
#pragma unroll
            for (int j = 0; j < Frag::kOCols; j += 2) {
                const float o0 = end.empty ? 0.f : Frag::o(acc_o, r, j) * end.inv_l;
                const float o1 = end.empty ? 0.f : Frag::o(acc_o, r, j + 1) * end.inv_l;
                float* dst = gOAcc + static_cast<int64_t>(row) * kHeadDimV + col0 + frag.col(j);
                dst[0] = o0;
                dst[1] = o1;
            }
        }
        return;
    }
    float* gLse = write_lse ? reinterpret_cast<float*>(p.lse) + lse_row0 : nullptr;
    const float sink = fa_sink(p, head);  // split-KV above leaves it to the combine kernel
    Elem* sO = sQ;
    Elem* gO = reinterpret_cast<Elem*>(p.o) + fa_o_offset(p, seq_out, head, 0);
#pragma unroll
    for (int r = 0; r < Frag::kRows; ++r) {
        const FaRowEnd end = softmax.finalize(r, to_natural, sink);
        const int srow = wrow + frag.row(r);  // row inside the CTA tile
        if (write_lse && lse_writer && (lane & 3) == 0 && m0 + srow < seqlen_q) gLse[m0 + srow] = end.lse;
#pragma unroll
        for (int j = 0; j < Frag::kOCols; j += 2) {
            const float o0 = end.empty ? 0.f : Frag::o(acc_o, r, j) * end.inv_l;
            const float o1 = end.empty ? 0.f : Frag::o(acc_o, r, j + 1) * end.inv_l;
            *reinterpret_cast<uint32_t*>(sO + srow * kStrideV + col0 + frag.col(j)) = fa_pack2<Elem>(o0, o1);
        }
    }
    __syncthreads();
    constexpr int kChunks = kHeadDimV / 8;  // 16-byte chunks per O row
    for (int c = tid; c < kBlockM * kChunks; c += T::kNThreads) {
        const int r = c / kChunks;
        const int col = (c % kChunks) * 8;
        if (m0 + r < seqlen_q)
            *reinterpret_cast<uint4*>(gO + static_cast<int64_t>(m0 + r) * p.o_row_stride + col) =
                *reinterpret_cast<const uint4*>(sO + r * kStrideV + col);
    }
}

}  // namespace fa2

// ---- instances: extern "C" so the host looks them up by plain name -------------------------------
// One instance: <family>_fwd_hd<D>_<f16|bf16>, the symbol build/instances.rs `kernel_symbol`
// gives: fa2_fwd_hd<D>_<dtype>, or fa4_fa2_fwd_hd<D>_<dtype> for the row that runs FA4's softmax
// in this pipeline (FA_FAMILY, with its FaRowPolicy).
namespace fa2 {
using elem_f16 = __half;
using elem_bf16 = __nv_bfloat16;
}  // namespace fa2
// The unit of the APPEND_KV_FAMILY row (FA_WITH_APPEND_KV, build/instances.rs) also carries the
// serving KV append kernel (cuda/common/append_kv.cuh), fa_append_kv_hd<D>_<dtype>: FA2's images
// load on every GPU the crate runs on (sm_80 SASS and compute_80 PTX), so every family's append
// runs this one.
#ifdef FA_WITH_APPEND_KV
#define FA2_APPEND_KV(HDIM, DT) FA_APPEND_KV_KERNEL(fa_append_kv_hd##HDIM##_##DT, fa2::elem_##DT)
#else
#define FA2_APPEND_KV(HDIM, DT)
#endif
#define FA2_KERNEL(FAM, HDIM, HDIM_V, DT)                                                           \
    extern "C" __global__ void __launch_bounds__(fa2::Fa2Traits<HDIM, HDIM_V>::kNThreads, 1)       \
        FAM##_fwd_hd##HDIM##_##DT(const __grid_constant__ FwdParams p) {                            \
        fa2::fwd_kernel<fa2::elem_##DT, HDIM, HDIM_V>(p);                                           \
    }                                                                                               \
    FA2_APPEND_KV(HDIM, DT)
// Expands FA_FAMILY, FA_HEAD_DIM before pasting.
#define FA2_KERNEL_(FAM, HDIM, HDIM_V, DT) FA2_KERNEL(FAM, HDIM, HDIM_V, DT)

#if !defined(FA_HEAD_DIM) || !defined(FA_FAMILY)
#error "compile through the unit build.rs generates from build/instances.rs"
#else
// V's head dim: the unit defines it only for a row whose V head dim differs (the fa2v row).
#ifndef FA_HEAD_DIM_V
#define FA_HEAD_DIM_V FA_HEAD_DIM
#endif
// The crate's build: build.rs generates one unit per head dim from build/instances.rs, with the
// row's tile as macros, then writes FA_INSTANCE(f16) and FA_INSTANCE(bf16). The row must be
// exactly what the traits compute, or the host would launch with the wrong shape.
static_assert(fa2::Fa2Traits<FA_HEAD_DIM, FA_HEAD_DIM_V>::kBlockM == FA_BLOCK_M &&
                  fa2::Fa2Traits<FA_HEAD_DIM, FA_HEAD_DIM_V>::kBlockN == FA_BLOCK_N &&
                  fa2::Fa2Traits<FA_HEAD_DIM, FA_HEAD_DIM_V>::kNThreads == FA_THREADS,
              "build/instances.rs fa2 tile disagrees with fa2_traits.cuh");
static_assert(fa2::Fa2Traits<FA_HEAD_DIM, FA_HEAD_DIM_V>::kSmemBytes == FA_SMEM_BYTES,
              "build/instances.rs fa2_smem_bytes disagrees with fa2_traits.cuh");
#define FA_INSTANCE(DT) FA2_KERNEL_(FA_FAMILY, FA_HEAD_DIM, FA_HEAD_DIM_V, DT)
#endif

// The launch table of the header comment, checked against the traits.
#define FA2_CHECK_V(D, DV, M, N, W, SMEM)                                                             \
    static_assert(fa2::Fa2Traits<D, DV>::kBlockM == M && fa2::Fa2Traits<D, DV>::kBlockN == N &&      \
                      fa2::Fa2Traits<D, DV>::kNWarps == W && fa2::Fa2Traits<D, DV>::kSmemBytes == SMEM, \
                  "docs/fa2.md launch table out of date for hdim " #D "/" #DV);
#define FA2_CHECK(D, M, N, W, SMEM) FA2_CHECK_V(D, D, M, N, W, SMEM)
FA2_CHECK(32, 128, 64, 4, 30720)
FA2_CHECK(64, 128, 64, 4, 55296)
FA2_CHECK(96, 128, 64, 4, 79872)
FA2_CHECK(128, 128, 32, 4, 69632)
FA2_CHECK(192, 64, 32, 4, 76800)
FA2_CHECK(256, 64, 32, 4, 101376)
FA2_CHECK(512, 32, 16, 4, 99840)
FA2_CHECK_V(192, 128, 64, 32, 4, 68608)
FA2_CHECK_V(576, 512, 16, 16, 4, 89344)

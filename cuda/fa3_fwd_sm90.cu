// FA3-style forward attention for Hopper (sm_90a), bf16/f16, built as a ladder of stages that
// each add one mechanism (docs/fa3.md has the status, launch configuration and tensor maps):
//   stage 1  wgmma only: one warpgroup per 64 query rows, Q/K/V copied by plain 16-byte loads
//            into 128B-swizzled shared memory, S = Q K^T (both operands in smem) and O += P V
//            (P from registers, V through a transposed "MN-major" descriptor).
//   stage 2  + TMA (cp.async.bulk.tensor.4d) into a 2-slot K/V ring with mbarrier
//            expect_tx / try_wait.parity phase tracking; one warpgroup, thread 0 issues.
//   stage 3  + warp specialisation: warpgroup 0 produces (TMA, setmaxnreg.dec), warpgroups 1-2
//            consume (setmaxnreg.inc), each on its own 64 of the CTA's 128 query rows; slots are
//            released through "empty" mbarriers.
//   stage 4  + ping-pong (the consumers pass a GEMM-issue token through two named barriers) and
//            intra-warpgroup overlap (S_j+1 and PV_j in flight during the softmax of S_j+1);
//            separate K and V barriers.
//   stage 5  + persistent scheduling (CTAs stride over heaviest-first tiles; the ring and the Q
//            buffer carry across tiles).
// Layouts (smem tiles, descriptors, register fragments) are derived in wgmma_sm90.cuh.
//
// Semantics (same as every backend): s = scale * q.k, optional softcap, bottom-right aligned
// causal/sliding window, GQA (kv head = q head / (heads_q / heads_kv)), LSE (natural log) on
// request, rows with no visible key give O = 0 and LSE = -inf. No ALiBi: the dispatcher must not
// route FA_FLAG_ALIBI here. Seqlens need not be multiples of the tile: loads past the end are
// zero (plain loads: explicit; TMA: out-of-bounds fill) and those keys are masked.
// Host requirements: head_dim == the instance's D; q/k/v/o row, head and batch strides multiples
// of 8 elements and base addresses 16-byte aligned (16-byte vector loads / TMA strides).
#include <climits>

#if defined(FA_HANG_CHECK)
// Hang-check builds (cuda/include/hang_check.cuh) name a stuck mbarrier from its shared-memory
// offset; defined at the end of this file from the Barriers / SplitBarriers layouts.
namespace fa3 {
__device__ const char* hang_barrier_name(unsigned int offset, int* slot);
}
#define FA_HANG_BARRIER_NAME(offset, slot) fa3::hang_barrier_name(offset, slot)
#endif

#include "fa_params.h"
#include "cta_coord.cuh"
#include "fa3_traits.cuh"
#include "fast_math_sm90.cuh"
#include "mbarrier_sm90.cuh"
#include "tma_sm90.cuh"
#include "wgmma_sm90.cuh"

namespace fa3 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Per-warpgroup online-softmax state and output accumulator: this thread's two rows
// (16w + g and 16w + g + 8 of the warpgroup's 64) and its D/2 accumulator columns.
template <int D>
struct Acc {
    float o[D / 2];
    float row_max[2];  // running max of raw (unscaled) scores, -inf before any visible key
    float row_sum[2];  // this thread's partial sum of exp2(...) (reduced over 4 lanes at the end)
};

// Fragment coordinates of this thread inside its warpgroup (see wgmma_sm90.cuh "Fragments").
struct FragPos {
    int row0;  // 16w + g; the thread's second row is row0 + 8
    int col0;  // 2t: the thread's columns in chunk j are 8j + col0 + {0, 1}
};
__device__ __forceinline__ FragPos frag_pos(int thread_in_wg) {
    const int warp = thread_in_wg / 32, lane = thread_in_wg % 32;
    return FragPos{16 * warp + lane / 4, 2 * (lane % 4)};
}

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

// Issues O[64 x D] += P[64 x BN] V_tile[BN x D] as one wgmma group; P is given as A fragments
// a[k] for keys 16k..16k+15. Neither o nor a may be touched until the group has been waited for.
template <class Tr, class T>
__device__ __forceinline__ void issue_pv(float (&o)[Tr::kHeadDim / 2],
                                         const uint32_t (&a)[Tr::kBlockN / kMmaK][4],
                                         uint32_t v_addr) {
    wgmma_fence();  // o was rescaled and a written by ordinary instructions
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / kMmaK; ++kk) {
#pragma unroll
        for (int nh = 0; nh < Tr::kHeadDim / kMmaN; ++nh) {
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
__device__ __forceinline__ void gemm_pv(float (&o)[Tr::kHeadDim / 2],
                                        const uint32_t (&a)[Tr::kBlockN / kMmaK][4],
                                        uint32_t v_addr) {
    issue_pv<Tr, T>(o, a, v_addr);
    wgmma_wait<0>();
    fence_regs(o);
}

// ---- Softmax verbs (names mirror src/cpu/softmax.rs: mask, online_softmax, rescale_o).

// Optional softcap (natural units), then -inf for keys past seqlen_k (zero-filled loads) and
// outside the window (the 64-bit rule of mask.cuh). m_first: global query row of the
// warpgroup's row 0; n_tile: the K/V tile index.
template <class Tr>
__device__ __forceinline__ void softcap_and_mask(const FwdParams& p, float (&s)[Tr::kBlockN / 2],
                                                 const FragPos& fp, int m_first, int n_tile) {
    if (p.flags & FA_FLAG_SOFTCAP) {  // s = cap * tanh((scale * s) / cap); exp2 then uses log2(e)
        // Scale first, then 1 / cap (finite: the host refuses subnormal caps), as a straightforward
        // softmax computes it: scale / cap folded into one factor overflows to inf (inf * 0 = NaN).
        const float inv_cap = 1.f / p.softcap;
#pragma unroll
        for (int i = 0; i < Tr::kBlockN / 2; ++i) s[i] = p.softcap * fast_tanh((s[i] * p.softmax_scale) * inv_cap);
    }
    const int n0 = n_tile * Tr::kBlockN;
    // Warpgroup-uniform: skip the element tests on tiles where nothing can be masked.
    if (Tr::kSkipUnmaskedTiles && !block_needs_mask(p, m_first, kMmaM, n0, Tr::kBlockN)) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = m_first + fp.row0 + 8 * h;
        const int lo = fa_key_lo(p, i), hi = fa_key_hi(p, i);  // visible keys [lo, hi)
#pragma unroll
        for (int c = 0; c < Tr::kBlockN / 8; ++c) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = n0 + 8 * c + fp.col0 + e;
                if (j < lo || j >= hi) s[acc_index(c, h, e)] = -INFINITY;
            }
        }
    }
}

// Row max update (score units: raw q.k, or natural units with softcap), s -> exp2((s - max) *
// scale_log2) in place, row sums; returns in corr[h] the factor the output accumulated so far
// must be multiplied by. Does not touch O. Exponents come from differences only (never
// max * scale_log2 on its own: rounded next to an FMA's exact product it was off by up to ±128
// in the exponent once |max * scale_log2| >= 2^31); see softmax_fwd.cuh.
template <class Tr>
__device__ __forceinline__ void online_softmax(Acc<Tr::kHeadDim>& acc, float (&s)[Tr::kBlockN / 2],
                                               float scale_log2, float (&corr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = acc.row_max[h];
#pragma unroll
        for (int c = 0; c < Tr::kBlockN / 8; ++c)
            mx = fmaxf(mx, fmaxf(s[acc_index(c, h, 0)], s[acc_index(c, h, 1)]));
        // 4 lanes (lane bits 0 and 1) share a row.
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // -inf guard: with nothing visible yet subtract 0 so exp2 gives 0, not NaN.
        const float m_use = mx == -INFINITY ? 0.f : mx;
        corr[h] = fast_exp2((acc.row_max[h] - m_use) * scale_log2);  // old max -inf: 0
        acc.row_max[h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < Tr::kBlockN / 8; ++c) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& x = s[acc_index(c, h, e)];
                x = fast_exp2((x - m_use) * scale_log2);
                sum += x;
            }
        }
        acc.row_sum[h] = acc.row_sum[h] * corr[h] + sum;
    }
}

template <class Tr>
__device__ __forceinline__ void rescale_o(Acc<Tr::kHeadDim>& acc, const float (&corr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < Tr::kHeadDim / 8; ++c) {
            acc.o[acc_index(c, h, 0)] *= corr[h];
            acc.o[acc_index(c, h, 1)] *= corr[h];
        }
}

// P (exponentiated S, fp32 accumulator layout) -> 16-bit A fragments, no data movement
// between threads (wgmma_sm90.cuh, "Fragments").
template <class Tr, class T>
__device__ __forceinline__ void pack_p(const float (&s)[Tr::kBlockN / 2],
                                       uint32_t (&a)[Tr::kBlockN / kMmaK][4]) {
#pragma unroll
    for (int k = 0; k < Tr::kBlockN / kMmaK; ++k)
#pragma unroll
        for (int r = 0; r < 4; ++r)
            a[k][r] = pack2<T>(s[acc_to_a_index(k, r)], s[acc_to_a_index(k, r) + 1]);
}

// One K/V tile, sequentially (stages 1-3): S is already computed; mask, softmax, rescale O,
// O += P V and wait.
template <class Tr, class T>
__device__ __forceinline__ void consume_tile(const FwdParams& p, Acc<Tr::kHeadDim>& acc,
                                             float (&s)[Tr::kBlockN / 2], const FragPos& fp,
                                             int m_first, int n_tile, uint32_t v_addr) {
    softcap_and_mask<Tr>(p, s, fp, m_first, n_tile);
    float corr[2];
    online_softmax<Tr>(acc, s, p.softmax_scale_log2, corr);
    rescale_o<Tr>(acc, corr);
    uint32_t a[Tr::kBlockN / kMmaK][4];
    pack_p<Tr, T>(s, a);
    gemm_pv<Tr, T>(acc.o, a, v_addr);
}

template <int D>
__device__ __forceinline__ void acc_init(Acc<D>& acc) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc.o[i] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        acc.row_max[h] = -INFINITY;
        acc.row_sum[h] = 0.f;
    }
}

// Normalise and write this thread's part of O (and LSE) straight from registers.
template <class Tr, class T>
__device__ __forceinline__ void write_output(const FwdParams& p, Acc<Tr::kHeadDim>& acc,
                                             const FragPos& fp, int m_first, int batch,
                                             int head) {
    const bool softcap = (p.flags & FA_FLAG_SOFTCAP) != 0;
    // Natural-log scale of the max: scores were multiplied by scale_log2 = scale * log2(e)
    // (softcap: log2(e) after the cap, i.e. natural scale 1).
    const float max_scale = softcap ? 1.f : p.softmax_scale;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = acc.row_sum[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        // No visible key: l = 0, O written as exactly 0 (not O * 0: NaN if a masked key's
        // infinite V reached O) and LSE -inf. A NaN l (a NaN score the row sees) stays NaN.
        const bool empty = l == 0.f;
        const float inv = empty ? 0.f : 1.f / l;
        const int i = m_first + fp.row0 + 8 * h;
        if (i >= p.seqlen_q) continue;
        T* orow = reinterpret_cast<T*>(p.o) + batch * p.o_batch_stride + i * p.o_row_stride +
                  head * p.o_head_stride;
#pragma unroll
        for (int c = 0; c < Tr::kHeadDim / 8; ++c) {
            const float o0 = empty ? 0.f : acc.o[acc_index(c, h, 0)] * inv;
            const float o1 = empty ? 0.f : acc.o[acc_index(c, h, 1)] * inv;
            *reinterpret_cast<uint32_t*>(orow + 8 * c + fp.col0) = pack2<T>(o0, o1);
        }
        if ((p.flags & FA_FLAG_RETURN_LSE) && fp.col0 == 0) {
            const float lse = empty ? -INFINITY : acc.row_max[h] * max_scale + logf(l);
            reinterpret_cast<float*>(p.lse)[(static_cast<int64_t>(batch) * p.heads_q + head) *
                                                p.seqlen_q +
                                            i] = lse;
        }
    }
}

// Consumer-side wait: every thread polls, then the warp reconverges before the next
// `.sync.aligned` wgmma instruction (which requires all lanes to execute it together).
__device__ __forceinline__ void consumer_wait(uint64_t* bar, uint32_t parity) {
    mbar_wait(bar, parity);
    __syncwarp();
}

using fa_cta::block_coord;
using fa_cta::BlockCoord;

// Stage 5's linear tile numbering: t = m_index * (heads_q * batch) + batch * heads_q + head,
// with m_index counting query tiles from the last one (the heaviest under a causal/window mask,
// so the first wave of CTAs takes the longest tiles).
__device__ __forceinline__ BlockCoord tile_coord(const FwdParams& p, int t, int num_m_blocks) {
    const int per_m = p.heads_q * p.batch;
    const int m_index = t / per_m, rest = t % per_m;
    BlockCoord bc;
    bc.m_block = p.window_right >= 0 ? num_m_blocks - 1 - m_index : m_index;
    bc.head = rest % p.heads_q;
    bc.kv_head = bc.head / (p.heads_q / p.heads_kv);
    bc.batch = rest / p.heads_q;
    return bc;
}

// The dynamic shared memory base: 1024-aligned (Fa3Traits::kSmemBytes includes the slack).
using fa_cta::aligned_smem;
static_assert(static_cast<int>(fa_cta::kSmemAlignBytes) == kSwizzleAtomBytes, "the base alignment is the SW128 atom");

// ---------------------------------------------------------------- stage 1: wgmma only

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

template <class T, int D>
__device__ __forceinline__ void stage1(const FwdParams& p) {
    using Tr = Fa3Traits<1, D>;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = aligned_smem(smem_raw);
    uint8_t* sq = smem + Tr::kOffQ;
    uint8_t* sk = smem + Tr::kOffK;
    uint8_t* sv = smem + Tr::kOffV;

    const int tid = threadIdx.x;
    const BlockCoord bc = block_coord(p);
    const int m0 = bc.m_block * Tr::kBlockM;
    const KvRange kv = kv_tile_range(p, m0, min(m0 + Tr::kBlockM, p.seqlen_q), Tr::kBlockN);

    const T* q = reinterpret_cast<const T*>(p.q) + bc.batch * p.q_batch_stride +
                 m0 * p.q_row_stride + bc.head * p.q_head_stride;
    const T* k = reinterpret_cast<const T*>(p.k) + bc.batch * p.k_batch_stride +
                 bc.kv_head * p.k_head_stride;
    const T* v = reinterpret_cast<const T*>(p.v) + bc.batch * p.v_batch_stride +
                 bc.kv_head * p.v_head_stride;

    load_tile_sw128<Tr::kBlockM, D>(sq, q, p.q_row_stride, p.seqlen_q - m0, tid, Tr::kThreads);

    const FragPos fp = frag_pos(tid);
    Acc<D> acc;
    acc_init(acc);
    float s[Tr::kBlockN / 2];
#pragma unroll
    for (int i = 0; i < Tr::kBlockN / 2; ++i) s[i] = 0.f;

    for (int n = kv.n_begin; n < kv.n_end; ++n) {
        __syncthreads();  // every thread's wgmmas of the previous tile have completed (wait 0)
        const int n0 = n * Tr::kBlockN;
        load_tile_sw128<Tr::kBlockN, D>(sk, k + n0 * p.k_row_stride, p.k_row_stride,
                                        p.seqlen_k - n0, tid, Tr::kThreads);
        load_tile_sw128<Tr::kBlockN, D>(sv, v + n0 * p.v_row_stride, p.v_row_stride,
                                        p.seqlen_k - n0, tid, Tr::kThreads);
        fence_proxy_async_smem();  // generic-proxy stores -> visible to wgmma (async proxy)
        __syncthreads();
        gemm_qk<Tr, T>(s, smem_u32(sq), smem_u32(sk));
        consume_tile<Tr, T>(p, acc, s, fp, m0, n, smem_u32(sv));
    }
    write_output<Tr, T>(p, acc, fp, m0, bc.batch, bc.head);
}

// ---------------------------------------------------------------- TMA issue (stages 2-5)

// Q rows [m0, m0 + kBlockM) of (head, batch): one 64-row box per slab per 64 rows. Boxes that
// start at or past seqlen_q are skipped (and not counted in expect_tx) rather than relying on
// TMA's behaviour for a box lying entirely out of bounds; their smem rows keep stale data, which
// only feeds query rows >= seqlen_q (row-wise softmax, never written back).
template <class Tr>
__device__ __forceinline__ void issue_q(const TmaDesc* tq, uint8_t* sq, uint64_t* bar, int m0,
                                        int seqlen_q, int head, int batch) {
    constexpr int kBoxes = Tr::kBlockM / Tr::kTmaBoxRowsQ;
    const int live = min(kBoxes, (seqlen_q - m0 + Tr::kTmaBoxRowsQ - 1) / Tr::kTmaBoxRowsQ);
    mbar_arrive_expect_tx(bar, live * (Tr::kTmaQBytes / kBoxes));
#pragma unroll
    for (int slab = 0; slab < Tr::kSlabs; ++slab)
#pragma unroll
        for (int rb = 0; rb < kBoxes; ++rb)
            if (rb < live)
                tma_load_4d(sq + Tr::q_box_offset(slab, rb), tq, bar, slab * kSlabCols, head,
                            m0 + rb * Tr::kTmaBoxRowsQ, batch);
}

// K and V tile n into ring slot `slot`, both counted on kv_full[slot].
template <class Tr>
__device__ __forceinline__ void issue_kv(const TmaDesc* tk, const TmaDesc* tv, uint8_t* sk,
                                         uint8_t* sv, uint64_t* bar, int slot, int n,
                                         int kv_head, int batch) {
    mbar_arrive_expect_tx(bar, Tr::kTmaKvBytes);
    uint8_t* dk = sk + slot * Tr::kKvTileBytes;
    uint8_t* dv = sv + slot * Tr::kKvTileBytes;
#pragma unroll
    for (int slab = 0; slab < Tr::kSlabs; ++slab) {
        tma_load_4d(dk + Tr::kv_box_offset(slab), tk, bar, slab * kSlabCols, kv_head,
                    n * Tr::kBlockN, batch);
        tma_load_4d(dv + Tr::kv_box_offset(slab), tv, bar, slab * kSlabCols, kv_head,
                    n * Tr::kBlockN, batch);
    }
}

// Barrier block layout: [0] q_full, [1 .. 1+S) kv_full, [1+S .. 1+2S) kv_empty.
template <class Tr>
struct Barriers {
    uint64_t* q_full;
    uint64_t* kv_full;
    uint64_t* kv_empty;
    __device__ __forceinline__ explicit Barriers(uint8_t* smem) {
        uint64_t* b = reinterpret_cast<uint64_t*>(smem + Tr::kOffBarriers);
        q_full = b;
        kv_full = b + 1;
        kv_empty = b + 1 + Tr::kKvStages;
    }
    // The name and slot of barrier number i of the block (hang-check reports).
    __device__ static const char* name(int i, int* slot) {
        constexpr int S = Tr::kKvStages;
        *slot = i == 0 ? 0 : (i - 1) % S;
        return i == 0 ? "q_full" : i <= S ? "kv_full" : i <= 2 * S ? "kv_empty" : nullptr;
    }
};

// ---------------------------------------------------------------- stage 2: + TMA, mbarriers

template <class T, int D>
__device__ __forceinline__ void stage2(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                       const TmaDesc* tv) {
    using Tr = Fa3Traits<2, D>;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = aligned_smem(smem_raw);
    uint8_t* sq = smem + Tr::kOffQ;
    uint8_t* sk = smem + Tr::kOffK;
    uint8_t* sv = smem + Tr::kOffV;
    Barriers<Tr> bars(smem);

    const int tid = threadIdx.x;
    const BlockCoord bc = block_coord(p);
    const int m0 = bc.m_block * Tr::kBlockM;
    const KvRange kv = kv_tile_range(p, m0, min(m0 + Tr::kBlockM, p.seqlen_q), Tr::kBlockN);
    const int n_tiles = kv.n_end - kv.n_begin;
    const bool issuer = tid == 0;

    if (issuer) {
        mbar_init(bars.q_full, 1);
        for (int st = 0; st < Tr::kKvStages; ++st) mbar_init(&bars.kv_full[st], 1);
        mbar_init_fence();
    }
    __syncthreads();

    if (issuer && n_tiles > 0) {
        tma_prefetch_desc(tq);
        tma_prefetch_desc(tk);
        tma_prefetch_desc(tv);
        issue_q<Tr>(tq, sq, bars.q_full, m0, p.seqlen_q, bc.head, bc.batch);
        for (int it = 0; it < min(n_tiles, Tr::kKvStages); ++it)
            issue_kv<Tr>(tk, tv, sk, sv, &bars.kv_full[it], it, kv.n_begin + it, bc.kv_head,
                         bc.batch);
    }

    const FragPos fp = frag_pos(tid);
    Acc<D> acc;
    acc_init(acc);
    float s[Tr::kBlockN / 2];
#pragma unroll
    for (int i = 0; i < Tr::kBlockN / 2; ++i) s[i] = 0.f;

    if (n_tiles > 0) consumer_wait(bars.q_full, 0);
    for (int it = 0; it < n_tiles; ++it) {
        const int slot = it % Tr::kKvStages;
        consumer_wait(&bars.kv_full[slot], (it / Tr::kKvStages) & 1);
        gemm_qk<Tr, T>(s, smem_u32(sq), smem_u32(sk + slot * Tr::kKvTileBytes));
        consume_tile<Tr, T>(p, acc, s, fp, m0, kv.n_begin + it,
                            smem_u32(sv + slot * Tr::kKvTileBytes));
        // Both wgmma groups reading this slot were waited on by every thread; after the CTA
        // barrier the slot may be refilled (async proxy writes after async proxy reads).
        __syncthreads();
        if (issuer && it + Tr::kKvStages < n_tiles)
            issue_kv<Tr>(tk, tv, sk, sv, &bars.kv_full[slot], slot,
                         kv.n_begin + it + Tr::kKvStages, bc.kv_head, bc.batch);
    }
    write_output<Tr, T>(p, acc, fp, m0, bc.batch, bc.head);
}

// ---------------------------------------------------------------- stage 3: + warp specialisation

template <class T, int D>
__device__ __forceinline__ void stage3(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                       const TmaDesc* tv) {
    using Tr = Fa3Traits<3, D>;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = aligned_smem(smem_raw);
    uint8_t* sq = smem + Tr::kOffQ;
    uint8_t* sk = smem + Tr::kOffK;
    uint8_t* sv = smem + Tr::kOffV;
    Barriers<Tr> bars(smem);

    const int tid = threadIdx.x;
    const int warpgroup = tid / kWarpgroupThreads;
    const bool is_producer = warpgroup < Tr::kProducerWarpgroups;
    const BlockCoord bc = block_coord(p);
    const int m0 = bc.m_block * Tr::kBlockM;
    const KvRange kv = kv_tile_range(p, m0, min(m0 + Tr::kBlockM, p.seqlen_q), Tr::kBlockN);
    const int n_tiles = kv.n_end - kv.n_begin;

    if (tid == 0) {
        mbar_init(bars.q_full, 1);
        for (int st = 0; st < Tr::kKvStages; ++st) {
            mbar_init(&bars.kv_full[st], 1);                        // producer's expect_tx
            mbar_init(&bars.kv_empty[st], Tr::kConsumerThreads);   // every consumer thread
        }
        mbar_init_fence();
    }
    __syncthreads();  // the last CTA-wide barrier: roles diverge below

    if (is_producer) {
        setmaxnreg_dec<Tr::kProducerRegs>();
        if (tid == 0 && n_tiles > 0) {
            tma_prefetch_desc(tq);
            tma_prefetch_desc(tk);
            tma_prefetch_desc(tv);
            issue_q<Tr>(tq, sq, bars.q_full, m0, p.seqlen_q, bc.head, bc.batch);
            for (int it = 0; it < n_tiles; ++it) {
                const int slot = it % Tr::kKvStages;
                // Use u = it / S of this slot needs use u - 1 released (its phase u - 1 done).
                if (it >= Tr::kKvStages)
                    mbar_wait(&bars.kv_empty[slot], ((it / Tr::kKvStages) - 1) & 1);
                issue_kv<Tr>(tk, tv, sk, sv, &bars.kv_full[slot], slot, kv.n_begin + it,
                             bc.kv_head, bc.batch);
            }
        }
    } else {
        setmaxnreg_inc<Tr::kConsumerRegs>();
        const int cw = warpgroup - Tr::kProducerWarpgroups;  // consumer index: query rows 64cw..
        const int m_first = m0 + cw * kMmaM;
        const uint32_t q_addr = smem_u32(sq) + Tr::q_warpgroup_offset(cw);
        const FragPos fp = frag_pos(tid % kWarpgroupThreads);
        Acc<D> acc;
        acc_init(acc);
        float s[Tr::kBlockN / 2];
#pragma unroll
        for (int i = 0; i < Tr::kBlockN / 2; ++i) s[i] = 0.f;

        if (n_tiles > 0) consumer_wait(bars.q_full, 0);
        for (int it = 0; it < n_tiles; ++it) {
            const int slot = it % Tr::kKvStages;
            consumer_wait(&bars.kv_full[slot], (it / Tr::kKvStages) & 1);
            gemm_qk<Tr, T>(s, q_addr, smem_u32(sk + slot * Tr::kKvTileBytes));
            consume_tile<Tr, T>(p, acc, s, fp, m_first, kv.n_begin + it,
                                smem_u32(sv + slot * Tr::kKvTileBytes));
            mbar_arrive(&bars.kv_empty[slot]);  // this thread's wgmma reads of the slot are done
        }
        write_output<Tr, T>(p, acc, fp, m_first, bc.batch, bc.head);
    }
}

// ---------------------------------------------------------------- stages 4-5: ping-pong, overlap,
// ---------------------------------------------------------------- persistent scheduling

// Barrier block of stages 4-5: [0] q_full, then k_full, v_full, k_empty, v_empty (one per slot),
// then q_empty (stage 5 reloads Q into the same buffer for its next tile).
template <class Tr>
struct SplitBarriers {
    uint64_t* q_full;
    uint64_t* k_full;
    uint64_t* v_full;
    uint64_t* k_empty;
    uint64_t* v_empty;
    uint64_t* q_empty;
    __device__ __forceinline__ explicit SplitBarriers(uint8_t* smem) {
        uint64_t* b = reinterpret_cast<uint64_t*>(smem + Tr::kOffBarriers);
        q_full = b;
        k_full = b + 1;
        v_full = b + 1 + Tr::kKvStages;
        k_empty = b + 1 + 2 * Tr::kKvStages;
        v_empty = b + 1 + 3 * Tr::kKvStages;
        q_empty = b + 1 + 4 * Tr::kKvStages;
    }
    // The name and slot of barrier number i of the block (hang-check reports).
    __device__ static const char* name(int i, int* slot) {
        constexpr int S = Tr::kKvStages;
        const int group = i == 0 ? -1 : (i - 1) / S;  // 0 k_full, 1 v_full, 2 k_empty, 3 v_empty, 4 q_empty
        *slot = i == 0 ? 0 : (i - 1) % S;
        const char* names[] = {"k_full", "v_full", "k_empty", "v_empty"};
        return i == 0 ? "q_full" : group < 4 ? names[group] : i == 1 + 4 * S ? "q_empty" : nullptr;
    }
    __device__ __forceinline__ void init() {  // one thread
        mbar_init(q_full, 1);
        mbar_init(q_empty, Tr::kConsumerThreads);
        for (int st = 0; st < Tr::kKvStages; ++st) {
            mbar_init(&k_full[st], 1);                       // producer's expect_tx
            mbar_init(&v_full[st], 1);
            mbar_init(&k_empty[st], Tr::kConsumerThreads);  // every consumer thread
            mbar_init(&v_empty[st], Tr::kConsumerThreads);
        }
        mbar_init_fence();
    }
};

// One K or one V tile (all slabs) into ring slot `slot`, counted on `bar`.
template <class Tr>
__device__ __forceinline__ void issue_tile(const TmaDesc* map, uint8_t* ring, uint64_t* bar,
                                           int slot, int n, int kv_head, int batch) {
    mbar_arrive_expect_tx(bar, Tr::kKvTileBytes);
    uint8_t* dst = ring + slot * Tr::kKvTileBytes;
#pragma unroll
    for (int slab = 0; slab < Tr::kSlabs; ++slab)
        tma_load_4d(dst + Tr::kv_box_offset(slab), map, bar, slab * kSlabCols, kv_head,
                    n * Tr::kBlockN, batch);
}

// Ping-pong token between the two consumer warpgroups: a warpgroup may issue its GEMMs only
// while it holds the token and passes it on right after issuing, so one warpgroup's softmax
// runs under the other's GEMMs (FA3 paper, section 3.1). Consumer 0 waits on barrier kBar0,
// completed by consumer 1's arrival, and vice versa.
// Accounting (must balance, or a barrier is left pending): consumer 1 passes once at start
// (the first token goes to consumer 0); afterwards both acquire + pass once per GEMM issue
// point, and the two consumers have the same issue points (same tiles); at the very end
// consumer 0 acquires once more to absorb consumer 1's last pass.
template <class Tr>
struct PingPong {
    static constexpr int kBar0 = Tr::kPingPongBarrier0, kBar1 = Tr::kPingPongBarrier0 + 1;
    static constexpr int kThreads = Tr::kPingPongThreads;
    bool first;  // consumer warpgroup 0 (warp-uniform, so the branches below do not diverge)
    __device__ __forceinline__ explicit PingPong(int cw) : first(cw == 0) {}
    __device__ __forceinline__ void acquire() const {
        if (first)
            named_bar_sync<kBar0, kThreads>();
        else
            named_bar_sync<kBar1, kThreads>();
    }
    __device__ __forceinline__ void pass() const {
        if (first)
            named_bar_arrive<kBar1, kThreads>();
        else
            named_bar_arrive<kBar0, kThreads>();
    }
    __device__ __forceinline__ void start() const {
        if (!first) pass();
    }
    __device__ __forceinline__ void finish() const {
        if (first) acquire();
    }
};

// Ring positions carried across the tiles of one CTA (stage 5 runs several tiles per CTA).
// kv_it counts K/V tiles, q_use counts Q loads (tiles with at least one K/V tile); producer and
// consumers advance them identically, so their parities agree.
struct RingPos {
    int kv_it = 0;
    int q_use = 0;
};

// One query tile of one (head, batch) seen by the producer thread: Q (after the previous Q was
// released), then K_j and V_j for every visible K/V tile j.
template <class Tr>
__device__ __forceinline__ void produce_tile(int seqlen_q, const TmaDesc* tq, const TmaDesc* tk,
                                             const TmaDesc* tv, uint8_t* sq, uint8_t* sk,
                                             uint8_t* sv, SplitBarriers<Tr>& bars,
                                             const BlockCoord& bc, const KvRange& kv,
                                             RingPos& pos) {
    constexpr int S = Tr::kKvStages;
    const int n_tiles = kv.n_end - kv.n_begin;
    if (n_tiles <= 0) return;
    if (pos.q_use > 0) mbar_wait(bars.q_empty, (pos.q_use - 1) & 1);
    issue_q<Tr>(tq, sq, bars.q_full, bc.m_block * Tr::kBlockM, seqlen_q, bc.head, bc.batch);
    ++pos.q_use;
    for (int j = 0; j < n_tiles; ++j, ++pos.kv_it) {
        const int slot = pos.kv_it % S;
        const uint32_t prev_use_parity = ((pos.kv_it / S) - 1) & 1;  // use kv_it/S - 1 released
        if (pos.kv_it >= S) mbar_wait(&bars.k_empty[slot], prev_use_parity);
        issue_tile<Tr>(tk, sk, &bars.k_full[slot], slot, kv.n_begin + j, bc.kv_head, bc.batch);
        if (pos.kv_it >= S) mbar_wait(&bars.v_empty[slot], prev_use_parity);
        issue_tile<Tr>(tv, sv, &bars.v_full[slot], slot, kv.n_begin + j, bc.kv_head, bc.batch);
    }
}

#if defined(FA_HANG_CHECK)
// Hang-check builds only: the producer thread stays until the consumers have released the last Q
// buffer and K/V slots it filled. A consumer stuck in a named barrier (bar.sync cannot time out)
// then makes this wait time out, and its report prints the CTA's wait board.
template <class Tr>
__device__ __forceinline__ void watch_release(SplitBarriers<Tr>& bars, const RingPos& pos) {
    constexpr int S = Tr::kKvStages;
    for (int it = max(0, pos.kv_it - S); it < pos.kv_it; ++it) {  // the last use of each slot
        mbar_wait(&bars.k_empty[it % S], (it / S) & 1);
        mbar_wait(&bars.v_empty[it % S], (it / S) & 1);
    }
    if (pos.q_use > 0) mbar_wait(bars.q_empty, (pos.q_use - 1) & 1);
}
#endif

// One query tile seen by consumer warpgroup cw (its 64 rows): the overlapped mainloop
//   S_0; softmax_0 | for j >= 1: {S_j, PV_j-1} issued, wait S_j, softmax_j under PV_j-1,
//   wait PV, rescale O | PV_last
// then the epilogue. Releases K_j as soon as S_j retires, V_j after PV_j, Q after the last S.
template <class Tr, class T>
__device__ __forceinline__ void consume_tile_overlapped(const FwdParams& p, uint8_t* sq,
                                                        uint8_t* sk, uint8_t* sv,
                                                        SplitBarriers<Tr>& bars,
                                                        const BlockCoord& bc, const KvRange& kv,
                                                        RingPos& pos, int cw,
                                                        const PingPong<Tr>& turn) {
    constexpr int S = Tr::kKvStages;
    const int n_tiles = kv.n_end - kv.n_begin;
    const int m_first = bc.m_block * Tr::kBlockM + cw * kMmaM;
    const FragPos fp = frag_pos(threadIdx.x % kWarpgroupThreads);
    Acc<Tr::kHeadDim> acc;
    acc_init(acc);
    if (n_tiles > 0) {
        const uint32_t q_addr = smem_u32(sq) + Tr::q_warpgroup_offset(cw);
        const float scale_log2 = p.softmax_scale_log2;
        const int it0 = pos.kv_it;  // ring position of K/V tile 0 of this query tile
        auto k_addr = [&](int j) { return smem_u32(sk + ((it0 + j) % S) * Tr::kKvTileBytes); };
        auto v_addr = [&](int j) { return smem_u32(sv + ((it0 + j) % S) * Tr::kKvTileBytes); };
        auto slot = [&](int j) { return (it0 + j) % S; };
        auto full_parity = [&](int j) { return static_cast<uint32_t>(((it0 + j) / S) & 1); };
        float s[Tr::kBlockN / 2];
        uint32_t a[Tr::kBlockN / kMmaK][4];  // P of the tile whose PV is issued next
        float corr[2];

        consumer_wait(bars.q_full, pos.q_use & 1);

        // Prologue: S_0, its softmax, P_0.
        consumer_wait(&bars.k_full[slot(0)], full_parity(0));
        turn.acquire();
        issue_qk<Tr, T>(s, q_addr, k_addr(0));
        turn.pass();
        wgmma_wait<0>();
        fence_regs(s);
        mbar_arrive(&bars.k_empty[slot(0)]);
        if (n_tiles == 1) mbar_arrive(bars.q_empty);  // last read of Q has retired
        softcap_and_mask<Tr>(p, s, fp, m_first, kv.n_begin);
        online_softmax<Tr>(acc, s, scale_log2, corr);  // O is still 0: no rescale needed
        pack_p<Tr, T>(s, a);

        for (int j = 1; j < n_tiles; ++j) {
            consumer_wait(&bars.k_full[slot(j)], full_parity(j));
            consumer_wait(&bars.v_full[slot(j - 1)], full_parity(j - 1));
            turn.acquire();
            issue_qk<Tr, T>(s, q_addr, k_addr(j));      // group 1: S_j
            issue_pv<Tr, T>(acc.o, a, v_addr(j - 1));    // group 2: O += P_j-1 V_j-1
            turn.pass();
            wgmma_wait<1>();  // groups retire in order: S_j is ready, PV may still run
            fence_regs(s);
            mbar_arrive(&bars.k_empty[slot(j)]);
            if (j == n_tiles - 1) mbar_arrive(bars.q_empty);
            softcap_and_mask<Tr>(p, s, fp, m_first, kv.n_begin + j);
            online_softmax<Tr>(acc, s, scale_log2, corr);  // overlaps PV_j-1; O untouched
            wgmma_wait<0>();
            fence_regs(acc.o);
            mbar_arrive(&bars.v_empty[slot(j - 1)]);
            rescale_o<Tr>(acc, corr);  // O now refers to the new row max
            pack_p<Tr, T>(s, a);       // a is free: PV_j-1 has retired
        }

        // Epilogue: PV of the last tile.
        const int last = n_tiles - 1;
        consumer_wait(&bars.v_full[slot(last)], full_parity(last));
        turn.acquire();
        issue_pv<Tr, T>(acc.o, a, v_addr(last));
        turn.pass();
        wgmma_wait<0>();
        fence_regs(acc.o);
        mbar_arrive(&bars.v_empty[slot(last)]);

        pos.kv_it += n_tiles;
        ++pos.q_use;
    }
    write_output<Tr, T>(p, acc, fp, m_first, bc.batch, bc.head);
}

// Stage 4: one query tile per CTA (grid as in stages 1-3), overlapped ping-pong mainloop.
// Stage 5: persistent: gridDim.x CTAs (ideally the SM count) walk the tiles t = blockIdx.x,
// blockIdx.x + gridDim.x, ...; tiles are numbered heaviest first under a causal/window mask.
template <int Stage, class T, int D>
__device__ __forceinline__ void stage45(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                        const TmaDesc* tv) {
    using Tr = Fa3Traits<Stage, D>;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = aligned_smem(smem_raw);
    uint8_t* sq = smem + Tr::kOffQ;
    uint8_t* sk = smem + Tr::kOffK;
    uint8_t* sv = smem + Tr::kOffV;
    SplitBarriers<Tr> bars(smem);

    const int tid = threadIdx.x;
    const int warpgroup = tid / kWarpgroupThreads;
    const bool is_producer = warpgroup < Tr::kProducerWarpgroups;
    // Tile walk: stage 4 has exactly one tile (from blockIdx), stage 5 strides over all of them.
    const int num_m_blocks = (p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
    const int num_tiles = Stage >= 5 ? num_m_blocks * p.heads_q * p.batch : 1;
    const int tile_begin = Stage >= 5 ? static_cast<int>(blockIdx.x) : 0;
    const int tile_step = Stage >= 5 ? static_cast<int>(gridDim.x) : 1;
    auto coord = [&](int t) {
        if (Stage < 5) return block_coord(p);
        return tile_coord(p, t, num_m_blocks);
    };
    auto range = [&](const BlockCoord& bc) {
        const int m0 = bc.m_block * Tr::kBlockM;
        return kv_tile_range(p, m0, min(m0 + Tr::kBlockM, p.seqlen_q), Tr::kBlockN);
    };

    if (tid == 0) bars.init();
    __syncthreads();  // the last CTA-wide barrier: roles diverge below

    RingPos pos;
    if (is_producer) {
        setmaxnreg_dec<Tr::kProducerRegs>();
        if (tid == 0) {
            tma_prefetch_desc(tq);
            tma_prefetch_desc(tk);
            tma_prefetch_desc(tv);
            for (int t = tile_begin; t < num_tiles; t += tile_step) {
                const BlockCoord bc = coord(t);
                produce_tile<Tr>(p.seqlen_q, tq, tk, tv, sq, sk, sv, bars, bc, range(bc), pos);
            }
#if defined(FA_HANG_CHECK)
            watch_release<Tr>(bars, pos);
#endif
        }
        return;
    }
    setmaxnreg_inc<Tr::kConsumerRegs>();
    const int cw = warpgroup - Tr::kProducerWarpgroups;
    const PingPong<Tr> turn(cw);
    turn.start();
    for (int t = tile_begin; t < num_tiles; t += tile_step) {
        const BlockCoord bc = coord(t);
        consume_tile_overlapped<Tr, T>(p, sq, sk, sv, bars, bc, range(bc), pos, cw, turn);
    }
    turn.finish();
}

#else  // not sm_90a: the instances exist (so every target links) but do nothing.

template <class T, int D>
__device__ __forceinline__ void stage1(const FwdParams&) {}
template <class T, int D>
__device__ __forceinline__ void stage2(const FwdParams&, const TmaDesc*, const TmaDesc*,
                                       const TmaDesc*) {}
template <class T, int D>
__device__ __forceinline__ void stage3(const FwdParams&, const TmaDesc*, const TmaDesc*,
                                       const TmaDesc*) {}
template <int Stage, class T, int D>
__device__ __forceinline__ void stage45(const FwdParams&, const TmaDesc*, const TmaDesc*,
                                        const TmaDesc*) {}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

// ---------------------------------------------------------------- instances
// Symbol: fa3s<stage>_fwd_hd<D>_<dtype> (the table's `<family>_fwd_hd<D>_<dtype>` convention,
// build/instances.rs: one family row per stage, "fa3s1".."fa3s5"). Stage 1 takes only the
// params; stages 2-5 also take the tensor maps of Q, K, V (docs/fa3.md). __launch_bounds__ pins
// the thread count each stage is written for.
//
// Two ways to build this file:
//   * build.rs (the crate): one unit per (stage, head dim); it defines FA_FAMILY (fa3s<N>),
//     FA_HEAD_DIM, FA_BLOCK_M, FA_BLOCK_N, FA_THREADS and FA_SMEM_BYTES from the table, which
//     the static_asserts below check against Fa3Traits, then writes FA_INSTANCE(f16) and
//     FA_INSTANCE(bf16).
//   * standalone (scripts/check-fa3.sh): every stage of one head dim per job with
//     -DFA3_ONLY_HDIM=<D> (or all 30 kernels without it).

#define FA3_S1(DT, T, D)                                                                   \
    extern "C" __global__ void __launch_bounds__(fa3::Fa3Traits<1, D>::kThreads, 1)        \
        fa3s1_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p) {                      \
        fa3::stage1<T, D>(p);                                                              \
    }
#define FA3_S2(DT, T, D)                                                                   \
    extern "C" __global__ void __launch_bounds__(fa3::Fa3Traits<2, D>::kThreads, 1)        \
        fa3s2_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p,                        \
                               const __grid_constant__ fa3::TmaDesc tmap_q,                \
                               const __grid_constant__ fa3::TmaDesc tmap_k,                \
                               const __grid_constant__ fa3::TmaDesc tmap_v) {              \
        fa3::stage2<T, D>(p, &tmap_q, &tmap_k, &tmap_v);                                   \
    }
#define FA3_S3(DT, T, D)                                                                   \
    extern "C" __global__ void __launch_bounds__(fa3::Fa3Traits<3, D>::kThreads, 1)        \
        fa3s3_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p,                        \
                               const __grid_constant__ fa3::TmaDesc tmap_q,                \
                               const __grid_constant__ fa3::TmaDesc tmap_k,                \
                               const __grid_constant__ fa3::TmaDesc tmap_v) {              \
        fa3::stage3<T, D>(p, &tmap_q, &tmap_k, &tmap_v);                                   \
    }
#define FA3_S45(S, DT, T, D)                                                               \
    extern "C" __global__ void __launch_bounds__(fa3::Fa3Traits<S, D>::kThreads, 1)        \
        fa3s##S##_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p,                    \
                                   const __grid_constant__ fa3::TmaDesc tmap_q,            \
                                   const __grid_constant__ fa3::TmaDesc tmap_k,            \
                                   const __grid_constant__ fa3::TmaDesc tmap_v) {          \
        fa3::stage45<S, T, D>(p, &tmap_q, &tmap_k, &tmap_v);                               \
    }
#define FA3_S4(DT, T, D) FA3_S45(4, DT, T, D)
#define FA3_S5(DT, T, D) FA3_S45(5, DT, T, D)
#define FA3_TYPE_bf16 __nv_bfloat16
#define FA3_TYPE_f16 __half

#if defined(FA_HANG_CHECK)
// The hang-check name hook declared at the top: barrier block index -> name. Only a build.rs unit
// knows its one (stage, head dim); the standalone all-stages build reports offsets only.
#if defined(FA_FAMILY) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FA3_HANG_NAMES 1
#endif
#endif

#if defined(FA_FAMILY)
// The stage of the family row this unit was generated for (FA_FAMILY is a bare token).
#define FA3_STAGE_OF_fa3s1 1
#define FA3_STAGE_OF_fa3s2 2
#define FA3_STAGE_OF_fa3s3 3
#define FA3_STAGE_OF_fa3s4 4
#define FA3_STAGE_OF_fa3s5 5
#define FA3_CAT_(a, b) a##b
#define FA3_CAT(a, b) FA3_CAT_(a, b)
#define FA3_STAGE FA3_CAT(FA3_STAGE_OF_, FA_FAMILY)
// The table (build/instances.rs) and the traits must agree on the launch shape.
static_assert(FA_THREADS == fa3::Fa3Traits<FA3_STAGE, FA_HEAD_DIM>::kThreads, "table: threads");
static_assert(FA_BLOCK_M == fa3::Fa3Traits<FA3_STAGE, FA_HEAD_DIM>::kBlockM, "table: block_m");
static_assert(FA_BLOCK_N == fa3::Fa3Traits<FA3_STAGE, FA_HEAD_DIM>::kBlockN, "table: block_n");
static_assert(FA_SMEM_BYTES == fa3::Fa3Traits<FA3_STAGE, FA_HEAD_DIM>::kSmemBytes,
              "table: dynamic shared memory (fa3_smem_bytes in build/instances.rs)");
// Two expansion levels so FA3_STAGE and FA_HEAD_DIM become literals before pasting.
#define FA3_INSTANCE_(S, DT, D) FA3_S##S(DT, FA3_TYPE_##DT, D)
#define FA3_INSTANCE(S, DT, D) FA3_INSTANCE_(S, DT, D)
#define FA_INSTANCE(DT) FA3_INSTANCE(FA3_STAGE, DT, FA_HEAD_DIM)
#if defined(FA3_HANG_NAMES)
__device__ const char* fa3::hang_barrier_name(unsigned int offset, int* slot) {
    using Tr = fa3::Fa3Traits<FA3_STAGE, FA_HEAD_DIM>;
    *slot = -1;
    if (Tr::kStage == 1 || offset < Tr::kOffBarriers || offset >= Tr::kSmemUsed || offset % 8) return nullptr;
    const int i = static_cast<int>(offset - Tr::kOffBarriers) / 8;
    return Tr::kSplitKv ? fa3::SplitBarriers<Tr>::name(i, slot) : fa3::Barriers<Tr>::name(i, slot);
}
#endif
#else
#define FA3_ALL_STAGES(D)              \
    FA3_S1(bf16, __nv_bfloat16, D)     \
    FA3_S1(f16, __half, D)             \
    FA3_S2(bf16, __nv_bfloat16, D)     \
    FA3_S2(f16, __half, D)             \
    FA3_S3(bf16, __nv_bfloat16, D)     \
    FA3_S3(f16, __half, D)             \
    FA3_S4(bf16, __nv_bfloat16, D)     \
    FA3_S4(f16, __half, D)             \
    FA3_S5(bf16, __nv_bfloat16, D)     \
    FA3_S5(f16, __half, D)

#if !defined(FA3_ONLY_HDIM) || FA3_ONLY_HDIM == 64
FA3_ALL_STAGES(64)
#endif
#if !defined(FA3_ONLY_HDIM) || FA3_ONLY_HDIM == 128
FA3_ALL_STAGES(128)
#endif
#if !defined(FA3_ONLY_HDIM) || FA3_ONLY_HDIM == 256
FA3_ALL_STAGES(256)
#endif
#endif  // FA_FAMILY

#if defined(FA_HANG_CHECK) && !defined(FA3_HANG_NAMES)
__device__ const char* fa3::hang_barrier_name(unsigned int, int* slot) {
    *slot = -1;
    return nullptr;
}
#endif

// FA4-style forward attention for Blackwell (sm_100a), bf16/f16, on the 5th-generation tensor
// cores (tcgen05) with the accumulators in tensor memory (TMEM). Built as a ladder of stages,
// each a complete kernel (docs/fa4.md has the status, launch shape and what ran where):
//   stage 1  tcgen05.mma with S = Q K^T and O = P V accumulated in TMEM (tcgen05.alloc /
//            relinquish / dealloc, tcgen05.ld / st), Q/K/V by TMA into 128B-swizzled shared
//            memory, one CTA of one warpgroup: thread 0 issues TMA and MMAs, each MMA batch is
//            tcgen05.commit-ed to an mbarrier every thread waits on; each thread owns one query
//            row (TMEM lane), so the softmax needs no shuffles. P goes through shared memory.
//   stage 2  + FA4's warp roles: a load warp (TMA, 2-slot K/V ring), an MMA warp (S_{j+1} into
//            the second TMEM S buffer while tile j's softmax runs), two softmax warpgroups (64
//            keys each, the row max shared through smem + a named barrier), a correction
//            warpgroup (O rescale in TMEM, epilogue); P is written over S in TMEM and the PV MMA
//            reads A from tensor memory.
//   stage 3  + two Q tiles (256 rows) in ping-pong, one per softmax warpgroup, and FA4's softmax:
//            software exp2 (common/exp2_poly.cuh) for 1 element in 8, conditional rescaling with
//            tau = 8 (common/softmax.cuh); the correction warpgroup rescales only when a row of
//            the warp needs it.
// Layouts (smem tiles, descriptors, TMEM) are derived in sm100/tcgen05.cuh.
//
// Semantics (same as every backend): s = scale * q.k, optional softcap, bottom-right aligned
// causal/sliding window, GQA, LSE (natural log) on request, rows with no visible key give O = 0
// and LSE -inf. No ALiBi (the host refuses it). Seqlens need not be multiples of the tile: TMA
// zero-fills rows past the end and those keys are masked.
// Host requirements (src/cuda/fa4.rs): head_dim == the instance's D; q/k/v/o strides multiples
// of 8 elements, 16-byte aligned base addresses (TMA, 16-byte stores of O).
#include <climits>

#include "common/cta.cuh"
#include "common/dtype.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/softmax.cuh"
#include "sm100/tcgen05.cuh"
#include "sm80/fast_math.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"

namespace fa4 {

using fa3::TmaDesc;

// Shape, roles and shared/tensor-memory plan of stage `Stage` at head dim `HeadDim`; the table
// row of build/instances.rs (fa4_tile, fa4_smem_bytes) repeats these numbers and the unit
// static_asserts the two agree.
template <int Stage, int HeadDim>
struct Fa4Traits {
    static_assert(Stage >= 1 && Stage <= 3, "stages 1, 2 and 3 are implemented");
    static_assert(HeadDim == 64 || HeadDim == 128, "head_dim 64 or 128");
    static constexpr int kHeadDim = HeadDim;
    static constexpr int kSlabs = HeadDim / kSlabCols;
    // Stage 1: one warpgroup, a thread per TMEM lane = query row. Stage 2 (FA4's roles):
    // warpgroups 0-1 softmax (each on 64 of the 128 keys of every row), warpgroup 2 correction
    // (O rescale, epilogue), warp 12 loads (TMA), warp 13 issues the MMAs, warp 14 owns the TMEM
    // allocation, warp 15 idles.
    static constexpr int kThreads = Stage == 1 ? 128 : 512;
    // Stage 3: two Q tiles of 128 rows (ping-pong), one per softmax warpgroup.
    static constexpr int kQTiles = Stage >= 3 ? 2 : 1;
    static constexpr int kBlockM = kUmmaM * kQTiles;
    static constexpr int kBlockN = 128;
    static constexpr int kSoftmaxWarpgroups = Stage == 1 ? 1 : 2;
    static constexpr int kKeysPerSoftmaxWg = Stage == 2 ? kBlockN / 2 : kBlockN;
    static constexpr int kCorrectionWarp0 = 8;
    static constexpr int kLoadWarp = 12;
    static constexpr int kMmaWarp = 13;
    static constexpr int kAllocWarp = Stage == 1 ? 0 : 14;

    // Shared memory (bytes; every tile a whole number of 1024-byte swizzle atoms).
    static constexpr int kElemBytes = 2;
    static constexpr int kKvStages = Stage == 1 ? 1 : 2;
    static constexpr int kQTileBytes = kUmmaM * HeadDim * kElemBytes;  // one 128-row Q tile
    static constexpr int kQBytes = kBlockM * HeadDim * kElemBytes;
    static constexpr int kKvTileBytes = kBlockN * HeadDim * kElemBytes;
    static constexpr int kPBytes = Stage == 1 ? kBlockM * kBlockN * kElemBytes : 0;  // stage 2: P in TMEM
    static constexpr int kQSlabStride = kUmmaM * kSwizzleBytes;  // within one 128-row Q tile
    static constexpr int kKvSlabStride = kBlockN * kSwizzleBytes;
    static constexpr int kPSlabStride = kBlockM * kSwizzleBytes;
    static constexpr int kOffQ = 0;
    static constexpr int kOffK = kOffQ + kQBytes;
    static constexpr int kOffV = kOffK + kKvStages * kKvTileBytes;
    static constexpr int kOffP = kOffV + kKvStages * kKvTileBytes;
    static constexpr int kOffBarriers = kOffP + kPBytes;
    // Stage 1: q_full, kv_full, s_full (S = Q K^T done), o_full (O += P V done). S and O get
    // separate barriers: with one, the issuer's next S commit could complete the phase after the
    // one a slow thread still waits for (same parity), and that thread would wait a phase late.
    // Stage 2: q_full, kv_full[2], kv_empty[2], s_full[2], p_full[2], corr_full[2], o_ready,
    // o_done, stats_full (Barriers2 below).
    // Stage 3: q_full, kv_full[2], kv_empty[2], then per Q tile t: s_full[t], p_full[t],
    // corr_full[t], o_ready[t], o_done[t], and stats_full (Barriers3 below).
    static constexpr int kNumBarriers = Stage == 1 ? 4 : Stage == 2 ? 14 : 16;
    static constexpr int kOffTmemSlot = kOffBarriers + 8 * kNumBarriers;
    // Stage 2 exchange buffers (f32, one per row): partial row max [2 tiles][2 wgs], the
    // correction factor [2 tiles], partial row sums [2 wgs], the final max.
    // Stage 3: the factors [Q tile][row], partial sums and maxima [Q tile][row].
    static constexpr int kOffRed = kOffTmemSlot + 8;
    static constexpr int kOffCorr = kOffRed + (Stage == 2 ? 4 * kUmmaM * 4 : 0);
    static constexpr int kOffLsum = kOffCorr + (Stage == 1 ? 0 : 2 * kUmmaM * 4);
    static constexpr int kOffMax = kOffLsum + (Stage == 1 ? 0 : 2 * kUmmaM * 4);
    static constexpr int kSmemUsed = kOffMax + (Stage == 1 ? 0 : Stage == 2 ? kUmmaM * 4 : 2 * kUmmaM * 4);
    static constexpr int kSmemBytes = kSmemUsed + kSwizzleAtomBytes;  // alignment slack

    // Tensor memory. Stage 1: S in columns [0, kBlockN), O in [kBlockN, kBlockN + D). Stage 2:
    // two S buffers (S_j in buffer j % 2, P_j written over it as packed 16-bit pairs) and O.
    // Stage 3: S_t (P_t over it) for Q tile t in columns [128 t, 128 t + 128), O_t at
    // 256 + D t.
    static constexpr int kSBuffers = Stage == 1 ? 1 : 2;
    static constexpr int kTmemS = 0;
    static constexpr int kTmemO = kSBuffers * kBlockN;
    static constexpr int kTmemCols = kTmemO + kQTiles * HeadDim <= 256 ? 256 : 512;

    // Stage 3 softmax (FlashAttention-4, docs/fa4.md), with its table row's parameters
    // (build/instances.rs FA4_SOFTMAX, passed as FA_EXP2_POLY_DEGREE, FA_EXP2_POLY_EVERY,
    // FA_LAZY_TAU): elements with index % kPolyEvery == kPolyEvery - 1 take the software exp2 of
    // common/exp2_poly.cuh (degree kPolyDegree) on the FMA units, the rest MUFU; the running max is kept
    // unless it grew by more than kLazyTau (log2 units). Stages 1-2 use neither.
#if defined(FA_EXP2_POLY_EVERY) && defined(FA_EXP2_POLY_DEGREE) && defined(FA_LAZY_TAU)
    static constexpr int kPolyEvery = Stage >= 3 ? FA_EXP2_POLY_EVERY : 0;
    static constexpr int kPolyDegree = Stage >= 3 ? FA_EXP2_POLY_DEGREE : 0;
    static constexpr float kLazyTau = Stage >= 3 ? FA_LAZY_TAU : -1.0f;
#else
    static constexpr int kPolyEvery = 0;
    static constexpr int kPolyDegree = 0;
    static constexpr float kLazyTau = -1.0f;
#endif
    static_assert(Stage < 3 || (kPolyEvery >= 1 && kPolyDegree >= 2 && kLazyTau >= 0.0f),
                  "stage 3 runs FA4's softmax: its table row passes the parameters");

    // TMA: boxes of {64 columns, 1 head, rows, 1 batch}; one box per slab per tile.
    static constexpr int kTmaBoxRows = 128;
    static constexpr int kTmaQBytes = kQBytes;
    static constexpr int kTmaKvBytes = 2 * kKvTileBytes;

    static_assert(kUmmaM == kTmaBoxRows && kBlockN == kTmaBoxRows, "one TMA box per slab and Q tile");
    static_assert(kSmemBytes <= 227 * 1024, "sm_100 opt-in shared memory is 227 KiB per block");
    static_assert(kTmemO + kQTiles * HeadDim <= kTmemColumns, "S and O fit the tensor memory");
};

#if defined(__CUDA_ARCH_FEAT_SM100_ALL)

using fa3::mbar_arrive;
using fa3::mbar_arrive_expect_tx;
using fa3::mbar_init;
using fa3::mbar_init_fence;
using fa3::mbar_wait;
using fa3::smem_u32;
using fa3::tma_load_4d;
using fa3::tma_prefetch_desc;

using fa_cta::aligned_smem;  // 1024-aligned dynamic shared memory base (kSmemBytes has the slack)
using fa_cta::block_coord;
using fa_cta::BlockCoord;
static_assert(static_cast<int>(fa_cta::kSmemAlignBytes) == kSwizzleAtomBytes, "the base alignment is the SW128 atom");

// Byte offset of (row, col) in a [rows x cols] tile of SW128 slabs (sm100/tcgen05.cuh).
__device__ __forceinline__ int sw128_offset(int row, int col, int rows) {
    return (col / kSlabCols) * rows * kSwizzleBytes + row * kSwizzleBytes +
           ((((col % kSlabCols) / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
}

// A thread's row of S as a fragment of the shared online softmax (common/softmax.cuh): one TMEM
// lane = one query row per thread, N consecutive keys of it in registers at a time, no lanes to
// reduce over. O stays in tensor memory (rescale_o), so the softmax never touches it.
template <int N>
struct RowFrag {
    static constexpr int kRows = 1, kSCols = N, kOCols = 0, kLanes = 1;
    __device__ __forceinline__ static float& s(float (&a)[N], int, int j) { return a[j]; }
    __device__ __forceinline__ int row(int) const { return 0; }
    __device__ __forceinline__ int col(int j) const { return j; }
};

// The online-softmax state of a thread's row, N keys at a time, with stage Tr's exponent policy
// (Fa4Traits: kPolyEvery, kPolyDegree, kLazyTau; stages 1-2 eager MUFU).
template <class Tr, int N>
using RowSoftmax = FaOnlineSoftmax<RowFrag<N>, Tr>;

// ---- The two GEMMs (one thread issues; completion through umma_commit).

// S[128 x BN] = Q[128 x D] K[BN x D]^T into TMEM columns kTmemS..
template <class Tr, class T>
__device__ __forceinline__ void issue_qk(uint32_t tmem, uint32_t q_addr, uint32_t k_addr) {
    constexpr uint32_t idesc =
        umma_idesc_f16(std::is_same<T, __nv_bfloat16>::value, kUmmaM, Tr::kBlockN, false, false);
#pragma unroll
    for (int kk = 0; kk < Tr::kHeadDim / kUmmaK; ++kk) {
        const int off = (kk / 4) * Tr::kQSlabStride + (kk % 4) * kUmmaKBytes;
        const int koff = (kk / 4) * Tr::kKvSlabStride + (kk % 4) * kUmmaKBytes;
        umma_f16_ss(tmem_addr(tmem, 0, Tr::kTmemS), umma_desc_kmajor_sw128(q_addr + off),
                    umma_desc_kmajor_sw128(k_addr + koff), idesc, kk > 0 ? 1u : 0u);
    }
}

// O[128 x D] (+)= P[128 x BN] V[BN x D] into TMEM columns kTmemO..; P from shared memory
// (K-major), V MN-major. `accumulate` = 0 on the first tile (O is not initialised).
template <class Tr, class T>
__device__ __forceinline__ void issue_pv(uint32_t tmem, uint32_t p_addr, uint32_t v_addr, bool accumulate) {
    constexpr uint32_t idesc =
        umma_idesc_f16(std::is_same<T, __nv_bfloat16>::value, kUmmaM, Tr::kHeadDim, false, true);
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / kUmmaK; ++kk) {
        const int poff = (kk / 4) * Tr::kPSlabStride + (kk % 4) * kUmmaKBytes;
        const int voff = kk * kUmmaK * kSwizzleBytes;  // 16 keys = 16 rows of 128 B
        umma_f16_ss(tmem_addr(tmem, 0, Tr::kTmemO), umma_desc_kmajor_sw128(p_addr + poff),
                    umma_desc_mnmajor_sw128(v_addr + voff, Tr::kKvSlabStride), idesc,
                    (accumulate || kk > 0) ? 1u : 0u);
    }
}

// ---- Softmax verbs (names mirror src/cpu/softmax.rs), on this thread's row of S.

// Loads `N` consecutive f32 columns of this thread's TMEM lane starting at `col`.
template <int N>
__device__ __forceinline__ void tmem_load_row(uint32_t tmem, int warp, int col, float (&x)[N]) {
#pragma unroll
    for (int c = 0; c < N / 32; ++c) {
        uint32_t r[32];
        tmem_ld_32x32b_x32(tmem_addr(tmem, 32 * (warp % 4), col + 32 * c), r);
        tmem_wait_ld(r);
#pragma unroll
        for (int j = 0; j < 32; ++j) x[32 * c + j] = __uint_as_float(r[j]);
    }
}

// Optional softcap (natural units; the shared score transform, no ALiBi: the host refuses it),
// then -inf for keys outside [lo, hi) (past seqlen_k or outside the window; mask.cuh).
template <int BN>
__device__ __forceinline__ void softcap_and_mask(const FwdParams& p, float (&s)[BN], int row, int n0) {
    if (fa_natural_scores(p)) fa_scores_to_natural<false, true>(s, RowFrag<BN>{}, p, 0.f, row, n0);
    const int lo = fa_key_lo(p, row), hi = fa_key_hi(p, row);
#pragma unroll
    for (int j = 0; j < BN; ++j)
        if (n0 + j < lo || n0 + j >= hi) s[j] = -INFINITY;
}

// P (this thread's row) -> 16-bit, into the K-major SW128 P tile (16-byte chunks).
template <class Tr, class T>
__device__ __forceinline__ void store_p(uint8_t* sp, const float (&s)[Tr::kBlockN], int row) {
#pragma unroll
    for (int c = 0; c < Tr::kBlockN / 8; ++c) {
        const uint4 v = make_uint4(fa_pack2<T>(s[8 * c], s[8 * c + 1]), fa_pack2<T>(s[8 * c + 2], s[8 * c + 3]),
                                   fa_pack2<T>(s[8 * c + 4], s[8 * c + 5]),
                                   fa_pack2<T>(s[8 * c + 6], s[8 * c + 7]));
        *reinterpret_cast<uint4*>(sp + sw128_offset(row, 8 * c, Tr::kBlockM)) = v;
    }
}

// O_t (this thread's TMEM row of Q tile t's output) *= corr, 32 columns at a time.
template <class Tr>
__device__ __forceinline__ void rescale_o(uint32_t tmem, int warp, float corr, int t = 0) {
#pragma unroll
    for (int c = 0; c < Tr::kHeadDim / 32; ++c) {
        const uint32_t a = tmem_addr(tmem, 32 * (warp % 4), Tr::kTmemO + t * Tr::kHeadDim + 32 * c);
        uint32_t r[32];
        tmem_ld_32x32b_x32(a, r);
        tmem_wait_ld(r);
#pragma unroll
        for (int j = 0; j < 32; ++j) r[j] = __float_as_uint(__uint_as_float(r[j]) * corr);
        tmem_st_32x32b_x32(a, r);
    }
    tmem_wait_st();
}

// Normalise and write this thread's row of O (and LSE) from TMEM; rows with no visible key
// get O = 0 (not O * 0: NaN if a masked key's infinite V reached O) and LSE -inf. Every thread
// of the warp loads (tcgen05.ld is .sync.aligned); only rows below seqlen_q are stored.
// `end`: the row's fa_softmax_finalize.
template <class Tr, class T>
__device__ __forceinline__ void write_output(const FwdParams& p, const FaRowEnd& end, uint32_t tmem, int warp,
                                             int row, int batch, int head, bool have_o) {
    const bool live = row < p.seqlen_q;
    const bool empty = end.empty || !have_o;
    const float inv = empty ? 0.f : end.inv_l;
#pragma unroll
    for (int c = 0; c < Tr::kHeadDim / 32; ++c) {
        float o[32];
#pragma unroll
        for (int j = 0; j < 32; ++j) o[j] = 0.f;
        if (have_o) {
            float x[32];
            tmem_load_row<32>(tmem, warp, Tr::kTmemO + 32 * c, x);
#pragma unroll
            for (int j = 0; j < 32; ++j) o[j] = empty ? 0.f : x[j] * inv;
        }
        if (!live) continue;
        T* orow = reinterpret_cast<T*>(p.o) + batch * p.o_batch_stride + row * p.o_row_stride + head * p.o_head_stride;
#pragma unroll
        for (int q = 0; q < 4; ++q)
            *reinterpret_cast<uint4*>(orow + 32 * c + 8 * q) =
                make_uint4(fa_pack2<T>(o[8 * q], o[8 * q + 1]), fa_pack2<T>(o[8 * q + 2], o[8 * q + 3]),
                           fa_pack2<T>(o[8 * q + 4], o[8 * q + 5]), fa_pack2<T>(o[8 * q + 6], o[8 * q + 7]));
    }
    if (live && (p.flags & FA_FLAG_RETURN_LSE)) {
        const float lse = empty ? -INFINITY : end.lse;
        reinterpret_cast<float*>(p.lse)[(static_cast<int64_t>(batch) * p.heads_q + head) * p.seqlen_q + row] = lse;
    }
}

// ---- What every stage does first and last.

// The carve-up of the 1024-aligned dynamic shared memory (Fa4Traits offsets), this CTA's query
// tile and key tiles, and the thread's place in the CTA.
template <class Tr>
struct Cta {
    uint8_t *smem, *sq, *sk, *sv;
    uint64_t* bars;  // the barrier block (Barriers2 / Barriers3, or stage 1's four)
    uint32_t* tmem_slot;
    int tid, warp, lane;
    BlockCoord bc;
    int m0;
    FaKeyTiles kv;
    int n_tiles;
    __device__ __forceinline__ Cta(const FwdParams& p, uint8_t* smem_raw)
        : smem(aligned_smem(smem_raw)), sq(smem + Tr::kOffQ), sk(smem + Tr::kOffK), sv(smem + Tr::kOffV),
          bars(reinterpret_cast<uint64_t*>(smem + Tr::kOffBarriers)),
          tmem_slot(reinterpret_cast<uint32_t*>(smem + Tr::kOffTmemSlot)), tid(threadIdx.x), warp(tid / 32),
          lane(tid % 32), bc(block_coord(p)), m0(bc.m_block * Tr::kBlockM),
          kv(fa_key_tiles(p, m0, min(m0 + Tr::kBlockM, p.seqlen_q), Tr::kBlockN)), n_tiles(kv.n_end - kv.n_begin) {}

    // The TMEM allocation (warp kAllocWarp, which then gives up the right to allocate more) and
    // the barriers (thread 0: init_barriers(), then the init fence), seen by every thread;
    // returns the TMEM base address.
    template <class F>
    __device__ __forceinline__ uint32_t start(F&& init_barriers) const {
        if (warp == Tr::kAllocWarp) {
            tmem_alloc(tmem_slot, Tr::kTmemCols);
            tmem_relinquish();
        }
        if (tid == 0) {
            init_barriers();
            mbar_init_fence();
        }
        tcgen05_fence_before();
        __syncthreads();
        tcgen05_fence_after();
        return *tmem_slot;
    }

    // Every thread's TMEM accesses are done before the allocating warp frees the columns.
    __device__ __forceinline__ void finish(uint32_t tmem) const {
        tcgen05_fence_before();
        __syncthreads();
        if (warp == Tr::kAllocWarp) {
            tcgen05_fence_after();
            tmem_dealloc(tmem, Tr::kTmemCols);
        }
    }
};

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
    write_output<Tr, T>(p, st.finalize(0, fa_to_natural(p)), tmem, warp, row, bc.batch, bc.head, n_tiles > 0);
    cta.finish(tmem);
}

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
// `parts` partial sums, kUmmaM apart (stage 2: one per softmax warpgroup).
template <class Tr>
__device__ __forceinline__ FaRowEnd published_row_end(const FwdParams& p, const uint8_t* smem, int row, int parts) {
    const float* lsum = reinterpret_cast<const float*>(smem + Tr::kOffLsum);
    float l = 0.f;
    for (int i = 0; i < parts; ++i) l += lsum[i * kUmmaM + row];
    return fa_softmax_finalize(reinterpret_cast<const float*>(smem + Tr::kOffMax)[row], l, fa_to_natural(p));
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
    const FaRowEnd end = published_row_end<Tr>(p, smem, r, 2);
    write_output<Tr, T>(p, end, tmem, warp, m0 + r, bc.batch, bc.head, n_tiles > 0);
}

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
        const FaRowEnd end = published_row_end<Tr>(p, smem, t * kUmmaM + r, 1);
        write_output<Tr, T>(p, end, tmem + static_cast<uint32_t>(t * Tr::kHeadDim), warp, m0 + t * kUmmaM + r,
                            bc.batch, bc.head, n_tiles > 0);
    }
}

// ---------------------------------------------------------------- stages 2-3: the warp roles

// Warpgroups 0-1 softmax, warpgroup 2 correction, the load warp and the MMA warp (Fa4Traits),
// with stage 2's or stage 3's role functions and barriers.
template <int Stage, class T, int D>
__device__ __forceinline__ void warp_roles(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                           const TmaDesc* tv) {
    using Tr = Fa4Traits<Stage, D>;
    using B = typename std::conditional<Stage == 2, Barriers2, Barriers3>::type;
    extern __shared__ uint8_t smem_raw[];
    const Cta<Tr> cta(p, smem_raw);
    const B b(cta.bars);
    const uint32_t tmem = cta.start([&] { b.init(); });
    const int warp = cta.warp, r = cta.tid % 128, n_tiles = cta.n_tiles;
    const bool issuer = cta.lane == 0 && n_tiles > 0;
    if (warp < 2 * 4) {
        if constexpr (Stage == 2)
            softmax_role<Tr, T>(p, b, cta.smem, tmem, warp / 4, r, warp, cta.m0, cta.kv.n_begin, n_tiles);
        else
            softmax_role3<Tr, T>(p, b, cta.smem, tmem, warp / 4, r, warp, cta.m0, cta.kv.n_begin, n_tiles);
    } else if (warp < Tr::kLoadWarp) {
        if constexpr (Stage == 2)
            correction_role<Tr, T>(p, b, cta.smem, tmem, r, warp, cta.m0, cta.bc, n_tiles);
        else
            correction_role3<Tr, T>(p, b, cta.smem, tmem, r, warp, cta.m0, cta.bc, n_tiles);
    } else if (warp == Tr::kLoadWarp) {
        if (issuer) load_role<Tr>(b, tq, tk, tv, cta.sq, cta.sk, cta.sv, cta.bc, cta.m0, cta.kv.n_begin, n_tiles);
    } else if (warp == Tr::kMmaWarp && issuer) {
        if constexpr (Stage == 2)
            mma_role<Tr, T>(b, tmem, smem_u32(cta.sq), smem_u32(cta.sk), smem_u32(cta.sv), n_tiles);
        else
            mma_role3<Tr, T>(b, tmem, smem_u32(cta.sq), smem_u32(cta.sk), smem_u32(cta.sv), n_tiles);
    }
    cta.finish(tmem);
}

// One entry per stage.
template <int Stage, class T, int D>
__device__ __forceinline__ void forward(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv) {
    if constexpr (Stage == 1)
        stage1<T, D>(p, tq, tk, tv);
    else
        warp_roles<Stage, T, D>(p, tq, tk, tv);
}

#else  // host pass / other targets: the kernels compile to nothing

template <int Stage, class T, int D>
__device__ __forceinline__ void forward(const FwdParams&, const TmaDesc*, const TmaDesc*, const TmaDesc*) {}

#endif  // __CUDA_ARCH_FEAT_SM100_ALL

}  // namespace fa4

// ---------------------------------------------------------------- instances
// Symbol: fa4s<stage>_fwd_hd<D>_<dtype> (build/instances.rs: one family row per stage). Every
// stage takes the params and the tensor maps of Q, K, V (box rows 128; src/cuda/fa4.rs).

#define FA4_KERNEL(S, DT, T, D)                                                                       \
    extern "C" __global__ void __launch_bounds__(fa4::Fa4Traits<S, D>::kThreads, 1)                   \
        fa4s##S##_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p,                               \
                                   const __grid_constant__ fa3::TmaDesc tmap_q,                       \
                                   const __grid_constant__ fa3::TmaDesc tmap_k,                       \
                                   const __grid_constant__ fa3::TmaDesc tmap_v) {                     \
        fa4::forward<S, T, D>(p, &tmap_q, &tmap_k, &tmap_v);                                          \
    }
#define FA4_TYPE_bf16 __nv_bfloat16
#define FA4_TYPE_f16 __half

#if defined(FA_STAGE)
// FA_STAGE is the row's `stage` (build/instances.rs: one family row per stage).
#define FA4_STAGE FA_STAGE
// The table (build/instances.rs) and the traits must agree on the launch shape.
static_assert(FA_THREADS == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kThreads, "table: threads");
static_assert(FA_BLOCK_M == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kBlockM, "table: block_m");
static_assert(FA_BLOCK_N == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kBlockN, "table: block_n");
static_assert(FA_SMEM_BYTES == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kSmemBytes,
              "table: dynamic shared memory (fa4_smem_bytes in build/instances.rs)");
#define FA4_INSTANCE_(S, DT, D) FA4_KERNEL(S, DT, FA4_TYPE_##DT, D)
#define FA4_INSTANCE(S, DT, D) FA4_INSTANCE_(S, DT, D)
#define FA_INSTANCE(DT) FA4_INSTANCE(FA4_STAGE, DT, FA_HEAD_DIM)
#endif

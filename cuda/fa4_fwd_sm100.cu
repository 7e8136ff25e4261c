// FA4-style forward attention for Blackwell (sm_100a), bf16/f16, on the 5th-generation tensor
// cores (tcgen05) with the accumulators in tensor memory (TMEM). Built as a ladder of stages,
// each a complete kernel (docs/fa4.md has the status, launch shape and what ran where):
//   stage 1  tcgen05.mma with S = Q K^T and O = P V accumulated in TMEM (tcgen05.alloc /
//            relinquish / dealloc, tcgen05.ld / st), Q/K/V by TMA into 128B-swizzled shared
//            memory, one CTA of one warpgroup: thread 0 issues TMA and MMAs, each MMA batch is
//            tcgen05.commit-ed to an mbarrier every thread waits on; each thread owns one query
//            row (TMEM lane), so the softmax needs no shuffles. P goes through shared memory.
// Layouts (smem tiles, descriptors, TMEM) are derived in tcgen05_sm100.cuh.
//
// Semantics (same as every backend): s = scale * q.k, optional softcap, bottom-right aligned
// causal/sliding window, GQA, LSE (natural log) on request, rows with no visible key give O = 0
// and LSE -inf. No ALiBi (the host refuses it). Seqlens need not be multiples of the tile: TMA
// zero-fills rows past the end and those keys are masked.
// Host requirements (src/cuda/fa4.rs): head_dim == the instance's D; q/k/v/o strides multiples
// of 8 elements, 16-byte aligned base addresses (TMA, 16-byte stores of O).
#include <climits>

#include "fa_params.h"
#include "fast_math_sm90.cuh"
#include "mask.cuh"
#include "mbarrier_sm90.cuh"
#include "tcgen05_sm100.cuh"
#include "tma_sm90.cuh"
#include "wgmma_sm90.cuh"  // pack2 (the two-element 16-bit pack)

namespace fa4 {

using fa3::TmaDesc;

// Shape, roles and shared/tensor-memory plan of stage `Stage` at head dim `HeadDim`; the table
// row of build/instances.rs (fa4_tile, fa4_smem) repeats these numbers and the unit
// static_asserts the two agree.
template <int Stage, int HeadDim>
struct Fa4Traits {
    static_assert(Stage == 1, "stage 1 is implemented");
    static_assert(HeadDim == 64 || HeadDim == 128, "head_dim 64 or 128");
    static constexpr int kHeadDim = HeadDim;
    static constexpr int kSlabs = HeadDim / kSlabCols;
    static constexpr int kThreads = 128;  // one warpgroup: a thread per TMEM lane = query row
    static constexpr int kBlockM = kUmmaM;
    static constexpr int kBlockN = 128;

    // Shared memory (bytes; every tile a whole number of 1024-byte swizzle atoms).
    static constexpr int kElemBytes = 2;
    static constexpr int kQBytes = kBlockM * HeadDim * kElemBytes;
    static constexpr int kKvTileBytes = kBlockN * HeadDim * kElemBytes;
    static constexpr int kPBytes = kBlockM * kBlockN * kElemBytes;
    static constexpr int kQSlabStride = kBlockM * kSwizzleBytes;
    static constexpr int kKvSlabStride = kBlockN * kSwizzleBytes;
    static constexpr int kPSlabStride = kBlockM * kSwizzleBytes;
    static constexpr int kOffQ = 0;
    static constexpr int kOffK = kOffQ + kQBytes;
    static constexpr int kOffV = kOffK + kKvTileBytes;
    static constexpr int kOffP = kOffV + kKvTileBytes;
    static constexpr int kOffBarriers = kOffP + kPBytes;
    // q_full, kv_full, s_full (S = Q K^T done), o_full (O += P V done). S and O get separate
    // barriers: with one, the issuer's next S commit could complete the phase after the one a
    // slow thread still waits for (same parity), and that thread would wait a phase too late.
    static constexpr int kNumBarriers = 4;
    static constexpr int kOffTmemSlot = kOffBarriers + 8 * kNumBarriers;
    static constexpr int kSmemUsed = kOffTmemSlot + 8;
    static constexpr int kSmemBytes = kSmemUsed + kSwizzleAtomBytes;  // alignment slack

    // Tensor memory: S in columns [0, kBlockN), O in [kBlockN, kBlockN + D); the allocation
    // is the next power of two.
    static constexpr int kTmemS = 0;
    static constexpr int kTmemO = kBlockN;
    static constexpr int kTmemCols = kBlockN + HeadDim <= 256 ? 256 : 512;

    // TMA: boxes of {64 columns, 1 head, rows, 1 batch}; one box per slab per tile.
    static constexpr int kTmaBoxRows = 128;
    static constexpr int kTmaQBytes = kQBytes;
    static constexpr int kTmaKvBytes = 2 * kKvTileBytes;

    static_assert(kBlockM == kTmaBoxRows && kBlockN == kTmaBoxRows, "one TMA box per slab");
    static_assert(kSmemBytes <= 227 * 1024, "sm_100 opt-in shared memory is 227 KiB per block");
    static_assert(kBlockN + HeadDim <= kTmemColumns, "S and O fit the tensor memory");
};

#if defined(__CUDA_ARCH_FEAT_SM100_ALL)

using fa3::fast_exp2;
using fa3::fast_tanh;
using fa3::mbar_arrive_expect_tx;
using fa3::mbar_init;
using fa3::mbar_init_fence;
using fa3::mbar_wait;
using fa3::smem_u32;
using fa3::tma_load_4d;
using fa3::tma_prefetch_desc;

// Block coordinates: x = query tile (heaviest first under a causal/window mask), y = q head,
// z = batch.
struct BlockCoord {
    int m_block, head, kv_head, batch;
};
__device__ __forceinline__ BlockCoord block_coord(const FwdParams& p) {
    BlockCoord bc;
    bc.m_block = p.window_right >= 0 ? static_cast<int>(gridDim.x - 1 - blockIdx.x)
                                     : static_cast<int>(blockIdx.x);
    bc.head = blockIdx.y;
    bc.kv_head = bc.head / (p.heads_q / p.heads_kv);
    bc.batch = blockIdx.z;
    return bc;
}

// 1024-aligned start of the dynamic shared memory (kSmemBytes includes the slack).
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
    const uint32_t pad = (kSwizzleAtomBytes - (smem_u32(raw) % kSwizzleAtomBytes)) % kSwizzleAtomBytes;
    return raw + pad;
}

// Byte offset of (row, col) in a [rows x cols] tile of SW128 slabs (tcgen05_sm100.cuh).
__device__ __forceinline__ int sw128_offset(int row, int col, int rows) {
    return (col / kSlabCols) * rows * kSwizzleBytes + row * kSwizzleBytes +
           ((((col % kSlabCols) / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
}

// Per-row online-softmax state (a thread owns one query row).
struct RowState {
    float row_max;  // running max of raw (unscaled) scores, -inf before any visible key
    float row_sum;  // running sum of exp2(...)
};

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

// Optional softcap (natural units), then -inf for keys outside [lo, hi) (past seqlen_k or
// outside the window; mask.cuh).
template <int BN>
__device__ __forceinline__ void softcap_and_mask(const FwdParams& p, float (&s)[BN], int row, int n0) {
    if (p.flags & FA_FLAG_SOFTCAP) {  // s = cap * tanh((scale * s) / cap), as FA3
        const float inv_cap = 1.f / p.softcap;
#pragma unroll
        for (int j = 0; j < BN; ++j) s[j] = p.softcap * fast_tanh((s[j] * p.softmax_scale) * inv_cap);
    }
    const int lo = fa_key_lo(p, row), hi = fa_key_hi(p, row);
#pragma unroll
    for (int j = 0; j < BN; ++j)
        if (n0 + j < lo || n0 + j >= hi) s[j] = -INFINITY;
}

// Row max update, s -> exp2((s - max) * scale_log2), row sum; returns the factor the output
// accumulated so far must be multiplied by (exponents from differences only; the -inf guard).
template <int BN>
__device__ __forceinline__ float online_softmax(RowState& st, float (&s)[BN], float scale_log2) {
    float mx = st.row_max;
#pragma unroll
    for (int j = 0; j < BN; ++j) mx = fmaxf(mx, s[j]);
    const float m_use = mx == -INFINITY ? 0.f : mx;
    const float corr = fast_exp2((st.row_max - m_use) * scale_log2);  // old max -inf: 0
    st.row_max = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < BN; ++j) {
        s[j] = fast_exp2((s[j] - m_use) * scale_log2);
        sum += s[j];
    }
    st.row_sum = st.row_sum * corr + sum;
    return corr;
}

// P (this thread's row) -> 16-bit, into the K-major SW128 P tile (16-byte chunks).
template <class Tr, class T>
__device__ __forceinline__ void store_p(uint8_t* sp, const float (&s)[Tr::kBlockN], int row) {
#pragma unroll
    for (int c = 0; c < Tr::kBlockN / 8; ++c) {
        const uint4 v = make_uint4(fa3::pack2<T>(s[8 * c], s[8 * c + 1]), fa3::pack2<T>(s[8 * c + 2], s[8 * c + 3]),
                                   fa3::pack2<T>(s[8 * c + 4], s[8 * c + 5]),
                                   fa3::pack2<T>(s[8 * c + 6], s[8 * c + 7]));
        *reinterpret_cast<uint4*>(sp + sw128_offset(row, 8 * c, Tr::kBlockM)) = v;
    }
}

// O (this thread's TMEM row) *= corr, 32 columns at a time.
template <class Tr>
__device__ __forceinline__ void rescale_o(uint32_t tmem, int warp, float corr) {
#pragma unroll
    for (int c = 0; c < Tr::kHeadDim / 32; ++c) {
        const uint32_t a = tmem_addr(tmem, 32 * (warp % 4), Tr::kTmemO + 32 * c);
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
// get O = 0 (not O * 0: NaN if a masked key's infinite V reached O) and LSE -inf.
template <class Tr, class T>
__device__ __forceinline__ void write_output(const FwdParams& p, const RowState& st, uint32_t tmem, int warp,
                                             int row, int batch, int head, bool have_o) {
    if (row >= p.seqlen_q) return;
    const bool softcap = (p.flags & FA_FLAG_SOFTCAP) != 0;
    const float max_scale = softcap ? 1.f : p.softmax_scale;  // the max in natural units
    const float l = st.row_sum;
    const bool empty = l == 0.f || !have_o;
    const float inv = empty ? 0.f : 1.f / l;
    T* orow = reinterpret_cast<T*>(p.o) + batch * p.o_batch_stride + row * p.o_row_stride + head * p.o_head_stride;
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
#pragma unroll
        for (int q = 0; q < 4; ++q)
            *reinterpret_cast<uint4*>(orow + 32 * c + 8 * q) =
                make_uint4(fa3::pack2<T>(o[8 * q], o[8 * q + 1]), fa3::pack2<T>(o[8 * q + 2], o[8 * q + 3]),
                           fa3::pack2<T>(o[8 * q + 4], o[8 * q + 5]), fa3::pack2<T>(o[8 * q + 6], o[8 * q + 7]));
    }
    if (p.flags & FA_FLAG_RETURN_LSE) {
        const float lse = empty ? -INFINITY : st.row_max * max_scale + logf(l);
        reinterpret_cast<float*>(p.lse)[(static_cast<int64_t>(batch) * p.heads_q + head) * p.seqlen_q + row] = lse;
    }
}

// ---------------------------------------------------------------- stage 1

template <class T, int D>
__device__ __forceinline__ void stage1(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                       const TmaDesc* tv) {
    using Tr = Fa4Traits<1, D>;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = aligned_smem(smem_raw);
    uint8_t* sq = smem + Tr::kOffQ;
    uint8_t* sk = smem + Tr::kOffK;
    uint8_t* sv = smem + Tr::kOffV;
    uint8_t* sp = smem + Tr::kOffP;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Tr::kOffBarriers);
    uint64_t* q_full = bars;
    uint64_t* kv_full = bars + 1;
    uint64_t* s_full = bars + 2;
    uint64_t* o_full = bars + 3;
    uint32_t* tmem_slot = reinterpret_cast<uint32_t*>(smem + Tr::kOffTmemSlot);

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const bool issuer = tid == 0;
    const BlockCoord bc = block_coord(p);
    const int m0 = bc.m_block * Tr::kBlockM;
    const FaKeyTiles kv = fa_key_tiles(p, m0, min(m0 + Tr::kBlockM, p.seqlen_q), Tr::kBlockN);
    const int n_tiles = kv.n_end - kv.n_begin;

    if (warp == 0) {
        tmem_alloc(tmem_slot, Tr::kTmemCols);
        tmem_relinquish();
    }
    if (issuer) {
        mbar_init(q_full, 1);
        mbar_init(kv_full, 1);
        mbar_init(s_full, 1);
        mbar_init(o_full, 1);
        mbar_init_fence();
    }
    tcgen05_fence_before();
    __syncthreads();
    tcgen05_fence_after();
    const uint32_t tmem = *tmem_slot;

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
    RowState st{-INFINITY, 0.f};
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
        const float corr = online_softmax<Tr::kBlockN>(st, s, p.softmax_scale_log2);
        store_p<Tr, T>(sp, s, tid);
        fa3::fence_proxy_async_smem();  // P (generic-proxy stores) -> visible to the MMA
        if (it > 0) rescale_o<Tr>(tmem, warp, corr);
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
    write_output<Tr, T>(p, st, tmem, warp, row, bc.batch, bc.head, n_tiles > 0);

    // Every thread's TMEM reads are done before the allocating warp frees the columns.
    tcgen05_fence_before();
    __syncthreads();
    if (warp == 0) {
        tcgen05_fence_after();
        tmem_dealloc(tmem, Tr::kTmemCols);
    }
}

#else  // host pass / other targets: the kernels compile to nothing

template <class T, int D>
__device__ __forceinline__ void stage1(const FwdParams&, const TmaDesc*, const TmaDesc*, const TmaDesc*) {}

#endif  // __CUDA_ARCH_FEAT_SM100_ALL

}  // namespace fa4

// ---------------------------------------------------------------- instances
// Symbol: fa4s<stage>_fwd_hd<D>_<dtype> (build/instances.rs: one family row per stage). Every
// stage takes the params and the tensor maps of Q, K, V (box rows 128; src/cuda/fa4.rs).

#define FA4_S1(DT, T, D)                                                                              \
    extern "C" __global__ void __launch_bounds__(fa4::Fa4Traits<1, D>::kThreads, 1)                   \
        fa4s1_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p, const __grid_constant__ fa3::TmaDesc tmap_q, \
                               const __grid_constant__ fa3::TmaDesc tmap_k,                           \
                               const __grid_constant__ fa3::TmaDesc tmap_v) {                         \
        fa4::stage1<T, D>(p, &tmap_q, &tmap_k, &tmap_v);                                              \
    }
#define FA4_TYPE_bf16 __nv_bfloat16
#define FA4_TYPE_f16 __half

#if defined(FA_FAMILY)
#define FA4_STAGE_OF_fa4s1 1
#define FA4_CAT_(a, b) a##b
#define FA4_CAT(a, b) FA4_CAT_(a, b)
#define FA4_STAGE FA4_CAT(FA4_STAGE_OF_, FA_FAMILY)
// The table (build/instances.rs) and the traits must agree on the launch shape.
static_assert(FA_THREADS == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kThreads, "table: threads");
static_assert(FA_BLOCK_M == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kBlockM, "table: block_m");
static_assert(FA_BLOCK_N == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kBlockN, "table: block_n");
static_assert(FA_SMEM_BYTES == fa4::Fa4Traits<FA4_STAGE, FA_HEAD_DIM>::kSmemBytes,
              "table: dynamic shared memory (fa4_smem in build/instances.rs)");
#define FA4_INSTANCE_(S, DT, D) FA4_S##S(DT, FA4_TYPE_##DT, D)
#define FA4_INSTANCE(S, DT, D) FA4_INSTANCE_(S, DT, D)
#define FA_INSTANCE(DT) FA4_INSTANCE(FA4_STAGE, DT, FA_HEAD_DIM)
#endif

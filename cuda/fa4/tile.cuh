// What every stage of the FA4 kernels builds on: the shared-memory tile layout, the two
// tcgen05 GEMMs, the softmax verbs on a thread's TMEM row, the epilogue that writes O and LSE,
// and the CTA's carve-up of shared memory.
#pragma once
#include "fa4/traits.cuh"

namespace fa4 {

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
// get O = 0 (not O * 0: NaN if a masked key's infinite V reached O) and LSE -inf, or the head's
// sink logit where it has one. Every thread of the warp loads (tcgen05.ld is .sync.aligned);
// only rows below seqlen_q are stored. `end`: the row's fa_softmax_finalize_sink (a CTA with no
// key tile, !have_o, finalizes the initial state: empty).
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
        const float lse = have_o || end.empty ? end.lse : -INFINITY;
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

#endif  // __CUDA_ARCH_FEAT_SM100_ALL

}  // namespace fa4

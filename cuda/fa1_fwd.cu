// FA1-style attention forward: tiled online softmax on CUDA cores (FFMA), f32 accumulation,
// f16/bf16 in and out. The GPU reference and the fallback where no faster family applies; runs
// on any SM >= 8.0. Simple on purpose: every tile goes through shared memory as f32.
//
// One thread block = kBlockM query rows of one (batch, head). It walks the key tiles the mask
// lets it see; per tile:  S = Q·Kᵀ (registers) -> softcap, ALiBi (natural units), mask ->
// online softmax in score units (softmax_fwd.cuh: running max m, sum l, output rescaled by
// exp2((m_old - m_new) * c)) -> P to shared memory -> O += P·V (registers). The end divides by
// l and writes O and the LSE; a row that saw no key is written as 0.
//
// A V tile holding an infinity or NaN switches O += P·V to a form that skips P = 0, so a key's V
// reaches only the rows that see it (0 * inf is NaN); the block learns it from the barrier that
// publishes the tile (__syncthreads_or), so finite inputs pay nothing.
//
// Thread layout: kColGroups = 8 consecutive lanes share a query row. In S a thread owns keys
// cg, cg+8, ...; in O it owns dims cg, cg+8, ...; so a row's max and sum are 3 xor-shuffles.
// Every row a thread owns in S it also owns in O, so the running max/sum live in registers.
//
// Compiled only through the unit build.rs generates from build/instances.rs, which defines
// FA_HEAD_DIM, FA_BLOCK_M, FA_BLOCK_N, FA_THREADS and FA_SMEM_BYTES (the host's launch values).

#include "dtype.cuh"
#include "fa_params.h"
#include "launch.cuh"
#include "mask.cuh"
#include "softmax_fwd.cuh"

#ifndef FA_HEAD_DIM
#error "compile through the unit build.rs generates from build/instances.rs"
#endif

namespace fa1 {

constexpr int kHeadDim = FA_HEAD_DIM;  // the instance's dim; p.head_dim <= it (tail masked)
constexpr int kBlockM = FA_BLOCK_M;
constexpr int kBlockN = FA_BLOCK_N;
constexpr int kThreads = FA_THREADS;
constexpr int kColGroups = 8;  // lanes per query row
constexpr int kRowGroups = kThreads / kColGroups;
constexpr int kRowsPerThread = kBlockM / kRowGroups;
constexpr int kKeysPerThread = kBlockN / kColGroups;
constexpr int kDimsPerThread = kHeadDim / kColGroups;

static_assert(kThreads % 32 == 0 && 32 % kColGroups == 0, "a row's lanes must sit in one warp");
static_assert(kBlockM % kRowGroups == 0, "block_m must be a multiple of threads / 8");
static_assert(kBlockN % kColGroups == 0 && kHeadDim % kColGroups == 0, "block_n and head_dim: multiples of 8");

// Shared memory, all f32. Q and K rows are padded by one float: the 8 lanes of a row group read
// 8 different K rows at the same dim, and a stride of head_dim + 1 puts them in 8 banks. P rows
// are padded for the same reason (4 row groups of a warp read 4 rows at the same key).
constexpr int kQStride = kHeadDim + 1;
constexpr int kKStride = kHeadDim + 1;
constexpr int kVStride = kHeadDim;  // read row-wise: lanes hit consecutive dims
constexpr int kPStride = kBlockN + 1;
constexpr int kSmemFloats = kBlockM * kQStride + kBlockN * kKStride + kBlockN * kVStride + kBlockM * kPStride;
static_assert(kSmemFloats * 4 == FA_SMEM_BYTES, "build/instances.rs fa1_smem_bytes disagrees with this layout");

extern __shared__ __align__(16) float smem[];

// Copies rows [row0, row0 + kRows) of one head into shared memory as f32, zero-filling rows past
// `seqlen` and dims past `head_dim`, so the tails contribute nothing to either product. Returns
// whether every value this thread copied is finite.
template <typename T, int kRows, int kStride>
__device__ __forceinline__ bool load_rows(float* dst, const T* head_base, long long row_stride, int row0,
                                          int seqlen, int head_dim) {
    bool finite = true;
    for (int idx = threadIdx.x; idx < kRows * kHeadDim; idx += kThreads) {
        const int r = idx / kHeadDim;  // consecutive threads take consecutive dims: coalesced
        const int d = idx % kHeadDim;
        float x = 0.f;
        if (row0 + r < seqlen && d < head_dim) x = fa_to_float(head_base[(long long)(row0 + r) * row_stride + d]);
        finite &= isfinite(x);
        dst[r * kStride + d] = x;
    }
    return finite;
}

// O += P·V for this thread's (rows, dims) over one tile. kSkipZeroP: a zero probability (a key
// the row does not see) contributes nothing even when V is infinite or NaN.
template <bool kSkipZeroP, int kRowsPerThread, int kDimsPerThread>
__device__ __forceinline__ void accumulate_pv(float (&acc)[kRowsPerThread][kDimsPerThread], const float* sP,
                                              const float* sV, int rg, int cg) {
#pragma unroll 2
    for (int j = 0; j < kBlockN; ++j) {
        float pv[kRowsPerThread];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) pv[i] = sP[(rg * kRowsPerThread + i) * kPStride + j];
#pragma unroll
        for (int dd = 0; dd < kDimsPerThread; ++dd) {
            const float vv = sV[j * kVStride + cg + dd * kColGroups];
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i) {
                const float t = fmaf(pv[i], vv, acc[i][dd]);
                acc[i][dd] = (kSkipZeroP && pv[i] == 0.f) ? acc[i][dd] : t;
            }
        }
    }
}

// The sum (or max) over the 8 lanes of a row group.
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int o = 1; o < kColGroups; o *= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
    for (int o = 1; o < kColGroups; o *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

template <typename T>
__device__ __forceinline__ void forward(const FwdParams& p) {
    // The host launches with exactly this shape; anything else would read out of bounds.
    if (blockDim.x != kThreads || fa_dynamic_smem_bytes() < (unsigned)FA_SMEM_BYTES || p.head_dim > kHeadDim) __trap();

    const int m0 = blockIdx.x * kBlockM;  // first query row of this block
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int head_kv = head / (p.heads_q / p.heads_kv);  // GQA: a group of q heads shares one kv head
    const int tid = threadIdx.x;
    const int rg = tid / kColGroups;  // row group: rows rg * kRowsPerThread + i
    const int cg = tid % kColGroups;  // column group: keys / dims cg + 8 * j

    float* sQ = smem;
    float* sK = sQ + kBlockM * kQStride;
    float* sV = sK + kBlockN * kKStride;
    float* sP = sV + kBlockN * kVStride;

    const T* q = reinterpret_cast<const T*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride;
    const T* k = reinterpret_cast<const T*>(p.k) + batch * p.k_batch_stride + head_kv * p.k_head_stride;
    const T* v = reinterpret_cast<const T*>(p.v) + batch * p.v_batch_stride + head_kv * p.v_head_stride;
    T* o = reinterpret_cast<T*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;

    load_rows<T, kBlockM, kQStride>(sQ, q, p.q_row_stride, m0, p.seqlen_q, p.head_dim);

    const bool softcap = (p.flags & FA_FLAG_SOFTCAP) != 0;
    const bool alibi = (p.flags & FA_FLAG_ALIBI) != 0;
    const float slope = alibi ? reinterpret_cast<const float*>(p.alibi_slopes)[head] : 0.f;
    // Score units (softmax_fwd.cuh): raw q.k, or natural units with softcap / ALiBi. c is the
    // host's softmax_scale_log2 (scale * log2 e, or log2 e for natural units), read from the
    // params where it is used (a register held across the loop spilled at hdim 192).
    const bool natural = softcap || alibi;

    float acc[kRowsPerThread][kDimsPerThread];
    float row_max[kRowsPerThread];  // running max, score units
    float row_sum[kRowsPerThread];  // running sum of exp2((s - row_max) * c)
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
        row_max[i] = -INFINITY;
        row_sum[i] = 0.f;
#pragma unroll
        for (int dd = 0; dd < kDimsPerThread; ++dd) acc[i][dd] = 0.f;
    }

    // Only the key tiles some row of this block can see.
    const int row_end = min(m0 + kBlockM, p.seqlen_q);
    const FaKeyTiles tiles = fa_key_tiles(p, m0, row_end, kBlockN);
    for (int n0 = tiles.n_begin * kBlockN; n0 < tiles.n_end * kBlockN; n0 += kBlockN) {
        __syncthreads();  // the previous tile's readers of sK, sV, sP are done
        load_rows<T, kBlockN, kKStride>(sK, k, p.k_row_stride, n0, p.seqlen_k, p.head_dim);
        const bool v_ok = load_rows<T, kBlockN, kVStride>(sV, v, p.v_row_stride, n0, p.seqlen_k, p.head_dim);
        // sQ (first time), sK, sV visible to all; and whether any thread copied a non-finite V.
        const bool v_nonfinite = __syncthreads_or(!v_ok) != 0;

        // S = Q·Kᵀ for this thread's (rows, keys). (kRowsPerThread, kKeysPerThread)
        float s[kRowsPerThread][kKeysPerThread];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
            for (int j = 0; j < kKeysPerThread; ++j) s[i][j] = 0.f;
#pragma unroll 4
        for (int d = 0; d < kHeadDim; ++d) {
            float qv[kRowsPerThread], kv[kKeysPerThread];
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i) qv[i] = sQ[(rg * kRowsPerThread + i) * kQStride + d];
#pragma unroll
            for (int j = 0; j < kKeysPerThread; ++j) kv[j] = sK[(cg + j * kColGroups) * kKStride + d];
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
                for (int j = 0; j < kKeysPerThread; ++j) s[i][j] = fmaf(qv[i], kv[j], s[i][j]);
        }

#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            const int row_local = rg * kRowsPerThread + i;
            const int row = m0 + row_local;
            // Scores in score units, masked to -inf: raw q.k, or natural units (softcap's tanh
            // and the ALiBi bias need them), each step as a straightforward f32 softmax takes it.
            const int key_lo = fa_key_lo(p, row), key_hi = row < p.seqlen_q ? fa_key_hi(p, row) : 0;
            float tile_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < kKeysPerThread; ++j) {
                const int col = n0 + cg + j * kColGroups;
                float x;
                if (col < key_lo || col >= key_hi) {
                    x = -INFINITY;
                } else if (natural) {
                    x = s[i][j] * p.softmax_scale;
                    if (softcap) x = p.softcap * tanhf(x / p.softcap);
                    if (alibi) x -= slope * (float)llabs((long long)row + p.seqlen_k - p.seqlen_q - col);
                } else {
                    x = s[i][j];
                }
                s[i][j] = x;
                tile_max = fmaxf(tile_max, x);
            }
            float m_new, m_ref;
            const float alpha = fa_softmax_rescale(row_max[i], group_max(tile_max), p.softmax_scale_log2, m_new, m_ref);
            row_max[i] = m_new;
            float tile_sum = 0.f;
#pragma unroll
            for (int j = 0; j < kKeysPerThread; ++j) {
                const float e = fa_softmax_p(s[i][j], m_ref, p.softmax_scale_log2);  // masked: exp2(-inf) = 0
                sP[row_local * kPStride + cg + j * kColGroups] = e;
                tile_sum += e;
            }
            row_sum[i] = row_sum[i] * alpha + group_sum(tile_sum);
#pragma unroll
            for (int dd = 0; dd < kDimsPerThread; ++dd) acc[i][dd] *= alpha;
        }
        __syncthreads();  // sP complete

        // O += P·V for this thread's (rows, dims); block-uniform branch.
        if (v_nonfinite)
            accumulate_pv<true>(acc, sP, sV, rg, cg);
        else
            accumulate_pv<false>(acc, sP, sV, rg, cg);
    }

    // Epilogue: O / l, LSE. Rows past seqlen_q and dims past head_dim are not written.
    const bool write_lse = (p.flags & FA_FLAG_RETURN_LSE) != 0;
    const float u = natural ? 1.f : p.softmax_scale;  // score units -> natural (LSE)
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
        const int row = m0 + rg * kRowsPerThread + i;
        if (row >= p.seqlen_q) continue;
        float inv_l, lse;
        fa_softmax_finalize(row_max[i], row_sum[i], u, inv_l, lse);
        const bool empty = row_sum[i] == 0.f;  // saw no key: exactly 0, whatever reached acc
        T* o_row = o + (long long)row * p.o_row_stride;
#pragma unroll
        for (int dd = 0; dd < kDimsPerThread; ++dd) {
            const int d = cg + dd * kColGroups;
            if (d < p.head_dim) o_row[d] = fa_from_float<T>(empty ? 0.f : acc[i][dd] * inv_l);
        }
        if (write_lse && cg == 0) {
            float* lse_out = reinterpret_cast<float*>(p.lse);
            lse_out[((long long)batch * p.heads_q + head) * p.seqlen_q + row] = lse;
        }
    }
}

}  // namespace fa1

// One kernel per (head_dim, dtype): fa1_fwd_hd<FA_HEAD_DIM>_<f16|bf16>.
#define FA_CONCAT_(a, b, c, d) a##b##c##d
#define FA_NAME(hd, dt) FA_CONCAT_(fa1_fwd_hd, hd, _, dt)
#define FA_INSTANCE(DT)                                                                     \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                \
        FA_NAME(FA_HEAD_DIM, DT)(const __grid_constant__ FwdParams p) {                     \
        fa1::forward<fa_##DT>(p);                                                           \
    }

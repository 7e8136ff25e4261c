// FA1-style attention forward: tiled online softmax on CUDA cores (FFMA), f32 accumulation,
// f16/bf16 in and out. The GPU reference and the fallback where no faster family applies; runs
// on any SM >= 8.0. Simple on purpose: every tile goes through shared memory as f32.
//
// One thread block = kBlockM query rows of one (batch, head). It walks the key tiles the mask
// lets it see; per tile:  S = Q·Kᵀ (registers) -> softcap, ALiBi (natural units), mask ->
// online softmax in score units (softmax.cuh, the one every family uses: running max m, sum l,
// output rescaled by exp2((m_old - m_new) * c)) -> P to shared memory -> O += P·V (registers).
// The end divides by l and writes O and the LSE; a row that saw no key is written as 0.
//
// Serving launches (docs/serving.md "GPU"): every address goes through the per-sequence view of
// cuda/common/seqlen.cuh, so the same code runs dense, varlen (packed q/o, packed k/v), KV caches
// and paged caches of any page size (K/V tiles are copied row by row, each row's address looked
// up through the block table), with the mask, ALiBi and LSE on each sequence's own sq_b x sk_b.
// Split-KV: grid z is b * splits + split; a split walks only its key tiles (fa_split_tiles) and
// writes its normalised output and LSE (-inf, zeros: no key) to o_accum / lse_accum in f32, which
// the combine kernel (cuda/combine.cu) merges.
//
// A V tile holding an infinity or NaN switches O += P·V to a form that skips P = 0, so a key's V
// reaches only the rows that see it (0 * inf is NaN); the block learns it from the barrier that
// publishes the tile (__syncthreads_or), so finite inputs pay nothing.
//
// Thread layout: kColGroups = 8 consecutive lanes share a query row. In S a thread owns keys
// cg, cg+8, ...; in O it owns dims cg, cg+8, ...; so a row's max and sum are 3 xor-shuffles.
// Every row a thread owns in S it also owns in O, so the running max/sum live in registers
// (`Frag` below describes this layout to the shared softmax and mask).
//
// Compiled only through the unit build.rs generates from build/instances.rs, which defines
// FA_HEAD_DIM, FA_BLOCK_M, FA_BLOCK_N, FA_THREADS and FA_SMEM_BYTES (the host's launch values).

#include "common/dtype.cuh"
#include "common/params.h"
#include "sm80/launch.cuh"
#include "common/mask.cuh"
#include "common/seqlen.cuh"
#include "common/softmax.cuh"

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
// `seqlen` and dims past `head_dim`, so the tails contribute nothing to either product; row j
// (< seqlen) is at head_base + row_offset(j) (a key row of a paged cache: through the block
// table). Returns whether every value this thread copied is finite.
template <typename T, int kRows, int kStride, class RowOffset>
__device__ __forceinline__ bool load_rows(float* dst, const T* head_base, const RowOffset& row_offset, int row0,
                                          int seqlen, int head_dim) {
    bool finite = true;
    for (int idx = threadIdx.x; idx < kRows * kHeadDim; idx += kThreads) {
        const int r = idx / kHeadDim;  // consecutive threads take consecutive dims: coalesced
        const int d = idx % kHeadDim;
        float x = 0.f;
        if (row0 + r < seqlen && d < head_dim) x = fa_to_float(head_base[row_offset(row0 + r) + d]);
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

// A thread's scores and outputs as rows and columns (the fragment layout of softmax.cuh): row r
// is block row rg * kRowsPerThread + r, score element j key cg + 8j, output element j dim cg + 8j.
struct Frag {
    static constexpr int kRows = kRowsPerThread, kSCols = kKeysPerThread, kOCols = kDimsPerThread;
    static constexpr int kLanes = kColGroups;
    int rg, cg;
    __device__ __forceinline__ static float& s(float (&a)[kRows][kSCols], int r, int j) { return a[r][j]; }
    __device__ __forceinline__ static float& o(float (&a)[kRows][kOCols], int r, int j) { return a[r][j]; }
    __device__ __forceinline__ int row(int r) const { return rg * kRowsPerThread + r; }
    __device__ __forceinline__ int col(int j) const { return cg + j * kColGroups; }
};

template <typename T>
__device__ __forceinline__ void forward(const FwdParams& p) {
    // The host launches with exactly this shape; anything else would read out of bounds.
    if (blockDim.x != kThreads || fa_dynamic_smem_bytes() < (unsigned)FA_SMEM_BYTES || p.head_dim > kHeadDim) __trap();

    const int m0 = blockIdx.x * kBlockM;  // first query row of this block
    const int head = blockIdx.y;
    const FaBatchSplit bsplit = fa_batch_split(p, blockIdx.z);
    const FaSeq seq = fa_seq(p, bsplit.b);  // this sequence's rows, keys and addresses
    if (m0 >= seq.sq) return;  // the whole block: past a shorter sequence's rows (no barrier yet)
    const FaMaskDims md = fa_seq_mask(p, seq);
    const int splits = fa_num_splits(p);
    const int head_kv = head / (p.heads_q / p.heads_kv);  // GQA: a group of q heads shares one kv head
    const int tid = threadIdx.x;
    const int rg = tid / kColGroups;  // row group: rows rg * kRowsPerThread + i
    const int cg = tid % kColGroups;  // column group: keys / dims cg + 8 * j
    const Frag frag{rg, cg};

    float* sQ = smem;
    float* sK = sQ + kBlockM * kQStride;
    float* sV = sK + kBlockN * kKStride;
    float* sP = sV + kBlockN * kVStride;

    const T* q = reinterpret_cast<const T*>(p.q) + fa_q_offset(p, seq, head, 0);
    const T* k = reinterpret_cast<const T*>(p.k) + head_kv * p.k_head_stride;
    const T* v = reinterpret_cast<const T*>(p.v) + head_kv * p.v_head_stride;
    const auto q_row = [&](int i) { return (long long)i * p.q_row_stride; };
    const auto k_row = [&](int j) { return fa_kv_row_offset(p, seq, p.k_batch_stride, p.k_row_stride, j); };
    const auto v_row = [&](int j) { return fa_kv_row_offset(p, seq, p.v_batch_stride, p.v_row_stride, j); };

    load_rows<T, kBlockM, kQStride>(sQ, q, q_row, m0, seq.sq, p.head_dim);

    // Score units (softmax.cuh): raw q.k, or natural units with softcap / ALiBi. c is the
    // host's softmax_scale_log2 (scale * log2 e, or log2 e for natural units), read from the
    // params where it is used (a register held across the loop spilled at hdim 192).
    const float slope = fa_alibi_slope(p, head);

    float acc[kRowsPerThread][kDimsPerThread];
    FaOnlineSoftmax<Frag> softmax;
    softmax.init();
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
        for (int dd = 0; dd < kDimsPerThread; ++dd) acc[i][dd] = 0.f;

    // Only the key tiles some row of this block can see, within this CTA's split (whole tiles).
    const int row_end = min(m0 + kBlockM, seq.sq);
    const FaKeyTiles tiles = fa_key_tiles(md, m0, row_end, kBlockN);
    const FaKeyTiles split_tiles = fa_split_tiles(seq.sk, splits, bsplit.split, kBlockN);
    const int n_first = max(tiles.n_begin, split_tiles.n_begin) * kBlockN;
    const int n_last = min(tiles.n_end, split_tiles.n_end) * kBlockN;
    for (int n0 = n_first; n0 < n_last; n0 += kBlockN) {
        __syncthreads();  // the previous tile's readers of sK, sV, sP are done
        load_rows<T, kBlockN, kKStride>(sK, k, k_row, n0, seq.sk, p.head_dim);
        const bool v_ok = load_rows<T, kBlockN, kVStride>(sV, v, v_row, n0, seq.sk, p.head_dim);
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

        // Scores in score units, masked to -inf, then P = exp2((s - m) * c) in place.
        if (fa_natural_scores(p)) fa_scores_to_natural<true, false>(s, frag, p, slope, m0, n0, seq.sk - seq.sq);
        if (fa_tile_needs_mask(md, m0, row_end - 1, n0, (long long)n0 + kBlockN - 1))
            fa_mask_fragment(s, frag, md, m0, n0);
        float corr[kRowsPerThread];
        softmax.update(s, p.softmax_scale_log2, corr);
        softmax.rescale(acc, corr);
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
            for (int j = 0; j < kKeysPerThread; ++j) sP[frag.row(i) * kPStride + frag.col(j)] = s[i][j];
        __syncthreads();  // sP complete

        // O += P·V for this thread's (rows, dims); block-uniform branch.
        if (v_nonfinite)
            accumulate_pv<true>(acc, sP, sV, rg, cg);
        else
            accumulate_pv<false>(acc, sP, sV, rg, cg);
    }

    // Epilogue: O / l, LSE. Rows past the sequence's and dims past head_dim are not written.
    // Split-KV: the normalised partial output and its LSE (always) in f32 to the accumulators.
    const bool write_lse = (p.flags & FA_FLAG_RETURN_LSE) != 0;
    const float u = fa_to_natural(p);  // score units -> natural (LSE)
    const FaSeq out_seq = fa_seq(p, bsplit.b);  // read again: not held in registers across the loop
    const float sink = splits > 1 ? -INFINITY : fa_sink(p, head);  // split-KV: the combine folds it
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
        const FaRowEnd end = softmax.finalize(i, u, sink);  // every lane of the row takes part
        const int row = m0 + frag.row(i);
        if (row >= out_seq.sq) continue;
        const long long lse_at = fa_lse_index(out_seq, head, row);
        if (splits > 1) {
            const long long acc_row = (long long)bsplit.split * fa_lse_rows(p) + lse_at;
            float* o_row = reinterpret_cast<float*>(p.o_accum) + acc_row * p.head_dim;
#pragma unroll
            for (int dd = 0; dd < kDimsPerThread; ++dd) {
                const int d = frag.col(dd);
                if (d < p.head_dim) o_row[d] = end.empty ? 0.f : acc[i][dd] * end.inv_l;
            }
            if (cg == 0) reinterpret_cast<float*>(p.lse_accum)[acc_row] = end.lse;
            continue;
        }
        T* o_row = reinterpret_cast<T*>(p.o) + fa_o_offset(p, out_seq, head, row);
#pragma unroll
        for (int dd = 0; dd < kDimsPerThread; ++dd) {
            const int d = frag.col(dd);
            // A row that saw no key: exactly 0, whatever reached acc.
            if (d < p.head_dim) o_row[d] = fa_from_float<T>(end.empty ? 0.f : acc[i][dd] * end.inv_l);
        }
        if (write_lse && cg == 0) reinterpret_cast<float*>(p.lse)[lse_at] = end.lse;
    }
}

}  // namespace fa1

// One kernel per (head_dim, dtype): fa1_fwd_hd<FA_HEAD_DIM>_<f16|bf16>.
// __launch_bounds__(threads, 1): ptxas may use more than 128 registers (on sm_80 shared memory
// limits the CTAs per SM to 2-3 anyway); left to its default it capped hd64 at 128 and spilled
// the serving paths' per-sequence addressing.
#define FA_CONCAT_(a, b, c, d) a##b##c##d
#define FA_NAME(hd, dt) FA_CONCAT_(fa1_fwd_hd, hd, _, dt)
#define FA_INSTANCE(DT)                                                                     \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)                             \
        FA_NAME(FA_HEAD_DIM, DT)(const __grid_constant__ FwdParams p) {                     \
        fa1::forward<fa_##DT>(p);                                                           \
    }

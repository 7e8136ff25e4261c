// FA3 on the serving layouts (docs/serving.md, docs/fa3.md "Serving layouts"): variable-length
// batches (cu_seqlens_q/k), dense caches with cache_seqlens (seqused_k) and paged caches
// (block_table, any page_size). What one (query tile, head, sequence) of FA3 needs from the
// per-sequence view of common/seqlen.cuh: its lengths, the TMA coordinates of its Q rows and of
// a K/V tile, where its O rows and LSE go, and the gathered load of a K/V tile that TMA cannot
// take.
//
// Load paths (the producer's choice per K/V tile, the same in every stage that runs serving):
//   TMA       a whole tile of kBlockN keys that lies in one box of the K/V tensor map: the packed
//             tensor (cu_seqlens_k), the dense cache, or one page of a paged cache when page_size
//             is a multiple of kBlockN (the block index read from the table per tile);
//   gathered  every other tile: the producer warpgroup's 128 threads copy the tile's rows with
//             16-byte cp.async through the block table into the same 128B-swizzled layout TMA
//             writes (sw128_offset), zero-filling rows past the sequence's last key, then arrive
//             on the same full barrier. Every tile of a paged cache whose page_size is not a
//             multiple of kBlockN, and the last, partial tile of every sequence: a TMA box there
//             would read rows past sk_b, which belong to the next sequence or are unused cache
//             slots (the tests fill them with NaN, and P = 0 times NaN is NaN in P V).
// An FP8 (e4m3) cache (FA_FLAG_KV_FP8, common/fp8_kv.cuh) is gathered tile by tile: each producer
// thread loads its 8 codes with a plain 8-byte load and stores their values (exact in the 16-bit
// dtype) as the 16-byte chunk, and with each K tile the producer writes the tile's per-key K and V
// scales into the tile's scale slot (Fa3Traits::kOffScales), published by the same full barrier;
// the consumers multiply S's columns by K's before the mask and P's by V's after the softmax, in
// f32, as FA2 and the CPU path do.
// Q boxes may run past sq_b into the next sequence's rows (or zero-filled past the tensor):
// those rows of S/P feed only query rows >= sq_b, which the epilogue never writes (softmax and
// P V are row-wise).
#pragma once
#include <type_traits>

#include "common/fp8_kv.cuh"
#include "common/params.h"
#include "common/seqlen.cuh"
#include "fa3/traits.cuh"
#include "sm80/mma.cuh"
#include "sm80/shared.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace fa3 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Named barrier of the producer warpgroup's gathered loads (0: __syncthreads, 1-2: ping-pong).
constexpr int kGatherBarrier = 3;

// Whether the launch uses a serving layout (any of the batch-layout fields set).
__device__ __forceinline__ bool launch_is_serving(const FwdParams& p) {
    return p.cu_seqlens_q != 0 || p.cu_seqlens_k != 0 || p.seqused_k != 0 || p.page_size > 0;
}

// Whether traits Tr run the serving layouts (Fa3Traits::kServing; traits without the member,
// the FP8 consumer's, do not).
template <class Tr, class = void>
struct ServesLayouts : std::false_type {};
template <class Tr>
struct ServesLayouts<Tr, std::void_t<decltype(Tr::kServing)>> : std::bool_constant<Tr::kServing> {};

// Sequence b of the launch (common/seqlen.cuh). Serving = false compiles the serving layouts
// out (instances that refuse them: head_dim 256, whose consumers have no registers to spare,
// and the FP8 consumer): batch entry b of a dense launch.
template <bool Serving>
__device__ __forceinline__ FaSeq seq_of(const FwdParams& p, int b) {
    if constexpr (Serving) return fa_seq(p, b);
    return fa_seq_dense(p, b);
}

// The parameters a tile's mask, K/V tile range and score transform read: with Serving, `own`
// filled with p and sequence s's lengths (bottom-right alignment per sequence, as fa_seq_mask);
// without, p itself: a dense-only instance keeps reading its lengths from the parameter bank (a
// copy holds them in registers, which spilled stage 4's consumers at head_dim 256).
template <bool Serving>
__device__ __forceinline__ const FwdParams& seq_params(const FwdParams& p, const FaSeq& s, FwdParams& own) {
    if constexpr (Serving) {
        own = p;
        own.seqlen_q = s.sq;
        own.seqlen_k = s.sk;
        return own;
    } else {
        return p;
    }
}

// Whether K/V tile n (keys n * kBlockN ..) of sequence s is gathered rather than loaded by TMA
// (the rule at the top of this file). Dense launches never gather: TMA zero-fills rows past
// seqlen_k, the end of the tensor.
template <class Tr>
__device__ __forceinline__ bool gathered_tile(const FwdParams& p, const FaSeq& s, int n) {
    if constexpr (!ServesLayouts<Tr>::value) return false;
    if (!launch_is_serving(p)) return false;
    if (fa_kv_fp8(p)) return true;  // codes: converted on the way, which TMA cannot do
    if (p.page_size > 0 && p.page_size % Tr::kBlockN != 0) return true;
    return (n + 1) * Tr::kBlockN > s.sk;
}

// TMA coordinates (row, batch) of the first key of K/V tile n (a TMA tile: gathered_tile false,
// so a paged tile lies in one page and the block index is the map's batch coordinate).
template <class Tr>
__device__ __forceinline__ void kv_tma_coords(const FwdParams& p, const FaSeq& s, int n, int* row, int* batch) {
    const int n0 = n * Tr::kBlockN;
    if (p.page_size > 0) {
        const FaPage pg = fa_kv_page(p, s, n0);
        *batch = pg.block;
        *row = pg.slot;
    } else {
        *row = s.kv_row0 + n0;
        *batch = s.kv_batch;
    }
}

// The gathered load of K or V tile n of sequence s into the [kBlockN x D] SW128 tile at `dst`
// (1024-aligned; D: the operand's head dim, Q/K's or V's), by the producer warpgroup's threads
// (ptid = 0..127, every one of them calls it): 16-byte cp.async per (row, 16-byte chunk), rows
// past the sequence's last key zero-filled (src-size 0 reads nothing). Src uint8_t: an FP8
// cache's codes, 8 per chunk, stored as their T values (T: the 16-bit dtype). Completed and
// published by gather_commit.
template <class Tr, int D, class T, class Src>
__device__ __forceinline__ void gather_tile(uint8_t* dst, const FwdParams& p, const FaSeq& s, const Src* base,
                                            int64_t batch_stride, int64_t row_stride, int64_t head_off, int n,
                                            int ptid) {
    // A pass of the 128 threads copies whole rows when a row's chunks divide them (D = 64, 128);
    // at D = 192 (24 chunks) a pass copies 16 rows of one 64-column slab instead, slab by slab.
    constexpr int kRowChunks = D / 8;  // 16-byte chunks per row
    constexpr bool kWholeRows = kWarpgroupThreads % kRowChunks == 0;
    constexpr int kChunks = kWholeRows ? kRowChunks : kSlabCols / 8;  // chunks a pass spans per row
    constexpr int kPassSlabs = kWholeRows ? 1 : D / kSlabCols;        // slabs copied one after another
    constexpr int kRowsPerPass = kWarpgroupThreads / kChunks;
    static_assert(kWarpgroupThreads % kChunks == 0 && kRowsPerPass % kSwizzleAtomRows == 0 && D % kSlabCols == 0,
                  "a pass covers whole rows (of a slab), and a thread's rows share one swizzle phase");
    // This thread's chunk c of rows r0, r0 + kRowsPerPass, ...: the swizzle phase r % 8 is the
    // same for all of them, so the destination steps by whole 128-byte rows (as the producer has
    // few registers, nothing else is kept per row).
    const int c = ptid % kChunks, r0 = ptid / kChunks;
    const int n0 = n * Tr::kBlockN;
#pragma unroll 1
    for (int slab = 0; slab < kPassSlabs; ++slab) {
        const int col0 = slab * kSlabCols + 8 * c;
        const Src* col = base + head_off + col0;
        uint32_t to = smem_u32(dst) + sw128_offset(r0, col0, Tr::kBlockN);
#pragma unroll 1
        for (int r = r0; r < Tr::kBlockN; r += kRowsPerPass, to += kRowsPerPass * kSwizzleBytes) {
            const int j = n0 + r;
            const bool live = j < s.sk;
            // Rows past the sequence's last key: src-size 0 writes 16 zero bytes and reads nothing
            // (the address must still be a valid global one: the tensor's base).
            const Src* src = live ? col + fa_kv_row_offset(p, s, batch_stride, row_stride, j) : base;
            if constexpr (sizeof(Src) == 1) {
                const uint4 chunk = live ? fa_e4m3x8<T>(*reinterpret_cast<const uint64_t*>(src)) : make_uint4(0, 0, 0, 0);
                fa_st_shared_v4(to, chunk);
            } else {
                fa2::cp_async_16(to, src, live ? 16 : 0);
            }
        }
    }
}

// An FP8 cache's per-key scales of K/V tile n of sequence s into `scales` (the tile's scale slot,
// Cta::kv_scales: K's kBlockN then V's), by the producer warpgroup's threads, before the K tile's
// gather_commit publishes them; keys past the sequence's last are 0 (masked, and P is 0 there).
template <class Tr>
__device__ __forceinline__ void gather_kv_scales(const FwdParams& p, const FaSeq& s, int ptid, float* scales, int n,
                                                 int kv_head) {
    const float* ks = reinterpret_cast<const float*>(p.k_cache_scale);
    const float* vs = reinterpret_cast<const float*>(p.v_cache_scale);
#pragma unroll 1
    for (int r = ptid; r < Tr::kBlockN; r += kWarpgroupThreads) {
        const int j = n * Tr::kBlockN + r;
        const int64_t at = j < s.sk ? fa_kv_scale_index(p, s, j, kv_head) : -1;
        scales[r] = at >= 0 ? ks[at] : 0.f;
        scales[Tr::kBlockN + r] = at >= 0 ? vs[at] : 0.f;
    }
}

// After gather_tile: this thread's copies land, are made visible to the async proxy (wgmma
// reads the tile through descriptors), the producer warpgroup meets, and one thread arrives on
// the tile's full barrier (count 1: the same single arrival a TMA tile's expect_tx makes), which
// also publishes the scales gather_kv_scales wrote.
__device__ __forceinline__ void gather_commit(uint64_t* full, int ptid) {
    fa2::cp_async_commit();
    fa2::cp_async_wait<0>();
    fence_proxy_async_smem();
    named_bar_sync<kGatherBarrier, kWarpgroupThreads>();
    if (ptid == 0) mbar_arrive(full);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

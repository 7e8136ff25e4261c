// The FA3-style backward main kernel (sm_90a): dK, dV of one key block and dQ accumulated in f32,
// as FlashAttention-3's backward (Shah et al., arXiv 2407.08608) organises it. One CTA per
// (key block of kBlockN keys, kv head, batch), 384 threads in three warpgroups:
//   producer (warpgroup 0, setmaxnreg.dec): thread 0 loads K and V once by TMA (kv_full), then,
//     for every query head of the kv head's group and every query block that sees one of the
//     block's keys, Q and dO by TMA into a kStages-slot ring (q_full[slot]), after the consumers
//     released the slot (q_empty[slot], every consumer thread arrives).
//   consumers (warpgroups 1-2, setmaxnreg.inc): warpgroup cw owns keys 64cw.. of the block; per
//     query block
//       S^T = K Q^T and dP^T = V dO^T      (wgmma, both operands in shared memory)
//       P^T = exp2(S^T log2e scale - LSE), dS^T = P^T o (dP^T - D)     (registers; LSE and D
//                                           read from global: f32, one per query row)
//       dV += P^T dO, dK += dS^T Q          (wgmma, A from the registers above, B MN-major)
//       dQ += dS K                          (dS through shared memory as A fragments, K MN-major;
//                                           added to the f32 accumulator: fa2::red_add_f32, or
//                                           the deterministic mode's per-64-key partial)
//     then releases the slot and finally writes dK * scale and dV.
// D = rowsum(dO o O) and the dq conversion are the FA2 backward's preprocess and convert
// kernels (cuda/fa2/bwd_preprocess.cuh, bwd_convert.cuh), launched before and after this one
// with p.block_n = 64 (the width of one consumer's partial in deterministic mode).
// Not supported (the host must not route them here): softcap, ALiBi.
#pragma once
#include <stdint.h>

#include "common/bwd_params.h"
#include "common/cta.cuh"
#include "common/dtype.cuh"
#include "common/mask.cuh"
#include "fa2/bwd_mainloop.cuh"  // bwd_rows_seeing, kBwdLog2e
#include "fa3/bwd_traits.cuh"
#include "sm80/fast_math.cuh"
#include "sm80/red.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

namespace fa3 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Barrier block: [0] kv_full, [1 .. 1+S) q_full, [1+S .. 1+2S) q_empty.
template <class Tr>
struct BwdBarriers {
    uint64_t* kv_full;
    uint64_t* q_full;
    uint64_t* q_empty;
    __device__ __forceinline__ explicit BwdBarriers(uint8_t* smem) {
        uint64_t* b = reinterpret_cast<uint64_t*>(smem + Tr::kOffBarriers);
        kv_full = b;
        q_full = b + 1;
        q_empty = b + 1 + Tr::kStages;
    }
    __device__ __forceinline__ void init() {  // one thread
        mbar_init(kv_full, 1);
        for (int s = 0; s < Tr::kStages; ++s) {
            mbar_init(&q_full[s], 1);                         // the producer's expect_tx
            mbar_init(&q_empty[s], Tr::kConsumerThreads);     // every consumer thread
        }
        mbar_init_fence();
    }
};

// The query blocks [first, end) of kBlockM rows that hold a row seeing some key of the CTA's block.
template <class Tr>
struct BwdQueryBlocks {
    int first, end;
    __device__ __forceinline__ BwdQueryBlocks(const BwdParams& p, int n0) {
        const fa2::FaRowRange rows = fa2::bwd_rows_seeing(p, n0, min(n0 + Tr::kBlockN, p.seqlen_k));
        first = rows.first / Tr::kBlockM;
        end = rows.end > rows.first ? (rows.end + Tr::kBlockM - 1) / Tr::kBlockM : first;
    }
};

// The rows [row, row + rows) of every slab of a [b, s, h, d] tensor's map into an SW128 tile.
template <class Tr>
__device__ __forceinline__ void bwd_load_rows(uint8_t* dst, const TmaDesc* map, uint64_t* bar, int slab_stride,
                                              int row, int head, int batch) {
#pragma unroll
    for (int slab = 0; slab < Tr::kSlabs; ++slab)
        tma_load_4d(dst + slab * slab_stride, map, bar, slab * kSlabCols, head, row, batch);
}

// Producer thread: K, V once, then Q and dO of every (head of the group, query block).
template <class Tr>
__device__ __forceinline__ void bwd_produce(const BwdParams& p, uint8_t* smem, BwdBarriers<Tr>& bars,
                                            const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv,
                                            const TmaDesc* tdo, int n0, int kv_head, int batch,
                                            const BwdQueryBlocks<Tr>& blocks) {
    constexpr int S = Tr::kStages;
    tma_prefetch_desc(tq);
    tma_prefetch_desc(tk);
    tma_prefetch_desc(tv);
    tma_prefetch_desc(tdo);
    // Rows past seqlen_k are zero-filled by TMA (and counted in the transaction bytes).
    mbar_arrive_expect_tx(bars.kv_full, 2 * Tr::kKvBytes);
    bwd_load_rows<Tr>(smem + Tr::kOffK, tk, bars.kv_full, Tr::kKvSlabStride, n0, kv_head, batch);
    bwd_load_rows<Tr>(smem + Tr::kOffV, tv, bars.kv_full, Tr::kKvSlabStride, n0, kv_head, batch);
    const int group = p.heads_q / p.heads_kv;
    int it = 0;
    for (int hi = 0; hi < group; ++hi) {
        const int head = kv_head * group + hi;
        for (int mb = blocks.first; mb < blocks.end; ++mb, ++it) {
            const int slot = it % S;
            if (it >= S) mbar_wait(&bars.q_empty[slot], ((it / S) - 1) & 1);  // use it/S - 1 released
            mbar_arrive_expect_tx(&bars.q_full[slot], 2 * Tr::kQBytes);
            const int m0 = mb * Tr::kBlockM;  // < seqlen_q: the block holds a row that sees a key
            bwd_load_rows<Tr>(smem + Tr::kOffQ + slot * Tr::kQBytes, tq, &bars.q_full[slot], Tr::kQSlabStride, m0,
                              head, batch);
            bwd_load_rows<Tr>(smem + Tr::kOffDo + slot * Tr::kQBytes, tdo, &bars.q_full[slot], Tr::kQSlabStride, m0,
                              head, batch);
        }
    }
}

// Issues X^T[64 keys x kBlockM] = A[64 keys x D] B[kBlockM x D]^T (both K-major in SW128 slabs)
// into acc, as one wgmma group (committed, not waited for).
template <class Tr, class Elem>
__device__ __forceinline__ void bwd_issue_kt(float (&acc)[Tr::kBlockM / 2], uint32_t a_addr, uint32_t b_addr) {
#pragma unroll
    for (int kk = 0; kk < Tr::kHeadDim / kMmaK; ++kk)
        wgmma_m64n64k16_ss<Elem>(acc, desc_kmajor_sw128(a_addr + Tr::kmajor_offset(kk, Tr::kKvSlabStride)),
                                 desc_kmajor_sw128(b_addr + Tr::kmajor_offset(kk, Tr::kQSlabStride)), kk > 0 ? 1 : 0);
}

// acc[64 x D] += A[64 x 64] (A fragments a[k] for reduction rows 16k..) B[64 x D] (MN-major
// SW128 slabs slab_stride apart), one wgmma per (16-row step, 64-column block).
template <class Tr, class Elem>
__device__ __forceinline__ void bwd_issue_rs(float (&acc)[Tr::kHeadDim / 2], const uint32_t (&a)[4][4],
                                             uint32_t b_addr, int slab_stride) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int nh = 0; nh < Tr::kHeadDim / kMmaN; ++nh)
            wgmma_m64n64k16_rs_tb<Elem>(&acc[acc_index(nh * kMmaN / 8, 0, 0)], a[kk],
                                        desc_mnmajor_sw128(b_addr + Tr::mnmajor_offset(kk, nh, slab_stride),
                                                           slab_stride));
}

// The 128 threads of consumer warpgroup cw meet around its dS tile (named barrier 1 + cw).
template <class Tr>
__device__ __forceinline__ void bwd_ds_barrier(int cw) {
    if (cw == 0)
        named_bar_sync<Tr::kDsBarrier0, 128>();
    else
        named_bar_sync<Tr::kDsBarrier0 + 1, 128>();
}

template <class Elem, int D>
__device__ __forceinline__ void bwd_kernel(const BwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                           const TmaDesc* tv, const TmaDesc* tdo) {
    using Tr = Fa3BwdTraits<D>;
    constexpr int S = Tr::kStages;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = fa_cta::aligned_smem(smem_raw);
    BwdBarriers<Tr> bars(smem);
    const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const int n0 = n_block * Tr::kBlockN;
    const int tid = threadIdx.x, warpgroup = tid / 128;
    const BwdQueryBlocks<Tr> blocks(p, n0);
    const bool any = blocks.end > blocks.first;

    if (tid == 0) bars.init();
    __syncthreads();  // the last CTA-wide barrier: roles diverge below
    if (warpgroup == 0) {
        setmaxnreg_dec<Tr::kProducerRegs>();
        if (tid == 0 && any) bwd_produce<Tr>(p, smem, bars, tq, tk, tv, tdo, n0, kv_head, batch, blocks);
        return;
    }
    setmaxnreg_inc<Tr::kConsumerRegs>();
    const int cw = warpgroup - 1, t = tid % 128;
    const int w = t / 32, g = t % 32 / 4;  // fragment coordinates (sm90/wgmma.cuh)
    const int key0 = n0 + cw * Tr::kKeysPerWarpgroup;    // the warpgroup's first key
    const uint32_t k_addr = smem_u32(smem + Tr::kOffK) + cw * Tr::kKeysPerWarpgroup * kSwizzleBytes;
    const uint32_t v_addr = smem_u32(smem + Tr::kOffV) + cw * Tr::kKeysPerWarpgroup * kSwizzleBytes;
    Elem* s_ds = reinterpret_cast<Elem*>(smem + Tr::kOffDs + cw * Tr::kDsBytes);  // [query][key]
    const bool deterministic = (p.flags & FA_BWD_FLAG_DETERMINISTIC) != 0u;
    const float* g_lse = reinterpret_cast<const float*>(p.lse);
    const float* g_dsum = reinterpret_cast<const float*>(p.d_sum);

    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;

    if (any) mbar_wait(bars.kv_full, 0);  // K and V: loaded once
    const int group = p.heads_q / p.heads_kv;
    int it = 0;
    for (int hi = 0; hi < group; ++hi) {
        const int head = kv_head * group + hi;
        const int64_t row_base = (static_cast<int64_t>(batch) * p.heads_q + head) * p.seqlen_q;
        for (int mb = blocks.first; mb < blocks.end; ++mb, ++it) {
            const int slot = it % S, m0 = mb * Tr::kBlockM;
            const uint32_t q_addr = smem_u32(smem + Tr::kOffQ + slot * Tr::kQBytes);
            const uint32_t do_addr = smem_u32(smem + Tr::kOffDo + slot * Tr::kQBytes);
            mbar_wait(&bars.q_full[slot], (it / S) & 1);  // Q and dO of this block have landed
            const int tq4 = threadIdx.x % 4;  // re-read per block: kept live it spilled at hd 128

            // ---- S^T = K Q^T, dP^T = V dO^T: element (key 16w+g+8h, query 8j+2t+e) ----
            float s[Tr::kBlockM / 2], dp[Tr::kBlockM / 2];
            wgmma_fence();
            bwd_issue_kt<Tr, Elem>(s, k_addr, q_addr);
            bwd_issue_kt<Tr, Elem>(dp, v_addr, do_addr);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(s);
            fence_regs(dp);

            // ---- P^T and dS^T in place ----
            const bool full = m0 + Tr::kBlockM <= p.seqlen_q &&
                              !fa_tile_needs_mask(p, m0, m0 + Tr::kBlockM - 1, key0,
                                                  static_cast<long long>(key0) + Tr::kKeysPerWarpgroup - 1);
#pragma unroll
            for (int j = 0; j < Tr::kBlockM / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int query = m0 + 8 * j + 2 * tq4 + e;
                    const bool in = query < p.seqlen_q;
                    const float lse2 = in ? g_lse[row_base + query] * fa2::kBwdLog2e : 0.f;
                    const float dsum = in ? g_dsum[row_base + query] : 0.f;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int i = acc_index(j, h, e), key = key0 + 16 * w + g + 8 * h;
                        const bool visible = full || (in && fa_key_visible(p, query, key));
                        const float pr = visible ? fa_ex2_approx(fmaf(s[i], p.softmax_scale_log2, -lse2)) : 0.f;
                        s[i] = pr;
                        dp[i] = pr * (dp[i] - dsum);
                    }
                }

            // ---- dV += P^T dO, dK += dS^T Q (A fragments straight from the accumulators) ----
            uint32_t pa[4][4], dsa[4][4];
#pragma unroll
            for (int k = 0; k < 4; ++k)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    pa[k][r] = fa_pack2<Elem>(s[acc_to_a_index(k, r)], s[acc_to_a_index(k, r) + 1]);
                    dsa[k][r] = fa_pack2<Elem>(dp[acc_to_a_index(k, r)], dp[acc_to_a_index(k, r) + 1]);
                }
            wgmma_fence();
            bwd_issue_rs<Tr, Elem>(dv, pa, do_addr, Tr::kQSlabStride);
            bwd_issue_rs<Tr, Elem>(dk, dsa, q_addr, Tr::kQSlabStride);
            wgmma_commit();

            // ---- dS [query][key] to shared memory for dQ = dS K ----
#pragma unroll
            for (int j = 0; j < Tr::kBlockM / 8; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        s_ds[(8 * j + 2 * tq4 + e) * Tr::kDsStride + 16 * w + g + 8 * h] =
                            fa_from_float<Elem>(dp[acc_index(j, h, e)]);
            // dK and dV retired: P^T, dS^T fragments free (the register budget of hd 128), and
            // this thread's reads of Q and dO done, so the slot goes back to the producer.
            wgmma_wait<0>();
            fence_regs(dk);
            fence_regs(dv);
            mbar_arrive(&bars.q_empty[slot]);
            bwd_ds_barrier<Tr>(cw);  // the warpgroup's dS complete
            uint32_t qa[4][4];  // A fragments of dS: rows = queries 16w+g(+8), cols = keys 16k+2t(+8)
#pragma unroll
            for (int k = 0; k < 4; ++k)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    qa[k][r] = *reinterpret_cast<const uint32_t*>(
                        &s_ds[(16 * w + g + 8 * (r % 2)) * Tr::kDsStride + 16 * k + 2 * tq4 + 8 * (r / 2)]);
            bwd_ds_barrier<Tr>(cw);  // every thread has read dS before the next block rewrites it

            // ---- dQ += dS K, 64 columns at a time (32 accumulators: the register budget of
            // hd 128), into the f32 accumulator (deterministic: this warpgroup's own partial).
            // A warpgroup whose keys all lie past seqlen_k writes nothing (K is zero-filled there)
            // and has no partial (the conversion sums ceil(seqlen_k / 64) of them); the test is
            // in the store loop because a branch around the GEMM made ptxas spill at hd 128.
            // Atomic mode: warpgroup 0 adds its dQ before warpgroup 1 (named barrier), so each
            // element receives the CTA's two sums in a fixed order (both sync: warpgroup 0 after its
            // additions, so it cannot run a block ahead and arrive twice in one phase).
            if (!deterministic && cw == 1) named_bar_sync<Tr::kDqOrderBarrier, Tr::kConsumerThreads>();
            const int64_t part = deterministic ? static_cast<int64_t>(n_block) * Tr::kConsumerWarpgroups + cw : 0;
            float* acc = reinterpret_cast<float*>(p.dq_accum) +
                         (part * p.batch * p.heads_q * p.seqlen_q + row_base) * D;
#pragma unroll
            for (int nh = 0; nh < D / kMmaN; ++nh) {
                float dq[kMmaN / 2];
#pragma unroll
                for (int i = 0; i < kMmaN / 2; ++i) dq[i] = 0.f;
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
                    wgmma_m64n64k16_rs_tb<Elem>(dq, qa[kk],
                                                desc_mnmajor_sw128(k_addr + Tr::mnmajor_offset(kk, nh, Tr::kKvSlabStride),
                                                                   Tr::kKvSlabStride));
                wgmma_commit();
                wgmma_wait<0>();
                fence_regs(dq);
#pragma unroll
                for (int j = 0; j < kMmaN / 8; ++j)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int query = m0 + 16 * w + g + 8 * h;
                        if (query >= p.seqlen_q || key0 >= p.seqlen_k) continue;
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float* dst = acc + static_cast<int64_t>(query) * D + nh * kMmaN + 8 * j + 2 * tq4 + e;
                            if (deterministic)
                                *dst = dq[acc_index(j, h, e)];
                            else
                                fa2::red_add_f32(dst, dq[acc_index(j, h, e)]);
                        }
                    }
            }
            if (!deterministic && cw == 0) named_bar_sync<Tr::kDqOrderBarrier, Tr::kConsumerThreads>();
        }
    }

    // ---- dK (times the softmax scale) and dV of the warpgroup's keys ----
    Elem* g_dk = reinterpret_cast<Elem*>(p.dk) + batch * p.dk_batch_stride + kv_head * p.dk_head_stride;
    Elem* g_dv = reinterpret_cast<Elem*>(p.dv) + batch * p.dv_batch_stride + kv_head * p.dv_head_stride;
    const int tq4 = t % 4;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = key0 + 16 * w + g + 8 * h;
            if (key >= p.seqlen_k) continue;
            const int col = 8 * j + 2 * tq4;
            *reinterpret_cast<uint32_t*>(g_dk + static_cast<int64_t>(key) * p.dk_row_stride + col) =
                fa_pack2<Elem>(dk[acc_index(j, h, 0)] * p.softmax_scale, dk[acc_index(j, h, 1)] * p.softmax_scale);
            *reinterpret_cast<uint32_t*>(g_dv + static_cast<int64_t>(key) * p.dv_row_stride + col) =
                fa_pack2<Elem>(dv[acc_index(j, h, 0)], dv[acc_index(j, h, 1)]);
        }
}

#else  // not sm_90a (nvcc's host pass): the instances exist but do nothing.

template <class Elem, int D>
__device__ __forceinline__ void bwd_kernel(const BwdParams&, const TmaDesc*, const TmaDesc*, const TmaDesc*,
                                           const TmaDesc*) {}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

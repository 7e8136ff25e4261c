// FP8 (e4m3) consumer of the FA3 kernels, stage-1 structure (docs/fp8.md "On Hopper"): one
// warpgroup per 64 query rows, Q / K / Vᵀ codes copied by plain 16-byte loads into SW128 shared
// memory, S = Q Kᵀ and O += P V as e4m3 wgmma (wgmma_fp8_sm90.cuh), the softmax, mask and
// epilogue of the 16-bit FA3 kernels (fa3_fwd_sm90.cu, included below for its device code only).
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
// Host requirements: head_dim == 128; q/k row strides and base addresses multiples of 16 bytes;
// v_row_stride a multiple of 16.
#define FA3_ONLY_HDIM 0  // fa3_fwd_sm90.cu: its device code, none of its kernels
#include "fa3_fwd_sm90.cu"
#include "wgmma_fp8_sm90.cuh"

namespace fa3 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <int D>
struct Fp8Traits {
    static_assert(D == 128, "the FP8 consumer is instantiated for head_dim 128");
    using Tr = Fa3Traits<1, D>;  // softmax / mask / epilogue shapes: 64 rows x 128 keys
    static constexpr int kBlockM = kMmaM;
    static constexpr int kBlockN = 128;
    static_assert(Tr::kBlockN == kBlockN && Tr::kBlockM == kBlockM, "16-bit stage-1 tile");
    static constexpr int kThreads = kWarpgroupThreads;
    static constexpr int kSlabs = D / kSlabCols8;        // 128-column e4m3 slabs of Q and K
    static constexpr int kQBytes = kBlockM * D;          // [64 x D] e4m3
    static constexpr int kKBytes = kBlockN * D;          // [128 x D]
    static constexpr int kVBytes = D * kBlockN;          // Vᵀ [D x 128 keys]: one slab
    static constexpr int kOffQ = 0, kOffK = kQBytes, kOffV = kOffK + kKBytes;
    static constexpr int kSmemBytes = kOffV + kVBytes + kSwizzleAtomBytes;
    // S = Q Kᵀ, k32 step kk: Q slab kk / 4 at +32 (kk % 4); K likewise, keys 64nh.. 64 rows further.
    __host__ __device__ static constexpr int qk_a_offset(int kk) {
        return (kk / 4) * kBlockM * kSwizzleBytes + (kk % 4) * kMmaK8Bytes;
    }
    __host__ __device__ static constexpr int qk_b_offset(int kk, int nh) {
        return (kk / 4) * kBlockN * kSwizzleBytes + nh * kMmaN * kSwizzleBytes + (kk % 4) * kMmaK8Bytes;
    }
    // O += P V, keys 32kk.. (kk = 0..3), output columns 64nh..: Vᵀ rows 64nh.., +32 kk bytes.
    __host__ __device__ static constexpr int pv_b_offset(int kk, int nh) {
        return nh * kMmaN * kSwizzleBytes + kk * kMmaK8Bytes;
    }
    static_assert(kQBytes % kSwizzleAtomBytes == 0 && kKBytes % kSwizzleAtomBytes == 0, "whole atoms");
};

// Copies a [ROWS x COLS] e4m3 tile (rows [0, rows_valid), columns [0, cols_valid) of the source;
// the rest zero) into SW128 slabs with 16-byte loads.
template <int ROWS, int COLS>
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
        *reinterpret_cast<uint4*>(dst + sw128_offset8(r, 16 * c, ROWS)) = v;
    }
}

// The descale of row/key `i` (clamped into the sequence) of (batch, head).
__device__ __forceinline__ float descale_at(uint64_t base, const FwdParams& p, int bh, int seqlen, int i) {
    const int ii = max(0, min(i, seqlen - 1));
    const int blocks = p.descale_block > 0 ? (seqlen + p.descale_block - 1) / p.descale_block : 1;
    const int blk = p.descale_block > 0 ? ii / p.descale_block : 0;
    return reinterpret_cast<const float*>(base)[static_cast<int64_t>(bh) * blocks + blk];
}

// One K/V tile, synchronously (both stages): S = Q Kᵀ (e4m3), per-block descales on S, mask,
// online softmax, rescale O, P · 2^8 -> e4m3 A fragments, O' += P V per 64-key half under its V
// descale. q_addr / k_addr / v_addr: the shared addresses of the Q, K and Vᵀ tiles.
template <class F, class T, int D>
__device__ __forceinline__ void fp8_tile(const FwdParams& p, Acc<D>& acc, float (&s)[F::kBlockN / 2], const float (&dq)[2],
                                         float& dv_cur, const FragPos& fp, int m0, int n, int bhk, uint32_t q_addr,
                                         uint32_t k_addr, uint32_t v_addr) {
    using Tr = typename F::Tr;
    const int n0 = n * F::kBlockN;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / kMmaK8; ++kk) {
        const uint64_t da = desc_kmajor_sw128(q_addr + F::qk_a_offset(kk));
#pragma unroll
        for (int nh = 0; nh < F::kBlockN / kMmaN; ++nh)
            wgmma_m64n64k32_ss_e4m3(&s[acc_index(nh * kMmaN / 8, 0, 0)], da,
                                    desc_kmajor_sw128(k_addr + F::qk_b_offset(kk, nh)), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);

    // Per-block descales on S, per element of the tile.
#pragma unroll
    for (int c = 0; c < F::kBlockN / 8; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float dk = descale_at(p.k_descale, p, bhk, p.seqlen_k, n0 + 8 * c + fp.col0 + e);
#pragma unroll
            for (int h = 0; h < 2; ++h) s[acc_index(c, h, e)] *= dq[h] * dk;
        }

    softcap_and_mask<Tr>(p, s, fp, m0, n);
    float corr[2];
    online_softmax<Tr>(acc, s, p.softmax_scale_log2, corr);
    rescale_o<Tr>(acc, corr);

    // P · 2^8 -> e4m3 A fragments (the row sums above used the unscaled P).
    const float p_scale = exp2f(FA_FP8_P_SCALE_LOG2);
#pragma unroll
    for (int i = 0; i < F::kBlockN / 2; ++i) s[i] *= p_scale;
    uint32_t a[F::kBlockN / kMmaK8][4];
#pragma unroll
    for (int kk = 0; kk < F::kBlockN / kMmaK8; ++kk) acc_to_a8(&s[16 * kk], a[kk]);

    // Two 64-key halves, each under one V descale: O' *= dv_old / dv_new, then O' += P V.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float dv = descale_at(p.v_descale, p, bhk, p.seqlen_k, n0 + 64 * half);
        const float ratio = dv_cur == 0.f ? 1.f : dv_cur / dv;
        dv_cur = dv;
        if (ratio != 1.f) {
#pragma unroll
            for (int i = 0; i < D / 2; ++i) acc.o[i] *= ratio;
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 2 * half; kk < 2 * half + 2; ++kk)
#pragma unroll
            for (int nh = 0; nh < D / kMmaN; ++nh)
                wgmma_m64n64k32_rs_e4m3(&acc.o[acc_index(nh * kMmaN / 8, 0, 0)], a[kk],
                                        desc_kmajor_sw128(v_addr + F::pv_b_offset(kk, nh)));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(acc.o);
    }
}

template <class T, int D>
__device__ __forceinline__ void fp8_stage1(const FwdParams& p) {
    using F = Fp8Traits<D>;
    using Tr = typename F::Tr;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = aligned_smem(smem_raw);
    uint8_t* sq = smem + F::kOffQ;
    uint8_t* sk = smem + F::kOffK;
    uint8_t* sv = smem + F::kOffV;

    const int tid = threadIdx.x;
    const BlockCoord bc = block_coord(p);
    const int m0 = bc.m_block * F::kBlockM;
    const KvRange kv = kv_tile_range(p, m0, min(m0 + F::kBlockM, p.seqlen_q), F::kBlockN);
    const int bhq = bc.batch * p.heads_q + bc.head, bhk = bc.batch * p.heads_kv + bc.kv_head;

    const uint8_t* q = reinterpret_cast<const uint8_t*>(p.q) + bc.batch * p.q_batch_stride + m0 * p.q_row_stride +
                       bc.head * p.q_head_stride;
    const uint8_t* k = reinterpret_cast<const uint8_t*>(p.k) + bc.batch * p.k_batch_stride + bc.kv_head * p.k_head_stride;
    const uint8_t* vt = reinterpret_cast<const uint8_t*>(p.v) + bc.batch * p.v_batch_stride + bc.kv_head * p.v_head_stride;

    load_tile8<F::kBlockM, D>(sq, q, p.q_row_stride, p.seqlen_q - m0, D, tid);

    const FragPos fp = frag_pos(tid);
    // Q descales of this thread's two rows, constant over the K/V loop.
    float dq[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) dq[h] = descale_at(p.q_descale, p, bhq, p.seqlen_q, m0 + fp.row0 + 8 * h);

    Acc<D> acc;
    acc_init(acc);
    float dv_cur = 0.f;  // O holds O_true / dv_cur (0: nothing accumulated yet)
    float s[F::kBlockN / 2];
#pragma unroll
    for (int i = 0; i < F::kBlockN / 2; ++i) s[i] = 0.f;

    for (int n = kv.n_begin; n < kv.n_end; ++n) {
        __syncthreads();  // the previous tile's wgmmas have completed (wait 0) in every thread
        const int n0 = n * F::kBlockN;
        load_tile8<F::kBlockN, D>(sk, k + n0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - n0, D, tid);
        load_tile8<D, F::kBlockN>(sv, vt + n0, p.v_row_stride, D, p.seqlen_k - n0, tid);
        fence_proxy_async_smem();
        __syncthreads();

        fp8_tile<F, T, D>(p, acc, s, dq, dv_cur, fp, m0, n, bhk, smem_u32(sq), smem_u32(sk), smem_u32(sv));
    }
    // O_true = O' · dv · 2^-8, then the usual normalisation by the row sum.
    const float unscale = dv_cur * exp2f(-FA_FP8_P_SCALE_LOG2);
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc.o[i] *= unscale;
    write_output<Tr, T>(p, acc, fp, m0, bc.batch, bc.head);
}

// ---- stage 2: + TMA into a 2-slot K/V ring guarded by mbarriers (thread 0 issues), as the
// 16-bit stage 2. Tensor maps (UINT8, SWIZZLE_128B, box inner extent 128 bytes): Q and K as
// {d, heads, seqlen, batch} with boxes {128, 1, 64 | 128, 1}; Vᵀ as {keys (= seqlen_k), d, heads,
// batch} with box {128, D, 1, 1}, which lands as D rows of 128 keys: the K-major Vᵀ tile, keys
// past seqlen_k zero-filled.
template <int D>
struct Fp8Traits2 : Fp8Traits<D> {
    using Base = Fp8Traits<D>;
    static constexpr int kKvStages = 2;
    static constexpr int kOffQ = 0;
    static constexpr int kOffK = Base::kQBytes;
    static constexpr int kOffV = kOffK + kKvStages * Base::kKBytes;
    static constexpr int kOffBarriers = kOffV + kKvStages * Base::kVBytes;
    static constexpr int kNumBarriers = 1 + 2 * kKvStages;  // q_full, kv_full[2], kv_empty[2] (unused)
    static constexpr int kSmemUsed = kOffBarriers + 8 * kNumBarriers;
    static constexpr int kSmemBytes = kSmemUsed + kSwizzleAtomBytes;
    static_assert(kSmemBytes <= 227 * 1024, "sm_90 opt-in shared memory");
};

template <class F>
__device__ __forceinline__ void fp8_issue_q(const TmaDesc* tq, uint8_t* sq, uint64_t* bar, int m0, int head, int batch) {
    mbar_arrive_expect_tx(bar, F::kQBytes);
#pragma unroll
    for (int slab = 0; slab < F::kSlabs; ++slab)
        tma_load_4d(sq + slab * F::kBlockM * kSwizzleBytes, tq, bar, slab * kSlabCols8, head, m0, batch);
}

template <class F, int D>
__device__ __forceinline__ void fp8_issue_kv(const TmaDesc* tk, const TmaDesc* tv, uint8_t* sk, uint8_t* sv,
                                             uint64_t* bar, int slot, int n, int kv_head, int batch) {
    mbar_arrive_expect_tx(bar, F::kKBytes + F::kVBytes);
    uint8_t* dk = sk + slot * F::kKBytes;
#pragma unroll
    for (int slab = 0; slab < F::kSlabs; ++slab)
        tma_load_4d(dk + slab * F::kBlockN * kSwizzleBytes, tk, bar, slab * kSlabCols8, kv_head, n * F::kBlockN, batch);
    tma_load_4d(sv + slot * F::kVBytes, tv, bar, n * F::kBlockN, 0, kv_head, batch);
}

template <class T, int D>
__device__ __forceinline__ void fp8_stage2(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv) {
    using F = Fp8Traits2<D>;
    using Tr = typename F::Tr;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = aligned_smem(smem_raw);
    uint8_t* sq = smem + F::kOffQ;
    uint8_t* sk = smem + F::kOffK;
    uint8_t* sv = smem + F::kOffV;
    Barriers<F> bars(smem);

    const int tid = threadIdx.x;
    const BlockCoord bc = block_coord(p);
    const int m0 = bc.m_block * F::kBlockM;
    const KvRange kv = kv_tile_range(p, m0, min(m0 + F::kBlockM, p.seqlen_q), F::kBlockN);
    const int n_tiles = kv.n_end - kv.n_begin;
    const int bhq = bc.batch * p.heads_q + bc.head, bhk = bc.batch * p.heads_kv + bc.kv_head;
    const bool issuer = tid == 0;

    if (issuer) {
        mbar_init(bars.q_full, 1);
        for (int st = 0; st < F::kKvStages; ++st) mbar_init(&bars.kv_full[st], 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (issuer && n_tiles > 0) {
        tma_prefetch_desc(tq);
        tma_prefetch_desc(tk);
        tma_prefetch_desc(tv);
        fp8_issue_q<F>(tq, sq, bars.q_full, m0, bc.head, bc.batch);
        for (int it = 0; it < min(n_tiles, F::kKvStages); ++it)
            fp8_issue_kv<F, D>(tk, tv, sk, sv, &bars.kv_full[it], it, kv.n_begin + it, bc.kv_head, bc.batch);
    }

    const FragPos fp = frag_pos(tid);
    float dq[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) dq[h] = descale_at(p.q_descale, p, bhq, p.seqlen_q, m0 + fp.row0 + 8 * h);
    Acc<D> acc;
    acc_init(acc);
    float dv_cur = 0.f;
    float s[F::kBlockN / 2];
#pragma unroll
    for (int i = 0; i < F::kBlockN / 2; ++i) s[i] = 0.f;

    if (n_tiles > 0) consumer_wait(bars.q_full, 0);
    for (int it = 0; it < n_tiles; ++it) {
        const int slot = it % F::kKvStages;
        consumer_wait(&bars.kv_full[slot], (it / F::kKvStages) & 1);
        fp8_tile<F, T, D>(p, acc, s, dq, dv_cur, fp, m0, kv.n_begin + it, bhk, smem_u32(sq),
                          smem_u32(sk + slot * F::kKBytes), smem_u32(sv + slot * F::kVBytes));
        // Every thread waited for both wgmma groups reading this slot; after the CTA barrier the
        // slot may be refilled.
        __syncthreads();
        if (issuer && it + F::kKvStages < n_tiles)
            fp8_issue_kv<F, D>(tk, tv, sk, sv, &bars.kv_full[slot], slot, kv.n_begin + it + F::kKvStages, bc.kv_head,
                               bc.batch);
    }
    const float unscale = dv_cur * exp2f(-FA_FP8_P_SCALE_LOG2);
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc.o[i] *= unscale;
    write_output<Tr, T>(p, acc, fp, m0, bc.batch, bc.head);
}

// ---- stage 3: + warp specialisation, as the 16-bit stage 3: warpgroup 0 produces (TMA,
// setmaxnreg.dec), warpgroups 1-2 consume (setmaxnreg.inc), each on its own 64 of the CTA's 128
// query rows; K/Vᵀ slots are released through kv_empty barriers (every consumer thread arrives
// after its P V wgmma of the slot retired).
template <int D>
struct Fp8Traits3 : Fp8Traits<D> {
    using Base = Fp8Traits<D>;
    static constexpr int kConsumerWarpgroups = 2;
    static constexpr int kThreads = kWarpgroupThreads * (1 + kConsumerWarpgroups);
    static constexpr int kConsumerThreads = kWarpgroupThreads * kConsumerWarpgroups;
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = 240;
    static constexpr int kCtaRows = kMmaM * kConsumerWarpgroups;  // query rows per CTA
    static constexpr int kQBytes = kCtaRows * D;
    static constexpr int kKvStages = 2;
    static constexpr int kOffQ = 0;
    static constexpr int kOffK = kQBytes;
    static constexpr int kOffV = kOffK + kKvStages * Base::kKBytes;
    static constexpr int kOffBarriers = kOffV + kKvStages * Base::kVBytes;
    static constexpr int kNumBarriers = 1 + 2 * kKvStages;  // q_full, kv_full[2], kv_empty[2]
    static constexpr int kSmemUsed = kOffBarriers + 8 * kNumBarriers;
    static constexpr int kSmemBytes = kSmemUsed + kSwizzleAtomBytes;
    static_assert(kSmemBytes <= 227 * 1024, "sm_90 opt-in shared memory");
    // Q slabs hold the CTA's 128 rows; a consumer's rows start 64 rows into slab 0.
    __host__ __device__ static constexpr int qk_a_offset(int kk) {
        return (kk / 4) * kCtaRows * kSwizzleBytes + (kk % 4) * kMmaK8Bytes;
    }
};

template <class T, int D>
__device__ __forceinline__ void fp8_stage3(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv) {
    using F = Fp8Traits3<D>;
    using Tr = typename F::Tr;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = aligned_smem(smem_raw);
    uint8_t* sq = smem + F::kOffQ;
    uint8_t* sk = smem + F::kOffK;
    uint8_t* sv = smem + F::kOffV;
    Barriers<F> bars(smem);

    const int tid = threadIdx.x;
    const int warpgroup = tid / kWarpgroupThreads;
    const BlockCoord bc = block_coord(p);
    const int m0 = bc.m_block * F::kCtaRows;
    const KvRange kv = kv_tile_range(p, m0, min(m0 + F::kCtaRows, p.seqlen_q), F::kBlockN);
    const int n_tiles = kv.n_end - kv.n_begin;

    if (tid == 0) {
        mbar_init(bars.q_full, 1);
        for (int st = 0; st < F::kKvStages; ++st) {
            mbar_init(&bars.kv_full[st], 1);
            mbar_init(&bars.kv_empty[st], F::kConsumerThreads);
        }
        mbar_init_fence();
    }
    __syncthreads();  // the last CTA-wide barrier: roles diverge below

    if (warpgroup == 0) {
        setmaxnreg_dec<F::kProducerRegs>();
        if (tid == 0 && n_tiles > 0) {
            tma_prefetch_desc(tq);
            tma_prefetch_desc(tk);
            tma_prefetch_desc(tv);
            // Q: one 64-row box per slab and consumer; boxes starting past seqlen_q are skipped
            // (their rows only feed query rows that are never written).
            const int live = min(F::kConsumerWarpgroups, (p.seqlen_q - m0 + kMmaM - 1) / kMmaM);
            mbar_arrive_expect_tx(bars.q_full, live * kMmaM * D);
#pragma unroll
            for (int slab = 0; slab < F::kSlabs; ++slab)
                for (int rb = 0; rb < live; ++rb)
                    tma_load_4d(sq + slab * F::kCtaRows * kSwizzleBytes + rb * kMmaM * kSwizzleBytes, tq, bars.q_full,
                                slab * kSlabCols8, bc.head, m0 + rb * kMmaM, bc.batch);
            for (int it = 0; it < n_tiles; ++it) {
                const int slot = it % F::kKvStages;
                if (it >= F::kKvStages) mbar_wait(&bars.kv_empty[slot], ((it / F::kKvStages) - 1) & 1);
                fp8_issue_kv<F, D>(tk, tv, sk, sv, &bars.kv_full[slot], slot, kv.n_begin + it, bc.kv_head, bc.batch);
            }
        }
    } else {
        setmaxnreg_inc<F::kConsumerRegs>();
        const int cw = warpgroup - 1;  // consumer index: query rows 64cw..
        const int m_first = m0 + cw * kMmaM;
        const uint32_t q_addr = smem_u32(sq) + cw * kMmaM * kSwizzleBytes;
        const FragPos fp = frag_pos(tid % kWarpgroupThreads);
        const int bhq = bc.batch * p.heads_q + bc.head, bhk = bc.batch * p.heads_kv + bc.kv_head;
        float dq[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) dq[h] = descale_at(p.q_descale, p, bhq, p.seqlen_q, m_first + fp.row0 + 8 * h);
        Acc<D> acc;
        acc_init(acc);
        float dv_cur = 0.f;
        float s[F::kBlockN / 2];
#pragma unroll
        for (int i = 0; i < F::kBlockN / 2; ++i) s[i] = 0.f;

        if (n_tiles > 0) consumer_wait(bars.q_full, 0);
        for (int it = 0; it < n_tiles; ++it) {
            const int slot = it % F::kKvStages;
            consumer_wait(&bars.kv_full[slot], (it / F::kKvStages) & 1);
            fp8_tile<F, T, D>(p, acc, s, dq, dv_cur, fp, m_first, kv.n_begin + it, bhk, q_addr,
                              smem_u32(sk + slot * F::kKBytes), smem_u32(sv + slot * F::kVBytes));
            mbar_arrive(&bars.kv_empty[slot]);  // this thread's wgmma reads of the slot are done
        }
        const float unscale = dv_cur * exp2f(-FA_FP8_P_SCALE_LOG2);
#pragma unroll
        for (int i = 0; i < D / 2; ++i) acc.o[i] *= unscale;
        write_output<Tr, T>(p, acc, fp, m_first, bc.batch, bc.head);
    }
}

#else  // not sm_90a: the instances exist (so every target links) but do nothing.

template <class T, int D>
__device__ __forceinline__ void fp8_stage1(const FwdParams&) {}
template <class T, int D>
__device__ __forceinline__ void fp8_stage2(const FwdParams&, const TmaDesc*, const TmaDesc*, const TmaDesc*) {}
template <class T, int D>
__device__ __forceinline__ void fp8_stage3(const FwdParams&, const TmaDesc*, const TmaDesc*, const TmaDesc*) {}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

// Symbols: fa3fp8s<stage>_fwd_hd<D>_<output dtype>; stage 2 also takes the tensor maps of Q, K, Vᵀ.
#define FA3_FP8_S1(DT, T, D)                                                               \
    extern "C" __global__ void __launch_bounds__(fa3::kWarpgroupThreads, 1)                \
        fa3fp8s1_fwd_hd##D##_##DT(const __grid_constant__ FwdParams p) {                   \
        fa3::fp8_stage1<T, D>(p);                                                          \
    }
#define FA3_FP8_S2(DT, T, D)                                                                             \
    extern "C" __global__ void __launch_bounds__(fa3::kWarpgroupThreads, 1) fa3fp8s2_fwd_hd##D##_##DT(   \
        const __grid_constant__ FwdParams p, const __grid_constant__ fa3::TmaDesc tmap_q,                \
        const __grid_constant__ fa3::TmaDesc tmap_k, const __grid_constant__ fa3::TmaDesc tmap_vt) {     \
        fa3::fp8_stage2<T, D>(p, &tmap_q, &tmap_k, &tmap_vt);                                            \
    }
#define FA3_FP8_S3(DT, T, D)                                                                             \
    extern "C" __global__ void __launch_bounds__(fa3::Fp8Traits3<D>::kThreads, 1) fa3fp8s3_fwd_hd##D##_##DT( \
        const __grid_constant__ FwdParams p, const __grid_constant__ fa3::TmaDesc tmap_q,                \
        const __grid_constant__ fa3::TmaDesc tmap_k, const __grid_constant__ fa3::TmaDesc tmap_vt) {     \
        fa3::fp8_stage3<T, D>(p, &tmap_q, &tmap_k, &tmap_vt);                                            \
    }
#if defined(FA_FAMILY)
// A build.rs unit of the table row fa3fp8s3 (build/instances.rs): the stage-3 consumer and, in
// the same image, the pre-pass of its head dim (E = elements per lane, head_dim <= 32·E), so one
// loaded module holds both launches of the FP8 forward.
#define FA_FP8_PREPASS_NO_INSTANCES 1
#include "fp8_prepass.cu"
static_assert(FA_STAGE == 3, "fa3fp8s3: the stage-3 consumer");
#define FA3_FP8_PREPASS_E (FA_HEAD_DIM <= 32 ? 1 : FA_HEAD_DIM <= 64 ? 2 : FA_HEAD_DIM <= 128 ? 4 : 8)
static_assert(FA3_FP8_PREPASS_E == 4, "the instance below is written for head_dim 128");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The table and the traits must agree on the launch shape.
static_assert(FA_THREADS == fa3::Fp8Traits3<FA_HEAD_DIM>::kThreads, "table: threads");
static_assert(FA_BLOCK_M == fa3::Fp8Traits3<FA_HEAD_DIM>::kCtaRows, "table: block_m");
static_assert(FA_BLOCK_N == fa3::Fp8Traits3<FA_HEAD_DIM>::kBlockN, "table: block_n");
static_assert(FA_SMEM_BYTES == fa3::Fp8Traits3<FA_HEAD_DIM>::kSmemBytes,
              "table: dynamic shared memory (fa3_fp8_smem_bytes in build/instances.rs)");
#endif
#define FA3_FP8_TYPE_bf16 __nv_bfloat16
#define FA3_FP8_TYPE_f16 __half
#define FA3_FP8_UNIT_(DT, D) FA3_FP8_S3(DT, FA3_FP8_TYPE_##DT, D) FA_FP8_PREPASS_INSTANCE(DT, 4)
#define FA3_FP8_UNIT(DT, D) FA3_FP8_UNIT_(DT, D)
#define FA_INSTANCE(DT) FA3_FP8_UNIT(DT, FA_HEAD_DIM)
#else
FA3_FP8_S1(bf16, __nv_bfloat16, 128)
FA3_FP8_S1(f16, __half, 128)
FA3_FP8_S2(bf16, __nv_bfloat16, 128)
FA3_FP8_S2(f16, __half, 128)
FA3_FP8_S3(bf16, __nv_bfloat16, 128)
FA3_FP8_S3(f16, __half, 128)
#endif  // FA_FAMILY

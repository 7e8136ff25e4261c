// The FA3 pipeline between the TMA producer and the wgmma consumers: the mbarrier blocks
// (stages 2-3: one full/empty pair per K/V slot; stages 4-5: separate K and V barriers and a Q
// release), the consumer wait, the TMA issue of Q and K/V tiles, the ring positions carried
// across tiles, the producer's walk of one query tile, and the ping-pong token of stages 4-5.
#pragma once
#include "fa3/preamble.cuh"
#include "fa3/scheduler.cuh"
#include "fa3/serving.cuh"
#include "fa3/traits.cuh"
#include "sm90/mbarrier.cuh"
#include "sm90/tma.cuh"

namespace fa3 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Consumer-side wait: every thread polls, then the warp reconverges before the next
// `.sync.aligned` wgmma instruction (which requires all lanes to execute it together).
__device__ __forceinline__ void consumer_wait(uint64_t* bar, uint32_t parity) {
    mbar_wait(bar, parity);
    __syncwarp();
}

// Q rows [m0, m0 + kBlockM) of (head, batch): one 64-row box per slab per 64 rows. Boxes that
// start at or past seqlen_q are skipped (and not counted in expect_tx) rather than relying on
// TMA's behaviour for a box lying entirely out of bounds; their smem rows keep stale data, which
// only feeds query rows >= seqlen_q (row-wise softmax, never written back).
// Serving layouts (fa3/serving.cuh) give the tile's first row as a TMA row coordinate `row0`
// (packed q: the sequence's offset + m0) and `rows_left` = sq_b - m0.
template <class Tr>
__device__ __forceinline__ void issue_q_rows(const TmaDesc* tq, uint8_t* sq, uint64_t* bar, int row0,
                                             int rows_left, int head, int batch) {
    constexpr int kBoxes = Tr::kBlockM / Tr::kTmaBoxRowsQ;
    const int live = min(kBoxes, (rows_left + Tr::kTmaBoxRowsQ - 1) / Tr::kTmaBoxRowsQ);
    mbar_arrive_expect_tx(bar, live * (Tr::kTmaQBytes / kBoxes));
#pragma unroll
    for (int slab = 0; slab < Tr::kSlabs; ++slab)
#pragma unroll
        for (int rb = 0; rb < kBoxes; ++rb)
            if (rb < live)
                tma_load_4d(sq + Tr::q_box_offset(slab, rb), tq, bar, slab * Tr::kTmaBoxCols, head,
                            row0 + rb * Tr::kTmaBoxRowsQ, batch);
}
template <class Tr>
__device__ __forceinline__ void issue_q(const TmaDesc* tq, uint8_t* sq, uint64_t* bar, int m0,
                                        int seqlen_q, int head, int batch) {
    issue_q_rows<Tr>(tq, sq, bar, m0, seqlen_q - m0, head, batch);
}

// One operand of the K/V ring as its tiles are laid out: K (IsV false) has Q/K's head dim, V
// (IsV true) its own (Fa3Traits::kHeadDimV: narrower in the (192, 128) instance), so the two
// rings differ in slabs per row and bytes per tile.
template <class Tr, bool IsV>
struct KvOperand {
    static constexpr int kSlabs = Tr::kSlabs;
    static constexpr int kTileBytes = Tr::kKTileBytes;
};
template <class Tr>
struct KvOperand<Tr, true> {
    static constexpr int kSlabs = Tr::kSlabsV;
    static constexpr int kTileBytes = Tr::kVTileBytes;
};

// The TMA copies of K (or, IsV, V) tile n, every slab, into ring slot `slot`, completing on
// `bar` (the caller has announced the bytes with expect_tx).
// load_kv_rows: the same from TMA row coordinate `row` of map batch `batch` (serving layouts:
// a packed tensor's row, or a page's slot with the block index as the batch coordinate).
template <class Tr, bool IsV>
__device__ __forceinline__ void load_kv_rows(const TmaDesc* map, uint8_t* ring, uint64_t* bar, int slot, int row,
                                             int kv_head, int batch) {
    using Op = KvOperand<Tr, IsV>;
    uint8_t* dst = ring + slot * Op::kTileBytes;
#pragma unroll
    for (int slab = 0; slab < Op::kSlabs; ++slab)
        tma_load_4d(dst + Tr::kv_box_offset(slab), map, bar, slab * Tr::kTmaBoxCols, kv_head, row, batch);
}
template <class Tr, bool IsV>
__device__ __forceinline__ void load_kv_tile(const TmaDesc* map, uint8_t* ring, uint64_t* bar, int slot, int n,
                                             int kv_head, int batch) {
    load_kv_rows<Tr, IsV>(map, ring, bar, slot, n * Tr::kBlockN, kv_head, batch);
}

// V tile n into ring slot `slot`: as K, or, when Tr::kVTransposed (the FP8 consumer: 8-bit wgmma
// takes B K-major only, and P V reduces over keys), the one box {kBlockN keys, D rows, 1 head,
// 1 batch} of a Vᵀ map {keys, d, heads, batch}, which lands as the K-major [D x kBlockN] tile.
template <class Tr>
__device__ __forceinline__ void load_v_tile(const TmaDesc* map, uint8_t* ring, uint64_t* bar, int slot, int n,
                                            int kv_head, int batch) {
    if constexpr (Tr::kVTransposed)
        tma_load_4d(ring + slot * Tr::kVTileBytes, map, bar, n * Tr::kBlockN, 0, kv_head, batch);
    else
        load_kv_tile<Tr, true>(map, ring, bar, slot, n, kv_head, batch);
}

// The gathered copy of K (is_v false) or V tile n of sequence s into ring slot `slot`, by the
// 128 producer threads (ptid 0..127); published by gather_commit. Src: the stored element, 16-bit
// or an FP8 cache's code (T: the kernel's 16-bit dtype).
template <class Tr, class T, class Src>
__device__ __forceinline__ void gather_kv_of(const FwdParams& p, const FaSeq& s, int ptid, uint8_t* ring, int slot,
                                             int n, int kv_head, bool is_v) {
    const Src* base = reinterpret_cast<const Src*>(is_v ? p.v : p.k);
    const int64_t bs = is_v ? p.v_batch_stride : p.k_batch_stride;
    const int64_t rs = is_v ? p.v_row_stride : p.k_row_stride;
    const int64_t hs = is_v ? p.v_head_stride : p.k_head_stride;
    if (is_v)
        gather_tile<Tr, Tr::kHeadDimV, T>(ring + slot * Tr::kVTileBytes, p, s, base, bs, rs, kv_head * hs, n, ptid);
    else
        gather_tile<Tr, Tr::kHeadDim, T>(ring + slot * Tr::kKTileBytes, p, s, base, bs, rs, kv_head * hs, n, ptid);
}
template <class Tr, class T>
__device__ __forceinline__ void gather_kv(const FwdParams& p, const FaSeq& s, int ptid, uint8_t* ring, int slot, int n,
                                          int kv_head, bool is_v) {
    if (fa_kv_fp8(p))
        gather_kv_of<Tr, T, uint8_t>(p, s, ptid, ring, slot, n, kv_head, is_v);
    else
        gather_kv_of<Tr, T, uint16_t>(p, s, ptid, ring, slot, n, kv_head, is_v);
}

// Stages 4-5: the producer's copy of one K or V tile n of sequence s into ring slot `slot`,
// completing on `full` (count 1): TMA by thread 0 (expect_tx of the tile's bytes), or gathered
// by all 128 producer threads when gathered_tile says so, with an FP8 cache's K tile also the
// tile's scales into `scales` (its scale slot). Dense launches only ever take the TMA branch
// (and only thread 0 runs the producer then).
template <class Tr, class T>
__device__ __forceinline__ void produce_kv(const FwdParams& p, const FaSeq& s, int ptid, const TmaDesc* map,
                                           uint8_t* ring, uint64_t* full, int slot, int n, int kv_head, bool is_v,
                                           float* scales) {
    if constexpr (ServesLayouts<Tr>::value) {
        if (gathered_tile<Tr>(p, s, n)) {
            gather_kv<Tr, T>(p, s, ptid, ring, slot, n, kv_head, is_v);
            if (!is_v && fa_kv_fp8(p)) gather_kv_scales<Tr>(p, s, ptid, scales, n, kv_head);
            gather_commit(full, ptid);
            return;
        }
    }
    if (ptid == 0) {
        int row, batch;
        kv_tma_coords<Tr>(p, s, n, &row, &batch);
        mbar_arrive_expect_tx(full, is_v ? Tr::kVTileBytes : Tr::kKTileBytes);
        if (!is_v)
            load_kv_rows<Tr, false>(map, ring, full, slot, row, kv_head, batch);
        else if constexpr (Tr::kVTransposed)  // the FP8 consumer's Vᵀ (dense launches only)
            load_v_tile<Tr>(map, ring, full, slot, n, kv_head, batch);
        else
            load_kv_rows<Tr, true>(map, ring, full, slot, row, kv_head, batch);
    }
}

// Stage 3 on the serving layouts: K and V tile n into slot `slot`, both on kv_full[slot] (with an
// FP8 cache, and the tile's scales into `scales`, its scale slot).
template <class Tr, class T>
__device__ __forceinline__ void produce_kv_pair(const FwdParams& p, const FaSeq& s, int ptid, const TmaDesc* tk,
                                                const TmaDesc* tv, uint8_t* sk, uint8_t* sv, uint64_t* full,
                                                int slot, int n, int kv_head, float* scales) {
    if (gathered_tile<Tr>(p, s, n)) {
        gather_kv<Tr, T>(p, s, ptid, sk, slot, n, kv_head, false);
        gather_kv<Tr, T>(p, s, ptid, sv, slot, n, kv_head, true);
        if (fa_kv_fp8(p)) gather_kv_scales<Tr>(p, s, ptid, scales, n, kv_head);
        gather_commit(full, ptid);
    } else if (ptid == 0) {
        int row, batch;
        kv_tma_coords<Tr>(p, s, n, &row, &batch);
        mbar_arrive_expect_tx(full, Tr::kTmaKvBytes);
        load_kv_rows<Tr, false>(tk, sk, full, slot, row, kv_head, batch);
        load_kv_rows<Tr, true>(tv, sv, full, slot, row, kv_head, batch);
    }
}

// Stages 2-3: K and V tile n into ring slot `slot`, both counted on kv_full[slot].
template <class Tr>
__device__ __forceinline__ void issue_kv(const TmaDesc* tk, const TmaDesc* tv, uint8_t* sk,
                                         uint8_t* sv, uint64_t* bar, int slot, int n,
                                         int kv_head, int batch) {
    mbar_arrive_expect_tx(bar, Tr::kTmaKvBytes);
    load_kv_tile<Tr, false>(tk, sk, bar, slot, n, kv_head, batch);
    load_v_tile<Tr>(tv, sv, bar, slot, n, kv_head, batch);
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
    // One thread: q_full and kv_full complete on the issuer's expect_tx; kv_empty (stage 3 only,
    // empty_count > 0) on every consumer thread's release.
    __device__ __forceinline__ void init(uint32_t empty_count) {
        mbar_init(q_full, 1);
        for (int st = 0; st < Tr::kKvStages; ++st) {
            mbar_init(&kv_full[st], 1);
            if (empty_count > 0) mbar_init(&kv_empty[st], empty_count);
        }
        mbar_init_fence();
    }
    // The name and slot of barrier number i of the block (hang-check reports).
    __device__ static const char* name(int i, int* slot) {
        constexpr int S = Tr::kKvStages;
        *slot = i == 0 ? 0 : (i - 1) % S;
        return i == 0 ? "q_full" : i <= S ? "kv_full" : i <= 2 * S ? "kv_empty" : nullptr;
    }
};

// Stages 2-3: the issuing thread's side of a CTA's one query tile, Q and K/V tile `it` of it
// into ring slot it % S.
template <class Tr>
struct RingIssuer {
    const TmaDesc* tq;
    const TmaDesc* tk;
    const TmaDesc* tv;
    uint8_t* sq;
    uint8_t* sk;
    uint8_t* sv;
    Barriers<Tr>& bars;
    const OneTile<Tr>& tile;
    __device__ __forceinline__ void start(int seqlen_q) const {
        prefetch_maps(tq, tk, tv);
        issue_q<Tr>(tq, sq, bars.q_full, tile.m0, seqlen_q, tile.bc.head, tile.bc.batch);
    }
    __device__ __forceinline__ void kv(int it) const {
        const int slot = it % Tr::kKvStages;
        issue_kv<Tr>(tk, tv, sk, sv, &bars.kv_full[slot], slot, tile.kv.n_begin + it, tile.bc.kv_head, tile.bc.batch);
    }
};

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

// One query tile of one (head, sequence) seen by the producer: Q (after the previous Q was
// released), then K_j and V_j for every visible K/V tile j, each by TMA (thread ptid 0) or
// gathered (all 128 producer threads, serving launches: produce_kv). seq: the tile's sequence
// (fa3/serving.cuh; a dense launch's batch entry).
template <class Tr, class T>
__device__ __forceinline__ void produce_tile(const FwdParams& p, const FaSeq& seq, int ptid, const TmaDesc* tq,
                                             const TmaDesc* tk, const TmaDesc* tv, const Cta<Tr>& cta,
                                             SplitBarriers<Tr>& bars, const BlockCoord& bc, const KvRange& kv,
                                             RingPos& pos) {
    constexpr int S = Tr::kKvStages;
    const int n_tiles = kv.n_end - kv.n_begin;
    if (n_tiles <= 0) return;
    if (ptid == 0) {
        if (pos.q_use > 0) mbar_wait(bars.q_empty, (pos.q_use - 1) & 1);
        const int m0 = bc.m_block * Tr::kBlockM;
        issue_q_rows<Tr>(tq, cta.sq, bars.q_full, seq.q_row0 + m0, seq.sq - m0, bc.head, seq.q_batch);
    }
    ++pos.q_use;
    for (int j = 0; j < n_tiles; ++j, ++pos.kv_it) {
        const int slot = pos.kv_it % S;
        const uint32_t prev_use_parity = ((pos.kv_it / S) - 1) & 1;  // use kv_it/S - 1 released
        if (pos.kv_it >= S) mbar_wait(&bars.k_empty[slot], prev_use_parity);
        float* scales = nullptr;  // an FP8 cache's scale slot (serving instances)
        if constexpr (ServesLayouts<Tr>::value) scales = cta.kv_scales(pos.kv_it);
        produce_kv<Tr, T>(p, seq, ptid, tk, cta.sk, &bars.k_full[slot], slot, kv.n_begin + j, bc.kv_head, false, scales);
        if (pos.kv_it >= S) mbar_wait(&bars.v_empty[slot], prev_use_parity);
        produce_kv<Tr, T>(p, seq, ptid, tv, cta.sv, &bars.v_full[slot], slot, kv.n_begin + j, bc.kv_head, true, scales);
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

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

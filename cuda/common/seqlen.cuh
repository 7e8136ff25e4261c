// The per-sequence view of a launch: which query rows, LSE entries and key rows sequence b owns,
// read from FwdParams' serving fields (docs/serving.md "GPU"). It mirrors src/serving/layout.rs
// BatchLayout::{seqlen_q, seqlen_k, q_row, kv_row} one to one, and every family reads its
// sequences through it. A dense launch (every serving field 0) gets the dense layout: sequence b
// is batch b with seqlen_q x seqlen_k, so the same code serves both.
//
//   q/o    dense [batch, seqlen_q, heads, dim]: row i of b is (b, i);
//          packed (cu_seqlens_q) [1, total_q, heads, dim]: row i of b is (0, cu_seqlens_q[b] + i)
//   LSE    dense [batch, heads_q, seqlen_q]; packed [heads_q, total_q] (FlashAttention's layouts)
//   k/v    dense [batch, seqlen_k, ..]: key j of b is (b, j), sk_b = seqlen_k;
//          packed (cu_seqlens_k): (0, cu_seqlens_k[b] + j), sk_b the offsets' difference;
//          cache (seqused_k): (b, j), sk_b = seqused_k[b] + seqlen_new; with cache_batch_idx the
//          row is (cache_batch_idx[b], j), with cache_leftpad (cache_leftpad[b] = pad) key j is
//          cache position pad + j and sk_b = seqused_k[b] + seqlen_new - pad (masks and ALiBi
//          count keys from pad, as BatchLayout does; dense caches only);
//          paged (page_size > 0, block_table): slot j % page_size of block
//          block_table[b * block_table_batch_stride + j / page_size], sk_b as a cache's.
//   split-KV (num_splits > 1): split s of a sequence takes the key tiles fa_split_tiles gives and
//          writes its normalised output and LSE to o_accum [splits, lse rows, head_dim] and
//          lse_accum [splits, lse rows] (lse rows indexed as the LSE above), never to o / lse;
//          the combine kernel merges them. The grid's z is b * splits + s.
//
// Contract (the host validates it: BatchLayout::new): offsets non-decreasing from 0, lengths at
// most max_seqlen (p.seqlen_q / p.seqlen_k), used block ids in range. Callers look a key row up
// only for j < sk_b: table entries past a sequence's pages are not read (engines pad with -1).
//
// Plain C++ apart from the qualifiers, so the emulator compiles it unchanged.
#pragma once
#include <stdint.h>

#include "common/mask.cuh"
#include "common/params.h"

#define FA_SEQ_FN __host__ __device__ __forceinline__

// One sequence of the launch.
struct FaSeq {
    int b;                    // sequence (batch) index
    int sq, sk;               // its query rows and keys (cached + new)
    int q_batch, q_row0;      // its query row i is row q_row0 + i of batch q_batch (q and o)
    int kv_batch, kv_row0;    // not paged: its key j is row kv_row0 + j of batch kv_batch
    int64_t lse0;             // LSE index of (head 0, row 0)
    int64_t lse_head_stride;  // LSE index step per head (rows step 1)
};

// Batch entry b of a dense launch (the serving fields ignored): seqlen_q x seqlen_k, rows (b, i).
// fa_seq starts from it; a kernel instance that has no serving path reads only this.
FA_SEQ_FN FaSeq fa_seq_dense(const FwdParams& p, int b) {
    FaSeq s;
    s.b = b;
    s.sq = p.seqlen_q;
    s.q_batch = b;
    s.q_row0 = 0;
    s.lse0 = static_cast<int64_t>(b) * p.heads_q * p.seqlen_q;
    s.lse_head_stride = p.seqlen_q;
    s.sk = p.seqlen_k;
    s.kv_batch = b;
    s.kv_row0 = 0;
    return s;
}

FA_SEQ_FN FaSeq fa_seq(const FwdParams& p, int b) {
    FaSeq s = fa_seq_dense(p, b);
    if (p.cu_seqlens_q != 0) {
        const int32_t* cu = reinterpret_cast<const int32_t*>(p.cu_seqlens_q);
        const int start = cu[b];
        s.sq = cu[b + 1] - start;
        s.q_batch = 0;
        s.q_row0 = start;
        s.lse0 = start;
        s.lse_head_stride = p.total_q;
    }
    if (p.seqused_k != 0) {
        s.sk = reinterpret_cast<const int32_t*>(p.seqused_k)[b] + p.seqlen_new;
        if (p.cache_batch_idx != 0) s.kv_batch = reinterpret_cast<const int32_t*>(p.cache_batch_idx)[b];
        if (p.cache_leftpad != 0) {
            s.kv_row0 = reinterpret_cast<const int32_t*>(p.cache_leftpad)[b];
            s.sk -= s.kv_row0;
        }
    } else if (p.cu_seqlens_k != 0) {
        const int32_t* cu = reinterpret_cast<const int32_t*>(p.cu_seqlens_k);
        s.kv_batch = 0;
        s.kv_row0 = cu[b];
        s.sk = cu[b + 1] - cu[b];
    }
    return s;
}

// The mask's view of sequence s (cuda/common/mask.cuh): bottom-right aligned on sq_b x sk_b.
FA_SEQ_FN FaMaskDims fa_seq_mask(const FwdParams& p, const FaSeq& s) {
    return FaMaskDims{p.window_left, p.window_right, s.sq, s.sk};
}

// Element offset of query row i (of head `head`) in q, and in o.
FA_SEQ_FN int64_t fa_q_offset(const FwdParams& p, const FaSeq& s, int head, int i) {
    return static_cast<int64_t>(s.q_batch) * p.q_batch_stride + static_cast<int64_t>(s.q_row0 + i) * p.q_row_stride +
           static_cast<int64_t>(head) * p.q_head_stride;
}
FA_SEQ_FN int64_t fa_o_offset(const FwdParams& p, const FaSeq& s, int head, int i) {
    return static_cast<int64_t>(s.q_batch) * p.o_batch_stride + static_cast<int64_t>(s.q_row0 + i) * p.o_row_stride +
           static_cast<int64_t>(head) * p.o_head_stride;
}

// LSE index of query row i of head `head` (also the row index of the split-KV accumulators).
FA_SEQ_FN int64_t fa_lse_index(const FaSeq& s, int head, int i) { return s.lse0 + head * s.lse_head_stride + i; }

// Rows of the LSE: batch * heads_q * seqlen_q dense, heads_q * total_q packed.
FA_SEQ_FN int64_t fa_lse_rows(const FwdParams& p) {
    return p.cu_seqlens_q != 0 ? static_cast<int64_t>(p.heads_q) * p.total_q
                               : static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
}

// Where key j of sequence s lies in a paged cache: slot `slot` of block `block` (the block the
// table names). Only for j < s.sk (table entries past a sequence's pages are not read).
struct FaPage {
    int block, slot;
};
FA_SEQ_FN FaPage fa_kv_page(const FwdParams& p, const FaSeq& s, int j) {
    const int32_t* row =
        reinterpret_cast<const int32_t*>(p.block_table) + static_cast<int64_t>(s.b) * p.block_table_batch_stride;
    return FaPage{row[j / p.page_size], j % p.page_size};
}

// Element offset of key row j (head 0) of sequence s in a k- or v-shaped tensor with these batch
// and row strides (k's for K, v's for V; add kv_head * head_stride). Paged: the block the table
// names (batch_stride steps blocks, row_stride slots). Only for j < s.sk.
FA_SEQ_FN int64_t fa_kv_row_offset(const FwdParams& p, const FaSeq& s, int64_t batch_stride, int64_t row_stride,
                                   int j) {
    if (p.page_size > 0) {
        const FaPage pg = fa_kv_page(p, s, j);
        return static_cast<int64_t>(pg.block) * batch_stride + static_cast<int64_t>(pg.slot) * row_stride;
    }
    return static_cast<int64_t>(s.kv_batch) * batch_stride + static_cast<int64_t>(s.kv_row0 + j) * row_stride;
}

// ---- split-KV ----------------------------------------------------------------------------------
FA_SEQ_FN int fa_num_splits(const FwdParams& p) { return p.num_splits > 1 ? p.num_splits : 1; }

// The sequence and split of a CTA from its grid z (b * splits + split).
struct FaBatchSplit {
    int b, split;
};
FA_SEQ_FN FaBatchSplit fa_batch_split(const FwdParams& p, int z) {
    const int n = fa_num_splits(p);
    return FaBatchSplit{z / n, z % n};
}

// The key tiles (of block_n keys) [n_begin, n_end) split `split` of `splits` takes from the
// ceil(sk / block_n) tiles of a sequence: ceil(tiles / splits) each, so trailing splits may be
// empty (n_begin == n_end). With one split: every tile. Kernels intersect it with the mask's
// fa_key_tiles.
FA_SEQ_FN FaKeyTiles fa_split_tiles(int sk, int splits, int split, int block_n) {
    const int tiles = (sk + block_n - 1) / block_n;
    if (splits <= 1) return FaKeyTiles{0, tiles};
    const int per = (tiles + splits - 1) / splits;
    const long long b = static_cast<long long>(split) * per, e = b + per;
    return FaKeyTiles{static_cast<int>(b < tiles ? b : tiles), static_cast<int>(e < tiles ? e : tiles)};
}

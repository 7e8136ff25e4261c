// The one FFI struct between Rust and every forward kernel: passed by value as
// `const __grid_constant__ FwdParams`. Mirrored field for field by `src/cuda/params.rs`; both
// sides assert the size and every offset, so a change on one side alone fails the build.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bits of FwdParams::flags.
#define FA_FLAG_RETURN_LSE 1u  // write lse[b, h, i] (natural log)
#define FA_FLAG_SOFTCAP 2u     // s = softcap * tanh(s / softcap) before ALiBi and mask
#define FA_FLAG_ALIBI 4u       // s += -alibi[h] * |i + seqlen_k - seqlen_q - j|
#define FA_FLAG_ROTARY_INTERLEAVED 8u   // rotary pairs (2i, 2i+1); unset: (i, i + rotary_dim/2)
#define FA_FLAG_KV_FP8 16u              // k, v (and the cache the append writes) hold e4m3 codes
#define FA_FLAG_KV_SCALE_PER_TOKEN 32u  // k/v_cache_scale per (slot, kv head); unset: one each
#define FA_FLAG_ROTARY_Q_ADVANCE 64u    // q row i rotates at seqlens[b] + i; unset: every row at seqlens[b]

typedef struct FwdParams {
    // Device addresses. q, k, v, o: [batch, seqlen, heads, head_dim], head_dim contiguous.
    uint64_t q, k, v, o;
    uint64_t lse;           // f32 [batch, heads_q, seqlen_q], or 0
    uint64_t alibi_slopes;  // f32 [heads_q], or 0
    // FP8 descales (f32), one per (batch, head, block of `descale_block` rows); 0 when unused.
    uint64_t q_descale, k_descale, v_descale;
    // Element strides of batch, seqlen and heads.
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int32_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
    // Visible keys of query i: i + seqlen_k - seqlen_q - window_left <= j <=
    // i + seqlen_k - seqlen_q + window_right; -1 = unbounded. Causal: window_right = 0.
    int32_t window_left, window_right;
    int32_t descale_block;  // rows per FP8 scale block (0 when unused)
    float softmax_scale;       // natural units, multiplies q.k
    float softmax_scale_log2;  // score units -> log2 units: softmax_scale * log2(e) for raw q.k scores,
                               // log2(e) for natural-unit scores (softcap or ALiBi on)
    float softcap;             // cap (0 when off)
    uint32_t flags;            // FA_FLAG_*
    uint32_t reserved;         // keeps the size a multiple of 8

    // ---- serving (docs/serving.md "GPU"): all 0 on a dense launch.
    // Mirrors src/serving/layout.rs BatchLayout; the per-sequence view is cuda/common/seqlen.cuh.
    // With any of these set, batch/seqlen_q/seqlen_k above are the batch and the longest sequence
    // (max_seqlen_q/k: the grid's size and the mask's clamp), not every sequence's length.
    uint64_t cu_seqlens_q;  // i32 [batch + 1]: q/o packed [1, total_q, heads, dim]; LSE then [heads_q, total_q]
    uint64_t cu_seqlens_k;  // i32 [batch + 1]: k/v packed [1, total_k, heads_kv, dim]
    uint64_t seqused_k;     // i32 [batch]: keys cached before this call's seqlen_new rows (cache_seqlens)
    uint64_t block_table;   // i32 [batch, block_table_batch_stride]: k/v paged [num_blocks, page_size, heads_kv, dim]
    uint64_t knew, vnew;    // [batch, seqlen_new, heads_kv, dim]: rows the append kernel writes into the cache
    uint64_t o_accum;       // f32 [num_splits, lse rows, head_dim]: split-KV partial outputs (normalised)
    uint64_t lse_accum;     // f32 [num_splits, lse rows]: their LSEs (natural log, -inf: no key)
    int64_t knew_batch_stride, knew_row_stride, knew_head_stride;
    int64_t vnew_batch_stride, vnew_row_stride, vnew_head_stride;
    int32_t block_table_batch_stride;  // entries per row of block_table (max_blocks_per_seq)
    int32_t page_size;                 // keys per block (any >= 1); 0 = not paged
    int32_t num_splits;                // key splits (split-KV); 0 or 1 = none
    int32_t seqlen_new;                // rows appended per sequence by this call (0: none)
    int32_t total_q;                   // rows of a packed q (the packed LSE's head stride); 0 when dense
    // k/v's two outer extents [kv_batches, kv_rows, heads_kv, dim] as BatchLayout holds them:
    // (1, total_k) packed, (batch, capacity) a cache, (num_blocks, page_size) paged; 0 on a dense
    // launch (batch, seqlen_k). Host-side only: the TMA maps of FA3/FA4 need the tensor's extent.
    int32_t kv_rows;
    int32_t kv_batches;
    uint32_t reserved2;                // keeps the size a multiple of 8

    // Attention sinks: f32 [heads_q], one logit per query head (natural units, -inf: none) in
    // every row's softmax denominator with no value (common/softmax.cuh fa_softmax_finalize_sink);
    // 0: no sinks. A split-KV launch's splits do not fold it: the combine kernel does, once.
    uint64_t sinks;

    // ---- what engines' serving paths need beside the layout (0: off).
    int32_t head_dim_v;  // V's and O's head dim; 0 = head_dim (Q/K's)
    int32_t rotary_dim;  // rotary embedding of k_new (append) and q over their first rotary_dim
                         // dims, at positions seqlens[b] + i; 0 = none (FA_FLAG_ROTARY_INTERLEAVED)
    uint64_t rotary_cos, rotary_sin;  // f32 [seqlen_ro, rotary_dim / 2]
    uint64_t cache_batch_idx;  // i32 [batch]: sequence b reads and writes cache row cache_batch_idx[b]
    uint64_t cache_leftpad;    // i32 [batch]: sequence b's keys start at cache position cache_leftpad[b]
    // FP8 KV cache (FA_FLAG_KV_FP8): a code c with scale s stands for e4m3(c) * s. f32 [1] each,
    // or with FA_FLAG_KV_SCALE_PER_TOKEN [kv_batches, kv_rows, heads_kv] (the cache without dim).
    uint64_t k_cache_scale, v_cache_scale;
} FwdParams;

#ifdef __cplusplus
}  // extern "C"
#endif

#ifdef __cplusplus
#include <cstddef>
static_assert(sizeof(FwdParams) == 432, "FwdParams size: update src/cuda/params.rs too");
static_assert(offsetof(FwdParams, q_batch_stride) == 72, "FwdParams layout");
static_assert(offsetof(FwdParams, batch) == 168, "FwdParams layout");
static_assert(offsetof(FwdParams, window_left) == 192, "FwdParams layout");
static_assert(offsetof(FwdParams, softmax_scale) == 204, "FwdParams layout");
static_assert(offsetof(FwdParams, flags) == 216, "FwdParams layout");
static_assert(offsetof(FwdParams, cu_seqlens_q) == 224, "FwdParams layout");
static_assert(offsetof(FwdParams, block_table) == 248, "FwdParams layout");
static_assert(offsetof(FwdParams, o_accum) == 272, "FwdParams layout");
static_assert(offsetof(FwdParams, knew_batch_stride) == 288, "FwdParams layout");
static_assert(offsetof(FwdParams, vnew_head_stride) == 328, "FwdParams layout");
static_assert(offsetof(FwdParams, block_table_batch_stride) == 336, "FwdParams layout");
static_assert(offsetof(FwdParams, num_splits) == 344, "FwdParams layout");
static_assert(offsetof(FwdParams, total_q) == 352, "FwdParams layout");
static_assert(offsetof(FwdParams, kv_rows) == 356, "FwdParams layout");
static_assert(offsetof(FwdParams, kv_batches) == 360, "FwdParams layout");
static_assert(offsetof(FwdParams, sinks) == 368, "FwdParams layout");
static_assert(offsetof(FwdParams, head_dim_v) == 376, "FwdParams layout");
static_assert(offsetof(FwdParams, rotary_cos) == 384, "FwdParams layout");
static_assert(offsetof(FwdParams, cache_batch_idx) == 400, "FwdParams layout");
static_assert(offsetof(FwdParams, k_cache_scale) == 416, "FwdParams layout");
#endif

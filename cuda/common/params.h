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
} FwdParams;

#ifdef __cplusplus
}  // extern "C"
#endif

#ifdef __cplusplus
#include <cstddef>
static_assert(sizeof(FwdParams) == 224, "FwdParams size: update src/cuda/params.rs too");
static_assert(offsetof(FwdParams, q_batch_stride) == 72, "FwdParams layout");
static_assert(offsetof(FwdParams, batch) == 168, "FwdParams layout");
static_assert(offsetof(FwdParams, window_left) == 192, "FwdParams layout");
static_assert(offsetof(FwdParams, softmax_scale) == 204, "FwdParams layout");
static_assert(offsetof(FwdParams, flags) == 216, "FwdParams layout");
#endif

// The one FFI struct between Rust and the backward kernels (cuda/fa2_bwd.cu): passed by value as
// `const __grid_constant__ BwdParams`. Mirrored field for field by `src/cuda/bwd_params.rs`; both
// sides assert the size and every offset, so a change on one side alone fails the build.
#pragma once
#include <stdint.h>

#include "common/params.h"  // FA_FLAG_SOFTCAP, FA_FLAG_ALIBI (the forward's meaning)

#ifdef __cplusplus
extern "C" {
#endif

// Bits of BwdParams::flags beside FA_FLAG_SOFTCAP and FA_FLAG_ALIBI.
// dq accumulated without floating-point atomics: every key block writes its own f32 partial of
// dq (dq_accum [num_key_blocks, ...]) and the convert kernel sums them in key-block order, so
// the result is bit-identical run to run.
#define FA_BWD_FLAG_DETERMINISTIC 8u

typedef struct BwdParams {
    // Device addresses. q, k, v, o, d_o, dq, dk, dv: [batch, seqlen, heads, head_dim], head_dim
    // contiguous; dk, dv have k's shape (heads_kv), dq and d_o q's.
    uint64_t q, k, v, o, d_o;
    uint64_t lse;       // f32 [batch, heads_q, seqlen_q], natural log, from the forward
    uint64_t d_sum;     // f32 [batch, heads_q, seqlen_q]: D = rowsum(dO * O) (the preprocess writes it)
    uint64_t dq_accum;  // f32 [dq_accum_splits, batch, heads_q, seqlen_q, head_dim]
    uint64_t dq, dk, dv;
    uint64_t alibi_slopes;  // f32 [heads_q], or 0
    // Element strides of batch, seqlen and heads.
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int64_t do_batch_stride, do_row_stride, do_head_stride;
    int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
    int32_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
    // The forward's mask (common/mask.cuh): -1 = unbounded; causal = window_right 0.
    int32_t window_left, window_right;
    float softmax_scale;       // natural units, multiplies q.k
    float softmax_scale_log2;  // softmax_scale * log2(e) for raw scores, log2(e) for natural ones
    float softcap;             // cap (0 when off)
    uint32_t flags;            // FA_FLAG_SOFTCAP | FA_FLAG_ALIBI | FA_BWD_FLAG_DETERMINISTIC
    int32_t dq_accum_splits;   // 1, or the key blocks of the main kernel (deterministic)
    int32_t block_n;           // keys per key block of the main kernel (the partials' width)
    // Attention sinks (the forward's FwdParams::sinks): f32 [heads_q] logits (natural units, -inf:
    // none), or 0. Their gradient goes to d_sinks (f32 [heads_q], written by fa2_bwd_sink_grad,
    // cuda/fa2/bwd_sink_grad.cuh), or 0 when the caller takes none. dq, dk, dv need neither:
    // the LSE already holds the sink's term.
    uint64_t sinks;
    uint64_t d_sinks;
} BwdParams;

#ifdef __cplusplus
}  // extern "C"
#endif

#ifdef __cplusplus
#include <cstddef>
static_assert(sizeof(BwdParams) == 360, "BwdParams size: update src/cuda/bwd_params.rs too");
static_assert(offsetof(BwdParams, alibi_slopes) == 88, "BwdParams layout");
static_assert(offsetof(BwdParams, q_batch_stride) == 96, "BwdParams layout");
static_assert(offsetof(BwdParams, dv_head_stride) == 280, "BwdParams layout");
static_assert(offsetof(BwdParams, batch) == 288, "BwdParams layout");
static_assert(offsetof(BwdParams, window_left) == 312, "BwdParams layout");
static_assert(offsetof(BwdParams, softmax_scale) == 320, "BwdParams layout");
static_assert(offsetof(BwdParams, flags) == 332, "BwdParams layout");
static_assert(offsetof(BwdParams, dq_accum_splits) == 336, "BwdParams layout");
static_assert(offsetof(BwdParams, block_n) == 340, "BwdParams layout");
static_assert(offsetof(BwdParams, sinks) == 344, "BwdParams layout");
static_assert(offsetof(BwdParams, d_sinks) == 352, "BwdParams layout");
#endif

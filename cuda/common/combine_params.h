// The parameters of the combine kernel (cuda/combine.cu): merges n attention states
// (o_i, lse_i) of the same query rows over disjoint key sets into one (o, lse), the split-KV
// combine and the device `merge_states`. Passed by value as `const __grid_constant__
// CombineParams`; mirrored field for field by src/cuda/combine.rs (both sides assert the size
// and the offsets).
//
// Rows are (b, s, h) of a [batch, seqlen, heads] grid (a packed varlen batch is batch 1, seqlen
// total_q). Every address is "base + b·stride[0] + s·stride[1] + h·stride[2]", in elements, then
// + c for column c of an output row (head_dim contiguous).
//
// States: `n_inputs` descriptors, each holding `states_per_input` states `o_state_stride` /
// `lse_state_stride` elements apart; state i is state (i % states_per_input) of input
// (i / states_per_input). So the split-KV partials o_accum [splits, batch, hq, seqlen_q, d] are
// one input of `splits` states, and merge_states_n's list is n inputs of one state each.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Warps per CTA; each warp merges one row on its own.
#define FA_COMBINE_WARPS 4
// Input descriptors one launch carries (the list form of merge_states_n).
#define FA_COMBINE_MAX_INPUTS 64
// Largest head_dim (16 columns per lane): the FA2 forward's largest instance.
#define FA_COMBINE_MAX_HEAD_DIM 512

typedef struct CombineInput {
    uint64_t o;             // device address of the outputs (f32, f16 or bf16: the kernel's input type)
    uint64_t lse;           // device address of the f32 LSEs (natural log)
    int64_t o_strides[3];   // element strides of o over (b, s, h)
} CombineInput;

typedef struct CombineParams {
    uint64_t out_o;            // device address of the merged output (the kernel's output type)
    uint64_t out_lse;          // device address of the merged f32 LSE; 0: not written
    int64_t out_strides[3];    // element strides of out_o over (b, s, h)
    int64_t out_lse_strides[3];
    int64_t lse_strides[3];    // element strides of every input's LSE over (b, s, h)
    int64_t o_state_stride;    // elements between consecutive states of one input's o
    int64_t lse_state_stride;  // ... and of its LSE
    int32_t batch, seqlen, heads, head_dim;
    int32_t n_inputs;          // 1..=FA_COMBINE_MAX_INPUTS
    int32_t states_per_input;  // >= 1
    uint64_t sinks;            // f32 [heads]: a sink logit per head merged as the state (o = 0, lse = sink),
                               // -inf: none; 0: no sinks (split-KV folds the forward's sinks here, once)
    CombineInput in[FA_COMBINE_MAX_INPUTS];
} CombineParams;

#ifdef __cplusplus
}  // extern "C"
#endif

#ifdef __cplusplus
#include <cstddef>
static_assert(sizeof(CombineInput) == 40, "CombineInput size: update src/cuda/combine.rs too");
static_assert(offsetof(CombineParams, out_strides) == 16, "CombineParams layout");
static_assert(offsetof(CombineParams, lse_strides) == 64, "CombineParams layout");
static_assert(offsetof(CombineParams, o_state_stride) == 88, "CombineParams layout");
static_assert(offsetof(CombineParams, batch) == 104, "CombineParams layout");
static_assert(offsetof(CombineParams, n_inputs) == 120, "CombineParams layout");
static_assert(offsetof(CombineParams, sinks) == 128, "CombineParams layout");
static_assert(offsetof(CombineParams, in) == 136, "CombineParams layout");
static_assert(sizeof(CombineParams) == 136 + 40 * FA_COMBINE_MAX_INPUTS, "CombineParams size: update src/cuda/combine.rs too");
// Kernel parameters are limited to 4 KiB on every driver the crate supports.
static_assert(sizeof(CombineParams) <= 4096, "CombineParams must fit the 4 KiB kernel parameter space");
#endif

// The parameters of the FP8 pre-pass (cuda/fp8_prepass.cu): bf16/f16 operands in, e4m3 codes and
// one f32 scale per (batch, head, block of rows) out, the Hadamard rotation optional per operand.
// Passed by value as `const __grid_constant__ Fp8PrepassParams`; mirrored field for field by
// src/cuda/fp8.rs (both sides assert the size and the offsets).
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Warps per CTA of the pre-pass; each warp quantises one scale block (work item) on its own.
#define FA_FP8_PREPASS_WARPS 4
// Operands one launch can carry (Q and K together; V alone).
#define FA_FP8_PREPASS_MAX_OPS 2

// Bits of Fp8PrepassOperand::flags.
#define FA_FP8_ROTATE 1u  // rows are rotated by H·D/sqrt(d) (seeded) before quantisation

typedef struct Fp8PrepassOperand {
    uint64_t x;       // device address of the bf16/f16 input [batch, seqlen, heads, head_dim]
    uint64_t codes;   // device address of the e4m3 codes (strides below, in bytes)
    uint64_t scales;  // device address of the f32 scales, contiguous [batch, heads, blocks]
    // Element strides of the input (batch, seqlen, heads; head_dim contiguous).
    int64_t x_batch_stride, x_row_stride, x_head_stride;
    // Byte strides of the codes (batch, seqlen, heads, head_dim): [b, s, h, d] contiguous is
    // (s·h·d, h·d, d, 1); V transposed for the K-major PV operand, [b, h, d, s_pad], is
    // (h·d·s_pad, 1, d·s_pad, s_pad).
    int64_t c_batch_stride, c_row_stride, c_head_stride, c_dim_stride;
    int32_t batch, seqlen, heads;
    int32_t block_rows;  // rows per scale (seqlen for one scale per (batch, head))
    int32_t blocks;      // ceil(seqlen / block_rows)
    uint32_t flags;      // FA_FP8_*
} Fp8PrepassOperand;

typedef struct Fp8PrepassParams {
    Fp8PrepassOperand op[FA_FP8_PREPASS_MAX_OPS];
    uint64_t hadamard_seed;  // seed of the random ±1 diagonal (same for every rotated operand)
    int32_t head_dim;        // same for every operand
    int32_t n_ops;           // 1 or 2
} Fp8PrepassParams;

#ifdef __cplusplus
}  // extern "C"
#endif

#ifdef __cplusplus
#include <cstddef>
static_assert(sizeof(Fp8PrepassOperand) == 104, "Fp8PrepassOperand size: update src/cuda/fp8.rs too");
static_assert(offsetof(Fp8PrepassOperand, x_batch_stride) == 24, "Fp8PrepassOperand layout");
static_assert(offsetof(Fp8PrepassOperand, c_batch_stride) == 48, "Fp8PrepassOperand layout");
static_assert(offsetof(Fp8PrepassOperand, batch) == 80, "Fp8PrepassOperand layout");
static_assert(offsetof(Fp8PrepassOperand, flags) == 100, "Fp8PrepassOperand layout");
static_assert(sizeof(Fp8PrepassParams) == 224, "Fp8PrepassParams size: update src/cuda/fp8.rs too");
static_assert(offsetof(Fp8PrepassParams, hadamard_seed) == 208, "Fp8PrepassParams layout");
static_assert(offsetof(Fp8PrepassParams, n_ops) == 220, "Fp8PrepassParams layout");
#endif

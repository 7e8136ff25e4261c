// The FP8 FA3 consumer (cuda/fa3_fp8_fwd_sm90.cu), unchanged, with the emulator's launcher
// (driver.cpp: launch files with FwdParams, buffers at device addresses, seeds 1-3 compared bit
// for bit). Built by tests/emulator/fp8.rs through tool_exe (with emu.h force-included).
#include "../../fa3_fp8_fwd_sm90.cu"

EMU_KERNEL(fa3fp8s1_fwd_hd64_bf16)
EMU_KERNEL(fa3fp8s1_fwd_hd64_f16)
EMU_KERNEL(fa3fp8s2_fwd_hd64_bf16)
EMU_KERNEL(fa3fp8s2_fwd_hd64_f16)
EMU_KERNEL(fa3fp8s3_fwd_hd64_bf16)
EMU_KERNEL(fa3fp8s3_fwd_hd64_f16)
EMU_KERNEL(fa3fp8s4_fwd_hd64_bf16)
EMU_KERNEL(fa3fp8s4_fwd_hd64_f16)
EMU_KERNEL(fa3fp8s5_fwd_hd64_bf16)
EMU_KERNEL(fa3fp8s5_fwd_hd64_f16)
EMU_KERNEL(fa3fp8s1_fwd_hd128_bf16)
EMU_KERNEL(fa3fp8s1_fwd_hd128_f16)
EMU_KERNEL(fa3fp8s2_fwd_hd128_bf16)
EMU_KERNEL(fa3fp8s2_fwd_hd128_f16)
EMU_KERNEL(fa3fp8s3_fwd_hd128_bf16)
EMU_KERNEL(fa3fp8s3_fwd_hd128_f16)
EMU_KERNEL(fa3fp8s4_fwd_hd128_bf16)
EMU_KERNEL(fa3fp8s4_fwd_hd128_f16)
EMU_KERNEL(fa3fp8s5_fwd_hd128_bf16)
EMU_KERNEL(fa3fp8s5_fwd_hd128_f16)
EMU_KERNEL(fa3fp8s1_fwd_hd256_bf16)
EMU_KERNEL(fa3fp8s1_fwd_hd256_f16)
EMU_KERNEL(fa3fp8s2_fwd_hd256_bf16)
EMU_KERNEL(fa3fp8s2_fwd_hd256_f16)
EMU_KERNEL(fa3fp8s3_fwd_hd256_bf16)
EMU_KERNEL(fa3fp8s3_fwd_hd256_f16)
EMU_KERNEL(fa3fp8s4_fwd_hd256_bf16)
EMU_KERNEL(fa3fp8s4_fwd_hd256_f16)
EMU_KERNEL(fa3fp8s5_fwd_hd256_bf16)
EMU_KERNEL(fa3fp8s5_fwd_hd256_f16)

#include "driver.cpp"

// Our e4m3 wgmma wrappers (cuda/sm90/wgmma_fp8.cuh) next to CuTe's for the same shapes,
// compiled for sm_90a (compile-checked only): tests/toolchain/fp8.rs (cute_e4m3_forms, ignored
// without CuTe and nvcc) compares the QGMMA instructions ptxas makes of each pair, register
// numbers aside, so the operand kinds and the accumulate / overwrite forms of our inline PTX are
// NVIDIA's. Kernels <impl>_e4m3_<form>, impl = ours | cute:
//   ss_acc   S += Q Kᵀ: A and B K-major from shared memory, accumulate (scale-d = 1)
//   ss_zero  S  = Q Kᵀ: the first k-step (scale-d = 0)
//   rs       O += P Vᵀᵀ: A (P) from registers, B = Vᵀ K-major
// (The same harness, gmma_harness.cuh, as gmma_forms.cu for the 16-bit forms.)
#include "gmma_harness.cuh"
#include "sm90/wgmma_fp8.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace {

using CuteSs = G::MMA_64x64x32_F32E4M3E4M3_SS_TN<>;
using CuteRs = G::MMA_64x64x32_F32E4M3E4M3_RS_TN<>;

}  // namespace

#define FA_FP8_SS_FORM(NAME, BODY)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) NAME(float* io, uint64_t da, uint64_t db) {         \
        float d[32];                                                                                     \
        load(d, io);                                                                                     \
        fa3::wgmma_fence();                                                                              \
        BODY;                                                                                            \
        fa3::wgmma_commit();                                                                             \
        fa3::wgmma_wait<0>();                                                                            \
        store(d, io);                                                                                    \
    }
FA_FP8_SS_FORM(ours_e4m3_ss_acc, fa3::wgmma_m64n64k32_ss_e4m3(d, da, db, 1))
FA_FP8_SS_FORM(cute_e4m3_ss_acc, call_ss<CuteSs>(d, da, db, G::ScaleOut::One, std::make_index_sequence<32>{}))
FA_FP8_SS_FORM(ours_e4m3_ss_zero, fa3::wgmma_m64n64k32_ss_e4m3(d, da, db, 0))
FA_FP8_SS_FORM(cute_e4m3_ss_zero, call_ss<CuteSs>(d, da, db, G::ScaleOut::Zero, std::make_index_sequence<32>{}))

#define FA_FP8_RS_FORM(NAME, BODY)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) NAME(float* io, const uint32_t* ain, uint64_t db) { \
        float d[32];                                                                                     \
        uint32_t a[4];                                                                                   \
        load(d, io);                                                                                     \
        load_a(a, ain);                                                                                  \
        fa3::wgmma_fence();                                                                              \
        BODY;                                                                                            \
        fa3::wgmma_commit();                                                                             \
        fa3::wgmma_wait<0>();                                                                            \
        store(d, io);                                                                                    \
    }
FA_FP8_RS_FORM(ours_e4m3_rs, fa3::wgmma_m64n64k32_rs_e4m3(d, a, db))
FA_FP8_RS_FORM(cute_e4m3_rs, call_rs<CuteRs>(d, a, db, std::make_index_sequence<32>{}))

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

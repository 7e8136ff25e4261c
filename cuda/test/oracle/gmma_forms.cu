// Our wgmma instruction wrappers (cuda/sm90/wgmma.cuh) next to CuTe's for the same
// shapes and layouts, compiled for sm_90a (compile-checked only): tests/toolchain/cute_oracle.rs compares
// the HGMMA instructions ptxas makes of each pair, register numbers aside, so the operand kinds,
// the transpose flags and the accumulate / overwrite forms of our inline PTX are NVIDIA's.
// Kernels <impl>_<dtype>_<form>, impl = ours | cute, dtype = bf16 | f16:
//   ss_acc   S += Q K^T: A and B K-major from shared memory, accumulate (scale-d = 1)
//   ss_zero  S  = Q K^T: the first k-step (scale-d = 0)
//   rs       O += P V: A from registers, B = V MN-major (transposed)
// Each kernel is one warpgroup issuing one instruction on descriptors passed in, between fence,
// commit and wait, with the accumulators loaded from and stored to global memory.
#include "gmma_harness.cuh"
#include "sm90/wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define FORMS(DT, T, CUTE_SS, CUTE_RS)                                                                          \
    extern "C" __global__ void __launch_bounds__(128) ours_##DT##_ss_acc(float* io, uint64_t da, uint64_t db) { \
        float d[32];                                                                                          \
        load(d, io);                                                                                          \
        fa3::wgmma_fence();                                                                                   \
        fa3::wgmma_m64n64k16_ss<T>(d, da, db, 1);                                                             \
        fa3::wgmma_commit();                                                                                  \
        fa3::wgmma_wait<0>();                                                                                 \
        store(d, io);                                                                                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) cute_##DT##_ss_acc(float* io, uint64_t da, uint64_t db) { \
        float d[32];                                                                                          \
        load(d, io);                                                                                          \
        fa3::wgmma_fence();                                                                                   \
        call_ss<CUTE_SS>(d, da, db, G::ScaleOut::One, std::make_index_sequence<32>{});                        \
        fa3::wgmma_commit();                                                                                  \
        fa3::wgmma_wait<0>();                                                                                 \
        store(d, io);                                                                                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) ours_##DT##_ss_zero(float* io, uint64_t da, uint64_t db) { \
        float d[32];                                                                                          \
        load(d, io);                                                                                          \
        fa3::wgmma_fence();                                                                                   \
        fa3::wgmma_m64n64k16_ss<T>(d, da, db, 0);                                                             \
        fa3::wgmma_commit();                                                                                  \
        fa3::wgmma_wait<0>();                                                                                 \
        store(d, io);                                                                                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) cute_##DT##_ss_zero(float* io, uint64_t da, uint64_t db) { \
        float d[32];                                                                                          \
        load(d, io);                                                                                          \
        fa3::wgmma_fence();                                                                                   \
        call_ss<CUTE_SS>(d, da, db, G::ScaleOut::Zero, std::make_index_sequence<32>{});                       \
        fa3::wgmma_commit();                                                                                  \
        fa3::wgmma_wait<0>();                                                                                 \
        store(d, io);                                                                                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) ours_##DT##_rs(float* io, const uint32_t* ain, uint64_t db) { \
        float d[32];                                                                                          \
        uint32_t a[4];                                                                                        \
        load(d, io);                                                                                          \
        load_a(a, ain);                                                                                       \
        fa3::wgmma_fence();                                                                                   \
        fa3::wgmma_m64n64k16_rs_tb<T>(d, a, db);                                                              \
        fa3::wgmma_commit();                                                                                  \
        fa3::wgmma_wait<0>();                                                                                 \
        store(d, io);                                                                                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) cute_##DT##_rs(float* io, const uint32_t* ain, uint64_t db) { \
        float d[32];                                                                                          \
        uint32_t a[4];                                                                                        \
        load(d, io);                                                                                          \
        load_a(a, ain);                                                                                       \
        fa3::wgmma_fence();                                                                                   \
        call_rs<CUTE_RS>(d, a, db, std::make_index_sequence<32>{});                                           \
        fa3::wgmma_commit();                                                                                  \
        fa3::wgmma_wait<0>();                                                                                 \
        store(d, io);                                                                                         \
    }

using CuteSsBf16 = G::MMA_64x64x16_F32BF16BF16_SS<G::Major::K, G::Major::K>;
using CuteRsBf16 = G::MMA_64x64x16_F32BF16BF16_RS<G::Major::K, G::Major::MN>;
using CuteSsF16 = G::MMA_64x64x16_F32F16F16_SS<G::Major::K, G::Major::K>;
using CuteRsF16 = G::MMA_64x64x16_F32F16F16_RS<G::Major::K, G::Major::MN>;
FORMS(bf16, __nv_bfloat16, CuteSsBf16, CuteRsBf16)
FORMS(f16, __half, CuteSsF16, CuteRsF16)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

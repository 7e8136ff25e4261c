// The device helpers both wgmma oracles (gmma_forms.cu: 16-bit, gmma_forms_fp8.cu: e4m3) build
// their kernels from: CuTe's fma called with the 32 accumulators of an m64n64 instruction, and
// the accumulators / A fragment of each thread loaded from and stored to global memory.
#pragma once
#include <cute/arch/mma_sm90_gmma.hpp>

#include <utility>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace G = cute::SM90::GMMA;

namespace {

template <class Op, size_t... I>
__device__ void call_ss(float (&d)[32], uint64_t da, uint64_t db, G::ScaleOut s, std::index_sequence<I...>) {
    Op::fma(da, db, d[I]..., s);
}
template <class Op, size_t... I>
__device__ void call_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, std::index_sequence<I...>) {
    Op::fma(a[0], a[1], a[2], a[3], db, d[I]..., G::ScaleOut::One);
}

__device__ void load(float (&d)[32], const float* in) {
    for (int i = 0; i < 32; ++i) d[i] = in[threadIdx.x * 32 + i];
}
__device__ void store(const float (&d)[32], float* out) {
    for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}
__device__ void load_a(uint32_t (&a)[4], const uint32_t* in) {
    for (int i = 0; i < 4; ++i) a[i] = in[threadIdx.x * 4 + i];
}

}  // namespace

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

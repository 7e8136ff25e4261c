// Force-included (g++ -include) before cuda/fa2_fwd.cu when the kernel is compiled for the host
// emulation: maps the CUDA language extensions the kernel uses onto plain C++. Each CUDA thread of
// a CTA runs as one std::thread; `smem_raw` (the kernel's `extern __shared__` array) is one global
// buffer, shared by the threads of the single CTA that runs at a time, as shared memory is.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct EmuDim3 {
    unsigned x, y, z;
};
extern thread_local EmuDim3 threadIdx, blockIdx;

// 16-bit storage types; conversions live in the host mma_sm80.cuh.
struct __half {
    uint16_t bits;
};
struct __nv_bfloat16 {
    uint16_t bits;
};
struct uint4 {
    unsigned x, y, z, w;
};

using std::max;
using std::min;

void __syncthreads();

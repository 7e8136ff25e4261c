// Runs a kernel's CUDA C++ on the CPU, for logic checks where no GPU exists (tests/emulate_kernels.rs).
// Each thread of a block is a std::thread; __syncthreads is a block-wide barrier and
// __shfl_xor_sync a warp-wide exchange through memory. Enough for kernels that use only plain
// CUDA C++ (FA1); nothing here emulates tensor cores, async copies or timing.
#pragma once
#define FA_HOST_EMULATION 1

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdlib>
#include <thread>
#include <vector>

// The CUDA headers first (their host paths give __half/__nv_bfloat16 and the conversions), then
// the CUDA keywords become plain C++.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __grid_constant__
#undef __shared__
#undef __align__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

using std::max;
using std::min;

struct EmuDim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace emu {
inline thread_local EmuDim3 thread_idx, block_idx;
inline EmuDim3 block_dim, grid_dim;
inline unsigned dynamic_smem = 0;
// __syncthreads_or: threads OR their predicate into or_acc before the barrier; the barrier's
// completion step (run once, after every thread arrived and before any leaves) publishes it in
// or_result and clears or_acc for the next barrier. or_result is read before the next barrier
// can complete, which needs this thread too.
inline std::atomic<int> or_acc{0};
inline int or_result = 0;
struct OrCompletion {
    void operator()() noexcept { or_result = or_acc.exchange(0); }
};
inline std::barrier<OrCompletion>* block_barrier = nullptr;
struct Warp {
    std::barrier<> bar{32};
    float vals[32];
};
inline std::vector<Warp>* warps = nullptr;
}  // namespace emu

#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define gridDim emu::grid_dim

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
inline int __syncthreads_or(int predicate) {
    if (predicate) emu::or_acc.store(1);
    emu::block_barrier->arrive_and_wait();
    return emu::or_result;
}
inline unsigned fa_dynamic_smem_bytes() { return emu::dynamic_smem; }
[[noreturn]] inline void __trap() { std::abort(); }

// Every lane of the warp must call it (as the kernels do: full mask, uniform control flow).
inline float __shfl_xor_sync(unsigned /*mask*/, float v, int lane_mask) {
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    emu::Warp& w = (*emu::warps)[warp];
    w.vals[lane] = v;
    w.bar.arrive_and_wait();
    const float r = w.vals[lane ^ lane_mask];
    w.bar.arrive_and_wait();
    return r;
}

// Runs `kernel(p)` over the grid, one block at a time, `threads` std::threads per block, with the
// shared memory `smem` (of `smem_floats` floats) poisoned with NaN before each block.
template <typename Kernel, typename Params>
void emu_launch(Kernel kernel, EmuDim3 grid, unsigned threads, unsigned smem_bytes, float* smem, size_t smem_floats,
                const Params& p) {
    emu::block_dim = {threads, 1, 1};
    emu::grid_dim = grid;
    emu::dynamic_smem = smem_bytes;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                std::fill(smem, smem + smem_floats, NAN);
                std::barrier<emu::OrCompletion> bar(threads);
                std::vector<emu::Warp> warps(threads / 32);
                emu::block_barrier = &bar;
                emu::warps = &warps;
                std::vector<std::thread> ts;
                for (unsigned t = 0; t < threads; ++t)
                    ts.emplace_back([&, t] {
                        emu::thread_idx = {t, 0, 0};
                        emu::block_idx = {x, y, z};
                        kernel(p);
                    });
                for (auto& t : ts) t.join();
            }
}

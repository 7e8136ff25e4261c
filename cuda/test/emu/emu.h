// Force-included (g++ -include) before a kernel source when the CPU emulator compiles it: maps
// the CUDA language onto plain C++ and supplies host versions of exactly the inline-PTX
// wrappers of the instruction headers (cuda/sm80/{mma,red,fast_math,launch}.cuh,
// cuda/sm90/{wgmma,wgmma_fp8,mbarrier,tma}.cuh, sm90/hang_check.cuh's clock, sm100/tcgen05.cuh),
// which those headers compile out under FA_HOST_EMULATION. tests/emulator/forward.rs checks that the two lists of wrappers
// are the same.
// The headers' other code (descriptor builders, layouts, mbar_wait, ...) is used as is.
//
// Build a kernel unit: g++ -std=c++20 -include cuda/test/emu/emu.h -isystem cuda/test/emu/include
//   -I cuda -I $OUT_DIR/include -x c++ <unit> + runtime/*.cpp + driver.cpp (tests/support/emu.rs does it).
#pragma once
#define FA_HOST_EMULATION 1
// The kernels' sm_90a code paths are compiled (their wrappers come from here, not from PTX).
#define __CUDA_ARCH_FEAT_SM90_ALL 1
// ... and so are the sm_100a ones (sm100/tcgen05.cuh's wrappers come from here too).
#define __CUDA_ARCH_FEAT_SM100_ALL 1

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <type_traits>

#include <cuda_bf16.h>  // the emulator's host versions (cuda/test/emu/include)
#include <cuda_fp16.h>

#include "common/params.h"
#include "runtime.h"

// ---- CUDA C++ keywords ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx())
#define blockDim (::emu::block_dim())
#define gridDim (::emu::grid_dim())

using std::max;
using std::min;

// ---- the kernels' shared-memory arrays all alias the emulator's window ----
extern "C" {
alignas(4096) unsigned char emu_shared_window[::emu::kWindowBytes];
}
namespace fa1 {
extern float smem[::emu::kWindowBytes / 4] __attribute__((alias("emu_shared_window")));
}
namespace fa2 {
extern unsigned char smem_raw[::emu::kWindowBytes] __attribute__((alias("emu_shared_window")));
}
namespace fa3 {
extern uint8_t smem_raw[::emu::kWindowBytes] __attribute__((alias("emu_shared_window")));
}
namespace fa4 {
extern uint8_t smem_raw[::emu::kWindowBytes] __attribute__((alias("emu_shared_window")));
}

// ---- intrinsics ----
inline void __syncthreads() { ::emu::syncthreads(); }
inline int __syncthreads_or(int predicate) { return ::emu::syncthreads_or(predicate); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::emu::syncwarp(mask); }
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u = ::emu::shfl_xor(mask, u, lane_mask, width);
    std::memcpy(&v, &u, 4);
    return v;
}
inline int __shfl_xor_sync(unsigned mask, int v, int lane_mask, int width = 32) {
    return static_cast<int>(::emu::shfl_xor(mask, static_cast<uint32_t>(v), lane_mask, width));
}
inline unsigned __shfl_xor_sync(unsigned mask, unsigned v, int lane_mask, int width = 32) {
    return ::emu::shfl_xor(mask, v, lane_mask, width);
}
inline unsigned __shfl_sync(unsigned mask, unsigned v, int src_lane, int width = 32) {
    return ::emu::shfl_idx(mask, v, src_lane, width);
}
// __byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of the 8-byte value y:x.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
}
inline float __uint_as_float(unsigned u) { return __builtin_bit_cast(float, u); }
inline unsigned __float_as_uint(float x) { return __builtin_bit_cast(unsigned, x); }
inline size_t __cvta_generic_to_shared(const void* p) { return ::emu::cvta_shared(p); }
[[noreturn]] inline void __trap() { ::emu::trap(); }

// sm80/launch.cuh
inline unsigned fa_dynamic_smem_bytes() { return ::emu::dynamic_smem_bytes(); }

namespace emu_detail {
template <class T>
constexpr ::emu::Elem elem_of() {
    static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value, "16-bit inputs only");
    return std::is_same<T, __half>::value ? ::emu::Elem::F16 : ::emu::Elem::BF16;
}
}  // namespace emu_detail

// ---- sm90/hang_check.cuh (the opt-in GPU hang diagnosis; its clock) ----
namespace fa_hang {
inline uint64_t globaltimer_ns() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
}
}  // namespace fa_hang

// ---- sm80/mma.cuh ----
namespace fa2 {
inline void cp_async_16(uint32_t dst_smem, const void* src_gmem, int src_bytes) {
    ::emu::cp_async(dst_smem, src_gmem, 16, src_bytes);
}
inline void cp_async_commit() { ::emu::cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
    ::emu::cp_async_wait(N);
}
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { ::emu::ldmatrix_x4(r, addr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { ::emu::ldmatrix_x4(r, addr, true); }
template <typename Elem>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    ::emu::mma_m16n8k16(d, a, b0, b1, emu_detail::elem_of<Elem>());
}
inline int cta_head() { return ::emu::ctaid(1); }
inline int cta_batch() { return ::emu::ctaid(2); }
}  // namespace fa2

// ---- sm80/shared.cuh ----
inline float fa_ld_shared_f32(uint32_t addr) { return __builtin_bit_cast(float, ::emu::ld_shared_b32(addr)); }
inline void fa_st_shared_v4(uint32_t addr, uint4 v) { ::emu::st_shared_v4(addr, v.x, v.y, v.z, v.w); }

// ---- sm80/red.cuh ----
// One fiber runs at a time and this is no scheduling point: the add is atomic. (The emulator
// runs CTAs in a fixed order, so sums come out the same for every seed; on a GPU they do not.)
namespace fa2 {
inline void red_add_f32(float* addr, float v) { *addr += v; }
}  // namespace fa2

// ---- fast_math.cuh ----
inline float fa_ex2_approx(float x) { return ::emu::ex2_approx_ftz(x); }
inline float fa_tanh_approx(float x) { return ::emu::tanh_approx(x); }

// ---- sm90/mbarrier.cuh (smem_u32 is the header's own, through __cvta_generic_to_shared) ----
namespace fa3 {
inline uint32_t emu_smem_addr(const void* p) { return static_cast<uint32_t>(::emu::cvta_shared(p)); }
inline void mbar_init(uint64_t* bar, uint32_t count) { ::emu::mbar_init(emu_smem_addr(bar), count); }
inline void mbar_init_fence() { ::emu::mbar_init_fence(); }
inline void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    ::emu::mbar_arrive_expect_tx(emu_smem_addr(bar), bytes);
}
inline void mbar_arrive(uint64_t* bar) { ::emu::mbar_arrive(emu_smem_addr(bar)); }
inline bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
    return ::emu::mbar_try_wait_parity(emu_smem_addr(bar), parity);
}
template <int Id, int Threads>
inline void named_bar_sync() {
    static_assert(Id > 0 && Id < 16 && Threads % 32 == 0, "named barrier id/count");
    ::emu::bar_sync(Id, Threads);
}
template <int Id, int Threads>
inline void named_bar_arrive() {
    static_assert(Id > 0 && Id < 16 && Threads % 32 == 0, "named barrier id/count");
    ::emu::bar_arrive(Id, Threads);
}
}  // namespace fa3

// ---- sm90/tma.cuh (needs TmaDesc: the header's pure part is included first) ----
#include "sm90/tma.cuh"
namespace fa3 {
inline void tma_prefetch_desc(const TmaDesc* map) { ::emu::tma_prefetch(map); }
inline void tma_load_4d(void* dst, const TmaDesc* map, uint64_t* bar, int c0, int c1, int c2, int c3) {
    const int32_t c[4] = {c0, c1, c2, c3};
    ::emu::tma_load(emu_smem_addr(dst), map, emu_smem_addr(bar), c, 4);
}
inline void fence_proxy_async_smem() { ::emu::fence_proxy_async(); }
inline bool elect_one_sync() { return ::emu::elect_one(); }
}  // namespace fa3

// ---- sm90/wgmma.cuh ----
// EMU_MUTATE_DROP_TRANS_B (mutation self-test): the RS wgmma is executed without its transpose
// bit, as if the kernel's PTX lacked it.
namespace fa3 {
inline void wgmma_fence() { ::emu::wgmma_fence(); }
inline void wgmma_commit() { ::emu::wgmma_commit(); }
template <int N>
inline void wgmma_wait() {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0..7");
    ::emu::wgmma_wait(N);
}
template <int N>
inline void fence_regs(float (&d)[N]) {
    ::emu::wgmma_check_regs(d, N);
}
template <int Regs>
inline void setmaxnreg_inc() {
    static_assert(Regs % 8 == 0 && Regs >= 24 && Regs <= 256, "setmaxnreg range");
    ::emu::setmaxnreg(true, Regs);
}
template <int Regs>
inline void setmaxnreg_dec() {
    static_assert(Regs % 8 == 0 && Regs >= 24 && Regs <= 256, "setmaxnreg range");
    ::emu::setmaxnreg(false, Regs);
}
template <class T>
inline void wgmma_m64n64k16_ss(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    const ::emu::Elem e = emu_detail::elem_of<T>();
    ::emu::wgmma_issue(::emu::WgmmaInstr{64, 64, 16, e, e, false, desc_a, desc_b, scale_d != 0, 1, 1, 0, 0}, d,
                       nullptr);
}
template <class T>
inline void wgmma_m64n64k16_rs_tb(float* d, const uint32_t (&a)[4], uint64_t desc_b) {
    const ::emu::Elem e = emu_detail::elem_of<T>();
#if defined(EMU_MUTATE_DROP_TRANS_B)
    const int trans_b = 0;
#else
    const int trans_b = 1;
#endif
    ::emu::wgmma_issue(::emu::WgmmaInstr{64, 64, 16, e, e, true, 0, desc_b, 1, 1, 1, 0, trans_b}, d, a);
}
}  // namespace fa3

// ---- sm90/wgmma_fp8.cuh (8-bit operands: K-major both, k32) ----
namespace fa3 {
inline void wgmma_m64n64k32_ss_e4m3(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    const ::emu::Elem e = ::emu::Elem::E4M3;
    ::emu::wgmma_issue(::emu::WgmmaInstr{64, 64, 32, e, e, false, desc_a, desc_b, scale_d != 0, 1, 1, 0, 0}, d,
                       nullptr);
}
inline void wgmma_m64n64k32_rs_e4m3(float* d, const uint32_t (&a)[4], uint64_t desc_b) {
    const ::emu::Elem e = ::emu::Elem::E4M3;
    ::emu::wgmma_issue(::emu::WgmmaInstr{64, 64, 32, e, e, true, 0, desc_b, 1, 1, 1, 0, 0}, d, a);
}
}  // namespace fa3
// ---- sm100/tcgen05.cuh ----
namespace fa4 {
inline uint32_t emu_smem_addr(const void* p) { return static_cast<uint32_t>(::emu::cvta_shared(p)); }
inline void tmem_alloc(uint32_t* dst, uint32_t ncols) { ::emu::tmem_alloc(emu_smem_addr(dst), ncols); }
inline void tmem_relinquish() { ::emu::tmem_relinquish(); }
inline void tmem_dealloc(uint32_t taddr, uint32_t ncols) { ::emu::tmem_dealloc(taddr, ncols); }
inline void umma_f16_ss(uint32_t d_tmem, uint64_t a_desc, uint64_t b_desc, uint32_t idesc, uint32_t accumulate) {
    ::emu::umma_issue(d_tmem, false, a_desc, b_desc, idesc, accumulate);
}
inline void umma_f16_ts(uint32_t d_tmem, uint32_t a_tmem, uint64_t b_desc, uint32_t idesc, uint32_t accumulate) {
    ::emu::umma_issue(d_tmem, true, a_tmem, b_desc, idesc, accumulate);
}
inline void umma_commit(uint64_t* bar) { ::emu::umma_commit(emu_smem_addr(bar)); }
inline void tmem_ld_32x32b_x32(uint32_t taddr, uint32_t (&r)[32]) { ::emu::tmem_ld(taddr, r, 32); }
inline void tmem_st_32x32b_x32(uint32_t taddr, const uint32_t (&r)[32]) { ::emu::tmem_st(taddr, r, 32); }
inline void tmem_st_32x32b_x16(uint32_t taddr, const uint32_t (&r)[16]) { ::emu::tmem_st(taddr, r, 16); }
template <int N>
inline void tmem_wait_ld(uint32_t (&)[N]) {
    ::emu::tmem_wait_ld();
}
inline void tmem_wait_st() { ::emu::tmem_wait_st(); }
inline void tcgen05_fence_before() { ::emu::tcgen05_fence(false); }
inline void tcgen05_fence_after() { ::emu::tcgen05_fence(true); }
}  // namespace fa4

// ---- registering the kernels of a unit with the driver ----
// EMU_KERNEL(fa3s2_fwd_hd64_bf16) after the kernel definitions: the driver then finds it by name.
namespace emu_detail {
template <auto K>
void invoke(const void* p, const void* const* m) {
    using F = decltype(K);
    const FwdParams& fp = *static_cast<const FwdParams*>(p);
    if constexpr (std::is_same<F, void (*)(FwdParams)>::value) {
        K(fp);
    } else {
        static_assert(std::is_same<F, void (*)(FwdParams, fa3::TmaDesc, fa3::TmaDesc, fa3::TmaDesc)>::value,
                      "kernel signature the emulator's driver does not know");
        K(fp, *static_cast<const fa3::TmaDesc*>(m[0]), *static_cast<const fa3::TmaDesc*>(m[1]),
          *static_cast<const fa3::TmaDesc*>(m[2]));
    }
}
template <auto K>
constexpr int nmaps() {
    return std::is_same<decltype(K), void (*)(FwdParams)>::value ? 0 : 3;
}
}  // namespace emu_detail
#define EMU_KERNEL(name)                                                                                  \
    static const int emu_registered_##name =                                                              \
        (::emu::register_kernel(#name, &::emu_detail::invoke<&name>, ::emu_detail::nmaps<&name>()), 0);

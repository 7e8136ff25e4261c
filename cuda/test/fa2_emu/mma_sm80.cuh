// Host stand-in for cuda/include/mma_sm80.cuh: the same API, implemented on the CPU from the PTX
// ISA text (9.7.14.5.8 mma.m16n8k16 fragments, 9.7.14.5.15 ldmatrix, 9.7.9.25 cp.async), so that
// the unchanged kernel source (cuda/fa2_fwd.cu) runs on the CPU, one std::thread per CUDA thread.
// Warp-collective instructions exchange their operands through a per-warp slot array between two
// warp barriers. cp.async either lands at issue or is deferred to the cp.async.wait_group that
// retires it (the two extremes the hardware allows), to catch reads that miss a wait or barrier.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <vector>

#include "fa2_layout.h"

namespace fa2 {
extern unsigned char smem_raw[];  // the kernel's `extern __shared__` buffer (defined by the driver)
}

namespace emu {

struct Warp {
    std::barrier<> bar{32};
    uint32_t addr[32];
    uint32_t a[32][4];
    uint32_t b[32][2];
    float f[32];
};
extern thread_local Warp* tl_warp;  // this thread's warp
extern thread_local int tl_lane;
enum class CpAsync { AtIssue, AtWait };
extern CpAsync cp_mode;

struct Copy {
    uint32_t dst;
    const void* src;
    int bytes;
};
extern thread_local std::vector<Copy> tl_open;              // issued, not yet committed
extern thread_local std::deque<std::vector<Copy>> tl_groups;  // committed, in flight

inline void do_copy(const Copy& c) {
    unsigned char* d = fa2::smem_raw + c.dst;
    std::memset(d, 0, 16);  // src-size < 16 zero-fills the rest
    if (c.bytes > 0) std::memcpy(d, c.src, static_cast<size_t>(c.bytes));
}

inline float f16_to_float(uint16_t h) { _Float16 x; std::memcpy(&x, &h, 2); return static_cast<float>(x); }
inline uint16_t float_to_f16(float f) { _Float16 x = static_cast<_Float16>(f); uint16_t h; std::memcpy(&h, &x, 2); return h; }
inline float bf16_to_float(uint16_t h) { uint32_t u = static_cast<uint32_t>(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t float_to_bf16(float f) {  // round to nearest even (no NaN inputs here)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float shfl_xor(float x, int mask) {
    Warp& w = *tl_warp;
    w.f[tl_lane] = x;
    w.bar.arrive_and_wait();
    const float y = w.f[tl_lane ^ mask];
    w.bar.arrive_and_wait();
    return y;
}

inline uint16_t smem16(uint32_t byte) { uint16_t v; std::memcpy(&v, fa2::smem_raw + byte, 2); return v; }

}  // namespace emu

namespace fa2 {

inline uint32_t smem_u32(const void* ptr) {
    return static_cast<uint32_t>(static_cast<const unsigned char*>(ptr) - smem_raw);
}

inline void cp_async_16(uint32_t dst_smem, const void* src_gmem, int src_bytes) {
    const emu::Copy c{dst_smem, src_gmem, src_bytes};
    if (emu::cp_mode == emu::CpAsync::AtIssue) emu::do_copy(c);
    else emu::tl_open.push_back(c);
}
inline void cp_async_commit() {
    emu::tl_groups.push_back(emu::tl_open);
    emu::tl_open.clear();
}
template <int N>
inline void cp_async_wait() {
    while (static_cast<int>(emu::tl_groups.size()) > N) {
        for (const emu::Copy& c : emu::tl_groups.front()) emu::do_copy(c);
        emu::tl_groups.pop_front();
    }
}

// ldmatrix.m8n8.x4: lane 8m + r supplies row r of matrix m; register m of lane l gets row l/4,
// columns 2(l%4), 2(l%4)+1 (low, high) -- or with .trans column l/4, rows 2(l%4), 2(l%4)+1.
inline void ldmatrix_impl(uint32_t (&r)[4], uint32_t addr, bool trans) {
    emu::Warp& w = *emu::tl_warp;
    const int l = emu::tl_lane;
    w.addr[l] = addr;
    w.bar.arrive_and_wait();
    for (int m = 0; m < 4; ++m) {
        uint16_t lo, hi;
        if (!trans) {
            const uint32_t row = w.addr[8 * m + l / 4];
            lo = emu::smem16(row + 2 * (2 * (l % 4)));
            hi = emu::smem16(row + 2 * (2 * (l % 4) + 1));
        } else {
            lo = emu::smem16(w.addr[8 * m + 2 * (l % 4)] + 2 * (l / 4));
            hi = emu::smem16(w.addr[8 * m + 2 * (l % 4) + 1] + 2 * (l / 4));
        }
        r[m] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    w.bar.arrive_and_wait();
}
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { ldmatrix_impl(r, addr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { ldmatrix_impl(r, addr, true); }

// mma.m16n8k16: lane l holds A elements (row g or g+8, col 2t+{0,1} or +8), B elements (k = 2t+{0,1}
// or +8, n = g), C/D (row g or g+8, col 2t+{0,1}). Inverted: A(row, k) sits in lane
// 4*(row%8) + (k%8)/2, register (row/8) + 2*(k/8), half k%2; B(k, n) in lane 4n + (k%8)/2,
// register k/8, half k%2.
template <typename Elem>
struct Mma {
    static float to_float(uint16_t h);
    static uint16_t from_float(float f);
    static float half_of(uint32_t reg, int h) { return to_float(static_cast<uint16_t>(h ? reg >> 16 : reg & 0xffffu)); }
    static void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        emu::Warp& w = *emu::tl_warp;
        const int l = emu::tl_lane;
        for (int r = 0; r < 4; ++r) w.a[l][r] = a[r];
        w.b[l][0] = b0;
        w.b[l][1] = b1;
        w.bar.arrive_and_wait();
        for (int i = 0; i < 4; ++i) {
            const int row = (l >> 2) + (i >= 2 ? 8 : 0), col = (l % 4) * 2 + (i & 1);
            double acc = 0;
            for (int k = 0; k < 16; ++k) {
                const float av = half_of(w.a[4 * (row % 8) + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2);
                const float bv = half_of(w.b[4 * col + (k % 8) / 2][k / 8], k % 2);
                acc += static_cast<double>(av) * bv;
            }
            d[i] = static_cast<float>(d[i] + acc);
        }
        w.bar.arrive_and_wait();
    }
    static uint32_t pack(float lo, float hi) {
        return static_cast<uint32_t>(from_float(lo)) | (static_cast<uint32_t>(from_float(hi)) << 16);
    }
};
template <> inline float Mma<__half>::to_float(uint16_t h) { return emu::f16_to_float(h); }
template <> inline uint16_t Mma<__half>::from_float(float f) { return emu::float_to_f16(f); }
template <> inline float Mma<__nv_bfloat16>::to_float(uint16_t h) { return emu::bf16_to_float(h); }
template <> inline uint16_t Mma<__nv_bfloat16>::from_float(float f) { return emu::float_to_bf16(f); }

inline float ex2(float x) { return std::exp2(x); }
inline float quad_max(float x) {
    x = std::fmax(x, emu::shfl_xor(x, 1));
    return std::fmax(x, emu::shfl_xor(x, 2));
}
inline float quad_sum(float x) {
    x += emu::shfl_xor(x, 1);
    return x + emu::shfl_xor(x, 2);
}
inline int cta_head() { return static_cast<int>(blockIdx.y); }
inline int cta_batch() { return static_cast<int>(blockIdx.z); }

}  // namespace fa2

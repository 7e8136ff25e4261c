// Runs the unchanged FA2 kernel source (cuda/fa2_fwd.cu) on the CPU and compares it with a float64
// attention reference. One std::thread per CUDA thread, one CTA at a time; the GPU-only
// instructions are the PTX-ISA models of ./mma_sm80.cuh. This checks the kernel's index math,
// masking, tile skipping, online softmax, LSE, GQA and epilogue end to end, without a GPU. It does
// not check timing-dependent behaviour beyond the two cp.async landing extremes, nor the real
// hardware's rounding inside mma (the model accumulates in double, rounds to f32 per mma).
//
// Build and run (scripts/check-fa2.sh does this), one command line:
//   g++ -std=c++20 -O2 -pthread -fno-strict-aliasing -include cuda/test/fa2_emu/cuda_shim.h
//       -Icuda/test/fa2_emu -Icuda/include cuda/test/fa2_emu/fa2_emu_test.cpp -o fa2_emu_test
//   fa2_emu_test [--quick | --random N [seed]]
#include <climits>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../fa2_fwd.cu"

thread_local EmuDim3 threadIdx, blockIdx;
namespace fa2 {
alignas(128) unsigned char smem_raw[fa2::kSmemLimitSm8x];
}
namespace emu {
thread_local Warp* tl_warp;
thread_local int tl_lane;
CpAsync cp_mode = CpAsync::AtWait;
thread_local std::vector<Copy> tl_open;
thread_local std::deque<std::vector<Copy>> tl_groups;
}  // namespace emu
static std::barrier<>* g_cta_barrier;
void __syncthreads() { g_cta_barrier->arrive_and_wait(); }

using Kernel = void (*)(const FwdParams);
struct Instance {
    bool bf16;
    int hdim;
    Kernel fn;
    int block_m, threads, smem;
};
#define INST(D) \
    Instance{false, D, fa2_fwd_hd##D##_f16, fa2::Fa2Traits<D>::kBlockM, fa2::Fa2Traits<D>::kNThreads, fa2::Fa2Traits<D>::kSmemBytes}, \
    Instance{true, D, fa2_fwd_hd##D##_bf16, fa2::Fa2Traits<D>::kBlockM, fa2::Fa2Traits<D>::kNThreads, fa2::Fa2Traits<D>::kSmemBytes}
static const Instance kInstances[] = {INST(32), INST(64), INST(96), INST(128), INST(192), INST(256)};

// Emulated launch: grid (ceil(sq / kBlockM), heads_q, batch), block kNThreads.
static void launch(const Instance& in, const FwdParams& p) {
    const unsigned gx = (p.seqlen_q + in.block_m - 1) / in.block_m;
    for (unsigned z = 0; z < static_cast<unsigned>(p.batch); ++z)
        for (unsigned y = 0; y < static_cast<unsigned>(p.heads_q); ++y)
            for (unsigned x = 0; x < gx; ++x) {
                std::memset(fa2::smem_raw, 0xff, sizeof(fa2::smem_raw));  // poison shared memory
                std::barrier<> cta(in.threads);
                g_cta_barrier = &cta;
                std::vector<std::unique_ptr<emu::Warp>> warps;
                for (int w = 0; w < in.threads / 32; ++w) warps.emplace_back(new emu::Warp);
                std::vector<std::thread> threads;
                for (int t = 0; t < in.threads; ++t)
                    threads.emplace_back([&, t] {
                        threadIdx = EmuDim3{static_cast<unsigned>(t), 0, 0};
                        blockIdx = EmuDim3{x, y, z};
                        emu::tl_warp = warps[t / 32].get();
                        emu::tl_lane = t % 32;
                        emu::tl_open.clear();
                        emu::tl_groups.clear();
                        in.fn(p);
                    });
                for (auto& th : threads) th.join();
            }
}

struct Case {
    const char* name;
    bool bf16;
    int hdim, batch, hq, hkv, sq, sk, left, right;
    float softcap;
    bool alibi, lse;
    bool bhsd = false;  // tensors laid out [b, h, s, d] instead of [b, s, h, d] (strides differ)
    // The edges (issue 10): `target` > 0 sets the softmax scale so that the largest |score| is
    // `target` (near f32::MAX log2-unit scores overflow); `poison` 1 sets every V to +inf, 2 to
    // NaN (rows that see a key must not look finite; rows that see none are exactly 0).
    double target = 0.0;
    int poison = 0;
};

static int g_fail = 0;

static bool run_case(const Case& c, emu::CpAsync mode) {
    emu::cp_mode = mode;
    const Instance* in = nullptr;
    for (const Instance& i : kInstances)
        if (i.bf16 == c.bf16 && i.hdim == c.hdim) in = &i;
    const int D = c.hdim;
    auto to_bits = [&](float f) { return c.bf16 ? emu::float_to_bf16(f) : emu::float_to_f16(f); };
    auto to_f = [&](uint16_t h) { return c.bf16 ? emu::bf16_to_float(h) : emu::f16_to_float(h); };
    std::mt19937 rng(1234 + D + c.sq * 7 + c.sk);
    std::normal_distribution<float> nd(0.f, 1.f);
    // [b, s, h, d] contiguous, or [b, h, s, d] when c.bhsd: element offsets by (b, s, h).
    auto off = [&](int b, int si, int h, int seqlen, int heads) -> size_t {
        return c.bhsd ? ((size_t(b) * heads + h) * seqlen + si) * D : ((size_t(b) * seqlen + si) * heads + h) * D;
    };
    std::vector<uint16_t> q(size_t(c.batch) * c.sq * c.hq * D), k(size_t(c.batch) * c.sk * c.hkv * D),
        v(k.size());
    for (auto& x : q) x = to_bits(nd(rng));
    for (auto& x : k) x = to_bits(nd(rng));
    for (auto& x : v) x = to_bits(c.poison == 1 ? INFINITY : c.poison == 2 ? NAN : nd(rng));
    const size_t o_elems = size_t(c.batch) * c.sq * c.hq * D, guard = 4096;
    std::vector<uint16_t> o(o_elems + guard, 0x7e00);  // NaN poison (f16 and bf16 alike: exp all 1s)
    std::vector<float> lse(size_t(c.batch) * c.hq * c.sq + guard, NAN);
    std::vector<float> slopes(c.hq);
    for (int h = 0; h < c.hq; ++h) slopes[h] = std::exp2(-8.0f * (h + 1) / c.hq);

    FwdParams p{};
    p.q = reinterpret_cast<uint64_t>(q.data());
    p.k = reinterpret_cast<uint64_t>(k.data());
    p.v = reinterpret_cast<uint64_t>(v.data());
    p.o = reinterpret_cast<uint64_t>(o.data());
    p.lse = c.lse ? reinterpret_cast<uint64_t>(lse.data()) : 0;
    p.alibi_slopes = c.alibi ? reinterpret_cast<uint64_t>(slopes.data()) : 0;
    p.q_batch_stride = int64_t(c.sq) * c.hq * D;
    p.q_row_stride = c.bhsd ? D : int64_t(c.hq) * D;
    p.q_head_stride = c.bhsd ? int64_t(c.sq) * D : D;
    p.k_batch_stride = int64_t(c.sk) * c.hkv * D;
    p.k_row_stride = c.bhsd ? D : int64_t(c.hkv) * D;
    p.k_head_stride = c.bhsd ? int64_t(c.sk) * D : D;
    p.v_batch_stride = p.k_batch_stride; p.v_row_stride = p.k_row_stride; p.v_head_stride = p.k_head_stride;
    p.o_batch_stride = p.q_batch_stride; p.o_row_stride = p.q_row_stride; p.o_head_stride = p.q_head_stride;
    p.batch = c.batch; p.seqlen_q = c.sq; p.seqlen_k = c.sk; p.heads_q = c.hq; p.heads_kv = c.hkv;
    p.head_dim = D; p.window_left = c.left; p.window_right = c.right;
    double scale = 1.0 / std::sqrt(double(D));
    if (c.target > 0) {  // the scale that makes the largest |q.k| equal `target`
        double max_dot = 0;
        for (int b = 0; b < c.batch; ++b)
            for (int h = 0; h < c.hq; ++h)
                for (int i = 0; i < c.sq; ++i)
                    for (int j = 0; j < c.sk; ++j) {
                        double dot = 0;
                        for (int d = 0; d < D; ++d)
                            dot += double(to_f(q[off(b, i, h, c.sq, c.hq) + d])) *
                                   to_f(k[off(b, j, h / (c.hq / c.hkv), c.sk, c.hkv) + d]);
                        max_dot = std::max(max_dot, std::fabs(dot));
                    }
        scale = c.target / max_dot;
    }
    p.softmax_scale = float(scale);
    // As the engine sets it: log2 e for natural-unit scores (softcap or ALiBi), else scale * log2 e.
    p.softmax_scale_log2 = (c.softcap > 0 || c.alibi) ? float(M_LOG2E) : float(double(p.softmax_scale) * M_LOG2E);
    p.softcap = c.softcap;
    p.flags = (c.lse ? FA_FLAG_RETURN_LSE : 0u) | (c.softcap > 0 ? FA_FLAG_SOFTCAP : 0u) | (c.alibi ? FA_FLAG_ALIBI : 0u);

    launch(*in, p);

    // float64 reference on the rounded inputs.
    double max_err = 0, max_lse_err = 0;
    bool ok = true;
    const int group = c.hq / c.hkv;
    std::vector<double> s(c.sk);
    for (int b = 0; b < c.batch; ++b)
        for (int h = 0; h < c.hq; ++h)
            for (int i = 0; i < c.sq; ++i) {
                const int hk = h / group;
                const uint16_t* qi = &q[off(b, i, h, c.sq, c.hq)];
                double m = -INFINITY;
                const long diag = long(i) + c.sk - c.sq;
                for (int j = 0; j < c.sk; ++j) {
                    const bool vis = (c.left < 0 || j >= diag - c.left) && (c.right < 0 || j <= diag + c.right);
                    if (!vis) { s[j] = -INFINITY; continue; }
                    const uint16_t* kj = &k[off(b, j, hk, c.sk, c.hkv)];
                    double dot = 0;
                    for (int d = 0; d < D; ++d) dot += double(to_f(qi[d])) * to_f(kj[d]);
                    double sc = dot * double(p.softmax_scale);
                    if (c.softcap > 0) sc = c.softcap * std::tanh(sc / c.softcap);
                    if (c.alibi) sc -= slopes[h] * std::fabs(double(diag - j));
                    s[j] = sc;
                    m = std::max(m, sc);
                }
                double l = 0;
                for (int j = 0; j < c.sk; ++j) l += (s[j] == -INFINITY) ? 0 : std::exp(s[j] - m);
                uint16_t* oi = &o[off(b, i, h, c.sq, c.hq)];
                for (int d = 0; d < D; ++d) {
                    double ref = 0;
                    if (l > 0)
                        for (int j = 0; j < c.sk; ++j)
                            if (s[j] != -INFINITY)
                                ref += std::exp(s[j] - m) / l * to_f(v[off(b, j, hk, c.sk, c.hkv) + d]);
                    const double got = to_f(oi[d]);
                    if (!std::isfinite(ref)) {  // sees a poisoned V: must not look finite
                        if (std::isfinite(got)) ok = false;
                        continue;
                    }
                    const double err = std::fabs(got - ref);
                    if (!(err <= max_err)) max_err = std::isnan(err) ? INFINITY : std::max(max_err, err);
                    if (l == 0 && got != 0.0) ok = false;
                }
                if (c.lse) {
                    const double ref = l > 0 ? m + std::log(l) : -INFINITY;
                    const double got = lse[(size_t(b) * c.hq + h) * c.sq + i];
                    if (l == 0) { if (got != -INFINITY) ok = false; }
                    else max_lse_err = std::max(max_lse_err, std::isnan(got) ? INFINITY : std::fabs(got - ref));
                }
            }
    // Nothing written past the end of O or LSE.
    for (size_t i = o_elems; i < o.size(); ++i) ok = ok && o[i] == 0x7e00;
    for (size_t i = size_t(c.batch) * c.hq * c.sq; i < lse.size(); ++i) ok = ok && std::isnan(lse[i]);
    // Tolerances: P and O are rounded to the 16-bit type (f16: 2^-11 relative, bf16: 2^-8).
    const double tol = c.bf16 ? 3e-2 : 4e-3;
    // LSE: f32 rounding of the max, relative for scores near f32::MAX.
    ok = ok && max_err <= tol && max_lse_err <= (c.target > 0 ? 1e-6 * c.target : 1e-3);
    std::printf("%-44s %-4s cp.async@%-5s max|dO| %.2e  max|dLSE| %.2e  %s\n", c.name, c.bf16 ? "bf16" : "f16",
                mode == emu::CpAsync::AtIssue ? "issue" : "wait", max_err, max_lse_err, ok ? "ok" : "FAIL");
    if (!ok) ++g_fail;
    return ok;
}

// `--random N [seed]`: N random configurations (head dim, dtype, GQA ratio, seqlens 1..300,
// window sides in {-1, 0..120}, softcap, ALiBi, layout), both cp.async modes.
static int run_random(int n, unsigned seed) {
    std::mt19937 rng(seed);
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    static const int kDims[] = {32, 64, 96, 128, 192, 256};
    static std::vector<std::string> names;
    names.reserve(n);
    for (int i = 0; i < n; ++i) {
        Case c{};
        c.bf16 = pick(0, 1);
        c.hdim = kDims[pick(0, 5)];
        c.batch = pick(1, 2);
        c.hkv = pick(1, 2);
        c.hq = c.hkv * pick(1, 3);
        c.sq = pick(0, 3) == 0 ? 1 : pick(1, 300);
        c.sk = pick(1, 300);
        c.left = pick(0, 2) == 0 ? pick(0, 120) : -1;
        c.right = pick(0, 2) == 0 ? pick(0, 120) : (pick(0, 1) ? 0 : -1);
        c.softcap = pick(0, 3) == 0 ? 10.f + pick(0, 40) : 0.f;
        c.alibi = pick(0, 3) == 0;
        c.lse = pick(0, 3) != 0;
        c.bhsd = pick(0, 1);
        char buf[128];
        std::snprintf(buf, sizeof buf, "rnd hd%d b%d h%d/%d s%d/%d w(%d,%d)%s%s%s", c.hdim, c.batch, c.hq, c.hkv,
                      c.sq, c.sk, c.left, c.right, c.softcap > 0 ? " cap" : "", c.alibi ? " alibi" : "",
                      c.bhsd ? " bhsd" : "");
        names.emplace_back(buf);
        c.name = names.back().c_str();
        run_case(c, emu::CpAsync::AtWait);
        run_case(c, emu::CpAsync::AtIssue);
    }
    std::printf("fa2_emu_test --random: %d failures in %d configurations\n", g_fail, n);
    return g_fail ? 1 : 0;
}

int main(int argc, char** argv) {
    if (argc > 2 && std::string(argv[1]) == "--random")
        return run_random(std::atoi(argv[2]), argc > 3 ? static_cast<unsigned>(std::atoi(argv[3])) : 1u);
    const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
    //            name                                   bf16  D  b hq hkv  sq   sk  left right softcap alibi lse
    const Case cases[] = {
        {"hd32 window(20,5) alibi gqa", false, 32, 1, 4, 2, 70, 150, 20, 5, 0.f, true, true},
        {"hd64 full gqa3 ragged", false, 64, 2, 3, 1, 130, 100, -1, -1, 0.f, false, true},
        {"hd64 causal sq>sk (empty rows)", true, 64, 1, 2, 2, 150, 40, -1, 0, 0.f, false, true},
        {"hd96 softcap30 seqlen_q=1", false, 96, 2, 2, 1, 1, 77, -1, -1, 30.f, false, true},
        {"hd128 causal", true, 128, 1, 2, 1, 100, 100, -1, 0, 0.f, false, true},
        {"hd128 local(40,0) softcap alibi", false, 128, 1, 2, 2, 150, 170, 40, 0, 20.f, true, true},
        {"hd192 causal sq<sk", false, 192, 1, 2, 1, 50, 130, -1, 0, 0.f, false, false},
        {"hd256 full ragged", true, 256, 1, 2, 2, 65, 70, -1, -1, 0.f, false, true},
        {"hd32 diagonal-only window sq>sk", true, 32, 1, 2, 1, 40, 30, 0, 0, 0.f, false, true},
        {"hd256 window(30,10) gqa [b,h,s,d]", false, 256, 2, 4, 2, 130, 150, 30, 10, 0.f, false, true, true},
        {"hd96 causal seqlen_q=1 [b,h,s,d]", true, 96, 1, 2, 2, 1, 200, -1, 0, 0.f, false, true, true},
        {"hd192 alibi full", true, 192, 1, 2, 1, 70, 70, -1, -1, 0.f, true, true},
        {"hd64 softcap50 causal multi-block", false, 64, 1, 1, 1, 300, 300, -1, 0, 50.f, false, true},
        // The edges (issue 10): huge window bounds, scores near f32::MAX, infinite and NaN V.
        {"hd64 window(INT_MAX,INT_MAX) sq<sk", false, 64, 1, 2, 1, 90, 200, INT_MAX, INT_MAX, 0.f, false, true},
        {"hd128 window(INT_MAX,0) sq>sk", true, 128, 1, 2, 2, 150, 70, INT_MAX, 0, 0.f, false, true},
        {"hd32 window(0,INT_MAX)", false, 32, 1, 1, 1, 100, 130, 0, INT_MAX, 0.f, false, true},
        {"hd64 causal |score| 3e38", false, 64, 1, 2, 1, 100, 140, -1, 0, 0.f, false, true, false, 3.0e38},
        {"hd128 window(40,8) |score| 2.5e38", true, 128, 1, 2, 2, 130, 130, 40, 8, 0.f, false, true, false, 2.5e38},
        {"hd64 causal sq>sk V=+inf", false, 64, 1, 2, 1, 150, 60, -1, 0, 0.f, false, true, false, 0.0, 1},
        {"hd96 causal sq>sk V=NaN", true, 96, 1, 1, 1, 140, 50, -1, 0, 0.f, false, true, false, 0.0, 2},
    };
    for (const Case& c : cases) {
        run_case(c, emu::CpAsync::AtWait);
        if (!quick) run_case(c, emu::CpAsync::AtIssue);
    }
    if (g_fail) {
        std::printf("fa2_emu_test: %d FAILED\n", g_fail);
        return 1;
    }
    std::printf("fa2_emu_test: kernel source matches the float64 reference on every case\n");
    return 0;
}

// FA1 kernel logic on the CPU: compiles cuda/fa1_fwd.cu with cuda_host_shim.h (threads and
// barriers instead of a GPU), runs a list of cases and compares with a float64 reference written
// here from the definition. Built and run by tests/emulate_kernels.rs, once per instantiated
// head dim (the -D values of the table's tile). Exit status 0 = every case within tolerance.
#include "cuda_host_shim.h"

#include "../fa1_fwd.cu"
FA_INSTANCE(f16)
FA_INSTANCE(bf16)

#include <climits>
#include <cstdint>
#include <cstdio>

namespace fa1 {
alignas(16) float smem[kSmemFloats];
}

struct Case {
    int batch, sq, sk, hq, hkv, d, left, right;
    float softcap;
    bool alibi, lse;
    // The edges (issue 10): `target` > 0 sets the softmax scale so that the largest |score| is
    // `target` (e.g. near f32::MAX, where log2-unit scores overflow); `poison` 1 sets V = +inf at
    // key `poison_key`, 2 sets every V to NaN.
    double target = 0.0;
    int poison = 0, poison_key = 0;
};

struct Rng {
    uint64_t s;
    double uniform() {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        return ((s * 0x2545F4914F6CDD1DULL) >> 11) * (1.0 / 9007199254740992.0);
    }
    double normal() {
        const double u1 = std::max(uniform(), 1e-300), u2 = uniform();
        return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    }
};

template <typename T>
bool run_case(const Case& c, const char* dt, void (*kernel)(FwdParams), double rel_tol, Rng& rng) {
    const size_t nq = (size_t)c.batch * c.sq * c.hq * c.d, nk = (size_t)c.batch * c.sk * c.hkv * c.d;
    std::vector<T> q(nq), k(nk), v(nk), o(nq, fa_from_float<T>(NAN));
    for (auto* t : {&q, &k, &v})
        for (auto& x : *t) x = fa_from_float<T>((float)rng.normal());
    for (int b = 0; b < c.batch; ++b)
        for (int j = 0; j < c.sk; ++j)
            for (int h = 0; h < c.hkv; ++h)
                for (int e = 0; e < c.d; ++e) {
                    T& x = v[(((size_t)b * c.sk + j) * c.hkv + h) * c.d + e];
                    if (c.poison == 2 || (c.poison == 1 && j == c.poison_key)) x = fa_from_float<T>(c.poison == 1 ? INFINITY : NAN);
                }
    // The softmax scale: 1/sqrt(d), or the one that makes the largest |q.k| over visible pairs
    // equal `target`.
    double scale = 1.0 / std::sqrt((double)c.d);
    if (c.target > 0) {
        double max_dot = 0;
        for (int b = 0; b < c.batch; ++b)
            for (int h = 0; h < c.hq; ++h)
                for (int i = 0; i < c.sq; ++i)
                    for (int j = 0; j < c.sk; ++j) {
                        double dot = 0;
                        for (int e = 0; e < c.d; ++e)
                            dot += (double)fa_to_float(q[(((size_t)b * c.sq + i) * c.hq + h) * c.d + e]) *
                                   fa_to_float(k[(((size_t)b * c.sk + j) * c.hkv + h / (c.hq / c.hkv)) * c.d + e]);
                        max_dot = std::max(max_dot, std::abs(dot));
                    }
        scale = c.target / max_dot;
    }
    std::vector<float> lse((size_t)c.batch * c.hq * c.sq, NAN), slopes(c.hq);
    for (int h = 0; h < c.hq; ++h) slopes[h] = 0.5f / (h + 1);

    FwdParams p{};
    p.q = (uint64_t)q.data(), p.k = (uint64_t)k.data(), p.v = (uint64_t)v.data(), p.o = (uint64_t)o.data();
    p.lse = c.lse ? (uint64_t)lse.data() : 0;
    p.alibi_slopes = c.alibi ? (uint64_t)slopes.data() : 0;
    p.q_batch_stride = p.o_batch_stride = (int64_t)c.sq * c.hq * c.d;
    p.q_row_stride = p.o_row_stride = (int64_t)c.hq * c.d;
    p.q_head_stride = p.o_head_stride = c.d;
    p.k_batch_stride = p.v_batch_stride = (int64_t)c.sk * c.hkv * c.d;
    p.k_row_stride = p.v_row_stride = (int64_t)c.hkv * c.d;
    p.k_head_stride = p.v_head_stride = c.d;
    p.batch = c.batch, p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.heads_q = c.hq, p.heads_kv = c.hkv, p.head_dim = c.d;
    p.window_left = c.left, p.window_right = c.right;
    p.softmax_scale = (float)scale;
    // As the engine sets it: log2 e for natural-unit scores (softcap or ALiBi), else scale * log2 e.
    p.softmax_scale_log2 = (c.softcap > 0 || c.alibi) ? FA_LOG2E : p.softmax_scale * FA_LOG2E;
    p.softcap = c.softcap;
    p.flags = (c.lse ? FA_FLAG_RETURN_LSE : 0) | (c.softcap > 0 ? FA_FLAG_SOFTCAP : 0) | (c.alibi ? FA_FLAG_ALIBI : 0);

    const EmuDim3 grid{(unsigned)((c.sq + fa1::kBlockM - 1) / fa1::kBlockM), (unsigned)c.hq, (unsigned)c.batch};
    emu_launch(kernel, grid, FA_THREADS, FA_SMEM_BYTES, fa1::smem, fa1::kSmemFloats, p);

    // float64 reference from the definition (src/reference.rs semantics).
    double max_err = 0, max_lse_err = 0;
    bool ok = true;
    const int off = c.sk - c.sq;
    std::vector<double> s(c.sk);
    for (int b = 0; b < c.batch; ++b)
        for (int h = 0; h < c.hq; ++h)
            for (int i = 0; i < c.sq; ++i) {
                const int hk = h / (c.hq / c.hkv);
                const T* qr = &q[(((size_t)b * c.sq + i) * c.hq + h) * c.d];
                double m = -INFINITY;
                for (int j = 0; j < c.sk; ++j) {
                    const int rel = j - (i + off);
                    const bool vis = (c.left < 0 || rel >= -c.left) && (c.right < 0 || rel <= c.right);
                    if (!vis) {
                        s[j] = -INFINITY;
                        continue;
                    }
                    const T* kr = &k[(((size_t)b * c.sk + j) * c.hkv + hk) * c.d];
                    double dot = 0;
                    for (int e = 0; e < c.d; ++e) dot += (double)fa_to_float(qr[e]) * fa_to_float(kr[e]);
                    double x = dot * (double)p.softmax_scale;
                    if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
                    if (c.alibi) x -= slopes[h] * std::abs((double)(i + off - j));
                    s[j] = x;
                    m = std::max(m, x);
                }
                double sum = 0;
                std::vector<double> acc(c.d, 0.0);
                if (m > -INFINITY)
                    for (int j = 0; j < c.sk; ++j) {
                        if (s[j] == -INFINITY) continue;
                        const double e = std::exp(s[j] - m);
                        sum += e;
                        const T* vr = &v[(((size_t)b * c.sk + j) * c.hkv + hk) * c.d];
                        for (int dd = 0; dd < c.d; ++dd) acc[dd] += e * fa_to_float(vr[dd]);
                    }
                const T* orow = &o[(((size_t)b * c.sq + i) * c.hq + h) * c.d];
                for (int dd = 0; dd < c.d; ++dd) {
                    const double ref = sum > 0 ? acc[dd] / sum : 0.0;
                    const double got = fa_to_float(orow[dd]);
                    if (!std::isfinite(ref)) {  // the row sees a poisoned V: it must not look finite
                        if (std::isfinite(got)) ok = false;
                        continue;
                    }
                    const double err = std::abs(got - ref);  // NaN (unwritten) fails below
                    if (!(err <= rel_tol * std::abs(ref) + 1e-4)) ok = false;
                    if (!(err <= max_err)) max_err = err;
                }
                if (c.lse) {
                    const double ref = sum > 0 ? m + std::log(sum) : -INFINITY;
                    const double got = lse[((size_t)b * c.hq + h) * c.sq + i];
                    const double err = (ref == got) ? 0.0 : std::abs(got - ref);
                    if (!(err <= 1e-4 * std::max(1.0, std::abs(ref)))) ok = false;
                    if (!(err <= max_lse_err)) max_lse_err = err;
                }
            }
    std::printf("%-4s hd%-3d b%d sq%-3d sk%-3d hq%d hkv%d d%-3d win(%d,%d) softcap %g alibi %d lse %d target %g poison %d: "
                "max err %.3g, lse err %.3g  %s\n",
                dt, FA_HEAD_DIM, c.batch, c.sq, c.sk, c.hq, c.hkv, c.d, c.left, c.right, c.softcap, c.alibi, c.lse,
                c.target, c.poison, max_err, max_lse_err, ok ? "ok" : "FAIL");
    return ok;
}

int main() {
    const int hd = FA_HEAD_DIM;
    const int tail = hd - 5;  // a head_dim that is not a multiple of 8: runs on this instance, tail masked
    const Case cases[] = {
        {1, 1, 1, 1, 1, hd, -1, -1, 0.f, false, true},
        {2, 70, 45, 4, 2, hd, -1, 0, 0.f, false, true},      // causal, sq > sk: 25 rows see no key
        {1, 45, 133, 2, 1, tail, 7, 3, 20.f, true, true},     // window, softcap, ALiBi, MQA
        {1, 66, 66, 3, 3, hd, 10, 0, 0.f, false, true},       // causal window
        {1, 33, 80, 2, 2, tail, -1, -1, 0.f, true, false},    // no mask, ALiBi, no LSE
        {1, 20, 50, 2, 1, hd, 2, -1, 0.f, false, true},       // left bound only
        // The edges (issue 10):
        {1, 40, 70, 2, 1, hd, INT_MAX, INT_MAX, 0.f, false, true},  // huge bounds: no mask
        {1, 70, 40, 2, 2, hd, INT_MAX, 0, 0.f, false, true},        // huge left, causal, sq > sk
        {1, 30, 50, 1, 1, hd, 0, INT_MAX, 0.f, false, true},        // huge right
        {1, 33, 45, 2, 1, hd, -1, 0, 0.f, false, true, 3.0e38},   // largest |score| 3e38
        {1, 33, 45, 2, 1, tail, 9, 2, 0.f, false, true, 2.5e38},  // window, tail dims
        {1, 40, 40, 2, 2, hd, -1, 0, 0.f, false, true, 0.0, 1, 20},  // V = inf at key 20
        {1, 50, 20, 1, 1, hd, -1, 0, 0.f, false, true, 0.0, 2},      // V = NaN, empty rows
        {1, 40, 40, 1, 1, hd, 5, 5, 0.f, true, true, 0.0, 1, 17},    // window + ALiBi, inf
    };
    Rng rng{0x9E3779B97F4A7C15ULL};
    bool ok = true;
    for (const Case& c : cases) {
        ok &= run_case<fa_f16>(c, "f16", FA_NAME(FA_HEAD_DIM, f16), 1.0 / 1024, rng);
        ok &= run_case<fa_bf16>(c, "bf16", FA_NAME(FA_HEAD_DIM, bf16), 1.0 / 128, rng);
    }
    std::printf("%s\n", ok ? "all cases ok" : "SOME CASES FAILED");
    return ok ? 0 : 1;
}

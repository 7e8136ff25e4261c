// GPU smoke test and micro-benchmark of the FA3 stage ladder, independent of the Rust runtime:
// a plain g++ program that dlopens libcuda, loads the cubins scripts/check-fa3.sh built
// (target/fa3-check/fa3_hd<D>.sm90a.cubin), runs every stage on a small test matrix against a
// float64 CPU reference, then optionally times each stage. Nothing here has run yet (written
// without a GPU); it exists so a 15-minute GPU window goes straight to answers.
//
// Build (here, no GPU needed; scripts/check-fa3.sh does it):
//   g++ -std=c++17 -O2 -static-libstdc++ -static-libgcc -I<cuda>/include -Icuda/include
//       -D__host__= -D__device__= -D__forceinline__=inline scripts/fa3-gpu-smoke.cpp
//       -ldl -o target/fa3-check/fa3-gpu-smoke
// Run (on the GPU machine, from the repository root; one line per case, flushed before each
// launch so a hang names its rung; wrap in `timeout`):
//   target/fa3-check/fa3-gpu-smoke [--stages 12345] [--hd 64,128,256] [--ctas N] [--bench]
// --ctas N caps stage 5's persistent grid (default: the SM count), so each CTA runs many tiles.
// Exit status 0 only if every case passed.
#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda.h>  // types and enums only: every driver call goes through dlsym

#include "fa3_traits.cuh"
#include "fa_params.h"

namespace {

// ---- driver entry points (names after cuda.h's _v2 macro expansion)
#define FA3_STR2(x) #x
#define FA3_STR(x) FA3_STR2(x)
#define FA3_DRIVER_FNS(X)                                                                     \
    X(cuInit) X(cuDeviceGet) X(cuDevicePrimaryCtxRetain) X(cuCtxSetCurrent)                   \
    X(cuDeviceGetAttribute) X(cuModuleLoadData) X(cuModuleGetFunction) X(cuFuncSetAttribute) \
    X(cuMemAlloc) X(cuMemFree) X(cuMemcpyHtoD) X(cuMemcpyDtoH) X(cuMemsetD8)                 \
    X(cuLaunchKernel) X(cuCtxSynchronize) X(cuTensorMapEncodeTiled) X(cuGetErrorString)      \
    X(cuEventCreate) X(cuEventRecord) X(cuEventSynchronize)
#define FA3_DECLARE(fn) decltype(&fn) p_##fn = nullptr;
FA3_DRIVER_FNS(FA3_DECLARE)
// cuda.h 13 maps cuEventElapsedTime to its _v2 (driver >= 12.8); the original symbol, same
// signature, exists in every driver, so look that one up by its literal name.
CUresult (*p_cuEventElapsedTime)(float*, CUevent, CUevent) = nullptr;

void check(CUresult r, const char* what) {
    if (r == CUDA_SUCCESS) return;
    const char* msg = "?";
    if (p_cuGetErrorString) p_cuGetErrorString(r, &msg);
    std::printf("FATAL %s: %s (%d)\n", what, msg, static_cast<int>(r));
    std::exit(2);
}
#define CK(call) check(call, #call)

void load_driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        std::printf("FATAL: no libcuda.so.1 (%s)\n", dlerror());
        std::exit(2);
    }
#define FA3_LOAD(fn)                                                               \
    p_##fn = reinterpret_cast<decltype(&fn)>(dlsym(lib, FA3_STR(fn)));             \
    if (!p_##fn) {                                                                 \
        std::printf("FATAL: libcuda lacks %s\n", FA3_STR(fn));                     \
        std::exit(2);                                                              \
    }
    FA3_DRIVER_FNS(FA3_LOAD)
    p_cuEventElapsedTime =
        reinterpret_cast<CUresult (*)(float*, CUevent, CUevent)>(dlsym(lib, "cuEventElapsedTime"));
    if (!p_cuEventElapsedTime) {
        std::printf("FATAL: libcuda lacks cuEventElapsedTime\n");
        std::exit(2);
    }
}

// ---- host 16-bit conversions (round to nearest even)
uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
uint16_t f32_to_f16(float f) {
    _Float16 h = static_cast<_Float16>(f);
    uint16_t u;
    std::memcpy(&u, &h, 2);
    return u;
}
float f16_to_f32(uint16_t u) {
    _Float16 h;
    std::memcpy(&h, &u, 2);
    return static_cast<float>(h);
}

struct Case {
    const char* name;
    int batch, sq, sk, hq, hkv, left, right;
    float softcap;
};

struct Geometry {
    int threads, block_m, smem;
};
Geometry geometry(int stage, int d) {
#define FA3_GEOM(S, D) \
    if (stage == S && d == D) return {fa3::Fa3Traits<S, D>::kThreads, fa3::Fa3Traits<S, D>::kBlockM, fa3::Fa3Traits<S, D>::kSmemBytes};
#define FA3_GEOM_D(S) FA3_GEOM(S, 64) FA3_GEOM(S, 128) FA3_GEOM(S, 256)
    FA3_GEOM_D(1) FA3_GEOM_D(2) FA3_GEOM_D(3) FA3_GEOM_D(4) FA3_GEOM_D(5)
    std::printf("FATAL: no geometry for stage %d hd %d\n", stage, d);
    std::exit(2);
}

CUtensorMap tensor_map(CUdeviceptr base, bool bf16, int d, int heads, int seqlen, int batch,
                       int box_rows) {
    // {d, heads, seqlen, batch}, contiguous [b, s, h, d]; box {64, 1, rows, 1}; docs/fa3.md.
    CUtensorMap m;
    const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(heads), cuuint64_t(seqlen), cuuint64_t(batch)};
    const cuuint64_t strides[3] = {cuuint64_t(d) * 2, cuuint64_t(heads) * d * 2,
                                   cuuint64_t(seqlen) * heads * d * 2};
    const cuuint32_t box[4] = {64, 1, cuuint32_t(box_rows), 1};
    const cuuint32_t elem[4] = {1, 1, 1, 1};
    CK(p_cuTensorMapEncodeTiled(&m, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                4, reinterpret_cast<void*>(base), dims, strides, box, elem,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    return m;
}

struct Run {
    CUfunction fn;
    int stage, d, sms;
    bool bf16;
};

// Launches one stage on device buffers; returns nothing, errors are fatal.
void launch(const Run& r, const Case& c, CUdeviceptr q, CUdeviceptr k, CUdeviceptr v,
            CUdeviceptr o, CUdeviceptr lse) {
    const Geometry g = geometry(r.stage, r.d);
    FwdParams p;
    std::memset(&p, 0, sizeof p);
    p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse;
    p.q_batch_stride = int64_t(c.sq) * c.hq * r.d, p.q_row_stride = int64_t(c.hq) * r.d, p.q_head_stride = r.d;
    p.k_batch_stride = int64_t(c.sk) * c.hkv * r.d, p.k_row_stride = int64_t(c.hkv) * r.d, p.k_head_stride = r.d;
    p.v_batch_stride = p.k_batch_stride, p.v_row_stride = p.k_row_stride, p.v_head_stride = r.d;
    p.o_batch_stride = p.q_batch_stride, p.o_row_stride = p.q_row_stride, p.o_head_stride = r.d;
    p.batch = c.batch, p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.heads_q = c.hq, p.heads_kv = c.hkv;
    p.head_dim = r.d, p.window_left = c.left, p.window_right = c.right;
    p.softmax_scale = 1.f / std::sqrt(float(r.d));
    p.softcap = c.softcap;
    p.softmax_scale_log2 = c.softcap > 0 ? 1.4426950408889634f : p.softmax_scale * 1.4426950408889634f;
    p.flags = FA_FLAG_RETURN_LSE | (c.softcap > 0 ? FA_FLAG_SOFTCAP : 0u);
    const int block_n = r.d <= 128 ? 128 : 64;
    CUtensorMap tq = tensor_map(q, r.bf16, r.d, c.hq, c.sq, c.batch, 64);
    CUtensorMap tk = tensor_map(k, r.bf16, r.d, c.hkv, c.sk, c.batch, block_n);
    CUtensorMap tv = tensor_map(v, r.bf16, r.d, c.hkv, c.sk, c.batch, block_n);
    void* args[4] = {&p, &tq, &tk, &tv};
    const unsigned m_tiles = unsigned((c.sq + g.block_m - 1) / g.block_m);
    unsigned gx = m_tiles, gy = unsigned(c.hq), gz = unsigned(c.batch);
    if (r.stage >= 5) {
        const unsigned tiles = m_tiles * unsigned(c.hq) * unsigned(c.batch);
        gx = tiles < unsigned(r.sms) ? tiles : unsigned(r.sms), gy = 1, gz = 1;
    }
    CK(p_cuLaunchKernel(r.fn, gx, gy, gz, unsigned(g.threads), 1, 1, unsigned(g.smem), nullptr, args, nullptr));
}

// float64 reference on the rounded inputs: returns O [b, sq, hq, d] and LSE [b, hq, sq].
void reference(const Case& c, int d, const std::vector<float>& q, const std::vector<float>& k,
               const std::vector<float>& v, std::vector<double>& o, std::vector<double>& lse) {
    const double scale = 1.0 / std::sqrt(double(d));
    const int off = c.sk - c.sq, group = c.hq / c.hkv;
    o.assign(size_t(c.batch) * c.sq * c.hq * d, 0.0);
    lse.assign(size_t(c.batch) * c.hq * c.sq, -INFINITY);
    std::vector<double> s(c.sk);
    for (int b = 0; b < c.batch; ++b)
        for (int h = 0; h < c.hq; ++h)
            for (int i = 0; i < c.sq; ++i) {
                double mx = -INFINITY;
                for (int j = 0; j < c.sk; ++j) {
                    const bool vis = (c.left < 0 || j >= i + off - c.left) && (c.right < 0 || j <= i + off + c.right);
                    double acc = 0;
                    for (int x = 0; x < d; ++x)
                        acc += double(q[((size_t(b) * c.sq + i) * c.hq + h) * d + x]) *
                               k[((size_t(b) * c.sk + j) * c.hkv + h / group) * d + x];
                    acc *= scale;
                    if (c.softcap > 0) acc = c.softcap * std::tanh(acc / c.softcap);
                    s[j] = vis ? acc : -INFINITY;
                    mx = std::max(mx, s[j]);
                }
                if (mx == -INFINITY) continue;  // no visible key: O = 0, LSE = -inf
                double sum = 0;
                for (int j = 0; j < c.sk; ++j) sum += s[j] == -INFINITY ? 0 : std::exp(s[j] - mx);
                lse[(size_t(b) * c.hq + h) * c.sq + i] = mx + std::log(sum);
                for (int j = 0; j < c.sk; ++j) {
                    if (s[j] == -INFINITY) continue;
                    const double pj = std::exp(s[j] - mx) / sum;
                    for (int x = 0; x < d; ++x)
                        o[((size_t(b) * c.sq + i) * c.hq + h) * d + x] +=
                            pj * v[((size_t(b) * c.sk + j) * c.hkv + h / group) * d + x];
                }
            }
}

uint32_t g_seed = 20261129u;
float randn() {  // Box-Muller on an LCG: deterministic across machines
    auto u = [] {
        g_seed = g_seed * 1664525u + 1013904223u;
        return (double(g_seed >> 8) + 0.5) / double(1u << 24);
    };
    return float(std::sqrt(-2.0 * std::log(u())) * std::cos(6.283185307179586 * u()));
}

bool run_case(const Run& r, const Case& c) {
    const size_t nq = size_t(c.batch) * c.sq * c.hq * r.d, nk = size_t(c.batch) * c.sk * c.hkv * r.d;
    std::vector<uint16_t> hq(nq), hk(nk), hv(nk);
    std::vector<float> fq(nq), fk(nk), fv(nk);
    auto fill = [&](std::vector<uint16_t>& h, std::vector<float>& f) {
        for (size_t i = 0; i < h.size(); ++i) {
            h[i] = r.bf16 ? f32_to_bf16(randn()) : f32_to_f16(randn());
            f[i] = r.bf16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
        }
    };
    fill(hq, fq);
    fill(hk, fk);
    fill(hv, fv);
    CUdeviceptr q, k, v, o, lse;
    const size_t nlse = size_t(c.batch) * c.hq * c.sq;
    CK(p_cuMemAlloc(&q, nq * 2));
    CK(p_cuMemAlloc(&k, nk * 2));
    CK(p_cuMemAlloc(&v, nk * 2));
    CK(p_cuMemAlloc(&o, nq * 2));
    CK(p_cuMemAlloc(&lse, nlse * 4));
    CK(p_cuMemcpyHtoD(q, hq.data(), nq * 2));
    CK(p_cuMemcpyHtoD(k, hk.data(), nk * 2));
    CK(p_cuMemcpyHtoD(v, hv.data(), nk * 2));
    CK(p_cuMemsetD8(o, 0xff, nq * 2));  // poison: NaN in both 16-bit formats
    CK(p_cuMemsetD8(lse, 0xff, nlse * 4));
    std::printf("  s%d %s hd%-3d %-28s ... ", r.stage, r.bf16 ? "bf16" : "f16 ", r.d, c.name);
    std::fflush(stdout);
    launch(r, c, q, k, v, o, lse);
    CK(p_cuCtxSynchronize());
    std::vector<uint16_t> ho(nq);
    std::vector<float> hl(nlse);
    CK(p_cuMemcpyDtoH(ho.data(), o, nq * 2));
    CK(p_cuMemcpyDtoH(hl.data(), lse, nlse * 4));
    for (CUdeviceptr ptr : {q, k, v, o, lse}) CK(p_cuMemFree(ptr));
    std::vector<double> ro, rl;
    reference(c, r.d, fq, fk, fv, ro, rl);
    double err_o = 0, err_l = 0, max_ref = 1.0;
    bool nan = false;
    for (double x : ro) max_ref = std::max(max_ref, std::fabs(x));
    for (size_t i = 0; i < nq; ++i) {
        const float x = r.bf16 ? bf16_to_f32(ho[i]) : f16_to_f32(ho[i]);
        if (!std::isfinite(x)) nan = true;
        err_o = std::max(err_o, std::fabs(double(x) - ro[i]));
    }
    for (size_t i = 0; i < nlse; ++i) {
        if (rl[i] == -INFINITY) {
            if (!(hl[i] == -INFINITY)) err_l = INFINITY;
            continue;
        }
        if (!std::isfinite(hl[i])) nan = true;
        err_l = std::max(err_l, std::fabs(double(hl[i]) - rl[i]));
    }
    // Outputs are convex combinations of N(0,1) rows (|O| up to ~4 for rows with few keys). The
    // tolerance covers rounding P and O to 16 bits (2 x 2^-9 relative for bf16, 2 x 2^-12 for
    // f16) with a 4x margin, scaled by max|O|; a layout or masking bug gives errors of order 1.
    // The Rust GPU tests apply FlashAttention's exact rule once the runtime is wired.
    const double tol_o = (r.bf16 ? 1.6e-2 : 2e-3) * max_ref, tol_l = 1e-2;
    const bool ok = !nan && err_o <= tol_o && err_l <= tol_l;
    std::printf("%s max|dO| %.2e max|dLSE| %.2e%s\n", ok ? "ok  " : "FAIL", err_o, err_l,
                nan ? " (non-finite output)" : "");
    return ok;
}

void bench(const Run& r, bool causal) {
    const Case c{"bench", 2, 8192, 8192, 16, 16, -1, causal ? 0 : -1, 0.f};
    const size_t n = size_t(c.batch) * c.sq * c.hq * r.d;
    CUdeviceptr q, k, v, o, lse;
    CK(p_cuMemAlloc(&q, n * 2));
    CK(p_cuMemAlloc(&k, n * 2));
    CK(p_cuMemAlloc(&v, n * 2));
    CK(p_cuMemAlloc(&o, n * 2));
    CK(p_cuMemAlloc(&lse, size_t(c.batch) * c.hq * c.sq * 4));
    CK(p_cuMemsetD8(q, 0x3c, n * 2));  // small finite values; timing only
    CK(p_cuMemsetD8(k, 0x3c, n * 2));
    CK(p_cuMemsetD8(v, 0x3c, n * 2));
    CUevent e0, e1;
    CK(p_cuEventCreate(&e0, CU_EVENT_DEFAULT));
    CK(p_cuEventCreate(&e1, CU_EVENT_DEFAULT));
    std::printf("  bench s%d %s hd%d b2 s8192 h16 %s ... ", r.stage, r.bf16 ? "bf16" : "f16", r.d,
                causal ? "causal    " : "non-causal");
    std::fflush(stdout);
    launch(r, c, q, k, v, o, lse);  // warm-up
    CK(p_cuCtxSynchronize());
    const int reps = 10;
    CK(p_cuEventRecord(e0, nullptr));
    for (int i = 0; i < reps; ++i) launch(r, c, q, k, v, o, lse);
    CK(p_cuEventRecord(e1, nullptr));
    CK(p_cuEventSynchronize(e1));
    float ms = 0;
    CK(p_cuEventElapsedTime(&ms, e0, e1));
    const double flops = 4.0 * c.batch * c.hq * double(c.sq) * c.sk * r.d * (causal ? 0.5 : 1.0);
    std::printf("%.3f ms  %.1f TFLOP/s\n", ms / reps, flops / (ms / reps * 1e-3) / 1e12);
    for (CUdeviceptr ptr : {q, k, v, o, lse}) CK(p_cuMemFree(ptr));
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<int> stages = {1, 2, 3, 4, 5};
    bool do_bench = false;
    int ctas = 0;  // 0: the SM count
    std::vector<int> hds = {64, 128, 256};
    std::string dir = "target/fa3-check";
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--bench") do_bench = true;
        else if (a == "--ctas" && i + 1 < argc) ctas = std::atoi(argv[++i]);
        else if (a == "--hd" && i + 1 < argc) {
            hds.clear();
            for (const char* h = argv[++i]; *h;) {
                hds.push_back(std::atoi(h));
                while (*h && *h != ',') ++h;
                if (*h == ',') ++h;
            }
        }
        else if (a == "--dir" && i + 1 < argc) dir = argv[++i];
        else if (a == "--stages" && i + 1 < argc) {
            stages.clear();
            for (const char* s = argv[++i]; *s; ++s)
                if (*s >= '1' && *s <= '5') stages.push_back(*s - '0');
        } else {
            std::printf("usage: %s [--stages 12345] [--hd 64,128,256] [--ctas N] [--bench] [--dir target/fa3-check]\n", argv[0]);
            return 2;
        }
    }
    load_driver();
    CK(p_cuInit(0));
    CUdevice dev;
    CK(p_cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(p_cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(p_cuCtxSetCurrent(ctx));
    int major = 0, sms = 0;
    CK(p_cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    CK(p_cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    std::printf("fa3-gpu-smoke: sm_%d0, %d SMs\n", major, sms);

    const Case cases[] = {
        {"b1 s128 h1", 1, 128, 128, 1, 1, -1, -1, 0.f},
        {"b2 sq100 sk300 gqa4:2 causal", 2, 100, 300, 4, 2, -1, 0, 0.f},
        {"b1 s257 h2 window(64,16)", 1, 257, 257, 2, 2, 64, 16, 0.f},
        {"b1 sq300 sk100 causal (empty)", 1, 300, 100, 2, 1, -1, 0, 0.f},
        {"b1 s200 h2 softcap 30", 1, 200, 200, 2, 2, -1, -1, 30.f},
        {"b1 s1000 h1 (8 kv tiles)", 1, 1000, 1000, 1, 1, -1, -1, 0.f},
    };
    int failures = 0;
    for (int d : hds) {
        const std::string path = dir + "/fa3_hd" + std::to_string(d) + ".sm90a.cubin";
        FILE* f = std::fopen(path.c_str(), "rb");
        if (!f) {
            std::printf("FATAL: %s missing (run scripts/check-fa3.sh first)\n", path.c_str());
            return 2;
        }
        std::vector<char> image;
        char buf[65536];
        for (size_t got; (got = std::fread(buf, 1, sizeof buf, f)) > 0;) image.insert(image.end(), buf, buf + got);
        std::fclose(f);
        CUmodule mod;
        CK(p_cuModuleLoadData(&mod, image.data()));
        for (int stage : stages)
            for (bool bf16 : {true, false}) {
                const std::string name = "fa3s" + std::to_string(stage) + "_fwd_hd" + std::to_string(d) + "_" + (bf16 ? "bf16" : "f16");
                Run r{nullptr, stage, d, ctas > 0 ? ctas : sms, bf16};
                CK(p_cuModuleGetFunction(&r.fn, mod, name.c_str()));
                CK(p_cuFuncSetAttribute(r.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, geometry(stage, d).smem));
                for (const Case& c : cases) {
                    if (!bf16 && std::strcmp(c.name, "b1 s128 h1") != 0 && std::strcmp(c.name, "b2 sq100 sk300 gqa4:2 causal") != 0) continue;
                    failures += run_case(r, c) ? 0 : 1;
                }
                if (do_bench && bf16 && d == 128) {
                    bench(r, false);
                    bench(r, true);
                }
            }
    }
    std::printf("fa3-gpu-smoke: %s (%d failing cases)\n", failures ? "FAILED" : "all passed", failures);
    return failures ? 1 : 0;
}

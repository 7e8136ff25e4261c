// A fake libcuda.so.1 for testing scripts/fa3-gpu-smoke.cpp on a machine without a GPU: "device"
// memory is host memory, and cuLaunchKernel of an fa3s<stage>_fwd_hd<D>_<dtype> kernel checks
// the launch configuration against Fa3Traits, then computes the attention on the CPU from the
// FwdParams it was given. A smoke run against it proves the harness (parameter packing, strides,
// flags, tensor-map arguments, reference, tolerances) is self-consistent; it says nothing about
// the kernels. scripts/check-fa3.sh builds it and runs the smoke test against it.
//
// Build: g++ -std=c++17 -O2 -shared -fPIC -I<cuda>/include -Icuda/include -D__host__=
//        -D__device__= -D__forceinline__=inline scripts/fa3-fake-libcuda.cpp -o <dir>/libcuda.so.1
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda.h>

#include "fa3_traits.cuh"
#include "fa_params.h"

namespace {

constexpr int kFakeSms = 132;

float load16(const void* base, int64_t idx, bool bf16) {
    uint16_t h;
    std::memcpy(&h, static_cast<const uint16_t*>(base) + idx, 2);
    if (bf16) {
        uint32_t u = uint32_t(h) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return float(x);
}
void store16(void* base, int64_t idx, float f, bool bf16) {
    uint16_t h;
    if (bf16) {
        uint32_t u;
        std::memcpy(&u, &f, 4);
        h = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    } else {
        _Float16 x = _Float16(f);
        std::memcpy(&h, &x, 2);
    }
    std::memcpy(static_cast<uint16_t*>(base) + idx, &h, 2);
}

struct Expect {
    int threads, block_m, smem;
};
bool expect(int stage, int d, Expect& e) {
#define FAKE_GEOM(S, D) \
    if (stage == S && d == D) { e = {fa3::Fa3Traits<S, D>::kThreads, fa3::Fa3Traits<S, D>::kBlockM, fa3::Fa3Traits<S, D>::kSmemBytes}; return true; }
#define FAKE_GEOM_D(S) FAKE_GEOM(S, 64) FAKE_GEOM(S, 128) FAKE_GEOM(S, 256)
    FAKE_GEOM_D(1) FAKE_GEOM_D(2) FAKE_GEOM_D(3) FAKE_GEOM_D(4) FAKE_GEOM_D(5)
    return false;
}

CUresult fail(const char* why) {
    std::fprintf(stderr, "fake libcuda: %s\n", why);
    return CUDA_ERROR_INVALID_VALUE;
}

}  // namespace

extern "C" {

CUresult CUDAAPI cuInit(unsigned int) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGet(CUdevice* d, int) { *d = 0; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
    *c = reinterpret_cast<CUcontext>(0x1);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxSetCurrent(CUcontext) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice) {
    *v = a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR ? 9 : a == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT ? kFakeSms : 0;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuModuleLoadData(CUmodule* m, const void*) {
    *m = reinterpret_cast<CUmodule>(0x2);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuModuleGetFunction(CUfunction* f, CUmodule, const char* name) {
    *f = reinterpret_cast<CUfunction>(strdup(name));
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetAttribute(CUfunction, CUfunction_attribute a, int v) {
    if (a == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES && v > 227 * 1024) return fail("smem opt-in above 227 KiB");
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemAlloc(CUdeviceptr* p, size_t n) {
    void* h = std::malloc(n);
    *p = reinterpret_cast<CUdeviceptr>(h);
    return h ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult CUDAAPI cuMemFree(CUdeviceptr p) { std::free(reinterpret_cast<void*>(p)); return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr d, const void* s, size_t n) { std::memcpy(reinterpret_cast<void*>(d), s, n); return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemcpyDtoH(void* d, CUdeviceptr s, size_t n) { std::memcpy(d, reinterpret_cast<void*>(s), n); return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemsetD8(CUdeviceptr d, unsigned char v, size_t n) { std::memset(reinterpret_cast<void*>(d), v, n); return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSynchronize() { return CUDA_SUCCESS; }
CUresult CUDAAPI cuGetErrorString(CUresult, const char** s) { *s = "fake libcuda error"; return CUDA_SUCCESS; }
CUresult CUDAAPI cuEventCreate(CUevent* e, unsigned int) { *e = reinterpret_cast<CUevent>(0x3); return CUDA_SUCCESS; }
CUresult CUDAAPI cuEventRecord(CUevent, CUstream) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuEventSynchronize(CUevent) { return CUDA_SUCCESS; }
#undef cuEventElapsedTime  // export the original (v1) name the smoke test looks up
CUresult CUDAAPI cuEventElapsedTime(float* ms, CUevent, CUevent) { *ms = 1.f; return CUDA_SUCCESS; }

// Checks the documented tensor-map rules (docs/fa3.md) and records dims/box in the opaque words.
CUresult CUDAAPI cuTensorMapEncodeTiled(CUtensorMap* m, CUtensorMapDataType, cuuint32_t rank, void* addr,
                                        const cuuint64_t* dims, const cuuint64_t* strides,
                                        const cuuint32_t* box, const cuuint32_t* elem, CUtensorMapInterleave,
                                        CUtensorMapSwizzle swz, CUtensorMapL2promotion, CUtensorMapFloatOOBfill) {
    if (rank != 4) return fail("rank != 4");
    if (reinterpret_cast<uintptr_t>(addr) % 16) return fail("global address not 16-byte aligned");
    for (int i = 0; i < 3; ++i)
        if (strides[i] % 16 || strides[i] >= (1ull << 40)) return fail("stride rule");
    for (int i = 0; i < 4; ++i)
        if (box[i] == 0 || box[i] > 256 || elem[i] != 1 || dims[i] == 0) return fail("box/elem/dim rule");
    if (swz != CU_TENSOR_MAP_SWIZZLE_128B || box[0] * 2 > 128) return fail("swizzle/inner box");
    std::memset(m, 0, sizeof *m);
    for (int i = 0; i < 4; ++i) m->opaque[i] = dims[i], m->opaque[4 + i] = box[i];
    return CUDA_SUCCESS;
}

// Validates the launch against Fa3Traits and the kernel contract, then runs the attention on
// the CPU with FwdParams' own pointers and strides.
CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz, unsigned smem, CUstream, void** args, void**) {
    int stage = 0, d = 0;
    char dt[8] = {0};
    if (std::sscanf(reinterpret_cast<const char*>(f), "fa3s%d_fwd_hd%d_%7[a-z0-9]", &stage, &d, dt) != 3)
        return fail("unknown kernel name");
    const bool bf16 = std::strcmp(dt, "bf16") == 0;
    Expect e{};
    if (!expect(stage, d, e)) return fail("no such instance");
    const FwdParams& p = *static_cast<const FwdParams*>(args[0]);
    if (bx != unsigned(e.threads) || by != 1 || bz != 1) return fail("block size");
    if (smem != unsigned(e.smem)) return fail("dynamic smem");
    if (p.head_dim != d) return fail("head_dim != instance");
    const unsigned m_tiles = unsigned((p.seqlen_q + e.block_m - 1) / e.block_m);
    if (stage < 5 && (gx != m_tiles || gy != unsigned(p.heads_q) || gz != unsigned(p.batch))) return fail("grid");
    if (stage >= 5 && (gx == 0 || gx > m_tiles * unsigned(p.heads_q * p.batch) || gy != 1 || gz != 1))
        return fail("persistent grid");
    if (stage >= 2) {  // tensor maps follow the params: check dims and boxes against the params
        const CUtensorMap* tq = static_cast<const CUtensorMap*>(args[1]);
        const CUtensorMap* tk = static_cast<const CUtensorMap*>(args[2]);
        const int block_n = fa3::Fa3Traits<1, 64>::kBlockN == 128 && d <= 128 ? 128 : 64;
        if (tq->opaque[0] != cuuint64_t(d) || tq->opaque[1] != cuuint64_t(p.heads_q) ||
            tq->opaque[2] != cuuint64_t(p.seqlen_q) || tq->opaque[3] != cuuint64_t(p.batch) || tq->opaque[6] != 64)
            return fail("Q tensor map");
        if (tk->opaque[1] != cuuint64_t(p.heads_kv) || tk->opaque[2] != cuuint64_t(p.seqlen_k) ||
            tk->opaque[6] != cuuint64_t(block_n))
            return fail("K tensor map");
    }
    if (p.flags & FA_FLAG_ALIBI) return fail("ALiBi routed to FA3");
    constexpr double kBenchSized = double(1 << 24);  // seqlen_q * seqlen_k: a --bench shape
    if (double(p.seqlen_q) * p.seqlen_k > kBenchSized) return CUDA_SUCCESS;  // timing only
    const void *q = reinterpret_cast<const void*>(p.q), *k = reinterpret_cast<const void*>(p.k),
               *v = reinterpret_cast<const void*>(p.v);
    void* o = reinterpret_cast<void*>(p.o);
    float* lse = reinterpret_cast<float*>(p.lse);
    const int group = p.heads_q / p.heads_kv;
    std::vector<double> s(p.seqlen_k), acc(d);
    for (int b = 0; b < p.batch; ++b)
        for (int h = 0; h < p.heads_q; ++h)
            for (int i = 0; i < p.seqlen_q; ++i) {
                double mx = -INFINITY;
                for (int j = 0; j < p.seqlen_k; ++j) {
                    double dot = 0;
                    for (int x = 0; x < d; ++x)
                        dot += double(load16(q, b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride + x, bf16)) *
                               load16(k, b * p.k_batch_stride + j * p.k_row_stride + (h / group) * p.k_head_stride + x, bf16);
                    double sc = dot * p.softmax_scale;
                    if (p.flags & FA_FLAG_SOFTCAP) sc = p.softcap * std::tanh(sc / p.softcap);
                    s[j] = fa3::key_visible(p, i, j) ? sc : -INFINITY;
                    mx = s[j] > mx ? s[j] : mx;
                }
                double sum = 0;
                for (double& a : acc) a = 0;
                if (mx != -INFINITY)
                    for (int j = 0; j < p.seqlen_k; ++j) {
                        if (s[j] == -INFINITY) continue;
                        const double w = std::exp(s[j] - mx);
                        sum += w;
                        for (int x = 0; x < d; ++x)
                            acc[x] += w * load16(v, b * p.v_batch_stride + j * p.v_row_stride + (h / group) * p.v_head_stride + x, bf16);
                    }
                for (int x = 0; x < d; ++x)
                    store16(o, b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride + x,
                            sum > 0 ? float(acc[x] / sum) : 0.f, bf16);
                if ((p.flags & FA_FLAG_RETURN_LSE) && lse)
                    lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + i] = sum > 0 ? float(mx + std::log(sum)) : -INFINITY;
            }
    return CUDA_SUCCESS;
}

}  // extern "C"

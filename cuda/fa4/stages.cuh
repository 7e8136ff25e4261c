// The FA4 kernels' entry: the warp roles of stages 2-3 and one `forward` per stage (stage 1 or
// the warp roles); on the host pass and other targets the kernels compile to nothing.
#pragma once
// Stage 1 first, then the warp roles: the order the definitions had in one file.
#include "fa4/stage1.cuh"
#include "fa4/roles3.cuh"

namespace fa4 {

#if defined(__CUDA_ARCH_FEAT_SM100_ALL)

// ---------------------------------------------------------------- stages 2-3: the warp roles

// Warpgroups 0-1 softmax, warpgroup 2 correction, the load warp and the MMA warp (Fa4Traits),
// with stage 2's or stage 3's role functions and barriers.
template <int Stage, class T, int D>
__device__ __forceinline__ void warp_roles(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk,
                                           const TmaDesc* tv) {
    using Tr = Fa4Traits<Stage, D>;
    using B = typename std::conditional<Stage == 2, Barriers2, Barriers3>::type;
    extern __shared__ uint8_t smem_raw[];
    const Cta<Tr> cta(p, smem_raw);
    const B b(cta.bars);
    const uint32_t tmem = cta.start([&] { b.init(); });
    const int warp = cta.warp, r = cta.tid % 128, n_tiles = cta.n_tiles;
    const bool issuer = cta.lane == 0 && n_tiles > 0;
    if (warp < 2 * 4) {
        if constexpr (Stage == 2)
            softmax_role<Tr, T>(p, b, cta.smem, tmem, warp / 4, r, warp, cta.m0, cta.kv.n_begin, n_tiles);
        else
            softmax_role3<Tr, T>(p, b, cta.smem, tmem, warp / 4, r, warp, cta.m0, cta.kv.n_begin, n_tiles);
    } else if (warp < Tr::kLoadWarp) {
        if constexpr (Stage == 2)
            correction_role<Tr, T>(p, b, cta.smem, tmem, r, warp, cta.m0, cta.bc, n_tiles);
        else
            correction_role3<Tr, T>(p, b, cta.smem, tmem, r, warp, cta.m0, cta.bc, n_tiles);
    } else if (warp == Tr::kLoadWarp) {
        if (issuer) load_role<Tr>(b, tq, tk, tv, cta.sq, cta.sk, cta.sv, cta.bc, cta.m0, cta.kv.n_begin, n_tiles);
    } else if (warp == Tr::kMmaWarp && issuer) {
        if constexpr (Stage == 2)
            mma_role<Tr, T>(b, tmem, smem_u32(cta.sq), smem_u32(cta.sk), smem_u32(cta.sv), n_tiles);
        else
            mma_role3<Tr, T>(b, tmem, smem_u32(cta.sq), smem_u32(cta.sk), smem_u32(cta.sv), n_tiles);
    }
    cta.finish(tmem);
}

// One entry per stage.
template <int Stage, class T, int D>
__device__ __forceinline__ void forward(const FwdParams& p, const TmaDesc* tq, const TmaDesc* tk, const TmaDesc* tv) {
    if constexpr (Stage == 1)
        stage1<T, D>(p, tq, tk, tv);
    else
        warp_roles<Stage, T, D>(p, tq, tk, tv);
}

#else  // host pass / other targets: the kernels compile to nothing

template <int Stage, class T, int D>
__device__ __forceinline__ void forward(const FwdParams&, const TmaDesc*, const TmaDesc*, const TmaDesc*) {}

#endif  // __CUDA_ARCH_FEAT_SM100_ALL

}  // namespace fa4

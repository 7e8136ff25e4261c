// The FA3 epilogue: O normalised by the softmax's row sums and written, with the LSE, straight
// from the consumer's registers.
#pragma once
#include "common/dtype.cuh"
#include "common/softmax.cuh"
#include "fa3/mainloop.cuh"
#include "sm90/wgmma.cuh"

namespace fa3 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Normalise and write this thread's part of O (and LSE) straight from registers.
template <class Tr, class T>
__device__ __forceinline__ void write_output(const FwdParams& p, Acc<Tr>& acc, const typename Acc<Tr>::Frag& frag,
                                             int m_first, int batch, int head) {
    using Frag = typename Acc<Tr>::Frag;
    const float u = fa_to_natural(p);
#pragma unroll
    for (int r = 0; r < Frag::kRows; ++r) {
        const FaRowEnd end = acc.softmax.finalize(r, u);  // every lane of the row takes part
        const int i = m_first + frag.row(r);
        if (i >= p.seqlen_q) continue;
        T* orow = reinterpret_cast<T*>(p.o) + batch * p.o_batch_stride + i * p.o_row_stride +
                  head * p.o_head_stride;
#pragma unroll
        for (int j = 0; j < Frag::kOCols; j += 2) {
            const float o0 = end.empty ? 0.f : Frag::o(acc.o, r, j) * end.inv_l;
            const float o1 = end.empty ? 0.f : Frag::o(acc.o, r, j + 1) * end.inv_l;
            *reinterpret_cast<uint32_t*>(orow + frag.col(j)) = fa_pack2<T>(o0, o1);
        }
        if ((p.flags & FA_FLAG_RETURN_LSE) && frag.col0 == 0)
            reinterpret_cast<float*>(p.lse)[(static_cast<int64_t>(batch) * p.heads_q + head) * p.seqlen_q + i] =
                end.lse;
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

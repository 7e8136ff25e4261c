// The FA3 epilogue: O normalised by the softmax's row sums and written, with the LSE, straight
// from the consumer's registers.
#pragma once
#include "common/dtype.cuh"
#include "common/softmax.cuh"
#include "fa3/mainloop.cuh"
#include "fa3/serving.cuh"
#include "sm90/wgmma.cuh"

namespace fa3 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Normalise and write this thread's part of O (and LSE) straight from registers: rows
// [0, seq.sq) of one sequence (common/seqlen.cuh: a dense launch's batch entry, or one sequence
// of a packed batch, whose LSE is FlashAttention's packed [heads_q, total_q]). Rows past seq.sq
// are never stored: predicated register stores, no TMA store of a partial tile. `sink`: the
// head's sink logit (fa_sink), read by the caller from the kernel's own parameters: a serving
// launch's `p` is a per-sequence copy, and its `sinks` kept live through the mainloop cost stage 5
// a spill at head_dim 128.
template <class Tr, class T>
__device__ __forceinline__ void write_output(const FwdParams& p, Acc<Tr>& acc, const typename Acc<Tr>::Frag& frag,
                                             int m_first, const FaSeq& seq, int head, float sink) {
    using Frag = typename Acc<Tr>::Frag;
    const float u = fa_to_natural(p);
#pragma unroll
    for (int r = 0; r < Frag::kRows; ++r) {
        const FaRowEnd end = acc.softmax.finalize(r, u, sink);  // every lane of the row takes part
        const int i = m_first + frag.row(r);
        if (i >= seq.sq) continue;
        T* orow = reinterpret_cast<T*>(p.o) + fa_o_offset(p, seq, head, i);
#pragma unroll
        for (int j = 0; j < Frag::kOCols; j += 2) {
            const float o0 = end.empty ? 0.f : Frag::o(acc.o, r, j) * end.inv_l;
            const float o1 = end.empty ? 0.f : Frag::o(acc.o, r, j + 1) * end.inv_l;
            *reinterpret_cast<uint32_t*>(orow + frag.col(j)) = fa_pack2<T>(o0, o1);
        }
        if ((p.flags & FA_FLAG_RETURN_LSE) && frag.col0 == 0)
            reinterpret_cast<float*>(p.lse)[fa_lse_index(seq, head, i)] = end.lse;
    }
}
// A dense launch's batch entry `batch`.
template <class Tr, class T>
__device__ __forceinline__ void write_output(const FwdParams& p, Acc<Tr>& acc, const typename Acc<Tr>::Frag& frag,
                                             int m_first, int batch, int head) {
    write_output<Tr, T>(p, acc, frag, m_first, fa_seq_dense(p, batch), head, fa_sink(p, head));
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace fa3

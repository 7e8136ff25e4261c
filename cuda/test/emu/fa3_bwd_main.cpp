// Runs the FA3-style backward main kernel (cuda/fa3_bwd_sm90.cu), unchanged, in the CPU
// emulator between the FA2 backward's preprocess and dq conversion (cuda/fa2_bwd.cu), the
// launch sequence the kernel's header describes, on one emulated stream, under several scheduler
// seeds whose outputs must be bit-identical; outputs are poisoned and guarded as in
// fa2_bwd_main.cpp. The four tensor maps (Q, K, V, dO) are encoded here from the params (the
// layout of docs/fa3.md: {head_dim, heads, seqlen, batch}, 128-byte swizzle). tests/emulator/backward.rs
// writes the launch file and compares dq, dk, dv with the float64 reference gradient.
//
// Launch file: bwd_launch_file.h. Exit status: 0 ok, 2 bad launch file, 3 a failed emulator check
// or a canary overwritten, 4 deadlock, 5 outputs differ between seeds.
#include <string>

#include "../../fa2_bwd.cu"
#include "../../fa3_bwd_sm90.cu"
#include "bwd_launch_file.h"

namespace {

using emu_launch::usage_error;

using RowKernel = void (*)(BwdParams);
using MainKernel = void (*)(BwdParams, fa3::TmaDesc, fa3::TmaDesc, fa3::TmaDesc, fa3::TmaDesc);

struct Kernel {
    RowKernel row = nullptr;
    MainKernel main = nullptr;
    bool bf16 = false;
};

const BwdParams* g_params;
Kernel g_kernel;
fa3::TmaDesc g_maps[4];  // q, k, v, dO
void entry(void*) {
    if (g_kernel.row)
        g_kernel.row(*g_params);
    else
        g_kernel.main(*g_params, g_maps[0], g_maps[1], g_maps[2], g_maps[3]);
}

Kernel find(const std::string& name) {
    const std::pair<const char*, RowKernel> rows[] = {
        {"fa2_bwd_preprocess_f16", &fa2_bwd_preprocess_f16}, {"fa2_bwd_convert_dq_f16", &fa2_bwd_convert_dq_f16},
        {"fa2_bwd_preprocess_bf16", &fa2_bwd_preprocess_bf16}, {"fa2_bwd_convert_dq_bf16", &fa2_bwd_convert_dq_bf16},
        {"fa2_bwd_sink_grad", &fa2_bwd_sink_grad}};
    const std::pair<const char*, MainKernel> mains[] = {
        {"fa3_bwd_hd64_f16", &fa3_bwd_hd64_f16}, {"fa3_bwd_hd128_f16", &fa3_bwd_hd128_f16},
        {"fa3_bwd_hd64_bf16", &fa3_bwd_hd64_bf16}, {"fa3_bwd_hd128_bf16", &fa3_bwd_hd128_bf16}};
    for (const auto& [n, k] : rows)
        if (name == n) return Kernel{k, nullptr, false};
    for (const auto& [n, k] : mains)
        if (name == n) return Kernel{nullptr, k, name.ends_with("bf16")};
    usage_error("kernel " + name + " is not compiled into this program");
}

// The map of one [b, s, h, d] operand (device address a, element strides batch/row/head) with a
// box of `rows` rows: CU_TENSOR_MAP_DATA_TYPE_FLOAT16 (6) or BFLOAT16 (9), SWIZZLE_128B (3),
// L2 promotion 256B (3), zero out-of-bounds fill.
void encode(fa3::TmaDesc* map, bool bf16, uint64_t a, int64_t bs, int64_t rs, int64_t hs, int head_dim, int heads,
            int seqlen, int batch, int rows) {
    const uint64_t dims[4] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(heads),
                              static_cast<uint64_t>(seqlen), static_cast<uint64_t>(batch)};
    const uint64_t strides[3] = {static_cast<uint64_t>(hs) * 2, static_cast<uint64_t>(rs) * 2,
                                 static_cast<uint64_t>(bs) * 2};
    const uint32_t box[4] = {64, 1, static_cast<uint32_t>(rows), 1};
    const uint32_t es[4] = {1, 1, 1, 1};
    std::string why;
    if (emu::encode_tensor_map_tiled(map, bf16 ? 9 : 6, 4, reinterpret_cast<const void*>(a), dims, strides, box, es, 0,
                                     3, 3, 0, &why) != 0)
        usage_error("tensor map rejected (cuTensorMapEncodeTiled would fail): " + why);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) usage_error("usage: fa3_bwd_main <launch file>");
    auto file = emu_bwd::read<Kernel>(argv[1], "fa3 backward driver", find);
    const BwdParams& p = file.params;
    for (const emu_bwd::Launch<Kernel>& l : file.launches)
        if (l.kernel.main) {
            using Tr = fa3::Fa3BwdTraits<64>;
            encode(&g_maps[0], l.kernel.bf16, p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.head_dim,
                   p.heads_q, p.seqlen_q, p.batch, Tr::kBlockM);
            encode(&g_maps[1], l.kernel.bf16, p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, p.head_dim,
                   p.heads_kv, p.seqlen_k, p.batch, Tr::kBlockN);
            encode(&g_maps[2], l.kernel.bf16, p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, p.head_dim,
                   p.heads_kv, p.seqlen_k, p.batch, Tr::kBlockN);
            encode(&g_maps[3], l.kernel.bf16, p.d_o, p.do_batch_stride, p.do_row_stride, p.do_head_stride, p.head_dim,
                   p.heads_q, p.seqlen_q, p.batch, Tr::kBlockM);
        }
    g_params = &p;
    return emu_bwd::run(file, &g_kernel, &entry);
}

// Runs the combine kernels (cuda/combine.cu), unchanged, in the CPU emulator: one launch as the
// crate plans it (flash_attn::cuda::combine::{merge_plan, splits_plan}: kernel, grid, block, the
// CombineParams bytes with device addresses), under several scheduler seeds whose outputs must be
// bit-identical, outputs poisoned before each run and guarded by canaries (guarded_buffers.h).
// tests/emulator/combine.rs writes the launch file and compares o and LSE with the host
// merge_states_n.
//
// Launch file, one directive per line:
//   kernel <symbol>     grid <x>     block <threads>     seeds <s1> <s2> ...
//   params <hex bytes of CombineParams>
//   in / out <name> <device address> <bytes> <file>   (guarded_buffers.h)
// Every address in the params must lie in a buffer. Exit status: 0 ok, 2 bad launch file,
// 3 a failed emulator check or a canary overwritten, 5 outputs differ between seeds.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../../combine.cu"
#include "guarded_buffers.h"
#include "launch_file.h"

namespace {

using emu_buffers::translate;
using emu_launch::num;
using emu_launch::usage_error;

using Kernel = void (*)(CombineParams);
const CombineParams* g_params;
Kernel g_kernel;
void entry(void*) { g_kernel(*g_params); }

Kernel find(const std::string& name) {
    const std::pair<const char*, Kernel> all[] = {
        {"fa_combine_f32_f32", &fa_combine_f32_f32},   {"fa_combine_f32_f16", &fa_combine_f32_f16},
        {"fa_combine_f32_bf16", &fa_combine_f32_bf16}, {"fa_combine_f16_f16", &fa_combine_f16_f16},
        {"fa_combine_bf16_bf16", &fa_combine_bf16_bf16},
    };
    for (const auto& [n, k] : all)
        if (name == n) return k;
    usage_error("kernel " + name + " is not compiled into this program");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) usage_error("usage: combine_main <launch file>");
    std::string kernel;
    emu::LaunchConfig cfg;
    std::vector<uint64_t> seeds;
    std::vector<unsigned char> params_bytes;
    emu_launch::g_program = "combine driver";
    emu_launch::for_each_directive(argv[1], [&](const emu_launch::Directive& d) {
        if (d.key == "kernel") {
            d.need(1);
            kernel = d.a[0];
        } else if (d.key == "grid") {
            d.need(1);
            cfg.grid = emu::Dim3{static_cast<unsigned>(num(d.a[0])), 1, 1};
        } else if (d.key == "block") {
            d.need(1);
            cfg.block = emu::Dim3{static_cast<unsigned>(num(d.a[0])), 1, 1};
        } else if (d.key == "seeds") {
            for (const std::string& x : d.a) seeds.push_back(num(x));
        } else if (d.key == "params") {
            d.need(1);
            emu_launch::hex_bytes(d.a[0], sizeof(CombineParams), params_bytes);
        } else if (!emu_buffers::buffer_directive(d)) {
            usage_error("unknown directive " + d.key);
        }
    });
    if (params_bytes.size() != sizeof(CombineParams)) usage_error("missing params");
    g_kernel = find(kernel);
    CombineParams p;
    std::memcpy(&p, params_bytes.data(), sizeof p);
    if (p.n_inputs < 1 || p.n_inputs > FA_COMBINE_MAX_INPUTS || p.states_per_input < 1) usage_error("params: states");
    p.out_o = translate(p.out_o, "params.out_o");
    p.out_lse = translate(p.out_lse, "params.out_lse");
    p.sinks = translate(p.sinks, "params.sinks");
    for (int i = 0; i < p.n_inputs; ++i) {
        p.in[i].o = translate(p.in[i].o, "params.in.o");
        p.in[i].lse = translate(p.in[i].lse, "params.in.lse");
    }
    g_params = &p;
    std::printf("launch %s: grid %u, %u threads\n", kernel.c_str(), cfg.grid.x, cfg.block.x);
    // 0xFF: NaN in f32, f16 and bf16, so an output element the kernel leaves unwritten shows.
    cfg.kernel = kernel;
    return emu_buffers::run_seeds(cfg, seeds, &entry, nullptr, 0xFF);
}

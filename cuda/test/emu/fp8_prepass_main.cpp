// Runs the FP8 pre-pass kernels (cuda/fp8_prepass.cu), unchanged, in the CPU emulator: one launch
// as the crate plans it (flash_attn::cuda::fp8::prepass_plan: kernel, grid, block, the
// Fp8PrepassParams bytes with device addresses), under several scheduler seeds whose outputs must
// be bit-identical, outputs poisoned before each run and guarded by canaries. tests/emulator/fp8.rs
// writes the launch file and compares the codes and scales with the CPU oracle.
//
// Launch file, one directive per line:
//   kernel <symbol>     grid <x>     block <threads>     seeds <s1> <s2> ...
//   params <hex bytes of Fp8PrepassParams>
//   in  <name> <device address> <bytes> <file>     input buffer (checked unchanged afterwards)
//   out <name> <device address> <bytes> <file>     output buffer: poisoned, written back
// Every address in the params must lie in a buffer. Exit status: 0 ok, 2 bad launch file,
// 3 a failed emulator check or a canary overwritten, 5 outputs differ between seeds.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../../fp8_prepass.cu"
#include "guarded_buffers.h"
#include "launch_file.h"

namespace {

using emu_buffers::translate;
using emu_launch::num;
using emu_launch::usage_error;

using Kernel = void (*)(Fp8PrepassParams);
const Fp8PrepassParams* g_params;
Kernel g_kernel;
void entry(void*) { g_kernel(*g_params); }

Kernel find(const std::string& name) {
    const std::pair<const char*, Kernel> all[] = {
        {"fa_fp8_prepass_e1_f16", &fa_fp8_prepass_e1_f16},   {"fa_fp8_prepass_e2_f16", &fa_fp8_prepass_e2_f16},
        {"fa_fp8_prepass_e4_f16", &fa_fp8_prepass_e4_f16},   {"fa_fp8_prepass_e8_f16", &fa_fp8_prepass_e8_f16},
        {"fa_fp8_prepass_e1_bf16", &fa_fp8_prepass_e1_bf16}, {"fa_fp8_prepass_e2_bf16", &fa_fp8_prepass_e2_bf16},
        {"fa_fp8_prepass_e4_bf16", &fa_fp8_prepass_e4_bf16}, {"fa_fp8_prepass_e8_bf16", &fa_fp8_prepass_e8_bf16},
    };
    for (const auto& [n, k] : all)
        if (name == n) return k;
    usage_error("kernel " + name + " is not compiled into this program");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) usage_error("usage: fp8_prepass_main <launch file>");
    std::string kernel;
    emu::LaunchConfig cfg;
    std::vector<uint64_t> seeds;
    std::vector<unsigned char> params_bytes;
    emu_launch::g_program = "fp8 prepass driver";
    emu_launch::for_each_directive(argv[1], [&](const emu_launch::Directive& d) {
        const std::string& key = d.key;
        const std::vector<std::string>& a = d.a;
        const auto need = [&](size_t n) { d.need(n); };
        if (key == "kernel") {
            need(1);
            kernel = a[0];
        } else if (key == "grid") {
            need(1);
            cfg.grid = emu::Dim3{static_cast<unsigned>(num(a[0])), 1, 1};
        } else if (key == "block") {
            need(1);
            cfg.block = emu::Dim3{static_cast<unsigned>(num(a[0])), 1, 1};
        } else if (key == "seeds") {
            for (const std::string& x : a) seeds.push_back(static_cast<uint64_t>(num(x)));
        } else if (key == "params") {
            need(1);
            emu_launch::hex_bytes(a[0], sizeof(Fp8PrepassParams), params_bytes);
        } else if (!emu_buffers::buffer_directive(d)) {
            usage_error("unknown directive " + key);
        }
    });
    if (params_bytes.size() != sizeof(Fp8PrepassParams)) usage_error("missing params");
    g_kernel = find(kernel);
    Fp8PrepassParams p;
    std::memcpy(&p, params_bytes.data(), sizeof p);
    if (p.n_ops < 1 || p.n_ops > FA_FP8_PREPASS_MAX_OPS) usage_error("params: n_ops");
    for (int i = 0; i < p.n_ops; ++i) {
        p.op[i].x = translate(p.op[i].x, "params.op.x");
        p.op[i].codes = translate(p.op[i].codes, "params.op.codes");
        p.op[i].scales = translate(p.op[i].scales, "params.op.scales");
    }
    g_params = &p;
    std::printf("launch %s: grid %u, %u threads\n", kernel.c_str(), cfg.grid.x, cfg.block.x);
    // 0xA5: an e4m3 code no finite block gives here; f32 scales: -2.9e-16.
    cfg.kernel = kernel;
    return emu_buffers::run_seeds(cfg, seeds, &entry, nullptr, 0xA5);
}

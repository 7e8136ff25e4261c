// Runs the FA2 backward (cuda/fa2_bwd.cu), unchanged, in the CPU emulator: the crate's launch
// sequence (flash_attn::cuda::fa2_bwd::plan: preprocess, main, convert, with one BwdParams) on
// one emulated stream, under several scheduler seeds whose outputs must be bit-identical,
// outputs (dq, dk, dv and the f32 scratch D and dq_accum) poisoned before each run and guarded
// by canaries (guarded_buffers.h). tests/emulator/backward.rs writes the launch file and
// compares dq, dk, dv with the float64 reference gradient.
//
// Launch file, one directive per line:
//   params <hex bytes of BwdParams>      seeds <s1> <s2> ...
//   launch <kernel> <grid x> <grid y> <grid z> <threads> <dynamic smem bytes>   (in order)
//   in / out <name> <device address> <bytes> <file>   (guarded_buffers.h)
// Every address in the params must lie in a buffer. Exit status: 0 ok, 2 bad launch file,
// 3 a failed emulator check or a canary overwritten, 4 deadlock, 5 outputs differ between seeds.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../../fa2_bwd.cu"
#include "guarded_buffers.h"
#include "launch_file.h"

namespace {

using emu_buffers::translate;
using emu_launch::num;
using emu_launch::usage_error;

using Kernel = void (*)(BwdParams);
const BwdParams* g_params;
Kernel g_kernel;
void entry(void*) { g_kernel(*g_params); }

#define FA2_BWD_ENTRY(NAME) {#NAME, &NAME}
#define FA2_BWD_ENTRIES(DT)                                                                                \
    FA2_BWD_ENTRY(fa2_bwd_preprocess_##DT), FA2_BWD_ENTRY(fa2_bwd_convert_dq_##DT),                       \
        FA2_BWD_ENTRY(fa2_bwd_hd32_##DT), FA2_BWD_ENTRY(fa2_bwd_hd64_##DT), FA2_BWD_ENTRY(fa2_bwd_hd96_##DT), \
        FA2_BWD_ENTRY(fa2_bwd_hd128_##DT), FA2_BWD_ENTRY(fa2_bwd_hd192_##DT), FA2_BWD_ENTRY(fa2_bwd_hd256_##DT)

Kernel find(const std::string& name) {
    const std::pair<const char*, Kernel> all[] = {FA2_BWD_ENTRIES(f16), FA2_BWD_ENTRIES(bf16)};
    for (const auto& [n, k] : all)
        if (name == n) return k;
    usage_error("kernel " + name + " is not compiled into this program");
}

struct Launch {
    Kernel kernel;
    emu::LaunchConfig cfg;
};

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) usage_error("usage: fa2_bwd_main <launch file>");
    std::vector<Launch> launches;
    std::vector<uint64_t> seeds;
    std::vector<unsigned char> params_bytes;
    emu_launch::g_program = "fa2 backward driver";
    emu_launch::for_each_directive(argv[1], [&](const emu_launch::Directive& d) {
        if (d.key == "launch") {
            d.need(6);
            Launch l;
            l.kernel = find(d.a[0]);
            l.cfg.kernel = d.a[0];
            l.cfg.grid = emu::Dim3{static_cast<unsigned>(num(d.a[1])), static_cast<unsigned>(num(d.a[2])),
                                   static_cast<unsigned>(num(d.a[3]))};
            l.cfg.block = emu::Dim3{static_cast<unsigned>(num(d.a[4])), 1, 1};
            l.cfg.smem_bytes = static_cast<unsigned>(num(d.a[5]));
            launches.push_back(l);
        } else if (d.key == "seeds") {
            for (const std::string& x : d.a) seeds.push_back(num(x));
        } else if (d.key == "params") {
            d.need(1);
            emu_launch::hex_bytes(d.a[0], sizeof(BwdParams), params_bytes);
        } else if (!emu_buffers::buffer_directive(d)) {
            usage_error("unknown directive " + d.key);
        }
    });
    if (params_bytes.size() != sizeof(BwdParams)) usage_error("missing params");
    if (launches.empty()) usage_error("no launch");
    BwdParams p;
    std::memcpy(&p, params_bytes.data(), sizeof p);
    for (uint64_t* a : {&p.q, &p.k, &p.v, &p.o, &p.d_o, &p.lse, &p.d_sum, &p.dq_accum, &p.dq, &p.dk, &p.dv,
                        &p.alibi_slopes})
        *a = translate(*a, "params address");
    g_params = &p;
    for (const Launch& l : launches)
        std::printf("launch %s: grid (%u,%u,%u), %u threads, %u bytes of dynamic shared memory\n", l.cfg.kernel.c_str(),
                    l.cfg.grid.x, l.cfg.grid.y, l.cfg.grid.z, l.cfg.block.x, l.cfg.smem_bytes);
    // 0xFF: NaN in f32, f16 and bf16, so an element no launch writes shows.
    return emu_buffers::run_seeds_with(
        seeds,
        [&](uint64_t seed) {
            for (Launch& l : launches) {
                l.cfg.seed = seed;
                g_kernel = l.kernel;
                emu::launch(l.cfg, &entry, nullptr);
            }
        },
        0xFF);
}

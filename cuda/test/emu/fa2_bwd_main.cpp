// Runs the FA2 backward (cuda/fa2_bwd.cu), unchanged, in the CPU emulator: the crate's launch
// sequence (flash_attn::cuda::fa2_bwd::plan: preprocess, main, convert, with one BwdParams) on
// one emulated stream, under several scheduler seeds whose outputs must be bit-identical,
// outputs (dq, dk, dv and the f32 scratch D and dq_accum) poisoned before each run and guarded
// by canaries (guarded_buffers.h). tests/emulator/backward.rs writes the launch file and
// compares dq, dk, dv with the float64 reference gradient.
//
// Launch file: bwd_launch_file.h. Exit status: 0 ok, 2 bad launch file, 3 a failed emulator check
// or a canary overwritten, 4 deadlock, 5 outputs differ between seeds.
#include <string>

#include "../../fa2_bwd.cu"
#include "bwd_launch_file.h"

namespace {

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
    const std::pair<const char*, Kernel> all[] = {FA2_BWD_ENTRIES(f16), FA2_BWD_ENTRIES(bf16),
                                                  FA2_BWD_ENTRY(fa2_bwd_sink_grad)};
    for (const auto& [n, k] : all)
        if (name == n) return k;
    usage_error("kernel " + name + " is not compiled into this program");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) usage_error("usage: fa2_bwd_main <launch file>");
    auto file = emu_bwd::read<Kernel>(argv[1], "fa2 backward driver", find);
    g_params = &file.params;
    return emu_bwd::run(file, &g_kernel, &entry);
}

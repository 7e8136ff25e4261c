// Runs the FP8 pre-pass kernels (cuda/fp8_prepass.cu), unchanged, in the CPU emulator: one launch
// as the crate plans it (flash_attn::cuda::fp8::prepass_plan: kernel, grid, block, the
// Fp8PrepassParams bytes with device addresses), under several scheduler seeds whose outputs must
// be bit-identical, outputs poisoned before each run and guarded by canaries. tests/fp8_emulator.rs
// writes the launch file and compares the codes and scales with the CPU oracle.
//
// Launch file, one directive per line:
//   kernel <symbol>     grid <x>     block <threads>     seeds <s1> <s2> ...
//   params <hex bytes of Fp8PrepassParams>
//   in  <name> <device address> <bytes> <file>     input buffer (checked unchanged afterwards)
//   out <name> <device address> <bytes> <file>     output buffer: poisoned, written back
// Every address in the params must lie in a buffer. Exit status: 0 ok, 2 bad launch file,
// 3 a failed emulator check or a canary overwritten, 5 outputs differ between seeds.
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../../fp8_prepass.cu"
#include "launch_file.h"

namespace {

using emu_launch::num;
using emu_launch::usage_error;

constexpr size_t kSlack = 256;
constexpr unsigned char kCanary = 0x5C;

// A buffer with canary slack on both sides (a write outside [0, bytes) is reported).
struct Guarded {
    std::vector<unsigned char> mem;
    size_t bytes = 0;
    explicit Guarded(size_t n = 0) : mem(n + 2 * kSlack, kCanary), bytes(n) {}
    unsigned char* data() { return mem.data() + kSlack; }
    void poison(unsigned char v) { std::memset(data(), v, bytes); }
    bool canaries_ok() const {
        for (size_t i = 0; i < kSlack; ++i)
            if (mem[i] != kCanary || mem[kSlack + bytes + i] != kCanary) return false;
        return true;
    }
};

struct Buffer {
    std::string name, path;
    bool out = false;
    uint64_t dev = 0;
    Guarded mem;
    std::vector<unsigned char> input;
};
std::vector<Buffer> g_buffers;

uint64_t translate(uint64_t dev, const char* what) {
    if (dev == 0) return 0;
    for (Buffer& b : g_buffers)
        if (dev >= b.dev && dev <= b.dev + b.mem.bytes) return reinterpret_cast<uint64_t>(b.mem.data()) + (dev - b.dev);
    usage_error(std::string(what) + ": device address in no buffer of the launch");
}

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
        } else if (key == "in" || key == "out") {
            need(4);
            Buffer b;
            b.name = a[0];
            b.out = key == "out";
            b.dev = static_cast<uint64_t>(num(a[1]));
            b.mem = Guarded(static_cast<size_t>(num(a[2])));
            b.path = a[3];
            if (!b.out) {
                std::ifstream f(b.path, std::ios::binary);
                if (!f.read(reinterpret_cast<char*>(b.mem.data()), static_cast<std::streamsize>(b.mem.bytes)))
                    usage_error("cannot read " + std::to_string(b.mem.bytes) + " bytes from " + b.path);
                b.input.assign(b.mem.data(), b.mem.data() + b.mem.bytes);
            }
            g_buffers.push_back(std::move(b));
        } else {
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
    if (seeds.empty()) seeds.push_back(1);
    g_params = &p;
    std::printf("launch %s: grid %u, %u threads\n", kernel.c_str(), cfg.grid.x, cfg.block.x);
    std::vector<std::vector<unsigned char>> first;
    for (size_t si = 0; si < seeds.size(); ++si) {
        for (Buffer& b : g_buffers)
            if (b.out) b.mem.poison(0xA5);  // an e4m3 code no finite block gives here; f32 scales: -2.9e-16
        cfg.seed = seeds[si];
        emu::launch(cfg, &entry, nullptr);
        std::vector<std::vector<unsigned char>> outs;
        for (Buffer& b : g_buffers) {
            if (!b.mem.canaries_ok()) {
                std::fprintf(stderr, "EMU ERROR: a write outside buffer %s\n", b.name.c_str());
                return 3;
            }
            if (b.out) {
                outs.emplace_back(b.mem.data(), b.mem.data() + b.mem.bytes);
            } else if (std::memcmp(b.mem.data(), b.input.data(), b.mem.bytes) != 0) {
                std::fprintf(stderr, "EMU ERROR: the kernel wrote into its input %s\n", b.name.c_str());
                return 3;
            }
        }
        std::printf("seed %" PRIu64 ": ok\n", seeds[si]);
        if (si == 0) {
            first = outs;
        } else if (outs != first) {
            std::fprintf(stderr, "EMU ERROR: outputs of seed %" PRIu64 " differ from seed %" PRIu64 "'s\n", seeds[si], seeds[0]);
            return 5;
        }
    }
    for (Buffer& b : g_buffers)
        if (b.out) {
            std::ofstream f(b.path, std::ios::binary);
            f.write(reinterpret_cast<const char*>(b.mem.data()), static_cast<std::streamsize>(b.mem.bytes));
            if (!f) usage_error("cannot write " + b.path);
        }
    return 0;
}

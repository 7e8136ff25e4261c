// Runs the FP8 pre-pass kernels (cuda/fp8_prepass.cu), unchanged, in the CPU emulator: one launch
// from a case file, under several scheduler seeds whose outputs must be bit-identical, outputs
// poisoned before each run and guarded by canaries. tests/fp8_emulator.rs writes the case and
// compares the codes and scales with the CPU oracle (src/numerics/quant.rs, hadamard.rs).
//
// Case file, one directive per line:
//   dtype f16|bf16          head_dim <d>          hadamard_seed <u64>        seeds <s1> <s2> ...
//   op <x file> <x elements> <batch> <seqlen> <heads> <x stride b> <x stride s> <x stride h>
//      <codes file> <codes bytes> <c stride b> <c stride s> <c stride h> <c stride d>
//      <scales file> <block_rows> <rotate 0|1>                    (one or two `op` lines)
// Exit status: 0 ok, 2 bad case file, 3 a failed emulator check or a canary overwritten,
// 5 outputs differ between seeds.
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../../fp8_prepass.cu"

namespace {

[[noreturn]] void usage_error(const std::string& msg) {
    std::fprintf(stderr, "fp8 prepass driver: %s\n", msg.c_str());
    std::exit(2);
}

int64_t num(const std::string& s) {
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 0);
    if (!end || *end) usage_error("not a number: " + s);
    return v;
}

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

struct Op {
    std::string x_path, codes_path, scales_path;
    Guarded x, codes, scales;
    Fp8PrepassOperand f{};
};

using Kernel = void (*)(Fp8PrepassParams);
const Fp8PrepassParams* g_params;
Kernel g_kernel;
void entry(void*) { g_kernel(*g_params); }

Kernel pick(const std::string& dtype, int e) {
    const bool bf = dtype == "bf16";
    if (dtype != "bf16" && dtype != "f16") usage_error("dtype must be f16 or bf16");
    switch (e) {
        case 1: return bf ? &fa_fp8_prepass_e1_bf16 : &fa_fp8_prepass_e1_f16;
        case 2: return bf ? &fa_fp8_prepass_e2_bf16 : &fa_fp8_prepass_e2_f16;
        case 4: return bf ? &fa_fp8_prepass_e4_bf16 : &fa_fp8_prepass_e4_f16;
        case 8: return bf ? &fa_fp8_prepass_e8_bf16 : &fa_fp8_prepass_e8_f16;
    }
    usage_error("head_dim above 256");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) usage_error("usage: fp8_prepass_main <case file>");
    std::ifstream in(argv[1]);
    if (!in) usage_error(std::string("cannot read ") + argv[1]);
    std::string dtype = "bf16";
    Fp8PrepassParams p{};
    std::vector<uint64_t> seeds;
    std::vector<Op> ops;
    ops.reserve(FA_FP8_PREPASS_MAX_OPS);
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream ls(line);
        std::string key;
        if (!(ls >> key) || key[0] == '#') continue;
        std::vector<std::string> a;
        for (std::string w; ls >> w;) a.push_back(w);
        auto need = [&](size_t n) {
            if (a.size() != n) usage_error(key + ": expected " + std::to_string(n) + " values");
        };
        if (key == "dtype") {
            need(1);
            dtype = a[0];
        } else if (key == "head_dim") {
            need(1);
            p.head_dim = static_cast<int32_t>(num(a[0]));
        } else if (key == "hadamard_seed") {
            need(1);
            p.hadamard_seed = std::strtoull(a[0].c_str(), nullptr, 0);
        } else if (key == "seeds") {
            for (const std::string& s : a) seeds.push_back(static_cast<uint64_t>(num(s)));
        } else if (key == "op") {
            need(17);
            if (ops.size() == FA_FP8_PREPASS_MAX_OPS) usage_error("too many operands");
            ops.emplace_back();
            Op& o = ops.back();
            o.x_path = a[0];
            o.x = Guarded(static_cast<size_t>(num(a[1])) * 2);
            o.f.batch = static_cast<int32_t>(num(a[2]));
            o.f.seqlen = static_cast<int32_t>(num(a[3]));
            o.f.heads = static_cast<int32_t>(num(a[4]));
            o.f.x_batch_stride = num(a[5]);
            o.f.x_row_stride = num(a[6]);
            o.f.x_head_stride = num(a[7]);
            o.codes_path = a[8];
            o.codes = Guarded(static_cast<size_t>(num(a[9])));
            o.f.c_batch_stride = num(a[10]);
            o.f.c_row_stride = num(a[11]);
            o.f.c_head_stride = num(a[12]);
            o.f.c_dim_stride = num(a[13]);
            o.scales_path = a[14];
            o.f.block_rows = static_cast<int32_t>(num(a[15]));
            o.f.flags = num(a[16]) ? FA_FP8_ROTATE : 0u;
            if (o.f.block_rows <= 0) usage_error("block_rows must be positive");
            o.f.blocks = (o.f.seqlen + o.f.block_rows - 1) / o.f.block_rows;
            o.scales = Guarded(static_cast<size_t>(o.f.batch) * o.f.heads * o.f.blocks * 4);
            std::ifstream f(o.x_path, std::ios::binary);
            if (!f.read(reinterpret_cast<char*>(o.x.data()), static_cast<std::streamsize>(o.x.bytes)))
                usage_error("cannot read " + std::to_string(o.x.bytes) + " bytes from " + o.x_path);
        } else {
            usage_error("unknown directive " + key);
        }
    }
    if (ops.empty()) usage_error("no op");
    if (p.head_dim <= 0 || p.head_dim > 256) usage_error("head_dim must be in 1..256");
    if (seeds.empty()) seeds.push_back(1);
    int e = 1;
    while (32 * e < p.head_dim) e *= 2;
    g_kernel = pick(dtype, e);
    p.n_ops = static_cast<int32_t>(ops.size());
    int64_t items = 0;
    for (size_t i = 0; i < ops.size(); ++i) {
        Op& o = ops[i];
        o.f.x = reinterpret_cast<uint64_t>(o.x.data());
        o.f.codes = reinterpret_cast<uint64_t>(o.codes.data());
        o.f.scales = reinterpret_cast<uint64_t>(o.scales.data());
        p.op[i] = o.f;
        items += static_cast<int64_t>(o.f.batch) * o.f.heads * o.f.blocks;
    }
    g_params = &p;
    emu::LaunchConfig cfg;
    cfg.grid = emu::Dim3{static_cast<unsigned>((items + FA_FP8_PREPASS_WARPS - 1) / FA_FP8_PREPASS_WARPS), 1, 1};
    cfg.block = emu::Dim3{fp8pre::kThreads, 1, 1};
    cfg.smem_bytes = 0;
    std::printf("launch fa_fp8_prepass_e%d_%s: grid %u, %u threads, %" PRId64 " work items\n", e, dtype.c_str(), cfg.grid.x,
                cfg.block.x, items);
    std::vector<std::vector<unsigned char>> first;
    for (size_t si = 0; si < seeds.size(); ++si) {
        std::vector<unsigned char> x_before;
        for (Op& o : ops) {
            o.codes.poison(0xA5);   // not an e4m3 value the oracle gives for finite inputs
            o.scales.poison(0xFF);  // NaN
        }
        cfg.seed = seeds[si];
        std::vector<std::vector<unsigned char>> inputs;
        for (Op& o : ops) inputs.emplace_back(o.x.data(), o.x.data() + o.x.bytes);
        emu::launch(cfg, &entry, nullptr);
        std::vector<std::vector<unsigned char>> outs;
        for (size_t i = 0; i < ops.size(); ++i) {
            Op& o = ops[i];
            if (!o.x.canaries_ok() || !o.codes.canaries_ok() || !o.scales.canaries_ok()) {
                std::fprintf(stderr, "EMU ERROR: a write outside the buffers of operand %zu\n", i);
                return 3;
            }
            if (std::memcmp(o.x.data(), inputs[i].data(), o.x.bytes) != 0) {
                std::fprintf(stderr, "EMU ERROR: the kernel wrote into its input %zu\n", i);
                return 3;
            }
            outs.emplace_back(o.codes.data(), o.codes.data() + o.codes.bytes);
            outs.emplace_back(o.scales.data(), o.scales.data() + o.scales.bytes);
        }
        std::printf("seed %" PRIu64 ": ok\n", seeds[si]);
        if (si == 0) {
            first = outs;
        } else if (outs != first) {
            std::fprintf(stderr, "EMU ERROR: outputs of seed %" PRIu64 " differ from seed %" PRIu64 "'s\n", seeds[si], seeds[0]);
            return 5;
        }
    }
    for (Op& o : ops) {
        std::ofstream c(o.codes_path, std::ios::binary), s(o.scales_path, std::ios::binary);
        c.write(reinterpret_cast<const char*>(o.codes.data()), static_cast<std::streamsize>(o.codes.bytes));
        s.write(reinterpret_cast<const char*>(o.scales.data()), static_cast<std::streamsize>(o.scales.bytes));
        if (!c || !s) usage_error("cannot write the outputs");
    }
    return 0;
}

// The buffers of the standalone kernels' emulator drivers (fp8_prepass_main.cpp for the FP8
// pre-pass, combine_main.cpp for the combine): `in` / `out` directives of the launch file (see
// launch_file.h) read into buffers with canary slack on both sides, device addresses of the
// params translated into them, and the seeded runs: outputs poisoned before each run, canaries
// and inputs checked after, outputs bit-identical across seeds, then written back.
//   in  <name> <device address> <bytes> <file>     input buffer (checked unchanged afterwards)
//   out <name> <device address> <bytes> <file>     output buffer: poisoned, written back
// Exit statuses of run_seeds: 0 ok, 3 a canary overwritten or an input written, 5 outputs differ
// between seeds (a failed emulator check exits from inside the run).
#pragma once
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "launch_file.h"
#include "runtime.h"

namespace emu_buffers {

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
inline std::vector<Buffer> g_buffers;

// The host address of a device address of the launch (0 stays 0: "none").
inline uint64_t translate(uint64_t dev, const char* what) {
    if (dev == 0) return 0;
    for (Buffer& b : g_buffers)
        if (dev >= b.dev && dev <= b.dev + b.mem.bytes) return reinterpret_cast<uint64_t>(b.mem.data()) + (dev - b.dev);
    emu_launch::usage_error(std::string(what) + ": device address in no buffer of the launch");
}

// Handles an `in` or `out` directive; false for any other key.
inline bool buffer_directive(const emu_launch::Directive& d) {
    if (d.key != "in" && d.key != "out") return false;
    d.need(4);
    Buffer b;
    b.name = d.a[0];
    b.out = d.key == "out";
    b.dev = emu_launch::num(d.a[1]);
    b.mem = Guarded(static_cast<size_t>(emu_launch::num(d.a[2])));
    b.path = d.a[3];
    if (!b.out) {
        std::ifstream f(b.path, std::ios::binary);
        if (!f.read(reinterpret_cast<char*>(b.mem.data()), static_cast<std::streamsize>(b.mem.bytes)))
            emu_launch::usage_error("cannot read " + std::to_string(b.mem.bytes) + " bytes from " + b.path);
        b.input.assign(b.mem.data(), b.mem.data() + b.mem.bytes);
    }
    g_buffers.push_back(std::move(b));
    return true;
}

// Runs `entry` once per seed (outputs poisoned with `poison` first), checks canaries, inputs and
// that every seed's outputs are bit-identical, and writes the outputs back. Returns the exit status.
inline int run_seeds(emu::LaunchConfig cfg, std::vector<uint64_t> seeds, void (*entry)(void*), unsigned char poison) {
    if (seeds.empty()) seeds.push_back(1);
    std::vector<std::vector<unsigned char>> first;
    for (size_t si = 0; si < seeds.size(); ++si) {
        for (Buffer& b : g_buffers)
            if (b.out) b.mem.poison(poison);
        cfg.seed = seeds[si];
        emu::launch(cfg, entry, nullptr);
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
            if (!f) emu_launch::usage_error("cannot write " + b.path);
        }
    return 0;
}

}  // namespace emu_buffers

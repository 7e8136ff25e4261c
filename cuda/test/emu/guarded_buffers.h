// The emulated device memory of every emulator driver (driver.cpp for the attention kernels,
// combine_main.cpp for the combine, fp8_prepass_main.cpp for the FP8 pre-pass, fa2_bwd_main.cpp
// for the backward's launch sequence): the `in` / `out`
// / `inout` directives of the launch file (see launch_file.h) read into guarded host buffers at
// the device addresses the plan used, device addresses translated into them, and the seeded
// runs: outputs poisoned before each run, canaries and inputs checked after, outputs
// bit-identical across seeds, then written back.
//   in    <name> <device address> <bytes> <file>   input buffer (checked unchanged afterwards)
//   out   <name> <device address> <bytes> <file>   output buffer: poisoned, written back
//   inout <name> <device address> <bytes> <file>   read from the file, written back (a KV cache
//                                                 the append kernel writes into; not poisoned)
// Exit statuses of run_seeds: 0 ok, 3 a canary overwritten or an input written, 5 outputs differ
// between seeds (a failed emulator check exits from inside the run).
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "launch_file.h"
#include "runtime.h"

namespace emu_buffers {

constexpr unsigned char kCanary = 0x5C;

// Host memory for `bytes` bytes whose end is followed by an inaccessible page and whose start
// is preceded by one (a read or write past either end faults at once), the data ending on a
// 256-byte boundary just before the trailing page; the rounding slack in front of the data
// holds a canary (a write there is reported by `overwritten`).
class Guarded {
public:
    Guarded() = default;
    Guarded(size_t bytes, const std::string& name) : bytes_(bytes) {
        const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        const size_t rounded = (bytes + 255) / 256 * 256;
        const size_t data_pages = (rounded + page - 1) / page;
        region_bytes_ = (data_pages + 2) * page;
        void* m = mmap(nullptr, region_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) emu_launch::usage_error("mmap failed for buffer " + name);
        region_ = static_cast<unsigned char*>(m);
        mprotect(region_, page, PROT_NONE);
        mprotect(region_ + (data_pages + 1) * page, page, PROT_NONE);
        data_ = region_ + (data_pages + 1) * page - rounded;
        slack_lo_ = static_cast<size_t>(data_ - (region_ + page));
        std::memset(region_ + page, kCanary, data_pages * page);
    }
    Guarded(Guarded&& o) noexcept { *this = std::move(o); }
    Guarded& operator=(Guarded&& o) noexcept {
        std::swap(region_, o.region_);
        std::swap(data_, o.data_);
        std::swap(region_bytes_, o.region_bytes_);
        std::swap(bytes_, o.bytes_);
        std::swap(slack_lo_, o.slack_lo_);
        return *this;
    }
    Guarded(const Guarded&) = delete;
    Guarded& operator=(const Guarded&) = delete;
    ~Guarded() {
        if (region_) munmap(region_, region_bytes_);
    }

    unsigned char* data() const { return data_; }
    size_t bytes() const { return bytes_; }
    // Where a canary was overwritten ("before the start", "past the end"), or nullptr.
    const char* overwritten() const {
        for (size_t i = 0; i < slack_lo_; ++i)
            if (data_[-1 - static_cast<ptrdiff_t>(i)] != kCanary) return "before the start";
        const size_t slack_hi = (bytes_ + 255) / 256 * 256 - bytes_;
        for (size_t i = 0; i < slack_hi; ++i)
            if (data_[bytes_ + i] != kCanary) return "past the end";
        return nullptr;
    }

private:
    unsigned char* region_ = nullptr;  // mmap'ed, including the guard pages
    unsigned char* data_ = nullptr;    // bytes_ bytes at data_[0 .. bytes_)
    size_t region_bytes_ = 0, bytes_ = 0, slack_lo_ = 0;
};

struct Buffer {
    std::string name, path;
    bool out = false;
    bool inout = false;  // an output whose initial contents come from the file (not poisoned)
    uint64_t dev = 0;
    Guarded mem;
    std::vector<unsigned char> input;
};
inline std::vector<Buffer> g_buffers;

// The host address of a device address of the launch (0 stays 0: "none").
inline uint64_t translate(uint64_t dev, const char* what) {
    if (dev == 0) return 0;
    for (const Buffer& b : g_buffers)
        if (dev >= b.dev && dev <= b.dev + b.mem.bytes()) return reinterpret_cast<uint64_t>(b.mem.data()) + (dev - b.dev);
    char msg[200];
    std::snprintf(msg, sizeof msg, "%s: device address 0x%" PRIx64 " is in no buffer of the launch", what, dev);
    emu_launch::usage_error(msg);
}

// The device address of a host address inside a buffer (0 if none).
inline uint64_t untranslate(uint64_t host) {
    for (const Buffer& b : g_buffers) {
        const uint64_t h = reinterpret_cast<uint64_t>(b.mem.data());
        if (host >= h && host <= h + b.mem.bytes()) return b.dev + (host - h);
    }
    return 0;
}

// Which buffer of the launch a host address is in or next to (fault reports: registered with
// emu::set_fault_describer by run_seeds); empty when none is within a MiB.
inline std::string describe_host_address(uintptr_t a) {
    const Buffer* best = nullptr;
    uint64_t best_d = UINT64_MAX;
    for (const Buffer& b : g_buffers) {
        const uintptr_t lo = reinterpret_cast<uintptr_t>(b.mem.data()), hi = lo + b.mem.bytes();
        const uint64_t d = a < lo ? lo - a : a >= hi ? a - hi + 1 : 0;
        if (d < best_d) {
            best_d = d;
            best = &b;
        }
    }
    if (!best || best_d > (1u << 20)) return "";
    const uintptr_t lo = reinterpret_cast<uintptr_t>(best->mem.data()), hi = lo + best->mem.bytes();
    char s[400];
    if (a < lo)
        std::snprintf(s, sizeof s, "%" PRIu64 " bytes before the start of buffer %s (device 0x%" PRIx64 ", %zu bytes)",
                      static_cast<uint64_t>(lo - a), best->name.c_str(), best->dev, best->mem.bytes());
    else if (a >= hi)
        std::snprintf(s, sizeof s, "%" PRIu64 " bytes past the end of buffer %s (device 0x%" PRIx64 ", %zu bytes): device address 0x%" PRIx64,
                      static_cast<uint64_t>(a - hi), best->name.c_str(), best->dev, best->mem.bytes(),
                      static_cast<uint64_t>(best->dev + (a - lo)));
    else
        std::snprintf(s, sizeof s, "inside buffer %s (device 0x%" PRIx64 ", %zu bytes) at byte %" PRIu64, best->name.c_str(),
                      best->dev, best->mem.bytes(), static_cast<uint64_t>(a - lo));
    return s;
}

// Handles an `in`, `out` or `inout` directive; false for any other key.
inline bool buffer_directive(const emu_launch::Directive& d) {
    if (d.key != "in" && d.key != "out" && d.key != "inout") return false;
    d.need(4);
    Buffer b;
    b.name = d.a[0];
    b.out = d.key != "in";
    b.inout = d.key == "inout";
    b.dev = emu_launch::num(d.a[1]);
    b.mem = Guarded(static_cast<size_t>(emu_launch::num(d.a[2])), b.name);
    b.path = d.a[3];
    if (!b.out || b.inout) {
        std::ifstream f(b.path, std::ios::binary);
        b.input.resize(b.mem.bytes());
        if (!f.read(reinterpret_cast<char*>(b.input.data()), static_cast<std::streamsize>(b.mem.bytes())))
            emu_launch::usage_error("cannot read " + std::to_string(b.mem.bytes()) + " bytes from " + b.path);
        std::memcpy(b.mem.data(), b.input.data(), b.mem.bytes());
    }
    g_buffers.push_back(std::move(b));
    return true;
}

// Runs `run(seed)` (one launch, or a sequence of launches on one stream) once per seed (outputs
// poisoned with `poison` first, `inout` buffers reset from their files), checks canaries, inputs
// and that every seed's outputs are bit-identical, and writes the outputs back. `note`, if given,
// adds to each seed's "ok" line (the driver's counters). Returns the exit status.
inline int run_seeds_with(std::vector<uint64_t> seeds, const std::function<void(uint64_t)>& run, unsigned char poison,
                          const std::function<std::string()>& note = {}) {
    if (seeds.empty()) seeds.push_back(1);
    emu::set_fault_describer(&describe_host_address);
    std::vector<std::vector<unsigned char>> first;
    for (size_t si = 0; si < seeds.size(); ++si) {
        for (Buffer& b : g_buffers)
            if (b.inout) std::memcpy(b.mem.data(), b.input.data(), b.mem.bytes());
            else if (b.out) std::memset(b.mem.data(), poison, b.mem.bytes());
        run(seeds[si]);
        std::printf("seed %" PRIu64 ": ok%s\n", seeds[si], note ? note().c_str() : "");
        std::vector<std::vector<unsigned char>> outs;
        for (Buffer& b : g_buffers) {
            if (const char* where = b.mem.overwritten()) {
                std::fprintf(stderr, "EMU ERROR: a write %s of buffer %s\n", where, b.name.c_str());
                return 3;
            }
            if (b.out) {
                outs.emplace_back(b.mem.data(), b.mem.data() + b.mem.bytes());
            } else if (std::memcmp(b.mem.data(), b.input.data(), b.mem.bytes()) != 0) {
                std::fprintf(stderr, "EMU ERROR: the kernel wrote into its input buffer %s\n", b.name.c_str());
                return 3;
            }
        }
        if (si == 0) {
            first = outs;
        } else if (outs != first) {
            std::fprintf(stderr, "EMU ERROR: outputs of seed %" PRIu64 " differ from seed %" PRIu64
                                 "'s: the result depends on the schedule (a race)\n",
                         seeds[si], seeds[0]);
            return 5;
        }
    }
    for (const Buffer& b : g_buffers)
        if (b.out) {
            std::ofstream f(b.path, std::ios::binary);
            f.write(reinterpret_cast<const char*>(b.mem.data()), static_cast<std::streamsize>(b.mem.bytes()));
            if (!f) emu_launch::usage_error("cannot write " + b.path);
        }
    return 0;
}

// run_seeds_with one launch of `entry(arg)` under `cfg`.
inline int run_seeds(emu::LaunchConfig cfg, std::vector<uint64_t> seeds, void (*entry)(void*), void* arg,
                     unsigned char poison, const std::function<std::string()>& note = {}) {
    return run_seeds_with(
        std::move(seeds),
        [&](uint64_t seed) {
            cfg.seed = seed;
            emu::launch(cfg, entry, arg);
        },
        poison, note);
}

}  // namespace emu_buffers

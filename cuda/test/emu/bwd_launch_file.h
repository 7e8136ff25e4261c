// The launch file of the backward drivers (fa2_bwd_main.cpp, fa3_bwd_main.cpp): one BwdParams,
// the seeds, a sequence of launches on one emulated stream, and the buffers (guarded_buffers.h).
// Reading it, translating the params' device addresses and running the sequence under every seed
// live here once; each driver supplies its kernels by name and its entry point.
//
// Launch file, one directive per line:
//   params <hex bytes of BwdParams>      seeds <s1> <s2> ...
//   launch <kernel> <grid x> <grid y> <grid z> <threads> <dynamic smem bytes>   (in order)
//   in / out <name> <device address> <bytes> <file>   (guarded_buffers.h)
// Every address in the params must lie in a buffer.
#pragma once
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/bwd_params.h"
#include "guarded_buffers.h"
#include "launch_file.h"

namespace emu_bwd {

template <class Kernel> struct Launch {
    Kernel kernel;
    emu::LaunchConfig cfg;
};

template <class Kernel> struct LaunchFile {
    BwdParams params;  // with host addresses
    std::vector<uint64_t> seeds;
    std::vector<Launch<Kernel>> launches;
};

// Reads the launch file at `path`; `find` maps a kernel name to the driver's kernel (and exits
// through usage_error when it has none). Errors start with `program`.
template <class Kernel, class Find> LaunchFile<Kernel> read(const char* path, const char* program, Find find) {
    using emu_launch::num;
    using emu_launch::usage_error;
    emu_launch::g_program = program;
    LaunchFile<Kernel> f;
    std::vector<unsigned char> params_bytes;
    emu_launch::for_each_directive(path, [&](const emu_launch::Directive& d) {
        if (d.key == "launch") {
            d.need(6);
            Launch<Kernel> l;
            l.kernel = find(d.a[0]);
            l.cfg.kernel = d.a[0];
            l.cfg.grid = emu::Dim3{static_cast<unsigned>(num(d.a[1])), static_cast<unsigned>(num(d.a[2])),
                                   static_cast<unsigned>(num(d.a[3]))};
            l.cfg.block = emu::Dim3{static_cast<unsigned>(num(d.a[4])), 1, 1};
            l.cfg.smem_bytes = static_cast<unsigned>(num(d.a[5]));
            f.launches.push_back(l);
        } else if (d.key == "seeds") {
            for (const std::string& x : d.a) f.seeds.push_back(num(x));
        } else if (d.key == "params") {
            d.need(1);
            emu_launch::hex_bytes(d.a[0], sizeof(BwdParams), params_bytes);
        } else if (!emu_buffers::buffer_directive(d)) {
            usage_error("unknown directive " + d.key);
        }
    });
    if (params_bytes.size() != sizeof(BwdParams)) usage_error("missing params");
    if (f.launches.empty()) usage_error("no launch");
    BwdParams& p = f.params;
    std::memcpy(&p, params_bytes.data(), sizeof p);
    for (uint64_t* a : {&p.q, &p.k, &p.v, &p.o, &p.d_o, &p.lse, &p.d_sum, &p.dq_accum, &p.dq, &p.dk, &p.dv,
                        &p.alibi_slopes, &p.sinks, &p.d_sinks})
        *a = emu_buffers::translate(*a, "params address");
    return f;
}

// Runs the launches in order under every seed, each through `entry` with `*current` set to its
// kernel; returns the exit status of emu_buffers::run_seeds_with.
template <class Kernel> int run(LaunchFile<Kernel>& f, Kernel* current, void (*entry)(void*)) {
    for (const Launch<Kernel>& l : f.launches)
        std::printf("launch %s: grid (%u,%u,%u), %u threads, %u bytes of dynamic shared memory\n", l.cfg.kernel.c_str(),
                    l.cfg.grid.x, l.cfg.grid.y, l.cfg.grid.z, l.cfg.block.x, l.cfg.smem_bytes);
    // 0xFF: NaN in f32, f16 and bf16, so an element no launch writes shows.
    return emu_buffers::run_seeds_with(
        f.seeds,
        [&](uint64_t seed) {
            for (Launch<Kernel>& l : f.launches) {
                l.cfg.seed = seed;
                *current = l.kernel;
                emu::launch(l.cfg, entry, nullptr);
            }
        },
        0xFF);
}

}  // namespace emu_bwd

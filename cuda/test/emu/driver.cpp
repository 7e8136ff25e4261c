// The emulator's launcher: `emu_<unit> <launch file>` runs one kernel launch exactly as the host
// would make it, from a launch file the Rust side writes (tests/emulator.rs, from the crate's own
// launch plan: FwdParams, grid, block, dynamic shared memory and the cuTensorMapEncodeTiled
// arguments of every tensor map). Device memory is emulated by host buffers at the device
// addresses the plan used; every address in the params and in the tensor maps is translated.
//
// Launch file, one directive per line (numbers decimal or 0x-hex):
//   kernel <symbol>            a kernel compiled into this program (EMU_KERNEL)
//   grid <x> <y> <z>           block <threads>           smem <dynamic bytes>
//   regs <registers per thread at entry, from ptxas; 0 = 65536 / threads rounded down to 8>
//   seeds <s1> <s2> ...        scheduler seeds; every seed must give bit-identical outputs
//   params <hex bytes of FwdParams>
//   in  <name> <device address> <bytes> <file>      input buffer (checked unchanged afterwards)
//   out <name> <device address> <bytes> <file>      output buffer: NaN-poisoned, written back
//   inout <name> <device address> <bytes> <file>    read from the file, written back (a KV cache
//                                                   the append kernel writes into)
//   tmap <data_type> <rank> <address> <dims..> <strides (rank-1)..> <box..> <elem strides..>
//        <interleave> <swizzle> <l2 promotion> <oob fill>     (cuTensorMapEncodeTiled's arguments)
//   print-maps                 print every encoded map as the kernel receives it (decoded)
// Exit status: 0 ok, 2 bad launch file or rejected tensor map, 3 a failed emulator check,
// 4 deadlock, 5 outputs differ between seeds.
#include <sys/mman.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/params.h"
#include "launch_file.h"
#include "runtime.h"

namespace {

using emu_launch::num;
using emu_launch::usage_error;

struct Buffer {
    std::string name, path;
    bool out = false;
    bool inout = false;  // an output whose initial contents come from the file (not poisoned)
    uint64_t dev = 0, bytes = 0;
    unsigned char* host = nullptr;   // bytes at host[0 .. bytes)
    unsigned char* region = nullptr; // mmap'ed, including guard pages
    size_t region_bytes = 0, slack_lo = 0, slack_hi = 0;
    std::vector<unsigned char> input;
};

constexpr unsigned char kCanary = 0x5C;

// Host memory whose end is followed by an inaccessible page (a read or write past it faults)
// and whose rounding slack around it is filled with a canary (checked after the run).
void allocate(Buffer& b) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t rounded = (b.bytes + 255) / 256 * 256;
    const size_t data_pages = (rounded + page - 1) / page;
    b.region_bytes = (data_pages + 2) * page;
    void* m = mmap(nullptr, b.region_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) usage_error("mmap failed for buffer " + b.name);
    b.region = static_cast<unsigned char*>(m);
    mprotect(b.region, page, PROT_NONE);
    mprotect(b.region + (data_pages + 1) * page, page, PROT_NONE);
    unsigned char* data_end = b.region + (data_pages + 1) * page;
    b.host = data_end - rounded;
    b.slack_lo = static_cast<size_t>(b.host - (b.region + page));
    b.slack_hi = rounded - b.bytes;
    std::memset(b.region + page, kCanary, data_pages * page);
}

void check_canaries(const Buffer& b) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (size_t i = 0; i < b.slack_lo; ++i)
        if (b.region[page + i] != kCanary) {
            std::fprintf(stderr, "EMU ERROR: a write before the start of buffer %s\n", b.name.c_str());
            std::exit(3);
        }
    for (size_t i = 0; i < b.slack_hi; ++i)
        if (b.host[b.bytes + i] != kCanary) {
            std::fprintf(stderr, "EMU ERROR: a write %zu bytes past the end of buffer %s\n", i, b.name.c_str());
            std::exit(3);
        }
}

struct Tmap {
    uint32_t data_type, rank, interleave, swizzle, l2, oob;
    uint64_t address;
    std::vector<uint64_t> dims, strides;
    std::vector<uint32_t> box, elem_strides;
};

std::vector<Buffer> g_buffers;

uint64_t untranslate(uint64_t host) {
    for (const Buffer& b : g_buffers) {
        const uint64_t h = reinterpret_cast<uint64_t>(b.host);
        if (host >= h && host <= h + b.bytes) return b.dev + (host - h);
    }
    return 0;
}

uint64_t translate(uint64_t dev, const char* what) {
    if (dev == 0) return 0;
    for (const Buffer& b : g_buffers)
        if (dev >= b.dev && dev <= b.dev + b.bytes) return reinterpret_cast<uint64_t>(b.host) + (dev - b.dev);
    char msg[160];
    std::snprintf(msg, sizeof msg, "%s: device address 0x%" PRIx64 " is in no buffer of the launch", what, dev);
    usage_error(msg);
}

struct Entry {
    emu::KernelInvoker invoke;
    const FwdParams* params;
    const void* maps[3];
};
void run_thread(void* arg) {
    const Entry* e = static_cast<const Entry*>(arg);
    e->invoke(e->params, e->maps);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc == 2 && std::string(argv[1]) == "--list") {
        for (const std::string& n : emu::kernel_names()) std::printf("%s\n", n.c_str());
        return 0;
    }
    if (argc != 2) usage_error("usage: emu_<unit> <launch file> | --list");
    std::string kernel;
    emu::LaunchConfig cfg;
    std::vector<uint64_t> seeds;
    std::vector<unsigned char> params_bytes;
    std::vector<Tmap> tmaps;
    bool print_maps = false;
    emu_launch::g_program = "emu driver";
    emu_launch::for_each_directive(argv[1], [&](const emu_launch::Directive& d) {
        const std::string& key = d.key;
        const std::vector<std::string>& a = d.a;
        const auto need = [&](size_t n) { d.need(n); };
        if (key == "kernel") {
            need(1);
            kernel = a[0];
        } else if (key == "grid") {
            need(3);
            cfg.grid = emu::Dim3{static_cast<unsigned>(num(a[0])), static_cast<unsigned>(num(a[1])),
                                 static_cast<unsigned>(num(a[2]))};
        } else if (key == "block") {
            need(1);
            cfg.block = emu::Dim3{static_cast<unsigned>(num(a[0])), 1, 1};
        } else if (key == "smem") {
            need(1);
            cfg.smem_bytes = static_cast<unsigned>(num(a[0]));
        } else if (key == "regs") {
            need(1);
            cfg.entry_regs = static_cast<unsigned>(num(a[0]));
        } else if (key == "seeds") {
            for (const std::string& s : a) seeds.push_back(num(s));
        } else if (key == "params") {
            need(1);
            emu_launch::hex_bytes(a[0], sizeof(FwdParams), params_bytes);
        } else if (key == "in" || key == "out" || key == "inout") {
            need(4);
            Buffer b;
            b.name = a[0];
            b.out = key != "in";
            b.inout = key == "inout";
            b.dev = num(a[1]);
            b.bytes = num(a[2]);
            b.path = a[3];
            allocate(b);
            if (!b.out || b.inout) {
                std::ifstream f(b.path, std::ios::binary);
                b.input.resize(b.bytes);
                if (!f.read(reinterpret_cast<char*>(b.input.data()), static_cast<std::streamsize>(b.bytes)))
                    usage_error("cannot read " + std::to_string(b.bytes) + " bytes from " + b.path);
                std::memcpy(b.host, b.input.data(), b.bytes);
            }
            g_buffers.push_back(std::move(b));
        } else if (key == "tmap") {
            need(2);
            Tmap t;
            t.data_type = static_cast<uint32_t>(num(a[0]));
            t.rank = static_cast<uint32_t>(num(a[1]));
            const size_t r = t.rank;
            need(2 + 1 + r + (r - 1) + r + r + 4);
            size_t i = 2;
            t.address = num(a[i++]);
            for (size_t j = 0; j < r; ++j) t.dims.push_back(num(a[i++]));
            for (size_t j = 0; j + 1 < r; ++j) t.strides.push_back(num(a[i++]));
            for (size_t j = 0; j < r; ++j) t.box.push_back(static_cast<uint32_t>(num(a[i++])));
            for (size_t j = 0; j < r; ++j) t.elem_strides.push_back(static_cast<uint32_t>(num(a[i++])));
            t.interleave = static_cast<uint32_t>(num(a[i++]));
            t.swizzle = static_cast<uint32_t>(num(a[i++]));
            t.l2 = static_cast<uint32_t>(num(a[i++]));
            t.oob = static_cast<uint32_t>(num(a[i++]));
            tmaps.push_back(t);
        } else if (key == "print-maps") {
            print_maps = true;
        } else {
            usage_error("unknown directive " + key);
        }
    });
    int nmaps = 0;
    const emu::KernelInvoker invoke = emu::find_kernel(kernel, &nmaps);
    if (!invoke) usage_error("kernel " + kernel + " is not compiled into this program (see --list)");
    if (static_cast<int>(tmaps.size()) != nmaps)
        usage_error(kernel + " takes " + std::to_string(nmaps) + " tensor maps, the launch file has " + std::to_string(tmaps.size()));
    if (params_bytes.size() != sizeof(FwdParams)) usage_error("missing params");
    if (seeds.empty()) seeds.push_back(1);
    FwdParams p;
    std::memcpy(&p, params_bytes.data(), sizeof p);
    p.q = translate(p.q, "params.q");
    p.k = translate(p.k, "params.k");
    p.v = translate(p.v, "params.v");
    p.o = translate(p.o, "params.o");
    p.lse = translate(p.lse, "params.lse");
    p.alibi_slopes = translate(p.alibi_slopes, "params.alibi_slopes");
    p.q_descale = translate(p.q_descale, "params.q_descale");
    p.k_descale = translate(p.k_descale, "params.k_descale");
    p.v_descale = translate(p.v_descale, "params.v_descale");
    // Serving (cuda/common/seqlen.cuh): the i32 index buffers, the append's rows and the
    // split-KV partial states travel as `in` / `out` buffers like any other.
    p.cu_seqlens_q = translate(p.cu_seqlens_q, "params.cu_seqlens_q");
    p.cu_seqlens_k = translate(p.cu_seqlens_k, "params.cu_seqlens_k");
    p.seqused_k = translate(p.seqused_k, "params.seqused_k");
    p.block_table = translate(p.block_table, "params.block_table");
    p.knew = translate(p.knew, "params.knew");
    p.vnew = translate(p.vnew, "params.vnew");
    p.o_accum = translate(p.o_accum, "params.o_accum");
    p.lse_accum = translate(p.lse_accum, "params.lse_accum");

    struct alignas(128) Map {
        unsigned char b[128];
    };
    std::vector<Map> maps(tmaps.size());
    for (size_t i = 0; i < tmaps.size(); ++i) {
        const Tmap& t = tmaps[i];
        std::string why;
        const void* addr = reinterpret_cast<const void*>(translate(t.address, "tensor map global address"));
        const int rc = emu::encode_tensor_map_tiled(maps[i].b, t.data_type, t.rank, addr, t.dims.data(), t.strides.data(),
                                                    t.box.data(), t.elem_strides.data(), t.interleave, t.swizzle, t.l2,
                                                    t.oob, &why);
        if (rc != 0) usage_error("tensor map " + std::to_string(i) + " rejected (cuTensorMapEncodeTiled would fail): " + why);
        if (print_maps) {
            emu::TensorMapFields f;
            if (!emu::decode_tensor_map(maps[i].b, &f)) usage_error("tensor map does not decode");
            std::printf("tmap %zu: data_type %u rank %u address %#" PRIx64 " dims", i, f.data_type, f.rank,
                        untranslate(f.global_address));
            for (uint32_t d = 0; d < f.rank; ++d) std::printf(" %" PRIu64, f.dims[d]);
            std::printf(" strides");
            for (uint32_t d = 1; d < f.rank; ++d) std::printf(" %" PRIu64, f.strides[d]);
            std::printf(" box");
            for (uint32_t d = 0; d < f.rank; ++d) std::printf(" %u", f.box[d]);
            std::printf(" elem_strides");
            for (uint32_t d = 0; d < f.rank; ++d) std::printf(" %u", f.elem_strides[d]);
            std::printf(" interleave %u swizzle %u l2 %u oob %u\n", f.interleave, f.swizzle, f.l2_promotion, f.oob_fill);
        }
    }
    Entry e{invoke, &p, {nullptr, nullptr, nullptr}};
    for (size_t i = 0; i < maps.size(); ++i) e.maps[i] = maps[i].b;

    std::printf("launch %s: grid (%u,%u,%u), %u threads, %u bytes of dynamic shared memory, %s registers per thread at entry\n",
                kernel.c_str(), cfg.grid.x, cfg.grid.y, cfg.grid.z, cfg.block.x, cfg.smem_bytes,
                cfg.entry_regs ? std::to_string(cfg.entry_regs).c_str() : "65536/threads (no ptxas report)");
    std::vector<std::vector<unsigned char>> first;
    for (size_t si = 0; si < seeds.size(); ++si) {
        for (Buffer& b : g_buffers)
            if (b.inout) std::memcpy(b.host, b.input.data(), b.bytes);
            else if (b.out) std::memset(b.host, 0xFF, b.bytes);  // NaN in f16, bf16 and f32
        cfg.seed = seeds[si];
        cfg.window_offset = 0;
        emu::launch(cfg, &run_thread, &e);
        const emu::Stats st = emu::stats();
        std::printf("seed %" PRIu64 ": ok (%" PRIu64 " CTAs, %" PRIu64 " switches, %" PRIu64 " wgmma, %" PRIu64 " TMA boxes, %" PRIu64
                    " cp.async, %" PRIu64 " mbarrier polls)\n",
                    seeds[si], st.ctas, st.switches, st.wgmma_ops, st.tma_copies, st.cp_async_copies, st.mbar_waits);
        std::vector<std::vector<unsigned char>> outs;
        for (Buffer& b : g_buffers) {
            check_canaries(b);
            if (b.out) {
                outs.emplace_back(b.host, b.host + b.bytes);
            } else if (std::memcmp(b.host, b.input.data(), b.bytes) != 0) {
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
            f.write(reinterpret_cast<const char*>(b.host), static_cast<std::streamsize>(b.bytes));
            if (!f) usage_error("cannot write " + b.path);
        }
    return 0;
}

// The emulator's launcher: `emu_<unit> <launch file>` runs one kernel launch exactly as the host
// would make it, from a launch file the Rust side writes (tests/emulator/forward.rs, from the crate's own
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
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/params.h"
#include "guarded_buffers.h"
#include "launch_file.h"
#include "runtime.h"

namespace {

using emu_buffers::translate;
using emu_buffers::untranslate;
using emu_launch::num;
using emu_launch::usage_error;

struct Tmap {
    uint32_t data_type, rank, interleave, swizzle, l2, oob;
    uint64_t address;
    std::vector<uint64_t> dims, strides;
    std::vector<uint32_t> box, elem_strides;
};

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
        } else if (!emu_buffers::buffer_directive(d)) {
            usage_error("unknown directive " + key);
        }
    });
    int nmaps = 0;
    const emu::KernelInvoker invoke = emu::find_kernel(kernel, &nmaps);
    if (!invoke) usage_error("kernel " + kernel + " is not compiled into this program (see --list)");
    if (static_cast<int>(tmaps.size()) != nmaps)
        usage_error(kernel + " takes " + std::to_string(nmaps) + " tensor maps, the launch file has " + std::to_string(tmaps.size()));
    if (params_bytes.size() != sizeof(FwdParams)) usage_error("missing params");
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
    p.sinks = translate(p.sinks, "params.sinks");
    p.rotary_cos = translate(p.rotary_cos, "params.rotary_cos");
    p.rotary_sin = translate(p.rotary_sin, "params.rotary_sin");
    p.cache_batch_idx = translate(p.cache_batch_idx, "params.cache_batch_idx");
    p.cache_leftpad = translate(p.cache_leftpad, "params.cache_leftpad");
    p.k_cache_scale = translate(p.k_cache_scale, "params.k_cache_scale");
    p.v_cache_scale = translate(p.v_cache_scale, "params.v_cache_scale");

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
    // 0xFF: NaN in f16, bf16 and f32, so an output element the kernel leaves unwritten shows.
    cfg.kernel = kernel;
    return emu_buffers::run_seeds(cfg, seeds, &run_thread, &e, 0xFF, [] {
        const emu::Stats st = emu::stats();
        char line[240];
        std::snprintf(line, sizeof line,
                      " (%" PRIu64 " CTAs, %" PRIu64 " switches, %" PRIu64 " wgmma, %" PRIu64 " TMA boxes, %" PRIu64
                      " cp.async, %" PRIu64 " mbarrier polls)",
                      st.ctas, st.switches, st.wgmma_ops, st.tma_copies, st.cp_async_copies, st.mbar_waits);
        return std::string(line);
    });
}

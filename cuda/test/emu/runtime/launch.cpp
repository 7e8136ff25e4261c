// Launching a kernel over its grid one CTA at a time with the end-of-CTA checks, the kernel's view
// of its launch (threadIdx, blockIdx, ...), stateless instructions, and the kernel registry
// (../runtime.h has the map).
#include "state.h"

namespace emu::rt {



}  // namespace emu::rt

namespace emu {
using namespace rt;

const Dim3& thread_idx() { return me().tidx; }
const Dim3& block_idx() {
    if (!g_cta) fail("blockIdx outside a launch");
    return g_cta->block_idx;
}
const Dim3& block_dim() { return g_launch.cfg.block; }
const Dim3& grid_dim() { return g_launch.cfg.grid; }
unsigned dynamic_smem_bytes() { return g_launch.cfg.smem_bytes; }

void trap() { fail("__trap() executed by the kernel"); }

int ctaid(int dim) {
    const Dim3& b = block_idx();
    return static_cast<int>(dim == 0 ? b.x : dim == 1 ? b.y : b.z);
}

float ex2_approx_ftz(float x) {
    // ftz: subnormal inputs read as 0 (2^0 = 1) and subnormal results flush to +0.
    if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.f;
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}
float tanh_approx(float x) { return std::tanh(x); }

// ---- launch ----

void launch(const LaunchConfig& cfg, void (*entry)(void*), void* arg) {
    Launch& L = g_launch;
    L.cfg = cfg;
    L.async_proxy_seen = false;
    L.entry = entry;
    L.arg = arg;
    L.rng.seed(cfg.seed * 0x9E3779B97F4A7C15ull + 12345);
    // Per-seed switching: seed 1 switches at random, seed 2 keeps fibers running, seed 3 is in
    // between; later seeds cycle. The land policy is drawn per copy (draw_land_p), so every seed
    // mixes copies that land at once, soon and as late as possible.
    static const double kStay[3] = {0.0, 0.9, 0.5};
    L.stay_p = kStay[(cfg.seed + 2) % 3];
    install_fault_handler();
    const unsigned nthreads = cfg.block.x * cfg.block.y * cfg.block.z;
    if (nthreads == 0 || nthreads > kMaxThreads || nthreads % 32)
        fail("launch with %u threads per CTA (a multiple of 32 up to %d)", nthreads, kMaxThreads);
    if (cfg.block.y != 1 || cfg.block.z != 1) fail("only 1-D CTAs are emulated");
    // Dynamic shared memory starts at a 16-byte aligned shared address that is deliberately not
    // 1024-byte aligned (kernels must align it themselves).
    if (L.cfg.window_offset == 0) L.cfg.window_offset = 16 * static_cast<uint32_t>(1 + L.rng() % 63);
    if (L.cfg.window_offset % 16 || L.cfg.window_offset % 1024 == 0) fail("window offset 0x%x", L.cfg.window_offset);
    L.win_base = L.cfg.window_offset;  // emu_shared_window[0] is the dynamic smem's first byte
    if (static_cast<size_t>(cfg.smem_bytes) + kRedzoneBytes > kWindowBytes)
        fail("%u bytes of dynamic shared memory (the emulator's window holds %zu)", cfg.smem_bytes,
             kWindowBytes - kRedzoneBytes);
    const unsigned entry_regs = cfg.entry_regs ? cfg.entry_regs : std::min(255u, (65536u / nthreads) & ~7u);
    g_stats = Stats{};
    for (unsigned z = 0; z < cfg.grid.z; ++z)
        for (unsigned y = 0; y < cfg.grid.y; ++y)
            for (unsigned x = 0; x < cfg.grid.x; ++x) {
                auto cta = std::make_unique<Cta>();
                Cta& c = *cta;
                g_cta = &c;
                c.block_idx = Dim3{x, y, z};
                c.nthreads = nthreads;
                c.fibers.resize(nthreads);
                c.warps.resize(nthreads / 32);
                for (WarpState& w : c.warps) w.regs = static_cast<int>(entry_regs);
                c.wgs.resize((nthreads + 127) / 128);
                std::memset(emu_shared_window, kSmemPoison, cfg.smem_bytes);
                std::memset(emu_shared_window + cfg.smem_bytes, kRedzone, kRedzoneBytes);
                c.async_view.assign(emu_shared_window, emu_shared_window + cfg.smem_bytes);
                c.gran.assign((cfg.smem_bytes + 15) / 16, 0);
                c.gran_bytes.resize(c.gran.size());
                c.next_entry = nthreads;
                if (L.async_proxy_seen) start_store_tracking();
                for (unsigned t = 0; t < nthreads; ++t) {
                    Fiber& f = c.fibers[t];
                    f.tid = t;
                    f.tidx = Dim3{t, 0, 0};
                    f.warp = t / 32;
                    f.lane = t % 32;
                    f.wg = t / 128;
                    std::fill(std::begin(f.bar_gen_arrived), std::end(f.bar_gen_arrived), UINT64_MAX);
                    f.vc.assign(nthreads, 0);
                    f.vc[t] = 1;
                    init_fiber(f);
                    make_runnable(&f);
                }
                tc_cta_begin();
                schedule();
                protect_window(false);
                tc_cta_end();
                // End-of-CTA checks.
                for (unsigned id = 0; id < 16; ++id)
                    if (c.bars[id].arrived)
                        fail("barrier %u left with %u of %u threads arrived at exit", id, c.bars[id].arrived,
                             c.bars[id].expected);
                for (auto& [a, m] : c.mbars)
                    if (m.pending != m.count || m.tx != 0)
                        fail("mbarrier at shared 0x%x: phase %" PRIu64 " incomplete at exit (%" PRId64 " of %u arrivals "
                             "missing, %" PRId64 " tx bytes outstanding)",
                             a, m.phase, m.pending, m.count, m.tx);
                if (!c.tma.empty()) fail("%zu TMA copies still in flight at exit", c.tma.size());
                for (unsigned i = 0; i < kRedzoneBytes; ++i)
                    if (emu_shared_window[cfg.smem_bytes + i] != kRedzone)
                        fail("shared memory written past the end of the dynamic allocation (%u bytes), at +%u",
                             cfg.smem_bytes, i);
                ++g_stats.ctas;
                g_cta = nullptr;
            }
}

Stats stats() { return g_stats; }

namespace {
struct KernelEntry {
    KernelInvoker invoke;
    int nmaps;
};
std::map<std::string, KernelEntry>& registry() {
    static std::map<std::string, KernelEntry> r;
    return r;
}
}  // namespace
void register_kernel(const char* name, KernelInvoker invoke, int nmaps) { registry()[name] = KernelEntry{invoke, nmaps}; }
KernelInvoker find_kernel(const std::string& name, int* nmaps) {
    auto it = registry().find(name);
    if (it == registry().end()) return nullptr;
    *nmaps = it->second.nmaps;
    return it->second.invoke;
}
std::vector<std::string> kernel_names() {
    std::vector<std::string> v;
    for (auto& [n, e] : registry()) v.push_back(n);
    return v;
}

}  // namespace emu

// How the runtime reports a failure: the thread and its symbolised call stack (emu::fail), the
// per-warp deadlock report, and the SIGSEGV/SIGBUS handler (../runtime.h has the map).
#include "state.h"

namespace emu::rt {

// ------------------------------------------------------------------ diagnostics

std::string cta_name() {
    if (!g_cta) return "(no CTA)";
    char b[96];
    std::snprintf(b, sizeof b, "CTA (%u,%u,%u)", g_cta->block_idx.x, g_cta->block_idx.y, g_cta->block_idx.z);
    return b;
}
std::string thread_name(const Fiber* f) {
    if (!f) return "scheduler";
    char b[96];
    std::snprintf(b, sizeof b, "thread %u (warpgroup %u, warp %u, lane %u)", f->tid, f->wg, f->warp, f->lane);
    return b;
}

// Return addresses of a call stack, innermost first, by walking frame pointers (everything is
// built with -fno-omit-frame-pointer).
std::vector<uintptr_t> frames_from(uintptr_t rbp, uintptr_t first_pc, uintptr_t lo, uintptr_t hi) {
    std::vector<uintptr_t> pcs;
    if (first_pc) pcs.push_back(first_pc);
    for (int i = 0; i < 48 && rbp >= lo && rbp + 16 <= hi && rbp % 8 == 0; ++i) {
        const uintptr_t ret = reinterpret_cast<uintptr_t*>(rbp)[1];
        const uintptr_t next = reinterpret_cast<uintptr_t*>(rbp)[0];
        if (!ret) break;
        pcs.push_back(ret);
        if (next <= rbp) break;
        rbp = next;
    }
    return pcs;
}
std::vector<uintptr_t> fiber_frames(const Fiber* f) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(f->stack_lo), hi = lo + kStackBytes;
    if (f == g_fiber) {
        return frames_from(reinterpret_cast<uintptr_t>(__builtin_frame_address(0)), 0, lo, hi);
    }
    // Suspended in emu_ctx_switch: [sp] mxcsr, r15, r14, r13, r12, rbx, rbp, return address.
    const uintptr_t* s = static_cast<const uintptr_t*>(f->sp);
    return frames_from(s[6], s[7], lo, hi);
}
// "function at file:line" lines from addr2line (kernel and header frames first).
std::string symbolize(const std::vector<uintptr_t>& pcs, int max_lines) {
    if (pcs.empty()) return "";
    std::string cmd = "addr2line -f -i -C -p -e /proc/" + std::to_string(getpid()) + "/exe";
    for (uintptr_t pc : pcs) {
        char b[32];
        std::snprintf(b, sizeof b, " 0x%" PRIxPTR, pc - 1);
        cmd += b;
    }
    cmd += " 2>/dev/null";
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) return "";
    std::string out, line;
    char buf[1024];
    int n = 0;
    while (std::fgets(buf, sizeof buf, p)) {
        line = buf;
        // Skip the emulator's own frames and the C++ library; keep the kernel's.
        if (line.find("/cuda/test/emu/") != std::string::npos || line.find("?? ") == 0 ||
            line.find("/usr/") != std::string::npos)
            continue;
        if (n++ < max_lines) out += "      " + line;
    }
    pclose(p);
    return out;
}

void print_context(FILE* o) {
    std::fprintf(o, "  at %s, %s\n", cta_name().c_str(), thread_name(g_fiber).c_str());
    if (g_fiber) std::fprintf(o, "%s", symbolize(fiber_frames(g_fiber), 14).c_str());
}

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
    char b[1024];
    va_list ap;
    va_start(ap, f);
    std::vsnprintf(b, sizeof b, f, ap);
    va_end(ap);
    return b;
}

// ------------------------------------------------------------------ deadlock report

std::string mbar_state(uint32_t addr) {
    auto it = g_cta->mbars.find(addr);
    if (it == g_cta->mbars.end()) return "not initialised";
    const Mbar& m = it->second;
    char b[256];
    size_t copies = 0;
    for (const TmaCopy& t : g_cta->tma) copies += t.bar == addr;
    std::snprintf(b, sizeof b,
                  "phase %" PRIu64 " (parity %" PRIu64 ") in progress: %" PRId64 " of %u arrivals still missing, %" PRId64
                  " tx bytes outstanding, %zu TMA copies in flight to it",
                  m.phase, m.phase & 1, m.pending, m.count, m.tx, copies);
    return b;
}

void deadlock() {
    Cta& c = *g_cta;
    std::fflush(stdout);
    std::fprintf(stderr, "EMU ERROR: deadlock: every thread of %s is blocked and no asynchronous work is in flight\n",
                 cta_name().c_str());
    for (size_t w = 0; w < c.warps.size(); ++w) {
        // Group the warp's lanes by what they wait for.
        struct Group {
            Wait wait;
            uint64_t obj, a0, a1;
            uint32_t lanes;
            const Fiber* rep;
        };
        std::vector<Group> groups;
        unsigned exited = 0;
        for (unsigned l = 0; l < 32 && w * 32 + l < c.nthreads; ++l) {
            const Fiber& f = c.fibers[w * 32 + l];
            if (f.done) {
                ++exited;
                continue;
            }
            bool found = false;
            for (Group& g : groups)
                if (g.wait == f.wait && g.obj == f.wobj && g.a0 == f.warg0 && g.a1 == f.warg1) {
                    g.lanes |= 1u << l;
                    found = true;
                }
            if (!found) groups.push_back(Group{f.wait, f.wobj, f.warg0, f.warg1, 1u << l, &f});
        }
        if (groups.empty()) {
            std::fprintf(stderr, "  warp %zu: all lanes exited\n", w);
            continue;
        }
        for (const Group& g : groups) {
            std::fprintf(stderr, "  warp %zu (warpgroup %zu), lanes 0x%08x%s: waits in %s\n", w, w / 4, g.lanes,
                         exited ? " (other lanes exited)" : "", wait_name(g.wait));
            switch (g.wait) {
                case Wait::Mbar:
                    std::fprintf(stderr, "    mbarrier at shared 0x%" PRIx64 ", awaited parity %" PRIu64 "; barrier: %s\n",
                                 g.obj, g.a0, mbar_state(static_cast<uint32_t>(g.obj)).c_str());
                    break;
                case Wait::Bar: {
                    const HwBar& b = c.bars[g.obj];
                    std::fprintf(stderr, "    barrier id %" PRIu64 ", count %" PRIu64 "; barrier: %u of %u threads arrived\n",
                                 g.obj, g.a0, b.arrived, b.expected);
                    break;
                }
                case Wait::WgmmaWait:
                    std::fprintf(stderr, "    waiting for wgmma #%" PRIu64 " of its warpgroup (issued by %" PRIu64
                                         " of 128 threads)\n",
                                 g.obj, g.a0);
                    break;
                case Wait::WarpColl:
                    std::fprintf(stderr, "    %s #%" PRIu64 ": %" PRIu64 " of 32 lanes arrived\n",
                                 coll_name(static_cast<CollKind>(g.a1)), g.obj, g.a0);
                    break;
                case Wait::RegPool:
                    std::fprintf(stderr, "    needs %" PRIu64 " registers, the CTA pool has %" PRId64 " free\n", g.a0,
                                 c.reg_pool);
                    break;
                default:
                    break;
            }
            std::fprintf(stderr, "%s", symbolize(fiber_frames(g.rep), 8).c_str());
        }
    }
    std::fprintf(stderr, "  (seed %" PRIu64 ")\n", g_launch.cfg.seed);
    std::fflush(stderr);
    std::_Exit(4);
}

// ------------------------------------------------------------------ faults

std::string (*g_fault_describer)(uintptr_t) = nullptr;

// SIGSEGV / SIGBUS (a wild or out-of-bounds access: guard pages surround every driver buffer and
// sit below every fiber stack): the kernel, CTA, thread, address, what the address is near and
// the faulting source line, then exit status 3. Runs on its own stack (a fiber's stack may be
// what overflowed).
void on_fault(int sig, siginfo_t* si, void* ctx) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(si->si_addr);
    const uintptr_t win0 = reinterpret_cast<uintptr_t>(emu_shared_window);
    if (sig == SIGSEGV && g_cta && g_cta->track_stores && addr >= win0 &&
        addr < win0 + (g_launch.cfg.smem_bytes + kPage - 1) / kPage * kPage) {
        // A store into the write-protected window (ordinary stores are being tracked): note the
        // page, open it, and let the store run.
        const uintptr_t page = (addr - win0) / kPage;
        g_cta->dirty_pages.push_back(static_cast<uint32_t>(page));
        mprotect(emu_shared_window + page * kPage, kPage, PROT_READ | PROT_WRITE);
        return;
    }
    const ucontext_t* uc = static_cast<const ucontext_t*>(ctx);
    const uintptr_t rip = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
    const uintptr_t rbp = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RBP]);
    std::fflush(stdout);
    std::fprintf(stderr, "EMU ERROR: %s: an access to address 0x%" PRIxPTR " in kernel %s\n",
                 sig == SIGBUS ? "bus error (SIGBUS)" : "segmentation fault (SIGSEGV)", addr,
                 g_launch.cfg.kernel.empty() ? "(unnamed)" : g_launch.cfg.kernel.c_str());
    std::fprintf(stderr, "  at %s, %s\n", cta_name().c_str(),
                 g_fiber ? thread_name(g_fiber).c_str() : "the scheduler (landing asynchronous work)");
    std::string near;
    for (size_t i = 0; i < g_launch.stacks.size(); ++i) {
        const uintptr_t lo = reinterpret_cast<uintptr_t>(g_launch.stacks[i]);
        if (addr >= lo - 4096 && addr < lo)
            near = "the guard page below the stack of thread " + std::to_string(i) + ": its stack (" +
                   std::to_string(kStackBytes / 1024) + " KiB) overflowed";
    }
    const uintptr_t win = reinterpret_cast<uintptr_t>(emu_shared_window);
    if (near.empty() && addr >= win && addr < win + kWindowBytes)
        near = fmt("the shared-memory window, at shared address 0x%x", static_cast<uint32_t>(g_launch.win_base + (addr - win)));
    if (near.empty() && g_fault_describer) near = g_fault_describer(addr);
    std::fprintf(stderr, "  the address: %s\n", near.empty() ? "near no buffer of the launch (a wild pointer)" : near.c_str());
    std::string where;
    if (g_fiber) {
        const uintptr_t lo = reinterpret_cast<uintptr_t>(g_fiber->stack_lo);
        where = symbolize(frames_from(rbp, rip + 1, lo, lo + kStackBytes), 14);
    }
    std::fprintf(stderr, "%s", where.empty() ? "      (no kernel frame: the access was made by the emulator itself, e.g. a TMA "
                                               "copy through a tensor map whose global extent is wrong)\n"
                                             : where.c_str());
    std::fprintf(stderr, "  (seed %" PRIu64 ", dynamic smem at shared address 0x%x)\n", g_launch.cfg.seed,
                 g_launch.cfg.window_offset);
    std::fflush(stderr);
    std::_Exit(3);
}

void install_fault_handler() {
    static bool installed = false;
    if (installed) return;
    installed = true;
    static std::vector<unsigned char> alt(256 * 1024);
    stack_t ss{};
    ss.ss_sp = alt.data();
    ss.ss_size = alt.size();
    sigaltstack(&ss, nullptr);
    struct sigaction sa{};
    sa.sa_sigaction = &on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
}

}  // namespace emu::rt

namespace emu {
using namespace rt;

void fail(const char* fmt, ...) {
    std::fflush(stdout);
    va_list ap;
    va_start(ap, fmt);
    std::fprintf(stderr, "EMU ERROR: ");
    std::vfprintf(stderr, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "\n");
    print_context(stderr);
    std::fprintf(stderr, "  (seed %" PRIu64 ", dynamic smem at shared address 0x%x)\n", g_launch.cfg.seed,
                 g_launch.cfg.window_offset);
    std::fflush(stderr);
    std::_Exit(3);
}

void set_fault_describer(std::string (*describe)(uintptr_t)) { g_fault_describer = describe; }

}  // namespace emu

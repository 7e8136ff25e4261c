// The CPU emulator's runtime (API and overview: runtime.h). Semantics are modelled from the PTX ISA
// 9.0 and the CUDA driver API documentation; layouts come only from sm80_layouts.h/sm90_layouts.h.
//
// Threads and scheduling. One CTA runs at a time on the calling OS thread; each CUDA thread is a
// fiber (own mmap'ed stack with a guard page, x86-64 context switch below). Every emulated
// primitive is a scheduling point: the fiber returns to the scheduler, which picks the next
// runnable fiber at random (seeded; a per-seed "stay" probability keeps some runs long) and, at
// every step, may complete asynchronous work that is in flight (a per-seed probability: from
// "land at once" to "land as late as possible"): TMA boxes, wgmma instructions, cp.async copies.
// A fiber that must wait blocks on a wait list and is woken when the state it waits for changes.
// When no fiber can run and no asynchronous work is left, the run is a deadlock: every warp's
// state is printed and the run fails.
//
// Checks (each fails the run with a message naming the thread, the object and the call stack):
//  shared memory  accesses through wgmma/TMA/ldmatrix/cp.async/mbarrier outside the dynamic
//                 allocation; the redzone after it overwritten; generic pointers that are not
//                 shared memory; wgmma reading bytes that ordinary stores changed after the last
//                 fence.proxy.async (approximation: one snapshot per fence of any thread).
//  barriers       __syncthreads / bar.sync / bar.arrive: one count per barrier phase, no thread
//                 arriving twice in a phase, whole warps only, nothing pending at exit;
//                 __syncthreads after a thread of the CTA exited.
//  warp collectives (shfl, ldmatrix, mma.sync, __syncwarp, elect.sync): full mask, every lane
//                 executes the same operation.
//  mbarrier       use before init, init twice, use by the async proxy before fence.mbarrier_init,
//                 the 8 bytes overwritten by ordinary stores or TMA, arrival underflow (an
//                 arrival when the phase has all its arrivals and waits for bytes), a TMA copy
//                 completing in a later phase than the one it was issued in (expect_tx too
//                 small), phases left incomplete (arrivals or tx bytes) at exit.
//  TMA            tensor map decoded (bad map: fail), destination 128-byte aligned and inside
//                 the allocation, box written at a scheduler-chosen time with zero fill out of
//                 bounds and the swizzle applied to absolute shared addresses, full box bytes
//                 completed on the mbarrier; the destination written by someone else while the
//                 copy was in flight; a copy landing on bytes an unretired wgmma reads; copies
//                 pending at exit.
//  wgmma          all 128 threads of the warpgroup issue the same instruction with the same
//                 descriptors in the same commit group; wgmma.fence before the first wgmma after
//                 a wait_group (or at start); accumulator registers poisoned while in flight and
//                 written back only when wait_group retires their group (a thread writing one in
//                 between, an A register changing, or fence_regs on a register still in flight
//                 fail); operands read at a scheduler-chosen time between issue and retirement,
//                 through the real descriptor bits; reading bytes a TMA/cp.async copy in flight
//                 will still write; the operand bytes changing before every thread retired the
//                 instruction (slot released early); ops uncommitted or unretired at exit.
//  setmaxnreg     warpgroup-uniform, inc/dec direction, a per-CTA pool of threads x entry
//                 registers (an inc that the pool cannot satisfy waits; if nothing frees
//                 registers it is a deadlock).
//  cp.async       copies land between issue and the wait_group that covers them; pending at exit.
//  happens-before of shared memory (every run, whatever the schedule): each TMA box and cp.async
//                 copy is the recorded writer of its 16-byte granules; a read through ldmatrix,
//                 a wgmma operand (per issuing thread: its warp's A rows, all of B) or a UMMA
//                 operand (the issuing thread) must have acquired the write's completion (TMA:
//                 the mbarrier phase it completes, through try_wait; cp.async: the copying
//                 thread's wait_group, then a release of that thread). Once the launch uses the
//                 async proxy, ordinary stores are seen too (the window is write-protected while
//                 fibers run; a written page is diffed when the fiber switches out): the async
//                 proxy may read them only after a fence.proxy.async of the storing thread and a
//                 release of it after the fence; ldmatrix after a release after the store; a
//                 store into bytes a wgmma reads needs every reading thread's retirement acquired.
#include "runtime.h"

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "sm80_layouts.h"
#include "sm90_layouts.h"

#if !defined(__x86_64__)
#error "the emulator's fiber switch is written for x86-64 (see emu_ctx_switch)"
#endif

// ---- context switch (System V x86-64): saves the callee-saved registers, MXCSR and the x87
// control word on the old stack, stores its stack pointer, loads the new one and returns there.
extern "C" void emu_ctx_switch(void** save_sp, void* new_sp);
extern "C" void emu_ctx_trampoline();
asm(R"(
    .text
    .globl emu_ctx_switch
    .type emu_ctx_switch,@function
emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_ctx_switch, .-emu_ctx_switch

    .globl emu_ctx_trampoline
    .type emu_ctx_trampoline,@function
emu_ctx_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size emu_ctx_trampoline, .-emu_ctx_trampoline
)");

namespace emu {
namespace {

constexpr uint32_t kPoisonBits = 0x7FF0DEADu;  // a quiet NaN: accumulator registers in flight
constexpr unsigned char kSmemPoison = 0xFF;     // NaN as f16, bf16 and f32
constexpr unsigned char kRedzone = 0xA5;
constexpr uint32_t kRedzoneBytes = 1024;
constexpr size_t kStackBytes = 256 * 1024;
constexpr int kMaxThreads = 1024;

struct Fiber;

struct WaitList {
    std::vector<Fiber*> waiters;
};

enum class Wait : uint8_t { None, Runnable, Bar, Mbar, WarpColl, WgColl, WgmmaWait, CpAsync, RegPool };

const char* wait_name(Wait w) {
    switch (w) {
        case Wait::Bar: return "bar.sync (named barrier / __syncthreads)";
        case Wait::Mbar: return "mbarrier.try_wait.parity";
        case Wait::WarpColl: return "warp-collective instruction (other lanes not there)";
        case Wait::WgColl: return "warpgroup-collective setmaxnreg (other warps not there)";
        case Wait::WgmmaWait: return "wgmma.wait_group (instructions not issued by the whole warpgroup)";
        case Wait::CpAsync: return "cp.async.wait_group";
        case Wait::RegPool: return "setmaxnreg.inc (register pool exhausted)";
        default: return "running";
    }
}

struct VReg {  // an accumulator register while wgmma owns it
    float value;
    uint64_t last_op;  // warpgroup op sequence number of the last wgmma writing it
};

// Happens-before between threads, as vector clocks: entry t is the number of synchronisation
// events (releases) of thread t that are ordered before the owner's present. Barriers, mbarrier
// phases and __syncwarp carry them; the wgmma checks use them to prove that every thread's
// retirement of an instruction is ordered before a TMA copy that overwrites its operands.
using Clock = std::vector<uint32_t>;
void join(Clock& into, const Clock& from) {
    if (into.size() < from.size()) into.resize(from.size(), 0);
    for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

struct CpCopy {
    unsigned tid;
    uint64_t group;  // the thread's commit count when issued: the group it belongs to
    uint32_t dst;
    const void* src;
    int size, src_bytes;
    uint32_t aw;    // its AsyncWrite record
    double land_p;  // per step, the probability that it lands when picked (its land policy)
};

// One asynchronous write into shared memory (a TMA box or one cp.async copy), for the
// happens-before check of reads: its completion is an event on a clock entry (`entry` reaching
// `value`): for TMA, the mbarrier's own entry (phase `phase` completing, through complete_tx);
// for cp.async, the issuing thread's entry at the cp.async.wait_group that covers it. A reader
// must have acquired that event (its clock's `entry` at least `value`).
struct AsyncWrite {
    bool tma = false;
    unsigned tid = 0;
    uint32_t dst = 0, bytes = 0;
    uint32_t bar = 0;     // TMA: the mbarrier it completes on
    uint64_t phase = 0;   // ... in this phase
    uint64_t group = 0;   // cp.async: the thread's commit group
    uint32_t entry = 0, value = 0;
    bool complete = false;  // the completion event has happened (TMA: known from the barrier)
    bool landed = false;
    std::array<uintptr_t, 10> pcs{};  // issuing call stack (innermost first)
};

struct Fiber {
    Dim3 tidx;
    unsigned tid = 0, warp = 0, lane = 0, wg = 0;
    void* sp = nullptr;
    unsigned char* stack_lo = nullptr;
    bool done = false, runnable = false;
    // What it is blocked on (diagnosis).
    Wait wait = Wait::None;
    uint64_t wobj = 0, warg0 = 0, warg1 = 0;
    bool soft = false;  // mbarrier try_wait: may return false when nothing else can progress
    // Collective sequence numbers.
    uint64_t wcoll = 0, wgcoll = 0;
    uint64_t bar_gen_arrived[16];
    // wgmma.
    uint64_t wg_issued = 0;          // instructions issued
    std::vector<uint64_t> group_end;  // per committed group: instructions issued when committed
    uint64_t groups_retired = 0;
    uint64_t ops_retired = 0;  // instructions whose results this thread has received
    bool need_fence = true;
    std::unordered_map<const float*, VReg> vregs;
    // cp.async.
    uint64_t cp_committed = 0;
    std::vector<std::pair<uint64_t, uint32_t>> cp_pending;  // (group, AsyncWrite id) not yet waited for
    // Ordinary stores into shared memory (seen when the fiber switches out): their count, and
    // per fence.proxy.async (store count then, clock entry then).
    uint32_t store_seq = 0;
    std::vector<std::pair<uint32_t, uint32_t>> fences;
    Clock vc;  // happens-before clock
    // __syncthreads_or calls made (selects the CTA's accumulator slot).
    uint64_t or_calls = 0;
};

// One warp-collective instruction instance (the k-th collective of every lane of a warp).
enum class CollKind : uint8_t { Shfl, SyncWarp, Ldmatrix, LdmatrixT, Mma, Elect, ShflIdx };
const char* coll_name(CollKind k) {
    switch (k) {
        case CollKind::Shfl: return "shfl.sync.bfly";
        case CollKind::SyncWarp: return "bar.warp.sync (__syncwarp)";
        case CollKind::Ldmatrix: return "ldmatrix.x4";
        case CollKind::LdmatrixT: return "ldmatrix.x4.trans";
        case CollKind::Mma: return "mma.sync.m16n8k16";
        case CollKind::Elect: return "elect.sync";
        case CollKind::ShflIdx: return "shfl.sync.idx";
    }
    return "?";
}
struct Coll {
    CollKind kind;
    uint32_t arg = 0;  // shfl lane mask / mma element type
    unsigned arrived = 0, consumed = 0;
    bool done = false;
    uint32_t in[32][10];
    float fin[32][4];
    uint32_t out[32][4];
    WaitList wl;
    Clock joined;  // __syncwarp: the join of every lane's release
};
struct WarpState {
    std::deque<Coll> colls;
    uint64_t base = 0;
    int regs = 0;  // setmaxnreg: registers per thread
};

struct WgColl {
    bool inc;
    int regs;
    unsigned arrived = 0, consumed = 0;
    bool done = false;
    WaitList wl;
};

struct WgmmaOp {
    WgmmaInstr ins{};
    uint64_t seq = 0, group = 0;
    unsigned issued = 0, retired = 0;
    bool executed = false;
    unsigned first_tid = 0;
    std::vector<float*> d;                 // per thread
    std::vector<const uint32_t*> a_ptr;    // RS: per thread
    std::vector<std::array<uint32_t, 4>> a_val;
    std::vector<std::vector<VReg*>> vr;    // per thread, per register
    // Shared-memory bytes the instruction reads: [lo, hi) per operand, and their values then.
    uint32_t lo[2] = {0, 0}, hi[2] = {0, 0};
    std::vector<unsigned char> snap[2];
    // Per thread: its clock entry when it retired the instruction (0: not yet).
    std::vector<uint32_t> retire_time;
    double land_p = 1;  // its land policy (CpCopy::land_p)
    // The 16-byte granules its shared operands occupy: A per warp of the warpgroup (rows 16w ..
    // 16w + 15, the part that warp's lanes read), B whole (happens-before check at issue).
    std::vector<uint32_t> gran_a[4], gran_b;
};
struct WgState {
    std::deque<WgmmaOp> ops;
    std::deque<WgmmaOp> history;  // the last fully retired instructions (their operands and retire times)
    uint64_t base = 0;       // seq of ops.front()
    uint64_t next_exec = 0;  // first unexecuted op
    WaitList wl;             // wait_group waiters (ops becoming fully issued)
    std::deque<WgColl> colls;
    uint64_t coll_base = 0;
};

struct HwBar {
    unsigned expected = 0, arrived = 0;
    uint64_t gen = 0;
    uint32_t warp_lanes[kMaxThreads / 32];
    WaitList wl;
    Clock acc, done;  // join of this phase's arrivals; of the last completed phase
};

struct Mbar {
    uint32_t count = 0;
    int64_t pending = 0, tx = 0;
    uint64_t phase = 0;
    bool fenced = false;
    unsigned init_tid = 0;
    uint64_t canary = 0;
    WaitList wl;
    Clock acc;      // join of the current phase's arrivals (and TMA issuers)
    Clock done[2];  // of the last completed phase of each parity
    uint32_t entry = 0;  // its own clock entry: phase p's completion sets it to p + 1
};

struct TmaCopy {
    uint64_t id;
    unsigned tid;
    Clock vc;  // the issuer's clock at issue
    uint32_t dst, bar, bytes;
    uint64_t issue_phase;
    TensorMapFields map;
    int32_t coords[5];
    std::vector<unsigned char> dst_before;
    uint32_t aw;    // its AsyncWrite record
    double land_p;  // its land policy (CpCopy::land_p)
};

struct Cta {
    Dim3 block_idx;
    unsigned nthreads = 0;
    std::vector<Fiber> fibers;
    std::vector<WarpState> warps;
    std::vector<WgState> wgs;
    HwBar bars[16];
    std::map<uint32_t, Mbar> mbars;
    std::vector<TmaCopy> tma;
    std::vector<CpCopy> cp;
    std::vector<unsigned char> async_view;  // smem as the async proxy sees it (last fence)
    // Happens-before of asynchronous writes: every record (id = index + 1), the last one issued
    // into each 16-byte granule of the dynamic smem (0: none), and the bytes it left there.
    std::vector<AsyncWrite> aw;
    std::vector<uint32_t> gran;
    std::vector<std::array<unsigned char, 16>> gran_bytes;
    // Ordinary (generic-proxy) stores into shared memory, per granule: the storing thread + 1
    // (0: none since the last asynchronous write), its store count and clock entry then. Seen
    // by write-protecting the window while fibers run (a written page is diffed against
    // `shadow` when the fiber switches out); on once the launch uses the async proxy.
    bool track_stores = false;
    std::vector<unsigned char> shadow;
    std::vector<uint32_t> st_tid, st_seq, st_epoch;
    std::vector<uint32_t> dirty_pages;  // window pages written since the last diff
    uint32_t next_entry = 0;  // the next clock entry for an mbarrier (after the threads')
    int64_t reg_pool = 0;                   // free registers of the CTA
    WaitList reg_wl;
    unsigned exited = 0;
    // __syncthreads_or: call n ORs into slot n % 3 and clears slot (n + 1) % 3 before its
    // barrier; slot (n + 1) % 3 was last read in call n - 2, before barrier n - 1, and is next
    // written in call n + 1, after barrier n. (Every thread makes the same calls, as CUDA needs.)
    int or_acc[3] = {0, 0, 0};
    uint64_t progress = 0;  // bumped by every state change (deadlock detection)
    std::vector<Fiber*> runnable;
    Fiber* current = nullptr;
    void* sched_sp = nullptr;
};

// Launch-wide state.
struct Launch {
    LaunchConfig cfg;
    void (*entry)(void*) = nullptr;
    void* arg = nullptr;
    uint32_t win_base = 0;  // shared address of emu_shared_window[0]... see smem_*
    std::mt19937_64 rng;
    double stay_p = 0;
    uint64_t tma_ids = 0;
    std::vector<unsigned char*> stacks;
    bool async_proxy_seen = false;  // a fence.proxy.async, TMA, wgmma or UMMA ran (store tracking)
};

Launch g_launch;
Stats g_stats;
thread_local Cta* g_cta = nullptr;
thread_local Fiber* g_fiber = nullptr;

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

}  // namespace

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

namespace {

// ------------------------------------------------------------------ scheduling

Fiber& me() {
    if (!g_fiber) fail("a device primitive was called outside a kernel launch");
    return *g_fiber;
}

// A release by the current thread: its clock, then its own entry advances (later events of the
// thread are not covered by this release).
Clock release(Fiber& f) {
    Clock c = f.vc;
    ++f.vc[f.tid];
    return c;
}

void make_runnable(Fiber* f) {
    if (f->done || f->runnable) return;
    f->runnable = true;
    f->wait = Wait::Runnable;
    g_cta->runnable.push_back(f);
}

void notify(WaitList& wl) {
    for (Fiber* f : wl.waiters) make_runnable(f);
    wl.waiters.clear();
    ++g_cta->progress;
}

void note_stores(Fiber& f);
void to_scheduler() {
    Fiber& f = *g_fiber;
    if (g_cta->track_stores) note_stores(f);
    ++g_stats.switches;
    emu_ctx_switch(&f.sp, g_cta->sched_sp);
}

// A scheduling point: the scheduler may run other fibers (and land async work) first.
void sched_point() { to_scheduler(); }

// Blocks the current fiber on `wl` until notified.
void block_on(WaitList& wl, Wait why, uint64_t obj, uint64_t a0 = 0, uint64_t a1 = 0, bool soft = false) {
    Fiber& f = me();
    f.wait = why;
    f.wobj = obj;
    f.warg0 = a0;
    f.warg1 = a1;
    f.soft = soft;
    f.runnable = false;
    wl.waiters.push_back(&f);
    auto& r = g_cta->runnable;
    r.erase(std::remove(r.begin(), r.end(), &f), r.end());
    to_scheduler();
    f.soft = false;
}

// ------------------------------------------------------------------ shared memory

uint32_t smem_lo() { return g_launch.cfg.window_offset; }
uint32_t smem_hi() { return g_launch.cfg.window_offset + g_launch.cfg.smem_bytes; }

unsigned char* host_of(uint32_t addr) { return emu_shared_window + (addr - g_launch.win_base); }

void check_smem_range(uint32_t addr, uint32_t bytes, const char* what) {
    if (addr < smem_lo() || addr + static_cast<uint64_t>(bytes) > smem_hi())
        fail("%s: shared bytes [0x%x, 0x%x) outside the dynamic shared memory [0x%x, 0x%x)", what, addr, addr + bytes,
             smem_lo(), smem_hi());
}

bool overlaps(uint32_t a0, uint32_t a1, uint32_t b0, uint32_t b1) { return a0 < b1 && b0 < a1; }

// The mbarrier objects' 8 bytes must not be touched by anything but mbarrier operations.
void check_not_mbarrier(uint32_t lo, uint32_t hi, const char* what) {
    for (auto& [addr, mb] : g_cta->mbars)
        if (overlaps(lo, hi, addr, addr + 8)) fail("%s writes over the mbarrier at shared 0x%x", what, addr);
}

uint64_t canary_for(uint32_t addr) { return 0x4D42415252494552ull ^ (static_cast<uint64_t>(addr) * 0x9E3779B97F4A7C15ull); }

// ------------------------------------------------------------------ element types

float elem_to_float(uint32_t bits, Elem e) {
    switch (e) {
        case Elem::F16: {
            _Float16 h;
            const uint16_t b = static_cast<uint16_t>(bits);
            std::memcpy(&h, &b, 2);
            return static_cast<float>(h);
        }
        case Elem::BF16: {
            const uint32_t u = bits << 16;
            float f;
            std::memcpy(&f, &u, 4);
            return f;
        }
        case Elem::E4M3: {  // 1-4-3, bias 7, no inf, S.1111.111 = NaN
            const uint32_t s = (bits >> 7) & 1, ex = (bits >> 3) & 15, m = bits & 7;
            if (ex == 15 && m == 7) return NAN;
            const float v = ex == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, ex - 7);
            return s ? -v : v;
        }
        case Elem::E5M2: {  // 1-5-2, bias 15, IEEE-like
            const uint32_t s = (bits >> 7) & 1, ex = (bits >> 2) & 31, m = bits & 3;
            float v;
            if (ex == 31) v = m ? NAN : INFINITY;
            else v = ex == 0 ? std::ldexp(static_cast<float>(m), -16) : std::ldexp(1.f + m / 4.f, ex - 15);
            return s ? -v : v;
        }
    }
    return NAN;
}
uint32_t elem_bytes(Elem e) { return (e == Elem::F16 || e == Elem::BF16) ? 2 : 1; }
float reg_elem(uint32_t reg, uint32_t idx, Elem e) {
    const uint32_t b = elem_bytes(e);
    const uint32_t bits = b == 2 ? (reg >> (16 * idx)) & 0xFFFF : (reg >> (8 * idx)) & 0xFF;
    return elem_to_float(bits, e);
}

// ------------------------------------------------------------------ async work

// Lands TMA copy i (removes it from the in-flight list).
void land_tma(size_t i);
// Executes the oldest fully issued, unexecuted wgmma of warpgroup w.
void exec_wgmma(unsigned w);
void land_cp(size_t i);
// tcgen05 (tcgen05.inc): pieces of asynchronous work ready to fire, firing one, the per-CTA state,
// and the guard on TMA destinations that unexecuted MMAs read.
size_t tc_pending();
void tc_fire(size_t i);
void tc_cta_begin();
void tc_cta_end();
void tc_check_tma_dst(uint32_t lo, uint32_t hi);

bool wg_can_exec(unsigned w) {
    WgState& s = g_cta->wgs[w];
    if (s.next_exec >= s.base + s.ops.size()) return false;
    return s.ops[s.next_exec - s.base].issued == 128;
}

// The land policies: the probability per scheduling step that a picked piece of asynchronous
// work lands (as late as possible, soon, at once).
constexpr double kLandP[3] = {0.01, 0.2, 1.0};
// A new piece of work's policy: the launch's fixed one, or one drawn per piece.
double draw_land_p() {
    const int fixed = g_launch.cfg.land_policy;
    return kLandP[fixed >= 0 ? fixed % 3 : static_cast<int>(g_launch.rng() % 3)];
}

// Picks one random piece of pending asynchronous work and fires it, if `forced` or with the
// probability of its land policy; false if there is none or it stays in flight.
bool fire_one(bool forced) {
    Cta& c = *g_cta;
    const size_t n_tma = c.tma.size(), n_cp = c.cp.size();
    size_t n_wg = 0;
    for (unsigned w = 0; w < c.wgs.size(); ++w) n_wg += wg_can_exec(w);
    const size_t n_tc = tc_pending();
    const size_t total = n_tma + n_cp + n_wg + n_tc;
    if (!total) return false;
    std::uniform_real_distribution<double> u01(0.0, 1.0);
    auto lands = [&](double p) { return forced || u01(g_launch.rng) < p; };
    size_t pick = g_launch.rng() % total;
    if (pick < n_tma) {
        if (!lands(c.tma[pick].land_p)) return false;
        land_tma(pick);
        return true;
    }
    pick -= n_tma;
    if (pick < n_cp) {
        if (!lands(c.cp[pick].land_p)) return false;
        land_cp(pick);
        return true;
    }
    pick -= n_cp;
    if (pick < n_tc) {
        if (!lands(draw_land_p())) return false;
        tc_fire(pick);
        return true;
    }
    pick -= n_tc;
    for (unsigned w = 0; w < c.wgs.size(); ++w)
        if (wg_can_exec(w) && pick-- == 0) {
            WgState& s = c.wgs[w];
            if (!lands(s.ops[s.next_exec - s.base].land_p)) return false;
            exec_wgmma(w);
            return true;
        }
    return false;
}

void deadlock();

// Runs the CTA's fibers to completion.
void schedule() {
    Cta& c = *g_cta;
    uint64_t soft_timeout_progress = UINT64_MAX;
    std::uniform_real_distribution<double> u01(0.0, 1.0);
    Fiber* last = nullptr;
    while (c.exited < c.nthreads) {
        // Asynchronous work lands at random points (each piece at the rate of its policy).
        while (fire_one(false)) {
        }
        if (c.runnable.empty()) {
            if (fire_one(true)) continue;
            // Fibers polling an mbarrier (try_wait) time out and poll again, once per change of
            // state; if nothing changed since the last time-out, nobody can make progress.
            std::vector<Fiber*> soft;
            for (Fiber& f : c.fibers)
                if (!f.done && !f.runnable && f.soft) soft.push_back(&f);
            ++g_stats.deadlock_checks;
            if (!soft.empty() && soft_timeout_progress != c.progress) {
                soft_timeout_progress = c.progress;
                for (Fiber* f : soft) {
                    // Take it off the list it waits on; it returns false and polls again.
                    for (auto& [a, mb] : c.mbars) {
                        auto& w = mb.wl.waiters;
                        w.erase(std::remove(w.begin(), w.end(), f), w.end());
                    }
                    make_runnable(f);
                }
                continue;
            }
            deadlock();
        }
        Fiber* next;
        if (last && last->runnable && u01(g_launch.rng) < g_launch.stay_p) {
            next = last;
        } else {
            next = c.runnable[g_launch.rng() % c.runnable.size()];
        }
        c.current = next;
        g_fiber = next;
        emu_ctx_switch(&c.sched_sp, next->sp);
        g_fiber = nullptr;
        last = next;
    }
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

// ------------------------------------------------------------------ fibers

void fiber_main(Fiber* f) {
    g_fiber = f;
    g_launch.entry(g_launch.arg);
    // Thread exit: nothing of its own may still be in flight.
    if (f->wg_issued != (f->group_end.empty() ? 0 : f->group_end.back()))
        fail("thread exits with %" PRIu64 " wgmma instructions never committed", f->wg_issued - (f->group_end.empty() ? 0 : f->group_end.back()));
    if (f->groups_retired != f->group_end.size())
        fail("thread exits with %zu wgmma groups never waited for (wgmma.wait_group)",
             f->group_end.size() - f->groups_retired);
    for (const CpCopy& c : g_cta->cp)
        if (c.tid == f->tid) fail("thread exits with cp.async copies in flight (no cp.async.wait_group)");
    if (g_cta->bars[0].arrived)
        fail("__syncthreads has %u of %u threads waiting while this thread exits (it can never complete)",
             g_cta->bars[0].arrived, g_cta->bars[0].expected);
    if (g_cta->track_stores) note_stores(*f);
    f->done = true;
    f->runnable = false;
    auto& r = g_cta->runnable;
    r.erase(std::remove(r.begin(), r.end(), f), r.end());
    ++g_cta->exited;
    ++g_cta->progress;
    emu_ctx_switch(&f->sp, g_cta->sched_sp);
    __builtin_unreachable();
}

unsigned char* stack_for(size_t i) {
    while (g_launch.stacks.size() <= i) {
        void* m = mmap(nullptr, kStackBytes + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) fail("mmap of a fiber stack failed");
        mprotect(m, 4096, PROT_NONE);  // guard page below the stack
        g_launch.stacks.push_back(static_cast<unsigned char*>(m) + 4096);
    }
    return g_launch.stacks[i];
}

void init_fiber(Fiber& f) {
    f.stack_lo = stack_for(f.tid);
    uintptr_t top = reinterpret_cast<uintptr_t>(f.stack_lo) + kStackBytes;
    top &= ~uintptr_t{15};
    uintptr_t* s = reinterpret_cast<uintptr_t*>(top);
    s[-1] = 0;
    s[-2] = 0;
    s[-3] = reinterpret_cast<uintptr_t>(&emu_ctx_trampoline);
    s[-4] = 0;                                          // rbp: end of the frame chain
    s[-5] = 0;                                          // rbx
    s[-6] = reinterpret_cast<uintptr_t>(&f);            // r12: argument
    s[-7] = reinterpret_cast<uintptr_t>(&fiber_main);   // r13: entry
    s[-8] = 0;                                          // r14
    s[-9] = 0;                                          // r15
    s[-10] = 0x1F80 | (uintptr_t{0x037F} << 32);        // MXCSR, x87 control word
    f.sp = &s[-10];
}

// ------------------------------------------------------------------ CTA-wide barriers

void hw_bar(unsigned id, unsigned count, bool wait, const char* what) {
    sched_point();
    Fiber& f = me();
    Cta& c = *g_cta;
    if (id >= 16) fail("%s: barrier id %u (0..15)", what, id);
    if (count == 0 || count % 32 || count > c.nthreads)
        fail("%s: thread count %u (a multiple of 32 up to the CTA's %u threads)", what, count, c.nthreads);
    HwBar& b = c.bars[id];
    if (b.expected == 0) {
        b.expected = count;
        std::fill(std::begin(b.warp_lanes), std::end(b.warp_lanes), 0u);
    } else if (b.expected != count) {
        fail("%s: barrier %u used with thread count %u while its current phase expects %u", what, id, count, b.expected);
    }
    if (f.bar_gen_arrived[id] == b.gen)
        fail("%s: thread arrives twice at barrier %u in one phase (%u of %u arrived)", what, id, b.arrived, b.expected);
    f.bar_gen_arrived[id] = b.gen;
    b.warp_lanes[f.warp] |= 1u << f.lane;
    join(b.acc, release(f));
    ++b.arrived;
    ++c.progress;
    const uint64_t gen = b.gen;
    if (b.arrived == b.expected) {
        for (unsigned w = 0; w < c.warps.size(); ++w)
            if (b.warp_lanes[w] != 0 && b.warp_lanes[w] != 0xFFFFFFFFu)
                fail("barrier %u completed with part of warp %u (lanes 0x%08x): bar.sync/bar.arrive are per warp", id, w,
                     b.warp_lanes[w]);
        b.arrived = 0;
        b.expected = 0;
        ++b.gen;
        b.done = std::move(b.acc);
        b.acc.clear();
        if (wait) join(f.vc, b.done);
        notify(b.wl);
        return;
    }
    if (!wait) return;
    while (b.gen == gen) block_on(b.wl, Wait::Bar, id, count);
    join(f.vc, b.done);
}

// ------------------------------------------------------------------ warp collectives

// Joins the lane's next collective of the warp; returns it once every lane has joined (the last
// arrival runs `compute`).
template <class Compute>
Coll& warp_collective(CollKind kind, uint32_t arg, Compute compute, const uint32_t* in, int n_in, const float* fin,
                      bool orders_memory = false) {
    sched_point();
    Fiber& f = me();
    WarpState& ws = g_cta->warps[f.warp];
    const uint64_t seq = f.wcoll++;
    while (ws.base + ws.colls.size() <= seq) ws.colls.emplace_back();
    Coll& c = ws.colls[seq - ws.base];
    if (c.arrived == 0) {
        c.kind = kind;
        c.arg = arg;
    } else if (c.kind != kind || c.arg != arg) {
        fail("warp %u: lane %u executes %s while other lanes execute %s at the same point (divergent warp "
             "collective)",
             f.warp, f.lane, coll_name(kind), coll_name(c.kind));
    }
    for (int i = 0; i < n_in; ++i) c.in[f.lane][i] = in[i];
    if (fin)
        for (int i = 0; i < 4; ++i) c.fin[f.lane][i] = fin[i];
    if (orders_memory) join(c.joined, release(f));
    if (++c.arrived == 32) {
        compute(c);
        c.done = true;
        notify(c.wl);
    } else {
        while (!c.done) block_on(c.wl, Wait::WarpColl, seq, c.arrived, static_cast<uint64_t>(kind));
    }
    if (orders_memory) join(f.vc, c.joined);
    return c;
}
void release_collective(Coll& c) {
    Fiber& f = me();
    WarpState& ws = g_cta->warps[f.warp];
    ++c.consumed;
    while (!ws.colls.empty() && ws.colls.front().consumed == 32) {
        ws.colls.pop_front();
        ++ws.base;
    }
}

void check_full_mask(unsigned mask, const char* what) {
    if (mask != 0xFFFFFFFFu) fail("%s with member mask 0x%08x: only full-warp masks are emulated", what, mask);
}

// ------------------------------------------------------------------ happens-before of async writes

uint32_t clock_at(const Clock& c, uint32_t e) { return e < c.size() ? c[e] : 0; }

uint32_t granule_of(uint32_t addr) { return (addr - smem_lo()) / 16; }

// Records an asynchronous write of [w.dst, w.dst + w.bytes), issued by the current thread, as
// the last writer of its granules; returns its id.
uint32_t record_async_write(AsyncWrite w) {
    Cta& c = *g_cta;
    if (g_fiber) {
        const std::vector<uintptr_t> pcs = fiber_frames(g_fiber);
        for (size_t i = 0; i < pcs.size() && i < w.pcs.size(); ++i) w.pcs[i] = pcs[i];
    }
    c.aw.push_back(w);
    const uint32_t id = static_cast<uint32_t>(c.aw.size());
    for (uint32_t g = granule_of(w.dst); g <= granule_of(w.dst + w.bytes - 1); ++g) c.gran[g] = id;
    return id;
}

// The write put its bytes into shared memory: remember them (bytes that ordinary stores replace
// later are no longer the write's).
void async_write_landed(uint32_t id) {
    Cta& c = *g_cta;
    AsyncWrite& w = c.aw[id - 1];
    w.landed = true;
    for (uint32_t g = granule_of(w.dst); g <= granule_of(w.dst + w.bytes - 1); ++g)
        if (c.gran[g] == id) std::memcpy(c.gran_bytes[g].data(), host_of(smem_lo() + 16 * g), 16);
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

[[noreturn]] void hb_violation(const Fiber& r, const AsyncWrite& w, uint32_t id, uint32_t addr, const char* what) {
    Cta& c = *g_cta;
    std::string wr, acq;
    if (w.tma) {
        auto it = c.mbars.find(w.bar);
        const bool done = it != c.mbars.end() && it->second.phase > w.phase;
        const uint32_t got = clock_at(r.vc, w.entry);
        wr = fmt("TMA copy #%u into shared [0x%x, 0x%x), issued by thread %u, completing (complete_tx) on the mbarrier "
                 "at shared 0x%x in its phase %" PRIu64 " (parity %" PRIu64 "), which %s",
                 id, w.dst, w.dst + w.bytes, w.tid, w.bar, w.phase, w.phase & 1,
                 done ? "has completed" : "has not completed yet");
        acq = fmt("mbarrier.try_wait.parity(%" PRIu64 ") on the mbarrier at shared 0x%x observing its phase %" PRIu64
                  " complete, by thread %u (or by a thread it synchronises with afterwards) before the read; thread %u "
                  "has %s",
                  w.phase & 1, w.bar, w.phase, r.tid, r.tid,
                  got == 0 ? std::string("acquired no phase of that mbarrier").c_str()
                           : fmt("acquired that mbarrier only up to its phase %u", got - 1).c_str());
    } else {
        wr = fmt("cp.async copy of thread %u (16 bytes into shared 0x%x, its commit group %" PRIu64 "), %s", w.tid, w.dst,
                 w.group,
                 w.complete ? "completed by that thread's cp.async.wait_group"
                            : "not yet covered by a cp.async.wait_group of that thread");
        if (r.tid == w.tid)
            acq = "this thread's own cp.async.wait_group covering the copy, before the read";
        else if (!w.complete)
            acq = fmt("cp.async.wait_group by thread %u covering the copy, then a barrier (or another release by thread "
                      "%u) that thread %u acquires, before the read",
                      w.tid, w.tid, r.tid);
        else
            acq = fmt("a barrier (or another release) by thread %u after its cp.async.wait_group, acquired by thread %u "
                      "before the read: thread %u has not synchronised with thread %u since that wait",
                      w.tid, r.tid, r.tid, w.tid);
    }
    std::vector<uintptr_t> pcs;
    for (uintptr_t pc : w.pcs)
        if (pc) pcs.push_back(pc);
    std::string wsrc = symbolize(pcs, 4);
    const bool other = &r != g_fiber;  // a lane of a warp-collective instruction completed by another lane
    fail("happens-before: %s by thread %u reads shared bytes [0x%x, 0x%x) whose asynchronous write is not ordered "
         "before the read\n  the write: %s\n    issued at:\n%s  the missing acquire: %s\n  the read%s:",
         what, r.tid, addr, addr + 16, wr.c_str(), wsrc.c_str(), acq.c_str(),
         other ? " (the warp-collective instruction, completed by its last lane)" : "");
}

// The happens-before check of a read of granule g by thread r (through `what`): the last
// asynchronous write into it must have completed and r must have acquired that completion.
// `ok` carries the last record found acquired (neighbouring granules mostly share one).
[[noreturn]] void hb_store_violation(const Fiber& r, unsigned t, uint32_t g, bool async_proxy, const char* what,
                                     const std::string& missing) {
    fail("happens-before: %s by thread %u reads shared bytes [0x%x, 0x%x) that ordinary stores of thread %u wrote, "
         "and the stores are not ordered before the read\n  the write: ordinary store(s) of thread %u (its store "
         "batch %u, before its release %u)\n  the missing acquire: %s%s\n  the read:",
         what, r.tid, smem_lo() + 16 * g, smem_lo() + 16 * g + 16, t, t, g_cta->st_seq[g], g_cta->st_epoch[g],
         missing.c_str(), async_proxy ? " (the async proxy reads them: a fence.proxy.async by the storing thread after the stores, then its release)" : "");
}

// The happens-before check of a read of granule g by thread r that ordinary stores wrote last:
// by the generic proxy (ldmatrix), a release of the storing thread after the stores acquired
// by r; by the async proxy (wgmma, UMMA), a fence.proxy.async of the storing thread after the
// stores, then a release of it after the fence acquired by r (or r itself fenced them).
void check_store_read(const Fiber& r, uint32_t g, bool async_proxy, const char* what) {
    Cta& c = *g_cta;
    const unsigned t = c.st_tid[g] - 1;
    const Fiber& w = c.fibers[t];
    if (!async_proxy) {
        if (t != r.tid && clock_at(r.vc, t) < c.st_epoch[g])
            hb_store_violation(r, t, g, false, what,
                               fmt("a barrier (or another release) by thread %u after the stores, acquired by thread %u", t, r.tid));
        return;
    }
    auto it = std::lower_bound(w.fences.begin(), w.fences.end(), std::make_pair(c.st_seq[g], 0u));
    if (it == w.fences.end())
        hb_store_violation(r, t, g, true, what, fmt("a fence.proxy.async by thread %u after its stores: it has none since", t));
    if (t != r.tid && clock_at(r.vc, t) < it->second)
        hb_store_violation(r, t, g, true, what,
                           fmt("a barrier (or another release) by thread %u after its fence.proxy.async, acquired by thread %u "
                               "before the read",
                               t, r.tid));
}

void check_async_read(const Fiber& r, uint32_t g, const char* what, uint32_t& ok, bool async_proxy) {
    Cta& c = *g_cta;
    if (c.track_stores && c.st_tid[g]) {
        check_store_read(r, g, async_proxy, what);
        return;
    }
    const uint32_t id = c.gran[g];
    if (id == 0 || id == ok) return;
    const AsyncWrite& w = c.aw[id - 1];
    if ((w.tma || w.complete) && clock_at(r.vc, w.entry) >= w.value) {
        ok = id;
        return;
    }
    if (w.landed && std::memcmp(host_of(smem_lo() + 16 * g), c.gran_bytes[g].data(), 16) != 0) {
        c.gran[g] = 0;  // replaced by ordinary stores since it landed
        return;
    }
    hb_violation(r, w, id, smem_lo() + 16 * g, what);
}

// Completes the current phase of an mbarrier: its waiters acquire the phase's arrivals (and the
// TMA issuers' clocks) and the barrier's own entry, phase + 1.
void complete_phase(Mbar& m) {
    Clock& d = m.done[m.phase & 1];
    d = std::move(m.acc);
    m.acc.clear();
    if (d.size() <= m.entry) d.resize(m.entry + 1, 0);
    d[m.entry] = std::max(d[m.entry], static_cast<uint32_t>(m.phase + 1));
    ++m.phase;
    m.pending = m.count;
    notify(m.wl);
}

// ------------------------------------------------------------------ ordinary stores

constexpr uintptr_t kPage = 4096;

// Write-protects the window's pages of the dynamic smem (a store then faults once per page:
// on_fault records the page and opens it).
void protect_window(bool on) {
    const size_t bytes = (g_launch.cfg.smem_bytes + kPage - 1) / kPage * kPage;
    if (bytes) mprotect(emu_shared_window, bytes, on ? PROT_READ : PROT_READ | PROT_WRITE);
}

// Copies the bytes the emulator itself wrote (async copies landing, mbarrier objects,
// tcgen05.alloc's address) into the shadow, so they are not taken for a thread's stores.
void shadow_sync(uint32_t addr, uint32_t n) {
    Cta& c = *g_cta;
    if (c.track_stores) std::memcpy(&c.shadow[addr - smem_lo()], host_of(addr), n);
}

// Starts tracking ordinary stores (at the launch's first use of the async proxy; from the
// start for every later CTA): what is in shared memory now is nobody's store.
void start_store_tracking() {
    Cta& c = *g_cta;
    g_launch.async_proxy_seen = true;
    if (c.track_stores) return;
    c.track_stores = true;
    c.shadow.assign(host_of(smem_lo()), host_of(smem_lo()) + g_launch.cfg.smem_bytes);
    c.st_tid.assign(c.gran.size(), 0);
    c.st_seq.assign(c.gran.size(), 0);
    c.st_epoch.assign(c.gran.size(), 0);
    c.dirty_pages.clear();
    protect_window(true);
}

// Thread f's store into granule g races with a wgmma that reads it unless f acquired every
// reading thread's retirement of that instruction (as for a TMA copy into its operands).
void check_store_over_wgmma(const Fiber& f, uint32_t g) {
    Cta& c = *g_cta;
    const uint32_t a = smem_lo() + 16 * g;
    for (WgState& s : c.wgs) {
        const unsigned w = static_cast<unsigned>(&s - c.wgs.data());
        for (const std::deque<WgmmaOp>* list : {&s.ops, &s.history})
            for (const WgmmaOp& op : *list) {
                if (!op.issued) continue;
                bool in_b = false, any = false;
                if (op.hi[1] > op.lo[1] && a < op.hi[1] && a + 16 > op.lo[1])
                    in_b = std::binary_search(op.gran_b.begin(), op.gran_b.end(), g);
                any = in_b;
                for (unsigned wq = 0; wq < 4 && !any; ++wq)
                    any = std::binary_search(op.gran_a[wq].begin(), op.gran_a[wq].end(), g);
                if (!any) continue;
                for (unsigned t = 0; t < 128; ++t) {
                    const bool reads = in_b || std::binary_search(op.gran_a[t / 32].begin(), op.gran_a[t / 32].end(), g);
                    const unsigned gt = 128 * w + t;
                    if (!reads || gt == f.tid) continue;
                    const bool issued_by_t = op.d.empty() ? true : op.d[t] != nullptr;
                    const uint32_t rt = op.retire_time.empty() ? 0 : op.retire_time[t];
                    if (!issued_by_t && rt == 0) continue;  // t has not issued it yet: its own issue check sees this store
                    if (rt == 0 || f.vc[gt] < rt)
                        fail("happens-before: an ordinary store of thread %u into shared bytes [0x%x, 0x%x) that wgmma #%" PRIu64
                             " of warpgroup %u reads for thread %u, which %s: the store races with the wgmma's read (the "
                             "missing acquire: a barrier after thread %u's wgmma.wait_group, before the store)",
                             f.tid, a, a + 16, op.seq, w, gt,
                             rt == 0 ? "has not retired it" : "retired it after the last release this thread acquired", gt);
                }
            }
    }
}

// Fiber f is switching out: the granules of the pages it wrote that differ from the shadow are
// its stores.
void note_stores(Fiber& f) {
    Cta& c = *g_cta;
    if (c.dirty_pages.empty()) return;
    const size_t n = c.shadow.size();
    const unsigned char* cur = host_of(smem_lo());
    bool any = false;
    for (uint32_t page : c.dirty_pages) {
        const size_t lo = page * kPage, hi = std::min(n, lo + kPage);
        for (size_t off = lo; off < hi; off += 16) {
            const size_t len = std::min<size_t>(16, hi - off);
            if (std::memcmp(cur + off, &c.shadow[off], len) == 0) continue;
            if (!any) {
                any = true;
                ++f.store_seq;
            }
            const uint32_t g = static_cast<uint32_t>(off / 16);
            check_store_over_wgmma(f, g);
            c.st_tid[g] = f.tid + 1;
            c.st_seq[g] = f.store_seq;
            c.st_epoch[g] = f.vc[f.tid];
            c.gran[g] = 0;  // no longer an asynchronous write's bytes
            std::memcpy(&c.shadow[off], cur + off, len);
        }
    }
    mprotect(emu_shared_window, (n + kPage - 1) / kPage * kPage, PROT_READ);
    c.dirty_pages.clear();
}

// ------------------------------------------------------------------ TMA

std::vector<unsigned char> copy_bytes(uint32_t addr, uint32_t n) {
    const unsigned char* p = host_of(addr);
    return std::vector<unsigned char>(p, p + n);
}

void land_tma(size_t i) {
    Cta& c = *g_cta;
    TmaCopy t = std::move(c.tma[i]);
    c.tma.erase(c.tma.begin() + static_cast<std::ptrdiff_t>(i));
    const TensorMapFields& m = t.map;
    const uint32_t esz = static_cast<uint32_t>(m.strides[0]);
    const uint32_t inner = m.box[0] * esz;
    // Someone wrote into the destination while the copy was in flight?
    if (copy_bytes(t.dst, t.bytes) != t.dst_before)
        fail("shared bytes [0x%x, 0x%x), the destination of a TMA copy in flight (issued by thread %u), were written "
             "before it landed",
             t.dst, t.dst + t.bytes, t.tid);
    // Landing on bytes an unretired wgmma reads?
    for (WgState& s : c.wgs)
        for (const WgmmaOp& op : s.ops)
            for (int k = 0; k < 2; ++k)
                if (op.issued && op.retired < 128 && op.hi[k] > op.lo[k] && overlaps(t.dst, t.dst + t.bytes, op.lo[k], op.hi[k]))
                    fail("TMA copy (issued by thread %u) lands on shared bytes [0x%x, 0x%x) that wgmma #%" PRIu64
                         " of warpgroup %u still reads (not yet retired by every thread's wgmma.wait_group: the "
                         "buffer was released too early)",
                         t.tid, std::max(t.dst, op.lo[k]), std::min(t.dst + t.bytes, op.hi[k]), op.seq,
                         static_cast<unsigned>(&s - c.wgs.data()));
    // The box, innermost dimension fastest, rows of `inner` bytes, swizzled by absolute address.
    uint32_t idx[5] = {0, 0, 0, 0, 0};
    const uint32_t rows = t.bytes / inner;
    for (uint32_t r = 0; r < rows; ++r) {
        // Row r -> box coordinates of dims 1..rank-1.
        uint32_t rest = r;
        for (uint32_t d = 1; d < m.rank; ++d) {
            idx[d] = rest % m.box[d];
            rest /= m.box[d];
        }
        bool row_oob = false;
        uint64_t goff = 0;
        for (uint32_t d = 1; d < m.rank; ++d) {
            const int64_t g = static_cast<int64_t>(t.coords[d]) + idx[d];
            if (g < 0 || g >= static_cast<int64_t>(m.dims[d])) row_oob = true;
            else goff += static_cast<uint64_t>(g) * m.strides[d];
        }
        for (uint32_t e = 0; e < m.box[0]; ++e) {
            const int64_t g0 = static_cast<int64_t>(t.coords[0]) + e;
            const bool oob = row_oob || g0 < 0 || g0 >= static_cast<int64_t>(m.dims[0]);
            const uint32_t linear = r * inner + e * esz;
            const uint32_t a = sm90::tma_smem_addr(t.dst, linear, m.swizzle);
            unsigned char* dst = host_of(a);
            if (oob) std::memset(dst, 0, esz);  // FLOAT_OOB_FILL_NONE: zeros
            else
                std::memcpy(dst, reinterpret_cast<const unsigned char*>(m.global_address) + goff +
                                     static_cast<uint64_t>(g0) * esz,
                            esz);
            std::memcpy(&c.async_view[a - smem_lo()], dst, esz);
        }
    }
    async_write_landed(t.aw);
    shadow_sync(t.dst, t.bytes);
    ++g_stats.tma_copies;
    // complete_tx on the mbarrier.
    auto it = c.mbars.find(t.bar);
    if (it == c.mbars.end()) fail("TMA copy completes on shared 0x%x, which is no longer an mbarrier", t.bar);
    Mbar& mb = it->second;
    if (mb.phase != t.issue_phase)
        fail("TMA copy of %u bytes issued by thread %u in phase %" PRIu64 " of the mbarrier at 0x%x completed in phase "
             "%" PRIu64 ": the phase completed before all its bytes landed (expect_tx smaller than the bytes copied?)",
             t.bytes, t.tid, t.issue_phase, t.bar, mb.phase);
    mb.tx -= t.bytes;
    join(mb.acc, t.vc);
    ++c.progress;
    if (mb.pending == 0 && mb.tx < 0)
        fail("mbarrier at 0x%x: a TMA copy completed %u bytes, more than the %" PRId64 " bytes the phase expects",
             t.bar, t.bytes, mb.tx + t.bytes);
    if (mb.pending == 0 && mb.tx == 0) complete_phase(mb);
}

// ------------------------------------------------------------------ cp.async

void land_cp(size_t i) {
    Cta& c = *g_cta;
    const CpCopy cp = c.cp[i];
    c.cp.erase(c.cp.begin() + static_cast<std::ptrdiff_t>(i));
    unsigned char* d = host_of(cp.dst);
    std::memset(d, 0, static_cast<size_t>(cp.size));  // src-size < cp-size zero-fills
    if (cp.src_bytes > 0) std::memcpy(d, cp.src, static_cast<size_t>(cp.src_bytes));
    async_write_landed(cp.aw);
    shadow_sync(cp.dst, static_cast<uint32_t>(cp.size));
    ++g_stats.cp_async_copies;
    ++c.progress;
}

void check_no_pending_writes(uint32_t lo, uint32_t hi, const char* reader) {
    for (const TmaCopy& t : g_cta->tma)
        if (overlaps(lo, hi, t.dst, t.dst + t.bytes))
            fail("%s reads shared bytes [0x%x, 0x%x) that a TMA copy in flight (issued by thread %u, completing on the "
                 "mbarrier at 0x%x) has not written yet: a missing or wrong mbarrier wait",
                 reader, std::max(lo, t.dst), std::min(hi, t.dst + t.bytes), t.tid, t.bar);
    for (const CpCopy& cp : g_cta->cp)
        if (overlaps(lo, hi, cp.dst, cp.dst + cp.size))
            fail("%s reads shared bytes [0x%x, 0x%x) that a cp.async copy of thread %u has not written yet: a missing "
                 "cp.async.wait_group or barrier",
                 reader, cp.dst, cp.dst + cp.size, cp.tid);
}

// ------------------------------------------------------------------ wgmma

constexpr uint32_t f2u(float x) {
    return __builtin_bit_cast(uint32_t, x);
}

void exec_wgmma(unsigned w) {
    Cta& c = *g_cta;
    WgState& s = c.wgs[w];
    WgmmaOp& op = s.ops[s.next_exec - s.base];
    const WgmmaInstr& in = op.ins;
    const uint32_t eb = elem_bytes(in.a_type);
    // Operand element -> shared address; record the byte ranges read.
    auto fetch = [&](int which, uint64_t desc, sm90::Major major, uint32_t mn, uint32_t k, Elem e) {
        const uint32_t a = sm90::operand_addr(desc, major, eb, mn, k);
        if (a < smem_lo() || a + eb > smem_hi())
            fail("wgmma #%" PRIu64 " of warpgroup %u: operand %c element (%s %u, k %u) at shared 0x%x is outside the "
                 "dynamic shared memory [0x%x, 0x%x) (descriptor 0x%016" PRIx64 ")",
                 op.seq, w, which ? 'B' : 'A', which ? "n" : "m", mn, k, a, smem_lo(), smem_hi(), desc);
        uint32_t bits = 0;
        std::memcpy(&bits, host_of(a), eb);
        uint32_t vbits = 0;
        std::memcpy(&vbits, &c.async_view[a - smem_lo()], eb);
        if (bits != vbits)
            fail("wgmma #%" PRIu64 " of warpgroup %u reads shared 0x%x, written by ordinary stores after the last "
                 "fence.proxy.async (the async proxy may not see it)",
                 op.seq, w, a);
        return elem_to_float(bits, e);
    };
    const int M = in.m, N = in.n, K = in.k;
    std::vector<float> A(static_cast<size_t>(M) * K), B(static_cast<size_t>(K) * N);
    if (in.a_from_regs) {
        for (unsigned t = 0; t < 128; ++t) {
            const uint32_t* regs = op.a_ptr[t];
            for (int r = 0; r < 4; ++r) {
                if (regs[r] != op.a_val[t][r])
                    fail("wgmma #%" PRIu64 " of warpgroup %u: thread %u changed A register %d (0x%08x -> 0x%08x) while "
                         "the instruction was in flight",
                         op.seq, w, t, r, op.a_val[t][r], regs[r]);
                const int per = eb == 2 ? 2 : 4;
                for (int h = 0; h < per; ++h) {
                    const sm90::RowCol rc = eb == 2 ? sm90::a_reg_coord16(static_cast<int>(t), r, h)
                                                    : sm90::a_reg_coord8(static_cast<int>(t), r, h);
                    A[static_cast<size_t>(rc.row) * K + rc.col] = reg_elem(regs[r], h, in.a_type);
                }
            }
        }
    } else {
        const sm90::Major ma = in.trans_a ? sm90::Major::MN : sm90::Major::K;
        for (int m = 0; m < M; ++m)
            for (int k = 0; k < K; ++k) A[static_cast<size_t>(m) * K + k] = fetch(0, in.desc_a, ma, m, k, in.a_type);
    }
    const sm90::Major mb = in.trans_b ? sm90::Major::MN : sm90::Major::K;
    for (int k = 0; k < K; ++k)
        for (int n = 0; n < N; ++n) B[static_cast<size_t>(k) * N + n] = fetch(1, in.desc_b, mb, n, k, in.b_type);
    for (int k = 0; k < 2; ++k) {
        if (op.hi[k] > op.lo[k]) {
            check_no_pending_writes(op.lo[k], op.hi[k], "wgmma");
            op.snap[k] = copy_bytes(op.lo[k], op.hi[k] - op.lo[k]);
        }
    }
    const double sa = in.scale_a, sb = in.scale_b;
    for (unsigned t = 0; t < 128; ++t)
        for (int i = 0; i < N / 2; ++i) {
            const sm90::RowCol rc = sm90::acc_coord(static_cast<int>(t), i);
            double acc = 0;
            for (int k = 0; k < K; ++k)
                acc += static_cast<double>(A[static_cast<size_t>(rc.row) * K + k]) * B[static_cast<size_t>(k) * N + rc.col];
            VReg* v = op.vr[t][static_cast<size_t>(i)];
            const double cin = in.scale_d ? static_cast<double>(v->value) : 0.0;
            v->value = static_cast<float>(cin + sa * sb * acc);
        }
    op.executed = true;
    ++s.next_exec;
    ++g_stats.wgmma_ops;
    ++c.progress;
}

// Retires this thread's instructions [f.ops_retired, end): results into its registers.
void wgmma_retire(Fiber& f, uint64_t end) {
    Cta& c = *g_cta;
    WgState& s = c.wgs[f.wg];
    for (auto it = f.vregs.begin(); it != f.vregs.end();) {
        if (it->second.last_op < end) {
            float* reg = const_cast<float*>(it->first);
            if (f2u(*reg) != kPoisonBits)
                fail("accumulator register at %p was written by the thread while wgmma #%" PRIu64
                     " was in flight (value %g); it may be touched only after wgmma.wait_group retires it",
                     static_cast<void*>(reg), it->second.last_op, static_cast<double>(*reg));
            *reg = it->second.value;
            it = f.vregs.erase(it);
        } else {
            ++it;
        }
    }
    for (uint64_t q = f.ops_retired; q < end; ++q) {
        WgmmaOp& op = s.ops[q - s.base];
        if (op.ins.a_from_regs)
            for (int r = 0; r < 4; ++r)
                if (op.a_ptr[f.tid % 128][r] != op.a_val[f.tid % 128][r])
                    fail("wgmma #%" PRIu64 ": A register %d was changed while the instruction was in flight (0x%08x -> "
                         "0x%08x)",
                         op.seq, r, op.a_val[f.tid % 128][r], op.a_ptr[f.tid % 128][r]);
        if (op.retire_time.empty()) op.retire_time.assign(128, 0);
        op.retire_time[f.tid % 128] = f.vc[f.tid];
        if (++op.retired == 128) {
            for (int k = 0; k < 2; ++k)
                if (op.hi[k] > op.lo[k] && copy_bytes(op.lo[k], op.hi[k] - op.lo[k]) != op.snap[k])
                    fail("shared bytes [0x%x, 0x%x) read by wgmma #%" PRIu64 " of warpgroup %u changed before every "
                         "thread of the warpgroup retired it (wgmma.wait_group): the buffer was overwritten too early",
                         op.lo[k], op.hi[k], op.seq, f.wg);
        }
    }
    f.ops_retired = end;
    while (!s.ops.empty() && s.ops.front().retired == 128 && s.ops.front().executed) {
        WgmmaOp& done = s.ops.front();
        done.d.clear();
        done.a_ptr.clear();
        done.a_val.clear();
        done.vr.clear();
        done.snap[0].clear();
        done.snap[1].clear();
        s.history.push_back(std::move(done));
        if (s.history.size() > 128) s.history.pop_front();
        s.ops.pop_front();
        ++s.base;
    }
}

// ------------------------------------------------------------------ TMA descriptors

constexpr uint64_t kMapMagic = 0x314D414D54554D45ull;  // "EMUTMAM1"

uint32_t dtype_bytes(uint32_t dt) {
    switch (dt) {
        case 0: return 1;   // UINT8
        case 1: return 2;   // UINT16
        case 2: return 4;   // UINT32
        case 3: return 4;   // INT32
        case 4: return 8;   // UINT64
        case 5: return 8;   // INT64
        case 6: return 2;   // FLOAT16
        case 7: return 4;   // FLOAT32
        case 8: return 8;   // FLOAT64
        case 9: return 2;   // BFLOAT16
        case 10: return 4;  // FLOAT32_FTZ
        case 11: return 4;  // TFLOAT32
        case 12: return 4;  // TFLOAT32_FTZ
        default: return 0;
    }
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

}  // namespace

// ================================================================== public API

void set_fault_describer(std::string (*describe)(uintptr_t)) { g_fault_describer = describe; }

const Dim3& thread_idx() { return me().tidx; }
const Dim3& block_idx() {
    if (!g_cta) fail("blockIdx outside a launch");
    return g_cta->block_idx;
}
const Dim3& block_dim() { return g_launch.cfg.block; }
const Dim3& grid_dim() { return g_launch.cfg.grid; }
unsigned dynamic_smem_bytes() { return g_launch.cfg.smem_bytes; }

uint32_t cvta_shared(const void* p) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    if (c < emu_shared_window || c >= emu_shared_window + kWindowBytes)
        fail("__cvta_generic_to_shared of %p, which is not a shared-memory address", p);
    return g_launch.win_base + static_cast<uint32_t>(c - emu_shared_window);
}

unsigned char* smem_ptr(uint32_t addr, uint32_t bytes, const char* what) {
    check_smem_range(addr, bytes, what);
    return host_of(addr);
}

void syncthreads() {
    if (g_cta && g_cta->exited)
        fail("__syncthreads after %u threads of the CTA exited", g_cta->exited);
    hw_bar(0, g_cta ? g_cta->nthreads : 0, true, "__syncthreads");
}
int syncthreads_or(int predicate) {
    if (!g_cta) fail("__syncthreads_or outside a launch");
    Fiber& f = me();
    const uint64_t n = f.or_calls++;
    if (predicate) g_cta->or_acc[n % 3] = 1;
    g_cta->or_acc[(n + 1) % 3] = 0;
    syncthreads();
    return g_cta->or_acc[n % 3];
}
void bar_sync(unsigned id, unsigned count) { hw_bar(id, count, true, "bar.sync"); }
void bar_arrive(unsigned id, unsigned count) { hw_bar(id, count, false, "bar.arrive"); }

void syncwarp(unsigned mask) {
    check_full_mask(mask, "__syncwarp");
    // Orders memory among the warp's lanes: every lane acquires every lane's release.
    Coll& c = warp_collective(CollKind::SyncWarp, 0, [](Coll&) {}, nullptr, 0, nullptr, true);
    release_collective(c);
}

uint32_t shfl_xor(unsigned mask, uint32_t v, int lane_mask, int width) {
    check_full_mask(mask, "__shfl_xor_sync");
    if (width != 32) fail("__shfl_xor_sync with width %d: only 32 is emulated", width);
    const uint32_t in[1] = {v};
    Coll& c = warp_collective(
        CollKind::Shfl, static_cast<uint32_t>(lane_mask),
        [&](Coll& k) {
            for (int l = 0; l < 32; ++l) k.out[l][0] = k.in[(l ^ lane_mask) & 31][0];
        },
        in, 1, nullptr);
    const uint32_t r = c.out[me().lane][0];
    release_collective(c);
    return r;
}

// Indexed shuffle: each lane reads the value of lane `src` (its own choice; several lanes may
// read the same source).
uint32_t shfl_idx(unsigned mask, uint32_t v, int src, int width) {
    check_full_mask(mask, "__shfl_sync");
    if (width != 32) fail("__shfl_sync with width %d: only 32 is emulated", width);
    const uint32_t in[2] = {v, static_cast<uint32_t>(src)};
    Coll& c = warp_collective(
        CollKind::ShflIdx, 0,
        [](Coll& k) {
            for (int l = 0; l < 32; ++l) k.out[l][0] = k.in[k.in[l][1] & 31][0];
        },
        in, 2, nullptr);
    const uint32_t r = c.out[me().lane][0];
    release_collective(c);
    return r;
}

bool elect_one() {
    Coll& c = warp_collective(
        CollKind::Elect, 0,
        [](Coll& k) {
            // The hardware picks one lane; the emulator picks a random one so that code relying on
            // lane 0 being elected shows up under some seed.
            const int pick = static_cast<int>(g_launch.rng() % 32);
            for (int l = 0; l < 32; ++l) k.out[l][0] = l == pick;
        },
        nullptr, 0, nullptr);
    const bool r = c.out[me().lane][0] != 0;
    release_collective(c);
    return r;
}

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

// ---- sm_80 ----

void cp_async(uint32_t dst, const void* src, int cp_size, int src_bytes) {
    sched_point();
    Fiber& f = me();
    if (dst % cp_size) fail("cp.async destination 0x%x not %d-byte aligned", dst, cp_size);
    if (src_bytes < 0 || src_bytes > cp_size) fail("cp.async src-size %d outside 0..%d", src_bytes, cp_size);
    check_smem_range(dst, static_cast<uint32_t>(cp_size), "cp.async destination");
    check_not_mbarrier(dst, dst + cp_size, "cp.async");
    AsyncWrite w;
    w.tid = f.tid;
    w.dst = dst;
    w.bytes = static_cast<uint32_t>(cp_size);
    w.group = f.cp_committed;
    w.entry = f.tid;
    const uint32_t id = record_async_write(w);
    f.cp_pending.emplace_back(f.cp_committed, id);
    g_cta->cp.push_back(CpCopy{f.tid, f.cp_committed, dst, src, cp_size, src_bytes, id, draw_land_p()});
}
void cp_async_commit() {
    sched_point();
    ++me().cp_committed;
}
void cp_async_wait(int n) {
    sched_point();
    Fiber& f = me();
    // Copies of groups older than the newest n committed groups land now (if they have not).
    const uint64_t limit = f.cp_committed >= static_cast<uint64_t>(n) ? f.cp_committed - n : 0;
    auto& v = g_cta->cp;
    for (size_t i = 0; i < v.size();) {
        if (v[i].tid == f.tid && v[i].group < limit) land_cp(i);
        else ++i;
    }
    // Their completion is this thread's event now: a reader must acquire it (this thread, or
    // through a release of this thread after the wait).
    auto& pend = f.cp_pending;
    for (auto& [group, id] : pend)
        if (group < limit) {
            AsyncWrite& w = g_cta->aw[id - 1];
            w.complete = true;
            w.value = f.vc[f.tid];
        }
    pend.erase(std::remove_if(pend.begin(), pend.end(), [&](const auto& e) { return e.first < limit; }), pend.end());
}

void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr, bool trans) {
    const uint32_t in[1] = {addr};
    Coll& c = warp_collective(
        trans ? CollKind::LdmatrixT : CollKind::Ldmatrix, 0,
        [&](Coll& k) {
            for (int l = 0; l < 32; ++l) {
                const uint32_t a = k.in[l][0];
                if (a % 16) fail("ldmatrix: lane %d's row address 0x%x is not 16-byte aligned", l, a);
                check_smem_range(a, 16, "ldmatrix row");
            }
            // Happens-before: each lane reads 4 bytes of up to 8 rows.
            const unsigned w0 = me().warp * 32;
            for (int l = 0; l < 32; ++l) {
                const Fiber& rd = g_cta->fibers[w0 + static_cast<unsigned>(l)];
                uint32_t ok = 0;
                for (int m = 0; m < 4; ++m)
                    for (int h = 0; h < 2; ++h) {
                        const sm80::RowCol rc = sm80::ldmatrix_coord(l, h, trans);
                        const uint32_t row = k.in[sm80::ldmatrix_row_lane(m, rc.row)][0];
                        check_async_read(rd, granule_of(row), trans ? "ldmatrix.x4.trans" : "ldmatrix.x4", ok, false);
                    }
            }
            for (int l = 0; l < 32; ++l) check_no_pending_writes(k.in[l][0], k.in[l][0] + 16, "ldmatrix");
            for (int l = 0; l < 32; ++l)
                for (int m = 0; m < 4; ++m) {
                    uint32_t reg = 0;
                    for (int h = 0; h < 2; ++h) {
                        const sm80::RowCol rc = sm80::ldmatrix_coord(l, h, trans);
                        const uint32_t row_addr = k.in[sm80::ldmatrix_row_lane(m, rc.row)][0];
                        uint16_t v;
                        std::memcpy(&v, host_of(row_addr + 2 * static_cast<uint32_t>(rc.col)), 2);
                        reg |= static_cast<uint32_t>(v) << (16 * h);
                    }
                    k.out[l][m] = reg;
                }
        },
        in, 1, nullptr);
    for (int m = 0; m < 4; ++m) r[m] = c.out[me().lane][m];
    release_collective(c);
}

void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, Elem e) {
    const uint32_t in[6] = {a[0], a[1], a[2], a[3], b0, b1};
    Coll& c = warp_collective(
        CollKind::Mma, static_cast<uint32_t>(e),
        [&](Coll& k) {
            float A[16][16], B[16][8];
            for (int l = 0; l < 32; ++l)
                for (int r = 0; r < 4; ++r)
                    for (int h = 0; h < 2; ++h) {
                        const sm80::RowCol rc = sm80::mma_a_coord(l, r, h);
                        A[rc.row][rc.col] = reg_elem(k.in[l][r], h, e);
                    }
            for (int l = 0; l < 32; ++l)
                for (int r = 0; r < 2; ++r)
                    for (int h = 0; h < 2; ++h) {
                        const sm80::RowCol rc = sm80::mma_b_coord(l, r, h);
                        B[rc.row][rc.col] = reg_elem(k.in[l][4 + r], h, e);
                    }
            for (int l = 0; l < 32; ++l)
                for (int i = 0; i < 4; ++i) {
                    const sm80::RowCol rc = sm80::mma_c_coord(l, i);
                    double acc = 0;
                    for (int kk = 0; kk < 16; ++kk) acc += static_cast<double>(A[rc.row][kk]) * B[kk][rc.col];
                    const float r = static_cast<float>(static_cast<double>(k.fin[l][i]) + acc);
                    std::memcpy(&k.out[l][i], &r, 4);
                }
        },
        in, 6, d);
    for (int i = 0; i < 4; ++i) std::memcpy(&d[i], &c.out[me().lane][i], 4);
    release_collective(c);
}

// ---- mbarrier ----

namespace {
Mbar& mbar_at(uint32_t bar, const char* what) {
    auto it = g_cta->mbars.find(bar);
    if (it == g_cta->mbars.end()) fail("%s on shared 0x%x, which is not an initialised mbarrier", what, bar);
    uint64_t now;
    std::memcpy(&now, host_of(bar), 8);
    if (now != it->second.canary)
        fail("%s: the mbarrier object at shared 0x%x was overwritten by an ordinary store", what, bar);
    return it->second;
}
void mbar_complete_if_done(Mbar& m) {
    if (m.pending == 0 && m.tx == 0) complete_phase(m);
}
void mbar_arrive_impl(uint32_t bar, uint32_t tx_bytes, const char* what) {
    sched_point();
    Mbar& m = mbar_at(bar, what);
    m.tx += tx_bytes;
    if (m.pending == 0)
        fail("%s: arrival underflow on the mbarrier at 0x%x: phase %" PRIu64 " already has all %u arrivals (it waits for "
             "%" PRId64 " tx bytes)",
             what, bar, m.phase, m.count, m.tx);
    --m.pending;
    join(m.acc, release(me()));
    ++g_cta->progress;
    mbar_complete_if_done(m);
}
}  // namespace

void mbar_init(uint32_t bar, uint32_t count) {
    sched_point();
    Fiber& f = me();
    if (bar % 8) fail("mbarrier.init at shared 0x%x: not 8-byte aligned", bar);
    check_smem_range(bar, 8, "mbarrier.init");
    if (count == 0 || count >= (1u << 20)) fail("mbarrier.init with count %u (1 .. 2^20 - 1)", count);
    if (g_cta->mbars.count(bar)) fail("mbarrier.init at shared 0x%x: already initialised (no mbarrier.inval)", bar);
    for (const TmaCopy& t : g_cta->tma)
        if (overlaps(bar, bar + 8, t.dst, t.dst + t.bytes)) fail("mbarrier.init inside the destination of a TMA copy in flight");
    Mbar& m = g_cta->mbars[bar];
    m.count = count;
    m.pending = count;
    m.init_tid = f.tid;
    m.entry = g_cta->next_entry++;
    m.canary = canary_for(bar);
    std::memcpy(host_of(bar), &m.canary, 8);
    shadow_sync(bar, 8);
    std::memcpy(&g_cta->async_view[bar - smem_lo()], &m.canary, 8);
}

void mbar_init_fence() {
    sched_point();
    for (auto& [a, m] : g_cta->mbars)
        if (m.init_tid == me().tid) m.fenced = true;
}

void mbar_arrive(uint32_t bar) { mbar_arrive_impl(bar, 0, "mbarrier.arrive"); }
void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    if (bytes >= (1u << 20)) fail("mbarrier.arrive.expect_tx of %u bytes (at most 2^20 - 1)", bytes);
    mbar_arrive_impl(bar, bytes, "mbarrier.arrive.expect_tx");
}

bool mbar_try_wait_parity(uint32_t bar, uint32_t parity) {
    sched_point();
    ++g_stats.mbar_waits;
    Mbar& m = mbar_at(bar, "mbarrier.try_wait.parity");
    if (parity > 1) fail("mbarrier.try_wait.parity with parity %u", parity);
    // Phase `parity` has completed iff the current (incomplete) phase has the other parity.
    if ((m.phase & 1) != parity) {
        join(me().vc, m.done[parity]);  // acquire the completed phase
        return true;
    }
    // Suspend until the phase changes; time out (return false) when nothing else can progress.
    const uint64_t phase = m.phase;
    block_on(m.wl, Wait::Mbar, bar, parity, 0, true);
    Mbar& m2 = mbar_at(bar, "mbarrier.try_wait.parity");
    if ((m2.phase & 1) == parity) return false;
    (void)phase;
    join(me().vc, m2.done[parity]);
    return true;
}

void fence_proxy_async() {
    sched_point();
    start_store_tracking();
    Fiber& f = me();
    f.fences.emplace_back(f.store_seq, f.vc[f.tid]);  // its stores so far are visible to the async proxy
    Cta& c = *g_cta;
    std::memcpy(c.async_view.data(), host_of(smem_lo()), c.async_view.size());
}

void tma_prefetch(const void* map) {
    sched_point();
    TensorMapFields f;
    if (!decode_tensor_map(map, &f)) fail("prefetch.tensormap of %p: not a tensor map encoded for this launch", map);
}

void tma_load(uint32_t dst, const void* map, uint32_t bar, const int32_t* coords, int rank) {
    sched_point();
    start_store_tracking();
    Fiber& f = me();
    TmaCopy t;
    if (!decode_tensor_map(map, &t.map)) fail("cp.async.bulk.tensor with %p: not a tensor map", map);
    if (static_cast<int>(t.map.rank) != rank)
        fail("cp.async.bulk.tensor.%dd with a rank-%u tensor map", rank, t.map.rank);
    if (dst % 128) fail("cp.async.bulk.tensor destination 0x%x is not 128-byte aligned", dst);
    uint32_t bytes = static_cast<uint32_t>(t.map.strides[0]);
    for (uint32_t d = 0; d < t.map.rank; ++d) bytes *= t.map.box[d];
    const uint32_t inner = t.map.box[0] * static_cast<uint32_t>(t.map.strides[0]);
    if (t.map.swizzle != 0 && inner != sm90::swizzle_width(sm90::tma_swizzle(t.map.swizzle)))
        fail("TMA box inner extent of %u bytes with a %u-byte swizzle: only boxes exactly one swizzle row wide are "
             "emulated",
             inner, sm90::swizzle_width(sm90::tma_swizzle(t.map.swizzle)));
    if (t.map.swizzle != 0 && dst % sm90::swizzle_repeat(sm90::tma_swizzle(t.map.swizzle)))
        fail("TMA destination 0x%x with a swizzled map is not aligned to the %u-byte swizzle pattern", dst,
             sm90::swizzle_repeat(sm90::tma_swizzle(t.map.swizzle)));
    check_smem_range(dst, bytes, "cp.async.bulk.tensor destination");
    check_not_mbarrier(dst, dst + bytes, "cp.async.bulk.tensor");
    Mbar& m = mbar_at(bar, "cp.async.bulk.tensor ... mbarrier::complete_tx");
    if (!m.fenced)
        fail("TMA completes on the mbarrier at 0x%x, whose initialisation was not followed by "
             "fence.mbarrier_init by the initialising thread",
             bar);
    for (const TmaCopy& o : g_cta->tma)
        if (overlaps(dst, dst + bytes, o.dst, o.dst + o.bytes))
            fail("two TMA copies in flight write the same shared bytes (0x%x and 0x%x)", dst, o.dst);
    tc_check_tma_dst(dst, dst + bytes);
    // The copy may land at once: the bytes must not be operands of a wgmma unless every thread of
    // its warpgroup retired it (wgmma.wait_group) *before* this copy, in happens-before order (a
    // buffer released before its readers waited fails here whatever the schedule).
    for (WgState& s : g_cta->wgs) {
        const unsigned w = static_cast<unsigned>(&s - g_cta->wgs.data());
        for (const std::deque<WgmmaOp>* list : {&s.ops, &s.history})
            for (const WgmmaOp& op : *list)
                for (int k = 0; k < 2; ++k) {
                    if (!op.issued || op.hi[k] <= op.lo[k] || !overlaps(dst, dst + bytes, op.lo[k], op.hi[k])) continue;
                    for (unsigned t = 0; t < 128; ++t) {
                        const unsigned gt = 128 * w + t;
                        const uint32_t rt = op.retire_time.empty() ? 0 : op.retire_time[t];
                        if (rt == 0 || f.vc[gt] < rt)
                            fail("TMA copy into shared bytes [0x%x, 0x%x) that wgmma #%" PRIu64 " of warpgroup %u reads, "
                                 "but thread %u %s: the buffer was released before its readers' wgmma.wait_group",
                                 std::max(dst, op.lo[k]), std::min(dst + bytes, op.hi[k]), op.seq, w, gt,
                                 rt == 0 ? "has not retired it yet" : "retired it after the release this copy waited for");
                    }
                }
    }
    AsyncWrite w;
    w.tma = true;
    w.tid = f.tid;
    w.dst = dst;
    w.bytes = bytes;
    w.bar = bar;
    w.phase = m.phase;
    w.entry = m.entry;
    w.value = static_cast<uint32_t>(m.phase + 1);
    t.aw = record_async_write(w);
    t.land_p = draw_land_p();
    t.vc = f.vc;
    t.id = g_launch.tma_ids++;
    t.tid = f.tid;
    t.dst = dst;
    t.bar = bar;
    t.bytes = bytes;
    t.issue_phase = m.phase;
    for (int i = 0; i < rank; ++i) t.coords[i] = coords[i];
    t.dst_before = copy_bytes(dst, bytes);
    g_cta->tma.push_back(std::move(t));
}

// ---- wgmma ----

void wgmma_fence() {
    sched_point();
    me().need_fence = false;
}

void wgmma_commit() {
    sched_point();
    Fiber& f = me();
    f.group_end.push_back(f.wg_issued);
}

void wgmma_issue(const WgmmaInstr& ins, float* d, const uint32_t* a_regs) {
    sched_point();
    start_store_tracking();
    Fiber& f = me();
    Cta& c = *g_cta;
    if (c.nthreads % 128) fail("wgmma in a CTA of %u threads (whole warpgroups only)", c.nthreads);
    if (f.need_fence)
        fail("wgmma.mma_async without a wgmma.fence since the start or the last wgmma.wait_group (registers written by "
             "ordinary instructions must be fenced before wgmma reads them)");
    if (ins.m != 64 || ins.n % 8 || ins.n < 8 || ins.n > 256 || ins.k * elem_bytes(ins.a_type) != 32)
        fail("wgmma shape m%dn%dk%d is not emulated", ins.m, ins.n, ins.k);
    if (!ins.a_from_regs) {
        if (const char* why = sm90::desc_problem(ins.desc_a)) fail("wgmma descriptor A 0x%016" PRIx64 ": %s", ins.desc_a, why);
    }
    if (const char* why = sm90::desc_problem(ins.desc_b)) fail("wgmma descriptor B 0x%016" PRIx64 ": %s", ins.desc_b, why);
    if ((ins.trans_a || ins.trans_b) && elem_bytes(ins.a_type) != 2)
        fail("wgmma with a transposed 8-bit operand (only 16-bit types may be MN-major)");
    WgState& s = c.wgs[f.wg];
    const uint64_t seq = f.wg_issued++;
    const uint64_t group = f.group_end.size();
    while (s.base + s.ops.size() <= seq) {
        s.ops.emplace_back();
        WgmmaOp& op = s.ops.back();
        op.seq = s.base + s.ops.size() - 1;
        op.d.assign(128, nullptr);
        op.a_ptr.assign(128, nullptr);
        op.a_val.assign(128, {0, 0, 0, 0});
        op.vr.assign(128, {});
    }
    WgmmaOp& op = s.ops[seq - s.base];
    const unsigned t = f.tid % 128;
    if (op.issued == 0) {
        op.ins = ins;
        op.group = group;
        op.first_tid = f.tid;
        // The shared bytes it will read, known from the descriptors at issue: from now until every
        // thread retired it, nothing may write them.
        const uint32_t eb = elem_bytes(ins.a_type);
        for (int which = ins.a_from_regs ? 1 : 0; which < 2; ++which) {
            const uint64_t desc = which ? ins.desc_b : ins.desc_a;
            const sm90::Major major = (which ? ins.trans_b : ins.trans_a) ? sm90::Major::MN : sm90::Major::K;
            const int mn = which ? ins.n : ins.m;
            uint32_t lo = UINT32_MAX, hi = 0;
            for (int i = 0; i < mn; ++i)
                for (int k = 0; k < ins.k; ++k) {
                    const uint32_t a = sm90::operand_addr(desc, major, eb, static_cast<uint32_t>(i), static_cast<uint32_t>(k));
                    lo = std::min(lo, a);
                    hi = std::max(hi, a + eb);
                    if (a < smem_lo() || a + eb > smem_hi()) continue;  // reported when it executes
                    (which ? op.gran_b : op.gran_a[i / 16]).push_back(granule_of(a));
                }
            op.lo[which] = lo;
            op.hi[which] = hi;
        }
        for (std::vector<uint32_t>* v : {&op.gran_a[0], &op.gran_a[1], &op.gran_a[2], &op.gran_a[3], &op.gran_b}) {
            std::sort(v->begin(), v->end());
            v->erase(std::unique(v->begin(), v->end()), v->end());
        }
        op.land_p = draw_land_p();
    } else {
        const WgmmaInstr& o = op.ins;
        if (o.m != ins.m || o.n != ins.n || o.k != ins.k || o.a_type != ins.a_type || o.b_type != ins.b_type ||
            o.a_from_regs != ins.a_from_regs || o.scale_d != ins.scale_d || o.scale_a != ins.scale_a ||
            o.scale_b != ins.scale_b || o.trans_a != ins.trans_a || o.trans_b != ins.trans_b)
            fail("wgmma #%" PRIu64 ": this thread issues a different instruction than thread %u did", seq, op.first_tid);
        if ((!ins.a_from_regs && o.desc_a != ins.desc_a) || o.desc_b != ins.desc_b)
            fail("wgmma #%" PRIu64 ": descriptors (A 0x%016" PRIx64 ", B 0x%016" PRIx64 ") differ from thread %u's (A 0x%016" PRIx64
                 ", B 0x%016" PRIx64 "): all 128 threads of a warpgroup must issue the same descriptors",
                 seq, ins.desc_a, ins.desc_b, op.first_tid, o.desc_a, o.desc_b);
        if (op.group != group)
            fail("wgmma #%" PRIu64 ": in commit group %" PRIu64 " for this thread but group %" PRIu64 " for thread %u", seq, group,
                 op.group, op.first_tid);
    }
    // Happens-before: the shared operands this thread's warp reads (A: its 16 rows; B) must be
    // acquired by the thread before it issues the instruction.
    uint32_t ok = 0;
    for (uint32_t g : op.gran_a[(f.tid / 32) % 4]) check_async_read(f, g, "wgmma.mma_async (operand A)", ok, true);
    for (uint32_t g : op.gran_b) check_async_read(f, g, "wgmma.mma_async (operand B)", ok, true);
    op.d[t] = d;
    if (ins.a_from_regs) {
        op.a_ptr[t] = a_regs;
        for (int r = 0; r < 4; ++r) op.a_val[t][r] = a_regs[r];
    }
    // Accumulator registers: captured (or chained from an instruction still in flight), then
    // poisoned until wait_group hands them back.
    auto& vr = op.vr[t];
    vr.resize(static_cast<size_t>(ins.n / 2));
    for (int i = 0; i < ins.n / 2; ++i) {
        float* reg = d + i;
        auto it = f.vregs.find(reg);
        if (it == f.vregs.end()) {
            it = f.vregs.emplace(reg, VReg{*reg, seq}).first;
            const float poison = __builtin_bit_cast(float, kPoisonBits);
            *reg = poison;
        } else {
            it->second.last_op = seq;
        }
        vr[static_cast<size_t>(i)] = &it->second;
    }
    ++op.issued;
    if (op.issued == 128) notify(s.wl);
}

void wgmma_wait(int n) {
    sched_point();
    Fiber& f = me();
    Cta& c = *g_cta;
    WgState& s = c.wgs[f.wg];
    f.need_fence = true;
    const uint64_t committed = f.group_end.size();
    if (committed <= f.groups_retired + static_cast<uint64_t>(n)) return;
    const uint64_t target_group = committed - static_cast<uint64_t>(n);  // retire groups [retired, target)
    const uint64_t end = f.group_end[target_group - 1];
    // Every instruction up to `end` must be issued by the whole warpgroup, then executed in order.
    while (s.next_exec < end) {
        if (wg_can_exec(f.wg)) {
            exec_wgmma(f.wg);
            continue;
        }
        const WgmmaOp& op = s.ops[s.next_exec - s.base];
        block_on(s.wl, Wait::WgmmaWait, op.seq, op.issued);
    }
    wgmma_retire(f, end);
    f.groups_retired = target_group;
}

void wgmma_check_regs(const float* d, int n) {
    Fiber& f = me();
    for (int i = 0; i < n; ++i) {
        auto it = f.vregs.find(d + i);
        if (it != f.vregs.end())
            fail("accumulator register %d of this array is read (fence_regs) while wgmma #%" PRIu64
                 " that writes it has not been retired by wgmma.wait_group",
                 i, it->second.last_op);
    }
}

void setmaxnreg(bool inc, int regs) {
    sched_point();
    Fiber& f = me();
    Cta& c = *g_cta;
    WgState& s = c.wgs[f.wg];
    const uint64_t seq = f.wgcoll++;
    while (s.coll_base + s.colls.size() <= seq) s.colls.emplace_back();
    WgColl& k = s.colls[seq - s.coll_base];
    if (k.arrived == 0) {
        k.inc = inc;
        k.regs = regs;
    } else if (k.inc != inc || k.regs != regs) {
        fail("setmaxnreg.%s %d in warpgroup %u, but other threads of the warpgroup execute setmaxnreg.%s %d: it must be "
             "warpgroup-uniform",
             inc ? "inc" : "dec", regs, f.wg, k.inc ? "inc" : "dec", k.regs);
    }
    if (++k.arrived == 128) {
        int64_t delta = 0;  // registers the warpgroup takes from the pool
        for (unsigned w = 4 * f.wg; w < 4 * f.wg + 4; ++w) {
            const int cur = c.warps[w].regs;
            if (inc && regs < cur) fail("setmaxnreg.inc %d below the warp's current %d registers", regs, cur);
            if (!inc && regs > cur) fail("setmaxnreg.dec %d above the warp's current %d registers", regs, cur);
            delta += static_cast<int64_t>(regs - cur) * 32;
        }
        while (c.reg_pool < delta) block_on(c.reg_wl, Wait::RegPool, f.wg, static_cast<uint64_t>(delta));
        c.reg_pool -= delta;
        for (unsigned w = 4 * f.wg; w < 4 * f.wg + 4; ++w) c.warps[w].regs = regs;
        if (delta < 0) notify(c.reg_wl);
        k.done = true;
        notify(k.wl);
    } else {
        while (!k.done) block_on(k.wl, Wait::WgColl, seq, k.arrived);
    }
    if (++k.consumed == 128) {
        while (!s.colls.empty() && s.colls.front().consumed == 128) {
            s.colls.pop_front();
            ++s.coll_base;
        }
    }
}

// ---- tensor maps ----

int encode_tensor_map_tiled(void* map, uint32_t data_type, uint32_t rank, const void* global_address,
                            const uint64_t* global_dim, const uint64_t* global_strides, const uint32_t* box_dim,
                            const uint32_t* element_strides, uint32_t interleave, uint32_t swizzle,
                            uint32_t l2_promotion, uint32_t oob_fill, std::string* why) {
    auto bad = [&](const std::string& s) {
        if (why) *why = s;
        return 1;  // CUDA_ERROR_INVALID_VALUE
    };
    if (reinterpret_cast<uintptr_t>(map) % 64) return bad("tensorMap not 64-byte aligned");
    const uint32_t esz = dtype_bytes(data_type);
    if (!esz) return bad("unknown tensorDataType " + std::to_string(data_type));
    if (rank < 1 || rank > 5) return bad("tensorRank " + std::to_string(rank) + " (1..5)");
    if (interleave > 2) return bad("interleave " + std::to_string(interleave));
    if (interleave != 0 && rank < 3) return bad("interleaved layouts need rank >= 3");
    if (interleave != 0) return bad("interleaved layouts are not emulated");
    if (swizzle > 3) return bad("swizzle " + std::to_string(swizzle) + " (0..3 are emulated)");
    if (l2_promotion > 3) return bad("l2Promotion " + std::to_string(l2_promotion));
    if (oob_fill > 1) return bad("oobFill " + std::to_string(oob_fill));
    if (oob_fill == 1 && !(data_type == 6 || data_type == 7 || data_type == 8 || data_type == 9 || data_type >= 10))
        return bad("NAN_REQUEST_ZERO_FMA fill needs a floating-point type");
    if (oob_fill == 1) return bad("NAN_REQUEST_ZERO_FMA fill is not emulated");
    if (reinterpret_cast<uintptr_t>(global_address) % 16) return bad("globalAddress not 16-byte aligned");
    for (uint32_t i = 0; i < rank; ++i) {
        if (global_dim[i] == 0 || global_dim[i] > (1ull << 32))
            return bad("globalDim[" + std::to_string(i) + "] = " + std::to_string(global_dim[i]) + " (1..2^32)");
        if (box_dim[i] == 0 || box_dim[i] > 256)
            return bad("boxDim[" + std::to_string(i) + "] = " + std::to_string(box_dim[i]) + " (1..256)");
        if (element_strides[i] == 0 || element_strides[i] > 8)
            return bad("elementStrides[" + std::to_string(i) + "] = " + std::to_string(element_strides[i]) + " (1..8)");
        if (element_strides[i] != 1) return bad("elementStrides other than 1 are not emulated");
    }
    for (uint32_t i = 0; i + 1 < rank; ++i)
        if (global_strides[i] % 16 || global_strides[i] >= (1ull << 40))
            return bad("globalStrides[" + std::to_string(i) + "] = " + std::to_string(global_strides[i]) +
                       " (a multiple of 16 below 2^40)");
    const uint32_t inner = box_dim[0] * esz;
    if (inner % 16) return bad("boxDim[0] * element size = " + std::to_string(inner) + " bytes, not a multiple of 16");
    if (swizzle != 0 && inner > sm90::swizzle_width(sm90::tma_swizzle(swizzle)))
        return bad("boxDim[0] * element size = " + std::to_string(inner) + " bytes exceeds the swizzle span");
    uint64_t w[16] = {};
    w[0] = kMapMagic;
    w[1] = reinterpret_cast<uint64_t>(global_address);
    for (uint32_t i = 0; i < rank; ++i) {
        w[2 + i] = global_dim[i];
        w[7 + i] = i == 0 ? esz : global_strides[i - 1];
    }
    for (uint32_t i = 0; i < rank; ++i) {
        w[12] |= static_cast<uint64_t>(box_dim[i] & 0x1FF) << (9 * i);
        w[13] |= static_cast<uint64_t>(element_strides[i] & 0xF) << (4 * i);
    }
    w[14] = data_type | (rank << 8) | (interleave << 12) | (swizzle << 16) | (l2_promotion << 20) | (uint64_t{oob_fill} << 24);
    w[15] = kMapMagic ^ w[1] ^ w[14];
    std::memcpy(map, w, sizeof w);
    return 0;
}

bool decode_tensor_map(const void* map, TensorMapFields* out) {
    uint64_t w[16];
    std::memcpy(w, map, sizeof w);
    if (w[0] != kMapMagic || w[15] != (kMapMagic ^ w[1] ^ w[14])) return false;
    TensorMapFields f{};
    f.global_address = w[1];
    f.data_type = w[14] & 0xFF;
    f.rank = (w[14] >> 8) & 0xF;
    f.interleave = (w[14] >> 12) & 0xF;
    f.swizzle = (w[14] >> 16) & 0xF;
    f.l2_promotion = (w[14] >> 20) & 0xF;
    f.oob_fill = (w[14] >> 24) & 0xF;
    for (uint32_t i = 0; i < f.rank && i < 5; ++i) {
        f.dims[i] = w[2 + i];
        f.strides[i] = w[7 + i];
        f.box[i] = (w[12] >> (9 * i)) & 0x1FF;
        f.elem_strides[i] = (w[13] >> (4 * i)) & 0xF;
    }
    *out = f;
    return true;
}

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

// The tcgen05 (sm_100a) model: tensor memory, UMMA, commit, tcgen05.ld/st.
#include "tcgen05.inc"

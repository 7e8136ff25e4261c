// The runtime's internal state and helpers, shared by its files (the map of the runtime and the
// list of its checks: ../runtime.h). Only the runtime's own files include this header.
#pragma once
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

namespace emu::rt {

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

inline const char* wait_name(Wait w) {
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
inline void join(Clock& into, const Clock& from) {
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
inline const char* coll_name(CollKind k) {
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
    // Loads through ld_shared_b32 since the last store into a granule: (thread, its clock entry
    // at the load), which that store's thread must have acquired.
    std::unordered_map<uint32_t, std::vector<std::pair<unsigned, uint32_t>>> loads;
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

extern Launch g_launch;
extern Stats g_stats;
extern constinit thread_local Cta* g_cta;
extern constinit thread_local Fiber* g_fiber;

// ---- scheduling (scheduler.cpp)

inline Fiber& me() {
    if (!g_fiber) fail("a device primitive was called outside a kernel launch");
    return *g_fiber;
}

// A release by the current thread: its clock, then its own entry advances (later events of the
// thread are not covered by this release).
inline Clock release(Fiber& f) {
    Clock c = f.vc;
    ++f.vc[f.tid];
    return c;
}

void make_runnable(Fiber* f);
void notify(WaitList& wl);
void to_scheduler();
// A scheduling point: the scheduler may run other fibers (and land async work) first.
inline void sched_point() { to_scheduler(); }

// Blocks the current fiber on `wl` until notified.
void block_on(WaitList& wl, Wait why, uint64_t obj, uint64_t a0 = 0, uint64_t a1 = 0, bool soft = false);
bool wg_can_exec(unsigned w);
double draw_land_p();
void schedule();
void init_fiber(Fiber& f);

// ---- diagnostics (diagnostics.cpp)

std::vector<uintptr_t> fiber_frames(const Fiber* f);
std::string symbolize(const std::vector<uintptr_t>& pcs, int max_lines);
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
void deadlock();
void install_fault_handler();

// ---- shared memory and its happens-before tracking (smem_tracking.cpp)

inline uint32_t smem_lo() { return g_launch.cfg.window_offset; }
inline uint32_t smem_hi() { return g_launch.cfg.window_offset + g_launch.cfg.smem_bytes; }

inline unsigned char* host_of(uint32_t addr) { return emu_shared_window + (addr - g_launch.win_base); }
inline bool overlaps(uint32_t a0, uint32_t a1, uint32_t b0, uint32_t b1) { return a0 < b1 && b0 < a1; }

void check_smem_range(uint32_t addr, uint32_t bytes, const char* what);
void check_not_mbarrier(uint32_t lo, uint32_t hi, const char* what);

inline uint32_t clock_at(const Clock& c, uint32_t e) { return e < c.size() ? c[e] : 0; }
inline uint32_t granule_of(uint32_t addr) { return (addr - smem_lo()) / 16; }
uint32_t record_async_write(AsyncWrite w);
void async_write_landed(uint32_t id);
void check_async_read(const Fiber& r, uint32_t g, const char* what, uint32_t& ok, bool async_proxy);

constexpr uintptr_t kPage = 4096;
void protect_window(bool on);
void shadow_sync(uint32_t addr, uint32_t n);
void start_store_tracking();
void note_stores(Fiber& f);

// ---- element types (operands of mma.sync, wgmma and UMMA)

inline float elem_to_float(uint32_t bits, Elem e) {
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
inline uint32_t elem_bytes(Elem e) { return (e == Elem::F16 || e == Elem::BF16) ? 2 : 1; }
inline float reg_elem(uint32_t reg, uint32_t idx, Elem e) {
    const uint32_t b = elem_bytes(e);
    const uint32_t bits = b == 2 ? (reg >> (16 * idx)) & 0xFFFF : (reg >> (8 * idx)) & 0xFF;
    return elem_to_float(bits, e);
}

// ---- warp collectives (sync.cpp; ldmatrix and mma.sync in mma.cpp use them too)

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
void release_collective(Coll& c);

// ---- mbarriers (mbarrier.cpp)

void complete_phase(Mbar& m);
Mbar& mbar_at(uint32_t bar, const char* what);
void mbar_complete_if_done(Mbar& m);

// ---- asynchronous copies (async_copy.cpp) and wgmma (wgmma.cpp)

std::vector<unsigned char> copy_bytes(uint32_t addr, uint32_t n);
// Lands TMA copy i (removes it from the in-flight list).
void land_tma(size_t i);
// Executes the oldest fully issued, unexecuted wgmma of warpgroup w.
void exec_wgmma(unsigned w);
void land_cp(size_t i);
void check_no_pending_writes(uint32_t lo, uint32_t hi, const char* reader);

// ---- tcgen05 (tcgen05.cpp): pieces of asynchronous work ready to fire, firing one, the per-CTA
// state, and the guard on TMA destinations that unexecuted MMAs read.

size_t tc_pending();
void tc_fire(size_t i);
void tc_cta_begin();
void tc_cta_end();
void tc_check_tma_dst(uint32_t lo, uint32_t hi);

}  // namespace emu::rt

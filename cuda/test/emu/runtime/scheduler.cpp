// The runtime's threads and scheduler: every CUDA thread a fiber on its own stack, switched by a
// seeded scheduler that also lands asynchronous work at random steps (../runtime.h has the map).
#include "state.h"

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

namespace emu::rt {

Launch g_launch;
Stats g_stats;
constinit thread_local Cta* g_cta = nullptr;
constinit thread_local Fiber* g_fiber = nullptr;

// ------------------------------------------------------------------ scheduling

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

void to_scheduler() {
    Fiber& f = *g_fiber;
    if (g_cta->track_stores) note_stores(f);
    ++g_stats.switches;
    emu_ctx_switch(&f.sp, g_cta->sched_sp);
}

// Blocks the current fiber on `wl` until notified.
void block_on(WaitList& wl, Wait why, uint64_t obj, uint64_t a0, uint64_t a1, bool soft) {
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

// ------------------------------------------------------------------ async work

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

}  // namespace emu::rt

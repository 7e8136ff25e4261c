// mbarriers: init, arrivals, expect_tx, phases and try_wait.parity (../runtime.h has the map).
#include "state.h"

namespace emu::rt {

uint64_t canary_for(uint32_t addr) { return 0x4D42415252494552ull ^ (static_cast<uint64_t>(addr) * 0x9E3779B97F4A7C15ull); }

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

}  // namespace emu::rt

namespace emu {
using namespace rt;

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

}  // namespace emu

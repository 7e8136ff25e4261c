// Shared memory: range checks, and the happens-before tracking of its writers (asynchronous
// copies and, once the async proxy is in use, ordinary stores seen through a write-protected
// window) that every read by ldmatrix, wgmma or UMMA is checked against (../runtime.h has the map).
#include "state.h"

namespace emu::rt {

// ------------------------------------------------------------------ shared memory

void check_smem_range(uint32_t addr, uint32_t bytes, const char* what) {
    if (addr < smem_lo() || addr + static_cast<uint64_t>(bytes) > smem_hi())
        fail("%s: shared bytes [0x%x, 0x%x) outside the dynamic shared memory [0x%x, 0x%x)", what, addr, addr + bytes,
             smem_lo(), smem_hi());
}

// The mbarrier objects' 8 bytes must not be touched by anything but mbarrier operations.
void check_not_mbarrier(uint32_t lo, uint32_t hi, const char* what) {
    for (auto& [addr, mb] : g_cta->mbars)
        if (overlaps(lo, hi, addr, addr + 8)) fail("%s writes over the mbarrier at shared 0x%x", what, addr);
}

// ------------------------------------------------------------------ happens-before of async writes

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

// ------------------------------------------------------------------ ordinary stores

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

// Thread f's store into granule g races with an earlier ld.shared of it by another thread unless
// f acquired a release of that thread after its load.
void check_store_over_loads(const Fiber& f, uint32_t g) {
    Cta& c = *g_cta;
    auto it = c.loads.find(g);
    if (it == c.loads.end()) return;
    for (const auto& [t, at] : it->second)
        if (t != f.tid && clock_at(f.vc, t) < at)
            fail("happens-before: an ordinary store of thread %u into shared bytes [0x%x, 0x%x) that thread %u loaded "
                 "(ld.shared) before, and the load is not ordered before the store (the missing acquire: a release by "
                 "thread %u after its load, acquired by thread %u before the store)",
                 f.tid, smem_lo() + 16 * g, smem_lo() + 16 * g + 16, t, t, f.tid);
    c.loads.erase(it);
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
            check_store_over_loads(f, g);
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

}  // namespace emu::rt

namespace emu {
using namespace rt;

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

uint32_t ld_shared_b32(uint32_t addr) {
    sched_point();
    if (addr % 4) fail("ld.shared.b32 of shared 0x%x, which is not 4-byte aligned", addr);
    check_smem_range(addr, 4, "ld.shared.b32");
    Fiber& r = me();
    const uint32_t g = granule_of(addr);
    uint32_t ok = 0;
    check_async_read(r, g, "ld.shared.b32", ok, false);
    auto& loads = g_cta->loads[g];
    const uint32_t at = r.vc[r.tid];
    auto mine = std::find_if(loads.begin(), loads.end(), [&](const auto& l) { return l.first == r.tid; });
    if (mine == loads.end())
        loads.emplace_back(r.tid, at);
    else
        mine->second = at;
    uint32_t v;
    std::memcpy(&v, host_of(addr), 4);
    return v;
}

void st_shared_v4(uint32_t addr, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
    sched_point();
    if (addr % 16) fail("st.shared.v4.b32 to shared 0x%x, which is not 16-byte aligned", addr);
    check_not_mbarrier(addr, addr + 16, "st.shared.v4.b32");
    const uint32_t v[4] = {x, y, z, w};
    std::memcpy(smem_ptr(addr, 16, "st.shared.v4.b32"), v, 16);  // an ordinary store (seen as one)
}

void fence_proxy_async() {
    sched_point();
    start_store_tracking();
    Fiber& f = me();
    f.fences.emplace_back(f.store_seq, f.vc[f.tid]);  // its stores so far are visible to the async proxy
    Cta& c = *g_cta;
    std::memcpy(c.async_view.data(), host_of(smem_lo()), c.async_view.size());
}

}  // namespace emu

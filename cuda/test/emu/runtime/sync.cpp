// CTA-wide barriers (__syncthreads, bar.sync/bar.arrive), warp collectives (__syncwarp, shuffles,
// elect.sync) and the warpgroup-collective setmaxnreg (../runtime.h has the map).
#include "state.h"

namespace emu::rt {

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

}  // namespace emu::rt

namespace emu {
using namespace rt;

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

}  // namespace emu

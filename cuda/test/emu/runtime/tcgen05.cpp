// The emulator's model of the sm_100a tcgen05 instructions the FA4 kernels use (it shares the
// runtime's CTA, fibers, scheduler, shared memory, mbarriers and checks through state.h).
// Layouts come only from sm100_layouts.h.
//
//  tensor memory  128 lanes x 512 columns of 32 bits per CTA, poisoned (NaN) at CTA start and at
//                 dealloc. tcgen05.alloc (warp-collective; ncols a power of 2 in 32..512) places
//                 the allocation at a seeded random free position (kernels must use the base it
//                 writes to shared memory), fails after relinquish_alloc_permit or when the
//                 columns are not free (it would block forever); dealloc must name an allocation
//                 exactly; every allocation must be freed before the CTA exits.
//  tcgen05.mma    kind::f16, cta_group::1, M = 128, A and B from UMMA shared-memory descriptors
//                 (A also from tensor memory), D in tensor memory; the descriptors and the
//                 instruction descriptor are decoded and checked (sm100_layouts.h) at issue. The
//                 CTA's MMAs execute in issue order at scheduler-chosen times; an operand is read
//                 at execution through the real descriptor bits and the swizzle of the absolute
//                 address, and must (a) equal the bytes it held at issue (not overwritten before the
//                 MMA's commit completed), (b) not still be a TMA/cp.async destination, (c) have
//                 been made visible to the async proxy (fence.proxy.async) if written by ordinary
//                 stores. A TMA copy issued into the operand bytes of an MMA that has not executed
//                 fails.
//  tcgen05.commit one arrival on the mbarrier once every earlier MMA of the issuing thread has
//                 executed (carrying the issuer's happens-before clock), at a scheduler-chosen time.
//  tcgen05.ld/st  .32x32b.xN: warp-collective (every lane of the warp executes the same instance,
//                 checked per instance and, for the lane count, at exit); the warp may address
//                 only its own lane quarter; the columns must be allocated. A load is read at issue and its registers hold a NaN poison until
//                 tcgen05.wait::ld (a register written in between fails); a store lands at
//                 tcgen05.wait::st. Loading columns an unexecuted MMA writes, storing columns an
//                 unexecuted MMA reads or writes, an MMA issued over stores not yet waited for, and
//                 loads/stores pending at exit all fail.
//  fences         tcgen05.fence::before/after_thread_sync are scheduling points (ordering is
//                 checked through the rules above, not through the fences themselves).
#include "state.h"
#include "sm100_layouts.h"

namespace emu::rt {
namespace {

constexpr uint32_t kTmemPoison = 0x7FBADBADu;  // a NaN
constexpr uint32_t kTmemLanes = 128, kTmemCols = 512;

struct TcAlloc {
    uint32_t col, ncols;
};
struct TcWarpOp {  // one warp-collective alloc / dealloc instance
    uint32_t dst, ncols;
};
struct UmmaOp {
    uint64_t seq = 0;
    unsigned tid = 0;
    uint32_t d = 0;
    bool a_tmem = false;
    uint64_t a = 0, b = 0;
    uint32_t idesc = 0;
    sm100::Idesc id{};
    bool accumulate = false;
    uint32_t lo[2] = {0, 0}, hi[2] = {0, 0};  // shared bytes read (A if from smem, B)
    std::vector<unsigned char> snap[2];
};
struct TcCommit {
    uint32_t bar;
    uint64_t upto;  // executes once this many MMAs of the CTA have executed
    unsigned tid;
    Clock vc;
};
struct TcLoad {
    uint32_t* dst;
    std::vector<uint32_t> vals;
};
struct TcStore {
    uint32_t lane, col;
    std::vector<uint32_t> vals;
};
struct TcWarpLdSt {  // one warp-collective tcgen05.ld / st instance
    bool store;
    uint32_t taddr;
    int n;
    unsigned lanes;
};
struct TcThread {
    uint64_t ldst = 0;  // tcgen05.ld/st executed (the lane's index into its warp's instances)
    std::vector<TcLoad> loads;
    std::vector<TcStore> stores;
    uint64_t issued_upto = 0;  // seq + 1 of the last MMA this thread issued
    uint64_t allocs = 0, deallocs = 0;
};
struct TcState {
    std::vector<uint32_t> tmem;
    std::vector<TcAlloc> allocs;
    bool relinquished = false;
    std::vector<std::vector<TcWarpOp>> warp_allocs, warp_deallocs;
    std::vector<std::vector<TcWarpLdSt>> warp_ldst;
    std::deque<UmmaOp> ops;  // issued, not executed
    uint64_t next_seq = 0, executed = 0;
    std::deque<TcCommit> commits;
    std::vector<TcThread> th;
};
TcState g_tc;

uint32_t& tmem_at(uint32_t lane, uint32_t col) { return g_tc.tmem[static_cast<size_t>(lane) * kTmemCols + col]; }

// The allocation holding columns [col, col + n), or fail.
void check_allocated(uint32_t col, uint32_t n, const char* what) {
    for (const TcAlloc& a : g_tc.allocs)
        if (col >= a.col && col + n <= a.col + a.ncols) return;
    fail("%s: tensor-memory columns [%u, %u) are not inside one allocation", what, col, col + n);
}

// Columns [lo, hi) of the TMEM an MMA writes (D) and reads (A from TMEM: [alo, ahi), else empty).
void umma_tmem_cols(const UmmaOp& op, uint32_t* dlo, uint32_t* dhi, uint32_t* alo, uint32_t* ahi) {
    *dlo = sm100::tmem_col(op.d);
    *dhi = *dlo + static_cast<uint32_t>(op.id.n);
    *alo = *ahi = 0;
    if (op.a_tmem) {
        *alo = sm100::tmem_col(static_cast<uint32_t>(op.a));
        *ahi = *alo + 8;  // K = 16 16-bit elements, two per column
    }
}

void tc_exec_front() {
    Cta& c = *g_cta;
    UmmaOp op = std::move(g_tc.ops.front());
    g_tc.ops.pop_front();
    const int M = op.id.m, N = op.id.n, K = 16;
    const Elem e = op.id.a_format == 1 ? Elem::BF16 : Elem::F16;
    for (int k = 0; k < 2; ++k) {
        if (op.hi[k] <= op.lo[k]) continue;
        check_no_pending_writes(op.lo[k], op.hi[k], "tcgen05.mma");
        if (copy_bytes(op.lo[k], op.hi[k] - op.lo[k]) != op.snap[k])
            fail("tcgen05.mma #%" PRIu64 " (issued by thread %u): its operand %c bytes [0x%x, 0x%x) changed between issue "
                 "and execution (overwritten before the MMA's tcgen05.commit completed)",
                 op.seq, op.tid, k ? 'B' : 'A', op.lo[k], op.hi[k]);
    }
    auto fetch = [&](int which, uint64_t desc, sm90::Major major, uint32_t mn, uint32_t kk) {
        const uint32_t a = sm100::operand_addr(desc, major, 2, mn, kk);
        uint32_t bits = 0, vbits = 0;
        std::memcpy(&bits, host_of(a), 2);
        std::memcpy(&vbits, &c.async_view[a - smem_lo()], 2);
        if (bits != vbits)
            fail("tcgen05.mma #%" PRIu64 " reads shared 0x%x (operand %c), written by ordinary stores after the last "
                 "fence.proxy.async (the async proxy may not see it)",
                 op.seq, a, which ? 'B' : 'A');
        return elem_to_float(bits, e);
    };
    uint32_t dlo, dhi, alo, ahi;
    umma_tmem_cols(op, &dlo, &dhi, &alo, &ahi);
    for (const TcThread& t : g_tc.th)
        for (const TcStore& s : t.stores)
            if (overlaps(s.col, s.col + static_cast<uint32_t>(s.vals.size()), dlo, dhi) ||
                (ahi > alo && overlaps(s.col, s.col + static_cast<uint32_t>(s.vals.size()), alo, ahi)))
                fail("tcgen05.mma #%" PRIu64 " executes over tensor-memory columns [%u, %zu) that a tcgen05.st of thread %u "
                     "has not completed (tcgen05.wait::st, fence::before_thread_sync and a barrier before the issue)",
                     op.seq, s.col, s.col + s.vals.size(), static_cast<unsigned>(&t - g_tc.th.data()));
    std::vector<float> A(static_cast<size_t>(M) * K), B(static_cast<size_t>(N) * K);
    for (int m = 0; m < M; ++m)
        for (int k = 0; k < K; ++k) {
            if (op.a_tmem) {
                const sm100::LaneCol lc = sm100::a_tmem_lane_col(static_cast<uint32_t>(op.a), m, k);
                const uint32_t w = tmem_at(lc.lane, lc.col);
                A[static_cast<size_t>(m) * K + k] = reg_elem(w, static_cast<uint32_t>(k % 2), e);
            } else {
                A[static_cast<size_t>(m) * K + k] =
                    fetch(0, op.a, op.id.a_major ? sm90::Major::MN : sm90::Major::K, static_cast<uint32_t>(m),
                          static_cast<uint32_t>(k));
            }
        }
    for (int n = 0; n < N; ++n)
        for (int k = 0; k < K; ++k)
            B[static_cast<size_t>(n) * K + k] = fetch(1, op.b, op.id.b_major ? sm90::Major::MN : sm90::Major::K,
                                                      static_cast<uint32_t>(n), static_cast<uint32_t>(k));
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
            double acc = 0;
            for (int k = 0; k < K; ++k)
                acc += static_cast<double>(A[static_cast<size_t>(m) * K + k]) * B[static_cast<size_t>(n) * K + k];
            const sm100::LaneCol lc = sm100::acc_lane_col(op.d, m, n);
            uint32_t& w = tmem_at(lc.lane, lc.col);
            const double cin = op.accumulate ? static_cast<double>(__builtin_bit_cast(float, w)) : 0.0;
            w = __builtin_bit_cast(uint32_t, static_cast<float>(cin + acc));
        }
    ++g_tc.executed;
    ++g_stats.wgmma_ops;
    ++c.progress;
}

bool tc_commit_ready() { return !g_tc.commits.empty() && g_tc.commits.front().upto <= g_tc.executed; }

void tc_fire_commit() {
    TcCommit cm = std::move(g_tc.commits.front());
    g_tc.commits.pop_front();
    Mbar& m = mbar_at(cm.bar, "tcgen05.commit's arrival");
    if (m.pending == 0)
        fail("tcgen05.commit (thread %u): arrival underflow on the mbarrier at 0x%x: phase %" PRIu64
             " already has all %u arrivals",
             cm.tid, cm.bar, m.phase, m.count);
    --m.pending;
    join(m.acc, cm.vc);
    ++g_cta->progress;
    mbar_complete_if_done(m);
}

}  // namespace

// ---- the hooks the scheduler and launch call ----

size_t tc_pending() { return (g_tc.ops.empty() ? 0 : 1) + (tc_commit_ready() ? 1 : 0); }

void tc_fire(size_t i) {
    if (i == 0 && !g_tc.ops.empty()) tc_exec_front();
    else tc_fire_commit();
}

void tc_cta_begin() {
    g_tc = TcState{};
    g_tc.tmem.assign(static_cast<size_t>(kTmemLanes) * kTmemCols, kTmemPoison);
    g_tc.th.resize(g_cta->nthreads);
    g_tc.warp_allocs.resize(g_cta->nthreads / 32);
    g_tc.warp_deallocs.resize(g_cta->nthreads / 32);
    g_tc.warp_ldst.resize(g_cta->nthreads / 32);
}

void tc_cta_end() {
    if (!g_tc.allocs.empty())
        fail("%zu tensor-memory allocation(s) (first at column %u, %u columns) not freed by tcgen05.dealloc at exit",
             g_tc.allocs.size(), g_tc.allocs[0].col, g_tc.allocs[0].ncols);
    if (!g_tc.ops.empty())
        fail("%zu tcgen05.mma instruction(s) still in flight at exit (never waited for through a commit)", g_tc.ops.size());
    if (!g_tc.commits.empty()) fail("%zu tcgen05.commit arrival(s) pending at exit", g_tc.commits.size());
    for (size_t w = 0; w < g_tc.warp_ldst.size(); ++w)
        for (size_t k = 0; k < g_tc.warp_ldst[w].size(); ++k)
            if (g_tc.warp_ldst[w][k].lanes != 32)
                fail("tcgen05.%s #%zu of warp %zu was executed by %u of its 32 lanes: it is .sync.aligned (every lane "
                     "of the warp must execute it, e.g. no early return of rows past the end)",
                     g_tc.warp_ldst[w][k].store ? "st" : "ld", k, w, g_tc.warp_ldst[w][k].lanes);
    for (size_t t = 0; t < g_tc.th.size(); ++t) {
        if (!g_tc.th[t].loads.empty()) fail("thread %zu: tcgen05.ld without tcgen05.wait::ld at exit", t);
        if (!g_tc.th[t].stores.empty()) fail("thread %zu: tcgen05.st without tcgen05.wait::st at exit", t);
    }
}

void tc_check_tma_dst(uint32_t lo, uint32_t hi) {
    for (const UmmaOp& op : g_tc.ops)
        for (int k = 0; k < 2; ++k)
            if (op.hi[k] > op.lo[k] && overlaps(lo, hi, op.lo[k], op.hi[k]))
                fail("TMA copy into shared bytes [0x%x, 0x%x) that tcgen05.mma #%" PRIu64
                     " (issued by thread %u, not yet executed) reads: the buffer was released before the MMA's commit "
                     "completed",
                     std::max(lo, op.lo[k]), std::min(hi, op.hi[k]), op.seq, op.tid);
}

namespace {

// The k-th warp-collective op of this lane in `list`: the first lane creates it (returns true).
bool warp_op(std::vector<std::vector<TcWarpOp>>& list, uint64_t k, uint32_t dst, uint32_t ncols, const char* what) {
    Fiber& f = me();
    auto& v = list[f.warp];
    if (k == v.size()) {
        v.push_back(TcWarpOp{dst, ncols});
        return true;
    }
    if (k > v.size()) fail("%s: lane %u runs ahead of its warp's earlier %s", what, f.lane, what);
    if (v[k].dst != dst || v[k].ncols != ncols)
        fail("%s: lanes of warp %u pass different operands (0x%x, %u vs 0x%x, %u): it is .sync.aligned", what, f.warp,
             dst, ncols, v[k].dst, v[k].ncols);
    return false;
}

// The lane's next tcgen05.ld/st joins its warp's instance of the same index: same kind, address
// and shape in every lane (.sync.aligned); the lane count is checked at exit.
void join_warp_ldst(bool store, uint32_t taddr, int n) {
    const Fiber& f = me();
    auto& v = g_tc.warp_ldst[f.warp];
    const uint64_t k = g_tc.th[f.tid].ldst++;
    if (k == v.size()) v.push_back(TcWarpLdSt{store, taddr, n, 0});
    TcWarpLdSt& x = v[k];
    if (x.store != store || x.taddr != taddr || x.n != n)
        fail("divergent tcgen05.ld/st in warp %u: lane %u executes tcgen05.%s .x%d at 0x%x where other lanes executed "
             "tcgen05.%s .x%d at 0x%x (.sync.aligned: the warp must execute the same instruction)",
             f.warp, f.lane, store ? "st" : "ld", n, taddr, x.store ? "st" : "ld", x.n, x.taddr);
    ++x.lanes;
}

void check_lane_quarter(uint32_t taddr, const char* what) {
    const Fiber& f = me();
    if (sm100::tmem_lane(taddr) != 32 * (f.warp % 4))
        fail("%s with lane %u in the address: warp %u (warp %% 4 = %u) may only access lanes %u..%u, and the address "
             "names the warp's first lane",
             what, sm100::tmem_lane(taddr), f.warp, f.warp % 4, 32 * (f.warp % 4), 32 * (f.warp % 4) + 31);
}

}  // namespace
}  // namespace emu::rt

// ================================================================== public API

namespace emu {
using namespace rt;

void tmem_alloc(uint32_t dst, uint32_t ncols) {
    sched_point();
    Fiber& f = me();
    const uint64_t k = g_tc.th[f.tid].allocs++;
    if (!warp_op(g_tc.warp_allocs, k, dst, ncols, "tcgen05.alloc")) return;
    if (ncols < 32 || ncols > kTmemCols || (ncols & (ncols - 1)))
        fail("tcgen05.alloc of %u columns (a power of 2 in 32..512)", ncols);
    if (g_tc.relinquished) fail("tcgen05.alloc after tcgen05.relinquish_alloc_permit");
    if (dst % 4) fail("tcgen05.alloc destination 0x%x is not 4-byte aligned", dst);
    check_smem_range(dst, 4, "tcgen05.alloc destination");
    check_not_mbarrier(dst, dst + 4, "tcgen05.alloc");
    std::vector<uint32_t> free_starts;
    for (uint32_t s = 0; s + ncols <= kTmemCols; s += ncols) {
        bool ok = true;
        for (const TcAlloc& a : g_tc.allocs)
            if (overlaps(s, s + ncols, a.col, a.col + a.ncols)) ok = false;
        if (ok) free_starts.push_back(s);
    }
    if (free_starts.empty())
        fail("tcgen05.alloc of %u columns: no free aligned range (it would block until another CTA frees some)", ncols);
    const uint32_t col = free_starts[g_launch.rng() % free_starts.size()];
    g_tc.allocs.push_back(TcAlloc{col, ncols});
    const uint32_t addr = col;  // lane 0
    std::memcpy(host_of(dst), &addr, 4);
    shadow_sync(dst, 4);
    std::memcpy(&g_cta->async_view[dst - smem_lo()], &addr, 4);
}

void tmem_relinquish() {
    sched_point();
    g_tc.relinquished = true;
}

void tmem_dealloc(uint32_t taddr, uint32_t ncols) {
    sched_point();
    Fiber& f = me();
    const uint64_t k = g_tc.th[f.tid].deallocs++;
    if (!warp_op(g_tc.warp_deallocs, k, taddr, ncols, "tcgen05.dealloc")) return;
    const uint32_t col = sm100::tmem_col(taddr);
    auto it = std::find_if(g_tc.allocs.begin(), g_tc.allocs.end(),
                           [&](const TcAlloc& a) { return a.col == col && a.ncols == ncols; });
    if (sm100::tmem_lane(taddr) != 0 || it == g_tc.allocs.end())
        fail("tcgen05.dealloc of address 0x%x, %u columns: not an allocation", taddr, ncols);
    for (const UmmaOp& op : g_tc.ops) {
        uint32_t dlo, dhi, alo, ahi;
        umma_tmem_cols(op, &dlo, &dhi, &alo, &ahi);
        if (overlaps(col, col + ncols, dlo, dhi) || (ahi > alo && overlaps(col, col + ncols, alo, ahi)))
            fail("tcgen05.dealloc of columns [%u, %u) that tcgen05.mma #%" PRIu64 " (in flight) uses", col, col + ncols,
                 op.seq);
    }
    for (size_t t = 0; t < g_tc.th.size(); ++t)
        if (!g_tc.th[t].loads.empty() || !g_tc.th[t].stores.empty())
            fail("tcgen05.dealloc while thread %zu has a tcgen05.ld/st not yet waited for", t);
    for (uint32_t l = 0; l < kTmemLanes; ++l)
        for (uint32_t cc = col; cc < col + ncols; ++cc) tmem_at(l, cc) = kTmemPoison;
    g_tc.allocs.erase(it);
}

void umma_issue(uint32_t d_tmem, bool a_tmem, uint64_t a, uint64_t b_desc, uint32_t idesc, uint32_t accumulate) {
    sched_point();
    start_store_tracking();
    Fiber& f = me();
    if (const char* why = sm100::idesc_problem(idesc, a_tmem))
        fail("tcgen05.mma instruction descriptor 0x%08x: %s", idesc, why);
    UmmaOp op;
    op.seq = g_tc.next_seq++;
    op.tid = f.tid;
    op.d = d_tmem;
    op.a_tmem = a_tmem;
    op.a = a;
    op.b = b_desc;
    op.idesc = idesc;
    op.id = sm100::decode_idesc(idesc);
    op.accumulate = accumulate != 0;
    if (sm100::tmem_lane(d_tmem) != 0) fail("tcgen05.mma with M = 128: D at lane %u, not 0", sm100::tmem_lane(d_tmem));
    check_allocated(sm100::tmem_col(d_tmem), static_cast<uint32_t>(op.id.n), "tcgen05.mma D");
    if (a_tmem) {
        if (sm100::tmem_lane(static_cast<uint32_t>(a)) != 0) fail("tcgen05.mma: A in tensor memory at a lane other than 0");
        check_allocated(sm100::tmem_col(static_cast<uint32_t>(a)), 8, "tcgen05.mma A (tensor memory)");
    } else if (const char* why = sm100::umma_desc_problem(a)) {
        fail("tcgen05.mma descriptor A 0x%016" PRIx64 ": %s", a, why);
    }
    if (const char* why = sm100::umma_desc_problem(b_desc)) fail("tcgen05.mma descriptor B 0x%016" PRIx64 ": %s", b_desc, why);
    for (int which = a_tmem ? 1 : 0; which < 2; ++which) {
        const uint64_t desc = which ? b_desc : a;
        const sm90::Major major = (which ? op.id.b_major : op.id.a_major) ? sm90::Major::MN : sm90::Major::K;
        const int mn = which ? op.id.n : op.id.m;
        uint32_t lo = UINT32_MAX, hi = 0, ok = 0;
        for (int i = 0; i < mn; ++i)
            for (int k = 0; k < 16; ++k) {
                const uint32_t ad = sm100::operand_addr(desc, major, 2, static_cast<uint32_t>(i), static_cast<uint32_t>(k));
                lo = std::min(lo, ad);
                hi = std::max(hi, ad + 2);
                // Happens-before: the issuing thread must have acquired the asynchronous writes.
                if (ad >= smem_lo() && ad + 2 <= smem_hi())
                    check_async_read(f, granule_of(ad), which ? "tcgen05.mma (operand B)" : "tcgen05.mma (operand A)", ok, true);
            }
        if (lo < smem_lo() || hi > smem_hi())
            fail("tcgen05.mma #%" PRIu64 ": operand %c spans shared [0x%x, 0x%x), outside the dynamic shared memory "
                 "[0x%x, 0x%x) (descriptor 0x%016" PRIx64 ")",
                 op.seq, which ? 'B' : 'A', lo, hi, smem_lo(), smem_hi(), desc);
        op.lo[which] = lo;
        op.hi[which] = hi;
        op.snap[which] = copy_bytes(lo, hi - lo);
    }
    uint32_t dlo, dhi, alo, ahi;
    umma_tmem_cols(op, &dlo, &dhi, &alo, &ahi);
    for (const TcThread& t : g_tc.th)
        for (const TcStore& s : t.stores)
            if (overlaps(s.col, s.col + static_cast<uint32_t>(s.vals.size()), dlo, dhi) ||
                (ahi > alo && overlaps(s.col, s.col + static_cast<uint32_t>(s.vals.size()), alo, ahi)))
                fail("tcgen05.mma #%" PRIu64 " issued over tensor-memory columns [%u, %zu) that a tcgen05.st of thread %u "
                     "has not completed (missing tcgen05.wait::st / fence / barrier before the issue)",
                     op.seq, s.col, s.col + s.vals.size(), static_cast<unsigned>(&t - g_tc.th.data()));
    g_tc.th[f.tid].issued_upto = op.seq + 1;
    g_tc.ops.push_back(std::move(op));
}

void umma_commit(uint32_t bar) {
    sched_point();
    Fiber& f = me();
    Mbar& m = mbar_at(bar, "tcgen05.commit");
    if (!m.fenced)
        fail("tcgen05.commit arrives on the mbarrier at 0x%x, whose initialisation was not followed by "
             "fence.mbarrier_init by the initialising thread",
             bar);
    g_tc.commits.push_back(TcCommit{bar, g_tc.th[f.tid].issued_upto, f.tid, release(f)});
}

void tmem_ld(uint32_t taddr, uint32_t* r, int n) {
    sched_point();
    Fiber& f = me();
    check_lane_quarter(taddr, "tcgen05.ld");
    join_warp_ldst(false, taddr, n);
    const uint32_t col = sm100::tmem_col(taddr);
    check_allocated(col, static_cast<uint32_t>(n), "tcgen05.ld");
    for (const UmmaOp& op : g_tc.ops) {
        uint32_t dlo, dhi, alo, ahi;
        umma_tmem_cols(op, &dlo, &dhi, &alo, &ahi);
        if (overlaps(col, col + static_cast<uint32_t>(n), dlo, dhi))
            fail("tcgen05.ld of tensor-memory columns [%u, %u) that tcgen05.mma #%" PRIu64 " (issued by thread %u) has not "
                 "written yet: wait for its tcgen05.commit's mbarrier (and fence::after_thread_sync) first",
                 col, col + n, op.seq, op.tid);
    }
    TcLoad ld;
    ld.dst = r;
    for (int i = 0; i < n; ++i) {
        const sm100::LaneCol lc = sm100::ld32x32b_lane_col(taddr, static_cast<int>(f.warp), static_cast<int>(f.lane), i);
        for (size_t t = 0; t < g_tc.th.size(); ++t)
            for (const TcStore& s : g_tc.th[t].stores)
                if (s.lane == lc.lane && lc.col >= s.col && lc.col < s.col + s.vals.size())
                    fail("tcgen05.ld of lane %u column %u, which thread %zu's tcgen05.st has not completed", lc.lane,
                         lc.col, t);
        ld.vals.push_back(tmem_at(lc.lane, lc.col));
        r[i] = kPoisonBits;
    }
    g_tc.th[f.tid].loads.push_back(std::move(ld));
}

void tmem_wait_ld() {
    sched_point();
    Fiber& f = me();
    for (TcLoad& ld : g_tc.th[f.tid].loads) {
        for (size_t i = 0; i < ld.vals.size(); ++i) {
            if (ld.dst[i] != kPoisonBits)
                fail("register %zu of a tcgen05.ld was written (0x%08x) before tcgen05.wait::ld", i, ld.dst[i]);
            ld.dst[i] = ld.vals[i];
        }
    }
    g_tc.th[f.tid].loads.clear();
}

void tmem_st(uint32_t taddr, const uint32_t* r, int n) {
    sched_point();
    Fiber& f = me();
    check_lane_quarter(taddr, "tcgen05.st");
    join_warp_ldst(true, taddr, n);
    const uint32_t col = sm100::tmem_col(taddr);
    check_allocated(col, static_cast<uint32_t>(n), "tcgen05.st");
    for (const UmmaOp& op : g_tc.ops) {
        uint32_t dlo, dhi, alo, ahi;
        umma_tmem_cols(op, &dlo, &dhi, &alo, &ahi);
        if (overlaps(col, col + static_cast<uint32_t>(n), dlo, dhi) ||
            (ahi > alo && overlaps(col, col + static_cast<uint32_t>(n), alo, ahi)))
            fail("tcgen05.st into tensor-memory columns [%u, %u) that tcgen05.mma #%" PRIu64 " (in flight) uses", col,
                 col + n, op.seq);
    }
    const sm100::LaneCol lc = sm100::ld32x32b_lane_col(taddr, static_cast<int>(f.warp), static_cast<int>(f.lane), 0);
    g_tc.th[f.tid].stores.push_back(TcStore{lc.lane, lc.col, std::vector<uint32_t>(r, r + n)});
}

void tmem_wait_st() {
    sched_point();
    Fiber& f = me();
    for (const TcStore& s : g_tc.th[f.tid].stores)
        for (size_t i = 0; i < s.vals.size(); ++i) tmem_at(s.lane, s.col + static_cast<uint32_t>(i)) = s.vals[i];
    g_tc.th[f.tid].stores.clear();
}

void tcgen05_fence(bool) { sched_point(); }

}  // namespace emu

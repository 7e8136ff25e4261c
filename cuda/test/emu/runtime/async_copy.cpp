// Asynchronous copies into shared memory: cp.async (sm_80) and TMA tensor loads (sm_90), issued by a
// thread and landed by the scheduler (../runtime.h has the map).
#include "state.h"

namespace emu::rt {

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

}  // namespace emu::rt

namespace emu {
using namespace rt;

// ---- cp.async ----

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

// ---- TMA ----

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

}  // namespace emu

// sm_90 wgmma: issue by the whole warpgroup, execution at a scheduler-chosen step, retirement by
// wgmma.wait_group, and the checks on its registers and shared operands (../runtime.h has the map).
#include "state.h"

namespace emu::rt {

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

}  // namespace emu::rt

namespace emu {
using namespace rt;

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

}  // namespace emu

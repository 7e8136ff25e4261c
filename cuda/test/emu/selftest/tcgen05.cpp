// Self-tests of tcgen05 (sm_100a): UMMA results with B K- and MN-major and A from smem or tensor
// memory, and six misuses.
#include "harness.h"
#include "smem_operands.h"

namespace selftest {
namespace {

// D(128 x 64) = A(128 x 16) B(16 x 64) in one tcgen05.mma (M = 128, N = 64, bf16): A K-major SW128
// from smem, or (a_tmem) from tensor memory written by tcgen05.st (row i in lane i, k in column
// k / 2, low half for even k); B K-major or MN-major. Every thread checks its row (lane) of D,
// loaded with tcgen05.ld 32x32b, against host arithmetic. `breakage` (0 = none) breaks one rule.
void tcgen05_case(bool b_mn, bool a_tmem, int breakage) {
    auto av = [](int m, int k) { return pat(m, k, 6); };
    auto bv = [](int k, int n) { return pat(k, n, 7); };
    launch(128, 60000, [&] {
        uint8_t* base = smem_aligned();
        uint8_t* sa = base;
        uint8_t* sb = base + 16384;  // A: 128 rows of 128 bytes
        uint64_t* bar = reinterpret_cast<uint64_t*>(base + 40000);
        uint32_t* slot = reinterpret_cast<uint32_t*>(base + 40016);
        Placed pa{}, pb{};
        const unsigned t = tid(), warp = t / 32;
        if (warp == 0) {
            fa4::tmem_alloc(slot, 128);
            fa4::tmem_relinquish();
        }
        if (t == 0) {
            pa = place_kmajor(sa, 128, 16, 128, 2, av, false);
            if (b_mn) pb = place_mnmajor(sb, 16, 64, 128, bv);
            else pb = place_kmajor(sb, 64, 16, 128, 2, [&](int n, int k) { return bv(k, n); }, false);
            std::memcpy(base + 40100, &pa, sizeof pa);
            std::memcpy(base + 40200, &pb, sizeof pb);
            fa3::mbar_init(bar, 1);
            fa3::mbar_init_fence();
        }
        fa3::fence_proxy_async_smem();
        fa4::tcgen05_fence_before();
        __syncthreads();
        fa4::tcgen05_fence_after();
        if (breakage == 4 && warp == 0) fa4::tmem_alloc(slot + 1, 32);  // after relinquish
        std::memcpy(&pa, base + 40100, sizeof pa);
        std::memcpy(&pb, base + 40200, sizeof pb);
        const uint32_t tmem = *slot;
        const uint32_t lane0 = 32 * (warp % 4);
        if (a_tmem) {  // A into columns 64..71 of this thread's lane
            uint32_t r[16] = {};
            for (int c = 0; c < 8; ++c)
                r[c] = bf16_bits(av(static_cast<int>(t), 2 * c)) |
                       (static_cast<uint32_t>(bf16_bits(av(static_cast<int>(t), 2 * c + 1))) << 16);
            fa4::tmem_st_32x32b_x16(fa4::tmem_addr(tmem, static_cast<int>(lane0), 64), r);
            if (breakage != 6) fa4::tmem_wait_st();
            fa4::tcgen05_fence_before();
            __syncthreads();
        }
        if (t == 0) {
            fa4::tcgen05_fence_after();
            using emu::sm100::Layout;
            const uint64_t da = emu::sm100::encode_umma_desc(pa.start, pa.lbo, pa.sbo, 0, Layout::B128);
            const uint64_t db = emu::sm100::encode_umma_desc(pb.start, pb.lbo, pb.sbo, 0, Layout::B128);
            const uint32_t idesc = emu::sm100::encode_idesc(1, 1, 1, 0, b_mn ? 1 : 0, 128, 64);
            // 3: a long queue of MMAs (the first overwrites, the rest accumulate), so that loads
            // of other threads meet some of them still in flight whatever the interleaving.
            for (int i = 0; i < (breakage == 3 ? 32 : 1); ++i) {
                if (a_tmem) fa4::umma_f16_ts(tmem, fa4::tmem_addr(tmem, 0, 64), db, idesc, i > 0);
                else fa4::umma_f16_ss(tmem, da, db, idesc, i > 0);
            }
            fa4::umma_commit(bar);
        }
        if (breakage == 3) {  // every thread reads D without waiting for the commit
            uint32_t r[32];
            fa4::tmem_ld_32x32b_x32(fa4::tmem_addr(tmem, static_cast<int>(lane0), 0), r);
            fa4::tmem_wait_ld(r);
        }
        if (breakage != 3) fa3::mbar_wait(bar, 0);
        __syncwarp();
        fa4::tcgen05_fence_after();
        const uint32_t lane_field = breakage == 2 && warp == 1 ? 0 : lane0;  // 2: warp 1 names lanes 0..31
        for (int h = 0; h < 2 && breakage != 3; ++h) {
            uint32_t r[32];
            fa4::tmem_ld_32x32b_x32(fa4::tmem_addr(tmem, static_cast<int>(lane_field), 32 * h), r);
            if (breakage == 5) r[3] = 1;  // written before wait::ld
            fa4::tmem_wait_ld(r);
            for (int n = 0; n < 32; ++n) {
                float ref = 0;
                for (int k = 0; k < 16; ++k) ref += av(static_cast<int>(t), k) * bv(k, 32 * h + n);
                CHECK(__uint_as_float(r[n]) == ref);
            }
        }
        if (breakage == 3) fa3::mbar_wait(bar, 0);  // late, so the phase is not left incomplete
        fa4::tcgen05_fence_before();
        __syncthreads();
        if (warp == 0 && breakage != 1) {
            fa4::tcgen05_fence_after();
            fa4::tmem_dealloc(tmem, 128);
        }
    });
}
void tcgen05_layouts() {
    for (bool b_mn : {false, true})
        for (bool a_tmem : {false, true}) tcgen05_case(b_mn, a_tmem, 0);
}

}  // namespace

std::vector<Test> tcgen05_tests() {
    return {
        {"tcgen05_layouts", nullptr, tcgen05_layouts},
        {"tcgen05_not_deallocated", "not freed by tcgen05.dealloc at exit", [] { tcgen05_case(false, false, 1); }},
        {"tcgen05_ld_other_lanes", "may only access lanes 32..63", [] { tcgen05_case(false, false, 2); }},
        {"tcgen05_ld_before_commit", "has not written yet", [] { tcgen05_case(false, false, 3); }},
        {"tcgen05_alloc_after_relinquish", "after tcgen05.relinquish_alloc_permit", [] { tcgen05_case(false, false, 4); }},
        {"tcgen05_ld_register_written", "before tcgen05.wait::ld", [] { tcgen05_case(false, false, 5); }},
        {"tcgen05_mma_over_unwaited_st", "has not completed", [] { tcgen05_case(false, true, 6); }},
    };
}

}  // namespace selftest

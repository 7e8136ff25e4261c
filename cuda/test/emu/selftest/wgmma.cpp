// Self-tests of wgmma: results for every operand layout and swizzle, chained accumulators and
// commit groups, each rule broken once, and operands another warp stored with and without a
// barrier.
#include "harness.h"
#include "smem_operands.h"

namespace selftest {
namespace {


// The wgmma fragment maps as the PTX ISA's figures draw them, written out here independently of
// sm90_layouts.h (warp w, g = lane / 4, q = lane % 4): accumulator register i holds
// (16w + g + 8 ((i / 2) % 2), 8 (i / 4) + 2q + i % 2); A register r, half h holds
// (16w + g + 8 (r % 2), 2q + h + 8 (r / 2)).
int acc_row(int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + ((i & 2) ? 8 : 0); }
int acc_col(int t, int i) { return 8 * (i / 4) + 2 * (t % 4) + (i % 2); }
int a_row(int t, int r) { return 16 * (t / 32) + (t % 32) / 4 + ((r & 1) ? 8 : 0); }
int a_col(int t, int r, int h) { return 2 * (t % 4) + h + ((r & 2) ? 8 : 0); }

emu::sm90::Swizzle mode_of(int w) {
    using emu::sm90::Swizzle;
    return w == 128 ? Swizzle::B128 : w == 64 ? Swizzle::B64 : w == 32 ? Swizzle::B32 : Swizzle::None;
}

// D(64 x 64) = A(64 x K) B(K x 64) in one wgmma: A K-major in smem; B K-major or MN-major
// (trans-b), every swizzle width; 16-bit (K = 16) or e4m3 (K = 32, K-major only).
void wgmma_case(int w, bool b_mn, bool e4m3, bool a_regs) {
    const int K = e4m3 ? 32 : 16, e = e4m3 ? 1 : 2;
    auto av = [](int m, int k) { return pat(m, k, 4); };
    auto bv = [](int k, int n) { return pat(k, n, 5); };
    launch(128, 60000, [&] {
        uint8_t* base = smem_aligned();
        uint8_t* sa = base;
        uint8_t* sb = base + 16384;
        Placed pa{}, pb{};
        if (tid() == 0) {
            pa = place_kmajor(sa, 64, K, w, e, av, e4m3);
            if (b_mn) pb = place_mnmajor(sb, K, 64, w, bv);
            else pb = place_kmajor(sb, 64, K, w, e, [&](int n, int k) { return bv(k, n); }, e4m3);
            // Publish the descriptors' fields to the other threads through smem.
            std::memcpy(base + 40000, &pa, sizeof pa);
            std::memcpy(base + 40064, &pb, sizeof pb);
        }
        fa3::fence_proxy_async_smem();
        __syncthreads();
        std::memcpy(&pa, base + 40000, sizeof pa);
        std::memcpy(&pb, base + 40064, sizeof pb);
        const auto m = mode_of(w);
        const uint64_t da = emu::sm90::encode_desc(pa.start, pa.lbo, pa.sbo, 0, m);
        const uint64_t db = emu::sm90::encode_desc(pb.start, pb.lbo, pb.sbo, 0, m);
        float d[32];
        for (float& x : d) x = 100.f;  // scale_d = 0 ignores it
        uint32_t a[4] = {0, 0, 0, 0};
        if (a_regs)
            for (int r = 0; r < 4; ++r) {
                const int t = static_cast<int>(tid());
                a[r] = bf16_bits(av(a_row(t, r), a_col(t, r, 0))) |
                       (static_cast<uint32_t>(bf16_bits(av(a_row(t, r), a_col(t, r, 1)))) << 16);
            }
        const emu::Elem el = e4m3 ? emu::Elem::E4M3 : emu::Elem::BF16;
        fa3::wgmma_fence();
        emu::wgmma_issue(emu::WgmmaInstr{64, 64, K, el, el, a_regs, da, db, 0, 1, 1, 0, b_mn ? 1 : 0}, d, a_regs ? a : nullptr);
        fa3::wgmma_commit();
        fa3::wgmma_wait<0>();
        fa3::fence_regs(d);
        for (int i = 0; i < 32; ++i) {
            const emu::sm90::RowCol rc{acc_row(static_cast<int>(tid()), i), acc_col(static_cast<int>(tid()), i)};
            float ref = 0;
            for (int k = 0; k < K; ++k) ref += av(rc.row, k) * bv(k, rc.col);
            CHECK(d[i] == ref);
        }
    });
}
void wgmma_layouts() {
    for (int w : {16, 32, 64, 128}) {
        wgmma_case(w, false, false, false);  // SS, both K-major
        wgmma_case(w, true, false, false);   // SS, B MN-major
        wgmma_case(w, true, false, true);    // RS, B MN-major (the PV form)
        wgmma_case(w, false, true, false);   // SS e4m3, K = 32
    }
}

// Two chained instructions in one group accumulate; a second group with scale_d = 0 overwrites.
void wgmma_chain_and_groups() {
    launch(128, 60000, [] {
        uint8_t* base = smem_aligned();
        if (tid() == 0) {
            place_kmajor(base, 64, 16, 128, 2, [](int m, int k) { return pat(m, k, 1); }, false);
            place_kmajor(base + 8192, 64, 16, 128, 2, [](int n, int k) { return pat(k, n, 2); }, false);
        }
        fa3::fence_proxy_async_smem();
        __syncthreads();
        const uint32_t b = saddr(base);
        const uint64_t da = emu::sm90::encode_desc(b, 16, 1024, 0, emu::sm90::Swizzle::B128);
        const uint64_t db = emu::sm90::encode_desc(b + 8192, 16, 1024, 0, emu::sm90::Swizzle::B128);
        float d[32], d2[32];
        for (int i = 0; i < 32; ++i) d[i] = 1.f;
        fa3::wgmma_fence();
        fa3::wgmma_m64n64k16_ss<__nv_bfloat16>(d, da, db, 1);  // d = 1 + AB
        fa3::wgmma_m64n64k16_ss<__nv_bfloat16>(d, da, db, 1);  // d = 1 + 2AB
        fa3::wgmma_commit();
        fa3::wgmma_m64n64k16_ss<__nv_bfloat16>(d2, da, db, 0);  // d2 = AB
        fa3::wgmma_commit();
        fa3::wgmma_wait<1>();
        fa3::fence_regs(d);
        fa3::wgmma_wait<0>();
        fa3::fence_regs(d2);
        for (int i = 0; i < 32; ++i) {
            const emu::sm90::RowCol rc{acc_row(static_cast<int>(tid()), i), acc_col(static_cast<int>(tid()), i)};
            float ab = 0;
            for (int k = 0; k < 16; ++k) ab += pat(rc.row, k, 1) * pat(k, rc.col, 2);
            CHECK(d[i] == 1.f + 2.f * ab);
            CHECK(d2[i] == ab);
        }
    });
}

// A minimal correct wgmma sequence with one rule broken by `breakage` (0 = none).
void wgmma_rule(int breakage) {
    launch(128, 60000, [breakage] {
        uint8_t* base = smem_aligned();
        if (tid() == 0) {
            place_kmajor(base, 64, 16, 128, 2, [](int m, int k) { return pat(m, k, 1); }, false);
            place_kmajor(base + 8192, 64, 16, 128, 2, [](int n, int k) { return pat(k, n, 2); }, false);
        }
        if (breakage != 6) fa3::fence_proxy_async_smem();
        __syncthreads();
        const uint32_t b = saddr(base);
        uint64_t da = emu::sm90::encode_desc(b, 16, 1024, 0, emu::sm90::Swizzle::B128);
        const uint64_t db = emu::sm90::encode_desc(b + 8192, 16, 1024, 0, emu::sm90::Swizzle::B128);
        if (breakage == 4 && tid() == 77) da = emu::sm90::encode_desc(b + 32, 16, 1024, 0, emu::sm90::Swizzle::B128);
        if (breakage == 7) da = emu::sm90::encode_desc(b + 58 * 1024, 16, 1024, 0, emu::sm90::Swizzle::B128);
        if (breakage == 8) da = emu::sm90::encode_desc(b + 128, 16, 1024, 0, emu::sm90::Swizzle::B128);
        float d[32] = {};
        uint32_t a[4] = {1, 2, 3, 4};
        if (breakage != 1) fa3::wgmma_fence();
        if (breakage == 5) {
            fa3::wgmma_m64n64k16_rs_tb<__nv_bfloat16>(d, a, db);
            a[2] = 7;  // an A register changed while in flight
        } else {
            fa3::wgmma_m64n64k16_ss<__nv_bfloat16>(d, da, db, 0);
        }
        if (breakage == 9) return;  // uncommitted at exit
        fa3::wgmma_commit();
        if (breakage == 10) return;  // never waited
        if (breakage == 2) fa3::fence_regs(d);  // read while in flight
        if (breakage == 3) d[5] = 0.f;          // written while in flight
        fa3::wgmma_wait<0>();
        fa3::fence_regs(d);
    });
}

// One thread of warp 1 stores both wgmma operands with ordinary stores and fences them; every
// thread then issues the wgmma, after a __syncthreads (barrier: must pass) or without one (the
// other warps' reads race with the stores: must fail by happens-before whatever the order the
// seed gives, either at the issue or at the store).
void wgmma_operands_of_another_warp(bool barrier, uint64_t seed) {
    launch(128, 60000, [barrier] {
        fa3::fence_proxy_async_smem();  // the launch uses the async proxy from here on
        uint8_t* base = smem_aligned();
        if (tid() == 32) {
            place_kmajor(base, 64, 16, 128, 2, [](int m, int k) { return pat(m, k, 1); }, false);
            place_kmajor(base + 8192, 64, 16, 128, 2, [](int n, int k) { return pat(k, n, 2); }, false);
            fa3::fence_proxy_async_smem();
        }
        if (barrier) __syncthreads();
        const uint32_t b = saddr(base);
        const uint64_t da = emu::sm90::encode_desc(b, 16, 1024, 0, emu::sm90::Swizzle::B128);
        const uint64_t db = emu::sm90::encode_desc(b + 8192, 16, 1024, 0, emu::sm90::Swizzle::B128);
        float d[32] = {};
        fa3::wgmma_fence();
        fa3::wgmma_m64n64k16_ss<__nv_bfloat16>(d, da, db, 0);
        fa3::wgmma_commit();
        fa3::wgmma_wait<0>();
        fa3::fence_regs(d);
        for (int i = 0; i < 32; ++i) {
            float want = 0;
            for (int k = 0; k < 16; ++k) want += pat(acc_row(tid(), i), k, 1) * pat(k, acc_col(tid(), i), 2);
            CHECK(d[i] == want);
        }
    }, seed);
}

}  // namespace

std::vector<Test> wgmma_tests() {
    return {
        {"wgmma_layouts", nullptr, wgmma_layouts},
        {"wgmma_chain_and_groups", nullptr, wgmma_chain_and_groups},
        {"wgmma_ok", nullptr, [] { wgmma_rule(0); }},
        {"wgmma_no_fence", "without a wgmma.fence", [] { wgmma_rule(1); }},
        {"wgmma_read_in_flight", "is read (fence_regs) while wgmma", [] { wgmma_rule(2); }},
        {"wgmma_write_in_flight", "written by the thread while wgmma", [] { wgmma_rule(3); }},
        {"wgmma_desc_mismatch", "must issue the same descriptors", [] { wgmma_rule(4); }},
        {"wgmma_a_reg_changed", "changed A register 2", [] { wgmma_rule(5); }},
        {"wgmma_unfenced_generic_store", "after the last fence.proxy.async", [] { wgmma_rule(6); }},
        {"wgmma_operands_of_another_warp_ok", nullptr, [] { for (uint64_t s = 1; s <= 3; ++s) wgmma_operands_of_another_warp(true, s); }},
        {"wgmma_operands_of_another_warp_seed1", "happens-before", [] { wgmma_operands_of_another_warp(false, 1); }},
        {"wgmma_operands_of_another_warp_seed2", "happens-before", [] { wgmma_operands_of_another_warp(false, 2); }},
        {"wgmma_operands_of_another_warp_seed3", "happens-before", [] { wgmma_operands_of_another_warp(false, 3); }},
        {"wgmma_operand_outside_smem", "outside the dynamic shared memory", [] { wgmma_rule(7); }},
        {"wgmma_base_offset", "base_offset does not equal", [] { wgmma_rule(8); }},
        {"wgmma_uncommitted_at_exit", "never committed", [] { wgmma_rule(9); }},
        {"wgmma_unwaited_at_exit", "never waited for", [] { wgmma_rule(10); }},
    };
}

}  // namespace selftest

// The FA3 (sm_90a) layouts against CuTe (cute_maps.h): the kernel's own __host__ helpers in
// cuda/sm90/wgmma.cuh and fa3/traits.cuh, and the software model of
// cuda/test/fa3_layout_sim.cpp (its hardware model is compiled in here with its main renamed, so
// the very functions it runs are the ones checked).
//
// Checked, for every stage 1-5 and head dim 64/128/256 (the tiles of Fa3Traits):
//  1. swizzle: the model's swizzle128 == CuTe Swizzle<3,4,3> on every byte address of 256 KiB;
//  2. storage: sw128_offset (plain loads, stage 1) and the model's TMA box placement (stages
//     2-5) put every Q/K/V element where CuTe's canonical SW128 tile of that shape has it;
//  3. descriptors: every descriptor the mainloop issues (desc_kmajor_sw128 / desc_mnmajor_sw128
//     at the qk_a/qk_b/pv_b offsets) equals, bit for bit, what CuTe's make_gmma_desc gives for
//     the same instruction block of the same tile, except LBO of the N = 64 MN-major V
//     descriptor (unused there; CuTe writes 0, we write the slab stride: see item 4);
//  4. LBO of the MN-major descriptor where it is used (N = 128, 256 instructions over the V
//     tile): our slab stride equals CuTe's;
//  5. operand fetch: the model's reading of a descriptor (which byte wgmma reads for element (i,k)
//     of the instruction) lands on the byte where CuTe's layout has that element;
//  6. fragments: the accumulator map (acc_index + the documented thread position == the model's
//     frag_rc) and the P -> A reuse (acc_to_a_index) equal CuTe's CLayout / ALayout;
//  7. e4m3 (FP8, K-major, K = 32): desc_kmajor_sw128 at the 16-bit byte offsets equals CuTe's
//     descriptors for the SW128 e4m3 tiles, desc_kmajor_sw64 for the SW64 ones, and the RS A
//     fragment of 8-bit inputs is NOT the accumulator fragment (reported: an FP8 P needs a register permutation).
#include <cstdint>
#include <cstdio>
#include <set>
#include <utility>

#include "cute_maps.h"
#include "expect.h"

#define main fa3_layout_sim_main
#include "../fa3_layout_sim.cpp"
#undef main

namespace {

namespace co = cute_oracle;

co::Expect g_sm90{"sm90"};
#define EXPECT(cond, ...) CUTE_ORACLE_EXPECT(g_sm90, cond, __VA_ARGS__)

co::GmmaTile tile_q(int bm, int d) { return {co::Operand::A, co::Major::K, 16, 128, bm, d, 64}; }
co::GmmaTile tile_k(int bn, int d) { return {co::Operand::B, co::Major::K, 16, 128, bn, d, 64}; }
co::GmmaTile tile_v(int bn, int d, int n) { return {co::Operand::B, co::Major::MN, 16, 128, d, bn, n}; }

int64_t cute_offset(const co::GmmaTile& t, int mn, int k) {
    int64_t off = -1;
    if (!co::gmma_tile_offset(t, mn, k, &off)) {
        std::printf("  no CuTe tile (mn %d k %d inst %d)\n", t.mn, t.k, t.inst_mn);
        ++g_sm90.bad;
    }
    return off;
}
co::GmmaDesc cute_desc(const co::GmmaTile& t, int mb, int kb) {
    co::GmmaDesc d{};
    if (!co::gmma_desc(t, mb, kb, &d)) {
        std::printf("  no CuTe descriptor (mn %d k %d inst %d block %d %d)\n", t.mn, t.k, t.inst_mn, mb, kb);
        ++g_sm90.bad;
    }
    return d;
}

constexpr uint64_t kLboMask = 0x3FFFull << 16;

void check_swizzle() {
    const long c0 = g_sm90.cases;
    const int b0 = g_sm90.bad;
    for (uint32_t a = 0; a < (256u << 10); ++a)
        EXPECT(swizzle128(a) == co::swizzle_addr(128, a), "swizzle128(%u) = %u, CuTe %u", a, swizzle128(a),
               co::swizzle_addr(128, a));
    // sw128_offset inside one atom == CuTe's K-major SW128 atom (16-bit).
    for (int r = 0; r < 8; ++r)
        for (int c = 0; c < 64; ++c)
            EXPECT(sw128_offset(r, c, 8) == co::swizzle_atom_offset(co::Major::K, 128, 2, r, c),
                   "atom (%d, %d)", r, c);
    g_sm90.section("128B swizzle (model swizzle128, sw128_offset atom)", c0, b0);
    // The interface's own conventions (cute_maps.h), for its other users: every canonical atom is
    // the swizzle function applied to the row-major (K-major) / column-major (MN-major) offset.
    const long c1 = g_sm90.cases;
    const int b1 = g_sm90.bad;
    for (int sw : {0, 32, 64, 128})
        for (int eb : {1, 2, 4}) {
            const int row_bytes = sw ? sw : 16, per_row = row_bytes / eb;
            for (int r = 0; r < 8; ++r)
                for (int c = 0; c < per_row; ++c) {
                    const uint32_t lin = static_cast<uint32_t>(r * row_bytes + c * eb);
                    EXPECT(co::swizzle_atom_offset(co::Major::K, sw, eb, r, c) == int(co::swizzle_addr(sw, lin)),
                           "K atom sw %d eb %d (%d, %d)", sw, eb, r, c);
                    EXPECT(co::swizzle_atom_offset(co::Major::MN, sw, eb, c, r) == int(co::swizzle_addr(sw, lin)),
                           "MN atom sw %d eb %d (%d, %d)", sw, eb, c, r);
                }
            EXPECT(co::swizzle_atom_offset(co::Major::K, sw, eb, 8, 0) == -1, "K atom bounds");
        }
    g_sm90.section("canonical atoms = swizzle(linear offset), 128B/64B/32B/none x 1/2/4 bytes (cute_maps.h)", c1, b1);
}

// Storage of one stage's tiles: where the kernel (plain loads or TMA) puts each element.
template <int Stage, int D>
void check_storage() {
    using Tr = Fa3Traits<Stage, D>;
    constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN;
    for (int r = 0; r < BM; ++r)
        for (int c = 0; c < D; ++c) {
            const int64_t want = cute_offset(tile_q(BM, D), r, c);
            if (Stage == 1) {
                EXPECT(sw128_offset(r, c, BM) == want, "stage 1 hd %d Q (%d, %d)", D, r, c);
            } else {
                const int slab = c / 64, rb = r / Tr::kTmaBoxRowsQ, rr = r % Tr::kTmaBoxRowsQ;
                const uint32_t at = swizzle128(Tr::q_box_offset(slab, rb) + rr * 128 + (c % 64) * 2);
                EXPECT(at == want, "stage %d hd %d Q TMA (%d, %d)", Stage, D, r, c);
            }
        }
    for (int r = 0; r < BN; ++r)
        for (int c = 0; c < D; ++c) {
            const int64_t want_k = cute_offset(tile_k(BN, D), r, c);
            const int64_t want_v = cute_offset(tile_v(BN, D, 64), c, r);  // (n = d, k = key)
            const uint32_t at = Stage == 1 ? static_cast<uint32_t>(sw128_offset(r, c, BN))
                                           : swizzle128(Tr::kv_box_offset(c / 64) + r * 128 + (c % 64) * 2);
            EXPECT(at == want_k, "stage %d hd %d K (%d, %d)", Stage, D, r, c);
            EXPECT(at == want_v, "stage %d hd %d V (%d, %d)", Stage, D, r, c);
        }
}

// Model address of element (i, k) of an instruction operand given its descriptor, read through
// the model's own fetch functions on a shared memory whose every element holds its index.
struct IndexSmem {
    Smem sm;
    explicit IndexSmem(int bytes) : sm(bytes) {
        for (int b = 0; b < bytes; b += 2) sm.put(b, static_cast<int16_t>(b / 2));
    }
    uint32_t kmajor(uint64_t desc, int i, int k) const { return 2u * fetch_kmajor(sm, desc, i, k); }
    uint32_t mnmajor(uint64_t desc, int k, int n) const { return 2u * fetch_mnmajor(sm, desc, k, n); }
};

template <int Stage, int D>
void check_descriptors(const IndexSmem& mem) {
    using Tr = Fa3Traits<Stage, D>;
    constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN;
    // S = Q K^T: A = Q rows of consumer warpgroup cw, B = K keys 64nh.., k step kk.
    for (int cw = 0; cw < Tr::kConsumerWarpgroups; ++cw)
        for (int kk = 0; kk < D / kMmaK; ++kk) {
            const uint64_t ours = desc_kmajor_sw128(Tr::q_warpgroup_offset(cw) + Tr::qk_a_offset(kk));
            const co::GmmaDesc cute = cute_desc(tile_q(BM, D), cw, kk);
            EXPECT(ours == cute.raw, "stage %d hd %d Q desc cw %d kk %d: ours %016llx CuTe %016llx", Stage, D, cw,
                   kk, (unsigned long long)ours, (unsigned long long)cute.raw);
            for (int i = 0; i < 64; ++i)
                for (int k = 0; k < 16; ++k)
                    EXPECT(mem.kmajor(ours, i, k) == cute_offset(tile_q(BM, D), 64 * cw + i, 16 * kk + k),
                           "stage %d hd %d Q fetch cw %d kk %d (%d, %d)", Stage, D, cw, kk, i, k);
        }
    for (int nh = 0; nh < BN / kMmaN; ++nh)
        for (int kk = 0; kk < D / kMmaK; ++kk) {
            const uint64_t ours = desc_kmajor_sw128(Tr::qk_b_offset(kk, nh));
            const co::GmmaDesc cute = cute_desc(tile_k(BN, D), nh, kk);
            EXPECT(ours == cute.raw, "stage %d hd %d K desc nh %d kk %d: ours %016llx CuTe %016llx", Stage, D, nh,
                   kk, (unsigned long long)ours, (unsigned long long)cute.raw);
            for (int n = 0; n < 64; ++n)
                for (int k = 0; k < 16; ++k)
                    EXPECT(mem.kmajor(ours, n, k) == cute_offset(tile_k(BN, D), 64 * nh + n, 16 * kk + k),
                           "stage %d hd %d K fetch nh %d kk %d (%d, %d)", Stage, D, nh, kk, n, k);
        }
    // O += P V: B = V as [D x BN] MN-major, output columns 64nh.., keys 16kk...
    for (int nh = 0; nh < D / kMmaN; ++nh)
        for (int kk = 0; kk < BN / kMmaK; ++kk) {
            const uint64_t ours = desc_mnmajor_sw128(Tr::pv_b_offset(kk, nh), Tr::kKvSlabStride);
            const co::GmmaDesc cute = cute_desc(tile_v(BN, D, 64), nh, kk);
            // N = 64 16-bit columns are one 128-byte swizzle row: LBO is not used (CuTe: 0).
            EXPECT((ours & ~kLboMask) == (cute.raw & ~kLboMask) && cute.lbo == 0,
                   "stage %d hd %d V desc nh %d kk %d: ours %016llx CuTe %016llx", Stage, D, nh, kk,
                   (unsigned long long)ours, (unsigned long long)cute.raw);
            for (int k = 0; k < 16; ++k)
                for (int n = 0; n < 64; ++n)
                    EXPECT(mem.mnmajor(ours, k, n) == cute_offset(tile_v(BN, D, 64), 64 * nh + n, 16 * kk + k),
                           "stage %d hd %d V fetch nh %d kk %d (k %d, n %d)", Stage, D, nh, kk, k, n);
        }
}

// LBO where it matters: one instruction spanning several 64-column slabs of V.
template <int D>
void check_v_lbo_wide(const IndexSmem& mem) {
    using Tr = Fa3Traits<1, D>;
    constexpr int BN = Tr::kBlockN;
    for (int n_inst = 128; n_inst <= D; n_inst *= 2) {
        const co::GmmaTile t = tile_v(BN, D, n_inst);
        for (int nb = 0; nb < D / n_inst; ++nb)
            for (int kk = 0; kk < BN / kMmaK; ++kk) {
                const uint64_t ours = desc_mnmajor_sw128(Tr::pv_b_offset(kk, nb * n_inst / kMmaN), Tr::kKvSlabStride);
                const co::GmmaDesc cute = cute_desc(t, nb, kk);
                EXPECT(ours == cute.raw, "hd %d V desc N=%d nb %d kk %d: ours %016llx CuTe %016llx (LBO %u)", D,
                       n_inst, nb, kk, (unsigned long long)ours, (unsigned long long)cute.raw, cute.lbo);
                for (int k = 0; k < 16; ++k)
                    for (int n = 0; n < n_inst; ++n)
                        EXPECT(mem.mnmajor(ours, k, n) == cute_offset(t, n_inst * nb + n, 16 * kk + k),
                               "hd %d V N=%d fetch (k %d, n %d)", D, n_inst, k, n);
            }
    }
}

// The thread position the kernel (AccFrag in cuda/fa3_fwd_sm90.cu, device-only) and the header
// comment give to accumulator index acc_index(j, h, e).
co::RowCol our_c(int thread, int j, int h, int e) {
    const int w = thread / 32, lane = thread % 32;
    return {16 * w + lane / 4 + 8 * h, 8 * j + 2 * (lane % 4) + e};
}

template <int BN>
void check_fragments() {
    // Per instruction (N = 64, chunk nh at s[acc_index(8 nh, 0, 0)]) and over the whole S tile.
    for (int th = 0; th < 128; ++th)
        for (int j = 0; j < BN / 8; ++j)
            for (int h = 0; h < 2; ++h)
                for (int e = 0; e < 2; ++e) {
                    const co::RowCol ours = our_c(th, j, h, e);
                    int mr, mc;
                    frag_rc(th, j, h, e, mr, mc);  // the layout model's map
                    const int nh = j / 8, v = acc_index(j, h, e) - acc_index(8 * nh, 0, 0);
                    const co::RowCol inst = co::wgmma_c_map(64, th, v);
                    const co::RowCol whole = co::wgmma_c_map(BN, th, acc_index(j, h, e));
                    EXPECT(inst.row == ours.row && inst.col + 64 * nh == ours.col, "C thread %d j %d h %d e %d", th, j,
                           h, e);
                    EXPECT(whole.row == ours.row && whole.col == ours.col, "C(N=%d) thread %d j %d", BN, th, j);
                    EXPECT(mr == ours.row && mc == ours.col, "model frag_rc thread %d j %d", th, j);
                }
    // P reuse: half e of register r of the A fragment of key step kk is accumulator element
    // acc_to_a_index(kk, r) + e; CuTe's ALayout must place it at the same (row, key).
    for (int th = 0; th < 128; ++th)
        for (int kk = 0; kk < BN / 16; ++kk)
            for (int r = 0; r < 4; ++r)
                for (int e = 0; e < 2; ++e) {
                    const co::RowCol s = co::wgmma_c_map(BN, th, acc_to_a_index(kk, r) + e);
                    const co::RowCol a = co::wgmma_a_map(16, th, 2 * r + e);
                    EXPECT(s.row == a.row && s.col == 16 * kk + a.col, "P->A thread %d kk %d r %d e %d: S (%d,%d) A (%d,%d)",
                           th, kk, r, e, s.row, s.col, a.row, 16 * kk + a.col);
                    // The header's formula: a[r] = row 16w+g+8(r%2), cols 8(r/2)+2t+e.
                    const int w = th / 32, lane = th % 32;
                    EXPECT(a.row == 16 * w + lane / 4 + 8 * (r % 2) && a.col == 8 * (r / 2) + 2 * (lane % 4) + e,
                           "A formula thread %d r %d e %d", th, r, e);
                }
}

// FP8 e4m3, K-major SW128: a 128-element row is 128 bytes, so the byte geometry is the 16-bit one
// with 128-element slabs; desc_kmajor_sw128 applies unchanged at these offsets. SW64 (the FP8
// consumer's tiles whose K extent is 64 bytes: Q and K at head_dim 64, Vᵀ of 64-key tiles):
// 64-element slabs, rows 64 bytes apart, two k32 steps per row, desc_kmajor_sw64.
void check_e4m3() {
    const long c0 = g_sm90.cases;
    const int b0 = g_sm90.bad;
    int n = 0;
    const co::GmmaTile* all = co::gmma_tiles(&n);
    int tiles = 0, tiles64 = 0;
    for (int i = 0; i < n; ++i) {
        const co::GmmaTile& t = all[i];
        if (t.elem_bits != 8 || (t.swizzle_bytes != 128 && t.swizzle_bytes != 64)) continue;
        const int w = t.swizzle_bytes;
        ++(w == 128 ? tiles : tiles64);
        const int slab_stride = t.mn * w, steps_per_slab = w / 32;
        for (int mb = 0; mb < t.mn / t.inst_mn; ++mb)
            for (int kb = 0; kb < t.k / 32; ++kb) {
                const uint32_t off = mb * t.inst_mn * w + (kb / steps_per_slab) * slab_stride + (kb % steps_per_slab) * 32;
                const co::GmmaDesc cute = cute_desc(t, mb, kb);
                EXPECT((w == 128 ? desc_kmajor_sw128(off) : desc_kmajor_sw64(off)) == cute.raw,
                       "e4m3 SW%d %s mn %d k %d block %d %d", w, t.operand == co::Operand::A ? "A" : "B", t.mn, t.k,
                       mb, kb);
            }
    }
    EXPECT(tiles >= 6, "e4m3 SW128 tiles instantiated: %d", tiles);
    EXPECT(tiles64 >= 4, "e4m3 SW64 tiles instantiated: %d", tiles64);
    g_sm90.section("e4m3 K-major SW128 / SW64 descriptors (desc_kmajor_sw128 / _sw64 at 32-byte k steps)", c0, b0);

    // The 8-bit RS A fragment against the accumulator: count threads whose A elements of key step
    // 0 (k 0..31) are not all among their own accumulator elements of columns 0..31.
    int threads_differ = 0;
    for (int th = 0; th < 128; ++th) {
        std::set<std::pair<int, int>> acc;
        for (int v = 0; v < 32 / 2; ++v) {  // N = 32 columns -> 16 values
            const co::RowCol c = co::wgmma_c_map(32, th, v);
            acc.insert({c.row, c.col});
        }
        bool same = true;
        for (int v = 0; v < 16; ++v) {
            const co::RowCol a = co::wgmma_a_map(8, th, v);
            same = same && acc.count({a.row, a.col});
        }
        threads_differ += !same;
    }
    const co::RowCol a0 = co::wgmma_a_map(8, 1, 0), a1 = co::wgmma_a_map(8, 1, 1), a4 = co::wgmma_a_map(8, 1, 4);
    std::printf("cute-oracle sm90: e4m3 RS A fragment vs accumulator: %d of 128 threads hold other elements "
                "(thread 1: A values 0, 1, 4 = (%d,%d) (%d,%d) (%d,%d); accumulator values 0, 1 = cols 2, 3): "
                "an FP8 P needs a register permutation before PV\n",
                threads_differ, a0.row, a0.col, a1.row, a1.col, a4.row, a4.col);
}

// The checks must bite: each deliberate error below has to disagree with CuTe somewhere.
void check_mutations(const IndexSmem& mem) {
    using Tr = Fa3Traits<3, 128>;
    constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, D = 128;
    const auto field = [](uint64_t d, int shift, uint64_t v) { return (d & ~(0x3FFFull << shift)) | (v << shift); };
    int detected = 0, tried = 0;
    auto differs_q = [&](auto mutate) {
        bool diff = false;
        for (int kk = 0; kk < D / kMmaK; ++kk)
            diff = diff || mutate(desc_kmajor_sw128(Tr::qk_a_offset(kk)), kk) != cute_desc(tile_q(BM, D), 0, kk).raw;
        return diff;
    };
    // 1. SBO 512 instead of 1024.
    ++tried, detected += differs_q([&](uint64_t d, int) { return field(d, 32, desc_field(512)); });
    // 2. 64B swizzle mode instead of 128B.
    ++tried, detected += differs_q([&](uint64_t d, int) { return (d & ~(3ull << 62)) | (2ull << 62); });
    // 3. No k-step advance inside a slab.
    ++tried, detected += differs_q([&](uint64_t d, int kk) { return d - desc_field((kk % 4) * kMmaKBytes); });
    // 4. V key step of 8 rows (1024 B) instead of 16 (2048 B): the operand fetch lands elsewhere.
    {
        bool diff = false;
        for (int kk = 0; kk < BN / kMmaK && !diff; ++kk) {
            const uint64_t d = desc_mnmajor_sw128(kk * 1024, Tr::kKvSlabStride);
            for (int k = 0; k < 16 && !diff; ++k)
                for (int n = 0; n < 64 && !diff; ++n)
                    diff = mem.mnmajor(d, k, n) != cute_offset(tile_v(BN, D, 64), n, 16 * kk + k);
        }
        ++tried, detected += diff;
    }
    // 5. P -> A with the two A registers of one row half swapped (r ^ 2).
    {
        bool diff = false;
        for (int th = 0; th < 128 && !diff; ++th)
            for (int r = 0; r < 4 && !diff; ++r) {
                const co::RowCol sv = co::wgmma_c_map(BN, th, acc_to_a_index(0, r ^ 2));
                const co::RowCol a = co::wgmma_a_map(16, th, 2 * r);
                diff = sv.row != a.row || sv.col != a.col;
            }
        ++tried, detected += diff;
    }
    // 6. Accumulator row halves swapped (h <-> e).
    {
        bool diff = false;
        for (int th = 0; th < 128 && !diff; ++th) {
            const co::RowCol c = co::wgmma_c_map(64, th, acc_index(0, 0, 1));
            diff = c.row != our_c(th, 0, 1, 0).row || c.col != our_c(th, 0, 1, 0).col;
        }
        ++tried, detected += diff;
    }
    ++g_sm90.cases;
    if (detected != tried) ++g_sm90.bad;
    std::printf("cute-oracle sm90: mutations (SBO, swizzle mode, k step, V key step, A registers, C halves): "
                "%d of %d detected\n", detected, tried);
}

template <int Stage>
void check_stage(const IndexSmem& mem) {
    const long c0 = g_sm90.cases;
    const int b0 = g_sm90.bad;
    check_storage<Stage, 64>();
    check_storage<Stage, 128>();
    check_storage<Stage, 256>();
    char what[96];
    std::snprintf(what, sizeof what, "stage %d storage (hd 64/128/256, Q/K/V)", Stage);
    g_sm90.section(what, c0, b0);
    const long c1 = g_sm90.cases;
    const int b1 = g_sm90.bad;
    check_descriptors<Stage, 64>(mem);
    check_descriptors<Stage, 128>(mem);
    check_descriptors<Stage, 256>(mem);
    std::snprintf(what, sizeof what, "stage %d descriptors and operand fetch (hd 64/128/256, Q/K/V)", Stage);
    g_sm90.section(what, c1, b1);
}

}  // namespace

int check_sm90() {
    const IndexSmem mem(64 << 10);  // the largest tile: Q 128 x 256 x 2 bytes
    check_swizzle();
    check_stage<1>(mem);
    check_stage<2>(mem);
    check_stage<3>(mem);
    check_stage<4>(mem);
    check_stage<5>(mem);
    {
        const long c0 = g_sm90.cases;
        const int b0 = g_sm90.bad;
        check_v_lbo_wide<128>(mem);
        check_v_lbo_wide<256>(mem);
        g_sm90.section("MN-major LBO with N = 128, 256 instructions (V, hd 128/256)", c0, b0);
    }
    {
        const long c0 = g_sm90.cases;
        const int b0 = g_sm90.bad;
        check_fragments<64>();
        check_fragments<128>();
        g_sm90.section("wgmma accumulator and P->A register fragments (N = 64, 128)", c0, b0);
    }
    check_e4m3();
    check_mutations(mem);
    return g_sm90.bad;
}

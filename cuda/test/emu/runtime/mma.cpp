// The sm_80 warp-level matrix instructions: ldmatrix.x4 and mma.sync.m16n8k16 (../runtime.h has the
// map).
#include "state.h"

namespace emu::rt {



}  // namespace emu::rt

namespace emu {
using namespace rt;

void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr, bool trans) {
    const uint32_t in[1] = {addr};
    Coll& c = warp_collective(
        trans ? CollKind::LdmatrixT : CollKind::Ldmatrix, 0,
        [&](Coll& k) {
            for (int l = 0; l < 32; ++l) {
                const uint32_t a = k.in[l][0];
                if (a % 16) fail("ldmatrix: lane %d's row address 0x%x is not 16-byte aligned", l, a);
                check_smem_range(a, 16, "ldmatrix row");
            }
            // Happens-before: each lane reads 4 bytes of up to 8 rows.
            const unsigned w0 = me().warp * 32;
            for (int l = 0; l < 32; ++l) {
                const Fiber& rd = g_cta->fibers[w0 + static_cast<unsigned>(l)];
                uint32_t ok = 0;
                for (int m = 0; m < 4; ++m)
                    for (int h = 0; h < 2; ++h) {
                        const sm80::RowCol rc = sm80::ldmatrix_coord(l, h, trans);
                        const uint32_t row = k.in[sm80::ldmatrix_row_lane(m, rc.row)][0];
                        check_async_read(rd, granule_of(row), trans ? "ldmatrix.x4.trans" : "ldmatrix.x4", ok, false);
                    }
            }
            for (int l = 0; l < 32; ++l) check_no_pending_writes(k.in[l][0], k.in[l][0] + 16, "ldmatrix");
            for (int l = 0; l < 32; ++l)
                for (int m = 0; m < 4; ++m) {
                    uint32_t reg = 0;
                    for (int h = 0; h < 2; ++h) {
                        const sm80::RowCol rc = sm80::ldmatrix_coord(l, h, trans);
                        const uint32_t row_addr = k.in[sm80::ldmatrix_row_lane(m, rc.row)][0];
                        uint16_t v;
                        std::memcpy(&v, host_of(row_addr + 2 * static_cast<uint32_t>(rc.col)), 2);
                        reg |= static_cast<uint32_t>(v) << (16 * h);
                    }
                    k.out[l][m] = reg;
                }
        },
        in, 1, nullptr);
    for (int m = 0; m < 4; ++m) r[m] = c.out[me().lane][m];
    release_collective(c);
}

void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, Elem e) {
    const uint32_t in[6] = {a[0], a[1], a[2], a[3], b0, b1};
    Coll& c = warp_collective(
        CollKind::Mma, static_cast<uint32_t>(e),
        [&](Coll& k) {
            float A[16][16], B[16][8];
            for (int l = 0; l < 32; ++l)
                for (int r = 0; r < 4; ++r)
                    for (int h = 0; h < 2; ++h) {
                        const sm80::RowCol rc = sm80::mma_a_coord(l, r, h);
                        A[rc.row][rc.col] = reg_elem(k.in[l][r], h, e);
                    }
            for (int l = 0; l < 32; ++l)
                for (int r = 0; r < 2; ++r)
                    for (int h = 0; h < 2; ++h) {
                        const sm80::RowCol rc = sm80::mma_b_coord(l, r, h);
                        B[rc.row][rc.col] = reg_elem(k.in[l][4 + r], h, e);
                    }
            for (int l = 0; l < 32; ++l)
                for (int i = 0; i < 4; ++i) {
                    const sm80::RowCol rc = sm80::mma_c_coord(l, i);
                    double acc = 0;
                    for (int kk = 0; kk < 16; ++kk) acc += static_cast<double>(A[rc.row][kk]) * B[kk][rc.col];
                    const float r = static_cast<float>(static_cast<double>(k.fin[l][i]) + acc);
                    std::memcpy(&k.out[l][i], &r, 4);
                }
        },
        in, 6, d);
    for (int i = 0; i < 4; ++i) std::memcpy(&d[i], &c.out[me().lane][i], 4);
    release_collective(c);
}

}  // namespace emu

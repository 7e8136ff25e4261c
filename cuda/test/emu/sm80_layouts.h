// The emulator's reading of the sm_80 warp-level data layouts, as pure functions: mma.sync
// m16n8k16 fragments and ldmatrix .x4 (with and without .trans). The emulator
// (cuda/test/emu/runtime/mma.cpp) moves data only through these, so an independent oracle (CuTe's
// SM80 MMA traits and copy atoms) can check exactly these functions.
//
// Written from the PTX ISA 9.0, "Matrix Fragments for mma.m16n8k16 with floating point type"
// and "ldmatrix". Notation: lane l, g = l / 4, q = l % 4. The kernel side has its own helpers
// (cuda/fa2/layout.h); these are the emulator's independent copy.
#pragma once

namespace emu {
namespace sm80 {

struct RowCol {
    int row, col;
};

// A (16 x 16, row-major), register r (0..3), half h (0 = low 16 bits):
// (g + 8 * (r % 2), 2q + h + 8 * (r / 2)).
constexpr RowCol mma_a_coord(int lane, int r, int h) {
    return RowCol{lane / 4 + 8 * (r & 1), 2 * (lane % 4) + h + 8 * (r >> 1)};
}
// B (16 x 8 = K x N), register r (0..1), half h: (k, n) = (2q + h + 8r, g).
constexpr RowCol mma_b_coord(int lane, int r, int h) { return RowCol{2 * (lane % 4) + h + 8 * r, lane / 4}; }
// C/D (16 x 8, f32), element i (0..3): (g + 8 * (i / 2), 2q + i % 2).
constexpr RowCol mma_c_coord(int lane, int i) { return RowCol{lane / 4 + 8 * (i >> 1), 2 * (lane % 4) + (i & 1)}; }

// ldmatrix.m8n8.x4.b16: lane 8m + j supplies the address of row j of matrix m (16 bytes).
// Destination register m, half h of lane l receives element (row, col) of matrix m:
//   without .trans: (l / 4, 2 (l % 4) + h)       with .trans: (2 (l % 4) + h, l / 4)
// i.e. it reads matrix m's row `row` (from lane 8m + row's address) at byte 2 * col.
constexpr RowCol ldmatrix_coord(int lane, int h, bool trans) {
    return trans ? RowCol{2 * (lane % 4) + h, lane / 4} : RowCol{lane / 4, 2 * (lane % 4) + h};
}
// The lane whose address holds row `row` of matrix `m`.
constexpr int ldmatrix_row_lane(int m, int row) { return 8 * m + row; }

}  // namespace sm80
}  // namespace emu

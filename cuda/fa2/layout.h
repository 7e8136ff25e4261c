// Thread -> matrix-element index math of the FA2 kernel (cuda/fa2_fwd.cu), kept free of any
// CUDA-only construct so that the host program cuda/test/fa2_layout_test.cpp (g++) checks the very
// same functions the kernel calls. Everything here is pure integer arithmetic.
//
// Source of every layout below: PTX ISA 9.0, section 9.7.14.5.8 "Matrix Fragments for
// mma.m16n8k16 with floating point type" and section 9.7.14.5.15 "ldmatrix". Notation of the ISA:
//   groupID = lane >> 2 (0..7), threadID_in_group = lane % 4 (0..3); we write g and t.
//
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32  D(16x8) = A(16x16) B(16x8) + C
//   A: four .b32 registers, each two 16-bit elements (low half = lower element index a_{2r}):
//       elements a0..a7, row = g for a0,a1,a4,a5 and g+8 for a2,a3,a6,a7;
//       col = 2t + (i & 1) for i < 4 and 2t + (i & 1) + 8 for i >= 4. Per register r = 0..3:
//         r0 = A[g   ][2t, 2t+1]    r1 = A[g+8][2t, 2t+1]
//         r2 = A[g   ][2t+8, +9]    r3 = A[g+8][2t+8, +9]
//   B: two .b32 registers, elements b0..b3: row (k) = 2t + (i & 1) (+8 for i >= 2), col (n) = g:
//         r0 = B[2t, 2t+1][g]       r1 = B[2t+8, 2t+9][g]
//   C/D (f32): four registers c0..c3: row = g for c0,c1 and g+8 for c2,c3; col = 2t + (i & 1).
//
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: four 8x8 matrices of 16-bit elements; lane
//   8*m + r supplies the shared address of row r of matrix m (16 contiguous bytes). Destination
//   register m of lane l receives, without .trans, row l/4, elements 2*(l%4) and 2*(l%4)+1 of
//   matrix m (low half = lower column); with .trans it receives column l/4, rows 2*(l%4) and
//   2*(l%4)+1 (low half = lower row), i.e. the matrix as if it were stored column-major.
//
// Shared memory tiles are row-major [rows][kStride] with kStride = head_dim + 8 elements (16 bytes
// of padding per row): the 8 row addresses of one ldmatrix phase then start 16*(r*(kStride/8) mod
// 8) bytes into a 128-byte bank line, which are 8 distinct 16-byte bank groups for every head dim
// here (kStride*2 mod 128 is 16 (hd 64/128/192/256/512 -> 144, 272, 400, 528, 1040 bytes) or 80 (hd 32/96 ->
// 80, 208 bytes), both odd multiples of 16), so ldmatrix is conflict-free.
#pragma once

#if defined(__CUDACC__)
#define FA2_HD __host__ __device__ __forceinline__
#else
#define FA2_HD inline
#endif

namespace fa2 {

// ---- mma.m16n8k16 fragment coordinates (PTX ISA 9.7.14.5.8) -------------------------------------

// Row of accumulator element c_i (i = 0..3) of `lane` inside its 16x8 tile.
FA2_HD constexpr int acc_row(int lane, int i) { return (lane >> 2) + (i >= 2 ? 8 : 0); }
// Column of accumulator element c_i inside its 16x8 tile.
FA2_HD constexpr int acc_col(int lane, int i) { return (lane & 3) * 2 + (i & 1); }

// A fragment (16x16, row-major): register r (0..3), half h (0 = low 16 bits, 1 = high).
FA2_HD constexpr int a_row(int lane, int r) { return (lane >> 2) + ((r & 1) ? 8 : 0); }
FA2_HD constexpr int a_col(int lane, int r, int h) { return (lane & 3) * 2 + h + ((r & 2) ? 8 : 0); }

// B fragment (16x8, "col" = B stored as B^T rows): register r (0..1), half h.
FA2_HD constexpr int b_row(int lane, int r, int h) { return (lane & 3) * 2 + h + (r ? 8 : 0); }
FA2_HD constexpr int b_col(int lane) { return lane >> 2; }

// ---- P stays in registers: S accumulator -> A operand of P.V ----------------------------------
// The S = Q K^T accumulator of key n-tiles 2j and 2j+1 (keys 16j..16j+7 and 16j+8..16j+15) holds,
// per lane, S[g][2t,2t+1] and S[g+8][2t,2t+1] of each n-tile (c0,c1 and c2,c3). The A fragment of
// the k16-slice j of P.V wants r0 = P[g][2t,2t+1], r1 = P[g+8][2t,2t+1], r2 = P[g][2t+8,+9],
// r3 = P[g+8][2t+8,+9] (k = key within the slice). Hence, with no data movement between lanes:
//   r0 = pack(S_{2j}.c0, S_{2j}.c1)    r1 = pack(S_{2j}.c2, S_{2j}.c3)
//   r2 = pack(S_{2j+1}.c0, S_{2j+1}.c1) r3 = pack(S_{2j+1}.c2, S_{2j+1}.c3)
// p_src_tile(r) is the n-tile offset (0 or 1) and p_src_elem(r, h) the accumulator index.
FA2_HD constexpr int p_src_tile(int r) { return r >> 1; }
FA2_HD constexpr int p_src_elem(int r, int h) { return (r & 1) * 2 + h; }

// ---- ldmatrix.x4 lane -> row address inside a 16x16 block ---------------------------------------
// Lane l addresses row (l % 8) of matrix (l / 8). Which 8x8 quadrant each matrix is decides which
// fragment registers come out, so each operand has its own assignment:
//
// Q (A operand, row-major [query][d]): matrices = (rows 0-7, k 0-7), (rows 8-15, k 0-7),
//   (rows 0-7, k 8-15), (rows 8-15, k 8-15) -> registers r0..r3 of the A fragment above.
FA2_HD constexpr int ldsm_q_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
FA2_HD constexpr int ldsm_q_col(int lane) { return (lane >> 4) * 8; }
//
// K (B operand of S = Q K^T; sK is [key][d], i.e. B^T row-major = B "col"): one x4 covers two
//   n-tiles: matrices = (keys 0-7, d 0-7) -> b0 of n-tile 0, (keys 0-7, d 8-15) -> b1 of n-tile 0,
//   (keys 8-15, d 0-7) -> b0 of n-tile 1, (keys 8-15, d 8-15) -> b1 of n-tile 1. Without .trans
//   lane l gets row g = key, columns 2t,2t+1 = d, which is B[k = 2t,2t+1][n = g] as required.
FA2_HD constexpr int ldsm_k_row(int lane) { return (lane & 7) + (lane >> 4) * 8; }
FA2_HD constexpr int ldsm_k_col(int lane) { return ((lane >> 3) & 1) * 8; }
//
// V (B operand of O = P V; sV is [key][d] = B row-major, so .trans): one x4.trans covers two
//   d-tiles: matrices = (keys 0-7, d 0-7) -> b0 of d-tile 0, (keys 8-15, d 0-7) -> b1 of d-tile 0,
//   (keys 0-7, d 8-15) -> b0 of d-tile 1, (keys 8-15, d 8-15) -> b1 of d-tile 1. With .trans lane
//   l gets rows 2t,2t+1 (= keys) of column g (= d): B[k = 2t,2t+1][n = g] as required.
FA2_HD constexpr int ldsm_v_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
FA2_HD constexpr int ldsm_v_col(int lane) { return (lane >> 4) * 8; }

// ---- tile ownership ----------------------------------------------------------------------------
// Warp w owns query rows [w * 16 * kMTiles, (w + 1) * 16 * kMTiles) of the CTA's kBlockM rows;
// its m-tile mt covers the 16 rows starting at warp_row0 + 16 * mt.
FA2_HD constexpr int warp_row0(int warp, int m_tiles) { return warp * 16 * m_tiles; }
// With O's columns split over warps (Fa2Traits kColSplit > 1): warp w is row group
// w % row_warps and owns the o_cols columns of O starting at warp_col0.
FA2_HD constexpr int warp_row_group(int warp, int row_warps) { return warp % row_warps; }
FA2_HD constexpr int warp_col0(int warp, int row_warps, int o_cols) { return (warp / row_warps) * o_cols; }

// A warp's m16n8k16 accumulator blocks S[kMTiles][kNTiles][4] and O[kMTiles][kDTiles][4] seen
// as rows and columns, the fragment layout of the shared softmax and mask (softmax.cuh): row r is
// half r % 2 (rows g, g + 8) of m-tile r / 2; element j is column j % 2 of this lane's pair in
// n-tile j / 2. row/col are relative to the warp's first row and the tile's first key.
template <int kMTiles, int kNTiles, int kDTiles>
struct AccFrag {
    static constexpr int kRows = 2 * kMTiles, kSCols = 2 * kNTiles, kOCols = 2 * kDTiles, kLanes = 4;
    int lane;
    FA2_HD static float& s(float (&a)[kMTiles][kNTiles][4], int r, int j) {
        return a[r / 2][j / 2][2 * (r % 2) + j % 2];
    }
    FA2_HD static float& o(float (&a)[kMTiles][kDTiles][4], int r, int j) {
        return a[r / 2][j / 2][2 * (r % 2) + j % 2];
    }
    FA2_HD int row(int r) const { return 16 * (r / 2) + acc_row(lane, 2 * (r % 2)); }
    FA2_HD int col(int j) const { return 8 * (j / 2) + acc_col(lane, j % 2); }
};

}  // namespace fa2

// NVIDIA's own definitions of the layouts our sm_80 / sm_90a kernels rely on, as plain functions:
// an oracle that is not our reading of the PTX ISA. Every answer is computed by CUTLASS/CuTe
// (nvidia-cutlass 4.2.0 from PyPI, installed by scripts/toolchain/install-cutlass.sh, never vendored):
// the register-fragment maps of CuTe's MMA traits, the thread/value maps of its ldmatrix copy
// traits, its shared-memory swizzle functors and the wgmma descriptors its make_gmma_desc builds.
// CuTe's definitions are the ones NVIDIA's own kernels run on hardware.
//
// This header does not include CuTe: any host test (the FA3 layout checks in
// cuda/test/oracle/check_sm90.cpp, the FA2 ones in check_sm80.cpp, the emulator's decoders of
// cuda/test/emu/ in check_emu.cpp) can include it and link cute_maps.cpp, which is the only file compiled against
// the CuTe headers (g++ -std=c++17, CuTe include dir, the CUDA toolkit's include/ and
// include/cccl/; tests/toolchain/cute_oracle.rs shows the command line).
//
// Conventions shared by every function:
//  * "thread" is the thread's index inside its warpgroup (0..127, sm_90 wgmma) and "lane" its
//    index inside its warp (0..31, sm_80 mma.sync / ldmatrix).
//  * "value" is CuTe's value index of the fragment, which is the position in the PTX instruction's
//    operand list: for 32-bit registers (accumulators) value v is register {d_v}; for packed
//    16-bit operands value v is the (v % 2) half of register v / 2 (0 = low 16 bits, the lower
//    element index); for packed 8-bit operands byte v % 4 of register v / 4.
//  * Matrix coordinates are (row, col) of the matrix as the PTX ISA names it: A is M x K
//    (row = m, col = k), B is K x N (row = k, col = n), C/D is M x N (row = m, col = n).
//  * Functions return {-1, -1} (or false) for arguments outside the documented ranges.
#pragma once
#include <cstdint>

namespace cute_oracle {

struct RowCol {
    int row;
    int col;
};

// "4.2.0": the CUTLASS version the oracle was built against (cutlass/version.h).
const char* cutlass_version();

// ---- sm_90a wgmma register fragments (CuTe SM90::GMMA, mma_traits_sm90_gmma.hpp) -------------

// Accumulator D of wgmma m64nNk* with 32-bit elements (f32 / s32): CuTe's CLayout_64xN of
// MMA_Traits<SM90_64xNx16_F32BF16BF16_SS> (identical for every 16-bit and 8-bit input type).
// n: a multiple of 8 in [8, 256]; thread 0..127; value 0..n/2-1 -> (row 0..63, col 0..n-1).
RowCol wgmma_c_map(int n, int thread, int value);

// A operand from registers (the RS forms): CuTe's ALayout_64x16 (16-bit inputs, k16, values
// 0..7 = 4 registers x 2 halves) or ALayout_64x32 (8-bit inputs such as e4m3, k32, values 0..15 =
// 4 registers x 4 bytes). elem_bits: 16 or 8. -> (row 0..63, col = k).
RowCol wgmma_a_map(int elem_bits, int thread, int value);

// ---- Shared-memory swizzles (CuTe Swizzle<B,4,3>: 128B: B = 3, 64B: B = 2, 32B: B = 1) --------

// The swizzle as hardware (TMA, wgmma) applies it to an absolute shared byte address:
// swizzle_bytes 128, 64 or 32 (0 = none: identity). Bits [4, 4+B) ^= bits [7, 7+B).
uint32_t swizzle_addr(int swizzle_bytes, uint32_t byte_addr);

enum class Major { K, MN };

// Byte offset of element (mn, k) inside one swizzle atom of CuTe's canonical GMMA layouts
// (GMMA::Layout_{K,MN}_SW{128,64,32}_Atom<T>, or _INTER_ for swizzle_bytes = 0) placed at a
// 1024-byte-aligned address. K-major atom: 8 mn-rows of swizzle_bytes (16 for INTER) bytes, k
// contiguous; MN-major atom: 8 k-rows of swizzle_bytes bytes, mn contiguous.
// elem_bytes: 1, 2 or 4. mn, k inside the atom. Returns -1 outside.
int swizzle_atom_offset(Major major, int swizzle_bytes, int elem_bytes, int mn, int k);

// ---- wgmma shared-memory descriptors (CuTe make_gmma_desc, through its MMA partitioning) -----

// One shared-memory operand tile as CuTe builds it: tile_to_shape of the canonical atom to
// (mn, k), for K-major tiling along mn first (8-row atoms stacked, then the next atom column:
// our "SW128 slabs", cuda/sm90/wgmma.cuh), for MN-major along k first (so an MN-major
// [mn x k] tile is byte-for-byte the K-major [k x mn] tile with k and mn swapped: our V tile).
// The tile is an A operand (M = 64 per instruction, K-major) or a B operand (N = inst_mn).
enum class Operand { A, B };
struct GmmaTile {
    Operand operand;
    Major major;
    int elem_bits;      // 16 (bf16 / f16: the same layouts, checked by static_assert) or 8 (e4m3)
    int swizzle_bytes;  // 128 (what our kernels use), 64, 32, or 0 (INTERLEAVE)
    int mn;             // rows (K-major) / contiguous extent (MN-major) of the tile
    int k;              // reduction extent of the tile
    int inst_mn;        // M (A: 64) or N (B) of one instruction; K per instruction is 32 bytes
};

// A descriptor as CuTe made it. On the host CuTe cannot form a shared-memory address (its
// cast_smem_ptr_to_uint returns 0), so the start-address field holds the block's offset from the
// tile base (unswizzled: the hardware applies the swizzle), i.e. CuTe's layout offset of the
// instruction's (mn_block, k_block) sub-tile.
struct GmmaDesc {
    uint64_t raw;           // the 64-bit descriptor (start field = start_offset >> 4)
    uint32_t start_offset;  // bytes from the tile base
    uint32_t lbo;           // leading-dimension byte offset, bytes (field << 4)
    uint32_t sbo;           // stride-dimension byte offset, bytes (field << 4)
    int base_offset;        // bits [49, 52)
    int layout_type;        // bits [62, 64): 0 INTERLEAVE, 1 128B, 2 64B, 3 32B
};

// Whether `tile` is one of the instantiated shapes (CuTe needs compile-time shapes); see
// gmma_tiles() for the list.
bool gmma_tile_supported(const GmmaTile& tile);
// Every instantiated tile (count in *n).
const GmmaTile* gmma_tiles(int* n);

// The descriptor of instruction block (mn_block, k_block): rows / columns
// [inst_mn * mn_block, +inst_mn) x k [k_per_inst * k_block, +k_per_inst) with k_per_inst = 256 /
// elem_bits (32 bytes). False for an unsupported tile or a block outside it.
bool gmma_desc(const GmmaTile& tile, int mn_block, int k_block, GmmaDesc* out);

// CuTe's own bit layout of the 64-bit descriptor (the GmmaDescriptor union's bitfield,
// cute/arch/mma_sm90_desc.hpp), independent of any tile: the fields CuTe reads from `raw`
// (start_offset, lbo, sbo in bytes = field << 4; raw = the input), and the descriptor CuTe's
// bitfield makes of the given fields (bytes >> 4, each truncated to its field width; every bit
// outside the fields 0).
GmmaDesc gmma_desc_fields(uint64_t raw);
uint64_t gmma_desc_pack(uint32_t start_bytes, uint32_t lbo_bytes, uint32_t sbo_bytes, int base_offset, int layout_type);

// CuTe's layout function of the same tile: byte offset from the (1024-aligned) tile base of
// element (mn, k), swizzle applied as the hardware does. False outside / unsupported.
bool gmma_tile_offset(const GmmaTile& tile, int mn, int k, int64_t* byte_offset);

// ---- sm_80 mma.sync.m16n8k16 (CuTe MMA_Traits<SM80_16x8x16_F32BF16BF16F32_TN>; f16 the same) --

RowCol mma16816_a_map(int lane, int value);  // value 0..7 -> (m 0..15, k 0..15)
RowCol mma16816_b_map(int lane, int value);  // value 0..3 -> (k 0..15, n 0..7)
RowCol mma16816_c_map(int lane, int value);  // value 0..3 -> (m 0..15, n 0..7)

// ---- ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16 (CuTe Copy_Traits<SM75_U32x{1,2,4}_LDSM_N>
// and <SM75_U16x{2,4,8}_LDSM_T>) --------------------------------------------------------------
// Where the 16-bit element that lands in half `half` of destination register `reg` of `lane`
// comes from: lane 8 * matrix + row supplied the shared address of that 16-byte row, and the
// element is number `col` (0..7) of the row. num: 1, 2 or 4 matrices; reg < num.
struct LdsmSource {
    int matrix;
    int row;
    int col;
};
LdsmSource ldmatrix_map(int num, bool trans, int lane, int reg, int half);

}  // namespace cute_oracle

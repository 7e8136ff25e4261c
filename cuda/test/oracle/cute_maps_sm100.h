// NVIDIA's definitions of the sm_100a (tcgen05 / UMMA) encodings our FA4 kernels and the
// emulator rely on, as plain functions (the sm_100 companion of cute_maps.h; computed by CuTe in
// cute_maps_sm100.cpp, the only file of this pair compiled against the CuTe headers).
//  * UMMA::SmemDescriptor: the shared-memory matrix descriptor bitfield (cute/arch/mma_sm100_desc.hpp);
//  * UMMA::InstrDescriptor and make_instr_desc: the kind::f16 instruction descriptor;
//  * make_umma_desc: CuTe's descriptors for our tiles (SW128 K-major Q/K/P slabs, SW128
//    MN-major V), one instruction block at a time, and the byte offset of every element of those
//    tiles in CuTe's layout. On the host CuTe writes start address 0 (cast_smem_ptr_to_uint).
#pragma once
#include <cstdint>

namespace cute_oracle {
namespace sm100 {

// Raw field values (start, LBO, SBO in 16-byte units).
struct UmmaDescFields {
    uint32_t start, lbo, sbo, version, base_offset, lbo_mode, layout;
};
UmmaDescFields umma_desc_fields(uint64_t desc);
uint64_t umma_desc_pack(const UmmaDescFields& f);

struct IdescFields {
    uint32_t sparse_id2, sparse_flag, saturate, c_format, a_format, b_format, a_negate, b_negate, a_major, b_major,
        n_dim, m_dim, max_shift;
};
IdescFields idesc_fields(uint32_t desc);
// make_instr_desc<T, T, float, m, n, a_major, b_major>() for T = bfloat16_t (bf16) or half_t, m = 128,
// n = 64 or 128; false for other arguments.
bool make_idesc_f16(bool bf16, int m, int n, bool a_mn_major, bool b_mn_major, uint32_t* out);

// Our tiles as CuTe lays them out (16-bit elements):
//  kind 0: K-major SW128 [128 rows x 64 k] slab (Q, K, P);
//  kind 1: MN-major SW128 [64 n x 128 k] (V at head dim 64), tiled along k first;
//  kind 2: MN-major SW128 [128 n x 128 k] (V at head dim 128): two 64-column slabs.
// Descriptor of the instruction block (all mn, k in [16 kb, 16 kb + 16)).
bool umma_tile_desc(int kind, int kb, uint64_t* out);
// Byte offset of element (mn, k) in the tile (-1 outside).
int64_t umma_tile_offset(int kind, int mn, int k);
int umma_tile_mn(int kind);
int umma_tile_k(int kind);

}  // namespace sm100
}  // namespace cute_oracle

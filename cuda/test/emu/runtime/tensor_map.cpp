// TMA tensor maps: the emulator's 128-byte encoding of a CUtensorMap, with the driver's argument
// checks, and its decoding (../runtime.h has the map).
#include "state.h"

namespace emu::rt {

// ------------------------------------------------------------------ TMA descriptors

constexpr uint64_t kMapMagic = 0x314D414D54554D45ull;  // "EMUTMAM1"

uint32_t dtype_bytes(uint32_t dt) {
    switch (dt) {
        case 0: return 1;   // UINT8
        case 1: return 2;   // UINT16
        case 2: return 4;   // UINT32
        case 3: return 4;   // INT32
        case 4: return 8;   // UINT64
        case 5: return 8;   // INT64
        case 6: return 2;   // FLOAT16
        case 7: return 4;   // FLOAT32
        case 8: return 8;   // FLOAT64
        case 9: return 2;   // BFLOAT16
        case 10: return 4;  // FLOAT32_FTZ
        case 11: return 4;  // TFLOAT32
        case 12: return 4;  // TFLOAT32_FTZ
        default: return 0;
    }
}

}  // namespace emu::rt

namespace emu {
using namespace rt;

// ---- tensor maps ----

int encode_tensor_map_tiled(void* map, uint32_t data_type, uint32_t rank, const void* global_address,
                            const uint64_t* global_dim, const uint64_t* global_strides, const uint32_t* box_dim,
                            const uint32_t* element_strides, uint32_t interleave, uint32_t swizzle,
                            uint32_t l2_promotion, uint32_t oob_fill, std::string* why) {
    auto bad = [&](const std::string& s) {
        if (why) *why = s;
        return 1;  // CUDA_ERROR_INVALID_VALUE
    };
    if (reinterpret_cast<uintptr_t>(map) % 64) return bad("tensorMap not 64-byte aligned");
    const uint32_t esz = dtype_bytes(data_type);
    if (!esz) return bad("unknown tensorDataType " + std::to_string(data_type));
    if (rank < 1 || rank > 5) return bad("tensorRank " + std::to_string(rank) + " (1..5)");
    if (interleave > 2) return bad("interleave " + std::to_string(interleave));
    if (interleave != 0 && rank < 3) return bad("interleaved layouts need rank >= 3");
    if (interleave != 0) return bad("interleaved layouts are not emulated");
    if (swizzle > 3) return bad("swizzle " + std::to_string(swizzle) + " (0..3 are emulated)");
    if (l2_promotion > 3) return bad("l2Promotion " + std::to_string(l2_promotion));
    if (oob_fill > 1) return bad("oobFill " + std::to_string(oob_fill));
    if (oob_fill == 1 && !(data_type == 6 || data_type == 7 || data_type == 8 || data_type == 9 || data_type >= 10))
        return bad("NAN_REQUEST_ZERO_FMA fill needs a floating-point type");
    if (oob_fill == 1) return bad("NAN_REQUEST_ZERO_FMA fill is not emulated");
    if (reinterpret_cast<uintptr_t>(global_address) % 16) return bad("globalAddress not 16-byte aligned");
    for (uint32_t i = 0; i < rank; ++i) {
        if (global_dim[i] == 0 || global_dim[i] > (1ull << 32))
            return bad("globalDim[" + std::to_string(i) + "] = " + std::to_string(global_dim[i]) + " (1..2^32)");
        if (box_dim[i] == 0 || box_dim[i] > 256)
            return bad("boxDim[" + std::to_string(i) + "] = " + std::to_string(box_dim[i]) + " (1..256)");
        if (element_strides[i] == 0 || element_strides[i] > 8)
            return bad("elementStrides[" + std::to_string(i) + "] = " + std::to_string(element_strides[i]) + " (1..8)");
        if (element_strides[i] != 1) return bad("elementStrides other than 1 are not emulated");
    }
    for (uint32_t i = 0; i + 1 < rank; ++i)
        if (global_strides[i] % 16 || global_strides[i] >= (1ull << 40))
            return bad("globalStrides[" + std::to_string(i) + "] = " + std::to_string(global_strides[i]) +
                       " (a multiple of 16 below 2^40)");
    const uint32_t inner = box_dim[0] * esz;
    if (inner % 16) return bad("boxDim[0] * element size = " + std::to_string(inner) + " bytes, not a multiple of 16");
    if (swizzle != 0 && inner > sm90::swizzle_width(sm90::tma_swizzle(swizzle)))
        return bad("boxDim[0] * element size = " + std::to_string(inner) + " bytes exceeds the swizzle span");
    uint64_t w[16] = {};
    w[0] = kMapMagic;
    w[1] = reinterpret_cast<uint64_t>(global_address);
    for (uint32_t i = 0; i < rank; ++i) {
        w[2 + i] = global_dim[i];
        w[7 + i] = i == 0 ? esz : global_strides[i - 1];
    }
    for (uint32_t i = 0; i < rank; ++i) {
        w[12] |= static_cast<uint64_t>(box_dim[i] & 0x1FF) << (9 * i);
        w[13] |= static_cast<uint64_t>(element_strides[i] & 0xF) << (4 * i);
    }
    w[14] = data_type | (rank << 8) | (interleave << 12) | (swizzle << 16) | (l2_promotion << 20) | (uint64_t{oob_fill} << 24);
    w[15] = kMapMagic ^ w[1] ^ w[14];
    std::memcpy(map, w, sizeof w);
    return 0;
}

bool decode_tensor_map(const void* map, TensorMapFields* out) {
    uint64_t w[16];
    std::memcpy(w, map, sizeof w);
    if (w[0] != kMapMagic || w[15] != (kMapMagic ^ w[1] ^ w[14])) return false;
    TensorMapFields f{};
    f.global_address = w[1];
    f.data_type = w[14] & 0xFF;
    f.rank = (w[14] >> 8) & 0xF;
    f.interleave = (w[14] >> 12) & 0xF;
    f.swizzle = (w[14] >> 16) & 0xF;
    f.l2_promotion = (w[14] >> 20) & 0xF;
    f.oob_fill = (w[14] >> 24) & 0xF;
    for (uint32_t i = 0; i < f.rank && i < 5; ++i) {
        f.dims[i] = w[2 + i];
        f.strides[i] = w[7 + i];
        f.box[i] = (w[12] >> (9 * i)) & 0x1FF;
        f.elem_strides[i] = (w[13] >> (4 * i)) & 0xF;
    }
    *out = f;
    return true;
}

}  // namespace emu

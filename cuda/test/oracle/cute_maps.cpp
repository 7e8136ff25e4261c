// The implementation of cute_maps.h: the only file compiled against the CuTe headers. Each
// function evaluates one of CuTe's own layout objects (no formula of ours in between).
#include "cute_maps.h"

#include <cute/atom/copy_traits_sm75.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm80.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/version.h>

#include <cstdio>

#include "quiet_stdout.h"
#include <type_traits>

namespace cute_oracle {

using namespace cute;
constexpr GMMA::Major K = GMMA::Major::K;
constexpr GMMA::Major MN = GMMA::Major::MN;

// f16 and bf16 share every layout (so one set of tables serves both; our kernels rely on it).
static_assert(std::is_same_v<MMA_Traits<SM90_64x64x16_F32F16F16_SS<K, K>>::CLayout,
                             MMA_Traits<SM90_64x64x16_F32BF16BF16_SS<K, K>>::CLayout>);
static_assert(std::is_same_v<MMA_Traits<SM90_64x64x16_F32F16F16_RS<K, MN>>::ALayout,
                             MMA_Traits<SM90_64x64x16_F32BF16BF16_RS<K, MN>>::ALayout>);
static_assert(std::is_same_v<MMA_Traits<SM90_64x64x16_F32F16F16_RS<K, MN>>::BLayout,
                             MMA_Traits<SM90_64x64x16_F32BF16BF16_RS<K, MN>>::BLayout>);
static_assert(std::is_same_v<MMA_Traits<SM90_64x64x32_F32E4M3E4M3_SS_TN<>>::CLayout,
                             MMA_Traits<SM90_64x64x16_F32BF16BF16_SS<K, K>>::CLayout>);
static_assert(std::is_same_v<MMA_Traits<SM80_16x8x16_F32F16F16F32_TN>::ALayout,
                             MMA_Traits<SM80_16x8x16_F32BF16BF16F32_TN>::ALayout>);
static_assert(std::is_same_v<MMA_Traits<SM80_16x8x16_F32F16F16F32_TN>::BLayout,
                             MMA_Traits<SM80_16x8x16_F32BF16BF16F32_TN>::BLayout>);
static_assert(std::is_same_v<MMA_Traits<SM80_16x8x16_F32F16F16F32_TN>::CLayout,
                             MMA_Traits<SM80_16x8x16_F32BF16BF16F32_TN>::CLayout>);
static_assert(sizeof_bits_v<half_t> == sizeof_bits_v<bfloat16_t>);

const char* cutlass_version() {
    static char v[32];
    std::snprintf(v, sizeof v, "%d.%d.%d", CUTLASS_MAJOR, CUTLASS_MINOR, CUTLASS_PATCH);
    return v;
}

namespace {

constexpr RowCol kNone{-1, -1};

// A (thread, value) -> index layout over an M x N (column-major: index = row + M * col) tile.
template <int M, class TV>
RowCol tv_map(TV tv, int thread, int value) {
    const int idx = static_cast<int>(tv(thread, value));
    return RowCol{idx % M, idx / M};
}

template <int N>
RowCol c_map_n(int thread, int value) {
    return tv_map<64>(GMMA::CLayout_64xN<N>{}, thread, value);
}
template <int... I>
RowCol c_map_dispatch(int n, int thread, int value, std::integer_sequence<int, I...>) {
    RowCol r = kNone;
    ((n == 8 * (I + 1) ? (r = c_map_n<8 * (I + 1)>(thread, value), 0) : 0), ...);
    return r;
}

using cute_oracle::QuietStdout;

template <GMMA::Major Mj, int Sw, class T>
auto atom() {
    if constexpr (Mj == K) {
        if constexpr (Sw == 128) return GMMA::Layout_K_SW128_Atom<T>{};
        else if constexpr (Sw == 64) return GMMA::Layout_K_SW64_Atom<T>{};
        else if constexpr (Sw == 32) return GMMA::Layout_K_SW32_Atom<T>{};
        else return GMMA::Layout_K_INTER_Atom<T>{};
    } else {
        if constexpr (Sw == 128) return GMMA::Layout_MN_SW128_Atom<T>{};
        else if constexpr (Sw == 64) return GMMA::Layout_MN_SW64_Atom<T>{};
        else if constexpr (Sw == 32) return GMMA::Layout_MN_SW32_Atom<T>{};
        else return GMMA::Layout_MN_INTER_Atom<T>{};
    }
}

// One instantiated operand tile: CuTe smem tensor over a 1024-aligned host buffer, partitioned by
// a one-warpgroup TiledMMA of `Op` as CuTe's collective mainloops do (thread 0's slice: for SS/RS
// smem operands every thread holds the same descriptors).
template <class Op, class T, GMMA::Major Mj, bool IsA, int Sw, int MNx, int Kx>
struct Tile {
    static auto layout() {
        if constexpr (Mj == K) return tile_to_shape(atom<Mj, Sw, T>(), Shape<Int<MNx>, Int<Kx>>{});
        else return tile_to_shape(atom<Mj, Sw, T>(), Shape<Int<MNx>, Int<Kx>>{}, Step<_2, _1>{});
    }
    static T* buffer() {
        alignas(1024) static T buf[MNx * Kx];
        return buf;
    }
    static auto tensor() { return make_tensor(make_smem_ptr(buffer()), layout()); }
    static bool offset(int mn, int k, int64_t* out) {
        if (mn < 0 || mn >= MNx || k < 0 || k >= Kx) return false;
        auto t = tensor();
        *out = reinterpret_cast<const char*>(&t(mn, k)) - reinterpret_cast<const char*>(buffer());
        return true;
    }
    static bool desc(int mb, int kb, GmmaDescriptor* out) {
        auto t = tensor();
        auto thr = make_tiled_mma(Op{}).get_thread_slice(0);
        QuietStdout quiet;
        if constexpr (IsA) {
            auto f = thr.partition_fragment_A(t);  // (MMA, MMA_M, MMA_K) descriptors
            if (mb < 0 || mb >= size<1>(f) || kb < 0 || kb >= size<2>(f)) return false;
            *out = f(0, mb, kb);
        } else {
            auto f = thr.partition_fragment_B(t);  // (MMA, MMA_N, MMA_K) descriptors
            if (mb < 0 || mb >= size<1>(f) || kb < 0 || kb >= size<2>(f)) return false;
            *out = f(0, mb, kb);
        }
        return true;
    }
};

struct Entry {
    GmmaTile tile;
    bool (*desc)(int, int, GmmaDescriptor*);
    bool (*offset)(int, int, int64_t*);
};

template <class Op, class T, GMMA::Major Mj, bool IsA, int Sw, int MNx, int Kx, int Inst>
constexpr Entry entry() {
    using Tl = Tile<Op, T, Mj, IsA, Sw, MNx, Kx>;
    return Entry{GmmaTile{IsA ? Operand::A : Operand::B, Mj == K ? Major::K : Major::MN,
                          int(sizeof_bits_v<T>), Sw, MNx, Kx, Inst},
                 &Tl::desc, &Tl::offset};
}

using Ss16 = SM90_64x64x16_F32BF16BF16_SS<K, K>;
using Ss8 = SM90_64x64x32_F32E4M3E4M3_SS_TN<>;
using Rs16n64 = SM90_64x64x16_F32BF16BF16_RS<K, MN>;
using Rs16n128 = SM90_64x128x16_F32BF16BF16_RS<K, MN>;
using Rs16n256 = SM90_64x256x16_F32BF16BF16_RS<K, MN>;
using Ss16Mn = SM90_64x64x16_F32BF16BF16_SS<K, MN>;
using Ss16MnA = SM90_64x64x16_F32BF16BF16_SS<MN, K>;
using Ss16n256 = SM90_64x256x16_F32BF16BF16_SS<K, K>;
using Bf = bfloat16_t;
using E4 = float_e4m3_t;

// The tiles our FA3 kernels use (cuda/fa3/traits.cuh: Q [BM x D] as A, K [BN x D] as B,
// both K-major; V [BN x D] as the MN-major B [D x BN] of P V), the wider-N forms of the V
// descriptor (where LBO is used), the e4m3 K-major tiles FP8 will need, and for the emulator's
// decoder one tile per other swizzle mode (A and B, K- and MN-major, 16- and 8-bit) and one wide
// K-major B.
const Entry kEntries[] = {
    // Q: A, K-major, 16-bit, rows = BM (64: stages 1-2; 128: stages 3-5; one instruction = 64 rows).
    entry<Ss16, Bf, K, true, 128, 64, 64, 64>(),
    entry<Ss16, Bf, K, true, 128, 64, 128, 64>(),
    entry<Ss16, Bf, K, true, 128, 64, 256, 64>(),
    entry<Ss16, Bf, K, true, 128, 128, 64, 64>(),
    entry<Ss16, Bf, K, true, 128, 128, 128, 64>(),
    entry<Ss16, Bf, K, true, 128, 128, 256, 64>(),
    // K: B, K-major, 16-bit, [BN x D] with BN = 128 (D <= 128) or 64 (D = 256), N = 64.
    entry<Ss16, Bf, K, false, 128, 128, 64, 64>(),
    entry<Ss16, Bf, K, false, 128, 128, 128, 64>(),
    entry<Ss16, Bf, K, false, 128, 64, 256, 64>(),
    // V: B, MN-major, 16-bit, [D x BN], N = 64 (what the kernel issues) and wider N.
    entry<Rs16n64, Bf, MN, false, 128, 64, 128, 64>(),
    entry<Rs16n64, Bf, MN, false, 128, 128, 128, 64>(),
    entry<Rs16n128, Bf, MN, false, 128, 128, 128, 128>(),
    entry<Rs16n64, Bf, MN, false, 128, 256, 64, 64>(),
    entry<Rs16n128, Bf, MN, false, 128, 256, 64, 128>(),
    entry<Rs16n256, Bf, MN, false, 128, 256, 64, 256>(),
    // e4m3 (FP8: wgmma takes 8-bit operands K-major only), K = 32 per instruction. A 64-element
    // row is 64 bytes: head_dim 64 fits only the 64B swizzle.
    entry<Ss8, E4, K, true, 64, 64, 64, 64>(),
    entry<Ss8, E4, K, true, 128, 64, 128, 64>(),
    entry<Ss8, E4, K, true, 128, 64, 256, 64>(),
    entry<Ss8, E4, K, true, 64, 128, 64, 64>(),
    entry<Ss8, E4, K, true, 128, 128, 128, 64>(),
    entry<Ss8, E4, K, true, 128, 128, 256, 64>(),
    entry<Ss8, E4, K, false, 64, 128, 64, 64>(),
    entry<Ss8, E4, K, false, 128, 128, 128, 64>(),
    entry<Ss8, E4, K, false, 128, 128, 256, 64>(),
    entry<Ss8, E4, K, false, 128, 64, 256, 64>(),
    // Vᵀ of the FP8 consumer at head_dim 256: [256 x 64 keys], B, K-major, 64-byte rows.
    entry<Ss8, E4, K, false, 64, 256, 64, 64>(),
    // The other swizzle modes, 16-bit 64 x 64 tiles.
    entry<Ss16, Bf, K, true, 64, 64, 64, 64>(),
    entry<Ss16, Bf, K, true, 32, 64, 64, 64>(),
    entry<Ss16, Bf, K, true, 0, 64, 64, 64>(),
    entry<Ss16Mn, Bf, MN, false, 128, 64, 64, 64>(),
    entry<Ss16Mn, Bf, MN, false, 64, 64, 64, 64>(),
    entry<Ss16Mn, Bf, MN, false, 32, 64, 64, 64>(),
    entry<Ss16Mn, Bf, MN, false, 0, 64, 64, 64>(),
    // For the emulator's decoder (cuda/test/oracle/check_emu.cpp), which serves any operand the
    // ISA allows: MN-major A from shared memory in every swizzle mode (transpose-A), e4m3 in the
    // two remaining modes, and a K-major B of one N = 256 instruction (the widest SBO walk).
    entry<Ss16MnA, Bf, MN, true, 128, 64, 64, 64>(),
    entry<Ss16MnA, Bf, MN, true, 64, 64, 64, 64>(),
    entry<Ss16MnA, Bf, MN, true, 32, 64, 64, 64>(),
    entry<Ss16MnA, Bf, MN, true, 0, 64, 64, 64>(),
    entry<Ss8, E4, K, true, 32, 64, 64, 64>(),
    entry<Ss8, E4, K, true, 0, 64, 64, 64>(),
    entry<Ss16n256, Bf, K, false, 128, 256, 64, 256>(),
};

bool same_tile(const GmmaTile& a, const GmmaTile& b) {
    return a.operand == b.operand && a.major == b.major && a.elem_bits == b.elem_bits &&
           a.swizzle_bytes == b.swizzle_bytes && a.mn == b.mn && a.k == b.k && a.inst_mn == b.inst_mn;
}
const Entry* find(const GmmaTile& t) {
    for (const Entry& e : kEntries)
        if (same_tile(e.tile, t)) return &e;
    return nullptr;
}

}  // namespace

RowCol wgmma_c_map(int n, int thread, int value) {
    if (n < 8 || n > 256 || n % 8 || thread < 0 || thread >= 128 || value < 0 || value >= n / 2)
        return kNone;
    return c_map_dispatch(n, thread, value, std::make_integer_sequence<int, 32>{});
}

RowCol wgmma_a_map(int elem_bits, int thread, int value) {
    if (thread < 0 || thread >= 128) return kNone;
    if (elem_bits == 16 && value >= 0 && value < 8) return tv_map<64>(GMMA::ALayout_64x16{}, thread, value);
    if (elem_bits == 8 && value >= 0 && value < 16) return tv_map<64>(GMMA::ALayout_64x32{}, thread, value);
    return kNone;
}

uint32_t swizzle_addr(int swizzle_bytes, uint32_t a) {
    switch (swizzle_bytes) {
        case 128: return Swizzle<3, 4, 3>{}(a);
        case 64: return Swizzle<2, 4, 3>{}(a);
        case 32: return Swizzle<1, 4, 3>{}(a);
        case 0: return Swizzle<0, 4, 3>{}(a);
    }
    return ~0u;
}

namespace {
template <GMMA::Major Mj, int Sw, class T>
int atom_offset(int mn, int k) {
    alignas(1024) static T buf[1024 / sizeof(T)];
    auto t = make_tensor(make_smem_ptr(buf), atom<Mj, Sw, T>());
    if (mn < 0 || mn >= size<0>(t) || k < 0 || k >= size<1>(t)) return -1;
    return static_cast<int>(reinterpret_cast<const char*>(&t(mn, k)) - reinterpret_cast<const char*>(buf));
}
template <GMMA::Major Mj, class T>
int atom_offset_sw(int sw, int mn, int k) {
    switch (sw) {
        case 128: return atom_offset<Mj, 128, T>(mn, k);
        case 64: return atom_offset<Mj, 64, T>(mn, k);
        case 32: return atom_offset<Mj, 32, T>(mn, k);
        case 0: return atom_offset<Mj, 0, T>(mn, k);
    }
    return -1;
}
template <GMMA::Major Mj>
int atom_offset_eb(int sw, int eb, int mn, int k) {
    switch (eb) {
        case 1: return atom_offset_sw<Mj, uint8_t>(sw, mn, k);
        case 2: return atom_offset_sw<Mj, uint16_t>(sw, mn, k);
        case 4: return atom_offset_sw<Mj, uint32_t>(sw, mn, k);
    }
    return -1;
}
}  // namespace

int swizzle_atom_offset(Major major, int swizzle_bytes, int elem_bytes, int mn, int k) {
    return major == Major::K ? atom_offset_eb<K>(swizzle_bytes, elem_bytes, mn, k)
                             : atom_offset_eb<MN>(swizzle_bytes, elem_bytes, mn, k);
}

bool gmma_tile_supported(const GmmaTile& tile) { return find(tile) != nullptr; }

const GmmaTile* gmma_tiles(int* n) {
    static GmmaTile tiles[sizeof kEntries / sizeof kEntries[0]];
    *n = 0;
    for (const Entry& e : kEntries) tiles[(*n)++] = e.tile;
    return tiles;
}

bool gmma_desc(const GmmaTile& tile, int mn_block, int k_block, GmmaDesc* out) {
    const Entry* e = find(tile);
    GmmaDescriptor d;
    if (!e || !e->desc(mn_block, k_block, &d)) return false;
    out->raw = d.desc_;
    out->start_offset = static_cast<uint32_t>(d.bitfield.start_address_) << 4;
    out->lbo = static_cast<uint32_t>(d.bitfield.leading_byte_offset_) << 4;
    out->sbo = static_cast<uint32_t>(d.bitfield.stride_byte_offset_) << 4;
    out->base_offset = d.bitfield.base_offset_;
    out->layout_type = d.bitfield.layout_type_;
    return true;
}

GmmaDesc gmma_desc_fields(uint64_t raw) {
    GmmaDescriptor d(raw);
    return GmmaDesc{raw,
                    static_cast<uint32_t>(d.bitfield.start_address_) << 4,
                    static_cast<uint32_t>(d.bitfield.leading_byte_offset_) << 4,
                    static_cast<uint32_t>(d.bitfield.stride_byte_offset_) << 4,
                    d.bitfield.base_offset_,
                    d.bitfield.layout_type_};
}

uint64_t gmma_desc_pack(uint32_t start_bytes, uint32_t lbo_bytes, uint32_t sbo_bytes, int base_offset,
                        int layout_type) {
    GmmaDescriptor d;  // all bits 0
    d.bitfield.start_address_ = static_cast<uint16_t>((start_bytes >> 4) & 0x3FFF);
    d.bitfield.leading_byte_offset_ = static_cast<uint16_t>((lbo_bytes >> 4) & 0x3FFF);
    d.bitfield.stride_byte_offset_ = static_cast<uint16_t>((sbo_bytes >> 4) & 0x3FFF);
    d.bitfield.base_offset_ = static_cast<uint8_t>(base_offset & 7);
    d.bitfield.layout_type_ = static_cast<uint8_t>(layout_type & 3);
    return d.desc_;
}

bool gmma_tile_offset(const GmmaTile& tile, int mn, int k, int64_t* byte_offset) {
    const Entry* e = find(tile);
    return e && e->offset(mn, k, byte_offset);
}

// ---- sm_80

using Sm80 = MMA_Traits<SM80_16x8x16_F32BF16BF16F32_TN>;

RowCol mma16816_a_map(int lane, int value) {
    if (lane < 0 || lane >= 32 || value < 0 || value >= 8) return kNone;
    return tv_map<16>(Sm80::ALayout{}, lane, value);  // (M16 x K16)
}
RowCol mma16816_b_map(int lane, int value) {
    if (lane < 0 || lane >= 32 || value < 0 || value >= 4) return kNone;
    const RowCol nk = tv_map<8>(Sm80::BLayout{}, lane, value);  // CuTe's B is N x K
    return RowCol{nk.col, nk.row};
}
RowCol mma16816_c_map(int lane, int value) {
    if (lane < 0 || lane >= 32 || value < 0 || value >= 4) return kNone;
    return tv_map<16>(Sm80::CLayout{}, lane, value);  // (M16 x N8)
}

namespace {
// Copy traits map (thread, value) -> bit of the copied block. The source side: thread s supplies
// 128 bits (one 8-element row); the destination: lane, (bit, register). Inverting the source
// layout on the destination's bit names the supplying lane and the element in its row.
template <class Traits>
LdsmSource ldsm(int lane, int reg, int half) {
    using Src = typename Traits::SrcLayout;
    using Dst = typename Traits::DstLayout;
    const int vflat = 16 * half + 32 * reg;  // first bit of the element, in the (bits, regs) order
    if (vflat >= size<1>(Dst{})) return LdsmSource{-1, -1, -1};
    const int bit = static_cast<int>(Dst{}(lane, vflat));
    for (int s = 0; s < 32; ++s)
        for (int b = 0; b < 128; b += 16)
            if (static_cast<int>(Src{}(s, b)) == bit) return LdsmSource{s / 8, s % 8, b / 16};
    return LdsmSource{-1, -1, -1};
}
}  // namespace

LdsmSource ldmatrix_map(int num, bool trans, int lane, int reg, int half) {
    if (lane < 0 || lane >= 32 || reg < 0 || reg >= num || half < 0 || half > 1) return LdsmSource{-1, -1, -1};
    if (!trans) {
        if (num == 1) return ldsm<Copy_Traits<SM75_U32x1_LDSM_N>>(lane, reg, half);
        if (num == 2) return ldsm<Copy_Traits<SM75_U32x2_LDSM_N>>(lane, reg, half);
        if (num == 4) return ldsm<Copy_Traits<SM75_U32x4_LDSM_N>>(lane, reg, half);
    } else {
        if (num == 1) return ldsm<Copy_Traits<SM75_U16x2_LDSM_T>>(lane, reg, half);
        if (num == 2) return ldsm<Copy_Traits<SM75_U16x4_LDSM_T>>(lane, reg, half);
        if (num == 4) return ldsm<Copy_Traits<SM75_U16x8_LDSM_T>>(lane, reg, half);
    }
    return LdsmSource{-1, -1, -1};
}

}  // namespace cute_oracle

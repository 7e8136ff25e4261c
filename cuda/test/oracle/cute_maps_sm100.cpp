// The implementation of cute_maps_sm100.h, compiled against the CuTe headers: every answer is
// CuTe's own bitfield or layout object.
#include "cute_maps_sm100.h"

#include <cute/arch/mma_sm100_desc.hpp>
#include <cute/atom/mma_traits_sm100.hpp>
#include <cute/tensor.hpp>

#include <cstdio>

#include "quiet_stdout.h"

namespace cute_oracle {
namespace sm100 {

using namespace cute;

UmmaDescFields umma_desc_fields(uint64_t desc) {
    UMMA::SmemDescriptor d;
    d.desc_ = desc;
    return UmmaDescFields{d.start_address_, d.leading_byte_offset_, d.stride_byte_offset_, d.version_,
                          d.base_offset_,   d.lbo_mode_,            d.layout_type_};
}

uint64_t umma_desc_pack(const UmmaDescFields& f) {
    UMMA::SmemDescriptor d;
    d.start_address_ = static_cast<uint16_t>(f.start);
    d.leading_byte_offset_ = static_cast<uint16_t>(f.lbo);
    d.stride_byte_offset_ = static_cast<uint16_t>(f.sbo);
    d.version_ = static_cast<uint16_t>(f.version);
    d.base_offset_ = static_cast<uint8_t>(f.base_offset);
    d.lbo_mode_ = static_cast<uint8_t>(f.lbo_mode);
    d.layout_type_ = static_cast<uint8_t>(f.layout);
    return d.desc_;
}

IdescFields idesc_fields(uint32_t desc) {
    UMMA::InstrDescriptor d;
    d.desc_ = desc;
    return IdescFields{d.sparse_id2_, d.sparse_flag_, d.saturate_, d.c_format_, d.a_format_, d.b_format_, d.a_negate_,
                       d.b_negate_,   d.a_major_,     d.b_major_,  d.n_dim_,    d.m_dim_,    d.max_shift_};
}

namespace {
template <class T, int M, int N, UMMA::Major A, UMMA::Major B>
uint32_t idesc() {
    return static_cast<uint32_t>(UMMA::make_instr_desc<T, T, float, M, N, A, B>());
}
template <class T, int N>
uint32_t idesc_majors(bool a_mn, bool b_mn) {
    constexpr auto K = UMMA::Major::K;
    constexpr auto MN = UMMA::Major::MN;
    if (!a_mn && !b_mn) return idesc<T, 128, N, K, K>();
    if (!a_mn && b_mn) return idesc<T, 128, N, K, MN>();
    if (a_mn && !b_mn) return idesc<T, 128, N, MN, K>();
    return idesc<T, 128, N, MN, MN>();
}

using cute_oracle::QuietStdout;

template <int Kind>
auto tile_layout() {
    if constexpr (Kind == 0) return tile_to_shape(UMMA::Layout_K_SW128_Atom<half_t>{}, Shape<_128, _64>{});
    else if constexpr (Kind == 1)
        return tile_to_shape(UMMA::Layout_MN_SW128_Atom<half_t>{}, Shape<_64, _128>{}, Step<_2, _1>{});
    else return tile_to_shape(UMMA::Layout_MN_SW128_Atom<half_t>{}, Shape<_128, _128>{}, Step<_2, _1>{});
}
template <int Kind>
half_t* tile_buffer() {
    alignas(1024) static half_t buf[128 * 128];
    return buf;
}
template <int Kind>
bool tile_desc(int kb, uint64_t* out) {
    auto t = make_tensor(make_smem_ptr(tile_buffer<Kind>()), tile_layout<Kind>());
    constexpr int MNx = decltype(size<0>(t))::value;
    constexpr int Kx = decltype(size<1>(t))::value;
    if (kb < 0 || kb >= Kx / 16) return false;
    auto blk = local_tile(t, Shape<Int<MNx>, _16>{}, make_coord(0, kb));
    QuietStdout quiet;
    if constexpr (Kind == 0) *out = UMMA::make_umma_desc<UMMA::Major::K>(blk);
    else *out = UMMA::make_umma_desc<UMMA::Major::MN>(blk);
    return true;
}
template <int Kind>
int64_t tile_offset(int mn, int k) {
    auto t = make_tensor(make_smem_ptr(tile_buffer<Kind>()), tile_layout<Kind>());
    if (mn < 0 || mn >= int(size<0>(t)) || k < 0 || k >= int(size<1>(t))) return -1;
    return reinterpret_cast<const char*>(&t(mn, k)) - reinterpret_cast<const char*>(tile_buffer<Kind>());
}
}  // namespace

bool make_idesc_f16(bool bf16, int m, int n, bool a_mn, bool b_mn, uint32_t* out) {
    if (m != 128 || (n != 64 && n != 128)) return false;
    if (bf16) *out = n == 64 ? idesc_majors<bfloat16_t, 64>(a_mn, b_mn) : idesc_majors<bfloat16_t, 128>(a_mn, b_mn);
    else *out = n == 64 ? idesc_majors<half_t, 64>(a_mn, b_mn) : idesc_majors<half_t, 128>(a_mn, b_mn);
    return true;
}

bool umma_tile_desc(int kind, int kb, uint64_t* out) {
    switch (kind) {
        case 0: return tile_desc<0>(kb, out);
        case 1: return tile_desc<1>(kb, out);
        case 2: return tile_desc<2>(kb, out);
        default: return false;
    }
}
int64_t umma_tile_offset(int kind, int mn, int k) {
    switch (kind) {
        case 0: return tile_offset<0>(mn, k);
        case 1: return tile_offset<1>(mn, k);
        case 2: return tile_offset<2>(mn, k);
        default: return -1;
    }
}
int umma_tile_mn(int kind) { return kind == 1 ? 64 : 128; }
int umma_tile_k(int kind) { return kind == 0 ? 64 : 128; }

}  // namespace sm100
}  // namespace cute_oracle

// Self-tests of TMA: a box read before or after its mbarrier wait, boxes out of bounds with the
// swizzle, misaligned destinations, bad maps, writes into a copy in flight, the encoder's argument
// checks.
#include "harness.h"

namespace selftest {
namespace {

// A TMA box read (ldmatrix) without waiting on its mbarrier, or (wait_first) after the wait: the
// read fails by happens-before whatever the land policy.
void tma_read_before_wait(int policy, bool wait_first) {
    alignas(128) static unsigned char map[128];
    static uint16_t g[64 * 8];
    const uint64_t dims[2] = {64, 8}, strides[1] = {128};
    const uint32_t box[2] = {64, 8}, es[2] = {1, 1};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, strides, box, es, 0, 0, 0, 0, nullptr) == 0);
    g_land_policy = policy;
    launch(32, 8192, [wait_first] {
        uint8_t* base = smem_aligned();
        uint64_t* bar = reinterpret_cast<uint64_t*>(base + 4096);
        if (tid() == 0) {
            fa3::mbar_init(bar, 1);
            fa3::mbar_init_fence();
        }
        __syncthreads();
        if (tid() == 0) {
            fa3::mbar_arrive_expect_tx(bar, 1024);
            const int32_t c[2] = {0, 0};
            emu::tma_load(saddr(base), map, saddr(bar), c, 2);
        }
        if (wait_first) fa3::mbar_wait(bar, 0);
        uint32_t r[4];
        fa2::ldmatrix_x4(r, saddr(base + 16 * (tid() % 8) + 128 * (tid() / 8)));
        if (!wait_first) fa3::mbar_wait(bar, 0);
    });
}

// A [rows x 64] bf16 tensor in global memory, boxes of {64, 64} with the 128B swizzle: a box
// partly past the end is zero-filled, one starting at a negative row too; the bytes complete
// the mbarrier phase.
void tma_box_oob_swizzle() {
    static std::vector<uint16_t> g(100 * 64);
    for (int r = 0; r < 100; ++r)
        for (int c = 0; c < 64; ++c) g[r * 64 + c] = bf16_bits(pat(r, c, 3));
    alignas(128) static unsigned char map[128];
    const uint64_t dims[2] = {64, 100}, strides[1] = {128};
    const uint32_t box[2] = {64, 64}, es[2] = {1, 1};
    std::string why;
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g.data(), dims, strides, box, es, 0, 3, 0, 0, &why) == 0);
    for (uint64_t seed = 1; seed <= 3; ++seed)
        launch(128, 40000, [&] {
            uint8_t* base = smem_aligned();
            uint64_t* bar = reinterpret_cast<uint64_t*>(base + 3 * 8192);
            if (tid() == 0) {
                fa3::mbar_init(bar, 1);
                fa3::mbar_init_fence();
            }
            __syncthreads();
            const int rows0[3] = {0, 64, -10};
            if (tid() == 0) {
                fa3::mbar_arrive_expect_tx(bar, 3 * 8192);
                for (int b = 0; b < 3; ++b) {
                    const int32_t c[2] = {0, rows0[b]};
                    emu::tma_load(saddr(base + b * 8192), map, saddr(bar), c, 2);
                }
            }
            fa3::mbar_wait(bar, 0);
            // Element (r, c) of box b: 128-byte rows, 16-byte chunk index XOR (row % 8).
            for (int b = 0; b < 3; ++b)
                for (int r = static_cast<int>(tid()) % 64; r < 64; r += 64)
                    for (int c = 0; c < 64; ++c) {
                        const int gr = rows0[b] + r;
                        const uint16_t want = gr >= 0 && gr < 100 ? g[gr * 64 + c] : 0;
                        const int off = r * 128 + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2;
                        uint16_t got;
                        std::memcpy(&got, base + b * 8192 + off, 2);
                        CHECK(got == want);
                    }
        }, seed);
}

void tma_dst_misaligned() {
    alignas(128) static unsigned char map[128];
    static uint16_t g[64 * 8];
    const uint64_t dims[2] = {64, 8}, strides[1] = {128};
    const uint32_t box[2] = {64, 8}, es[2] = {1, 1};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, strides, box, es, 0, 0, 0, 0, nullptr) == 0);
    launch(32, 8192, [] {
        uint8_t* base = smem_aligned();
        uint64_t* bar = reinterpret_cast<uint64_t*>(base + 4096);
        if (tid() == 0) {
            fa3::mbar_init(bar, 1);
            fa3::mbar_init_fence();
            const int32_t c[2] = {0, 0};
            emu::tma_load(saddr(base + 64), map, saddr(bar), c, 2);
        }
    });
}

void tma_bad_map() {
    launch(32, 8192, [] {
        alignas(128) unsigned char junk[128] = {};
        if (tid() == 0) fa3::tma_prefetch_desc(reinterpret_cast<const fa3::TmaDesc*>(junk));
    });
}

void tma_dst_written_in_flight() {
    alignas(128) static unsigned char map[128];
    static uint16_t g[64 * 8];
    const uint64_t dims[2] = {64, 8}, strides[1] = {128};
    const uint32_t box[2] = {64, 8}, es[2] = {1, 1};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, strides, box, es, 0, 3, 0, 0, nullptr) == 0);
    launch(32, 8192, [] {
        uint8_t* base = smem_aligned();
        uint64_t* bar = reinterpret_cast<uint64_t*>(base + 4096);
        if (tid() == 0) {
            fa3::mbar_init(bar, 1);
            fa3::mbar_init_fence();
        }
        __syncthreads();
        if (tid() == 0) {
            fa3::mbar_arrive_expect_tx(bar, 1024);
            const int32_t c[2] = {0, 0};
            emu::tma_load(saddr(base), map, saddr(bar), c, 2);
            base[10] = 1;  // an ordinary store into the destination before the copy landed
        }
        fa3::mbar_wait(bar, 0);
    }, 1);
}

void encode_rejects() {
    alignas(128) static unsigned char map[128];
    static uint16_t g[64 * 64];
    const uint64_t dims[2] = {64, 64};
    const uint32_t es[2] = {1, 1};
    std::string why;
    const uint64_t bad_stride[1] = {120};
    const uint32_t box[2] = {64, 64};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, bad_stride, box, es, 0, 3, 0, 0, &why) == 1);
    CHECK(why.find("globalStrides") != std::string::npos);
    const uint64_t stride[1] = {128};
    const uint32_t big_box[2] = {64, 300};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, stride, big_box, es, 0, 3, 0, 0, &why) == 1);
    CHECK(why.find("boxDim[1]") != std::string::npos);
    const uint32_t wide[2] = {128, 8};
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g, dims, stride, wide, es, 0, 3, 0, 0, &why) == 1);
    CHECK(why.find("swizzle span") != std::string::npos);
    CHECK(emu::encode_tensor_map_tiled(map, 9, 2, g + 1, dims, stride, box, es, 0, 3, 0, 0, &why) == 1);
    CHECK(why.find("16-byte aligned") != std::string::npos);
}

}  // namespace

std::vector<Test> tma_tests() {
    return {
        {"tma_read_after_wait_ok", nullptr, [] { for (int p = 0; p < 3; ++p) tma_read_before_wait(p, true); }},
        {"tma_read_before_wait_late", "happens-before: ldmatrix.x4 by thread", [] { tma_read_before_wait(0, false); }},
        {"tma_read_before_wait_soon", "the missing acquire: mbarrier.try_wait.parity(0)", [] { tma_read_before_wait(1, false); }},
        {"tma_read_before_wait_at_once", "the missing acquire: mbarrier.try_wait.parity(0)", [] { tma_read_before_wait(2, false); }},
        {"tma_box_oob_swizzle", nullptr, tma_box_oob_swizzle},
        {"tma_dst_misaligned", "not 128-byte aligned", tma_dst_misaligned},
        {"tma_bad_map", "not a tensor map", tma_bad_map},
        {"tma_dst_written_in_flight", "were written before it landed", tma_dst_written_in_flight},
        {"encode_rejects", nullptr, encode_rejects},
    };
}

}  // namespace selftest

// Self-tests of the drivers' guarded buffers (guarded_buffers.h): writes on either side, a read
// onto the guard page, a store onto it inside a launch.
#include "harness.h"

namespace selftest {
namespace {

// guarded_buffers.h: a write into the rounding slack on either side of a buffer is reported, a
// read past the slack faults on the guard page, and a buffer survives a move.
void report_overwrite(const emu_buffers::Guarded& g) {
    if (const char* where = g.overwritten()) {
        std::fprintf(stderr, "a write %s of the buffer\n", where);
        std::_Exit(3);
    }
}
void buffer_guards_ok() {
    emu_buffers::Guarded g(100, "t");
    for (int i = 0; i < 100; ++i) g.data()[i] = static_cast<unsigned char>(i);
    emu_buffers::Guarded moved = std::move(g);
    CHECK(g.data() == nullptr && moved.bytes() == 100 && moved.data()[99] == 99);
    report_overwrite(moved);
}
void buffer_written_past_end() {
    emu_buffers::Guarded g(100, "t");
    g.data()[100] = 0;
    report_overwrite(g);
}
void buffer_written_before_start() {
    emu_buffers::Guarded g(100, "t");
    g.data()[-1] = 0;
    report_overwrite(g);
}
void buffer_read_past_guard() {
    std::signal(SIGSEGV, [](int) {
        const char msg[] = "fault on the guard page\n";
        (void)!write(2, msg, sizeof msg - 1);
        std::_Exit(3);
    });
    emu_buffers::Guarded g(100, "t");
    const volatile unsigned char* p = g.data();
    std::printf("%d\n", p[256]);  // the rounding slack ends at 256: the next byte is the guard page
}

// A store onto a buffer's guard page by one thread of a launch: the fault report names the
// thread and the buffer.
void fault_is_diagnosed() {
    emu_buffers::Buffer b;
    b.name = "o";
    b.dev = 0x4000;
    b.mem = emu_buffers::Guarded(100, "o");
    emu_buffers::g_buffers.push_back(std::move(b));
    emu::set_fault_describer(&emu_buffers::describe_host_address);
    unsigned char* p = emu_buffers::g_buffers.back().mem.data();
    launch(64, 1024, [p] {
        if (tid() == 33) {
            volatile unsigned char* q = p;
            q[300] = 1;
        }
    });
}

}  // namespace

std::vector<Test> buffers_tests() {
    return {
        {"buffer_guards_ok", nullptr, buffer_guards_ok},
        {"buffer_written_past_end", "a write past the end of the buffer", buffer_written_past_end},
        {"buffer_written_before_start", "a write before the start of the buffer", buffer_written_before_start},
        {"buffer_read_past_guard", "fault on the guard page", buffer_read_past_guard},
        {"fault_is_diagnosed", "thread 33 (warpgroup 0, warp 1, lane 1)\n  the address: 200 bytes past the end of buffer o (device 0x4000",
         fault_is_diagnosed},
    };
}

}  // namespace selftest

// The launch files tests/support/emu.rs writes for the emulator's drivers (driver.cpp for the
// forward kernels, fp8_prepass_main.cpp for the FP8 pre-pass): one directive per line,
// `key value...`, blank lines and '#' comments skipped. The reading, the number and hex parsing
// and the error exit live here once; each driver handles its own directives.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace emu_launch {

// The name a driver's errors start with ("emu driver", "fp8 prepass driver").
inline const char* g_program = "emu driver";

[[noreturn]] inline void usage_error(const std::string& msg) {
    std::fprintf(stderr, "%s: %s\n", g_program, msg.c_str());
    std::exit(2);
}

// A decimal or 0x-prefixed number (strtoull: a leading '-' wraps, as the drivers always took it).
inline uint64_t num(const std::string& s) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(s.c_str(), &end, 0);
    if (!end || *end) usage_error("not a number: " + s);
    return v;
}

// `params <hex>`: exactly `bytes` bytes as 2 hex digits each, appended to `out`.
inline void hex_bytes(const std::string& h, size_t bytes, std::vector<unsigned char>& out) {
    if (h.size() != 2 * bytes) usage_error("params: expected " + std::to_string(2 * bytes) + " hex digits");
    for (size_t i = 0; i < h.size(); i += 2) out.push_back(static_cast<unsigned char>(std::stoul(h.substr(i, 2), nullptr, 16)));
}

// The values of one directive; need(n) exits with a message naming the key when fewer are given.
struct Directive {
    std::string key;
    std::vector<std::string> a;
    void need(size_t n) const {
        if (a.size() < n) usage_error("too few values for " + key);
    }
};

// Calls on(d) for every directive of the file at `path`.
template <class F> void for_each_directive(const char* path, F&& on) {
    std::ifstream in(path);
    if (!in) usage_error(std::string("cannot read ") + path);
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream ls(line);
        Directive d;
        if (!(ls >> d.key) || d.key[0] == '#') continue;
        for (std::string w; ls >> w;) d.a.push_back(w);
        on(d);
    }
}

}  // namespace emu_launch

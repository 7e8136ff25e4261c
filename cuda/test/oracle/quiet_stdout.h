// CuTe's descriptor builders (make_gmma_desc, make_umma_desc) call cast_smem_ptr_to_uint, which on
// the host prints "ERROR: ... not supported" to stdout and returns 0 for the start address
// (documented in cute_maps.h). The message is expected in the oracle, so stdout is pointed at
// /dev/null while one of these lives.
#pragma once
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>

namespace cute_oracle {

struct QuietStdout {
    int saved = -1;
    QuietStdout() {
        std::fflush(stdout);
        saved = dup(1);
        const int null = open("/dev/null", O_WRONLY);
        if (null >= 0) {
            dup2(null, 1);
            close(null);
        }
    }
    ~QuietStdout() {
        std::fflush(stdout);
        if (saved >= 0) {
            dup2(saved, 1);
            close(saved);
        }
    }
};

}  // namespace cute_oracle

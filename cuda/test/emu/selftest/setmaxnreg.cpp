// Self-tests of setmaxnreg: the register pool, a non-uniform warpgroup, an exhausted pool.
#include "harness.h"

namespace selftest {
namespace {

void setmaxnreg_ok() {
    launch(384, 1024, [] {
        if (tid() < 128) fa3::setmaxnreg_dec<24>();
        else fa3::setmaxnreg_inc<240>();
    }, 1, 168);
}
void setmaxnreg_nonuniform() {
    launch(256, 1024, [] {
        if (tid() < 64) fa3::setmaxnreg_dec<24>();
        else if (tid() < 128) fa3::setmaxnreg_dec<32>();
    }, 1, 168);
}
void setmaxnreg_pool_exhausted() {
    launch(384, 1024, [] {
        if (tid() >= 128) fa3::setmaxnreg_inc<240>();  // nobody gives registers back
    }, 1, 168);
}

}  // namespace

std::vector<Test> setmaxnreg_tests() {
    return {
        {"setmaxnreg_ok", nullptr, setmaxnreg_ok},
        {"setmaxnreg_nonuniform", "must be warpgroup-uniform", setmaxnreg_nonuniform},
        {"setmaxnreg_pool_exhausted", "the CTA pool has 0 free", setmaxnreg_pool_exhausted},
    };
}

}  // namespace selftest

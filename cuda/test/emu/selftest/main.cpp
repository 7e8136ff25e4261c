// The CPU emulator's self-tests (tests/emulator/forward.rs runs them): small kernels that use each
// emulated primitive correctly (and must pass, with results checked against host arithmetic)
// or break one of its rules (and must fail with the expected diagnosis). Each test runs in a
// forked child, so a failing emulator check (which exits) is observed from outside. The tests
// live by topic in this directory (harness.h: what they share).
//
//   selftest            run every test, print PASS/FAIL per test, exit 1 if any is unexpected
//   selftest <name>     run one test in-process (for debugging)
#include "harness.h"

namespace selftest {
namespace {

const std::vector<Test>& tests() {
    static const std::vector<Test> t = [] {
        std::vector<Test> all;
        for (auto topic : {scheduling_tests, barriers_tests, collectives_tests, cp_async_tests, tma_tests, mbarrier_tests,
                           wgmma_tests, tcgen05_tests, setmaxnreg_tests, buffers_tests}) {
            std::vector<Test> v = topic();
            all.insert(all.end(), v.begin(), v.end());
        }
        return all;
    }();
    return t;
}

}  // namespace
}  // namespace selftest

int main(int argc, char** argv) {
    using selftest::Test, selftest::tests;
    if (argc == 2) {
        for (const Test& t : tests())
            if (argv[1] == std::string(t.name)) {
                t.run();
                std::printf("%s: returned normally\n", t.name);
                return 0;
            }
        std::fprintf(stderr, "no test %s\n", argv[1]);
        return 2;
    }
    int bad = 0;
    for (const Test& t : tests()) {
        int fds[2];
        if (pipe(fds) != 0) return 2;
        std::fflush(stdout);
        const pid_t pid = fork();
        if (pid == 0) {
            dup2(fds[1], 1);
            dup2(fds[1], 2);
            close(fds[0]);
            t.run();
            std::fflush(stdout);
            std::_Exit(0);
        }
        close(fds[1]);
        std::string out;
        char buf[4096];
        for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
        close(fds[0]);
        int status = 0;
        waitpid(pid, &status, 0);
        const bool exited_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        bool ok;
        if (!t.expect) ok = exited_ok;
        else ok = !exited_ok && out.find("SELFTEST CHECK FAILED") == std::string::npos && out.find(t.expect) != std::string::npos;
        std::printf("%s %s%s%s%s\n", ok ? "PASS" : "FAIL", t.name, t.expect ? " (must fail: " : "", t.expect ? t.expect : "",
                    t.expect ? ")" : "");
        if (!ok) {
            ++bad;
            std::printf("---- output of %s (status %d):\n%s----\n", t.name, status, out.c_str());
        }
    }
    std::printf("%d of %zu emulator self-tests as expected\n", static_cast<int>(tests().size()) - bad, tests().size());
    return bad ? 1 : 0;
}

// The churn of benches/c/churn.c through C++'s new/delete: plain `new`,
// the hinted `new` with a hot hint, and with a cold one (the heap of cold
// blocks of the node the block is placed on). Prints the thread's CPU
// nanoseconds per new+delete pair of each, on one line.
//
//   hotcold ROUNDS
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <new>

#include "numaweave.h"

static std::uint64_t cpu_ns() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000u + static_cast<std::uint64_t>(ts.tv_nsec);
}

// hint < 0: plain new.
static double churn(std::size_t rounds, int hint) {
    std::uint64_t x = 0x9e3779b97f4a7c15ull;
    void *live[256];
    std::size_t n = 0;
    std::uint64_t t = cpu_ns();
    for (std::size_t i = 0; i < rounds; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::size_t size = static_cast<std::size_t>(16) << (x % 11);
        void *p = hint < 0 ? ::operator new(size) : ::operator new(size, static_cast<__hot_cold_t>(hint));
        if (n < 256) {
            live[n++] = p;
        } else {
            std::size_t k = i % 256;
            ::operator delete(live[k]);
            live[k] = p;
        }
    }
    double ns = static_cast<double>(cpu_ns() - t) / static_cast<double>(rounds);
    for (std::size_t k = 0; k < n; k++) ::operator delete(live[k]);
    return ns;
}

int main(int argc, char **argv) {
    std::size_t rounds = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 2000000;
    churn(rounds / 10, -1);
    double plain = churn(rounds, -1), hot = churn(rounds, 254), cold = churn(rounds, 1);
    std::printf("%.3f %.3f %.3f\n", plain, hot, cold);
    return 0;
}

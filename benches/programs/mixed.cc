// OLogN's alloc-test "real-world load" simulation, as its description
// gives it: C++ new/delete of skewed random sizes (most small, a few
// large: the size's exponent drawn with a falling probability), a working
// set of live objects replaced at random, in 1 or more threads, each
// thread its own set. Prints operations a second.
//
//   mixed [THREADS [OPS_PER_THREAD]]
#include <pthread.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>

static long ops = 10000000;

static void *work(void *arg) {
    uint64_t x = 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)arg * 7919;
    const unsigned live = 1 << 14;
    char **set = new char *[live]();
    for (long i = 0; i < ops; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        unsigned k = (unsigned)(x % live);
        delete[] set[k];
        // Skewed: the exponent is the number of trailing ones of a random
        // word (half the sizes below 16 bytes, a quarter below 32, ...).
        unsigned e = (unsigned)__builtin_ctzll(~(x >> 20)) % 12;
        size_t size = (size_t)1 << (e + 3);
        size += (x >> 40) % size;
        set[k] = new char[size];
        set[k][0] = (char)i;
    }
    for (unsigned k = 0; k < live; k++) delete[] set[k];
    delete[] set;
    return nullptr;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? std::atoi(argv[1]) : 1;
    if (argc > 2) ops = std::atol(argv[2]);
    timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    pthread_t *t = new pthread_t[threads];
    for (int i = 0; i < threads; i++) pthread_create(&t[i], nullptr, work, (void *)(uintptr_t)(i + 1));
    for (int i = 0; i < threads; i++) pthread_join(t[i], nullptr);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    delete[] t;
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    std::printf("mixed: %.0f new+delete a second, %d thread(s)\n", (double)threads * (double)ops / s, threads);
    return 0;
}

/* The mixed-size churn of benches/capi.rs, in C, through malloc/free (the
 * library it is linked or preloaded with): 256 live blocks of 16 B - 16 KiB
 * replaced one by one, the same xorshift sequence as the Rust side. Prints
 * the thread's CPU nanoseconds per alloc+free pair.
 *
 *   churn ROUNDS */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static uint64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static double churn(size_t rounds) {
    uint64_t x = 0x9e3779b97f4a7c15ull;
    void *live[256];
    size_t n = 0;
    uint64_t t = cpu_ns();
    for (size_t i = 0; i < rounds; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        void *p = malloc((size_t)16 << (x % 11));
        if (!p) abort();
        if (n < 256) {
            live[n++] = p;
        } else {
            size_t k = i % 256;
            free(live[k]);
            live[k] = p;
        }
    }
    double ns = (double)(cpu_ns() - t) / (double)rounds;
    for (size_t k = 0; k < n; k++) free(live[k]);
    return ns;
}

int main(int argc, char **argv) {
    size_t rounds = argc > 1 ? strtoull(argv[1], NULL, 10) : 2000000;
    churn(rounds / 10); /* warm-up */
    printf("%.3f\n", churn(rounds));
    return 0;
}

/* glibc's benchtests/bench-malloc-thread, as its description gives it: each
 * of T threads allocates and frees its own blocks of random small sizes
 * (a distribution favouring the smallest, up to 32 KiB), keeping a working
 * set of live blocks it replaces at random; no block crosses threads.
 * Prints iterations a second, all threads together.
 *
 *   perthread [THREADS [ITERATIONS_PER_THREAD]]
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define WORKING_SET 1024
static long iterations = 10000000;

static void *work(void *arg) {
    uint64_t x = 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)arg * 7919;
    void *set[WORKING_SET] = {0};
    for (long i = 0; i < iterations; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        unsigned k = (unsigned)(x % WORKING_SET);
        free(set[k]);
        /* Small sizes most often: the square of a uniform in [0, 1). */
        double u = (double)(x >> 11) / (double)(1ull << 53);
        size_t size = 1 + (size_t)(u * u * u * 32768.0);
        char *p = malloc(size);
        if (!p) abort();
        p[0] = (char)i;
        set[k] = p;
    }
    for (int k = 0; k < WORKING_SET; k++) free(set[k]);
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    if (argc > 2) iterations = atol(argv[2]);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    pthread_t t[64];
    if (threads > 64) threads = 64;
    for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, work, (void *)(uintptr_t)(i + 1));
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    printf("perthread: %.0f iterations a second, %d thread(s)\n", (double)threads * (double)iterations / s, threads);
    return 0;
}

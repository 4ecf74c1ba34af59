/* glibc's benchtests/bench-malloc-simple, as its description gives it:
 * one thread, a loop of same-size malloc/free pairs, for sizes from 16
 * bytes to 4 KiB (the thread cache's and fast bins' case), then the same
 * with a second thread started first (so a single-thread shortcut cannot
 * serve it). Prints ns per pair, averaged over the sizes.
 *
 *   simple [PAIRS_PER_SIZE]
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double ns_per_pair(long pairs) {
    static const size_t sizes[] = {16, 32, 48, 64, 100, 128, 256, 512, 1024, 2048, 4096};
    const int n = sizeof sizes / sizeof *sizes;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int s = 0; s < n; s++)
        for (long i = 0; i < pairs; i++) {
            void *volatile p = malloc(sizes[s]);
            free(p);
        }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)(pairs * n);
}

static void *idle(void *arg) { return arg; }

int main(int argc, char **argv) {
    long pairs = argc > 1 ? atol(argv[1]) : 2000000;
    double one = ns_per_pair(pairs);
    pthread_t t;
    pthread_create(&t, NULL, idle, NULL);
    pthread_join(t, NULL);
    double two = ns_per_pair(pairs);
    printf("simple: %.2f ns a pair, %.2f with a second thread started\n", one, two);
    return 0;
}

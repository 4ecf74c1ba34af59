/* Larson and Krishnan's server benchmark ("Memory allocation for
 * long-running server applications", ISMM 1998), as its description gives
 * it: each of T threads owns an array of N slots filled with blocks of
 * 10-1000 bytes; it replaces a random slot's block (free, then malloc of a
 * random size) R times, then starts a new thread that takes over the same
 * array (so the new thread frees the old one's blocks: remote frees) and
 * exits. Threads end and start all the time, as a server's connections do.
 * Runs a fixed number of generations and prints the replacements a second.
 *
 *   larson [THREADS [GENERATIONS [SLOTS [ROUNDS]]]]
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int threads = 2, generations = 400, slots = 1000, rounds = 10000;

struct lane {
    void **blocks;
    uint64_t x;
    int left; /* generations still to run */
};

static void *generation(void *arg) {
    struct lane *l = arg;
    uint64_t x = l->x;
    for (int i = 0; i < rounds; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        size_t k = x % (uint64_t)slots;
        free(l->blocks[k]);
        size_t size = 10 + (x >> 32) % 991;
        char *p = malloc(size);
        if (!p) abort();
        p[0] = (char)i;
        p[size - 1] = (char)k;
        l->blocks[k] = p;
    }
    l->x = x;
    if (--l->left > 0) {
        /* The next generation takes the array over; this thread ends. */
        pthread_t t;
        if (pthread_create(&t, NULL, generation, l) != 0) abort();
        pthread_detach(t);
    } else {
        l->left = -1;
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1) threads = atoi(argv[1]);
    if (argc > 2) generations = atoi(argv[2]);
    if (argc > 3) slots = atoi(argv[3]);
    if (argc > 4) rounds = atoi(argv[4]);
    struct lane *lanes = calloc((size_t)threads, sizeof *lanes);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int t = 0; t < threads; t++) {
        lanes[t].blocks = calloc((size_t)slots, sizeof(void *));
        lanes[t].x = 0x9e3779b97f4a7c15ull ^ (uint64_t)(t + 1) * 7919;
        lanes[t].left = generations;
        for (int k = 0; k < slots; k++) lanes[t].blocks[k] = malloc(10 + (size_t)k % 991);
        pthread_t th;
        if (pthread_create(&th, NULL, generation, &lanes[t]) != 0) abort();
        pthread_detach(th);
    }
    /* Wait for every lane's last generation (detached threads). */
    for (;;) {
        int done = 1;
        for (int t = 0; t < threads; t++)
            if (__atomic_load_n(&lanes[t].left, __ATOMIC_ACQUIRE) != -1) done = 0;
        if (done) break;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    for (int t = 0; t < threads; t++) {
        for (int k = 0; k < slots; k++) free(lanes[t].blocks[k]);
        free(lanes[t].blocks);
    }
    free(lanes);
    printf("larson: %.0f replacements/s\n", (double)threads * generations * rounds / s);
    return 0;
}

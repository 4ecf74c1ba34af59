/* mimalloc-bench's mleak pattern, as its description gives it: rounds of
 * 10 threads, each of which makes one small long-lived block (16 words,
 * calloc), swaps it into a shared table of 1,000 slots at a random place
 * and frees the block it took out (made by an earlier, exited thread: a
 * remote free into a heap no thread owns), then exits. What an allocator
 * keeps per thread it started, and how it deals with a thread that leaves
 * one block behind, shows in the time and the memory. Prints nothing but
 * a checksum.
 *
 *   mleak [ROUNDS_OF_100]
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define THREADS 10
#define SLOTS (THREADS * 100)

static _Atomic(intptr_t *) table[SLOTS];

static void *leak(void *arg) {
    uint64_t x = (uintptr_t)arg * 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
    intptr_t *p = calloc(16, sizeof(void *));
    if (!p) abort();
    p[0] = (intptr_t)arg;
    intptr_t *q = atomic_exchange(&table[x % SLOTS], p);
    free(q);
    return NULL;
}

int main(int argc, char **argv) {
    int rounds = (argc > 1 ? atoi(argv[1]) : 10) * 100;
    uintptr_t k = 1;
    for (int n = 0; n < rounds; n++) {
        pthread_t t[THREADS];
        for (int i = 0; i < THREADS; i++)
            if (pthread_create(&t[i], NULL, leak, (void *)k++)) abort();
        for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    }
    intptr_t sum = 0;
    for (int i = 0; i < SLOTS; i++) {
        intptr_t *p = atomic_load(&table[i]);
        if (p) sum += p[0];
        free(p);
    }
    printf("mleak: %ld\n", (long)sum);
    return 0;
}

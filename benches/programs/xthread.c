/* Workload class "cross-thread frees": a producer allocates blocks of
 * mixed sizes (1 B - 2 KiB) and passes them through a queue to a consumer,
 * which reads and frees them: every free is a remote free. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QN 4096
static void *q[QN];
static atomic_size_t head, tail;
static size_t total;

static void *consumer(void *arg) {
    (void)arg;
    size_t got = 0, sum = 0;
    while (got < total) {
        size_t t = atomic_load_explicit(&tail, memory_order_acquire);
        size_t h = atomic_load_explicit(&head, memory_order_relaxed);
        if (h == t) continue;
        while (h != t) {
            unsigned char *p = q[h % QN];
            sum += p[0];
            free(p);
            h++;
            got++;
        }
        atomic_store_explicit(&head, h, memory_order_release);
    }
    printf("%zu\n", sum);
    return NULL;
}

int main(int argc, char **argv) {
    total = argc > 1 ? strtoull(argv[1], NULL, 10) : 10000000;
    pthread_t c;
    pthread_create(&c, NULL, consumer, NULL);
    uint64_t x = 0x2545f4914f6cdd1dull;
    for (size_t i = 0; i < total; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        size_t size = 1 + (x % 2048);
        unsigned char *p = malloc(size);
        p[0] = (unsigned char)i;
        while (atomic_load_explicit(&tail, memory_order_relaxed) - atomic_load_explicit(&head, memory_order_acquire) >= QN) {
        }
        size_t t = atomic_load_explicit(&tail, memory_order_relaxed);
        q[t % QN] = p;
        atomic_store_explicit(&tail, t + 1, memory_order_release);
    }
    pthread_join(c, NULL);
    return 0;
}

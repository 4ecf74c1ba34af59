/* Cross-thread frees at any thread count: T threads in a ring, each
 * allocating blocks of 16 B - 4 KiB (a server's requests and buffers),
 * writing them, and handing them through a bounded queue to the next
 * thread, which reads and frees them (every free a remote one), as a task
 * handed between a runtime's workers frees what another allocated. Each
 * thread also allocates and frees one block of its own per handed one.
 * Prints blocks handed a second, all threads together.
 *
 *   ring [THREADS [BLOCKS_PER_THREAD]]
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define QN 1024 /* a power of two */
#define BATCH 32

struct queue {
    _Alignas(64) atomic_size_t head; /* written by the consumer */
    _Alignas(64) atomic_size_t tail; /* written by the producer */
    _Alignas(64) void *slot[QN];
};

static struct queue *queues;
static int threads = 2;
static long per = 2000000;

static size_t size_of(uint64_t x) { return (size_t)16 << (x % 9); /* 16 B - 4 KiB */ }

static uint64_t next(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* Frees what the previous thread handed over; returns how many. */
static long drain(struct queue *in) {
    size_t h = atomic_load_explicit(&in->head, memory_order_relaxed);
    size_t t = atomic_load_explicit(&in->tail, memory_order_acquire);
    long n = 0;
    for (; h != t; h++, n++) {
        unsigned char *p = in->slot[h % QN];
        if (p[0] != (unsigned char)(uintptr_t)p) abort(); /* written by its maker */
        free(p);
    }
    atomic_store_explicit(&in->head, h, memory_order_release);
    return n;
}

static void *work(void *arg) {
    int k = (int)(uintptr_t)arg;
    struct queue *out = &queues[k], *in = &queues[(k + threads - 1) % threads];
    uint64_t x = 0x9e3779b97f4a7c15ull ^ (uint64_t)(k + 1) * 7919;
    long made = 0, freed = 0;
    while (made < per || freed < per) {
        long before = made + freed;
        size_t t = atomic_load_explicit(&out->tail, memory_order_relaxed);
        size_t h = atomic_load_explicit(&out->head, memory_order_acquire);
        for (int i = 0; i < BATCH && made < per && t - h < QN; i++, made++, t++) {
            size_t n = size_of(next(&x));
            unsigned char *p = malloc(n);
            if (!p) abort();
            memset(p, (unsigned char)(uintptr_t)p, n < 64 ? n : 64);
            out->slot[t % QN] = p;
            void *own = malloc(size_of(next(&x))); /* a thread's own short-lived block */
            if (!own) abort();
            free(own);
        }
        atomic_store_explicit(&out->tail, t, memory_order_release);
        freed += drain(in);
        if (made + freed == before) sched_yield(); /* more threads than CPUs: let the others run */
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1) threads = atoi(argv[1]);
    if (argc > 2) per = atol(argv[2]);
    if (threads < 1 || per < 1) return 2;
    queues = aligned_alloc(64, sizeof *queues * (size_t)threads);
    if (!queues) return 1;
    memset(queues, 0, sizeof *queues * (size_t)threads);
    pthread_t *t = malloc(sizeof *t * (size_t)threads);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < threads; i++)
        if (pthread_create(&t[i], NULL, work, (void *)(uintptr_t)i)) return 1;
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    double s = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9;
    printf("ring: %.0f blocks handed a second, %d thread(s)\n", (double)threads * (double)per / s, threads);
    free(t);
    free(queues);
    return 0;
}

/* rpmalloc's benchmark pattern as mimalloc-bench runs it (`rptest N 0 1 2
 * 500 1000 100 8 16000`), written from its description: N threads, each
 * with a table of 1,000 slots. Each loop a thread frees some 25-80 of its
 * slots' blocks (a prime stride through the table), frees the batches
 * other threads handed it, then fills some 31-99 slots with new blocks
 * (freeing what is there) of 8 to 16,000 bytes, small sizes the most
 * likely (a falling linear distribution), two thirds of those under 4 KiB
 * asked with 8- or 16-byte alignment, every OS page of a block written;
 * every second loop it also makes a batch of blocks and hands it to the
 * next thread (cross-thread frees), if that one took the last. Two
 * iterations of 500 loops, each ending with every block freed. Prints
 * operations a second.
 *
 *   rptest [THREADS [LOOPS]]
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SLOTS 1000
#define MIN_SIZE 8
#define MAX_SIZE 16000

struct batch {
    struct batch *next;
    size_t count;
    void **blocks;
};

struct worker {
    _Atomic(struct batch *) inbox;
    uint64_t x;
    long ops;
    int index;
};

static int threads = 2, loops = 500;
static struct worker *workers;
static pthread_barrier_t barrier;

static uint64_t next(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* 8 B to 16,000 B: a uniform draw scaled by a triangular one falling
 * to 0 at the top (rptest's "linear" size mode). */
static size_t size_of(uint64_t *x) {
    double even = (double)(next(x) % (MAX_SIZE - MIN_SIZE + 1));
    double w0 = (double)(next(x) % 100000) / 100000.0, w1 = (double)(next(x) % 100000) / 100000.0;
    double t = w0 + w1 - 1.0;
    return MIN_SIZE + (size_t)(even * (t < 0 ? -t : t));
}

static void *make(uint64_t *x, long *ops) {
    size_t size = size_of(x);
    void *p = NULL;
    unsigned a = (unsigned)(next(x) % 3);
    if (size < 4096 && a != 0) {
        if (posix_memalign(&p, a == 1 ? 8 : 16, size)) p = NULL;
    } else {
        p = malloc(size);
    }
    if (!p) abort();
    *(uint32_t *)p = (uint32_t)size;
    for (size_t off = 4096; off + 1 < size; off += 4096) ((char *)p)[off] = 1;
    ((char *)p)[size - 1] = 1;
    ++*ops;
    return p;
}

static void take(void *p, long *ops) {
    uint32_t size = *(uint32_t *)p;
    if (size < MIN_SIZE || size > MAX_SIZE || ((char *)p)[size - 1] != 1) abort();
    free(p);
    ++*ops;
}

static void drain(struct worker *w) {
    struct batch *b = atomic_exchange(&w->inbox, NULL);
    while (b) {
        struct batch *n = b->next;
        for (size_t i = 0; i < b->count; i++) take(b->blocks[i], &w->ops);
        free(b->blocks);
        free(b);
        w->ops += 2;
        b = n;
    }
}

static void *run(void *arg) {
    struct worker *w = arg;
    void **slots = calloc(SLOTS, sizeof(void *));
    if (!slots) abort();
    size_t ai = 0, fi = 0;
    for (int iter = 0; iter < 2; iter++) {
        pthread_barrier_wait(&barrier);
        for (int loop = 0; loop < loops; loop++) {
            size_t frees = 80 * (31 + next(&w->x) % 69) / 100, allocs = 31 + next(&w->x) % 69;
            for (size_t i = 0; i < frees; i++) {
                if (slots[fi]) take(slots[fi], &w->ops);
                slots[fi] = NULL;
                fi = (fi + 11) % SLOTS;
            }
            drain(w);
            for (size_t i = 0; i < allocs; i++) {
                if (slots[ai]) take(slots[ai], &w->ops);
                slots[ai] = make(&w->x, &w->ops);
                ai = (ai + 7) % SLOTS;
            }
            /* (A thread hands the next one a batch only while that one has
             * taken the last: one descheduled for long would otherwise
             * find hundreds of MiB waiting, and the peak RSS would measure
             * the scheduler. Each inbox has one producer, the thread before
             * it, so a store does.) */
            struct worker *to = &workers[(w->index + 1) % threads];
            if (threads > 1 && loop % 2 == 0 && !atomic_load(&to->inbox)) {
                struct batch *b = malloc(sizeof *b);
                if (!b || !(b->blocks = malloc(allocs * sizeof(void *)))) abort();
                b->count = allocs;
                b->next = NULL;
                for (size_t i = 0; i < allocs; i++) b->blocks[i] = make(&w->x, &w->ops);
                atomic_store(&to->inbox, b);
                w->ops += 2;
            }
        }
        /* Every thread done with its loops before the last batches are taken. */
        pthread_barrier_wait(&barrier);
        drain(w);
        for (size_t i = 0; i < SLOTS; i++) {
            if (slots[i]) take(slots[i], &w->ops);
            slots[i] = NULL;
        }
    }
    free(slots);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1) threads = atoi(argv[1]);
    if (argc > 2) loops = atoi(argv[2]);
    if (threads < 1 || loops < 1) return 2;
    workers = calloc((size_t)threads, sizeof *workers);
    pthread_t *t = calloc((size_t)threads, sizeof *t);
    if (!workers || !t || pthread_barrier_init(&barrier, NULL, (unsigned)threads)) return 1;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < threads; i++) {
        workers[i].x = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
        workers[i].index = i;
        if (pthread_create(&t[i], NULL, run, &workers[i])) return 1;
    }
    long ops = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(t[i], NULL);
        ops += workers[i].ops;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    printf("rptest: %.0f operations a second, %d threads\n", (double)ops / s, threads);
    free(workers);
    free(t);
    return 0;
}

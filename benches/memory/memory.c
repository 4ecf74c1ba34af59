/* What an allocator keeps: the memory workloads of benches/memory/run.py,
 * run under whichever malloc is preloaded. Each prints `key value` lines.
 *
 *   memory phases [PHASES]        a size mix that shifts phase by phase
 *   memory churn THREADS          short-lived threads, 8 at a time
 *   memory perthread THREADS      threads each holding 64 small blocks
 *   memory steady ROUNDS          a loop that frees and allocates the same
 *   memory until-null             1 MiB blocks until malloc fails
 *   memory robson [ROUNDS]        fill a budget, free every other block,
 *                                 double the size, again (Robson's pattern,
 *                                 as Mesh's fragmenter runs it)
 *
 * Bytes are resident bytes (/proc/self/statm) less those resident when
 * main() started, unless the key says otherwise. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define MIB (1024.0 * 1024.0)

static long page_size;
static size_t baseline;

static void die(const char *what) {
    fprintf(stderr, "memory: %s failed\n", what);
    exit(1);
}

/* Read with open/read into the stack, not stdio: a probe that called
 * malloc would be a slow path of the allocator it measures (churn reads
 * after every batch). */
static size_t resident(void) {
    char buf[128];
    int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof buf - 1);
    if (fd >= 0) close(fd);
    unsigned long size = 0, rss = 0;
    if (n <= 0) die("reading /proc/self/statm");
    buf[n] = 0;
    if (sscanf(buf, "%lu %lu", &size, &rss) != 2) die("reading /proc/self/statm");
    return rss * (size_t)page_size;
}

/* Resident bytes above the baseline (0 if below). */
static size_t held(void) {
    size_t r = resident();
    return r > baseline ? r - baseline : 0;
}

/* The process's peak resident set (VmHWM), bytes, above the baseline. */
static size_t peak(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    size_t kib = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %zu kB", &kib) == 1) break;
    if (f) fclose(f);
    size_t b = kib * 1024;
    return b > baseline ? b - baseline : 0;
}

static long minor_faults(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_minflt;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

/* A size between lo and hi, log-uniform. */
static size_t log_uniform(uint64_t *s, size_t lo, size_t hi) {
    double u = (next(s) >> 11) * (1.0 / 9007199254740992.0);
    double l = __builtin_log((double)lo), h = __builtin_log((double)hi);
    return (size_t)__builtin_exp(l + u * (h - l));
}

static void *xmalloc(size_t n) {
    void *p = malloc(n);
    if (!p) die("malloc");
    /* Touch every page, as a program writing its data does. */
    for (size_t i = 0; i < n; i += 4096) ((volatile char *)p)[i] = 1;
    ((volatile char *)p)[n - 1] = 1;
    return p;
}

/* One small malloc/free every 10 ms for `seconds`: a program gone quiet. */
static void quiet(double seconds) {
    double end = now() + seconds;
    while (now() < end) {
        void *volatile p = malloc(64);
        free(p);
        usleep(10000);
    }
}

/* The preloaded allocator's own malloc_trim, if it has one. */
static int trim(void) {
    int (*t)(size_t) = (int (*)(size_t))dlsym(RTLD_DEFAULT, "malloc_trim");
    Dl_info in;
    if (!t || !dladdr((void *)t, &in) || !in.dli_fname) return 0;
    /* glibc's own trims glibc's malloc, which is not the one in use when
     * another is preloaded. */
    void *(*m)(size_t) = (void *(*)(size_t))dlsym(RTLD_DEFAULT, "malloc");
    Dl_info mi;
    if (!m || !dladdr((void *)m, &mi) || !mi.dli_fname || strcmp(mi.dli_fname, in.dli_fname) != 0) return 0;
    t(0);
    return 1;
}

/* What numaweave's statistics count, all nodes, in MiB, into `out`: free
 * memory the kernel still holds for it (`free_resident`, k = 13: free pages
 * waiting out the purge delay), free blocks of size-class pages still in use
 * (`stranded`, k = 17) and blocks other threads freed not yet collected
 * (`uncollected`, k = 18), from one snapshot; 0 under another allocator.
 * `numaweave_stats` fills `struct numaweave_node_stats` (numaweave.h): 19
 * counters of 8 bytes, the last two these. */
static int numaweave_mib(double out[3]) {
    static const int k[3] = {13, 17, 18};
    int (*stats)(uint64_t(*)[19], int) = (int (*)(uint64_t(*)[19], int))dlsym(RTLD_DEFAULT, "numaweave_stats");
    if (!stats) return 0;
    static uint64_t s[64][19];
    int n = stats(s, 64);
    for (int j = 0; j < 3; j++) {
        out[j] = 0;
        for (int i = 0; i < n && i < 64; i++) out[j] += (double)s[i][k[j]];
        out[j] /= MIB;
    }
    return 1;
}

/* ---- phases: a size mix that shifts, 64 MiB a phase, 75% freed at random by
 * other threads than those that allocated. */

enum { WORKERS = 4 };
static const size_t PHASE_BYTES = (size_t)64 << 20;

struct block {
    void *p;
    size_t n;
};
static struct block *pool;
static size_t pool_len, pool_cap;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_size_t live;

struct phase_arg {
    int phase, worker;
};

static void *phase_alloc(void *arg) {
    struct phase_arg *a = arg;
    /* Windows of sizes: 16-256 B, 64 B-1 KiB, ... 16-256 KiB, and back. */
    int w = a->phase % 12 < 6 ? a->phase % 12 : 11 - a->phase % 12;
    size_t lo = (size_t)16 << (2 * w), hi = lo * 16;
    uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(a->phase * WORKERS + a->worker + 1);
    size_t want = PHASE_BYTES / WORKERS, got = 0;
    size_t cap = 1024, len = 0;
    struct block *mine = malloc(cap * sizeof *mine);
    while (got < want) {
        size_t n = log_uniform(&s, lo, hi);
        if (len == cap) mine = realloc(mine, (cap *= 2) * sizeof *mine);
        mine[len++] = (struct block){xmalloc(n), n};
        got += n;
    }
    pthread_mutex_lock(&pool_lock);
    if (pool_len + len > pool_cap) {
        while (pool_len + len > pool_cap) pool_cap = pool_cap ? pool_cap * 2 : 65536;
        pool = realloc(pool, pool_cap * sizeof *pool);
        if (!pool) die("realloc");
    }
    memcpy(pool + pool_len, mine, len * sizeof *mine);
    pool_len += len;
    pthread_mutex_unlock(&pool_lock);
    free(mine);
    atomic_fetch_add(&live, got);
    return NULL;
}

/* Frees the blocks in [from, to) of the pool that the shuffle marked. */
struct free_arg {
    size_t from, to;
    unsigned char *marked;
};

static void *phase_free(void *arg) {
    struct free_arg *a = arg;
    size_t gone = 0;
    for (size_t i = a->from; i < a->to; i++)
        if (a->marked[i]) {
            free(pool[i].p);
            gone += pool[i].n;
            pool[i].p = NULL;
        }
    atomic_fetch_sub(&live, gone);
    return NULL;
}

static void phases(int count) {
    double peak_live = 0, ratio_sum = 0;
    uint64_t s = 42;
    for (int p = 0; p < count; p++) {
        pthread_t t[WORKERS];
        struct phase_arg pa[WORKERS];
        for (int w = 0; w < WORKERS; w++) {
            pa[w] = (struct phase_arg){p, w};
            if (pthread_create(&t[w], NULL, phase_alloc, &pa[w])) die("pthread_create");
        }
        for (int w = 0; w < WORKERS; w++) pthread_join(t[w], NULL);
        if (atomic_load(&live) > peak_live) peak_live = atomic_load(&live);
        /* 75% of what is live, at random, freed by four other threads (a
         * block's allocating thread is gone or elsewhere). */
        unsigned char *marked = calloc(pool_len, 1);
        for (size_t i = 0; i < pool_len; i++) marked[i] = next(&s) % 4 != 0;
        struct free_arg fa[WORKERS];
        for (int w = 0; w < WORKERS; w++) {
            fa[w] = (struct free_arg){pool_len * w / WORKERS, pool_len * (w + 1) / WORKERS, marked};
            if (pthread_create(&t[w], NULL, phase_free, &fa[w])) die("pthread_create");
        }
        for (int w = 0; w < WORKERS; w++) pthread_join(t[w], NULL);
        free(marked);
        size_t j = 0;
        for (size_t i = 0; i < pool_len; i++)
            if (pool[i].p) pool[j++] = pool[i];
        pool_len = j;
        double r = (double)held() / (double)atomic_load(&live);
        ratio_sum += r;
        printf("phase%d_live_mib %.1f\nphase%d_rss_mib %.1f\n", p, atomic_load(&live) / MIB, p, held() / MIB);
        double nw[3];
        if (numaweave_mib(nw))
            printf("phase%d_free_resident_mib %.1f\nphase%d_stranded_mib %.1f\nphase%d_uncollected_mib %.1f\n", p,
                   nw[0], p, nw[1], p, nw[2]);
    }
    printf("peak_live_mib %.1f\npeak_rss_mib %.1f\n", peak_live / MIB, peak() / MIB);
    printf("peak_rss_per_live %.2f\nmean_rss_per_live_after_frees %.2f\n", peak() / peak_live, ratio_sum / count);
    for (size_t i = 0; i < pool_len; i++) free(pool[i].p);
    pool_len = 0;
    free(pool);
    pool = NULL;
    printf("freed_rss_mib %.1f\n", held() / MIB);
    quiet(5.0);
    printf("quiet_rss_mib %.1f\n", held() / MIB);
    if (trim()) printf("trimmed_rss_mib %.1f\n", held() / MIB);
}

/* ---- churn: short-lived threads, 8 at a time, each allocating about 1 MiB
 * in mixed sizes and freeing 7/8 of it; the other 1/8 is freed by a thread
 * of the next batch. Resident memory between two batches swings with how
 * the batch's threads overlapped (10-25% under every allocator), so beside
 * the two samples after 1,000 threads and at the end it prints the median
 * of the samples after each batch over threads 501-1,000 and over the last
 * 500: a growth shows in those, one batch's overlap does not. */

enum { BATCH = 8, HANDED = 64 };
struct churn_arg {
    uint64_t seed;
    void **handed;     /* what this thread hands on */
    void **inherited;  /* what a thread of the last batch handed on */
};

static void *churn_thread(void *arg) {
    struct churn_arg *a = arg;
    for (int i = 0; i < HANDED; i++) {
        free(a->inherited[i]);
        a->inherited[i] = NULL;
    }
    void *mine[512];
    int n = 0, h = 0;
    size_t got = 0;
    while (got < (1 << 20) && n < 512) {
        size_t sz = log_uniform(&a->seed, 16, 16384);
        mine[n++] = xmalloc(sz);
        got += sz;
    }
    for (int i = 0; i < n; i++) {
        if (i % 8 == 0 && h < HANDED)
            a->handed[h++] = mine[i];
        else
            free(mine[i]);
    }
    return NULL;
}

static int cmp_size(const void *a, const void *b) {
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return (x > y) - (x < y);
}

static double median_mib(size_t *v, int n) {
    if (n == 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_size);
    return (n % 2 ? (double)v[n / 2] : ((double)v[n / 2 - 1] + (double)v[n / 2]) / 2) / MIB;
}

static void churn(long threads) {
    void *handed[2][BATCH][HANDED];
    memset(handed, 0, sizeof handed);
    struct churn_arg args[BATCH];
    long started = 0, batches = 0;
    enum { WINDOW = 500 / BATCH + 1 };
    size_t early[WINDOW], late[WINDOW];
    int n_early = 0, n_late = 0, late_at = 0;
    while (started < threads) {
        pthread_t t[BATCH];
        int b = (int)(batches & 1);
        for (int i = 0; i < BATCH; i++) {
            args[i] = (struct churn_arg){(uint64_t)(started + i + 1) * 0x9e3779b97f4a7c15ull, handed[b][i],
                                         handed[!b][(i + 3) % BATCH]};
            if (pthread_create(&t[i], NULL, churn_thread, &args[i])) die("pthread_create");
        }
        for (int i = 0; i < BATCH; i++) pthread_join(t[i], NULL);
        started += BATCH;
        batches++;
        size_t h = held();
        if (started == 1000) printf("rss_after_1000_mib %.1f\n", h / MIB);
        if (started > 500 && started <= 1000 && n_early < WINDOW) early[n_early++] = h;
        if (started > threads - 500) {
            late[late_at] = h; /* a ring: threads need not be a multiple of BATCH */
            late_at = (late_at + 1) % WINDOW;
            if (n_late < WINDOW) n_late++;
        }
    }
    printf("rss_at_end_mib %.1f\nthreads %ld\n", held() / MIB, started);
    /* Only when the two windows are whole and apart. */
    if (n_early == WINDOW && threads >= 1500) {
        double e = median_mib(early, n_early), l = median_mib(late, n_late);
        printf("rss_median_501_1000_mib %.1f\nrss_median_last_500_mib %.1f\n", e, l);
        if (e > 0) printf("rss_median_growth %.2f\n", l / e);
    }
    for (int b = 0; b < 2; b++)
        for (int i = 0; i < BATCH; i++)
            for (int j = 0; j < HANDED; j++) free(handed[b][i][j]);
}

/* ---- perthread: THREADS threads each holding 64 blocks of 16 B - 2 KiB. */

static pthread_barrier_t held_barrier, done_barrier;
static atomic_size_t perthread_live;

static void *holder(void *arg) {
    uint64_t s = (uint64_t)(uintptr_t)arg * 0x9e3779b97f4a7c15ull + 7;
    void *b[64];
    size_t got = 0;
    for (int i = 0; i < 64; i++) {
        size_t n = 16 + next(&s) % (2048 - 16 + 1);
        b[i] = xmalloc(n);
        got += n;
    }
    atomic_fetch_add(&perthread_live, got);
    pthread_barrier_wait(&held_barrier);
    pthread_barrier_wait(&done_barrier);
    for (int i = 0; i < 64; i++) free(b[i]);
    return NULL;
}

static void perthread(long threads) {
    pthread_t *t = malloc(threads * sizeof *t);
    pthread_barrier_init(&held_barrier, NULL, (unsigned)threads + 1);
    pthread_barrier_init(&done_barrier, NULL, (unsigned)threads + 1);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    /* Small stacks, so that 10,000 threads fit any address-space budget. */
    pthread_attr_setstacksize(&attr, 128 << 10);
    size_t before = held();
    for (long i = 0; i < threads; i++)
        if (pthread_create(&t[i], &attr, holder, (void *)(uintptr_t)(i + 1))) die("pthread_create");
    pthread_barrier_wait(&held_barrier);
    size_t during = held();
    printf("threads %ld\nlive_kib_per_thread %.1f\nrss_kib_per_thread %.1f\n", threads,
           atomic_load(&perthread_live) / 1024.0 / threads, (during - before) / 1024.0 / threads);
    pthread_barrier_wait(&done_barrier);
    for (long i = 0; i < threads; i++) pthread_join(t[i], NULL);
    free(t);
}

/* ---- steady: a loop that builds a document (200,000 small blocks and a
 * buffer grown by realloc to 16 MiB), frees it, rests 20 ms, and again. */

static void steady(int rounds) {
    enum { SMALL = 200000 };
    void **small = xmalloc(SMALL * sizeof *small);
    long faults_warm = 0;
    double t0 = 0;
    uint64_t s = 3;
    for (int r = 0; r < rounds; r++) {
        if (r == 2) {
            faults_warm = minor_faults();
            t0 = now();
        }
        for (int i = 0; i < SMALL; i++) small[i] = xmalloc(16 + next(&s) % 240);
        char *buf = NULL;
        for (size_t cap = 4096; cap <= (16 << 20); cap *= 2) {
            buf = realloc(buf, cap);
            if (!buf) die("realloc");
            memset(buf + cap / 2, 'x', cap / 2);
        }
        free(buf);
        for (int i = 0; i < SMALL; i++) free(small[i]);
        usleep(20000);
    }
    printf("faults_per_round %.0f\nseconds_per_round %.4f\n", (minor_faults() - faults_warm) / (double)(rounds - 2),
           (now() - t0) / (rounds - 2));
    printf("rss_after_loop_mib %.1f\n", held() / MIB);
    quiet(5.0);
    printf("quiet_rss_mib %.1f\n", held() / MIB);
    free(small);
}

/* ---- until-null: 1 MiB blocks until malloc fails (under a limit). */

static void until_null(void) {
    size_t n = 0;
    void *head = NULL;
    for (;;) {
        void **p = malloc(1 << 20);
        if (!p) break;
        *p = head;
        head = p;
        n++;
    }
    printf("mib_until_null %zu\n", n);
    while (head) {
        void *nx = *(void **)head;
        free(head);
        head = nx;
    }
}

/* ---- robson: Robson's worst case for allocators that do not move blocks,
 * the pattern of Mesh's `fragmenter` (PLDI 2019). Blocks of one size fill
 * a budget of live bytes; every other live block (in allocation order) is
 * freed, which leaves holes of the old size between survivors; the size
 * doubles and the budget is filled again. An allocator that reuses a hole
 * only for blocks that fit it needs new memory every round. */

static const size_t ROBSON_BUDGET = (size_t)64 << 20;

static void robson(int rounds) {
    size_t cap = ROBSON_BUDGET / 16 + 1, len = 0, live = 0;
    void **blocks = malloc(cap * sizeof *blocks);
    size_t *sizes = malloc(cap * sizeof *sizes);
    if (!blocks || !sizes) die("malloc");
    for (int r = 0; r < rounds; r++) {
        size_t sz = (size_t)16 << r;
        while (live + sz <= ROBSON_BUDGET) {
            if (len == cap) die("robson: the block list is full");
            void *p = xmalloc(sz);
            memset(p, r + 1, sz);
            blocks[len] = p;
            sizes[len++] = sz;
            live += sz;
        }
        size_t j = 0;
        for (size_t i = 0; i < len; i++) {
            if (i % 2 == 1) {
                free(blocks[i]);
                live -= sizes[i];
            } else {
                blocks[j] = blocks[i];
                sizes[j++] = sizes[i];
            }
        }
        len = j;
        printf("round%d_size %zu\nround%d_rss_mib %.1f\n", r, sz, r, held() / MIB);
    }
    /* Read before `peak()`, whose fopen is a malloc: a call after the frees
     * may be the one an allocator gives memory back on. */
    double end = held() / (double)live;
    printf("budget_mib %.1f\npeak_rss_mib %.1f\n", ROBSON_BUDGET / MIB, peak() / MIB);
    printf("peak_rss_per_budget %.2f\nend_rss_per_live %.2f\n", peak() / (double)ROBSON_BUDGET, end);
    /* What the allocator gives back with the survivors still live (the OS
     * pages only freed blocks cover): on its own while the program goes on
     * calling, and when asked (glibc's trim returns those pages too). */
    quiet(2.0);
    printf("quiet_rss_per_live %.2f\n", held() / (double)live);
    if (trim()) printf("trimmed_rss_per_live %.2f\n", held() / (double)live);
    for (size_t i = 0; i < len; i++) free(blocks[i]);
    free(blocks);
    free(sizes);
}

int main(int argc, char **argv) {
    page_size = sysconf(_SC_PAGESIZE);
    baseline = resident();
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *what = argc > 1 ? argv[1] : "";
    long n = argc > 2 ? atol(argv[2]) : 0;
    if (strcmp(what, "phases") == 0)
        phases(n ? (int)n : 12);
    else if (strcmp(what, "churn") == 0)
        churn(n ? n : 100000);
    else if (strcmp(what, "perthread") == 0)
        perthread(n ? n : 1000);
    else if (strcmp(what, "steady") == 0)
        steady(n ? (int)n : 20);
    else if (strcmp(what, "until-null") == 0)
        until_null();
    else if (strcmp(what, "robson") == 0)
        robson(n ? (int)n : 10);
    else {
        fprintf(stderr, "usage: memory phases|churn|perthread|steady|until-null|robson [N]\n");
        return 2;
    }
    return 0;
}

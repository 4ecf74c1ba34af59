/* The malloc ABI as the C standard and POSIX state it, checked on the
 * library a user gets (release, and hardened): linked with -lnumaweave (or
 * -lnumaweave_hardened). Exits non-zero at the first failure, saying which.
 *
 * - alignment (C23 7.24.3): a block of n bytes holds any object of
 *   fundamental alignment and of size <= n, so every entry point gives 16
 *   above 8 bytes (alignof(max_align_t) on x86-64), for every size to 4 KiB;
 *   a 16-aligned header with a flexible array member, allocated at its size
 *   plus 8, is stored to with an aligned SSE store;
 * - errno: a call that succeeds leaves it as it found it (POSIX.1-2024 asks
 *   this of free; programs rely on it of all), a failed one sets ENOMEM;
 * - a request the kernel's overcommit policy refuses (four times RAM and
 *   swap under vm.overcommit_memory 0 or 2) fails with NULL and ENOMEM,
 *   where the program can handle it. */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdalign.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "numaweave.h"
#include "check.h"

static volatile size_t HALF = SIZE_MAX / 2;

/* The alignment C23 asks of a block of n bytes: the largest fundamental
 * alignment of a type no larger than n. */
static size_t need(size_t n) {
    size_t a = alignof(max_align_t);
    while (a > 1 && a > n) a /= 2;
    return a;
}

/* Blocks of one size kept live at once. */
#define LIVE 8

static int aligned(const void *p, size_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

/* The block is the caller's, whole: written and read back. */
static void use(unsigned char *p, size_t n) {
    CHECK_AT(p != NULL && malloc_usable_size(p) >= n, n);
    memset(p, 0xa5, n);
    for (size_t i = 0; i < n; i += 61) CHECK_AT(p[i] == 0xa5, n);
}

static void test_alignment(void) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (size_t n = 0; n <= 4096; n++) {
        size_t a = need(n);
        /* Several blocks live at once: a block freed and asked for again
         * comes back at the same place, which may be aligned by luck. */
        unsigned char *live[LIVE];
        for (int k = 0; k < LIVE; k++) {
            live[k] = malloc(n);
            CHECK_AT(live[k] && aligned(live[k], a), n);
            use(live[k], n);
        }
        for (int k = 0; k < LIVE; k++) free(live[k]);
        for (int k = 0; k < LIVE; k++) {
            live[k] = k % 2 ? calloc(1, n) : calloc(n, 1);
            CHECK_AT(live[k] && aligned(live[k], a), n);
            for (size_t i = 0; i < n; i++) CHECK_AT(live[k][i] == 0, n);
        }
        for (int k = 0; k < LIVE; k++) free(live[k]);
        for (int k = 0; k < LIVE; k++) {
            live[k] = realloc(NULL, n);
            CHECK_AT(live[k] && aligned(live[k], a), n);
        }
        for (int k = 0; k < LIVE; k++) free(live[k]);
        unsigned char *p;
        if (n > 0) {
            /* Grown from one byte, shrunk from a page and more, and from
             * n + 8 (which may keep the block): contents kept, aligned. */
            p = malloc(1);
            p[0] = 0x5a;
            p = realloc(p, n);
            CHECK_AT(p && aligned(p, a) && p[0] == 0x5a, n);
            use(p, n);
            free(p);
            p = malloc(n + 5000);
            memset(p, 0x3c, n + 5000);
            p = realloc(p, n);
            CHECK_AT(p && aligned(p, a) && p[n - 1] == 0x3c, n);
            free(p);
            p = malloc(n + 8);
            memset(p, 0x3d, n + 8);
            p = realloc(p, n);
            CHECK_AT(p && aligned(p, a) && p[n - 1] == 0x3d, n);
            free(p);
            p = reallocarray(NULL, n, 1);
            CHECK_AT(p && aligned(p, a), n);
            free(p);
        }
        /* The aligned entry points at alignments below max_align_t: the
         * block must still hold any object of its size. */
        for (size_t al = 1; al <= 16; al *= 2) {
            size_t want = a > al ? a : al;
            for (int k = 0; k < LIVE; k++) {
                switch (k % 4) {
                case 0: live[k] = aligned_alloc(al, n); break;
                case 1: live[k] = memalign(al, n); break;
                case 2: {
                    void *q = NULL;
                    size_t pal = al < sizeof(void *) ? sizeof(void *) : al;
                    live[k] = posix_memalign(&q, pal, n) == 0 ? q : NULL;
                    break;
                }
                default: live[k] = numaweave_alloc_on_node(n, al, numaweave_current_node());
                }
                CHECK_AT(live[k] && aligned(live[k], want), n);
                use(live[k], n);
            }
            for (int k = 0; k < LIVE; k++) free(live[k]);
        }
        p = valloc(n);
        CHECK_AT(p && aligned(p, page), n);
        free(p);
        p = pvalloc(n);
        CHECK_AT(p && aligned(p, page) && malloc_usable_size(p) >= page, n);
        free(p);
    }
}

#if defined(__x86_64__)
/* A 16-aligned member, then a flexible array: `sizeof + 8` is 40 bytes,
 * not a multiple of 16. The store is `movaps`, which faults on a block
 * aligned to 8 only. */
struct msg {
    __m128 v;
    int n;
    char data[];
};

static void test_flexible_array(void) {
    struct msg *volatile keep[256];
    for (int i = 0; i < 256; i++) {
        struct msg *m = malloc(sizeof *m + 8 + (size_t)(i % 3) * 8);
        CHECK(m && aligned(m, 16));
        _mm_store_ps((float *)&m->v, _mm_set1_ps((float)i));
        m->n = i;
        keep[i] = m;
    }
    for (int i = 0; i < 256; i++) {
        float f[4];
        _mm_storeu_ps(f, keep[i]->v);
        CHECK(f[3] == (float)i && keep[i]->n == i);
        free(keep[i]);
    }
}
#else
static void test_flexible_array(void) {}
#endif

/* errno must be as it was after the expression (a call that succeeded). */
#define KEEPS_ERRNO(expr)                                                  \
    do {                                                                   \
        errno = 4242;                                                      \
        expr;                                                              \
        checks++;                                                          \
        if (errno != 4242) CHECK_FAILED(#expr, ": errno %d after it\n", errno); \
    } while (0)

static void *thread_allocs(void *arg) {
    (void)arg;
    int ok = 1;
    errno = 4242;
    void *p = malloc(100); /* the thread's first: its heap is made */
    ok &= p != NULL && errno == 4242;
    free(p);
    return (void *)(uintptr_t)ok;
}

static void test_errno(void) {
    void *p = NULL, *q = NULL;
    size_t sizes[] = {0, 1, 24, 4096, 100000, 300000, 5 << 20, 64 << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        KEEPS_ERRNO(p = malloc(sizes[i]));
        CHECK(p);
        KEEPS_ERRNO(q = realloc(p, sizes[i] * 3 + 1));
        CHECK(q);
        KEEPS_ERRNO(free(q));
        KEEPS_ERRNO(p = calloc(sizes[i], 2));
        CHECK(p);
        KEEPS_ERRNO(free(p));
        KEEPS_ERRNO(CHECK(posix_memalign(&p, 4096, sizes[i]) == 0));
        KEEPS_ERRNO(free(p));
        KEEPS_ERRNO(p = aligned_alloc(1 << 20, sizes[i]));
        CHECK(p);
        KEEPS_ERRNO(free(p));
    }
    /* An 8 MiB block grown to 64 MiB and more: in place where the address
     * space after it is free, else moved (the in-place mremap failed
     * first). Blocks on both sides make both happen across the rounds. */
    for (int round = 0; round < 8; round++) {
        void *before = malloc(8 << 20);
        KEEPS_ERRNO(p = malloc(8 << 20));
        void *after = malloc(8 << 20);
        memset(p, 7, 8 << 20);
        KEEPS_ERRNO(p = realloc(p, 64 << 20));
        CHECK(p && ((unsigned char *)p)[(8 << 20) - 1] == 7);
        KEEPS_ERRNO(p = realloc(p, (size_t)(65 + round) << 20));
        KEEPS_ERRNO(p = realloc(p, 1 << 20));
        CHECK(p && ((unsigned char *)p)[(1 << 20) - 1] == 7);
        KEEPS_ERRNO(free(p));
        free(before);
        free(after);
    }
    KEEPS_ERRNO(free(NULL));
    KEEPS_ERRNO(malloc_trim(0));
    KEEPS_ERRNO(CHECK(malloc_usable_size(NULL) == 0));
    pthread_t t;
    void *ok;
    CHECK(pthread_create(&t, NULL, thread_allocs, NULL) == 0 && pthread_join(t, &ok) == 0);
    CHECK(ok == (void *)1);
    /* A failure sets ENOMEM; posix_memalign returns it (and sets errno as
     * glibc's does, which GCC's builtin assumes it does not: failures.c,
     * built with -fno-builtin, checks that and every other case). */
    errno = 0;
    CHECK(malloc(HALF + 1) == NULL && errno == ENOMEM);
    CHECK(posix_memalign(&p, 16, HALF + 1) == ENOMEM);
}

static unsigned long long meminfo_kib(const char *key) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long v = 0;
    size_t k = strlen(key);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, k) == 0 && line[k] == ':') v = strtoull(line + k + 1, NULL, 10);
    fclose(f);
    return v;
}

static void test_overcommit(void) {
    FILE *f = fopen("/proc/sys/vm/overcommit_memory", "r");
    int mode = -1;
    if (f) {
        if (fscanf(f, "%d", &mode) != 1) mode = -1;
        fclose(f);
    }
    unsigned long long kib = meminfo_kib("MemTotal") + meminfo_kib("SwapTotal");
    if (mode != 0 && mode != 2) {
        fprintf(stderr, "  overcommit refusal not checked: vm.overcommit_memory is %d\n", mode);
        return;
    }
    CHECK(kib > 0);
    size_t too_big = (size_t)(kib * 1024 * 4);
    errno = 0;
    CHECK(malloc(too_big) == NULL && errno == ENOMEM);
    errno = 0;
    CHECK(calloc(too_big / 8, 8) == NULL && errno == ENOMEM);
    void *p = NULL;
    CHECK(posix_memalign(&p, 1 << 21, too_big) == ENOMEM);
    unsigned char *b = malloc(1 << 20);
    memset(b, 9, 1 << 20);
    errno = 0;
    CHECK(realloc(b, too_big) == NULL && errno == ENOMEM);
    CHECK(b[(1 << 20) - 1] == 9); /* a failed realloc leaves the block */
    free(b);
    fprintf(stderr, "  malloc of %zu GiB refused (vm.overcommit_memory %d)\n", too_big >> 30, mode);
}

/* `abi` runs every part; `abi PART` one of them. */
int main(int argc, char **argv) {
    const char *only = argc > 1 ? argv[1] : NULL;
    struct {
        const char *name;
        void (*run)(void);
    } parts[] = {{"alignment", test_alignment},
                 {"flexible-array", test_flexible_array},
                 {"errno", test_errno},
                 {"overcommit", test_overcommit}};
    int ran = 0;
    for (size_t i = 0; i < sizeof parts / sizeof *parts; i++) {
        if (only && strcmp(only, parts[i].name) != 0) continue;
        parts[i].run();
        ran++;
    }
    CHECK(ran > 0);
    printf("abi: %d checks passed\n", checks);
    return 0;
}

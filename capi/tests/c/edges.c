/* Every exported function of libnumaweave at its edges, from C: errno,
 * alignment, zero sizes, overflow, usable size >= request, contents across
 * realloc, foreign pointers, and the numaweave_* API. Linked with
 * -lnumaweave (so malloc is numaweave's); exits non-zero at the first
 * failure, saying which. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "numaweave.h"
#include "check.h"

void free_sized(void *p, size_t size);
void free_aligned_sized(void *p, size_t align, size_t size);

/* Sizes the compiler must not see through (it warns, and may fold). */
static volatile size_t SIZE_MAX_V = SIZE_MAX;
static volatile size_t HALF = SIZE_MAX / 2;
static volatile size_t TERA = (size_t)1 << 40;

static int aligned(void *p, size_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(seed + i * 7);
}

static int same(const unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != (unsigned char)(seed + i * 7)) return 0;
    return 1;
}

static void test_malloc_free(void) {
    void *a = malloc(0), *b = malloc(0);
    CHECK(a && b && a != b);
    CHECK(aligned(a, 8) && malloc_usable_size(a) >= 1);
    free(a);
    free(b);
    free(NULL);
    errno = 0;
    CHECK(malloc(SIZE_MAX_V) == NULL && errno == ENOMEM);
    errno = 0;
    CHECK(malloc(HALF + 1) == NULL && errno == ENOMEM);
    size_t sizes[] = {1, 15, 16, 17, 24, 40, 48, 56, 100, 112, 129, 1000, 4095, 4096, 4097, 65536, 262144, 262145,
                      1 << 20, 5 << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        unsigned char *p = malloc(sizes[i]);
        /* 16 above 8 bytes (C23: any object of the size fits), else 8. */
        CHECK(p && aligned(p, sizes[i] > 8 ? 16 : 8));
        CHECK(malloc_usable_size(p) >= sizes[i]);
        fill(p, sizes[i], (unsigned)i);
        CHECK(same(p, sizes[i], (unsigned)i));
        free(p);
    }
    CHECK(malloc_usable_size(NULL) == 0);
}

static void test_calloc(void) {
    errno = 0;
    CHECK(calloc(HALF, 3) == NULL && errno == ENOMEM);
    errno = 0;
    CHECK(calloc(TERA, TERA) == NULL && errno == ENOMEM);
    /* A dirty block freed, then calloc of the same size: zeroed anyway. */
    for (size_t n = 16; n <= (1 << 20); n *= 4) {
        unsigned char *d = malloc(n);
        memset(d, 0xff, n);
        free(d);
        unsigned char *z = calloc(1, n);
        CHECK(z);
        for (size_t i = 0; i < n; i++) CHECK(z[i] == 0);
        free(z);
    }
    void *z = calloc(0, 10);
    CHECK(z);
    free(z);
}

static void test_realloc(void) {
    unsigned char *p = realloc(NULL, 100);
    CHECK(p);
    fill(p, 100, 3);
    /* Grow through every kind of block and back, contents kept. */
    size_t steps[] = {200, 5000, 100000, 300000, 3 << 20, 40 << 20, 1 << 20, 70000, 1000, 50};
    size_t kept = 100;
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++) {
        unsigned char *q = realloc(p, steps[i]);
        CHECK(q);
        size_t n = kept < steps[i] ? kept : steps[i];
        CHECK(same(q, n, 3));
        if (steps[i] > kept) {
            fill(q, steps[i], 3);
            kept = steps[i];
        } else {
            kept = steps[i];
        }
        CHECK(malloc_usable_size(q) >= steps[i]);
        p = q;
    }
    errno = 0;
    CHECK(realloc(p, SIZE_MAX_V) == NULL && errno == ENOMEM);
    CHECK(same(p, kept, 3)); /* a failed realloc leaves the block */
    CHECK(realloc(p, 0) == NULL); /* frees it (glibc) */

    unsigned char *r = reallocarray(NULL, 10, 10);
    CHECK(r);
    fill(r, 100, 9);
    errno = 0;
    CHECK(reallocarray(r, HALF, 3) == NULL && errno == ENOMEM);
    CHECK(same(r, 100, 9));
    r = reallocarray(r, 1000, 10);
    CHECK(r && same(r, 100, 9));
    free(r);
}

static void test_aligned(void) {
    void *p = (void *)1;
    CHECK(posix_memalign(&p, 3, 10) == EINVAL && p == (void *)1);
    CHECK(posix_memalign(&p, 4, 10) == EINVAL); /* not a multiple of sizeof(void *) */
    CHECK(posix_memalign(&p, 0, 10) == EINVAL);
    size_t aligns[] = {8, 16, 64, 4096, 65536, 1 << 20, 8 << 20};
    for (size_t i = 0; i < sizeof aligns / sizeof *aligns; i++) {
        for (size_t size = 0; size <= 300000; size = size * 3 + 1) {
            errno = 1234;
            CHECK(posix_memalign(&p, aligns[i], size) == 0 && errno == 1234);
            CHECK(p && aligned(p, aligns[i]) && malloc_usable_size(p) >= size);
            memset(p, 1, size);
            free(p);
        }
    }
    CHECK(posix_memalign(&p, TERA, 10) == ENOMEM);

    errno = 0;
    CHECK(aligned_alloc(3, 10) == NULL && errno == EINVAL);
    p = aligned_alloc(64, 100);
    CHECK(p && aligned(p, 64));
    free_aligned_sized(p, 64, 100);
    p = aligned_alloc(4096, 1); /* size need not be a multiple (C17) */
    CHECK(p && aligned(p, 4096));
    free(p);

    p = memalign(24, 100); /* rounded up to 32, as glibc */
    CHECK(p && aligned(p, 32));
    free(p);
    p = memalign(0, 10);
    CHECK(p && aligned(p, 8));
    free(p);

    long page = sysconf(_SC_PAGESIZE);
    p = valloc(10);
    CHECK(p && aligned(p, (size_t)page));
    free(p);
    p = pvalloc(1);
    CHECK(p && aligned(p, (size_t)page) && malloc_usable_size(p) >= (size_t)page);
    free(p);
    p = pvalloc(0);
    CHECK(p && aligned(p, (size_t)page));
    free_sized(p, (size_t)page);
}

static void test_trim_stats(void) {
    void *big[64];
    for (int i = 0; i < 64; i++) big[i] = malloc(100000);
    for (int i = 0; i < 64; i++) free(big[i]);
    CHECK(malloc_trim(0) == 1);
    malloc_stats();
}

/* Memory of another allocator (glibc's, the next malloc) given to ours.
 * (The hardened library reports such a free as a misuse: not there.) */
static void test_foreign(void) {
    if (getenv("EDGES_HARDENED")) {
        fprintf(stderr, "  (hardened library: foreign pointers not checked)\n");
        return;
    }
    void *libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
    void *(*next_malloc)(size_t) = libc ? (void *(*)(size_t))dlsym(libc, "malloc") : NULL;
    if (!next_malloc) {
        fprintf(stderr, "  (no next malloc: foreign pointers not checked)\n");
        return;
    }
    unsigned char *g = next_malloc(1000);
    CHECK(g && numaweave_node_of(g) == -1);
    fill(g, 1000, 5);
    CHECK(malloc_usable_size(g) >= 1000); /* glibc's answer */
    g = realloc(g, 5000);                 /* glibc's realloc */
    CHECK(g && same(g, 1000, 5) && numaweave_node_of(g) == -1);
    free(g); /* glibc's free */
    int on_stack;
    CHECK(numaweave_node_of(&on_stack) == -1);
    CHECK(numaweave_node_of(NULL) == -1);
}

static void test_api(void) {
    CHECK(numaweave_node_count() >= 1);
    int here = numaweave_current_node();
    CHECK(here >= 0 && here < numaweave_node_count());
    void *p = numaweave_alloc_on_node(10000, 4096, here);
    CHECK(p && aligned(p, 4096) && numaweave_node_of(p) >= 0);
    free(p);
    p = numaweave_alloc_on_node(5 << 20, 0, here); /* a huge block */
    CHECK(p && aligned(p, 16));
    free(p);
    errno = 0;
    CHECK(numaweave_alloc_on_node(100, 0, 63) == NULL && errno == EINVAL);
    CHECK(strstr(numaweave_last_error(), "node") != NULL);
    errno = 0;
    CHECK(numaweave_alloc_on_node(100, 3, here) == NULL && errno == EINVAL);
    /* Cold data: a lower tier where there is one, else this node. */
    p = numaweave_alloc_cold(100000, 4096);
    CHECK(p && aligned(p, 4096) && numaweave_node_of(p) >= 0);
    memset(p, 5, 100000);
    free(p);
    errno = 0;
    CHECK(numaweave_alloc_cold(100, 3) == NULL && errno == EINVAL);

    CHECK(numaweave_set_thread_policy("bogus:1") == NUMAWEAVE_INVALID_POLICY);
    CHECK(strlen(numaweave_last_error()) > 0);
    CHECK(numaweave_set_thread_policy("interleave:0-63") == NUMAWEAVE_INVALID_POLICY);
    CHECK(numaweave_set_thread_policy(NULL) == NUMAWEAVE_INVALID_ARGUMENT);
    char spec[64];
    snprintf(spec, sizeof spec, "interleave:%d:bytes=64K", here);
    CHECK(numaweave_set_thread_policy(spec) == NUMAWEAVE_OK);
    void *bufs[32];
    for (int i = 0; i < 32; i++) {
        CHECK(posix_memalign(&bufs[i], 4096, 4096) == 0);
        CHECK(numaweave_node_of(bufs[i]) >= 0);
    }
    for (int i = 0; i < 32; i++) free(bufs[i]);
    snprintf(spec, sizeof spec, "bind:%d", here);
    CHECK(numaweave_set_thread_policy(spec) == NUMAWEAVE_OK);
    free(malloc(100));
    numaweave_clear_thread_policy();

    numaweave_slab *s = numaweave_slab_create("edges_cmd", 200, 0, -1);
    CHECK(s);
    void *objs[100];
    for (int i = 0; i < 100; i++) {
        objs[i] = numaweave_slab_alloc(s);
        CHECK(objs[i] && aligned(objs[i], 8));
        memset(objs[i], i, 200);
    }
    for (int i = 0; i < 100; i++) numaweave_slab_free(s, objs[i]);
    CHECK(numaweave_slab_alloc_bulk(s, objs, 64) == NUMAWEAVE_OK);
    for (int i = 0; i < 64; i++) CHECK(objs[i]);
    numaweave_slab_free_bulk(s, (void *const *)objs, 64);
    void *o = numaweave_slab_alloc_on(s, here);
    CHECK(o);
    numaweave_slab_free(s, o);
    CHECK(numaweave_slab_alloc_on(s, 63) == NULL);
    numaweave_slab_free(s, NULL);
    char info[8192];
    size_t need = numaweave_slabinfo(info, sizeof info);
    CHECK(need > 0 && strstr(info, "edges_cmd") != NULL);
    char tiny[4];
    CHECK(numaweave_slabinfo(tiny, sizeof tiny) == need && tiny[3] == 0);
    numaweave_slab_destroy(s);
    numaweave_slab_destroy(NULL);
    CHECK(numaweave_slab_create("bad", TERA, 0, -1) == NULL && strlen(numaweave_last_error()) > 0);
    CHECK(numaweave_slab_create("bad", 64, 3, -1) == NULL);
    CHECK(numaweave_slab_create_for_device("dev", 64, 0, "no-such-device0", false) == NULL);
    numaweave_slab *d = numaweave_slab_create_for_device("dev", 64, 0, "no-such-device0", true);
    CHECK(d == NULL || numaweave_slab_alloc(d) != NULL);
    numaweave_slab_destroy(d);

    numaweave_node_stats st[64];
    int n = numaweave_stats(st, 64);
    CHECK(n >= 1);
    unsigned long long allocs = 0, resident = 0;
    for (int i = 0; i < n; i++) {
        allocs += st[i].allocs;
        resident += st[i].resident;
        /* The lifecycle's figures reach C too, and add up. */
        CHECK(st[i].resident >= st[i].free_resident);
    }
    CHECK(allocs > 0 && resident > 0);
    char table[4096];
    CHECK(numaweave_stats_print(table, sizeof table) > 0 && strstr(table, "node") != NULL);
    numaweave_collect();
}

int main(void) {
    test_malloc_free();
    test_calloc();
    test_realloc();
    test_aligned();
    test_trim_stats();
    test_foreign();
    test_api();
    printf("edges: %d checks passed\n", checks);
    return 0;
}

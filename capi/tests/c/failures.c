/* Every way an allocation fails, from every entry point, as glibc's malloc
 * fails it: the result and errno. Run with the library preloaded and, as
 * the control that the expectations are glibc's, without it.
 *
 * - sizes no allocator can serve (near SIZE_MAX, past PTRDIFF_MAX, 2^50 and
 *   up: glibc's tst-malloc-too-large's sizes), products that overflow:
 *   null and ENOMEM; posix_memalign returns ENOMEM, leaves its pointer and,
 *   as glibc's does, sets errno to ENOMEM too;
 * - bad alignments: posix_memalign's EINVAL (errno left as it was),
 *   memalign's beyond SIZE_MAX / 2 + 1 (EINVAL), aligned_alloc's that are
 *   not powers of two (EINVAL since glibc 2.38; 2.36 took them);
 * - an address-space limit (RLIMIT_AS): a block larger than what is left
 *   fails from every entry point with ENOMEM; 1 MiB blocks until one
 *   fails, the last with ENOMEM; after freeing them, a block of nearly
 *   all the room is had again (glibc unmaps at once; an allocator that
 *   keeps freed mappings and segments must give their address space back
 *   when the kernel refuses one); the same with 16 KiB blocks. (A test of
 *   its own, `failures limit`: the limit stays with the process.) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <gnu/libc-version.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "check.h"

/* Too large on purpose. */
#pragma GCC diagnostic ignored "-Walloc-size-larger-than="

/* `call` fails with null and `err` in errno (set to 4242 before). */
#define FAILS_WITH(call, err)                                                                       \
    do {                                                                                            \
        errno = 4242;                                                                               \
        void *volatile r_ = (call);                                                                 \
        int e_ = errno;                                                                             \
        checks++;                                                                                   \
        if (r_ != NULL || e_ != (err))                                                              \
            CHECK_FAILED(#call, ": %p, errno %d (wanted null, errno %d)\n", (void *)r_, e_, (err)); \
        free(r_);                                                                                   \
    } while (0)

/* posix_memalign fails with `ret` and errno `err`, its pointer untouched. */
#define PM_FAILS_WITH(align, size, ret, err)                                                            \
    do {                                                                                                \
        void *p_ = (void *)0x1234;                                                                      \
        errno = 4242;                                                                                   \
        int r_ = posix_memalign(&p_, (align), (size));                                                  \
        int e_ = errno;                                                                                 \
        checks++;                                                                                       \
        if (r_ != (ret) || e_ != (err) || p_ != (void *)0x1234)                                         \
            CHECK_FAILED("posix_memalign", "(%zu, %zu): %d, errno %d, %p (wanted %d, errno %d)\n",      \
                         (size_t)(align), (size_t)(size), r_, e_, p_, (ret), (err));                    \
    } while (0)

static int preloaded(void) {
    return dlsym(RTLD_DEFAULT, "numaweave_node_of") != NULL;
}

/* Every entry point asked for `size` bytes (and products making it). */
static void too_large(size_t size) {
    void *small = malloc(16);
    CHECK(small != NULL);
    FAILS_WITH(malloc(size), ENOMEM);
    FAILS_WITH(realloc(NULL, size), ENOMEM);
    errno = 4242;
    CHECK(realloc(small, size) == NULL && errno == ENOMEM);
    for (size_t n = 1; n <= 8; n *= 2) {
        if (size % n) break;
        FAILS_WITH(calloc(n, size / n), ENOMEM);
        FAILS_WITH(calloc(size / n, n), ENOMEM);
        errno = 4242;
        CHECK(reallocarray(small, n, size / n) == NULL && errno == ENOMEM);
    }
    for (size_t align = 1; align != 0 && align <= ((size_t)1 << 40); align <<= 3) {
        FAILS_WITH(memalign(align, size), ENOMEM);
        if (align % sizeof(void *) == 0) PM_FAILS_WITH(align, size, ENOMEM, ENOMEM);
        if (size % align == 0) FAILS_WITH(aligned_alloc(align, size), ENOMEM);
    }
    FAILS_WITH(valloc(size), ENOMEM);
    FAILS_WITH(pvalloc(size), ENOMEM);
    /* The block a failed realloc was given is intact and still ours. */
    memset(small, 1, 16);
    free(small);
}

static void sizes(void) {
    for (size_t i = 0; i < 64; i++) too_large(SIZE_MAX - i);
    for (size_t i = 1; i < 64; i++) too_large((size_t)PTRDIFF_MAX + i);
    for (size_t msbs = 1; msbs < (1 << 14); msbs = msbs * 3 + 1) {
        too_large(msbs << 50);
        too_large((msbs << 50) | (((size_t)1 << 50) - 1));
    }
    /* Products that overflow. */
    FAILS_WITH(calloc(SIZE_MAX / 2, 3), ENOMEM);
    FAILS_WITH(calloc((size_t)1 << 32, (size_t)1 << 32), ENOMEM);
    void *p = malloc(32);
    errno = 4242;
    CHECK(reallocarray(p, SIZE_MAX / 2, 3) == NULL && errno == ENOMEM);
    free(p);
}

static void alignments(void) {
    /* posix_memalign: a power of two multiple of sizeof(void *); errno kept. */
    PM_FAILS_WITH(0, 64, EINVAL, 4242);
    PM_FAILS_WITH(4, 64, EINVAL, 4242);
    PM_FAILS_WITH(24, 64, EINVAL, 4242);
    PM_FAILS_WITH(SIZE_MAX / 2 + 1 + sizeof(void *), 64, EINVAL, 4242);
    /* memalign: anything up to SIZE_MAX / 2 + 1, rounded up to a power of
     * two; beyond, EINVAL. */
    FAILS_WITH(memalign(SIZE_MAX / 2 + 2, 64), EINVAL);
    FAILS_WITH(memalign(SIZE_MAX, 64), EINVAL);
    errno = 4242;
    void *p = memalign(48, 100);
    CHECK(p != NULL && (uintptr_t)p % 64 == 0 && errno == 4242);
    free(p);
    /* aligned_alloc: a power of two (glibc 2.38; 2.36 rounded up, as
     * memalign does, and is the control here only where it is older). */
    int old = !preloaded() && strverscmp(gnu_get_libc_version(), "2.38") < 0;
    if (!old) {
        FAILS_WITH(aligned_alloc(0, 64), EINVAL);
        FAILS_WITH(aligned_alloc(3, 64), EINVAL);
        FAILS_WITH(aligned_alloc(48, 96), EINVAL);
    }
    errno = 4242;
    p = aligned_alloc(64, 100);
    CHECK(p != NULL && (uintptr_t)p % 64 == 0 && errno == 4242);
    free(p);
}

/* The process's virtual size, bytes. */
static size_t vm_size(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long pages = 0;
    CHECK(f != NULL && fscanf(f, "%lu", &pages) == 1);
    fclose(f);
    return pages * (size_t)sysconf(_SC_PAGESIZE);
}

/* Blocks of `size` until one fails (ENOMEM), at least `least` of them;
 * all freed, then one block of 7/8 of the room (224 MiB) is had. */
static void fill_free_and_refill(size_t size, int least) {
    enum { MAX = 1 << 15 };
    static void *blocks[MAX];
    int n = 0;
    for (;;) {
        CHECK(n < MAX);
        errno = 4242;
        blocks[n] = malloc(size);
        if (!blocks[n]) break;
        memset(blocks[n], 5, size < 4096 ? size : 4096);
        n++;
    }
    CHECK(errno == ENOMEM);
    /* (After the frees: printing allocates.) */
    for (int i = 0; i < n; i++) free(blocks[i]);
    printf("failures: %d blocks of %zu KiB within 256 MiB of address space\n", n, size >> 10);
    CHECK(n >= least);
    size_t most = (size_t)224 << 20;
    void *p = malloc(most);
    CHECK(p != NULL);
    memset(p, 6, most);
    free(p);
}

static void limit(void) {
    /* 256 MiB of address space beyond what the process has now. */
    size_t room = (size_t)256 << 20;
    struct rlimit rl = {vm_size() + room, vm_size() + room};
    CHECK(setrlimit(RLIMIT_AS, &rl) == 0);
    size_t big = (size_t)512 << 20;
    void *small = malloc(16);
    CHECK(small != NULL);
    FAILS_WITH(malloc(big), ENOMEM);
    FAILS_WITH(calloc(big / 8, 8), ENOMEM);
    errno = 4242;
    CHECK(realloc(small, big) == NULL && errno == ENOMEM);
    errno = 4242;
    CHECK(reallocarray(small, big / 8, 8) == NULL && errno == ENOMEM);
    FAILS_WITH(memalign(4096, big), ENOMEM);
    FAILS_WITH(aligned_alloc(1 << 21, big), ENOMEM);
    PM_FAILS_WITH(64, big, ENOMEM, ENOMEM);
    FAILS_WITH(valloc(big), ENOMEM);
    FAILS_WITH(pvalloc(big), ENOMEM);
    free(small);
    fill_free_and_refill(1 << 20, 64);
    fill_free_and_refill(16 << 10, 4096);
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "all";
    if (strcmp(what, "limit") == 0) {
        limit();
    } else {
        sizes();
        alignments();
    }
    printf("failures %s (%s): %d checks passed\n", what, preloaded() ? "numaweave" : "glibc", checks);
    return 0;
}

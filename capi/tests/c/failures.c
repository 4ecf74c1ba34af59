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
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
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

#if defined(__x86_64__)
#define OUR_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define OUR_ARCH AUDIT_ARCH_AARCH64
#endif

/* From now on every thread's mmap and mremap fail with ENOMEM. */
static void refuse_mappings(void) {
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, OUR_ARCH, 0, 4),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mmap, 1, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mremap, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOMEM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof code / sizeof code[0], code};
    CHECK(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0);
    CHECK(syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog) == 0);
    /* The filter holds: a mapping of our own is refused too. */
    errno = 0;
    CHECK(mmap(NULL, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) == MAP_FAILED && errno == ENOMEM);
}

enum { STRESSERS = 4, LIVE = 256, ROUNDS = 40000 };
static pthread_barrier_t warmed, filtered;

struct stress {
    int id;
    long served, refused;
};

/* The byte of block `slot` of thread `id` at offset `at`. */
static unsigned char pattern(int id, int slot, size_t at) {
    return (unsigned char)(id * 31 + slot * 7 + at);
}

/* Fills (or checks) the first and last 64 bytes of a block, and every 4 KiB. */
static void fill(unsigned char *p, size_t n, int id, int slot, int check) {
    for (size_t at = 0; at < n; at = at < 64 || at + 64 >= n ? at + 1 : (at | 4095) + 1 < n - 64 ? (at | 4095) + 1 : n - 64) {
        if (check)
            CHECK_AT(p[at] == pattern(id, slot, at), at);
        else
            p[at] = pattern(id, slot, at);
    }
}

static size_t size_of_round(unsigned *seed) {
    unsigned r = rand_r(seed);
    switch (r % 100) {
    case 0: return ((size_t)1 << 20) + r % 4096 * 4096; /* 1-17 MiB */
    case 1: return (size_t)64 << 20;
    case 2 ... 9: return 16384 + r % (256 << 10);
    default: return 16 + r % 2048;
    }
}

static void *stress(void *arg) {
    struct stress *s = arg;
    unsigned seed = 12345u + s->id;
    unsigned char *blocks[LIVE] = {0};
    size_t sizes[LIVE] = {0};
    /* Warm: a heap of every size this thread will ask, freed. */
    for (int i = 0; i < LIVE; i++) {
        sizes[i] = size_of_round(&seed);
        blocks[i] = malloc(sizes[i]);
        CHECK(blocks[i] != NULL);
    }
    for (int i = 0; i < LIVE; i++) free(blocks[i]), blocks[i] = NULL;
    pthread_barrier_wait(&warmed);
    pthread_barrier_wait(&filtered);
    for (int round = 0; round < ROUNDS; round++) {
        int i = rand_r(&seed) % LIVE;
        if (blocks[i]) {
            fill(blocks[i], sizes[i], s->id, i, 1);
            if (rand_r(&seed) % 2) {
                free(blocks[i]);
                blocks[i] = NULL;
                continue;
            }
            size_t n = size_of_round(&seed);
            errno = 4242;
            unsigned char *q = realloc(blocks[i], n);
            if (!q) {
                CHECK(errno == ENOMEM);
                s->refused++;
                continue; /* the old block is kept, checked when next met */
            }
            s->served++;
            size_t kept = n < sizes[i] ? n : sizes[i];
            for (size_t at = 0; at < kept && at < 64; at++) CHECK_AT(q[at] == pattern(s->id, i, at), at);
            blocks[i] = q;
            sizes[i] = n;
            fill(q, n, s->id, i, 0);
            continue;
        }
        size_t n = size_of_round(&seed);
        errno = 4242;
        int zero = rand_r(&seed) % 4 == 0;
        unsigned char *p = zero ? calloc(1, n) : malloc(n);
        if (!p) {
            CHECK(errno == ENOMEM);
            s->refused++;
            continue;
        }
        s->served++;
        if (zero)
            for (size_t at = 0; at < n; at += 4093) CHECK_AT(p[at] == 0, at);
        blocks[i] = p;
        sizes[i] = n;
        fill(p, n, s->id, i, 0);
    }
    for (int i = 0; i < LIVE; i++) {
        if (blocks[i]) fill(blocks[i], sizes[i], s->id, i, 1);
        free(blocks[i]);
    }
    return NULL;
}

static void no_mappings(void) {
    pthread_t t[STRESSERS];
    struct stress s[STRESSERS];
    /* (stdout's buffer before the filter: printing allocates.) */
    printf("failures nommap: %d threads, %d rounds each, every mmap and mremap refused\n", STRESSERS, ROUNDS);
    fflush(stdout);
    CHECK(pthread_barrier_init(&warmed, NULL, STRESSERS + 1) == 0);
    CHECK(pthread_barrier_init(&filtered, NULL, STRESSERS + 1) == 0);
    for (int i = 0; i < STRESSERS; i++) {
        s[i] = (struct stress){.id = i};
        CHECK(pthread_create(&t[i], NULL, stress, &s[i]) == 0);
    }
    pthread_barrier_wait(&warmed);
    refuse_mappings();
    pthread_barrier_wait(&filtered);
    long served = 0, refused = 0;
    for (int i = 0; i < STRESSERS; i++) {
        CHECK(pthread_join(t[i], NULL) == 0);
        served += s[i].served;
        refused += s[i].refused;
    }
    printf("failures nommap: %ld served, %ld refused with ENOMEM, contents intact\n", served, refused);
    /* Warm heaps serve on: most small requests were had. */
    CHECK(served > refused);
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "all";
    if (strcmp(what, "limit") == 0) {
        limit();
    } else if (strcmp(what, "nommap") == 0) {
        no_mappings();
    } else {
        sizes();
        alignments();
    }
    printf("failures %s (%s): %d checks passed\n", what, preloaded() ? "numaweave" : "glibc", checks);
    return 0;
}

/* What a thread pays for its first allocations in stack: every thread
 * keeps resident the stack pages the allocator's slow path touched (its
 * heap made, its first refills). Each thread here runs on a fresh stack of
 * its own (fresh pages from mmap, not a reused one), makes 64 blocks of
 * 16 B - 2 KiB and a few larger ones, and the pages of the stack below
 * the thread function's frame that became resident are counted
 * (`mincore`: a stack probe writes zeros, so a scan for written bytes
 * would miss the pages only probes touched). At most one page below the
 * frame's: a slow path whose frame held a 3 KiB interleave cursor (built
 * inline, probed page by page) touched two or three, in every thread's
 * resident memory.
 *
 *   stack            prints "checks passed"
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"

enum { STACK = 256 * 1024, BOUND = 1 };

static volatile uintptr_t top; /* the thread's frame at its start */

static void *work(void *arg) {
    (void)arg;
    unsigned char here;
    top = (uintptr_t)&here;
    void *b[72];
    for (int i = 0; i < 64; i++) {
        b[i] = malloc(16 + (size_t)(i * 37) % 2033);
        CHECK(b[i]);
        memset(b[i], 1, 16);
    }
    for (int i = 64; i < 72; i++) CHECK((b[i] = malloc((size_t)4096 << (i - 64))));
    for (int i = 0; i < 72; i++) free(b[i]);
    return NULL;
}

int main(void) {
    for (int round = 0; round < 4; round++) {
        unsigned char *s = mmap(NULL, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(s != MAP_FAILED);
        pthread_attr_t at;
        CHECK(pthread_attr_init(&at) == 0);
        CHECK(pthread_attr_setstack(&at, s, STACK) == 0);
        pthread_t t;
        CHECK(pthread_create(&t, &at, work, NULL) == 0);
        CHECK(pthread_join(t, NULL) == 0);
        /* (Above `top`: the thread's descriptor and static TLS, which
         * glibc puts on a stack it is given, and the start's frames.) */
        size_t page = (size_t)sysconf(_SC_PAGESIZE), below = (top & ~(uintptr_t)(page - 1)) - (uintptr_t)s;
        unsigned char in[STACK / 4096];
        CHECK(below <= STACK && mincore(s, below, in) == 0);
        size_t touched = 0;
        for (size_t k = 0; k < below / page; k++) touched += in[k] & 1;
        printf("round %d: %zu pages of the thread's stack touched below its start's\n", round, touched);
        /* (Round 0 also binds the program's calls to malloc: the dynamic
         * linker's resolver saves the vector registers on the stack, 2.8
         * KiB here, more with AVX-512.) */
        if (round > 0) CHECK(touched <= BOUND);
        munmap(s, STACK);
        pthread_attr_destroy(&at);
    }
    printf("checks passed\n");
    return 0;
}

/* Misuses of the heap, each of which libnumaweave_hardened.so must catch
 * (run under LD_PRELOAD, one case per process). Before each misuse the
 * program prints the report it expects on stderr ("EXPECT ..."), computed
 * from the addresses it got; the test compares it with the line that
 * follows and checks that the process aborted.
 *
 * Compiled with -fno-builtin and called through volatile pointers so that
 * the compiler neither warns about nor removes what is wrong on purpose. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "numaweave.h"

static void *(*volatile my_malloc)(size_t) = malloc;
static void (*volatile my_free)(void *) = free;

static void expect(const char *fmt, void *p, void *q) {
    fprintf(stderr, "EXPECT ");
    fprintf(stderr, fmt, p, q);
    fprintf(stderr, "\n");
    fflush(stderr);
}

static void *free_it(void *p) {
    my_free(p);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *w = argv[1];
    if (!strcmp(w, "double-free")) {
        char *p = my_malloc(64);
        my_free(p);
        expect("numaweave: double free of %p (64-byte block, node 0)", p, NULL);
        my_free(p);
    } else if (!strcmp(w, "double-free-other-thread")) {
        char *p = my_malloc(64);
        pthread_t t;
        pthread_create(&t, NULL, free_it, p);
        pthread_join(t, NULL);
        expect("numaweave: double free of %p (64-byte block, node 0)", p, NULL);
        my_free(p);
    } else if (!strcmp(w, "double-free-huge")) {
        char *p = my_malloc(64 << 20);
        my_free(p);
        expect("numaweave: double free of %p (huge block)", p, NULL);
        my_free(p);
    } else if (!strcmp(w, "double-free-slab")) {
        numaweave_slab *c = numaweave_slab_create("sense", 96, 0, -1);
        void *p = numaweave_slab_alloc(c);
        numaweave_slab_free(c, p);
        expect("numaweave: double free of %p (slab cache \"sense\", node 0)", p, NULL);
        numaweave_slab_free(c, p);
    } else if (!strcmp(w, "overflow-24")) {
        char *p = my_malloc(24);
        p[24] = 1;
        expect("numaweave: write past the end of %p (32-byte block, node 0): the red zone after it was overwritten", p,
               NULL);
        my_free(p);
    } else if (!strcmp(w, "overflow-20")) {
        char *p = my_malloc(20);
        p[21] = 1;
        expect("numaweave: write past the end of %p (32-byte block, node 0, 20 bytes asked): byte 1 after its end changed",
               p, NULL);
        my_free(p);
    } else if (!strcmp(w, "write-after-free")) {
        char *p = my_malloc(64);
        my_free(p);
        p[40] = 7;
        expect("numaweave: write after free into %p (80-byte block, node 0): byte 40 changed (to 0x07)", p, NULL);
        p = my_malloc(64);
        fprintf(stderr, "not reported; got %p\n", (void *)p);
    } else if (!strcmp(w, "stack-pointer")) {
        int x = 5;
        expect("numaweave: free of %p, which numaweave did not allocate", &x, NULL);
        my_free(&x);
    } else if (!strcmp(w, "static-pointer")) {
        static char buf[64];
        expect("numaweave: free of %p, which numaweave did not allocate", buf, NULL);
        my_free(buf);
    } else if (!strcmp(w, "interior-pointer")) {
        char *p = my_malloc(64);
        expect("numaweave: free of %p, inside the 64-byte block at %p (node 0)", p + 16, p);
        my_free(p + 16);
    } else if (!strcmp(w, "wrong-slab-cache")) {
        numaweave_slab *a = numaweave_slab_create("io_cmd", 256, 0, -1);
        numaweave_slab *b = numaweave_slab_create("sense_buf", 96, 0, -1);
        void *p = numaweave_slab_alloc(a);
        expect("numaweave: object %p of slab cache \"io_cmd\" freed into slab cache \"sense_buf\"", p, NULL);
        numaweave_slab_free(b, p);
    } else {
        return 2;
    }
    puts("survived");
    return 0;
}

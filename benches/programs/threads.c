/* Workload class "thread churn": threads start, allocate mixed sizes, hand
 * half of their blocks to the next thread (which frees them), and exit;
 * new threads keep starting. A fresh thread should find a heap and pages
 * ready instead of faulting memory in again. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PER 20000
static void *handoff[2][PER];

static void *work(void *arg) {
    uintptr_t k = (uintptr_t)arg;
    void **mine = handoff[k & 1], **theirs = handoff[(k + 1) & 1];
    uint64_t x = 0x9e3779b97f4a7c15ull ^ (k * 7919);
    for (int i = 0; i < PER; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        free(theirs[i]); /* the previous thread's block */
        theirs[i] = NULL;
        size_t size = 16 << (x % 10);
        char *p = malloc(size);
        memset(p, (int)i, size < 64 ? size : 64);
        if (i & 1)
            mine[i] = p;
        else
            free(p);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 300;
    for (int r = 0; r < rounds; r++) {
        pthread_t t;
        pthread_create(&t, NULL, work, (void *)(uintptr_t)r);
        pthread_join(t, NULL);
    }
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < PER; i++) free(handoff[k][i]);
    puts("done");
    return 0;
}

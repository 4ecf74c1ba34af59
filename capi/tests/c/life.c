/* A process's life under LD_PRELOAD=libnumaweave.so: threads started before
 * the first allocation, fork() while other threads allocate (the child
 * allocates and frees), dlopen/dlclose of a library that allocates, exec
 * with the variables passed on, and exit() while threads allocate.
 *
 *   life all LIB.so   every scenario but exit (then execs itself: "exec")
 *   life exit         exit() while 4 threads allocate
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHECK(c)                                                                  \
    do {                                                                          \
        if (!(c)) {                                                               \
            fprintf(stderr, "life.c:%d: check failed: %s\n", __LINE__, #c);       \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

static atomic_int stop;

/* Is `p` numaweave's? Found through the preloaded library. */
static int ours(void *p) {
    int (*node_of)(const void *) = (int (*)(const void *))dlsym(RTLD_DEFAULT, "numaweave_node_of");
    return node_of && node_of(p) >= 0;
}

static void *churn(void *arg) {
    unsigned x = (unsigned)(uintptr_t)arg * 2654435761u + 1;
    void *live[64] = {0};
    while (!atomic_load(&stop)) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        unsigned i = x % 64;
        free(live[i]);
        live[i] = malloc(16 + x % 70000);
        CHECK(live[i]);
        memset(live[i], (int)i, 16);
    }
    for (int i = 0; i < 64; i++) free(live[i]);
    return NULL;
}

static void start(pthread_t *t, int n) {
    for (int i = 0; i < n; i++) CHECK(pthread_create(&t[i], NULL, churn, (void *)(uintptr_t)(i + 1)) == 0);
}

static void finish(pthread_t *t, int n) {
    atomic_store(&stop, 1);
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    atomic_store(&stop, 0);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "exit") == 0) {
        pthread_t t[4];
        start(t, 4);
        usleep(20000);
        exit(0); /* the threads are still allocating */
    }
    if (argc > 1 && strcmp(argv[1], "exec") == 0) {
        /* After exec: the variables came along, and malloc is numaweave's. */
        CHECK(getenv("LD_PRELOAD") && strstr(getenv("LD_PRELOAD"), "numaweave"));
        CHECK(getenv("NUMAWEAVE_MODE") && strcmp(getenv("NUMAWEAVE_MODE"), "flat") == 0);
        void *p = malloc(100);
        CHECK(ours(p));
        free(p);
        printf("life: exec ok\n");
        return 0;
    }
    CHECK(argc > 2 && strcmp(argv[1], "all") == 0);

    /* Threads started before this process's first allocation here. */
    pthread_t t[4];
    start(t, 4);
    void *first = malloc(10);
    CHECK(ours(first));
    free(first);

    /* fork() while they allocate: each child allocates and frees. */
    for (int k = 0; k < 50; k++) {
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            void *v[500];
            for (int i = 0; i < 500; i++) {
                v[i] = malloc(16 + i * 100);
                if (!v[i]) _exit(2);
                memset(v[i], 1, 16 + i * 100);
            }
            for (int i = 0; i < 500; i++) free(v[i]);
            _exit(ours(v[0]) ? 0 : 3);
        }
        int st;
        CHECK(waitpid(pid, &st, 0) == pid);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    finish(t, 4);

    /* dlopen/dlclose of a library that allocates (and frees at unload). */
    for (int k = 0; k < 20; k++) {
        void *h = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
        CHECK(h);
        char *(*make)(int) = (char *(*)(int))dlsym(h, "user_make");
        CHECK(make);
        char *s = make(k);
        CHECK(s && ours(s) && s[0] == 'k');
        free(s);
        CHECK(dlclose(h) == 0);
    }

    /* exec: the child sees the variables, and numaweave again. */
    fflush(stdout);
    setenv("NUMAWEAVE_MODE", "flat", 1);
    char *args[] = {argv[0], "exec", NULL};
    execv(argv[0], args);
    perror("execv");
    return 1;
}

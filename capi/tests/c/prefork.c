/* A prefork server's worker and the published slab table: the parent makes
 * a slab cache and forks; the child closes every inherited descriptor from
 * 3 up (as daemons do), opens four log files of its own and grows the
 * cache by 64 MiB. Its logs must stay its own (the slab layer once closed
 * the inherited table's descriptor by number at the child's first chunk,
 * which was by then the child's first log: EBADF at its first write), and
 * it must get a table of its own listing its chunks. The parent keeps
 * changing its table meanwhile: the child's is not the parent's.
 *
 * Also: the table's file cannot be truncated by another opener (a
 * truncated shared mapping is a SIGBUS in its writer).
 *
 *   prefork DIR    (the logs go in DIR)
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "numaweave.h"

#define CHECK(c)                                                                      \
    do {                                                                              \
        if (!(c)) {                                                                   \
            fprintf(stderr, "prefork.c:%d: check failed: %s (errno %d)\n", __LINE__, #c, errno); \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)



#define OBJ 4096
#define GROW ((64u << 20) / OBJ)

/* The descriptor of this process's table (the memory file whose header
 * names this pid), or -1. */
static int own_table(void) {
    DIR *d = opendir("/proc/self/fd");
    CHECK(d != NULL);
    struct dirent *e;
    int found = -1;
    while ((e = readdir(d)) != NULL) {
        char path[300], link[256];
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(path, link, sizeof link - 1);
        if (n <= 0) continue;
        link[n] = 0;
        if (strncmp(link, "/memfd:numaweave-slabs", 22) != 0) continue;
        uint64_t head[2] = {0, 0};
        int fd = atoi(e->d_name);
        if (pread(fd, head, sizeof head, 0) == (ssize_t)sizeof head && memcmp(&head[0], "NWSLABS2", 8) == 0 &&
            head[1] == (uint64_t)getpid())
            found = fd;
    }
    closedir(d);
    return found;
}

/* Whether the table at `fd` lists a chunk holding `p`. */
static int lists(int fd, const void *p) {
    static uint64_t t[8 + 4096 * 8];
    CHECK(pread(fd, t, sizeof t, 0) == (ssize_t)sizeof t);
    uintptr_t a = (uintptr_t)p;
    for (int s = 0; s < 4096; s++) {
        uint64_t *e = &t[8 + s * 8];
        if (e[1] != 0 && a >= e[0] && a < e[0] + e[1]) return 1;
    }
    return 0;
}

static int child(const char *dir, numaweave_slab *cache) {
    /* A daemon's first act: every inherited descriptor but stdio closed. */
    for (int fd = 3; fd < 1024; fd++) close(fd);
    int logs[4];
    ino_t ino[4];
    for (int i = 0; i < 4; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/log%d", dir, i);
        logs[i] = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        CHECK(logs[i] >= 3);
        struct stat st;
        CHECK(fstat(logs[i], &st) == 0);
        ino[i] = st.st_ino;
    }
    /* The cache grows: new chunks, each listed in the table. */
    void **objs = calloc(GROW, sizeof *objs);
    CHECK(objs != NULL);
    for (unsigned i = 0; i < GROW; i++) {
        objs[i] = numaweave_slab_alloc(cache);
        CHECK(objs[i] != NULL);
        memset(objs[i], (int)i, 64);
    }
    for (int i = 0; i < 4; i++) {
        struct stat st;
        CHECK(fstat(logs[i], &st) == 0 && st.st_ino == ino[i]);
        char line[64];
        int n = snprintf(line, sizeof line, "worker %d log %d\n", (int)getpid(), i);
        CHECK(write(logs[i], line, (size_t)n) == n);
        CHECK(close(logs[i]) == 0);
    }
    int t = own_table();
    CHECK(t >= 0);
    CHECK(lists(t, objs[GROW - 1]));
    for (unsigned i = 0; i < GROW; i++) {
        CHECK(*(unsigned char *)objs[i] == (unsigned char)i);
        numaweave_slab_free(cache, objs[i]);
    }
    free(objs);
    return 0;
}

int main(int argc, char **argv) {
    CHECK(argc == 2);
    numaweave_slab *cache = numaweave_slab_create("prefork", OBJ, 0, -1);
    CHECK(cache != NULL);
    void *first = numaweave_slab_alloc(cache);
    CHECK(first != NULL);
    memset(first, 1, OBJ);
    int t = own_table();
    CHECK(t >= 0);
    CHECK(lists(t, first));

    /* Sealed at its size: another opener cannot truncate it. */
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", t);
    int rw = open(path, O_RDWR | O_CLOEXEC);
    CHECK(rw >= 0);
    CHECK(ftruncate(rw, 0) != 0 && errno == EPERM);
    close(rw);

    for (int round = 0; round < 3; round++) {
        fflush(NULL);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) _exit(child(argv[1], cache));
        /* The parent changes its own table meanwhile. */
        void *more[256];
        for (int i = 0; i < 256; i++) CHECK((more[i] = numaweave_slab_alloc(cache)) != NULL);
        for (int i = 0; i < 256; i++) numaweave_slab_free(cache, more[i]);
        int st;
        CHECK(waitpid(pid, &st, 0) == pid);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        CHECK(own_table() == t);
        CHECK(lists(t, first));
        for (int i = 0; i < 4; i++) {
            char log[512], text[128] = {0};
            snprintf(log, sizeof log, "%s/log%d", argv[1], i);
            int fd = open(log, O_RDONLY | O_CLOEXEC);
            CHECK(fd >= 0);
            CHECK(read(fd, text, sizeof text - 1) > 0);
            CHECK(strstr(text, "worker ") == text);
            close(fd);
        }
    }
    numaweave_slab_free(cache, first);
    numaweave_slab_destroy(cache);
    printf("prefork: checks passed\n");
    return 0;
}

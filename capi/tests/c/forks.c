/* fork() where glibc's own malloc makes it safe, run with the library
 * preloaded (and, as the control, without):
 *
 *   forks stdio SECONDS   four threads fork (each child _exits), eight
 *                         threads getline() a long line (50,000 bytes or
 *                         1 MiB) from their own FILE (the FILE's lock held
 *                         while getline mallocs), one thread fflush(NULL)s
 *                         in a loop
 *                         (stdio's list lock, then each FILE's): glibc's
 *                         fork takes the list lock before the malloc locks
 *                         (glibc bug 19431), an allocator's fork handler
 *                         that takes its locks first waits on the list
 *                         lock, whose holder waits on a FILE whose holder
 *                         waits on the allocator;
 *   forks signal COUNT    a single-threaded process whose SIGUSR1 handler
 *                         forks (the child _exits, the parent waits for
 *                         it) while the main thread mallocs, frees and
 *                         forks, the signal sent by five other processes:
 *                         the interrupted malloc, free or fork may hold
 *                         any of the allocator's locks, or be half done.
 *
 * Each prints "forks: ... checks passed" when done; a hang is the failure
 * (the caller bounds the run in time). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

static atomic_int stop;
static atomic_long forked, lines_read, flushes;

static void *fork_loop(void *arg) {
    (void)arg;
    while (!atomic_load(&stop)) {
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) _exit(17);
        int status;
        CHECK(waitpid(pid, &status, 0) == pid);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 17);
        atomic_fetch_add(&forked, 1);
    }
    return NULL;
}

/* The readers' lines: half of them glibc's test's 50,000 bytes (a small
 * block's class), half 1 MiB (a mapping of its own, taken from and given
 * back to the node's arena under its lock on every getline). */
static char paths[2][64];
static const long line_len[2] = {50000, 1 << 20};

static void *getline_loop(void *arg) {
    int which = (int)(uintptr_t)arg % 2;
    long len0 = line_len[which];
    FILE *f = fopen(paths[which], "r");
    CHECK(f != NULL);
    while (!atomic_load(&stop)) {
        rewind(f);
        char *line = NULL;
        size_t n = 0;
        ssize_t len = getline(&line, &n, f);
        CHECK(len == len0 + 1 && line[0] == 'x' && line[len0 - 1] == 'x' && line[len0] == '\n');
        free(line);
        atomic_fetch_add(&lines_read, 1);
    }
    fclose(f);
    return NULL;
}

static void *flush_loop(void *arg) {
    (void)arg;
    while (!atomic_load(&stop)) {
        CHECK(fflush(NULL) == 0);
        atomic_fetch_add(&flushes, 1);
    }
    return NULL;
}

static int with_stdio(double seconds) {
    for (int k = 0; k < 2; k++) {
        snprintf(paths[k], sizeof paths[k], "/tmp/numaweave-forks-%d-%d", (int)getpid(), k);
        FILE *f = fopen(paths[k], "w");
        CHECK(f != NULL);
        for (long i = 0; i < line_len[k]; i++) fputc('x', f);
        fputc('\n', f);
        CHECK(fclose(f) == 0);
    }
    pthread_t t[13];
    for (int i = 0; i < 13; i++)
        CHECK(pthread_create(&t[i], NULL, i < 4 ? fork_loop : i < 12 ? getline_loop : flush_loop, (void *)(uintptr_t)i) ==
              0);
    struct timespec ts = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
    atomic_store(&stop, 1);
    for (int i = 0; i < 13; i++) CHECK(pthread_join(t[i], NULL) == 0);
    unlink(paths[0]);
    unlink(paths[1]);
    CHECK(forked > 0 && lines_read > 0 && flushes > 0);
    printf("forks: stdio: %ld children, %ld lines, %ld flushes in %.1f s; %d checks passed\n", (long)forked,
           (long)lines_read, (long)flushes, seconds, checks);
    return 0;
}

/* Async-signal-safe reports: the handler may interrupt stdio. */
static void say(const char *s) {
    ssize_t r = write(2, s, strlen(s));
    (void)r;
}

static volatile sig_atomic_t in_handler_forks;

static void on_usr1(int sig) {
    (void)sig;
    int saved = errno;
    pid_t pid = fork();
    if (pid < 0) {
        say("forks.c: fork in the signal handler failed\n");
        abort();
    }
    if (pid == 0) _exit(0);
    int status;
    pid_t w;
    while ((w = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
    }
    if (w != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        say("forks.c: the signal handler's child did not exit 0\n");
        abort();
    }
    in_handler_forks++;
    errno = saved;
}

/* A sender: signals its parent until killed, at random, 0.2 to 1 ms
 * apart (five of them: one signal every 0.1 ms or so, while a fork in the
 * handler takes about as long; closer, the main thread would only ever
 * run between two handlers). */
static void sender(pid_t target, unsigned seed) {
    for (;;) {
        if (kill(target, SIGUSR1) != 0) _exit(1);
        usleep(200 + rand_r(&seed) % 800);
    }
}

static int with_signals(long count) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sigemptyset(&sa.sa_mask);
    /* No SA_RESTART: waitpid below sees EINTR and tries again. */
    CHECK(sigaction(SIGUSR1, &sa, NULL) == 0);
    pid_t senders[5];
    for (int i = 0; i < 5; i++) {
        senders[i] = fork();
        CHECK(senders[i] >= 0);
        if (senders[i] == 0) sender(getppid(), (unsigned)i * 7919u + 1);
    }
    enum { OBJECTS = 1009 };
    static unsigned char *objects[OBJECTS];
    static size_t sizes[OBJECTS];
    unsigned seed = 1;
    long iterations = 0, own_forks = 0;
    while (in_handler_forks < count) {
        int slot = rand_r(&seed) % OBJECTS;
        size_t size = (size_t)rand_r(&seed) % 70000;
        if (objects[slot]) {
            /* Whatever interrupted, the block kept what was written. */
            CHECK(objects[slot][0] == (unsigned char)slot && objects[slot][sizes[slot] - 1] == (unsigned char)slot);
            free(objects[slot]);
        }
        objects[slot] = malloc(size + 1);
        CHECK(objects[slot] != NULL);
        sizes[slot] = size + 1;
        objects[slot][0] = objects[slot][size] = (unsigned char)slot;
        if (++iterations % 64 == 0) {
            /* The main thread forks too: a signal may land inside fork. */
            pid_t pid = fork();
            CHECK(pid >= 0);
            if (pid == 0) {
                /* The child allocates: its copy of the allocator is whole. */
                void *p = malloc(100);
                free(p);
                _exit(p ? 3 : 4);
            }
            int status;
            pid_t w;
            while ((w = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
            }
            CHECK(w == pid && WIFEXITED(status) && WEXITSTATUS(status) == 3);
            own_forks++;
        }
    }
    signal(SIGUSR1, SIG_IGN);
    for (int i = 0; i < 5; i++) {
        kill(senders[i], SIGKILL);
        waitpid(senders[i], NULL, 0);
    }
    for (int i = 0; i < OBJECTS; i++) free(objects[i]);
    printf("forks: signal: %ld forks in the handler, %ld iterations, %ld forks of the main thread; %d checks passed\n",
           (long)in_handler_forks, iterations, own_forks, checks);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc == 3 && strcmp(argv[1], "stdio") == 0) return with_stdio(atof(argv[2]));
    if (argc == 3 && strcmp(argv[1], "signal") == 0) return with_signals(atol(argv[2]));
    fprintf(stderr, "usage: forks stdio SECONDS | forks signal COUNT\n");
    return 2;
}

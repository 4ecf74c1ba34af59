/* The C library's own resident pages, as a program that preloads it keeps
 * them: start-up, the malloc family on small, large and huge blocks, a
 * thread that allocates and exits (its blocks then freed remotely), then
 * the sum of `Rss:` over the mappings of the file named in argv[1] (a
 * path's last component), in KiB, on stdout. Every block escapes
 * (`keep`): a compiler may delete a malloc whose only use is its free.
 *
 * The kernel maps a file's pages in 64 KiB windows around each fault
 * (fault-around), so a function run once costs its window: the code a
 * program runs lies together (`.text.sorted.numaweave`), and a function
 * left out of it shows here as 64 KiB more. `.ci/fastpaths` bounds it. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *kept[64];

/* Makes `p` escape, so that its allocation and writes stay. */
static void keep(void *p) { __asm__ volatile("" : : "r"(p) : "memory"); }

static void *worker(void *arg) {
    (void)arg;
    for (int i = 0; i < 64; i++) kept[i] = malloc(16 + 40 * i);
    void *p = malloc(100);
    keep(p);
    free(p);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    void *small[256];
    for (int i = 0; i < 256; i++) keep(small[i] = malloc(8 + (i * 37) % 3000));
    for (int i = 0; i < 256; i += 2) small[i] = realloc(small[i], 5000);
    void *big = calloc(1, 300 * 1024), *huge = malloc(8 << 20);
    keep(big);
    memset(huge, 1, 1 << 20);
    keep(huge);
    pthread_t t;
    if (pthread_create(&t, NULL, worker, NULL) || pthread_join(t, NULL)) return 2;
    for (int i = 0; i < 64; i++) free(kept[i]);
    for (int i = 0; i < 256; i++) free(small[i]);
    free(big);
    free(huge);

    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return 2;
    char line[4096];
    int ours = 0;
    long kib = 0, maps = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char path[4096] = "";
        if (sscanf(line, "%lx-%lx %*s %*s %*s %*s %4095s", &lo, &hi, path) >= 2 && strchr(line, '-') < strchr(line, ' ')) {
            const char *base = strrchr(path, '/');
            ours = base && strcmp(base + 1, argv[1]) == 0;
            maps += ours;
        } else if (ours && strncmp(line, "Rss:", 4) == 0) {
            kib += strtol(line + 4, NULL, 10);
        }
    }
    fclose(f);
    if (maps == 0) {
        fprintf(stderr, "resident: %s is not mapped (not preloaded?)\n", argv[1]);
        return 2;
    }
    printf("%ld\n", kib);
    return 0;
}

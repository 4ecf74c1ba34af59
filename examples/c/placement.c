/* numaweave from C: where plain malloc puts memory, and an interleave with a
 * granularity set from its text form.
 *
 * Build and run (the library, header and launcher come from
 * `cargo build --release --workspace`):
 *
 *   cc -O2 -I target/release examples/c/placement.c -o placement \
 *      -L target/release -lnumaweave -Wl,-rpath,$PWD/target/release -lpthread -ldl
 *   ./placement
 *
 * or statically (as the multi-node VM check does):
 *
 *   cc -O2 -static -I target/release examples/c/placement.c -o placement \
 *      target/release/libnumaweave.a -lpthread -ldl -lm
 *
 * A thread pinned to each node with CPUs allocates with plain malloc and
 * asks the kernel (move_pages) where every page landed; then one thread
 * sets numaweave_set_thread_policy("interleave:ALL:bytes=256K") and checks
 * that 64 KiB I/O buffers (posix_memalign'ed) rotate over the nodes four to
 * a turn. Each thread also asks numaweave_alloc_cold for 1 MiB of cold data:
 * on a memory-only (CXL-like) node where the machine has one, else its own.
 * Exits non-zero if a page is off its node. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "numaweave.h"

#define MPOL_F_NODE 1
#define MPOL_F_ADDR 2

/* The kernel's node of the page at p (touched first): get_mempolicy. */
static int page_node(void *p) {
    int node = -1;
    *(volatile char *)p = *(volatile char *)p;
    if (syscall(SYS_get_mempolicy, &node, NULL, 0, p, MPOL_F_NODE | MPOL_F_ADDR) != 0) return -2;
    return node;
}

static int cpu_of_node(int node) {
    char path[128], buf[256];
    snprintf(path, sizeof path, "/sys/devices/system/node/node%d/cpulist", node);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int cpu = -1;
    if (fgets(buf, sizeof buf, f) && buf[0] >= '0' && buf[0] <= '9') cpu = atoi(buf);
    fclose(f);
    return cpu;
}

struct job {
    int node, cpu, bad, pages;
    uint64_t memory_only; /* mask of memory-only nodes */
    int cold_node, cold_bad;
};

static void *on_node(void *arg) {
    struct job *j = arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(j->cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) return NULL;
    size_t sizes[] = {64, 1000, 30000, 200000, 3 << 20};
    for (int s = 0; s < 5; s++) {
        for (int k = 0; k < 8; k++) {
            char *p = malloc(sizes[s]);
            memset(p, 1, sizes[s]);
            for (size_t off = 0; off < sizes[s]; off += 4096) {
                j->pages++;
                if (page_node(p + off) != j->node) j->bad++;
            }
            free(p);
        }
    }
    /* Cold data: every page on one memory-only node, or on this node
     * where there is none. */
    char *c = numaweave_alloc_cold(1 << 20, 4096);
    if (!c) {
        j->cold_bad = 1;
        return NULL;
    }
    memset(c, 3, 1 << 20);
    j->cold_node = page_node(c);
    for (size_t off = 0; off < 1 << 20; off += 4096) {
        int n = page_node(c + off);
        int want_mem_only = j->memory_only != 0;
        if (n != j->cold_node || n < 0 || (want_mem_only ? !((j->memory_only >> n) & 1) : n != j->node)) j->cold_bad++;
    }
    free(c);
    return NULL;
}

int main(void) {
    int nodes = numaweave_node_count(), bad = 0, cpu_nodes = 0;
    printf("%d node(s)\n", nodes);
    uint64_t memory_only = 0;
    for (int n = 0; n < nodes && n < 64; n++) {
        void *probe = cpu_of_node(n) < 0 ? numaweave_alloc_on_node(4096, 4096, n) : NULL;
        if (probe) memory_only |= 1ull << n;
        free(probe);
    }
    for (int n = 0; n < nodes; n++) {
        struct job j = {.node = n, .cpu = cpu_of_node(n), .memory_only = memory_only};
        if (j.cpu < 0) continue; /* memory-only node */
        cpu_nodes++;
        pthread_t t;
        pthread_create(&t, NULL, on_node, &j);
        pthread_join(t, NULL);
        printf("  thread on node %d (cpu %d): malloc'd %d pages, %d off node %d; 1 MiB of cold data on node %d, %d pages off\n",
               n, j.cpu, j.pages, j.bad, n, j.cold_node, j.cold_bad);
        bad += j.bad + j.cold_bad;
    }
    /* Interleave over every node with memory, 256 KiB turns: 64 KiB I/O
     * buffers go four to a node, in node order. */
    char spec[256] = "interleave:";
    int mem[64], m = 0;
    for (int n = 0; n < nodes && n < 64; n++) {
        void *probe = numaweave_alloc_on_node(4096, 4096, n);
        if (!probe) continue; /* no memory there */
        free(probe);
        mem[m++] = n;
        snprintf(spec + strlen(spec), sizeof spec - strlen(spec), "%s%d", m > 1 ? "," : "", n);
    }
    strncat(spec, ":bytes=256K", sizeof spec - strlen(spec) - 1);
    if (numaweave_set_thread_policy(spec) != NUMAWEAVE_OK) {
        printf("%s: %s\n", spec, numaweave_last_error());
        return 1;
    }
    int off = 0;
    void *bufs[64];
    for (int i = 0; i < 64; i++) {
        if (posix_memalign(&bufs[i], 4096, 65536) != 0) return 1;
        memset(bufs[i], 2, 65536);
    }
    numaweave_clear_thread_policy();
    /* The thread's turn may have started mid-rotation: find the phase from
     * the first buffer's node, then every buffer must follow. */
    int start = 0;
    while (start < m && mem[start] != numaweave_node_of(bufs[0])) start++;
    for (int i = 0; i < 64; i++) {
        int want = mem[(start + i / 4) % m];
        for (int p = 0; p < 16; p++)
            if (page_node((char *)bufs[i] + p * 4096) != want) off++;
        free(bufs[i]);
    }
    printf("  %s: 64 buffers of 64 KiB, %d pages off the turn's node\n", spec, off);
    bad += off;
    printf("placement: %s (%d nodes with CPUs checked)\n", bad ? "FAILED" : "ok", cpu_nodes);
    return bad ? 1 : 0;
}

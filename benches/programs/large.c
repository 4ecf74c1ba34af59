/* Workload class "large blocks": a loop of 5-25 MB blocks, each written
 * page by page (as a buffer is filled) and freed. glibc keeps such blocks
 * after it has seen one freed (its mmap threshold rises); an allocator that
 * unmaps them pays a fault and a cleared page for every page, every time. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 400;
    uint64_t x = 88172645463325252ull, sum = 0;
    for (int i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        size_t size = (5 + x % 21) << 20;
        unsigned char *p = malloc(size);
        if (!p) return 1;
        for (size_t off = 0; off < size; off += 4096) p[off] = (unsigned char)(i + off);
        for (size_t off = 0; off < size; off += 65536) sum += p[off];
        free(p);
    }
    printf("%llu\n", (unsigned long long)sum);
    return 0;
}

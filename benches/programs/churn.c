/* Workload class "single-thread churn": mixed sizes (8 B - 32 KiB), a few
 * thousand live, with an occasional realloc growing or shrinking a block. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LIVE 4096

int main(int argc, char **argv) {
    size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : 20000000;
    static void *live[LIVE];
    static size_t sizes[LIVE];
    uint64_t x = 0x9e3779b97f4a7c15ull, sum = 0;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        size_t k = x % LIVE;
        if (live[k] && (x >> 20) % 16 == 0) {
            size_t ns = 8 + (x >> 32) % (sizes[k] * 2 + 64);
            live[k] = realloc(live[k], ns);
            sizes[k] = ns;
        } else {
            free(live[k]);
            size_t s = (size_t)8 << ((x >> 24) % 13);
            s += (x >> 40) % s;
            live[k] = malloc(s);
            sizes[k] = s;
        }
        ((unsigned char *)live[k])[0] = (unsigned char)i;
        sum += ((unsigned char *)live[k])[sizes[k] - 1];
    }
    for (size_t k = 0; k < LIVE; k++) free(live[k]);
    printf("%llu\n", (unsigned long long)sum);
    return 0;
}

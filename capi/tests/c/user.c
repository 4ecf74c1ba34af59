/* A library that allocates when used and frees what it kept when unloaded
 * (for life.c's dlopen/dlclose). */
#include <stdio.h>
#include <stdlib.h>

static char *kept[16];
static int n;

char *user_make(int k) {
    char *s = malloc(64);
    snprintf(s, 64, "k%d", k);
    if (n < 16) {
        kept[n] = malloc(1000 + k);
        n++;
    }
    return s;
}

__attribute__((destructor)) static void unload(void) {
    for (int i = 0; i < n; i++) free(kept[i]);
}

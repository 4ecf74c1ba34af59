/* The check of the C tests: counts, and on failure says where, what and
 * errno, then exits 1. `CHECK_AT` adds the size being checked. */
#ifndef NUMAWEAVE_TEST_CHECK_H
#define NUMAWEAVE_TEST_CHECK_H
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

static int checks;
#define CHECK_FAILED(c, ...)                                             \
    do {                                                                 \
        fprintf(stderr, "%s:%d: check failed: %s", __FILE__, __LINE__, c); \
        fprintf(stderr, __VA_ARGS__);                                    \
        exit(1);                                                         \
    } while (0)
#define CHECK(c)                                                   \
    do {                                                           \
        checks++;                                                  \
        if (!(c)) CHECK_FAILED(#c, " (errno %d)\n", errno);        \
    } while (0)
#define CHECK_AT(c, n)                                                 \
    do {                                                               \
        checks++;                                                      \
        if (!(c)) CHECK_FAILED(#c, " (size %zu)\n", (size_t)(n));      \
    } while (0)
#endif

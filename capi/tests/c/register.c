/* A cache's registration hooks from C (numaweave_slab_create_registered):
 * every region registered once before an object of it is handed out and
 * unregistered once before it goes; a registrar that refuses fails the
 * allocation (NUMAWEAVE_REGISTRATION_FAILED) and is never asked to
 * unregister what it refused. With liburing (HAVE_LIBURING), the regions
 * go into an io_uring's sparse fixed-buffer table as they come, and a
 * READ_FIXED into an object reads a file's bytes. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "numaweave.h"

#ifdef HAVE_LIBURING
#include <liburing.h>
#endif

#define MAX_REGIONS 64

struct table {
    numaweave_region regions[MAX_REGIONS];
    int live[MAX_REGIONS];
    int registered, unregistered, refuse, released, reregistered;
#ifdef HAVE_LIBURING
    struct io_uring *ring;
#endif
};

static int slot_of(struct table *t, const void *addr) {
    for (int i = 0; i < t->registered; i++)
        if (t->regions[i].addr == addr) return i;
    return -1;
}

static int on_register(void *ctx, const numaweave_region *r) {
    struct table *t = ctx;
    if (t->refuse) return t->refuse;
    CHECK(t->registered < MAX_REGIONS);
    CHECK(slot_of(t, r->addr) < 0 || !t->live[slot_of(t, r->addr)]);
    CHECK(r->len > 0 && r->page_size >= 4096 && (uintptr_t)r->addr % r->page_size == 0 && r->len % r->page_size == 0);
    int i = t->registered++;
    t->regions[i] = *r;
    t->live[i] = 1;
#ifdef HAVE_LIBURING
    if (t->ring) {
        struct iovec iov = {r->addr, r->len};
        __u64 tag = 0;
        int e = io_uring_register_buffers_update_tag(t->ring, (unsigned)i, &iov, &tag, 1);
        if (e < 0) {
            t->live[i] = 0;
            t->registered--;
            return -e;
        }
    }
#endif
    return 0;
}

static void on_unregister(void *ctx, const numaweave_region *r) {
    struct table *t = ctx;
    int i = slot_of(t, r->addr);
    CHECK(i >= 0 && t->live[i] && t->regions[i].len == r->len && t->regions[i].node == r->node);
    t->live[i] = 0;
    t->unregistered++;
#ifdef HAVE_LIBURING
    if (t->ring) {
        struct iovec iov = {NULL, 0};
        __u64 tag = 0;
        CHECK(io_uring_register_buffers_update_tag(t->ring, (unsigned)i, &iov, &tag, 1) == 1);
    }
#endif
}

/* A mover: the region leaves its slot's registration and comes back to
 * the same slot, on its new node. */
static int on_release(void *ctx, const numaweave_region *r) {
    struct table *t = ctx;
    int i = slot_of(t, r->addr);
    CHECK(i >= 0 && t->live[i] && t->regions[i].len == r->len);
    t->live[i] = 2; /* released, slot kept */
    t->released++;
    return 0;
}

static int on_reregister(void *ctx, const numaweave_region *r) {
    struct table *t = ctx;
    int i = slot_of(t, r->addr);
    CHECK(i >= 0 && t->live[i] == 2 && t->regions[i].len == r->len);
    t->live[i] = 1;
    t->regions[i].node = r->node;
    t->reregistered++;
    return 0;
}

/* The registered region an object lies in, or -1. */
static int region_of(struct table *t, const void *p, size_t size) {
    for (int i = 0; i < t->registered; i++) {
        const char *a = t->regions[i].addr;
        if (t->live[i] && (const char *)p >= a && (const char *)p + size <= a + t->regions[i].len) return i;
    }
    return -1;
}

int main(void) {
    enum { N = 600, SIZE = 4096 };
    static void *objs[N];
    struct table t = {0};
    numaweave_registrar reg = {on_register, on_unregister, &t};
    CHECK(numaweave_slab_create_registered("reg_null", SIZE, SIZE, -1, NULL) == NULL);

    numaweave_slab *s = numaweave_slab_create_registered("reg_bufs", SIZE, SIZE, -1, &reg);
    CHECK(s != NULL);
    CHECK(t.registered == 0); /* nothing mapped before the first object */
    for (int i = 0; i < N; i++) {
        objs[i] = numaweave_slab_alloc(s);
        CHECK(objs[i] != NULL && (uintptr_t)objs[i] % SIZE == 0);
        CHECK(region_of(&t, objs[i], SIZE) >= 0);
        memset(objs[i], i & 0xff, SIZE);
    }
    CHECK(t.registered >= 2); /* 2.4 MiB of buffers: chunks double from 8 slabs */
    /* A registered cache does not move: its regions are pinned, and a C
     * registrar cannot release them. Nothing moves, the error says so. */
    numaweave_migration m = {.to = -1};
    CHECK(numaweave_slab_migrate(s, 0, &m) == NUMAWEAVE_REGISTERED);
    CHECK(m.to == -1 && strstr(numaweave_last_error(), "registered") != NULL);
    for (int i = 0; i < N; i++) numaweave_slab_free(s, objs[i]);
    numaweave_slab_destroy(s);
    CHECK(t.unregistered == t.registered);

    /* With a mover it moves: each region released and registered again in
     * its slot, none registered anew, every object where it was. */
    struct table mt = {0};
    numaweave_registrar mreg = {on_register, on_unregister, &mt};
    numaweave_mover mover = {on_release, on_reregister};
    numaweave_mover half = {on_release, NULL};
    CHECK(numaweave_slab_create_movable("mv_half", SIZE, SIZE, 0, &mreg, &half) == NULL);
    CHECK(numaweave_slab_create_movable("mv_null", SIZE, SIZE, 0, &mreg, NULL) == NULL);
    numaweave_slab *ms = numaweave_slab_create_movable("mv_bufs", SIZE, SIZE, 0, &mreg, &mover);
    CHECK(ms != NULL);
    for (int i = 0; i < N; i++) {
        CHECK((objs[i] = numaweave_slab_alloc(ms)) != NULL);
        memset(objs[i], i & 0xff, SIZE);
    }
    int regions = mt.registered;
    CHECK(numaweave_slab_migrate(ms, 0, &m) == NUMAWEAVE_OK);
    CHECK(m.regions_moved == (uint64_t)regions && mt.released == regions && mt.reregistered == regions);
    CHECK(mt.registered == regions && m.pages_refused == 0);
    for (int i = 0; i < N; i++) {
        unsigned char *b = objs[i];
        CHECK(region_of(&mt, b, SIZE) >= 0 && b[0] == (i & 0xff) && b[SIZE - 1] == (i & 0xff));
        numaweave_slab_free(ms, objs[i]);
    }
    numaweave_slab_destroy(ms);
    CHECK(mt.unregistered == mt.registered);
    for (int i = 0; i < t.registered; i++) CHECK(!t.live[i]);

    /* A plain cache moves while in use: every object where it was, with
     * what it held; a bad node is refused. */
    numaweave_slab *mv = numaweave_slab_create("movable", SIZE, SIZE, 0);
    CHECK(mv != NULL);
    /* A demotion condition that always holds moves it from its first
     * refill (to node 0, where it is). */
    CHECK(numaweave_slab_demote_when(mv, 0, UINT64_MAX, 0, 0) == NUMAWEAVE_OK);
    CHECK(numaweave_slab_demote_when(mv, 4096, 1, 0, 0) == NUMAWEAVE_INVALID_NODE);
    for (int i = 0; i < N; i++) {
        objs[i] = numaweave_slab_alloc(mv);
        CHECK(objs[i] != NULL);
        memset(objs[i], i & 0xff, SIZE);
    }
    CHECK(numaweave_slab_migrate(mv, 0, &m) == NUMAWEAVE_OK);
    CHECK(m.to == 0 && m.pages_busy + m.pages_node_full + m.pages_shared + m.pages_refused + m.pages_other == 0);
    CHECK(m.pages_moved + m.pages_already >= N); /* every written page present, on node 0 */
    CHECK(numaweave_slab_migrate(mv, 4096, NULL) == NUMAWEAVE_INVALID_NODE);
    /* A migration that fails still writes *out: a caller that reads it
     * reads no garbage. */
    memset(&m, 0x55, sizeof m);
    CHECK(numaweave_slab_migrate(mv, 4096, &m) == NUMAWEAVE_INVALID_NODE);
    CHECK(m.to == -1 && m.pages_moved == 0 && m.regions_lost == 0);
    CHECK(numaweave_slab_migrate(NULL, 0, NULL) == NUMAWEAVE_INVALID_ARGUMENT);
    for (int i = 0; i < N; i++) {
        unsigned char *b = objs[i];
        CHECK(b[0] == (i & 0xff) && b[SIZE - 1] == (i & 0xff));
    }
    static char info[1 << 16];
    numaweave_slabinfo(info, sizeof info);
    CHECK(strstr(info, "movable: 2 migrations (1 demotions) moved") != NULL);
    for (int i = 0; i < N; i++) numaweave_slab_free(mv, objs[i]);
    numaweave_slab_destroy(mv);

    /* A registrar that refuses: the allocation fails with its errno, and
     * nothing it refused is unregistered. */
    struct table no = {.refuse = ENOMEM};
    numaweave_registrar noreg = {on_register, on_unregister, &no};
    numaweave_slab *r = numaweave_slab_create_registered("reg_refused", 256, 0, -1, &noreg);
    CHECK(r != NULL);
    CHECK(numaweave_slab_alloc(r) == NULL);
    CHECK(strstr(numaweave_last_error(), "registrar refused") != NULL);
    CHECK(strstr(numaweave_last_error(), "ENOMEM") != NULL);
    no.refuse = 0; /* and once it accepts, the cache serves */
    void *o = numaweave_slab_alloc(r);
    CHECK(o != NULL && region_of(&no, o, 256) >= 0);
    numaweave_slab_free(r, o);
    numaweave_slab_destroy(r);
    CHECK(no.registered >= 1 && no.unregistered == no.registered);

#ifdef HAVE_LIBURING
    struct io_uring ring;
    int e = io_uring_queue_init(8, &ring, 0);
    if (e == 0) e = io_uring_register_buffers_sparse(&ring, MAX_REGIONS);
    if (e < 0) {
        printf("io_uring leg skipped: %s\n", strerror(-e));
    } else {
        char path[] = "/tmp/numaweave-register-XXXXXX";
        int fd = mkstemp(path);
        CHECK(fd >= 0);
        unlink(path);
        char data[SIZE];
        for (int i = 0; i < SIZE; i++) data[i] = (char)(i * 7 + 3);
        CHECK(write(fd, data, SIZE) == SIZE);
        struct table u = {.ring = &ring};
        numaweave_registrar ureg = {on_register, on_unregister, &u};
        numaweave_slab *io = numaweave_slab_create_registered("reg_uring", SIZE, SIZE, -1, &ureg);
        CHECK(io != NULL);
        char *buf = numaweave_slab_alloc(io);
        if (buf == NULL && strstr(numaweave_last_error(), "ENOMEM") != NULL) {
            /* io_uring pins registered buffers against RLIMIT_MEMLOCK. */
            printf("io_uring leg skipped: %s (RLIMIT_MEMLOCK)\n", numaweave_last_error());
            numaweave_slab_destroy(io);
            close(fd);
            io_uring_queue_exit(&ring);
            printf("register: %d checks passed\n", checks);
            return 0;
        }
        CHECK(buf != NULL);
        int slot = region_of(&u, buf, SIZE);
        CHECK(slot >= 0);
        memset(buf, 0, SIZE);
        struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
        io_uring_prep_read_fixed(sqe, fd, buf, SIZE, 0, slot);
        CHECK(io_uring_submit(&ring) == 1);
        struct io_uring_cqe *cqe;
        CHECK(io_uring_wait_cqe(&ring, &cqe) == 0);
        CHECK(cqe->res == SIZE);
        io_uring_cqe_seen(&ring, cqe);
        CHECK(memcmp(buf, data, SIZE) == 0);
        numaweave_slab_free(io, buf);
        numaweave_slab_destroy(io);
        CHECK(u.registered == u.unregistered);
        close(fd);
        printf("io_uring: READ_FIXED into a registered object, %d region(s)\n", u.registered);
    }
    io_uring_queue_exit(&ring);
#else
    printf("io_uring leg skipped: liburing not installed (liburing-dev)\n");
#endif
    printf("register: %d checks passed\n", checks);
    return 0;
}

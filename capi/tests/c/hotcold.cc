// The hinted operator new family (LLVM's -optimize-hot-cold-new, tcmalloc's
// __hot_cold_t) through libnumaweave, called directly as a profile-guided
// build calls it: every form, hot and cold blocks of many sizes mixed, and
// then, over every page of every block (move_pages, the kernel's word):
//
// - no page holds both a hot and a cold block;
// - on a machine with a lower memory tier (a memory-only node), every cold
//   page is on one, and every hot page on the node of the CPU the program
//   is pinned to; with none, both on that node (cold a counted fallback);
// - the failure paths: a cold new that cannot be served calls the
//   new-handler, retries cold, and throws std::bad_alloc; the nothrow forms
//   return null.
//
// Also the multi-node guest's check (.ci/vm-tests links it statically and
// runs it with --placement: in a static program the library cannot find
// the C++ runtime's thrower by dlsym, so the failure paths are left out).
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <set>
#include <vector>

#include "numaweave.h"

static int checks;
#define CHECK(c)                                                                 \
    do {                                                                         \
        checks++;                                                                \
        if (!(c)) {                                                              \
            std::fprintf(stderr, "hotcold.cc:%d: check failed: %s\n", __LINE__, #c); \
            std::exit(1);                                                        \
        }                                                                        \
    } while (0)

static const __hot_cold_t COLD = static_cast<__hot_cold_t>(1);
static const __hot_cold_t HOT = static_cast<__hot_cold_t>(254);
static const std::size_t PAGE = 4096;

struct Block {
    void *p;
    std::size_t size;
    bool cold;
    bool array;
    std::size_t align; // 0: not an aligned form
};

/* The node of each page (the kernel's answer), -errno where it has none. */
static std::vector<int> nodes_of(const std::vector<void *> &pages) {
    std::vector<int> status(pages.size(), -1);
    long r = syscall(SYS_move_pages, 0, pages.size(), pages.data(), nullptr, status.data(), 0);
    CHECK(r == 0);
    return status;
}

/* Whether node n has memory and no CPU (/sys/devices/system/node). */
static bool memory_only(int n) {
    char path[96];
    std::snprintf(path, sizeof path, "/sys/devices/system/node/node%d/cpulist", n);
    FILE *f = std::fopen(path, "r");
    if (!f) return false;
    char buf[64] = {0};
    bool cpus = std::fgets(buf, sizeof buf, f) && buf[0] != '\n' && buf[0] != 0;
    std::fclose(f);
    return !cpus;
}

static int handler_calls;
static void handler() {
    handler_calls++;
    std::set_new_handler(nullptr); // next time: throw
}

static volatile std::size_t IMPOSSIBLE = SIZE_MAX / 2;

static void failure_paths() {
    bool caught = false;
    std::set_new_handler(handler);
    try {
        void *p = ::operator new(IMPOSSIBLE, COLD);
        std::printf("%p\n", p);
    } catch (const std::bad_alloc &) {
        caught = true;
    }
    CHECK(caught && handler_calls == 1);
    caught = false;
    try {
        void *p = ::operator new[](IMPOSSIBLE, std::align_val_t(64), COLD);
        std::printf("%p\n", p);
    } catch (const std::bad_alloc &) {
        caught = true;
    }
    CHECK(caught);
    CHECK(::operator new(IMPOSSIBLE, std::nothrow, COLD) == nullptr);
    CHECK(::operator new[](IMPOSSIBLE, std::nothrow, HOT) == nullptr);
    CHECK(::operator new(IMPOSSIBLE, std::align_val_t(64), std::nothrow, COLD) == nullptr);
    CHECK(::operator new[](IMPOSSIBLE, std::align_val_t(64), std::nothrow, HOT) == nullptr);
}

int main(int argc, char **argv) {
    bool placement_only = argc > 1 && std::strcmp(argv[1], "--placement") == 0;
    // Pinned to the first CPU, so that "local" is one node.
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(0, &one);
    CHECK(sched_setaffinity(0, sizeof one, &one) == 0);
    unsigned cpu = 0, here = 0;
    CHECK(syscall(SYS_getcpu, &cpu, &here, nullptr) == 0);

    std::vector<Block> blocks;
    std::uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < 6000; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::size_t size = 8 + x % ((x >> 20) % 8 == 0 ? 16384 : 512);
        if (i % 500 == 0) size = 300 << 10; // beyond the size classes
        bool cold = (x >> 33) % 2;
        __hot_cold_t h = cold ? COLD : HOT;
        Block b{nullptr, size, cold, false, 0};
        switch ((x >> 40) % 8) {
        case 0: b.p = ::operator new(size, h); break;
        case 1: b.p = ::operator new[](size, h); b.array = true; break;
        case 2: b.align = 64; b.p = ::operator new(size, std::align_val_t(64), h); break;
        case 3: b.align = 4096; b.p = ::operator new[](size, std::align_val_t(4096), h); b.array = true; break;
        case 4: b.p = ::operator new(size, std::nothrow, h); break;
        case 5: b.p = ::operator new[](size, std::nothrow, h); b.array = true; break;
        case 6: b.align = 32; b.p = ::operator new(size, std::align_val_t(32), std::nothrow, h); break;
        default: b.align = 128; b.p = ::operator new[](size, std::align_val_t(128), std::nothrow, h); b.array = true; break;
        }
        CHECK(b.p != nullptr);
        CHECK(reinterpret_cast<std::uintptr_t>(b.p) % (b.align ? b.align : __STDCPP_DEFAULT_NEW_ALIGNMENT__) == 0);
        std::memset(b.p, cold ? 0xC0 : 0x40, size); // every page faulted in
        blocks.push_back(b);
        // Some freed again (delete of either is an ordinary free).
        if (i % 7 == 3) {
            Block &d = blocks[x % blocks.size()];
            if (d.p) {
                if (d.array) ::operator delete[](d.p); else ::operator delete(d.p);
                d.p = nullptr;
            }
        }
    }
    // The C entry point, both ways.
    void *c = numaweave_alloc_hint(1000, 0), *h = numaweave_alloc_hint(1000, 200);
    CHECK(c && h);
    std::memset(c, 0xC0, 1000);
    std::memset(h, 0x40, 1000);
    blocks.push_back(Block{c, 1000, true, false, 0});
    blocks.push_back(Block{h, 1000, false, false, 0});

    std::set<std::uintptr_t> hot_pages, cold_pages;
    for (const Block &b : blocks) {
        if (!b.p) continue;
        const unsigned char *q = static_cast<const unsigned char *>(b.p);
        CHECK(q[0] == (b.cold ? 0xC0 : 0x40) && q[b.size - 1] == q[0]);
        std::uintptr_t first = reinterpret_cast<std::uintptr_t>(b.p) / PAGE;
        std::uintptr_t last = (reinterpret_cast<std::uintptr_t>(b.p) + b.size - 1) / PAGE;
        for (std::uintptr_t pg = first; pg <= last; pg++) (b.cold ? cold_pages : hot_pages).insert(pg);
    }
    std::size_t shared = 0;
    for (std::uintptr_t pg : cold_pages) shared += hot_pages.count(pg);
    CHECK(shared == 0);

    std::vector<void *> cold_v, hot_v;
    for (std::uintptr_t pg : cold_pages) cold_v.push_back(reinterpret_cast<void *>(pg * PAGE));
    for (std::uintptr_t pg : hot_pages) hot_v.push_back(reinterpret_cast<void *>(pg * PAGE));
    std::vector<int> cn = nodes_of(cold_v), hn = nodes_of(hot_v);
    bool tiered = false;
    for (int n = 0; n < 64; n++) tiered |= memory_only(n);
    std::size_t cold_ok = 0, hot_ok = 0;
    int cold_node = -1;
    for (int n : cn) {
        if (tiered ? memory_only(n) : n == static_cast<int>(here)) cold_ok++;
        cold_node = n;
    }
    for (int n : hn) hot_ok += n == static_cast<int>(here);
    std::printf("hotcold: %zu cold pages, %zu on %s (node %d); %zu hot pages, %zu on node %u; none shared\n",
                cn.size(), cold_ok, tiered ? "a memory-only node" : "the local node", cold_node, hn.size(), hot_ok,
                here);
    CHECK(cold_ok == cn.size());
    CHECK(hot_ok == hn.size());

    for (Block &b : blocks) {
        if (!b.p) continue;
        if (b.p == c || b.p == h) std::free(b.p);
        else if (b.array) ::operator delete[](b.p);
        else ::operator delete(b.p);
    }
    if (!placement_only) failure_paths();
    std::printf("hotcold: checks passed (%d)\n", checks);
    return 0;
}

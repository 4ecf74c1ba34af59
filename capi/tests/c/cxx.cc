// C++ new/delete through libnumaweave (linked, or preloaded): every form,
// 16-byte alignment at every size, and the failure paths of
// [new.delete.single]: std::bad_alloc thrown through numaweave's operator
// new (plain, array, aligned) when no new-handler is set; a handler called
// before each retry, one that throws its own exception (which must reach
// the caller), one that frees memory so that the retry succeeds; the
// nothrow forms returning null, also when the handler throws.
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

extern "C" int numaweave_node_of(const void *p);

static int checks;
#define CHECK(c)                                                             \
    do {                                                                     \
        checks++;                                                            \
        if (!(c)) {                                                          \
            std::fprintf(stderr, "cxx.cc:%d: check failed: %s\n", __LINE__, #c); \
            std::exit(1);                                                    \
        }                                                                    \
    } while (0)

struct alignas(256) Wide {
    char b[300];
};

static int handler_calls;
static void handler() {
    handler_calls++;
    std::set_new_handler(nullptr); // next time: throw
}

struct HandlerGaveUp {
    int code;
};
static void throwing_handler() {
    handler_calls++;
    throw HandlerGaveUp{42};
}

static void *reserve;
static void freeing_handler() {
    handler_calls++;
    ::operator delete(reserve);
    reserve = nullptr;
    std::set_new_handler(nullptr);
}

/* Bytes of address space the process has now (/proc/self/statm). */
static std::size_t address_space() {
    unsigned long pages = 0;
    FILE *f = std::fopen("/proc/self/statm", "r");
    if (f) {
        if (std::fscanf(f, "%lu", &pages) != 1) pages = 0;
        std::fclose(f);
    }
    return pages * (std::size_t)sysconf(_SC_PAGESIZE);
}

static volatile std::size_t IMPOSSIBLE = SIZE_MAX / 2;

static void failure_paths() {
    // No handler: std::bad_alloc from each throwing form.
    std::set_new_handler(nullptr);
    int thrown = 0;
    try {
        (void)::operator new(IMPOSSIBLE);
    } catch (const std::bad_alloc &e) {
        thrown += std::string(e.what()).size() > 0;
    }
    try {
        (void)::operator new[](IMPOSSIBLE);
    } catch (const std::bad_alloc &) {
        thrown++;
    }
    try {
        (void)::operator new(IMPOSSIBLE, std::align_val_t(64));
    } catch (const std::bad_alloc &) {
        thrown++;
    }
    try {
        (void)::operator new[](IMPOSSIBLE, std::align_val_t(4096));
    } catch (const std::bad_alloc &) {
        thrown++;
    }
    try {
        char *p = new char[IMPOSSIBLE / 2];
        (void)p;
    } catch (const std::bad_alloc &) {
        thrown++;
    }
    CHECK(thrown == 5);
    CHECK(::operator new(IMPOSSIBLE, std::nothrow) == nullptr);
    CHECK(::operator new[](IMPOSSIBLE, std::nothrow) == nullptr);
    CHECK(::operator new(IMPOSSIBLE, std::align_val_t(64), std::nothrow) == nullptr);

    // A handler runs once, gives up (clears itself), then bad_alloc.
    handler_calls = 0;
    std::set_new_handler(handler);
    bool caught = false;
    try {
        (void)::operator new(IMPOSSIBLE);
    } catch (const std::bad_alloc &) {
        caught = true;
    }
    CHECK(caught && handler_calls == 1);

    // A handler's own exception reaches the caller, from every form.
    std::set_new_handler(throwing_handler);
    handler_calls = 0;
    int codes = 0;
    try {
        (void)::operator new(IMPOSSIBLE);
    } catch (const HandlerGaveUp &e) {
        codes += e.code;
    }
    try {
        (void)::operator new[](IMPOSSIBLE, std::align_val_t(128));
    } catch (const HandlerGaveUp &e) {
        codes += e.code;
    }
    CHECK(codes == 84 && handler_calls == 2);
    // The nothrow forms turn it into null.
    CHECK(::operator new(IMPOSSIBLE, std::nothrow) == nullptr && handler_calls == 3);
    std::set_new_handler(nullptr);

    // A handler that frees memory: the retry succeeds. Address space is
    // bounded so that the second block cannot be had beside the first.
    struct rlimit old;
    CHECK(getrlimit(RLIMIT_AS, &old) == 0);
    const std::size_t block = 96 << 20;
    struct rlimit lim = {address_space() + block + (64 << 20), old.rlim_max};
    if (old.rlim_cur != RLIM_INFINITY && old.rlim_cur < lim.rlim_cur) {
        std::fprintf(stderr, "  (RLIMIT_AS already low: the freeing handler not checked)\n");
        return;
    }
    CHECK(setrlimit(RLIMIT_AS, &lim) == 0);
    reserve = ::operator new(block);
    handler_calls = 0;
    std::set_new_handler(freeing_handler);
    void *p = ::operator new(block);
    CHECK(p != nullptr && handler_calls == 1 && reserve == nullptr);
    static_cast<char *>(p)[block - 1] = 1;
    ::operator delete(p);
    CHECK(setrlimit(RLIMIT_AS, &old) == 0);
}

int main() {
    int *i = new int(7);
    CHECK(numaweave_node_of(i) >= 0 && *i == 7);
    delete i;
    int *a = new int[1000]();
    CHECK(numaweave_node_of(a) >= 0 && a[999] == 0);
    delete[] a;
    Wide *w = new Wide;
    CHECK(reinterpret_cast<std::uintptr_t>(w) % 256 == 0 && numaweave_node_of(w) >= 0);
    delete w;
    Wide *ws = new Wide[3];
    CHECK(reinterpret_cast<std::uintptr_t>(ws) % 256 == 0);
    delete[] ws;
    // new's default alignment at every size (C's malloc gives 8 to 1..8).
    for (std::size_t k = 0; k <= 4096; k++) {
        char *c = new char[k];
        CHECK(reinterpret_cast<std::uintptr_t>(c) % __STDCPP_DEFAULT_NEW_ALIGNMENT__ == 0);
        delete[] c;
        void *v = ::operator new(k);
        CHECK(reinterpret_cast<std::uintptr_t>(v) % __STDCPP_DEFAULT_NEW_ALIGNMENT__ == 0);
        ::operator delete(v, k);
        v = ::operator new(k, std::nothrow);
        CHECK(v && reinterpret_cast<std::uintptr_t>(v) % __STDCPP_DEFAULT_NEW_ALIGNMENT__ == 0);
        ::operator delete(v, std::nothrow);
    }
    void *n = ::operator new(100, std::nothrow);
    CHECK(n != nullptr);
    ::operator delete(n, std::nothrow);
    void *s = ::operator new(64);
    ::operator delete(s, 64); // sized
    void *al = ::operator new(64, std::align_val_t(4096));
    CHECK(reinterpret_cast<std::uintptr_t>(al) % 4096 == 0);
    ::operator delete(al, 64, std::align_val_t(4096));

    std::vector<std::string> v;
    for (int k = 0; k < 10000; k++) v.push_back(std::string(k % 100, 'x'));
    CHECK(v[9999].size() == 99);

    failure_paths();
    std::printf("cxx: %d checks passed\n", checks);
    return 0;
}

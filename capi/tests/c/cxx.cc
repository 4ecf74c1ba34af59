// C++ new/delete through libnumaweave: every form, and std::bad_alloc from
// an impossible new (thrown through numaweave's operator new), the
// new-handler called first.
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
    // new's default alignment, whatever the size (C's malloc gives 8 to 24).
    for (std::size_t k = 1; k <= 200; k++) {
        char *c = new char[k];
        CHECK(reinterpret_cast<std::uintptr_t>(c) % __STDCPP_DEFAULT_NEW_ALIGNMENT__ == 0);
        delete[] c;
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

    // Impossible: nothrow returns null, the throwing form runs the handler
    // once, then throws std::bad_alloc.
    CHECK(::operator new(SIZE_MAX / 2, std::nothrow) == nullptr);
    std::set_new_handler(handler);
    bool caught = false;
    try {
        void *p = ::operator new(SIZE_MAX / 2);
        (void)p;
    } catch (const std::bad_alloc &) {
        caught = true;
    }
    CHECK(caught && handler_calls == 1);
    caught = false;
    try {
        char *p = new char[SIZE_MAX / 4];
        (void)p;
    } catch (const std::bad_alloc &e) {
        caught = std::string(e.what()).size() > 0;
    }
    CHECK(caught);
    std::printf("cxx: %d checks passed\n", checks);
    return 0;
}

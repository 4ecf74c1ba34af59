//! The JSON workload (`benches/apps/json.rs`) under jemalloc as the global
//! allocator.

#[global_allocator]
static A: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

include!("apps/json.rs");

fn main() {
    run("jemalloc");
}

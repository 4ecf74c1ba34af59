//! The Rust applications' workloads (`benches/apps/workloads.rs`) under
//! jemalloc as the global allocator.

#[global_allocator]
static A: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

include!("apps/workloads.rs");

fn main() {
    run("jemalloc");
}

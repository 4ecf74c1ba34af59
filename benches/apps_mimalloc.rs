//! The Rust applications' workloads (`benches/apps/workloads.rs`) under
//! mimalloc as the global allocator.

#[global_allocator]
static A: mimalloc::MiMalloc = mimalloc::MiMalloc;

include!("apps/workloads.rs");

fn main() {
    run("mimalloc");
}

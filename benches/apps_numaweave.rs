//! The Rust applications' workloads (`benches/apps/workloads.rs`) under
//! numaweave as the global allocator.

#[global_allocator]
static A: numaweave::NumaAlloc = numaweave::NumaAlloc::new();

include!("apps/workloads.rs");

fn main() {
    run("numaweave");
}

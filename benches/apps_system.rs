//! The Rust applications' workloads (`benches/apps/workloads.rs`) under
//! system as the global allocator.

#[global_allocator]
static A: std::alloc::System = std::alloc::System;

include!("apps/workloads.rs");

fn main() {
    run("system");
}

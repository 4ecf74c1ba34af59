//! The JSON workload (`benches/apps/json.rs`) under system as the global
//! allocator.

#[global_allocator]
static A: std::alloc::System = std::alloc::System;

include!("apps/json.rs");

fn main() {
    run("system");
}

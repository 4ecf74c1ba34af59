//! The JSON workload (`benches/apps/json.rs`) under numaweave as the global
//! allocator.

#[global_allocator]
static A: numaweave::NumaAlloc = numaweave::NumaAlloc::new();

include!("apps/json.rs");

fn main() {
    run("numaweave");
}

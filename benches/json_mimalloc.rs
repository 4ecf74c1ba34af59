//! The JSON workload (`benches/apps/json.rs`) under mimalloc as the global
//! allocator.

#[global_allocator]
static A: mimalloc::MiMalloc = mimalloc::MiMalloc;

include!("apps/json.rs");

fn main() {
    run("mimalloc");
}

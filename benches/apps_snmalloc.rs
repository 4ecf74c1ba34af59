//! The Rust applications' workloads (`benches/apps/workloads.rs`) under
//! snmalloc as the global allocator (`snmalloc-rs`, built with `cc`).

#[global_allocator]
static A: snmalloc_rs::SnMalloc = snmalloc_rs::SnMalloc;

include!("apps/workloads.rs");

fn main() {
    run("snmalloc");
}

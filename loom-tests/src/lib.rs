//! Loom models of numaweave's concurrent structures live in `tests/`; this
//! crate only exists so they build with `--cfg loom` in their own target dir:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test -p numaweave-loom-tests --release --target-dir target/loom
//! ```

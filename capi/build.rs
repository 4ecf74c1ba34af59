//! Generates `numaweave.h` from the Rust declarations of `src/api.rs` with
//! cbindgen (no hand-kept copy), into `OUT_DIR` and beside the library in
//! the target directory (`target/<profile>/numaweave.h`); and links the
//! unwinder privately (`unwinder.rs`).

use std::path::PathBuf;

#[path = "unwinder.rs"]
mod unwinder;

fn main() {
    unwinder::link_private_unwinder();
    println!("cargo:rerun-if-changed=unwinder.rs");
    let crate_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed=src/api.rs");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("capi/cbindgen.toml");
    let header = cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/api.rs"))
        .generate()
        .expect("numaweave.h could not be generated from src/api.rs");
    header.write_to_file(out.join("numaweave.h"));
    // OUT_DIR is target/<profile>/build/<pkg>-<hash>/out: the library lands
    // three levels up.
    if let Some(profile_dir) = out.ancestors().nth(3) {
        header.write_to_file(profile_dir.join("numaweave.h"));
    }
}

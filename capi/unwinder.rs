//! Links the unwinder (which std's backtrace code needs) into the library
//! from GCC's static `libgcc_eh.a` instead of loading `libgcc_s.so.1`: a C
//! program would not load that library otherwise, and its pages (about
//! 100 KiB once the dynamic linker has relocated it) would count in the
//! program's RSS. The copy is private: the library exports only its own
//! symbols, so a C++ program's exceptions still go through its own
//! `libgcc_s`. Where no `libgcc_eh.a` is found (a toolchain without GCC's
//! runtime), nothing changes.
//!
//! The hardened library's build script, and part of the plain one's
//! (`build.rs` has it as a module).

#[allow(dead_code)]
fn main() {
    link_private_unwinder();
}

/// Asks Cargo to link `libgcc_eh.a` ahead of std's `-lgcc_s` (a library of
/// this crate comes before its dependencies' on the linker's command line,
/// and the linker drops the unneeded `libgcc_s` under `--as-needed`).
pub fn link_private_unwinder() {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let static_crt = var("CARGO_CFG_TARGET_FEATURE").split(',').any(|f| f == "crt-static");
    if var("CARGO_CFG_TARGET_OS") != "linux" || var("CARGO_CFG_TARGET_ENV") != "gnu" || static_crt {
        return;
    }
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let Ok(out) = std::process::Command::new(cc).arg("-print-file-name=libgcc_eh.a").output() else { return };
    let path = std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !path.is_absolute() || !path.exists() {
        return;
    }
    if let Some(dir) = path.parent() {
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:rustc-link-lib=static:-bundle=gcc_eh");
    }
}

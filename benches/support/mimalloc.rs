//! mimalloc built from the sources of the `libmimalloc-sys` crate the
//! `peers` feature uses, for the benches that compare numaweave's C library
//! with it (`capi`, `hardened`): found in cargo's registry at the version
//! `Cargo.lock` names (fetched by any build with `--features peers`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The sources of the `libmimalloc-sys` crate `Cargo.lock` names, in
/// cargo's registry (`$CARGO_HOME`, else `~/.cargo`): its mimalloc 2.x.
pub fn sources() -> Option<PathBuf> {
    let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.lock")).ok()?;
    let at = lock.find("name = \"libmimalloc-sys\"\nversion = \"")? + "name = \"libmimalloc-sys\"\nversion = \"".len();
    let version = &lock[at..at + lock[at..].find('"')?];
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
    std::fs::read_dir(home.join("registry/src"))
        .ok()?
        .flatten()
        .map(|d| d.path().join(format!("libmimalloc-sys-{version}/c_src/mimalloc/v2")))
        .find(|d| d.join("src/static.c").exists())
}

/// What [`build`] makes of the sources.
#[allow(dead_code)] // each bench uses one of them
pub enum Kind {
    /// A library to preload or link (`malloc` and the rest overridden).
    Shared,
    /// An object to link into a program (its `malloc` then the program's).
    Object,
}

/// mimalloc from `src` into `out`, with these defines, built as its CMake
/// release build does (`-O3 -DNDEBUG`, the initial-exec TLS model: without
/// it a shared build reads its heap through `__tls_get_addr`, a call in
/// every `malloc`, which mimalloc as shipped does not make). False if the
/// compiler failed.
pub fn build(cc: &str, src: &Path, defines: &[&str], kind: Kind, out: &Path) -> bool {
    let (how, libs): (&[&str], &[&str]) = match kind {
        Kind::Shared => (&["-fPIC", "-shared"], &["-lpthread"]),
        Kind::Object => (&["-c"], &[]),
    };
    Command::new(cc)
        .args(["-O3", "-DNDEBUG", "-DMI_BUILD_RELEASE", "-DMI_MALLOC_OVERRIDE", "-ftls-model=initial-exec"])
        .args(how)
        .args(defines)
        .arg("-I")
        .arg(src.join("include"))
        .arg(src.join("src/static.c"))
        .arg("-o")
        .arg(out)
        .args(libs)
        .status()
        .is_ok_and(|s| s.success())
}

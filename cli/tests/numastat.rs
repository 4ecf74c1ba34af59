//! `numaweave numastat PID` shows a live process's slab caches per node: this
//! test is that process (a cache of its own, touched), and reads the
//! command's table back.

use numaweave::slab::RawCache;

#[test]
fn numastat_shows_each_cache_of_a_live_process_by_node() {
    let pool = RawCache::builder("cli_numastat", 4096).build().unwrap();
    let objs: Vec<_> = (0..1024).map(|_| pool.alloc().unwrap()).collect();
    for p in &objs {
        // SAFETY: a live object of 4096 bytes.
        unsafe { p.as_ptr().write_bytes(1, 4096) };
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_numaweave"))
        .args(["numastat", &std::process::id().to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    assert!(out.status.success());
    assert!(text.contains("Per-cache slab memory"), "no per-cache table");
    let row = text.lines().find(|l| l.starts_with("cli_numastat")).expect("the cache has no row");
    let fields: Vec<f64> = row.split_whitespace().skip(1).map(|f| f.parse().unwrap()).collect();
    let (total, off) = (fields[fields.len() - 2], fields[fields.len() - 1]);
    // 4 MiB of objects written, on this machine's node(s), each page on the
    // node its chunk is bound to (the table says which).
    assert!(total >= 4.0, "{row}");
    assert!(off == 0.0, "pages off their chunk's node on a machine where none can be: {row}");
    for p in objs {
        // SAFETY: objects of this pool, each freed once.
        unsafe { pool.free(p) };
    }
}

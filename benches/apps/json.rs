// The JSON workload of the Rust applications' benches, shared by one bench
// target per global allocator (`benches/json_*.rs`, each `include!`s this
// after setting its `#[global_allocator]`): a document of about 20 MB
// (`serde_json::Value`: 60,000 records of strings, numbers and nested
// arrays) serialized to a `String` and parsed back, round after round, as
// a service that reads and writes documents does. Prints one line: the
// allocator, the median round's seconds, the minor page faults and the
// peak RSS of the whole run (`getrusage`), so that time and memory are
// measured in the same run. Nothing is asserted.
//
// ```text
// cargo bench --features peers --bench json_numaweave --bench json_mimalloc --bench json_jemalloc --bench json_system
// ```

use serde_json::{Value, json};

/// The document: `records` records of a few fields each.
fn document(records: usize) -> Value {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let items: Vec<Value> = (0..records)
        .map(|i| {
            let r = next();
            json!({
                "id": i,
                "name": format!("record-{i}-{:x}", r),
                "score": (r % 10_000) as f64 / 7.0,
                "tags": (0..(r % 8)).map(|k| format!("tag{}", (r >> (k * 4)) % 97)).collect::<Vec<_>>(),
                "values": (0..(r % 24)).map(|k| (r >> k) % 1000).collect::<Vec<_>>(),
                "nested": { "ok": r % 2 == 0, "text": "x".repeat((r % 200) as usize) },
            })
        })
        .collect();
    Value::Array(items)
}

fn usage() -> libc::rusage {
    // SAFETY: an all-zero `rusage` is a valid value for the call to fill.
    let mut u: libc::rusage = unsafe { core::mem::zeroed() };
    // SAFETY: `u` is writable and of the type the call fills.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    u
}

fn run(allocator: &str) {
    let rounds: usize = std::env::var("NUMAWEAVE_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
    let faults0 = usage().ru_minflt;
    let doc = document(60_000);
    let mut times = Vec::with_capacity(rounds);
    let mut bytes = 0;
    for _ in 0..rounds {
        let t = std::time::Instant::now();
        let text = serde_json::to_string(&doc).unwrap();
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back.as_array().map(Vec::len), Some(60_000));
        bytes = text.len();
        drop(back);
        drop(text);
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let u = usage();
    println!(
        "json {allocator:<10} {:.3} s a round (median of {rounds}), {} minor faults, peak RSS {} MiB, document {:.1} MB",
        times[rounds / 2],
        u.ru_minflt - faults0,
        u.ru_maxrss / 1024,
        bytes as f64 / 1e6
    );
}

// The Rust applications' workloads, shared by one bench target per global
// allocator (`benches/apps_*.rs`, each sets its `#[global_allocator]` and
// `include!`s this): what real Rust programs do, with each crate's default
// set-up.
//
// - json: an 18 MB `serde_json` document serialized and parsed back;
// - http: a hyper HTTP/1.1 server and client on tokio (two workers), 64
//   keep-alive connections, 4 KiB responses;
// - rayon: a pipeline of records parsed, filtered, sorted and grouped in
//   parallel;
// - channel: crossbeam channels, two producers and two consumers of
//   buffers of 64 B-64 KiB (every buffer freed by another thread);
// - regex: patterns compiled and matched against lines, captures kept.
//
// The bench runs each workload in a child process of its own (itself, with
// the workload's name), so that its page faults and peak RSS are its own,
// and prints a line a workload: the median of its rounds' seconds, its
// minor faults and its peak RSS. `benches/apps/run.py` runs every
// allocator's and prints the table. Nothing is asserted but the results.

use std::process::Command;

use serde_json::{Value, json};

const WORKLOADS: [&str; 5] = ["json", "http", "rayon", "channel", "regex"];

/// A fresh xorshift generator.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

fn json_round(doc: &Value) {
    let text = serde_json::to_string(doc).unwrap();
    let back: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(back.as_array().map(Vec::len), Some(60_000));
}

fn json_document() -> Value {
    let mut next = rng(0x9e37_79b9_7f4a_7c15);
    let items: Vec<Value> = (0..60_000)
        .map(|i| {
            let r = next();
            json!({
                "id": i,
                "name": format!("record-{i}-{:x}", r),
                "score": (r % 10_000) as f64 / 7.0,
                "tags": (0..(r % 8)).map(|k| format!("tag{}", (r >> (k * 4)) % 97)).collect::<Vec<_>>(),
                "values": (0..(r % 24)).map(|k| (r >> k) % 1000).collect::<Vec<_>>(),
                "nested": { "ok": r.is_multiple_of(2), "text": "x".repeat((r % 200) as usize) },
            })
        })
        .collect();
    Value::Array(items)
}

fn http_round(rt: &tokio::runtime::Runtime) {
    use http_body_util::{BodyExt, Full};
    use hyper::body::Bytes;
    use hyper_util::rt::TokioIo;
    const CONNECTIONS: usize = 64;
    const REQUESTS: usize = 200;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(|req: hyper::Request<hyper::body::Incoming>| async move {
                        let n = req.uri().path().len();
                        let body = vec![b'a' + (n % 26) as u8; 4096];
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::from(body))))
                    });
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                });
            }
        });
        let clients: Vec<_> = (0..CONNECTIONS)
            .map(|c| {
                tokio::spawn(async move {
                    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
                    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
                    tokio::spawn(conn);
                    let mut bytes = 0;
                    for i in 0..REQUESTS {
                        let req = hyper::Request::get(format!("/c{c}/r{i}"))
                            .header("host", "localhost")
                            .body(Full::new(Bytes::new()))
                            .unwrap();
                        let res = send.send_request(req).await.unwrap();
                        bytes += res.into_body().collect().await.unwrap().to_bytes().len();
                    }
                    bytes
                })
            })
            .collect();
        let mut total = 0;
        for c in clients {
            total += c.await.unwrap();
        }
        assert_eq!(total, CONNECTIONS * REQUESTS * 4096);
        server.abort();
    });
}

fn rayon_round() {
    use rayon::prelude::*;
    let lines: Vec<String> = (0..400_000u64)
        .into_par_iter()
        .map(|i| {
            let r = (i * 0x9e37_79b9_7f4a_7c15) >> 20;
            format!("{},user{},{},{}", i, r % 5000, r % 997, "z".repeat((r % 64) as usize))
        })
        .collect();
    let mut parsed: Vec<(String, u64, String)> = lines
        .par_iter()
        .filter_map(|l| {
            let mut f = l.split(',');
            let _id = f.next()?;
            let user = f.next()?.to_string();
            let score: u64 = f.next()?.parse().ok()?;
            let rest = f.next()?.to_uppercase();
            (!score.is_multiple_of(3)).then_some((user, score, rest))
        })
        .collect();
    parsed.par_sort_unstable_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
    let groups = parsed
        .par_iter()
        .fold(std::collections::HashMap::<&str, Vec<u64>>::new, |mut m, (u, s, _)| {
            m.entry(u.as_str()).or_default().push(*s);
            m
        })
        .reduce(std::collections::HashMap::new, |mut a, b| {
            for (k, mut v) in b {
                a.entry(k).or_default().append(&mut v);
            }
            a
        });
    assert_eq!(groups.len(), 5000);
}

fn channel_round() {
    const PER_PRODUCER: usize = 100_000;
    let (tx, rx) = crossbeam_channel::bounded::<Vec<u8>>(256);
    let producers: Vec<_> = (0..2u64)
        .map(|p| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut next = rng(p + 7);
                for _ in 0..PER_PRODUCER {
                    let r = next();
                    let len = 64 << (r % 11);
                    let mut buf = vec![0u8; len.min(64 << 10)];
                    buf[0] = r as u8;
                    tx.send(buf).unwrap();
                }
            })
        })
        .collect();
    drop(tx);
    let consumers: Vec<_> = (0..2)
        .map(|_| {
            let rx = rx.clone();
            std::thread::spawn(move || {
                let mut n = 0usize;
                while let Ok(buf) = rx.recv() {
                    n += usize::from(buf[0] & 1) + 1;
                }
                n
            })
        })
        .collect();
    for p in producers {
        p.join().unwrap();
    }
    let got: usize = consumers.into_iter().map(|c| c.join().unwrap()).sum();
    assert!(got >= 2 * PER_PRODUCER);
}

fn regex_round() {
    let mut next = rng(42);
    let words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"];
    let lines: Vec<String> = (0..20_000)
        .map(|i| {
            let r = next();
            format!(
                "{} user={}{} id={} path=/{}/{}.txt code={}",
                i,
                words[(r % 8) as usize],
                r % 100,
                r % 100_000,
                words[((r >> 8) % 8) as usize],
                r % 1000,
                200 + (r >> 16) % 300
            )
        })
        .collect();
    let mut kept = Vec::new();
    for k in 0..60 {
        let re = regex::Regex::new(&format!(
            r"user=({})(\d+) id=(\d*{})\d* path=/(\w+)/(\d+)\.txt code=(\d{{3}})",
            words[k % 8],
            k % 10
        ))
        .unwrap();
        for l in &lines {
            if let Some(c) = re.captures(l) {
                kept.push(format!("{}:{}:{}", &c[1], &c[4], &c[6]));
            }
        }
    }
    assert!(!kept.is_empty());
}

fn usage() -> libc::rusage {
    // SAFETY: an all-zero `rusage` is a valid value for the call to fill.
    let mut u: libc::rusage = unsafe { core::mem::zeroed() };
    // SAFETY: `u` is writable and of the type the call fills.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    u
}

/// In the child: `workload`'s rounds; prints the median round's seconds,
/// the minor faults and the peak RSS (KiB).
fn child(workload: &str) {
    let rounds: usize = std::env::var("NUMAWEAVE_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let faults0 = usage().ru_minflt;
    let doc = (workload == "json").then(json_document);
    let rt = (workload == "http")
        .then(|| tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap());
    let mut times: Vec<f64> = (0..rounds)
        .map(|_| {
            let t = std::time::Instant::now();
            match workload {
                "json" => json_round(doc.as_ref().unwrap()),
                "http" => http_round(rt.as_ref().unwrap()),
                "rayon" => rayon_round(),
                "channel" => channel_round(),
                "regex" => regex_round(),
                w => panic!("no workload {w}"),
            }
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let u = usage();
    println!("{:.4} {} {}", times[rounds / 2], u.ru_minflt - faults0, u.ru_maxrss);
}

/// Every workload in a child of its own; a line each.
fn run(allocator: &str) {
    let mut args = std::env::args().skip(1);
    if let Some(w) = args.find_map(|a| a.strip_prefix("--workload=").map(str::to_string)) {
        return child(&w);
    }
    let me = std::env::current_exe().unwrap();
    for w in WORKLOADS {
        let out = Command::new(&me).arg(format!("--workload={w}")).output().unwrap();
        assert!(out.status.success(), "{w} under {allocator}: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        let v: Vec<&str> = text.split_whitespace().collect();
        println!(
            "app {w:<8} {allocator:<10} {} s a round (median), {} minor faults, peak RSS {} MiB",
            v[0],
            v[1],
            v[2].parse::<u64>().unwrap_or(0) / 1024
        );
    }
}

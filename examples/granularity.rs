//! Interleave granularity in miniature: the experiment of Shaohua Li's
//! "numa: interleave allocation granularity" thread (`../shared/sources/004_…`).
//!
//! ```text
//! cargo run --release --example granularity -- [--buffers N] [--svg PATH]
//! NUMAWEAVE_TOPOLOGY=fake:4 cargo run --release --example granularity   # 4 nodes on a 1-node machine
//! ```
//!
//! A stream of I/O buffers of mixed sizes (4 KiB–128 KiB) is allocated under
//! page-by-page interleave (`Count(1)`), `Count(8)` and `Bytes(2 MiB)`, each
//! through its own interleaving handle over every memory node. For each it
//! prints the number of contiguous extents (buffers adjacent in the address
//! space merge, as the block layer merges adjacent requests), the mean extent
//! size (the `avgrq-sz` analogue), the segments a 512 KiB scatter-gather
//! request needs, bytes per node (as placed, and as `move_pages` reports), and,
//! where `/proc/self/pagemap` gives frame numbers (root), the physically
//! contiguous runs. It writes an SVG placement map (one row per policy, one
//! cell per page, coloured by the node `move_pages` reports) and prints its
//! path.

use std::fmt::Write as _;

use allocator_api2::vec::Vec as AVec;
use numaweave::policy::{Granularity, Interleave};
use numaweave::topology::{MAX_NODES, Topology};
use numaweave::{InterleaveHandle, NumaAlloc, os};

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

const PAGE: usize = 4096;
const SG_REQUEST: usize = 512 << 10;
/// Pages per row of the SVG map.
const MAP_PAGES: usize = 1024;

struct Row {
    name: String,
    /// Node of each page of the stream, in stream order (as `move_pages` says).
    pages: Vec<Option<usize>>,
}

fn sizes(n: usize) -> Vec<usize> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            PAGE << (x % 6) // 4, 8, 16, 32, 64, 128 KiB
        })
        .collect()
}

fn main() {
    let mut n_bufs = 2000;
    let mut svg_path = std::env::temp_dir().join("numaweave-granularity.svg");
    let mut svg_stdout = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--buffers" => n_bufs = args.next().and_then(|v| v.parse().ok()).expect("--buffers N"),
            "--svg" => svg_path = args.next().expect("--svg PATH").into(),
            // Inside the VM, whose files vanish with it: the SVG goes to
            // stdout between marker lines, for the harness to cut out.
            "--svg-stdout" => svg_stdout = true,
            _ => {
                eprintln!("usage: granularity [--buffers N] [--svg PATH | --svg-stdout]");
                std::process::exit(2);
            }
        }
    }
    let topo = Topology::global();
    let nodes = topo.memory_nodes().intersection(&topo.allowed_nodes());
    println!(
        "{} buffers of 4–128 KiB interleaved over nodes {nodes}{}",
        n_bufs,
        if topo.is_synthetic() { " (SYNTHETIC: every page is really on the one node)" } else { "" }
    );
    let stream = sizes(n_bufs);
    let policies = [
        ("page interleave, Count(1)", Granularity::Count(1)),
        ("Count(8)", Granularity::Count(8)),
        ("Bytes(2 MiB)", Granularity::Bytes(2 << 20)),
    ];
    let mut rows = Vec::new();
    println!(
        "\n{:<26} {:>8} {:>12} {:>13} {:>10}  bytes per node (placed | move_pages)",
        "policy", "extents", "mean extent", "segs/512 KiB", "phys runs"
    );
    for (name, g) in policies {
        let h = A.interleave(Interleave::new(nodes, g).unwrap()).unwrap();
        let bufs: Vec<AVec<u8, InterleaveHandle>> = stream
            .iter()
            .map(|&s| {
                let mut b = AVec::with_capacity_in(s, h.clone());
                b.resize(s, 0x5a); // touch: pages get placed
                b
            })
            .collect();
        // Extents: runs of buffers adjacent in the address space, in stream order.
        let starts: Vec<usize> = bufs.iter().map(|b| b.as_ptr() as usize).collect();
        let adjacent = |i: usize| starts[i - 1] + stream[i - 1] == starts[i];
        let extents = 1 + (1..bufs.len()).filter(|&i| !adjacent(i)).count();
        let total: usize = stream.iter().sum();
        // A scatter-gather request of 512 KiB of consecutive buffers needs a
        // segment per run of adjacent buffers inside it.
        let (mut reqs, mut segs, mut acc) = (0usize, 0usize, 0usize);
        for (i, &size) in stream.iter().enumerate() {
            if acc == 0 || !adjacent(i) {
                segs += 1;
            }
            acc += size;
            if acc >= SG_REQUEST {
                reqs += 1;
                acc = 0;
            }
        }
        // Where every page is, and the physical frames where readable.
        let mut pages = Vec::with_capacity(total / PAGE);
        let mut frames = Vec::with_capacity(total / PAGE);
        let mut placed = [0u64; MAX_NODES];
        for (b, &s) in bufs.iter().zip(&stream) {
            // SAFETY: a live block of `A`.
            placed[unsafe { A.node_of(b.as_ptr()) }] += s as u64;
            let addrs: Vec<*const u8> = (0..s / PAGE).map(|k| b.as_ptr().wrapping_add(k * PAGE)).collect();
            let mut st = vec![0i32; addrs.len()];
            os::mem::page_nodes(&addrs, &mut st).expect("move_pages");
            pages.extend(st.iter().map(|&n| usize::try_from(n).ok()));
            let mut f = vec![None; addrs.len()];
            let _ = os::mem::page_frames(b.as_ptr(), &mut f);
            frames.extend(f);
        }
        let phys_runs = if frames.iter().all(Option::is_some) {
            let f: Vec<u64> = frames.iter().map(|f| f.unwrap()).collect();
            (1 + f.windows(2).filter(|w| w[1] != w[0] + 1).count()).to_string()
        } else {
            "n/a".to_string() // frame numbers need root
        };
        let mut real = [0u64; MAX_NODES];
        for n in pages.iter().flatten() {
            real[*n] += PAGE as u64;
        }
        let per_node = |v: &[u64; MAX_NODES]| {
            let mut s = String::new();
            for (n, &b) in v.iter().enumerate().filter(|(_, b)| **b > 0) {
                let _ = write!(s, "{n}:{:.1}M ", b as f64 / (1 << 20) as f64);
            }
            s
        };
        println!(
            "{name:<26} {extents:>8} {:>9.1} KiB {:>13.2} {phys_runs:>10}  {}| {}",
            total as f64 / extents as f64 / 1024.0,
            segs as f64 / reqs.max(1) as f64,
            per_node(&placed),
            per_node(&real)
        );
        rows.push(Row { name: name.to_string(), pages });
    }
    let svg = svg(&rows);
    if svg_stdout {
        println!("\n-----BEGIN SVG-----\n{svg}-----END SVG-----");
        return;
    }
    match std::fs::write(&svg_path, svg) {
        Ok(()) => println!("\nplacement map (one cell per page, coloured by node): {}", svg_path.display()),
        Err(e) => eprintln!("could not write {}: {e}", svg_path.display()),
    }
}

fn svg(rows: &[Row]) -> String {
    const PALETTE: [&str; 8] = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"];
    let (cell, row_h, label_w, gap) = (2usize, 28usize, 190usize, 14usize);
    let width = label_w + MAP_PAGES * cell + 10;
    let height = rows.len() * (row_h + gap) + 50;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<text x="4" y="16">numaweave: node of each page (first {MAP_PAGES} pages of the stream, move_pages)</text>"#
    );
    for (r, row) in rows.iter().enumerate() {
        let y = 30 + r * (row_h + gap);
        let _ = writeln!(s, r#"<text x="4" y="{}">{}</text>"#, y + row_h / 2 + 4, row.name);
        for (i, n) in row.pages.iter().take(MAP_PAGES).enumerate() {
            let fill = n.map_or("#cccccc", |n| PALETTE[n % PALETTE.len()]);
            let _ = writeln!(
                s,
                r#"<rect x="{}" y="{y}" width="{cell}" height="{row_h}" fill="{fill}"><title>page {i}: node {n:?}</title></rect>"#,
                label_w + i * cell
            );
        }
    }
    let ly = 30 + rows.len() * (row_h + gap);
    for (n, c) in PALETTE.iter().enumerate().take(4) {
        let _ = writeln!(s, r#"<rect x="{}" y="{ly}" width="12" height="12" fill="{c}"/>"#, 4 + n * 80);
        let _ = writeln!(s, r#"<text x="{}" y="{}">node {n}</text>"#, 20 + n * 80, ly + 11);
    }
    s.push_str("</svg>\n");
    s
}

//! The main demo: NumaAlloc as the global allocator of a small multi-threaded
//! program, one worker per node, with blocks handed across nodes.
//!
//! ```text
//! cargo run --release --example demo
//! NUMAWEAVE_TOPOLOGY=fake:2 cargo run --release --example demo   # two synthetic nodes
//! ```
//!
//! Each worker runs pinned to a CPU of its node, builds a map of strings and
//! buffers, checks it, and sends half of it to the next node's worker, which
//! frees it there: those frees travel back to the heap (and node) that made
//! the blocks. The program prints the topology, where each worker's buffer
//! pages really are (`move_pages`), and the allocator's per-node statistics.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Instant;

use numaweave::{NumaAlloc, Topology, os};

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

fn main() {
    let topo = Topology::global();
    print!("{topo}");
    println!("allocator mode: {:?}\n", A.mode());

    let workers: Vec<(usize, usize)> = topo.cpu_nodes().iter().map(|n| (n, topo.cpus_of(n).first().unwrap())).collect();
    let (txs, rxs): (Vec<_>, Vec<_>) = workers.iter().map(|_| mpsc::channel::<Vec<String>>()).unzip();
    let start = Instant::now();
    let handles: Vec<_> = workers
        .iter()
        .zip(rxs)
        .enumerate()
        .map(|(i, (&(node, cpu), rx))| {
            let next = txs[(i + 1) % txs.len()].clone();
            std::thread::spawn(move || {
                os::cpu::pin_current_thread(cpu).expect("pin worker");
                let mut map: HashMap<String, Vec<u8>> = HashMap::new();
                for k in 0..100_000u32 {
                    map.insert(format!("node{node}-key{k}"), vec![(k % 251) as u8; 16 + (k as usize % 48)]);
                }
                for (k, v) in &map {
                    let n: u32 = k.rsplit("key").next().unwrap().parse().unwrap();
                    assert!(v.iter().all(|&b| b == (n % 251) as u8));
                }
                // A buffer, to show where its pages are.
                let buf = vec![1u8; 4 << 20];
                let pages: Vec<*const u8> = (0..buf.len()).step_by(4096).map(|o| buf[o..].as_ptr()).collect();
                let mut st = vec![0i32; pages.len()];
                os::mem::page_nodes(&pages, &mut st).expect("move_pages");
                let on_node = st.iter().filter(|&&s| s as usize == Topology::global().physical_node(node)).count();
                // Half the keys go to the next worker, which frees them.
                let keys: Vec<String> = map.keys().take(50_000).cloned().collect();
                next.send(keys).unwrap();
                drop(next);
                let received = rx.recv().unwrap();
                let n = received.len();
                drop(received);
                (node, cpu, on_node, pages.len(), n)
            })
        })
        .collect();
    drop(txs);
    let count = workers.len();
    for (i, h) in handles.into_iter().enumerate() {
        let (node, cpu, on, total, freed) = h.join().unwrap();
        let from = workers[(i + count - 1) % count].0;
        println!(
            "worker on cpu {cpu} (node {node}): {on}/{total} pages of its 4 MiB buffer on node {node}; \
             freed {freed} strings made by the worker of node {from}"
        );
    }
    println!("\n{count} worker(s) done in {:.0?}\n", start.elapsed());
    print!("{}", A.stats());
}

//! The node runtime with numaweave as the global allocator: tasks run on
//! their node's workers, a listener per node serves connections, and task
//! memory lands on the workers' node (checked with `move_pages`; in the
//! multi-node guest of `.ci/vm-tests` as on real nodes, on one node here,
//! or two synthetic ones with `NUMAWEAVE_TOPOLOGY=fake:2`, each backed by
//! node 0).

use std::io::{Read, Write};
use std::sync::Mutex;

use numaweave::{NumaAlloc, Topology};
use numaweave_tokio::{NodeRuntime, current_node};
use tokio::io::AsyncWriteExt;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

/// One runtime at a time: each pins threads to every node's CPUs.
static SERIAL: Mutex<()> = Mutex::new(());

fn runtime() -> NodeRuntime {
    NodeRuntime::builder().workers_per_node(2).build().unwrap()
}

/// 200 tasks per node, spawned from outside: each ran on a worker of its
/// node, on one of the node's CPUs.
#[test]
fn tasks_run_on_their_nodes_workers_and_cpus() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    assert_eq!(rt.nodes(), Topology::global().cpu_nodes().iter().collect::<Vec<_>>());
    for node in rt.nodes() {
        let tasks: Vec<_> = (0..200)
            .map(|_| {
                rt.spawn_on(node, async {
                    tokio::task::yield_now().await;
                    (current_node(), numaweave::os::cpu::current_cpu())
                })
            })
            .collect();
        for t in tasks {
            let (n, cpu) = rt.block_on(t).unwrap();
            assert_eq!(n, Some(node));
            let cpu = cpu.unwrap();
            assert!(rt.cpus(node).unwrap().contains(&cpu), "a task of node {node} on cpu {cpu}");
        }
    }
    assert_eq!(current_node(), None, "the test's own thread is no worker");
}

/// A listener per node on one port: 40 connections, each accepted by a
/// task running on its listener's node and served by a task of the same
/// node, each saying where it ran.
#[test]
fn a_listener_per_node_serves_connections_on_its_node() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    let listeners = rt.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    assert_eq!(listeners.len(), rt.nodes().len());
    let port = listeners[0].1.local_addr().unwrap().port();
    assert!(listeners.iter().all(|(_, l)| l.local_addr().unwrap().port() == port), "one port for all");
    for (node, l) in listeners {
        rt.spawn_on(node, async move {
            loop {
                let Ok((mut s, _)) = l.accept().await else { return };
                let accepted = current_node().map_or(u8::MAX, |n| n as u8);
                tokio::spawn(async move {
                    let served = current_node().map_or(u8::MAX, |n| n as u8);
                    let _ = s.write_all(&[node as u8, accepted, served]).await;
                });
            }
        });
    }
    let mut by_node = std::collections::BTreeMap::new();
    for _ in 0..40 {
        let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        c.write_all(b"?").unwrap();
        let mut reply = [0u8; 3];
        c.read_exact(&mut reply).unwrap();
        assert!(
            reply[1] == reply[0] && reply[2] == reply[0],
            "node {}'s listener: accepted on node {}, served on node {}",
            reply[0],
            reply[1],
            reply[2]
        );
        *by_node.entry(reply[0]).or_insert(0) += 1;
    }
    println!("40 connections served by node: {by_node:?}");
}

/// 100,000 tasks (an equal share per node, spawned from a task of the
/// node) each holding a 4 KiB buffer across an await: at least 99% of the
/// buffers' pages and of the tasks' own state on the node of the workers
/// that ran them. Then each node's buffers are dropped by the next node's
/// workers: frees going home, counted in the owners' statistics once the
/// owners allocate again.
#[test]
fn task_memory_lands_on_the_workers_node_and_goes_home() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const TASKS: usize = 100_000;
    let rt = runtime();
    let topo = Topology::global();
    let nodes = rt.nodes();
    let per = TASKS / nodes.len();
    // The tasks report where their buffer and state are, then wait at a
    // gate: both are looked up while the tasks are alive.
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Option<usize>, usize, usize)>();
    let mut spawners = Vec::new();
    for &node in &nodes {
        let (gate, tx) = (gate.clone(), tx.clone());
        spawners.push((
            node,
            rt.spawn_on(node, async move {
                let tasks: Vec<_> = (0..per)
                    .map(|i| {
                        let (gate, tx) = (gate.clone(), tx.clone());
                        tokio::spawn(async move {
                            let buf = vec![i as u8; 4096].into_boxed_slice();
                            // Held across an await: part of the task's own state.
                            let state = [i as u8; 64];
                            let at = std::hint::black_box(&state).as_ptr() as usize;
                            tx.send((node, current_node(), buf.as_ptr() as usize, at)).unwrap();
                            gate.acquire().await.unwrap().forget();
                            std::hint::black_box(&state);
                            buf
                        })
                    })
                    .collect();
                let mut out = Vec::with_capacity(per);
                for t in tasks {
                    out.push(t.await.unwrap());
                }
                out
            }),
        ));
    }
    drop(tx);
    let reports: Vec<_> = rx.iter().take(per * nodes.len()).collect();
    for &node in &nodes {
        let phys = topo.physical_node(node);
        let mine: Vec<_> = reports.iter().filter(|r| r.0 == node).collect();
        assert_eq!(mine.len(), per);
        assert!(mine.iter().all(|r| r.1 == Some(node)), "a task of node {node} ran elsewhere");
        let addrs: Vec<*const u8> = mine.iter().flat_map(|r| [r.2 as *const u8, r.3 as *const u8]).collect();
        let mut st = vec![0i32; addrs.len()];
        numaweave::os::mem::page_nodes(&addrs, &mut st).unwrap();
        let on = st.iter().filter(|&&s| s == phys as i32).count();
        assert!(on * 100 >= addrs.len() * 99, "node {node}: {on} of {} pages on it", addrs.len());
        println!("node {node}: {on} of {} buffer and task pages on the node", addrs.len());
    }
    gate.add_permits(per * nodes.len());
    let mut held = Vec::new();
    for (node, s) in spawners {
        let tasks = rt.block_on(s).unwrap();
        for (i, b) in tasks.iter().enumerate().step_by(997) {
            assert!(b.iter().all(|&x| x == i as u8), "buffer {i} of node {node} changed");
        }
        held.push((node, tasks));
    }
    // Each node's buffers dropped by the next node's workers.
    let before: Vec<u64> = nodes.iter().map(|&n| A.stats().per_node[n].remote_frees).collect();
    let count = held.iter().map(|(_, t)| t.len()).sum::<usize>();
    for (k, (_, tasks)) in held.drain(..).enumerate() {
        let to = nodes[(k + 1) % nodes.len()];
        rt.block_on(rt.spawn_on(to, async move { drop(tasks) })).unwrap();
    }
    // The owners allocate again: their refills collect the remote frees.
    for &node in &nodes {
        let work: Vec<_> = (0..64)
            .map(|_| {
                rt.spawn_on(node, async {
                    let v: Vec<Box<[u8]>> = (0..512).map(|_| vec![1u8; 4096].into_boxed_slice()).collect();
                    v.len()
                })
            })
            .collect();
        for w in work {
            rt.block_on(w).unwrap();
        }
    }
    let after: Vec<u64> = nodes.iter().map(|&n| A.stats().per_node[n].remote_frees).collect();
    let home: u64 = after.iter().zip(&before).map(|(a, b)| a - b).sum();
    println!("{count} tasks' buffers freed on another node's workers: {home} remote frees collected by their owners");
    // Each buffer's free is a remote free its owner collects (the count
    // also holds task cells another worker of the node freed).
    if nodes.len() > 1 {
        assert!(home as usize >= count, "{home} remote frees collected for {count} buffers freed elsewhere");
    }
}

/// With rings: every worker has a ring cloned from its node's table (one
/// table per node, its rings counted there), and a buffer from it carries
/// an index in that table.
#[cfg(feature = "io-uring")]
#[test]
fn each_worker_has_a_ring_of_its_nodes_table() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rt = match NodeRuntime::builder().workers_per_node(2).rings(4096, 32).build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("SKIPPED: no io_uring here ({e})");
            assert!(std::env::var_os("NUMAWEAVE_TEST_STRICT").is_none(), "no io_uring under NUMAWEAVE_TEST_STRICT");
            return;
        }
    };
    for node in rt.nodes() {
        let t = rt.spawn_on(node, async {
            numaweave_tokio::with_ring(|ring| {
                let buf = ring.alloc().unwrap();
                // A nested call sees the same ring.
                let again = numaweave_tokio::with_ring(|r| r.node()).unwrap();
                assert_eq!(again, Some(ring.node()));
                (ring.node(), buf.index())
            })
        });
        let (ring_node, _index) = rt.block_on(t).unwrap().unwrap().expect("a worker without a ring");
        assert_eq!(ring_node, node);
        let table = rt.table(node).unwrap();
        // The ring of the worker that asked (rings are made when asked for).
        assert!(table.rings() >= 1 || table.sharing() == numaweave::io::uring::Sharing::PerRing, "{}", table.rings());
        println!("node {node}: {:?}, {} rings, {} bytes pinned once", table.sharing(), table.rings(), table.pinned());
    }
    assert_eq!(numaweave_tokio::with_ring(|_| ()).unwrap(), None, "the test's own thread has no ring");
}

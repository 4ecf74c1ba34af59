//! Prints the NUMA topology as a table: nodes, CPUs, memory, distances, the
//! nodes this process may use, and where this thread runs.
//!
//! ```text
//! cargo run --example topology                       # this machine (sysfs)
//! NUMAWEAVE_TOPOLOGY=fake:4 cargo run --example topology   # 4 synthetic nodes
//! cargo run --example topology -- --device nvme0n1   # plus a device's node
//! ```
//!
//! `--device` takes a PCI bus id (`0000:03:00.0`), a block device (`nvme0n1`,
//! `/dev/sda`) or a network interface (`eth0`); it may be repeated.

use std::process::ExitCode;

use numaweave::topology::Topology;

fn main() -> ExitCode {
    let mut devices = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--device" => match args.next() {
                Some(d) => devices.push(d),
                None => return usage("--device needs a name"),
            },
            "-h" | "--help" => {
                println!("usage: topology [--device NAME]...");
                return ExitCode::SUCCESS;
            }
            other => return usage(&format!("unknown argument {other:?}")),
        }
    }

    let topo = Topology::global();
    print!("{topo}");
    match topo.current_cpu() {
        Some(cpu) => println!("this thread runs on CPU {cpu}, node {}", topo.current_node()),
        None => println!("this thread's CPU is unknown; default node {}", topo.default_node()),
    }
    let order: Vec<String> = topo.nodes_by_distance(topo.current_node()).map(|n| n.to_string()).collect();
    println!("fallback order from here: {}", order.join(" -> "));

    let mut status = ExitCode::SUCCESS;
    for d in &devices {
        match topo.device_node(d) {
            Ok(Some(n)) => println!("device {d}: node {n}"),
            Ok(None) => println!("device {d}: no node (NUMA_NO_NODE: local to the whole machine)"),
            Err(e) => {
                eprintln!("device {d}: {e}");
                status = ExitCode::FAILURE;
            }
        }
    }
    status
}

fn usage(why: &str) -> ExitCode {
    eprintln!("topology: {why}\nusage: topology [--device NAME]...");
    ExitCode::from(2)
}

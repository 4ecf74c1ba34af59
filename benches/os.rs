//! Costs of the foundation's primitives, side by side in one run: finding the
//! current node (vDSO `sched_getcpu` + table vs the `getcpu` system call), and
//! getting node-bound memory (`mmap` alone vs `mmap` + `mbind`).
//!
//! `cargo bench --bench os`

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use numaweave::os::mem::{Mapping, MemPolicy};
use numaweave::topology::{NodeSet, Topology};

fn current_node(c: &mut Criterion) {
    let topo = Topology::global();
    let mut g = c.benchmark_group("current_node");
    g.bench_function("topology.current_node (sched_getcpu + table)", |b| b.iter(|| black_box(topo.current_node())));
    g.bench_function("getcpu syscall", |b| b.iter(|| black_box(numaweave::os::cpu::getcpu().unwrap())));
    g.finish();
}

fn bound_memory(c: &mut Criterion) {
    const LEN: usize = 256 * 1024;
    let topo = Topology::global();
    let node = NodeSet::single(topo.physical_node(topo.current_node()));
    let mut g = c.benchmark_group("map+touch 256KiB");
    let touch = |r: &Mapping| {
        for off in (0..r.len()).step_by(4096) {
            // SAFETY: inside the region, which is mapped and writable.
            unsafe { r.as_ptr().add(off).write_volatile(1) };
        }
    };
    g.bench_function("mmap", |b| {
        b.iter(|| {
            let r = Mapping::map(LEN).unwrap();
            touch(&r);
        })
    });
    g.bench_function("mmap+mbind(bind)", |b| {
        b.iter(|| {
            let r = Mapping::map(LEN).unwrap();
            r.bind(MemPolicy::Bind(node)).unwrap();
            touch(&r);
        })
    });
    g.finish();
}

criterion_group!(benches, current_node, bound_memory);
criterion_main!(benches);

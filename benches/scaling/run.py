#!/usr/bin/env python3
"""Throughput by thread count under five allocators, in one run.

    python3 benches/scaling/run.py [--threads 8,16,64] [--rounds N] [--work F] [--quick] [--out DIR]

Four multi-threaded workloads, each at each thread count, under glibc's
malloc, jemalloc, mimalloc, tcmalloc and numaweave (each preloaded, as
benches/programs/run.py does, whose installs and builds it shares):

- larson: Larson's server (threads replace random blocks of 10-1000 B and
  hand their arrays to a new thread each generation: remote frees, threads
  that come and go);
- new/delete: C++ objects of mixed sizes made and deleted by each thread;
- per-thread sizes: glibc's bench-malloc-thread (a working set a thread
  replaces at random, up to 32 KiB);
- ring: every block handed to the next thread, which frees it (a
  runtime's tasks moving between workers; `ring.c`).

Each thread does the same work at every count, so a workload's throughput
(operations a second, all threads together) grows with the CPUs while
they last. The default counts are 1, 2, the machine's CPUs and 8, 16
and 64 (the counts past the CPUs measure oversubscription); rounds are
interleaved (every allocator once per round) and the median printed: a
table of millions of operations a second, each peer's beside numaweave's
and numaweave's ratio to the best peer (above 1: numaweave ahead). Written
to OUT/scaling.md (OUT: target/scaling). `--work` scales the work a thread
does; `--quick` is one round, counts 1, 2 and 8, a tenth of the work.
Nothing is asserted about timings.
"""

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
_spec = importlib.util.spec_from_file_location("programs_run", ROOT / "benches/programs/run.py")
programs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(programs)
ALLOCATORS = programs.ALLOCATORS


def workloads(bins: Path, threads: int, work: float):
    """(name, command, pattern of the throughput it prints)."""
    n = lambda x: str(max(1, int(x * work)))
    return [
        ("larson", [str(bins / "larson"), str(threads), n(100), "1000", "10000"], r"([\d.]+) replacements/s"),
        ("new/delete", [str(bins / "mixed"), str(threads), n(10_000_000)], r"([\d.]+) new\+delete"),
        ("per-thread sizes", [str(bins / "perthread"), str(threads), n(2_000_000)], r"([\d.]+) iterations"),
        ("ring", [str(bins / "ring"), str(threads), n(500_000)], r"([\d.]+) blocks handed"),
    ]


def throughput(cmd, pattern, lib):
    env = programs.environment(lib)
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=900).stdout
    m = re.search(pattern, out)
    if not m:
        sys.exit(f"{cmd[0]} printed no figure: {out!r}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", help="comma-separated thread counts (default 1, 2, the CPUs, 8, 16, 64)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, 1 with --quick)")
    ap.add_argument("--work", type=float, default=None, help="work a thread does, times the default")
    ap.add_argument("--quick", action="store_true", help="one round, 1, 2 and 8 threads, a tenth of the work")
    ap.add_argument("--out", default=str(ROOT / "target/scaling"))
    a = ap.parse_args()
    cpus = os.cpu_count() or 1
    if a.threads:
        counts = sorted({int(t) for t in a.threads.split(",") if t})
    elif a.quick:
        counts = [1, 2, 8]
    else:
        counts = sorted({1, 2, cpus, 8, 16, 64})
    rounds = a.rounds or (1 if a.quick else 3)
    work = a.work or (0.1 if a.quick else 1.0)
    programs.install()
    programs.sh(["cargo", "build", "-q", "--release", "-p", "numaweave-capi"], cwd=ROOT)
    bins = Path(tempfile.mkdtemp(prefix="numaweave-scaling-"))
    for c in ("larson", "perthread"):
        programs.sh(["gcc", "-O2", str(programs.HERE / f"{c}.c"), "-o", str(bins / c), "-lpthread"])
    programs.sh(["g++", "-O2", str(programs.HERE / "mixed.cc"), "-o", str(bins / "mixed"), "-lpthread"])
    programs.sh(["gcc", "-O2", str(HERE / "ring.c"), "-o", str(bins / "ring"), "-lpthread"])

    names = list(ALLOCATORS)
    peers = [n for n in names if n != "numaweave"]
    rows = []
    for threads in counts:
        for name, cmd, pattern in workloads(bins, threads, work):
            runs = {n: [] for n in names}
            for _ in range(rounds):
                for n in names:
                    runs[n].append(throughput(cmd, pattern, ALLOCATORS[n]))
            med = {n: statistics.median(runs[n]) for n in names}
            best = max(peers, key=lambda n: med[n])
            rows.append((name, threads, med, best))
            print(f"{name:16} {threads:3} threads " + " ".join(f"{n}={med[n] / 1e6:.2f}M" for n in names)
                  + f"  numaweave / {best} {med['numaweave'] / med[best]:.2f}", flush=True)

    stamp = time.strftime("%Y-%m-%d")
    lines = [f"Throughput by threads ({stamp}, {cpus} CPUs, {rounds} round(s), medians, millions of "
             "operations a second; last column: numaweave / the best peer, above 1 numaweave ahead)", "",
             "| workload | threads | " + " | ".join(names) + " | numaweave / best peer |",
             "| --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: |"]
    for name, threads, med, best in rows:
        lines.append(f"| {name} | {threads} | " + " | ".join(f"{med[n] / 1e6:.2f}" for n in names)
                     + f" | {med['numaweave'] / med[best]:.2f} ({best}) |")
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.md").write_text(table + "\n")
    print(f"\nwritten: {out / 'scaling.md'}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The Rust applications' workloads under each global allocator, one table.

    python3 benches/apps/run.py [--rounds N] [--no-peers]

Builds the bench targets `apps_numaweave`, `apps_system` and (with the
`peers` feature) `apps_mimalloc`, `apps_jemalloc` and `apps_snmalloc` (benches/apps_*.rs:
the same workloads, benches/apps/workloads.rs, under each allocator), runs
them N times (default 3), alternating, and prints per workload each
allocator's median time a round, its minor faults and peak RSS, and its
time over the fastest's; then the geometric means over the workloads.
Nothing is asserted.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(peers):
    """The bench executables, by allocator."""
    names = ["numaweave", "system"] + (["mimalloc", "jemalloc", "snmalloc"] if peers else [])
    cmd = ["cargo", "bench", "-q", "-p", "numaweave", "--no-run", "--message-format=json"]
    if peers:
        cmd += ["--features", "peers"]
    for n in names:
        cmd += ["--bench", f"apps_{n}"]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    exes = {}
    for line in out.splitlines():
        m = json.loads(line)
        if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"].startswith("apps_"):
            exes[m["target"]["name"][5:]] = m["executable"]
    return {n: exes[n] for n in names}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-peers", action="store_true", help="numaweave and the system allocator only")
    a = ap.parse_args()
    exes = build(not a.no_peers)
    res = {}  # (workload, allocator) -> [(s, faults, rss MiB)]
    for r in range(a.rounds):
        for alloc, exe in exes.items():
            out = subprocess.run([exe], cwd=ROOT, check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                f = line.split()
                if f[:1] != ["app"]:
                    continue
                res.setdefault((f[1], alloc), []).append((float(f[3]), int(f[8]), int(f[13])))
            print(f"round {r + 1}/{a.rounds}: {alloc} done", file=sys.stderr)
    workloads = list(dict.fromkeys(w for w, _ in res))
    allocs = list(exes)
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v), max(x[2] for x in v),
               min(x[0] for x in v), max(x[0] for x in v)) for k, v in res.items()}
    print(f"Rust applications under {len(allocs)} allocators ({a.rounds} process rounds; time: median round "
          "of each process's rounds, median over processes, [spread]; faults; peak RSS)\n")
    print("| workload | " + " | ".join(allocs) + " |")
    print("| --- |" + " ---: |" * len(allocs))
    for w in workloads:
        best = min(med[(w, al)][0] for al in allocs)
        cells = []
        for al in allocs:
            t, fl, rss, lo, hi = med[(w, al)]
            cells.append(f"{t:.3f} s [{lo:.3f}–{hi:.3f}] ({t / best:.2f}), {fl:,} faults, {rss} MiB")
        print(f"| {w} | " + " | ".join(cells) + " |")
    gm = []
    for al in allocs:
        t = math.exp(statistics.mean(math.log(med[(w, al)][0] / min(med[(w, b)][0] for b in allocs)) for w in workloads))
        r = math.exp(statistics.mean(math.log(med[(w, al)][2] / min(med[(w, b)][2] for b in allocs)) for w in workloads))
        gm.append(f"time {t:.2f}, RSS {r:.2f}")
    print("| geomean / best | " + " | ".join(gm) + " |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What five allocators keep: memory, not time, in one run.

    python3 benches/memory/run.py [--quick] [--only NAME,...] [--lib PATH] [--out DIR]

Builds benches/memory/memory.c and runs its workloads under glibc's malloc
and, each through LD_PRELOAD, jemalloc (libjemalloc2), mimalloc
(libmimalloc2.0), tcmalloc (libtcmalloc-minimal4), where installed, and
numaweave (target/release/libnumaweave.so, or --lib), then python3 at
start. Prints one markdown table (rows: measures; columns: allocators) and
writes it to OUT/memory.md (OUT: target/memory).

- phases: a size mix that shifts phase by phase (16-256 B up to
  16-256 KiB and back), 64 MiB a phase from four threads, 75% of what is
  live freed at random by four other threads, 12 phases: peak resident /
  peak live, mean resident / live after each phase's frees, resident after
  everything is freed, after 5 s of one malloc/free every 10 ms, after
  malloc_trim(0) where the allocator has its own;
- churn: short-lived threads, 8 at a time, ~1 MiB in mixed sizes each, 1/8
  of it freed by a thread of the next batch: resident after 1,000 and at
  the end (100,000; --quick 10,000), and the ratio of the median resident
  after a batch over the last 500 threads to that over threads 501-1,000;
- perthread: 1,000 and 10,000 threads each holding 64 blocks of
  16 B-2 KiB: resident per thread;
- steady: a loop that builds a document (200,000 small blocks and a
  buffer grown to 16 MiB), frees it and rests 20 ms: page faults per round
  after two, resident after the loop and after 5 quiet seconds;
- until-null: 1 MiB blocks until malloc fails under `ulimit -v` 300000;
- robson: Robson's pattern, as Mesh's fragmenter runs it (blocks of one
  size fill 64 MiB, every other one freed, the size doubled, from 16 B to
  8 KiB): peak resident / budget, resident / live at the end (before
  any other call), after 2 s of a malloc/free every 10 ms and after
  `malloc_trim(0)` (where the allocator has one), the survivors live;
- redis: Debian's redis-server (where installed) fills 300,000 keys of
  128-byte values, deletes 75% of them at random, then fills 60,000 keys
  of 512-byte values (the bytes it deleted): the server's peak resident and
  its resident at the end (MiB). glibc's column preloads libc.so.6, as the
  server links libjemalloc, whose malloc it would otherwise get;
- python3: virtual size at start; the smallest `ulimit -v` (MiB) it starts
  under, found by bisection.

Resident figures are the process's less what it held when main() began.
Nothing is asserted: figures are printed.
"""

import argparse
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LIBDIR = Path("/usr/lib/x86_64-linux-gnu")
PEERS = {
    "jemalloc": LIBDIR / "libjemalloc.so.2",
    "mimalloc": LIBDIR / "libmimalloc.so.2",
    "tcmalloc": LIBDIR / "libtcmalloc_minimal.so.4",
}


def build(work: Path) -> Path:
    exe = work / "memory"
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", str(HERE / "memory.c"), "-o", str(exe), "-lpthread", "-ldl",
                    "-lm"], check=True)
    return exe


def run(cmd, lib, limit_kib=None, timeout=600):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if lib:
        env["LD_PRELOAD"] = str(lib)

    def pre():
        if limit_kib:
            resource.setrlimit(resource.RLIMIT_AS, (limit_kib * 1024, limit_kib * 1024))

    return subprocess.run(cmd, env=env, capture_output=True, text=True, preexec_fn=pre, timeout=timeout)


def figures(out: str) -> dict:
    d = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                d[parts[0]] = float(parts[1])
            except ValueError:
                pass
    return d


def resp(*args) -> bytes:
    """One command in the Redis protocol."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def redis_frag(lib):
    """Peak and final resident (MiB) of a redis-server that fills, deletes
    75% at random and fills again with larger values; None without
    redis-server."""
    if not shutil.which("redis-server") or not shutil.which("redis-cli"):
        return None
    env = dict(os.environ)
    # The server links libjemalloc: without a preload it gets jemalloc's
    # malloc, so glibc's is preloaded by name.
    env["LD_PRELOAD"] = str(lib) if lib else "/lib/x86_64-linux-gnu/libc.so.6"
    port = str(22000 + os.getpid() % 10000)
    d = tempfile.mkdtemp(prefix="numaweave-redis-frag-")
    srv = subprocess.Popen(["redis-server", "--port", port, "--save", "", "--appendonly", "no", "--dir", d,
                            "--daemonize", "no"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cli = ["redis-cli", "-p", port]

    def pipe(data: bytes):
        subprocess.run(cli + ["--pipe"], input=data, stdout=subprocess.DEVNULL, check=True)

    def status(key):
        text = Path(f"/proc/{srv.pid}/status").read_text()
        return int(re.search(key + r":\s+(\d+)", text).group(1)) / 1024

    try:
        for _ in range(100):
            if subprocess.run(cli + ["ping"], capture_output=True).stdout.strip() == b"PONG":
                break
            time.sleep(0.05)
        rng = random.Random(7)
        small = b"v" * 128
        pipe(b"".join(resp("SET", f"k:{i}", small) for i in range(300_000)))
        gone = rng.sample(range(300_000), 225_000)
        pipe(b"".join(resp("DEL", f"k:{i}") for i in gone))
        large = b"w" * 512
        pipe(b"".join(resp("SET", f"big:{i}", large) for i in range(60_000)))
        time.sleep(1)
        return {"peak_mib": status("VmHWM"), "end_mib": status("VmRSS")}
    finally:
        subprocess.run(cli + ["shutdown", "nosave"], capture_output=True)
        srv.wait(timeout=30)
        shutil.rmtree(d, ignore_errors=True)


def python_vsz(lib):
    r = run(["python3", "-c",
             "print([l for l in open('/proc/self/status') if l.startswith('VmSize')][0].split()[1])"], lib)
    return float(r.stdout.strip()) / 1024 if r.returncode == 0 else None


def starts(lib, mib):
    """Whether python3 starts under `ulimit -v` of `mib` MiB with `lib`
    preloaded (a library the loader could not map under the limit, and
    went on without, does not count)."""
    r = run(["python3", "-c", "pass"], lib, limit_kib=mib * 1024)
    return r.returncode == 0 and "cannot be preloaded" not in r.stderr


def python_min_limit(lib):
    """The smallest `ulimit -v` (MiB, to 1 MiB) python3 starts under (and
    every larger one up to 256 MiB, checked in steps of 4)."""
    ok = [m for m in range(4, 257, 4) if starts(lib, m)]
    if not ok or any(not starts(lib, m) for m in range(ok[0], 257, 4)):
        return None
    lo, hi = ok[0] - 4, ok[0]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if starts(lib, mid):
            hi = mid
        else:
            lo = mid
    return float(hi)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer threads (CI)")
    ap.add_argument("--only", help="comma-separated allocators")
    ap.add_argument("--lib", default=str(ROOT / "target/release/libnumaweave.so"))
    ap.add_argument("--out", default=str(ROOT / "target/memory"))
    a = ap.parse_args()
    libs = {"glibc": None}
    libs.update({k: v for k, v in PEERS.items() if v.exists()})
    libs["numaweave"] = Path(a.lib)
    if not libs["numaweave"].exists():
        sys.exit(f"{a.lib} not built: cargo build --release --workspace")
    if a.only:
        keep = set(a.only.split(","))
        libs = {k: v for k, v in libs.items() if k in keep}
    churn_n = 10000 if a.quick else 100000
    rows = [
        ("phases: peak resident / peak live", "phases", "peak_rss_per_live", "{:.2f}"),
        ("phases: mean resident / live after frees", "phases", "mean_rss_per_live_after_frees", "{:.2f}"),
        ("phases: resident after all is freed (MiB)", "phases", "freed_rss_mib", "{:.1f}"),
        ("phases: after 5 s of a malloc/free every 10 ms (MiB)", "phases", "quiet_rss_mib", "{:.1f}"),
        ("phases: after malloc_trim(0) (MiB)", "phases", "trimmed_rss_mib", "{:.1f}"),
        (f"churn: resident after 1,000 threads (MiB)", "churn", "rss_after_1000_mib", "{:.1f}"),
        (f"churn: resident after {churn_n:,} threads (MiB)", "churn", "rss_at_end_mib", "{:.1f}"),
        ("churn: median resident after a batch, last 500 threads / threads 501-1,000", "churn",
         "rss_median_growth", "{:.2f}"),
        ("1,000 threads holding 64 blocks: resident per thread (KiB)", "perthread1000", "rss_kib_per_thread",
         "{:.0f}"),
        ("10,000 threads holding 64 blocks: resident per thread (KiB)", "perthread10000", "rss_kib_per_thread",
         "{:.0f}"),
        ("steady loop: page faults per round", "steady", "faults_per_round", "{:.0f}"),
        ("steady loop: seconds per round", "steady", "seconds_per_round", "{:.3f}"),
        ("steady loop: resident after it (MiB)", "steady", "rss_after_loop_mib", "{:.1f}"),
        ("steady loop: after 5 quiet seconds (MiB)", "steady", "quiet_rss_mib", "{:.1f}"),
        ("malloc until NULL under ulimit -v 300000 (MiB)", "until", "mib_until_null", "{:.0f}"),
        ("robson: peak resident / 64 MiB budget", "robson", "peak_rss_per_budget", "{:.2f}"),
        ("robson: resident / live at the end", "robson", "end_rss_per_live", "{:.2f}"),
        ("robson: the same after 2 s of a malloc/free every 10 ms", "robson", "quiet_rss_per_live", "{:.2f}"),
        ("robson: the same after malloc_trim(0)", "robson", "trimmed_rss_per_live", "{:.2f}"),
        ("redis fill, delete 75%, refill larger: peak resident (MiB)", "redis", "peak_mib", "{:.1f}"),
        ("same: resident at the end (MiB)", "redis", "end_mib", "{:.1f}"),
        ("python3 virtual size at start (MiB)", "pyvsz", "vsz", "{:.1f}"),
        ("python3: smallest ulimit -v it starts under (MiB)", "pylimit", "limit", "{:.0f}"),
    ]
    with tempfile.TemporaryDirectory() as t:
        exe = build(Path(t))
        results = {}
        for name, lib in libs.items():
            r = {}
            print(f"{name} ...", file=sys.stderr, flush=True)
            for key, args, kw in [
                ("phases", ["phases"], {}),
                ("churn", ["churn", str(churn_n)], {}),
                ("perthread1000", ["perthread", "1000"], {}),
                ("perthread10000", ["perthread", "10000"], {}),
                ("steady", ["steady", "20"], {}),
                ("until", ["until-null"], {"limit_kib": 300000}),
                ("robson", ["robson"], {}),
            ]:
                p = run([str(exe)] + args, lib, **kw)
                if p.returncode != 0:
                    print(f"  {name} {args}: exit {p.returncode}: {p.stderr.strip()[-300:]}", file=sys.stderr)
                r[key] = figures(p.stdout)
            r["redis"] = redis_frag(lib) or {}
            r["pyvsz"] = {"vsz": python_vsz(lib)}
            r["pylimit"] = {"limit": python_min_limit(lib)}
            results[name] = r
    names = list(libs)
    lines = ["| measure | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key, field, fmt in rows:
        cells = []
        for n in names:
            v = results[n].get(key, {}).get(field)
            cells.append(fmt.format(v) if v is not None else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.md").write_text(table + "\n")


if __name__ == "__main__":
    main()

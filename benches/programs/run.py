#!/usr/bin/env python3
"""Real programs under five allocators, in one run.

    python3 benches/programs/run.py [--quick] [--hardened] [--baseline LIB] [--no-interleaves]
                                    [--repeat N] [--only NAME,...] [--out DIR]

Runs allocation-heavy programs from Debian's packages, and small C and C++
programs of ours (workload classes, six of them the patterns of public
allocator benchmarks), under glibc's malloc, jemalloc
(libjemalloc2), mimalloc (libmimalloc2.0), tcmalloc (libtcmalloc-minimal4)
and numaweave, each through LD_PRELOAD, repeats interleaved (every
allocator once per round); then numaweave under process-wide interleaves
on a synthetic two-node topology. Prints a markdown table of the medians of
wall time and peak RSS (/usr/bin/time: the largest process of the tree) and
their ratios (with --hardened, also libnumaweave_hardened.so without and
with NUMAWEAVE_CHECK=full, against numaweave; with --baseline, another
build of libnumaweave.so, e.g. the one before a change, in the same rounds,
against numaweave), writes it to OUT/programs.md and an SVG chart of the
time ratios to OUT/programs.svg (OUT: target/programs).

Every program's allocations are checked to go through the preloaded
library: a numaweave run with NUMAWEAVE_SHOW_STATS=1 must count at least
10,000 allocations (Python runs with PYTHONMALLOC=malloc: its own
small-object allocator would take them otherwise); a workload class of ours
at least as many as it makes by design (the large-block loop: one per
iteration). Ghostscript is left out: it runs its own allocator over a few
large malloc'd chunks (4,000 allocations a render), so it measures nothing;
jq on a generated JSON file takes its place. The installs are done
here (apt), so it runs on a fresh machine. Nothing is asserted about
timings.
"""

import argparse
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LIBDIR = Path("/usr/lib/x86_64-linux-gnu")
PACKAGES = ["z3", "lua5.4", "redis-server", "redis-tools", "sqlite3", "python3.11", "gcc", "g++", "jq", "time",
            "libjemalloc2", "libmimalloc2.0", "libtcmalloc-minimal4"]
ALLOCATORS = {
    # Preloaded by name: redis-server links libjemalloc, whose malloc it
    # would get with no preload (the row's "glibc" was jemalloc's before).
    "glibc": Path("/lib/x86_64-linux-gnu/libc.so.6"),
    "jemalloc": LIBDIR / "libjemalloc.so.2",
    "mimalloc": LIBDIR / "libmimalloc.so.2",
    "tcmalloc": LIBDIR / "libtcmalloc_minimal.so.4",
    "numaweave": ROOT / "target/release/libnumaweave.so",
}
INTERLEAVES = {
    "interleave count=8": "interleave:0-1:count=8",
    "interleave bytes=64K": "interleave:0-1:bytes=64K",
}
HARDENED_LIB = ROOT / "target/hardened/release/libnumaweave_hardened.so"
HARDENED = {
    "hardened": {},
    "hardened full": {"NUMAWEAVE_CHECK": "full"},
}


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def install():
    missing = [p for p in PACKAGES if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if not missing:
        return
    print("installing", " ".join(missing), flush=True)
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    base = sudo + ["apt-get", "-o", "DPkg::Lock::Timeout=300"]
    if subprocess.run(base + ["install", "-y", "-q", "--no-install-recommends"] + missing, env=env,
                      stdout=subprocess.DEVNULL).returncode != 0:
        sh(base + ["update", "-q"], env=env, stdout=subprocess.DEVNULL)
        sh(base + ["install", "-y", "-q", "--no-install-recommends"] + missing, env=env, stdout=subprocess.DEVNULL)
    # Debian starts redis-server as a service: the benchmark starts its own.
    subprocess.run(sudo + ["service", "redis-server", "stop"], capture_output=True)


def inputs(work: Path, quick: bool):
    """Generated inputs, deterministic."""
    r = random.Random(2)
    n, m = 30, 70
    with open(work / "problem.smt2", "w") as f:
        f.write("(set-logic QF_LIA)\n")
        for i in range(n):
            f.write(f"(declare-const x{i} Int)\n(assert (and (>= x{i} (- 1000)) (<= x{i} 1000)))\n")
        for _ in range(m):
            terms = " ".join(f"(* {r.randrange(-50, 50)} x{v})" for v in r.sample(range(n), 4))
            f.write(f"(assert (<= (+ {terms}) {r.randrange(-300, 300)}))\n")
        f.write("(check-sat)\n")
    (work / "gc.lua").write_text("""
local function tree(d) if d == 0 then return {} end return {tree(d-1), tree(d-1)} end
local function check(t) if not t[1] then return 1 end return 1 + check(t[1]) + check(t[2]) end
local total = 0
for i = 1, %d do
  total = total + check(tree(15))
  local s = {}
  for j = 1, 20000 do s[#s+1] = tostring(j) .. "-" .. i end
  total = total + #table.concat(s, ",")
end
print(total)
""" % (10 if quick else 40))
    (work / "alloc.py").write_text("""
import random
r = random.Random(1)
class Node:
    __slots__ = ("l", "r", "v")
    def __init__(self, l, r, v): self.l, self.r, self.v = l, r, v
def tree(d): return Node(tree(d - 1), tree(d - 1), d) if d else None
def count(t): return 0 if t is None else 1 + count(t.l) + count(t.r)
total = 0
for i in range(%d):
    total += count(tree(14))
    d = {}
    for j in range(40000):
        d[str(j * i)] = [j] * (j %% 7)
        if j %% 3 == 0:
            d.pop(str((j - 3) * i), None)
    total += len(d) + sum(len(v) for v in d.values())
    s = " ".join(str(r.random()) for _ in range(20000)).split()
    total += len(s)
print(total)
""" % (3 if quick else 12))
    rows = 20000 if quick else 150000
    with open(work / "workload.sql", "w") as f:
        f.write("create table t(id integer primary key, k integer, name text, payload blob);\nbegin;\n")
        for _ in range(rows):
            name = "".join(r.choice("abcdefgh") for _ in range(r.randrange(1, 40)))
            f.write(f"insert into t(k, name, payload) values({r.randrange(1000)}, '{name}', randomblob({r.randrange(300)}));\n")
        f.write("commit;\ncreate index tk on t(k);\ncreate index tn on t(name);\n")
        f.write("select k, count(*), sum(length(payload)) from t group by k order by 3 desc limit 5;\n")
        f.write("update t set name = upper(name) where k % 3 = 0;\ndelete from t where k % 5 = 0;\n")
        f.write("select count(*), count(distinct name) from t;\nvacuum;\n")
    funcs = 500 if quick else 3000
    with open(work / "big.c", "w") as f:
        f.write("#include <stdio.h>\n#include <string.h>\n")
        for i in range(funcs):
            ops = " ".join(f"x = (x {r.choice('+-^*')} {r.randrange(1, 1000)}u) {r.choice(['<<', '>>'])} {r.randrange(1, 5)};"
                           for _ in range(r.randrange(3, 20)))
            f.write(f"static unsigned f{i}(unsigned x) {{ char b[{r.randrange(8, 64)}]; memset(b, (int)x, sizeof b); {ops} "
                    f"for (unsigned i = 0; i < sizeof b; i++) x += (unsigned char)b[i] * i; return x; }}\n")
        f.write("int main(void) { unsigned acc = 1;\n")
        for i in range(funcs):
            f.write(f"  acc = f{i}(acc) ^ {i}u;\n")
        f.write('  printf("%u\\n", acc); return 0; }\n')
    import json
    items = [{"id": i, "name": "n%d" % r.randrange(10 ** 6), "tags": [r.choice("abcdefgh") * r.randrange(1, 9)
             for _ in range(r.randrange(1, 8))], "v": r.random()} for i in range(40000 if quick else 200000)]
    (work / "big.json").write_text(json.dumps(items))


def programs(work: Path, quick: bool, bins: Path):
    """(name, kind, command): kind is 'real' (Debian's) or 'class' (ours)."""
    jq = "map(select(.v > 0.3)) | group_by(.tags[0]) | map({k: .[0].tags[0], n: length, s: (map(.v) | add)})"
    real = [
        ("z3", ["z3", str(work / "problem.smt2")]),
        ("lua", ["lua5.4", str(work / "gc.lua")]),
        ("redis", ["redis"]),
        ("sqlite3", ["sqlite3", ":memory:", "-init", "/dev/null", "-batch", "-cmd", f".read {work / 'workload.sql'}", ".quit"]),
        ("python3", ["/usr/bin/python3.11", str(work / "alloc.py")]),
        ("gcc -O2", ["gcc", "-O2", "-c", str(work / "big.c"), "-o", str(work / "big.o")]),
        ("jq", ["jq", "-c", jq, str(work / "big.json")]),
    ]
    classes = [
        ("large blocks", [str(bins / "large"), "300" if quick else "2000"]),
        ("thread churn", [str(bins / "threads"), "100" if quick else "400"]),
        ("cross-thread", [str(bins / "xthread"), "2000000" if quick else "10000000"]),
        ("churn+realloc", [str(bins / "churn"), "5000000" if quick else "20000000"]),
        # Public allocator benchmarks' patterns, written from their
        # descriptions (see each file): Larson's server, glibc's
        # bench-malloc-simple and bench-malloc-thread, OLogN's alloc-test,
        # rpmalloc's benchmark, mimalloc-bench's mleak.
        # Larson as mimalloc-bench runs it (5,000 blocks a thread, 100
        # rounds of them a generation), and with short generations (a
        # thread's start and exit every 10,000 replacements).
        ("larson", [str(bins / "larson"), "2", "4" if quick else "40", "5000", "500000"]),
        ("larson, short lives", [str(bins / "larson"), "2", "200" if quick else "2000", "1000", "10000"]),
        ("malloc-simple", [str(bins / "simple"), "200000" if quick else "2000000"]),
        ("new/delete, 1 thread", [str(bins / "mixed"), "1", "6000000" if quick else "60000000"]),
        ("new/delete, 2 threads", [str(bins / "mixed"), "2", "6000000" if quick else "60000000"]),
        ("per-thread sizes", [str(bins / "perthread"), "2", "2000000" if quick else "20000000"]),
        # mimalloc-bench's rptest (rpmalloc's pattern: sizes to 16,000
        # bytes, batches handed between threads) and mleak (threads that
        # each leave one block behind, freed by a later one).
        ("rptest", [str(bins / "rptest"), "2", "2000" if quick else "20000"]),
        ("mleak", [str(bins / "mleak"), "10" if quick else "30"]),
    ]
    if quick:
        real = [p for p in real if p[0] in ("lua", "sqlite3", "jq")]
    return [(n, "real", c) for n, c in real] + [(n, "class", c) for n, c in classes]


def environment(lib, policy=None):
    env = dict(os.environ, PYTHONMALLOC="malloc")
    env.pop("LD_PRELOAD", None)
    if lib:
        env["LD_PRELOAD"] = str(lib)
    if policy:
        env.update(NUMAWEAVE_TOPOLOGY="fake:2", NUMAWEAVE_MODE="per-node", NUMAWEAVE_POLICY=policy)
    return env


def run_redis(env, quick):
    """A redis-server under `env`, redis-benchmark against it on loopback:
    the benchmark's wall time, the server's peak RSS (KiB)."""
    port = str(20000 + os.getpid() % 10000)
    d = tempfile.mkdtemp(prefix="numaweave-redis-")
    srv = subprocess.Popen(["redis-server", "--port", port, "--save", "", "--appendonly", "no", "--dir", d,
                            "--daemonize", "no"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if subprocess.run(["redis-cli", "-p", port, "ping"], capture_output=True).stdout.strip() == b"PONG":
                break
            time.sleep(0.05)
        n = "50000" if quick else "400000"
        t0 = time.monotonic()
        sh(["redis-benchmark", "-p", port, "-q", "-n", n, "-P", "16", "-d", "256", "-r", "100000",
            "-t", "set,get,lpush,lpop,sadd,hset,incr"], stdout=subprocess.DEVNULL)
        wall = time.monotonic() - t0
        status = Path(f"/proc/{srv.pid}/status").read_text()
        rss = int(re.search(r"VmHWM:\s+(\d+)", status).group(1))
    finally:
        subprocess.run(["redis-cli", "-p", port, "shutdown", "nosave"], capture_output=True)
        srv.wait(timeout=30)
        shutil.rmtree(d, ignore_errors=True)
    return wall, rss


def measure(cmd, env, quick, work):
    """Wall seconds and peak RSS (KiB) of one run."""
    if cmd == ["redis"]:
        return run_redis(env, quick)
    out = work / "time.txt"
    sh(["/usr/bin/time", "-f", "%e %M", "-o", str(out)] + cmd, env=env, cwd=work,
       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall, rss = out.read_text().split()[-2:]
    return float(wall), int(rss)


def allocations(cmd, quick, work):
    """Allocations numaweave counted in one run (NUMAWEAVE_SHOW_STATS)."""
    env = dict(environment(ALLOCATORS["numaweave"]), NUMAWEAVE_SHOW_STATS="1")
    if cmd == ["redis"]:
        # The server prints its statistics at exit, on its stderr.
        port = str(21000 + os.getpid() % 10000)
        srv = subprocess.Popen(["redis-server", "--port", port, "--save", "", "--appendonly", "no"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(100):
            if subprocess.run(["redis-cli", "-p", port, "ping"], capture_output=True).stdout.strip() == b"PONG":
                break
            time.sleep(0.05)
        sh(["redis-benchmark", "-p", port, "-q", "-n", "20000", "-P", "16", "-t", "set,get"], stdout=subprocess.DEVNULL)
        subprocess.run(["redis-cli", "-p", port, "shutdown", "nosave"], capture_output=True)
        err = srv.communicate(timeout=30)[1].decode()
    else:
        err = subprocess.run(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE).stderr.decode()
    # Every process of the tree prints its table; the total of their allocs.
    total = 0
    for m in re.finditer(r"^\s+\d+\s+\S+ \S+\s+\S+ \S+\s+\S+ \S+\s+\S+ \S+\s+(\d+)\s", err, re.M):
        total += int(m.group(1))
    return total


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def svg(rows, names, path):
    """Grouped bars: each allocator's time as a ratio to glibc's, per program."""
    colors = ["#888888", "#d95f02", "#1b9e77", "#7570b3", "#e7298a", "#66a61e", "#e6ab02"]
    w, bar, gap, h, top = 70 + len(rows) * (len(names) * 9 + 14), 9, 14, 360, 30
    maxr = max(2.0, max(r["time"][n] / r["time"]["glibc"] for r in rows for n in names))
    scale = (h - top - 90) / maxr
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="10">',
           f'<text x="10" y="18" font-size="13">wall time / glibc (lower is better), median of runs</text>']
    base = h - 90
    for y in (0.5, 1.0, 1.5, 2.0):
        if y <= maxr:
            yy = base - y * scale
            out.append(f'<line x1="60" x2="{w}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#ddd"/>'
                       f'<text x="30" y="{yy + 3:.1f}">{y:.1f}</text>')
    x = 66
    for r in rows:
        for i, n in enumerate(names):
            v = r["time"][n] / r["time"]["glibc"]
            hh = min(v, maxr) * scale
            out.append(f'<rect x="{x}" y="{base - hh:.1f}" width="{bar - 1}" height="{hh:.1f}" fill="{colors[i % len(colors)]}">'
                       f'<title>{r["name"]} {n}: {v:.2f}</title></rect>')
            x += bar
        out.append(f'<text transform="translate({x - len(names) * bar / 2:.0f},{base + 8}) rotate(50)">{r["name"]}</text>')
        x += gap
    for i, n in enumerate(names):
        out.append(f'<rect x="{70 + i * 120}" y="{h - 16}" width="10" height="10" fill="{colors[i % len(colors)]}"/>'
                   f'<text x="{84 + i * 120}" y="{h - 7}">{n}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few programs, smaller inputs, one repeat")
    ap.add_argument("--hardened", action="store_true", help="also the hardened library, without and with full checks")
    ap.add_argument("--repeat", type=int, default=None, help="rounds (default 3, 1 with --quick)")
    ap.add_argument("--baseline", help="another libnumaweave.so, run in the same rounds (before / after a change)")
    ap.add_argument("--no-interleaves", action="store_true", help="leave out numaweave under interleaves")
    ap.add_argument("--only", help="comma-separated words: the programs whose row name contains one "
                    "(e.g. 'larson,new/delete' to rerun a few rows with more repeats)")
    ap.add_argument("--out", default=str(ROOT / "target/programs"))
    a = ap.parse_args()
    repeat = a.repeat or (1 if a.quick else 3)
    install()
    sh(["cargo", "build", "-q", "--release", "-p", "numaweave-capi"], cwd=ROOT)
    if a.hardened:
        sh(["cargo", "build", "-q", "--release", "--manifest-path", "capi/hardened/Cargo.toml",
            "--target-dir", "target/hardened"], cwd=ROOT)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="numaweave-programs-"))
    bins = work / "bin"
    bins.mkdir()
    for c in ("large", "threads", "xthread", "churn", "larson", "simple", "perthread", "rptest", "mleak"):
        sh(["gcc", "-O2", str(HERE / f"{c}.c"), "-o", str(bins / c), "-lpthread"])
    sh(["g++", "-O2", str(HERE / "mixed.cc"), "-o", str(bins / "mixed"), "-lpthread"])
    inputs(work, a.quick)
    interleaves = {} if a.no_interleaves else INTERLEAVES
    baseline = {"baseline": Path(a.baseline).resolve()} if a.baseline else {}
    names = list(ALLOCATORS) + list(interleaves) + (list(HARDENED) if a.hardened else []) + list(baseline)
    variants = {**interleaves, **HARDENED, **baseline}
    rows = []
    only = [w for w in a.only.split(",") if w] if a.only else None
    for name, kind, cmd in programs(work, a.quick, bins):
        if only is not None and not any(w in name for w in only):
            continue
        allocs = allocations(cmd, a.quick, work)
        # The large-block loop makes one allocation per iteration.
        want = int(cmd[1]) if name == "large blocks" else 10000
        if allocs < want:
            print(f"{name}: only {allocs} allocations reached the preloaded library: left out", flush=True)
            continue
        runs = {n: [] for n in names}
        for _ in range(repeat):
            for n in names:
                if n in ALLOCATORS:
                    env = environment(ALLOCATORS[n])
                elif n in HARDENED:
                    env = dict(environment(HARDENED_LIB), **HARDENED[n])
                elif n in baseline:
                    env = environment(baseline[n])
                else:
                    env = environment(ALLOCATORS["numaweave"], INTERLEAVES[n])
                runs[n].append(measure(cmd, env, a.quick, work))
        row = {"name": name, "kind": kind, "allocs": allocs,
               "time": {n: statistics.median(x[0] for x in runs[n]) for n in names},
               "rss": {n: statistics.median(x[1] for x in runs[n]) for n in names}}
        rows.append(row)
        t = row["time"]
        print(f"{name:14} " + " ".join(f"{n}={t[n]:.2f}s" for n in names), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    if not rows:
        sys.exit("no program measured")

    stamp = time.strftime("%Y-%m-%d")
    lines = [f"Programs under five allocators ({stamp}, {os.cpu_count()} CPUs, {repeat} round(s), medians; "
             f"interleaves: numaweave on fake:2 per-node)", "",
             "| program | allocs | " + " | ".join(names) + " | numaweave / mimalloc | / glibc | / best peer (time, RSS) |",
             "| --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: |"]
    peers = [n for n in ALLOCATORS if n != "numaweave"]
    for r in rows:
        t, m = r["time"], r["rss"]
        best_t = min(peers, key=lambda n: t[n])
        lines.append(f"| {r['name']} | {r['allocs']:,} | " + " | ".join(f"{t[n]:.2f} s, {m[n] / 1024:.0f} MiB" for n in names)
                     + f" | {t['numaweave'] / t['mimalloc']:.2f} | {t['numaweave'] / t['glibc']:.2f}"
                     + f" | {t['numaweave'] / t[best_t]:.2f} ({best_t}), {m['numaweave'] / m[best_t]:.2f} |")
    for kind in ("real", "class"):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        gt = {n: geomean([r["time"][n] / r["time"]["mimalloc"] for r in sel]) for n in names}
        gm = {n: geomean([r["rss"][n] / r["rss"]["mimalloc"] for r in sel]) for n in names}
        label = "real programs" if kind == "real" else "workload classes"
        lines.append(f"| geomean / mimalloc, {label} | | " + " | ".join(f"{gt[n]:.2f}, RSS {gm[n]:.2f}" for n in names) + " | | | |")
    # The variants of numaweave (interleaves, hardened) against it.
    il = [f"| variant / numaweave ({r['name']}) | | " + " | ".join(
        (f"{r['time'][n] / r['time']['numaweave']:.2f}, RSS {r['rss'][n] / r['rss']['numaweave']:.2f}" if n in variants else "")
        for n in names) + " | | | |" for r in rows]
    il.append("| geomean variant / numaweave | | " + " | ".join(
        (f"{geomean([r['time'][n] / r['time']['numaweave'] for r in rows]):.2f}, "
         f"RSS {geomean([r['rss'][n] / r['rss']['numaweave'] for r in rows]):.2f}" if n in variants else "")
        for n in names) + " | | | |")
    table = "\n".join(lines + (il if variants else []))
    print("\n" + table)
    (out / "programs.md").write_text(table + "\n")
    svg(rows, list(ALLOCATORS), out / "programs.svg")
    print(f"\nwritten: {out / 'programs.md'}, {out / 'programs.svg'}")


if __name__ == "__main__":
    main()

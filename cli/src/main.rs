//! `numaweave`: run any program on libnumaweave, and look at NUMA memory.
//!
//! ```text
//! numaweave run [--policy P] [--mode M] [--huge H] [--strict] [--stats] [--verbose]
//!               [--hardened [--check full] [--on-error report] [--guard]] [--lib PATH] -- PROGRAM ARGS...
//! numaweave topology [--device DEV]
//! numaweave numastat PID
//! ```
//!
//! `run` is `numactl` with interleave granularity: it preloads the
//! `libnumaweave.so` that sits beside this binary (or `--lib`), sets the
//! `NUMAWEAVE_*` variables the options stand for, and `exec`s the program
//! (so its exit status is this command's). A policy that does not parse or
//! does not fit the topology is refused before anything starts. With
//! `--hardened` the library is `libnumaweave_hardened.so` (misuse caught and
//! reported): beside this binary, or where its build puts it
//! (`target/hardened/release/` next to `target/release/`).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Arg, ArgAction, ArgMatches, Command};
use std::collections::BTreeMap;

use numaweave::Topology;
use numaweave::policy::{Policy, SizeRules};
use numaweave::slab::published;
use numaweave::stats::class_table;

fn cli() -> Command {
    Command::new("numaweave")
        .about("NUMA-aware memory for any program: libnumaweave, its policies, and where memory is")
        .subcommand_required(true)
        .arg_required_else_help(true)
        .subcommand(
            Command::new("run")
                .about("Runs PROGRAM with libnumaweave preloaded (LD_PRELOAD) and the given configuration")
                .arg(Arg::new("policy").long("policy").value_name("POLICY").help(
                    "Memory policy: local, bind:NODES, preferred:NODE, tier:lower, \
                     interleave:NODES[:count=N|:bytes=SIZE][:weights=W,...|:weights=auto], none; \
                     or rules by size: <64K:local;>=64K:interleave:0-3:bytes=2M",
                ))
                .arg(
                    Arg::new("mode")
                        .long("mode")
                        .value_name("MODE")
                        .value_parser(["auto", "flat", "per-node"])
                        .help("Arenas: auto (per-node on several nodes), flat, per-node"),
                )
                .arg(
                    Arg::new("huge")
                        .long("huge")
                        .value_name("PAGES")
                        .value_parser(["off", "thp", "hugetlb", "hugetlb-1g"])
                        .help("Huge pages for interleave regions and slabs: off, thp, hugetlb, hugetlb-1g (the nodes' reserved pools)"),
                )
                .arg(Arg::new("strict").long("strict").action(ArgAction::SetTrue).help("Never fall back to another node"))
                .arg(
                    Arg::new("stats")
                        .long("stats")
                        .action(ArgAction::SetTrue)
                        .help("Print the allocator's per-node statistics at exit"),
                )
                .arg(
                    Arg::new("verbose")
                        .long("verbose")
                        .short('v')
                        .action(ArgAction::SetTrue)
                        .help("Print the configuration and topology at start"),
                )
                .arg(
                    Arg::new("hardened")
                        .long("hardened")
                        .action(ArgAction::SetTrue)
                        .help("Preload libnumaweave_hardened.so: double, foreign and interior frees reported"),
                )
                .arg(
                    Arg::new("check")
                        .long("check")
                        .value_name("LEVEL")
                        .value_parser(["default", "full"])
                        .requires("hardened")
                        .help("full: red zones (overflows) and poison (writes after free) too"),
                )
                .arg(
                    Arg::new("on-error")
                        .long("on-error")
                        .value_name("ACTION")
                        .value_parser(["abort", "report"])
                        .requires("hardened")
                        .help("On a misuse: abort (default), or report, leak the block and go on"),
                )
                .arg(
                    Arg::new("guard")
                        .long("guard")
                        .action(ArgAction::SetTrue)
                        .requires("hardened")
                        .help("A page no access is allowed to after every segment and huge mapping"),
                )
                .arg(
                    Arg::new("lib")
                        .long("lib")
                        .value_name("PATH")
                        .value_parser(clap::value_parser!(PathBuf))
                        .help("The library to preload (default: libnumaweave.so beside this binary)"),
                )
                .arg(
                    Arg::new("command")
                        .value_name("PROGRAM")
                        .required(true)
                        .num_args(1..)
                        .trailing_var_arg(true)
                        .allow_hyphen_values(true)
                        .value_parser(clap::value_parser!(OsString)),
                ),
        )
        .subcommand(
            Command::new("topology").about("Prints the NUMA topology").arg(
                Arg::new("device")
                    .long("device")
                    .value_name("DEV")
                    .help("Also the node of a device: PCI id, block device or network interface"),
            ),
        )
        .subcommand(
            Command::new("numastat").about(
                "A running process's memory per node (from /proc/PID/numa_maps), and its slab caches' per cache and node",
            ).arg(
                Arg::new("pid").value_name("PID").required(true).value_parser(clap::value_parser!(u32)),
            ),
        )
}

fn main() -> ExitCode {
    let m = cli().get_matches();
    match m.subcommand() {
        Some(("run", m)) => run(m),
        Some(("topology", m)) => topology(m),
        Some(("numastat", m)) => numastat(*m.get_one::<u32>("pid").unwrap()),
        _ => unreachable!("a subcommand is required"),
    }
}

fn fail(msg: std::fmt::Arguments<'_>) -> ExitCode {
    eprintln!("numaweave: {msg}");
    ExitCode::from(2)
}

fn run(m: &ArgMatches) -> ExitCode {
    let mut vars: Vec<(&str, String)> = Vec::new();
    if let Some(p) = m.get_one::<String>("policy") {
        let p = p.trim();
        if p != "none" {
            // One policy, or rules by size (as NUMAWEAVE_POLICY tells them).
            let checked = if SizeRules::is_rules_text(p) {
                p.parse::<SizeRules>().and_then(|r| r.validate(Topology::global()))
            } else {
                // The topology the program will see (NUMAWEAVE_TOPOLOGY passes on).
                p.parse::<Policy>().and_then(|policy| policy.validate(Topology::global()))
            };
            if let Err(e) = checked {
                return fail(format_args!("--policy {p}: {e}"));
            }
        }
        vars.push(("NUMAWEAVE_POLICY", p.to_string()));
    }
    if let Some(mode) = m.get_one::<String>("mode") {
        vars.push(("NUMAWEAVE_MODE", mode.clone()));
    }
    if let Some(huge) = m.get_one::<String>("huge") {
        vars.push(("NUMAWEAVE_HUGE", huge.clone()));
    }
    for (flag, var) in
        [("strict", "NUMAWEAVE_STRICT"), ("stats", "NUMAWEAVE_SHOW_STATS"), ("verbose", "NUMAWEAVE_VERBOSE")]
    {
        if m.get_flag(flag) {
            vars.push((var, "1".to_string()));
        }
    }
    let hardened = m.get_flag("hardened");
    if hardened {
        for (opt, var) in [("check", "NUMAWEAVE_CHECK"), ("on-error", "NUMAWEAVE_ON_ERROR")] {
            if let Some(v) = m.get_one::<String>(opt) {
                vars.push((var, v.clone()));
            }
        }
        if m.get_flag("guard") {
            vars.push(("NUMAWEAVE_GUARD", "1".to_string()));
        }
    }
    let lib = match m.get_one::<PathBuf>("lib") {
        Some(l) => l.clone(),
        None => match std::env::current_exe() {
            Ok(exe) if hardened => {
                let beside = exe.with_file_name("libnumaweave_hardened.so");
                // target/release/numaweave -> target/hardened/release/
                let built = exe.parent().and_then(|d| Some(d.parent()?.join("hardened").join(d.file_name()?)));
                match built.map(|d| d.join("libnumaweave_hardened.so")) {
                    Some(b) if !beside.is_file() && b.is_file() => b,
                    _ => beside,
                }
            }
            Ok(exe) => exe.with_file_name("libnumaweave.so"),
            Err(e) => return fail(format_args!("cannot find this binary's directory: {e}")),
        },
    };
    if !lib.is_file() {
        let how = if hardened {
            "cargo build --release --manifest-path capi/hardened/Cargo.toml --target-dir target/hardened"
        } else {
            "cargo build --release"
        };
        return fail(format_args!("{} not found (build it with `{how}`, or give --lib)", lib.display()));
    }
    let lib = std::fs::canonicalize(&lib).unwrap_or(lib);
    let mut preload = lib.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preload.push(":");
        preload.push(old);
    }
    let mut cmd = m.get_many::<OsString>("command").unwrap();
    let program = cmd.next().unwrap();
    let err = std::process::Command::new(program).args(cmd).envs(vars).env("LD_PRELOAD", preload).exec();
    eprintln!("numaweave: {}: {err}", program.to_string_lossy());
    ExitCode::from(if err.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 })
}

fn topology(m: &ArgMatches) -> ExitCode {
    let t = Topology::global();
    print!("{t}");
    if let Some(dev) = m.get_one::<String>("device") {
        match t.device_node(dev) {
            Ok(Some(n)) => println!("{dev}: node {n}"),
            Ok(None) => println!("{dev}: no node (NUMA_NO_NODE)"),
            Err(e) => return fail(format_args!("{e}")),
        }
    }
    ExitCode::SUCCESS
}

/// Per-node bytes of one process by kind of memory, like `numastat -p`.
#[derive(Default)]
struct Usage {
    nodes: std::collections::BTreeMap<usize, [u64; 6]>,
}

const KINDS: [&str; 6] = ["Huge", "Heap", "Stack", "Anonymous", "File", "numaweave"];

impl Usage {
    /// Adds one line of `/proc/PID/numa_maps`.
    fn add_line(&mut self, line: &str) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let page: u64 = words
            .iter()
            .find_map(|w| w.strip_prefix("kernelpagesize_kB="))
            .and_then(|v| v.parse().ok())
            .map_or(4096, |kb: u64| kb * 1024);
        // The allocator's own mappings (`numaweave::alloc::NEAR_RANGE`), of
        // any kind: what libnumaweave holds, resident, per node.
        let start = words.first().and_then(|a| usize::from_str_radix(a, 16).ok());
        let kind = if start.is_some_and(|a| numaweave::alloc::NEAR_RANGE.contains(&a)) {
            5
        } else if words.contains(&"huge") {
            0
        } else if words.contains(&"heap") {
            1
        } else if words.contains(&"stack") {
            2
        } else if words.iter().any(|w| w.starts_with("file=")) {
            4
        } else {
            3
        };
        for w in &words {
            if let Some((n, pages)) = w.strip_prefix('N').and_then(|r| r.split_once('='))
                && let (Ok(n), Ok(pages)) = (n.parse::<usize>(), pages.parse::<u64>())
            {
                self.nodes.entry(n).or_default()[kind] += pages * page;
            }
        }
    }
}

fn numastat(pid: u32) -> ExitCode {
    let maps = match std::fs::read_to_string(format!("/proc/{pid}/numa_maps")) {
        Ok(s) => s,
        Err(e) => return fail(format_args!("/proc/{pid}/numa_maps: {e}")),
    };
    let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    let mut u = Usage::default();
    maps.lines().for_each(|l| u.add_line(l));
    if u.nodes.is_empty() {
        u.nodes.insert(0, [0; 6]);
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!("\nPer-node process memory usage (in MiB) for PID {pid} ({})", name.trim());
    let mut head = format!("{:<16}", "");
    let mut rule = format!("{:<16}", "");
    for n in u.nodes.keys() {
        head.push_str(&format!(" {:>15}", format!("Node {n}")));
        rule.push_str(&format!(" {:>15}", "---------------"));
    }
    println!("{head} {:>15}\n{rule} {:>15}", "Total", "---------------");
    let mut totals = vec![0u64; u.nodes.len()];
    for (k, kind) in KINDS.iter().enumerate() {
        let mut row = format!("{kind:<16}");
        let mut sum = 0;
        for (i, v) in u.nodes.values().enumerate() {
            row.push_str(&format!(" {:>15.2}", mib(v[k])));
            sum += v[k];
            totals[i] += v[k];
        }
        println!("{row} {:>15.2}", mib(sum));
    }
    println!("{rule} {:>15}", "---------------");
    let mut row = format!("{:<16}", "Total");
    for t in &totals {
        row.push_str(&format!(" {:>15.2}", mib(*t)));
    }
    println!("{row} {:>15.2}", mib(totals.iter().sum()));
    caches(pid);
    classes(pid);
    ExitCode::SUCCESS
}

/// A table the process publishes in a memory file named `name` (the slab
/// layer's chunks, the allocator's classes), found among its open files:
/// the first that `read` takes and whose `pid_of` says it is this
/// process's (a forked child may still hold its parent's). A file that is
/// not a table (another process wrote it; nothing of it is trusted) is
/// reported and skipped.
fn published_file<T, E: std::fmt::Display>(
    pid: u32,
    name: &str,
    read: impl Fn(&std::path::Path) -> Result<T, E>,
    pid_of: impl Fn(&T) -> u32,
) -> std::io::Result<Option<T>> {
    let wanted = format!("/memfd:{name}");
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))?.flatten() {
        if !std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with(&wanted)) {
            continue;
        }
        match read(&e.path()) {
            Ok(t) if pid_of(&t) == pid => return Ok(Some(t)),
            Ok(_) => {}
            Err(err) => eprintln!("numaweave: {}: {err}", e.path().display()),
        }
    }
    Ok(None)
}

/// One cache's pages: bytes on each kernel node, and of those, bytes on
/// another node than the one their chunk is bound to.
#[derive(Default)]
struct CacheRow {
    by_node: BTreeMap<usize, u64>,
    off_node: u64,
}

/// Per cache, the bytes of its pages on each kernel node, asked of the
/// kernel page by page (`move_pages` of the process, a query), a bounded
/// batch at a time: a chunk's length is the other process's word
/// (`published::parse` bounds it, and nothing here grows with it).
fn cache_usage(pid: u32, t: &published::Table) -> BTreeMap<String, CacheRow> {
    const BATCH: usize = 1024;
    let mut by: BTreeMap<String, CacheRow> = BTreeMap::new();
    let (mut addrs, mut st) = ([core::ptr::null::<u8>(); BATCH], [0i32; BATCH]);
    for c in &t.chunks {
        let page = c.page_size();
        let row = by.entry(c.name().to_owned()).or_default();
        let mut pages = (c.start..c.start.saturating_add(c.len)).step_by(page);
        loop {
            let mut n = 0;
            for (slot, a) in addrs.iter_mut().zip(pages.by_ref()) {
                *slot = a as *const u8;
                n += 1;
            }
            if n == 0 || numaweave::os::pages::page_nodes_of(pid as i32, &addrs[..n], &mut st[..n]).is_err() {
                break;
            }
            for &s in &st[..n] {
                if let Ok(node) = usize::try_from(s) {
                    *row.by_node.entry(node).or_default() += page as u64;
                    if c.node().is_some_and(|bound| bound != node) {
                        row.off_node += page as u64;
                    }
                }
            }
        }
    }
    by
}

fn caches(pid: u32) {
    let Ok(Some(t)) = published_file(pid, published::FILE_NAME, published::read_file, |t| t.pid) else { return };
    let by = cache_usage(pid, &t);
    let nodes: std::collections::BTreeSet<usize> = by.values().flat_map(|r| r.by_node.keys().copied()).collect();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!("\nPer-cache slab memory (in MiB) for PID {pid}, where its pages are");
    let mut head = format!("{:<16}", "Cache");
    for n in &nodes {
        head.push_str(&format!(" {:>15}", format!("Node {n}")));
    }
    // "Off its node": pages on another node than their chunk is bound to
    // (a full node's fallback, or pins the kernel moved off a movable node).
    println!("{head} {:>15} {:>15}", "Total", "Off its node");
    for (name, row) in &by {
        let mut line = format!("{name:<16}");
        for n in &nodes {
            line.push_str(&format!(" {:>15.2}", mib(row.by_node.get(n).copied().unwrap_or(0))));
        }
        println!("{line} {:>15.2} {:>15.2}", mib(row.by_node.values().sum()), mib(row.off_node));
    }
    if t.unlisted > 0 {
        println!("({} chunks not listed: the process's table was full)", t.unlisted);
    }
}

/// The size classes' pages per node, as the process last published them:
/// what each class spans, holds in use, waits to collect, and strands
/// (free blocks only that class can use until its pages empty).
fn classes(pid: u32) {
    let t = match published_file(pid, class_table::FILE_NAME, class_table::read_file, |t| t.pid) {
        Ok(Some(t)) => t,
        Ok(None) => {
            // (A forked child shows none until its first publication.)
            println!("\n(no size-class table: start the program with NUMAWEAVE_PUBLISH=1 to see one)");
            return;
        }
        Err(e) => {
            println!("\n(no size-class table: /proc/{pid}/fd: {e})");
            return;
        }
    };
    let age = numaweave::os::monotonic_ms().saturating_sub(t.published_ms);
    let kib = |b: u64| b as f64 / 1024.0;
    println!("\nSize classes (in KiB) for PID {pid}, published {age} ms ago (at most every {} ms)", t.period_ms);
    let line =
        |node: &dyn std::fmt::Display, block: &dyn std::fmt::Display, pages: &dyn std::fmt::Display, b: [f64; 4]| {
            println!("{node:>4} {block:>10} {pages:>8} {:>12.1} {:>12.1} {:>12.1} {:>12.1}", b[0], b[1], b[2], b[3]);
        };
    println!(
        "{:>4} {:>10} {:>8} {:>12} {:>12} {:>12} {:>12}",
        "Node", "Block", "Pages", "Spanned", "In use", "Uncollected", "Stranded"
    );
    let mut rows = t.rows;
    rows.sort_by_key(|r| (r.node, r.usage.block_size));
    let (mut pages, mut sum) = (0, [0u64; 4]);
    for r in &rows {
        let u = &r.usage;
        let b = [u.bytes, u.in_use, u.uncollected, u.stranded];
        line(&r.node, &u.block_size, &u.pages, b.map(kib));
        pages += u.pages;
        for (s, v) in sum.iter_mut().zip(b) {
            *s += v;
        }
    }
    line(&"", &"Total", &pages, sum.map(kib));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_maps_lines_add_up_by_node_and_kind() {
        let mut u = Usage::default();
        u.add_line("55d1c0000000 default heap anon=3 dirty=3 N0=2 N1=1 kernelpagesize_kB=4");
        u.add_line("7ffd0000 default stack anon=1 dirty=1 N1=1 kernelpagesize_kB=4");
        u.add_line("7f000000 default file=/usr/lib/libc.so.6 mapped=5 N0=5 kernelpagesize_kB=4");
        u.add_line("7e000000 bind:1 anon=512 dirty=512 N1=512 kernelpagesize_kB=4");
        u.add_line(
            "7d000000 default file=/anon_hugepage\\040(deleted) huge anon=1 dirty=1 N0=1 kernelpagesize_kB=2048",
        );
        u.add_line("13b00000000 bind:1 anon=64 dirty=64 N1=64 kernelpagesize_kB=4");
        assert_eq!(u.nodes[&0], [2 << 20, 8192, 0, 0, 5 * 4096, 0]);
        assert_eq!(u.nodes[&1], [0, 4096, 4096, 512 * 4096, 0, 64 * 4096]);
    }

    #[test]
    fn the_command_line_is_well_formed() {
        cli().debug_assert();
        let m = cli().try_get_matches_from(["numaweave", "run", "--policy", "local", "--", "ls", "-l"]).unwrap();
        let (_, r) = m.subcommand().unwrap();
        let cmd: Vec<_> = r.get_many::<OsString>("command").unwrap().collect();
        assert_eq!(cmd, ["ls", "-l"]);
        let m = cli().try_get_matches_from(["numaweave", "run", "--huge", "hugetlb", "--", "ls"]).unwrap();
        assert_eq!(m.subcommand().unwrap().1.get_one::<String>("huge").map(String::as_str), Some("hugetlb"));
        assert!(cli().try_get_matches_from(["numaweave", "run", "--huge", "1G", "--", "ls"]).is_err());
    }
}

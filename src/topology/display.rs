//! A readable table of a topology (`{}`), saying clearly when it is synthetic.

use core::fmt;

use super::{NodeSet, Source, Topology};

/// `bytes` as a short binary figure: `512.0 MiB`, `15.6 GiB`.
pub(crate) fn human_bytes(bytes: u64) -> impl fmt::Display {
    struct H(u64);
    impl fmt::Display for H {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
            let mut v = self.0 as f64;
            let mut u = 0;
            while v >= 1024.0 && u + 1 < UNITS.len() {
                v /= 1024.0;
                u += 1;
            }
            let s = if u == 0 { format!("{} B", self.0) } else { format!("{v:.1} {}", UNITS[u]) };
            f.pad(&s)
        }
    }
    H(bytes)
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.source {
            Source::Synthetic { physical_nodes, fake } => writeln!(
                f,
                "SYNTHETIC NUMA topology ({} over {physical_nodes} real memory node{}): not this machine's real layout",
                match fake {
                    false => "builder".to_string(),
                    true if self.online == NodeSet::first_n(self.node_count()) => format!("fake:{}", self.node_count()),
                    true => format!("fake:{}", self.online),
                },
                if physical_nodes == 1 { "" } else { "s" },
            )?,
            Source::Hwloc { synthetic: true } => {
                writeln!(f, "SYNTHETIC NUMA topology (hwloc synthetic description): not this machine's real layout")?
            }
            Source::Hwloc { synthetic: false } => writeln!(f, "NUMA topology (from hwloc)")?,
            Source::Sysfs => writeln!(f, "NUMA topology (from sysfs)")?,
            Source::NoNuma => writeln!(f, "NUMA topology: kernel without NUMA support, one node assumed")?,
        }
        writeln!(
            f,
            "{} node{} online ({} with CPUs, {} memory-only); this process may use node{} {}",
            self.node_count(),
            if self.node_count() == 1 { "" } else { "s" },
            self.with_cpus.len(),
            self.memory_only_nodes().len(),
            if self.allowed.len() == 1 { "" } else { "s" },
            self.allowed,
        )?;
        if self.ignored_nodes > 0 || self.ignored_cpus > 0 {
            writeln!(
                f,
                "left out: {} node(s) at or beyond id {}, {} CPU(s) beyond id {} or on such nodes",
                self.ignored_nodes,
                super::MAX_NODES,
                self.ignored_cpus,
                super::MAX_CPUS
            )?;
        }
        let synthetic = self.is_synthetic();
        let mut head = format!("{:>4}  {:<11}  {:<16}  {:>10}", "node", "kind", "cpus", "memory");
        if synthetic {
            head.push_str("  real");
        }
        head.push_str("  distances to");
        for m in self.online.iter() {
            head.push_str(&format!(" {m:>3}"));
        }
        writeln!(f, "{head}")?;
        for n in self.online.iter() {
            let kind = match (self.with_cpus.contains(n), self.with_memory.contains(n)) {
                (true, true) => "cpu+memory",
                (true, false) => "cpu only",
                (false, true) => "memory-only",
                (false, false) => "empty",
            };
            let cpus = self.cpus_of(n).to_string();
            let cpus = if cpus.is_empty() { "-".to_string() } else { cpus };
            let mark = if self.allowed.contains(n) { ' ' } else { '!' };
            write!(f, "{n:>3}{mark}  {kind:<11}  {cpus:<16}  {:>10}", human_bytes(self.memory_of(n)))?;
            if synthetic {
                write!(f, "  {:>4}", self.physical_node(n))?;
            }
            write!(f, "  {:13}", "")?;
            for m in self.online.iter() {
                write!(f, " {:>3}", self.distance(n, m))?;
            }
            writeln!(f)?;
        }
        if self.allowed != self.with_memory {
            writeln!(f, "(! = this process may not allocate there: Mems_allowed)")?;
        }
        self.write_perf(f)?;
        // Huge pages are the real nodes' (a synthetic topology's nodes share
        // theirs): one line per real node that has pools.
        let mut shown = crate::sets::NodeSet::new();
        for n in self.online.iter() {
            let phys = self.physical_node(n);
            let Ok(pools) = self.huge_pages(n) else { continue };
            if shown.contains(phys) || pools.iter().count() == 0 {
                continue;
            }
            shown.insert(phys);
            write!(f, "huge pages on {}node {phys}:", if synthetic { "real " } else { "" })?;
            for p in pools.iter() {
                write!(f, "  {}: {} free of {}", human_bytes(p.page_size as u64), p.free, p.total)?;
                if p.surplus > 0 {
                    write!(f, " (+{} surplus)", p.surplus)?;
                }
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

impl fmt::Debug for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Topology")
            .field("source", &self.source)
            .field("online", &self.online)
            .field("with_cpus", &self.with_cpus)
            .field("with_memory", &self.with_memory)
            .field("allowed", &self.allowed)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_tables_say_so() {
        let t = Topology::synthetic(2).cpus_per_node(2).memory_only_nodes(1).build().unwrap();
        let s = t.to_string();
        assert!(s.starts_with("SYNTHETIC"), "{s}");
        assert!(s.contains("memory-only"), "{s}");
        assert!(s.contains(" 10  20  30"), "{s}");
        let real = Topology::detect().unwrap().to_string();
        assert!(!real.contains("SYNTHETIC"), "{real}");
    }

    #[test]
    fn bytes_are_human() {
        assert_eq!(human_bytes(512).to_string(), "512 B");
        assert_eq!(human_bytes(512 << 20).to_string(), "512.0 MiB");
        assert_eq!(human_bytes(3 << 29).to_string(), "1.5 GiB");
    }
}

//! Fixed-size bit sets of node and CPU ids, parsed from and printed as the
//! kernel's list format (`0-3,8,10-11`).
//!
//! A leaf module: the OS layer takes node sets (`mbind` masks) and the
//! topology builds them, so neither may own them.

use core::fmt;

use crate::error::{Error, Result};

/// Largest node id + 1 that the crate represents. Fits one `u64` node mask,
/// the form `mbind` takes.
pub const MAX_NODES: usize = 64;

/// Largest CPU id + 1 that the crate represents.
pub const MAX_CPUS: usize = 1024;

/// A set of small ids held in `WORDS` 64-bit words, with no heap storage.
/// Use it through [`NodeSet`] and [`CpuSet`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdSet<const WORDS: usize> {
    words: [u64; WORDS],
}

/// A set of NUMA node ids below [`MAX_NODES`].
///
/// ```
/// use numaweave::topology::NodeSet;
/// let s: NodeSet = "0-2,5".parse().unwrap();
/// assert_eq!(s.len(), 4);
/// assert!(s.contains(5) && !s.contains(3));
/// assert_eq!(s.to_string(), "0-2,5");
/// ```
pub type NodeSet = IdSet<1>;

/// A set of CPU ids below [`MAX_CPUS`].
pub type CpuSet = IdSet<{ MAX_CPUS / 64 }>;

impl<const W: usize> IdSet<W> {
    /// The largest id the set can hold, plus one.
    pub const CAPACITY: usize = W * 64;

    /// The empty set.
    pub const fn new() -> Self {
        Self { words: [0; W] }
    }

    /// `{0, 1, …, n-1}` (capped at the capacity).
    pub fn first_n(n: usize) -> Self {
        let mut s = Self::new();
        for i in 0..n.min(Self::CAPACITY) {
            s.insert(i);
        }
        s
    }

    /// Adds `id`; returns false (and does nothing) when it is beyond the capacity.
    #[inline]
    pub fn insert(&mut self, id: usize) -> bool {
        if id >= Self::CAPACITY {
            return false;
        }
        self.words[id / 64] |= 1 << (id % 64);
        true
    }

    /// Removes `id`.
    #[inline]
    pub fn remove(&mut self, id: usize) {
        if id < Self::CAPACITY {
            self.words[id / 64] &= !(1 << (id % 64));
        }
    }

    /// Whether `id` is in the set.
    #[inline]
    pub const fn contains(&self, id: usize) -> bool {
        id < Self::CAPACITY && self.words[id / 64] & (1 << (id % 64)) != 0
    }

    /// Number of ids in the set.
    pub fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The smallest id, if any.
    pub fn first(&self) -> Option<usize> {
        self.iter().next()
    }

    /// The largest id, if any.
    pub fn last(&self) -> Option<usize> {
        (0..W).rev().find(|&i| self.words[i] != 0).map(|i| i * 64 + 63 - self.words[i].leading_zeros() as usize)
    }

    /// Ids in both sets.
    #[must_use]
    pub fn intersection(&self, other: &Self) -> Self {
        let mut s = *self;
        for (a, b) in s.words.iter_mut().zip(other.words.iter()) {
            *a &= *b;
        }
        s
    }

    /// Ids in either set.
    #[must_use]
    pub fn union(&self, other: &Self) -> Self {
        let mut s = *self;
        for (a, b) in s.words.iter_mut().zip(other.words.iter()) {
            *a |= *b;
        }
        s
    }

    /// Ids in `self` but not in `other`.
    #[must_use]
    pub fn difference(&self, other: &Self) -> Self {
        let mut s = *self;
        for (a, b) in s.words.iter_mut().zip(other.words.iter()) {
            *a &= !*b;
        }
        s
    }

    /// Whether every id of `self` is in `other`.
    pub fn is_subset(&self, other: &Self) -> bool {
        self.difference(other).is_empty()
    }

    /// The ids in ascending order.
    pub fn iter(&self) -> Iter<'_, W> {
        Iter { set: self, next: 0 }
    }

    /// Parses the kernel's list format (`"0-3,8,10-11"`, empty for the empty
    /// set). Ids at or beyond the capacity are not stored; their count is
    /// returned beside the set, so callers can say what they dropped.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub fn parse_list(s: &str) -> Result<(Self, usize)> {
        let mut set = Self::new();
        let mut dropped = 0;
        let cap = Self::CAPACITY;
        for range in Ranges::new(s) {
            let (a, b) = range?;
            for id in a..=b.min(cap - 1) {
                set.insert(id);
            }
            // Counted, not walked: a list may name ids up to `usize::MAX`.
            if b >= cap {
                dropped = (b - a.max(cap)).saturating_add(1).saturating_add(dropped);
            }
        }
        Ok((set, dropped))
    }
}

/// The ranges of a kernel list (`"0-3,8"`: 0 to 3, then 8 to 8), each
/// `Err` if malformed. Bytes, not `str::split`/`trim`/`parse`: this runs
/// inside the allocator's start-up, which keeps off core's out-of-line
/// string code (see `os::file::PathBuf::push`); and one copy serves every
/// set width.
struct Ranges<'a> {
    /// What is left of the list; `None` once it is used up.
    rest: Option<&'a [u8]>,
}

impl<'a> Ranges<'a> {
    fn new(s: &'a str) -> Self {
        let s = s.as_bytes().trim_ascii();
        Self { rest: (!s.is_empty()).then_some(s) }
    }
}

impl Iterator for Ranges<'_> {
    type Item = Result<(usize, usize)>;

    #[unsafe(link_section = ".text.sorted.numaweave")]
    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.rest?;
        let part = match rest.iter().position(|&b| b == b',') {
            Some(i) => {
                self.rest = Some(&rest[i + 1..]);
                &rest[..i]
            }
            None => {
                self.rest = None;
                rest
            }
        };
        let (a, b) = match part.iter().position(|&b| b == b'-') {
            Some(i) => (parse_id(&part[..i]), parse_id(&part[i + 1..])),
            None => (parse_id(part), parse_id(part)),
        };
        Some(match (a, b) {
            (Some(a), Some(b)) if a <= b => Ok((a, b)),
            _ => {
                self.rest = None;
                Err(Error::InvalidTopology { reason: "malformed id list (want e.g. 0-3,8)" })
            }
        })
    }
}

/// A decimal id with blanks around it, as the kernel's lists write them;
/// `None` for anything else or a figure too large for a word. Also the
/// figure parser of the rest of start-up's sysfs reading (meminfo,
/// distances), which must keep off `core::str`'s parsers.
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) fn parse_id(b: &[u8]) -> Option<usize> {
    let b = b.trim_ascii();
    if b.is_empty() {
        return None;
    }
    b.iter().try_fold(0usize, |v, &d| {
        if !d.is_ascii_digit() {
            return None;
        }
        v.checked_mul(10)?.checked_add(usize::from(d - b'0'))
    })
}

impl IdSet<1> {
    /// The set as a bit mask (bit `i` = node `i`), the form `mbind` takes.
    pub const fn bits(&self) -> u64 {
        self.words[0]
    }

    /// The set of the bits of `mask`.
    pub const fn from_bits(mask: u64) -> Self {
        Self { words: [mask] }
    }

    /// `{id}`.
    pub const fn single(id: usize) -> Self {
        if id < 64 { Self::from_bits(1 << id) } else { Self::new() }
    }
}

impl<const W: usize> Default for IdSet<W> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const W: usize> FromIterator<usize> for IdSet<W> {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Self {
        let mut s = Self::new();
        for i in iter {
            s.insert(i);
        }
        s
    }
}

impl<const W: usize> core::str::FromStr for IdSet<W> {
    type Err = Error;
    /// Parses the list format; ids beyond the capacity are an error here.
    fn from_str(s: &str) -> Result<Self> {
        match Self::parse_list(s)? {
            (set, 0) => Ok(set),
            _ => Err(Error::InvalidTopology { reason: "id beyond the set's capacity" }),
        }
    }
}

/// Iterator over an [`IdSet`]'s ids in ascending order.
pub struct Iter<'a, const W: usize> {
    set: &'a IdSet<W>,
    next: usize,
}

impl<const W: usize> Iterator for Iter<'_, W> {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        while self.next < IdSet::<W>::CAPACITY {
            let w = self.set.words[self.next / 64] >> (self.next % 64);
            if w == 0 {
                self.next = (self.next / 64 + 1) * 64;
                continue;
            }
            let id = self.next + w.trailing_zeros() as usize;
            self.next = id + 1;
            return Some(id);
        }
        None
    }
}

impl<'a, const W: usize> IntoIterator for &'a IdSet<W> {
    type Item = usize;
    type IntoIter = Iter<'a, W>;
    fn into_iter(self) -> Iter<'a, W> {
        self.iter()
    }
}

impl<const W: usize> fmt::Display for IdSet<W> {
    /// The kernel's list format; the empty set prints as nothing, as in sysfs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut it = self.iter().peekable();
        let mut first = true;
        while let Some(a) = it.next() {
            let mut b = a;
            while it.peek() == Some(&(b + 1)) {
                b = it.next().unwrap_or(b);
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if a == b { write!(f, "{a}")? } else { write!(f, "{a}-{b}")? }
        }
        Ok(())
    }
}

impl<const W: usize> fmt::Debug for IdSet<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{{{self}}}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_round_trip() {
        for s in ["", "0", "0-3", "0-2,5,7-9", "63"] {
            let set: NodeSet = s.parse().unwrap();
            assert_eq!(set.to_string(), s);
        }
        let c: CpuSet = "0-1023".parse().unwrap();
        assert_eq!(c.len(), 1024);
        assert_eq!(c.last(), Some(1023));
    }

    #[test]
    fn overflow_is_counted_not_stored() {
        let (s, dropped) = NodeSet::parse_list("62-65").unwrap();
        assert_eq!(s.to_string(), "62-63");
        assert_eq!(dropped, 2);
        let (s, dropped) = NodeSet::parse_list(" 1, 70-71 ,0-18446744073709551615\n").unwrap();
        assert_eq!((s.len(), dropped), (64, 2 + (usize::MAX - 63)));
        assert!("64".parse::<NodeSet>().is_err());
    }

    #[test]
    fn malformed_lists_are_rejected() {
        for s in ["a", "3-1", "1-", ",", "1,,2", "-1"] {
            assert!(NodeSet::parse_list(s).is_err(), "{s:?} accepted");
        }
    }

    #[test]
    fn set_algebra() {
        let a: NodeSet = "0-3".parse().unwrap();
        let b: NodeSet = "2-5".parse().unwrap();
        assert_eq!(a.intersection(&b).to_string(), "2-3");
        assert_eq!(a.union(&b).to_string(), "0-5");
        assert_eq!(a.difference(&b).to_string(), "0-1");
        assert!(a.intersection(&b).is_subset(&a));
        assert_eq!(a.bits(), 0b1111);
        assert_eq!(NodeSet::single(64), NodeSet::new());
    }
}

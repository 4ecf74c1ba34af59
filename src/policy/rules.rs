//! Rules by size: a process default that routes blocks to a policy by their
//! size ([`SizeRules`]).

use core::fmt;

use super::Policy;
use crate::error::{Error, Result};
use crate::topology::Topology;

/// Most rules in a [`SizeRules`].
pub const MAX_RULES: usize = 4;

/// Rules by size: the process default, which routes blocks to a policy by
/// their size (one policy for every size is its one-rule case,
/// [`single`](Self::single)), so an unmodified program keeps its small objects local and spreads
/// its big buffers over DRAM and CXL (`NUMAWEAVE_POLICY`, `numaweave run
/// --policy`, [`Config::policy_rules`](crate::Config::policy_rules)).
///
/// ```text
/// local
/// <64K:local;>=64K:interleave:0-3:bytes=2M:weights=auto
/// <4K:local;<1M:tier:lower;>=1M:interleave:0-1:bytes=2M
/// ```
///
/// One policy's text (`local`, `bind:1`) is the one rule for every size.
/// Rules are separated by `;`, in ascending order of size, each a bound and a
/// policy: `<B` takes the sizes from the previous rule's bound up to `B`,
/// `>=B` every size from `B` on (it is the last rule, and `B` is the
/// previous rule's bound). Every size is covered exactly once. At most
/// [`MAX_RULES`] rules, at most one of them an interleave.
///
/// A bound is compared with the size a block really has: its size class (the
/// size a request is rounded up to, what `malloc_usable_size` says) up to
/// 256 KiB, the request itself above. So with `<64K`, a request of 65,000
/// bytes (a 64 KiB block) goes with `>=64K`. Under the interleave rule,
/// blocks of a page and more follow the cursor block by block, exact turns,
/// a turn's blocks back to back on its node, as I/O buffers do under a
/// whole-program interleave; smaller ones (a rule such as `>=1K`) page by
/// page. Blocks free without a size, as C frees them, exactly as under any
/// policy: a block's size is its page's or its region's.
///
/// ```
/// use numaweave::policy::{Policy, SizeRules};
/// let r: SizeRules = "<64K:local;>=64K:interleave:0-1:bytes=2M:weights=auto".parse().unwrap();
/// assert_eq!(r.policy_for(4096), Policy::Local);
/// assert!(matches!(r.policy_for(1 << 20), Policy::Interleave(_)));
/// assert_eq!(r.to_string(), "<64K:local;>=64K:interleave:0-1:bytes=2097152:weights=auto");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeRules {
    len: u8,
    /// Rule k takes sizes from `from[k]` (0 for the first) to `from[k + 1]`
    /// (to the end for the last).
    from: [usize; MAX_RULES],
    policy: [Policy; MAX_RULES],
}

impl SizeRules {
    /// No rules: not a valid default by itself ([`push`](Self::push) adds).
    pub const fn new() -> Self {
        Self { len: 0, from: [0; MAX_RULES], policy: [Policy::Local; MAX_RULES] }
    }

    /// One policy for every size: the one-rule case, what
    /// [`Config::policy`](crate::Config::policy) sets.
    ///
    /// ```
    /// use numaweave::policy::{Policy, SizeRules};
    /// let r = SizeRules::single(Policy::Preferred(0));
    /// assert_eq!(r.policy_for(1 << 30), Policy::Preferred(0));
    /// assert_eq!(r.as_single(), Some(Policy::Preferred(0)));
    /// assert_eq!(r.to_string().parse::<SizeRules>().unwrap(), r);
    /// ```
    pub const fn single(policy: Policy) -> Self {
        let mut r = Self::new();
        r.len = 1;
        r.policy[0] = policy;
        r
    }

    /// The policy of every size, when there is one rule.
    #[inline]
    pub fn as_single(&self) -> Option<Policy> {
        (self.len == 1).then_some(self.policy[0])
    }

    /// Whether `text` is in the rules' text form (a `;` or a leading `<` or
    /// `>`) rather than one policy's: how `NUMAWEAVE_POLICY` and
    /// `numaweave run --policy` tell the two apart.
    ///
    /// ```
    /// use numaweave::policy::SizeRules;
    /// assert!(SizeRules::is_rules_text(" <64K:local;>=64K:bind:0"));
    /// assert!(!SizeRules::is_rules_text("interleave:0-1:bytes=2M"));
    /// ```
    pub fn is_rules_text(text: &str) -> bool {
        text.contains(';') || text.trim_start().starts_with(['<', '>'])
    }

    /// Adds a rule for sizes from `from` on (up to the next rule's bound):
    /// the first rule's `from` is 0, each next one's above the one before.
    pub fn push(mut self, from: usize, policy: Policy) -> Result<Self> {
        let bad = |reason| Err(Error::InvalidPolicy { reason });
        let n = usize::from(self.len);
        if n == MAX_RULES {
            return bad("more than four size rules");
        }
        if n == 0 && from != 0 {
            return bad("the first size rule starts at 0 (<B)");
        }
        if n > 0 && from <= self.from[n - 1] {
            return bad("size rules in ascending order of size, without overlaps");
        }
        if matches!(policy, Policy::Interleave(_))
            && self.policy[..n].iter().any(|p| matches!(p, Policy::Interleave(_)))
        {
            return bad("at most one interleave among the size rules");
        }
        self.from[n] = from;
        self.policy[n] = policy;
        self.len += 1;
        Ok(self)
    }

    /// The rules: each size from which it applies, and its policy.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &Policy)> {
        self.from[..usize::from(self.len)].iter().copied().zip(&self.policy[..usize::from(self.len)])
    }

    /// The policy of a block of `size` bytes (its size class's size, for
    /// blocks the classes serve).
    #[inline]
    pub fn policy_for(&self, size: usize) -> Policy {
        self.policy[self.index_for(size)]
    }

    /// The index of the rule for `size`.
    #[inline]
    fn index_for(&self, size: usize) -> usize {
        let n = usize::from(self.len);
        (1..n).rev().find(|&k| size >= self.from[k]).unwrap_or(0)
    }

    /// The interleave rule's policy, where there is one.
    pub fn interleave(&self) -> Option<&super::Interleave> {
        self.policy[..usize::from(self.len)].iter().find_map(|p| match p {
            Policy::Interleave(i) => Some(i),
            _ => None,
        })
    }

    /// Checks every rule's policy against `topo` (as
    /// [`Policy::validate`]), and that there is one at least.
    pub fn validate(&self, topo: &Topology) -> Result<()> {
        if self.len == 0 {
            return Err(Error::InvalidPolicy { reason: "no size rule" });
        }
        self.policy[..usize::from(self.len)].iter().try_for_each(|p| p.validate(topo))
    }
}

impl Default for SizeRules {
    fn default() -> Self {
        Self::new()
    }
}

impl core::str::FromStr for SizeRules {
    type Err = Error;

    /// Parses the text form (the type's docs): rules, or one policy. Allocates
    /// nothing: the allocator parses `NUMAWEAVE_POLICY` during its own
    /// start-up.
    fn from_str(s: &str) -> Result<Self> {
        if !Self::is_rules_text(s) {
            return s.trim().parse::<Policy>().map(Self::single);
        }
        let bad = |reason| Error::InvalidPolicy { reason };
        let mut rules = SizeRules::new();
        let mut open_end = false;
        let mut prev = 0;
        for rule in s.trim().split(';') {
            let rule = rule.trim();
            if open_end {
                return Err(bad("a >=B size rule is the last"));
            }
            let (at_least, rest) = match rule.strip_prefix(">=") {
                Some(r) => (true, r),
                None => (false, rule.strip_prefix('<').ok_or(bad("a size rule starts with <B: or >=B:"))?),
            };
            let (size, policy) = rest.split_once(':').ok_or(bad("a size rule is <B:POLICY or >=B:POLICY"))?;
            let b = crate::units::parse_bytes(size).ok_or(bad("a size rule's bound is a size (64K, 1M)"))?;
            let policy: Policy = policy.parse()?;
            if at_least {
                if rules.len == 0 || b != prev {
                    return Err(bad(">=B follows a rule <B with the same bound"));
                }
                rules = rules.push(b, policy)?;
                open_end = true;
            } else {
                if b <= prev {
                    return Err(bad("size rules in ascending order of size, without overlaps"));
                }
                rules = rules.push(prev, policy)?;
                prev = b;
            }
        }
        if !open_end {
            return Err(bad("the last size rule is >=B (every size covered)"));
        }
        Ok(rules)
    }
}

/// A size in the text form: with the largest binary suffix that divides it.
struct Size(usize);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
            if self.0 >= 1 << shift && self.0.is_multiple_of(1 << shift) {
                return write!(f, "{}{suffix}", self.0 >> shift);
            }
        }
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for SizeRules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = usize::from(self.len);
        if n == 1 {
            return write!(f, "{}", self.policy[0]);
        }
        for k in 0..n {
            if k > 0 {
                f.write_str(";")?;
            }
            match k + 1 < n {
                true => write!(f, "<{}:{}", Size(self.from[k + 1]), self.policy[k])?,
                false => write!(f, ">={}:{}", Size(self.from[k]), self.policy[k])?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_round_trip_and_route_by_size() {
        let s = "<4K:local;<1M:tier:lower;>=1M:interleave:0-1:bytes=2097152";
        let r: SizeRules = s.parse().unwrap();
        assert_eq!(r.to_string(), s);
        assert_eq!(r.policy_for(0), Policy::Local);
        assert_eq!(r.policy_for(4095), Policy::Local);
        assert_eq!(r.policy_for(4096), Policy::LowerTier);
        assert_eq!(r.policy_for((1 << 20) - 1), Policy::LowerTier);
        assert!(matches!(r.policy_for(1 << 20), Policy::Interleave(_)));
        assert!(matches!(r.policy_for(usize::MAX), Policy::Interleave(_)));
        assert!(r.interleave().is_some());
        assert_eq!(r.iter().map(|(from, _)| from).collect::<Vec<_>>(), [0, 4096, 1 << 20]);
    }

    #[test]
    fn bad_rules_are_typed_errors() {
        assert_eq!("local".parse::<SizeRules>().unwrap(), SizeRules::single(Policy::Local));
        assert_eq!(SizeRules::single(Policy::Local).to_string(), "local");
        for s in [
            "",
            "bogus",
            "<64K:local",
            ">=64K:local",
            "<64K:local;>=32K:bind:0",
            "<64K:local;<32K:bind:0;>=32K:local",
            "<64K:local;>=64K:local;<1M:local",
            "<64K:bogus;>=64K:local",
            "<64Q:local;>=64K:local",
            "<64K;>=64K:local",
            "<1K:local;<2K:local;<3K:local;<4K:local;>=4K:local",
            "<64K:interleave:0;>=64K:interleave:0",
        ] {
            assert!(s.parse::<SizeRules>().is_err(), "{s:?} parsed");
        }
    }
}

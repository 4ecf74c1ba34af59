//! Byte sizes in configuration text: `8M`, `512K`, `1G`, or plain bytes.

/// `"8M"` → 8 MiB, `"512k"` → 512 KiB, `"4096"` → 4096; `None` for anything
/// else or on overflow.
///
/// ```
/// assert_eq!(numaweave::units::parse_bytes("2M"), Some(2 << 20));
/// assert_eq!(numaweave::units::parse_bytes("2 MiB"), None);
/// ```
pub fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, shift) = match s.as_bytes().last()? {
        b'k' | b'K' => (&s[..s.len() - 1], 10),
        b'm' | b'M' => (&s[..s.len() - 1], 20),
        b'g' | b'G' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    num.parse::<usize>().ok()?.checked_mul(1 << shift)
}

/// A duration in milliseconds from its text form: `250ms`, `2s`, `1m`, or a
/// bare number of milliseconds.
///
/// ```
/// use numaweave::units::parse_millis;
/// assert_eq!(parse_millis("250ms"), Some(250));
/// assert_eq!(parse_millis("2s"), Some(2000));
/// assert_eq!(parse_millis("0"), Some(0));
/// assert_eq!(parse_millis("soon"), None);
/// ```
pub fn parse_millis(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mul) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1000)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60_000)
    } else {
        (s, 1)
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mul)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("8M"), Some(8 << 20));
        assert_eq!(parse_bytes("512k"), Some(512 << 10));
        assert_eq!(parse_bytes("1G"), Some(1 << 30));
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("M"), None);
        assert_eq!(parse_bytes("-1"), None);
        assert_eq!(parse_bytes(""), None);
        assert_eq!(parse_bytes("99999999999999999999G"), None);
    }
}

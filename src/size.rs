//! Human sizes on the command line: `4096`, `64K`, `512M`, `1G`, `2T` (powers of
//! 1024; a trailing `B` or `iB` is accepted).

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SizeError {
    #[error("{0:?} is not a size (expected a number with an optional K, M, G or T suffix)")]
    Invalid(String),
    #[error("{0:?} is too large")]
    Overflow(String),
}

/// Parse a size such as `1G` into bytes.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let t = if lower.ends_with("ib") {
        &t[..t.len() - 2]
    } else if lower.ends_with('b') {
        &t[..t.len() - 1]
    } else {
        t
    };
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(SizeError::Invalid(s.to_owned())),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SizeError::Invalid(s.to_owned()));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| SizeError::Overflow(s.to_owned()))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| SizeError::Overflow(s.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_are_binary() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2tib"), Ok(2 << 40));
        assert_eq!(parse_size("512MB"), Ok(512 << 20));
    }

    #[test]
    fn garbage_is_rejected() {
        for bad in ["", "G", "1.5G", "-1", "10X", "1 G"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert!(matches!(
            parse_size("99999999999999T"),
            Err(SizeError::Overflow(_))
        ));
    }
}

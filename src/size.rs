//! Human sizes on the command line and in config files: `4096`, `64K`, `512M`,
//! `1G`, `2T`, `1.5G` (powers of 1024; a trailing `B` or `iB` is accepted; a
//! decimal must come to a whole number of bytes: `1.5K` is 1536, `1.1K` and
//! `1.5` are refused).
//!
//! And the other way, sizes for people ([`human`], [`human_exact`],
//! [`human_short`]): one rule everywhere, the largest binary unit the size
//! reaches (bytes, KiB, MiB, GiB, TiB, PiB, EiB) with at most one decimal,
//! rounded (`1535 MiB` is `1.5 GiB`, `100 MiB` stays `100 MiB`). A rounded
//! figure is never alone where the exact one matters: [`human_exact`] adds
//! the bytes.
//!
//! A size limit (`--size-limit` of every command, `size_limit` in a config
//! file) is read by [`parse_limit`] alone: a size, or `none` or `0` for no
//! limit (the window reaches the end of the file, as losetup's
//! `--sizelimit 0` and the kernel's `lo_sizelimit` 0 mean).
//!
//! Contract: pure functions; every string is either a byte count that is
//! exactly what it says, or an error naming it.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SizeError {
    #[error("{0:?} is not a size (expected a number with an optional K, M, G or T suffix)")]
    Invalid(String),
    #[error("{0:?} is too large")]
    Overflow(String),
    #[error("{0:?} is not a whole number of bytes")]
    NotWhole(String),
}

/// Parse a size such as `1G` or `1.5M` into bytes.
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
    let (number, shift) = match t.char_indices().last() {
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
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    if int.is_empty() || !digits(int) || !digits(frac) || number.ends_with('.') {
        return Err(SizeError::Invalid(s.to_owned()));
    }
    let over = || SizeError::Overflow(s.to_owned());
    let n: u64 = int.parse().map_err(|_| over())?;
    let whole = n.checked_mul(1u64 << shift).ok_or_else(over)?;
    // The fraction, exactly: frac / 10^len * 2^shift must be an integer.
    let frac = frac.trim_end_matches('0');
    if frac.is_empty() {
        return Ok(whole);
    }
    if frac.len() > 19 {
        return Err(SizeError::NotWhole(s.to_owned()));
    }
    let f: u128 = frac.parse().map_err(|_| over())?;
    let scaled = f << shift;
    let den = 10u128.pow(u32::try_from(frac.len()).map_err(|_| over())?);
    if scaled % den != 0 {
        return Err(SizeError::NotWhole(s.to_owned()));
    }
    let part = u64::try_from(scaled / den).map_err(|_| over())?;
    whole.checked_add(part).ok_or_else(over)
}

/// Parse a size limit: `none` (any case) or `0` is no limit (`None`: to the
/// end of the file); anything else a size as [`parse_size`] reads it.
pub fn parse_limit(s: &str) -> Result<Option<u64>, SizeError> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    parse_size(s).map(limit_of)
}

/// A limit given as a number of bytes: 0 is no limit.
pub fn limit_of(n: u64) -> Option<u64> {
    (n != 0).then_some(n)
}

/// Parse a block size (`512`, `4k`): a size that fits 32 bits.
pub fn parse_block_size(s: &str) -> Result<u32, SizeError> {
    u32::try_from(parse_size(s)?).map_err(|_| SizeError::Overflow(s.to_owned()))
}

/// The units of [`human`], each 1024 times the one before.
const UNITS: [(&str, &str); 7] = [
    ("bytes", "B"),
    ("KiB", "K"),
    ("MiB", "M"),
    ("GiB", "G"),
    ("TiB", "T"),
    ("PiB", "P"),
    ("EiB", "E"),
];

/// The figure and the unit's index of `b` under the one rule (see the
/// module doc): tenths of the largest unit `b` reaches, rounded half up; a
/// figure that rounds to 1024 of a unit is 1 of the next.
fn scaled(b: u64) -> (u128, usize) {
    let mut i = 0;
    while i + 1 < UNITS.len() && b >> (10 * (i + 1)) > 0 {
        i += 1;
    }
    let unit = 1u128 << (10 * i);
    let mut tenths = (u128::from(b) * 10 + unit / 2) / unit;
    if tenths >= 10240 && i + 1 < UNITS.len() {
        i += 1;
        tenths = 10;
    }
    (tenths, i)
}

fn figure(tenths: u128) -> String {
    if tenths % 10 == 0 {
        (tenths / 10).to_string()
    } else {
        format!("{}.{}", tenths / 10, tenths % 10)
    }
}

/// `b` for a person: `100 MiB`, `1.5 GiB`, `512 bytes` (see the module doc).
pub fn human(b: u64) -> String {
    let (t, i) = scaled(b);
    if i == 0 {
        return format!("{b} bytes");
    }
    format!("{} {}", figure(t), UNITS[i].0)
}

/// `b` for a person, with the exact bytes: `64 MiB (67108864 bytes)`;
/// below 1 KiB just `512 bytes`.
pub fn human_exact(b: u64) -> String {
    if b < 1024 {
        return human(b);
    }
    format!("{} ({b} bytes)", human(b))
}

/// `b` for a table cell, as lsblk writes it: `64M`, `1.5G`, `512B`.
pub fn human_short(b: u64) -> String {
    let (t, i) = scaled(b);
    format!("{}{}", figure(t), UNITS[i].1)
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
        for bad in ["", "G", "-1", "10X", "1 G", ".5G", "1.G", "1..5G", "1.5.0K"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert!(matches!(
            parse_size("99999999999999T"),
            Err(SizeError::Overflow(_))
        ));
        assert_eq!(parse_size("16777215.5T"), Ok(u64::MAX - (1 << 39) + 1));
        assert!(matches!(
            parse_size("16777216.5T"),
            Err(SizeError::Overflow(_))
        ));
    }

    #[test]
    fn decimals_must_be_whole_bytes() {
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("1.5K"), Ok(1536));
        assert_eq!(parse_size("0.25M"), Ok(256 << 10));
        assert_eq!(parse_size("2.0"), Ok(2));
        assert_eq!(parse_size("1.50k"), Ok(1536));
        for bad in ["1.5", "1.1K", "0.3M", "1.0000000000000000000001T"] {
            assert_eq!(
                parse_size(bad),
                Err(SizeError::NotWhole(bad.into())),
                "{bad}"
            );
        }
    }

    #[test]
    fn limits_are_sizes_or_none_and_zero_is_none() {
        assert_eq!(parse_limit("1M"), Ok(Some(1 << 20)));
        for none in ["none", "NONE", " None ", "0", "0K", "0.0G"] {
            assert_eq!(parse_limit(none), Ok(None), "{none}");
        }
        assert!(parse_limit("nothing").is_err());
        assert!(parse_limit("-1").is_err());
    }

    #[test]
    fn block_sizes_take_suffixes() {
        assert_eq!(parse_block_size("4k"), Ok(4096));
        assert_eq!(parse_block_size("512"), Ok(512));
        assert!(parse_block_size("4G").is_err());
    }

    /// One unit rule, whatever the size: the largest unit reached, one
    /// decimal at most (issue 27: `1535 MiB` and `1 GiB` were two rules).
    #[test]
    fn human_sizes_follow_one_rule() {
        assert_eq!(human(0), "0 bytes");
        assert_eq!(human(512), "512 bytes");
        assert_eq!(human(1024), "1 KiB");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(100 << 20), "100 MiB");
        assert_eq!(human(1535 << 20), "1.5 GiB");
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human((1 << 30) - 1), "1 GiB");
        assert_eq!(human(3 << 39), "1.5 TiB");
        assert_eq!(human(u64::MAX), "16 EiB");
        assert_eq!(human_exact(64 << 20), "64 MiB (67108864 bytes)");
        assert_eq!(human_exact(1000), "1000 bytes");
        assert_eq!(human_short(64 << 20), "64M");
        assert_eq!(human_short(3 << 29), "1.5G");
        assert_eq!(human_short(512), "512B");
        assert_eq!(human_short(0), "0B");
    }

    proptest::proptest! {
        /// The figure is within a twentieth of a unit of the size.
        #[test]
        fn human_is_close(b in 0u64..u64::MAX) {
            let (t, i) = scaled(b);
            let unit = 1u128 << (10 * i);
            let shown = t * unit;
            let exact = u128::from(b) * 10;
            proptest::prop_assert!(shown.abs_diff(exact) <= unit / 2 + 1);
            proptest::prop_assert!(t < 10240 || i == UNITS.len() - 1);
        }

        #[test]
        fn whole_numbers_round_trip(n in 0u64..(1 << 40), shift in 0usize..5) {
            let suffix = ["", "K", "M", "G", "T"][shift];
            let v = n >> (10 * shift);
            proptest::prop_assert_eq!(parse_size(&format!("{v}{suffix}")), Ok(v << (10 * shift)));
        }

        #[test]
        fn never_panics(s in "[0-9.kKmMgGtTiIbB ]{0,24}") {
            let _ = parse_size(&s);
        }
    }
}

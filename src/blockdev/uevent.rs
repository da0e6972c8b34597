//! Pure parsers for the sysfs text the kernel writes about a block device:
//! `uevent` (`KEY=VALUE` lines), `dev` (`MAJOR:MINOR`) and the decimal
//! counters (`start`, `size`, `partition`).
//!
//! No I/O here: callers read the files and hand over the text. The text comes
//! from the kernel, but nothing is trusted: numbers are range-checked, a
//! `DEVNAME` that could leave `/dev` (absolute, `.`/`..` components, NUL) is
//! refused, and a key given twice is an error rather than a silent choice.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum UeventError {
    #[error("no {0}= line")]
    Missing(&'static str),
    #[error("{0}= appears more than once")]
    Duplicate(&'static str),
    #[error("{key}={value:?} is not a number in range")]
    BadNumber { key: &'static str, value: String },
    #[error("DEVNAME={0:?} is not a relative path below /dev")]
    BadDevname(String),
    #[error("{0:?} is not MAJOR:MINOR")]
    BadDevnum(String),
}

/// What a block device's `uevent` file says about it (the keys loopd uses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uevent {
    pub major: u32,
    pub minor: u32,
    /// The node's path relative to `/dev` (e.g. `loop3p1`, `nbd0p2`).
    pub devname: String,
    /// `disk` or `partition` (absent on very old kernels).
    pub devtype: Option<String>,
    /// The partition number (only on partitions).
    pub partn: Option<u32>,
}

/// Parses a `uevent` file: `KEY=VALUE` lines; lines without `=` and keys
/// loopd does not use are ignored; `MAJOR`, `MINOR` and `DEVNAME` are required.
pub fn parse_uevent(text: &str) -> Result<Uevent, UeventError> {
    let mut major = None;
    let mut minor = None;
    let mut devname = None;
    let mut devtype = None;
    let mut partn = None;
    for line in text.lines() {
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        match key {
            "MAJOR" => set(&mut major, "MAJOR", number("MAJOR", value)?)?,
            "MINOR" => set(&mut minor, "MINOR", number("MINOR", value)?)?,
            "PARTN" => set(&mut partn, "PARTN", number("PARTN", value)?)?,
            "DEVNAME" => set(&mut devname, "DEVNAME", checked_devname(value)?)?,
            "DEVTYPE" => set(&mut devtype, "DEVTYPE", value.to_owned())?,
            _ => {}
        }
    }
    Ok(Uevent {
        major: major.ok_or(UeventError::Missing("MAJOR"))?,
        minor: minor.ok_or(UeventError::Missing("MINOR"))?,
        devname: devname.ok_or(UeventError::Missing("DEVNAME"))?,
        devtype,
        partn,
    })
}

fn set<T>(slot: &mut Option<T>, key: &'static str, v: T) -> Result<(), UeventError> {
    if slot.is_some() {
        return Err(UeventError::Duplicate(key));
    }
    *slot = Some(v);
    Ok(())
}

fn number<T: std::str::FromStr>(key: &'static str, value: &str) -> Result<T, UeventError> {
    let bad = || UeventError::BadNumber {
        key,
        value: value.to_owned(),
    };
    // `FromStr` for integers accepts a leading '+'; the kernel never writes one.
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    value.parse().map_err(|_| bad())
}

fn checked_devname(value: &str) -> Result<String, UeventError> {
    let ok = !value.is_empty()
        && !value.starts_with('/')
        && !value.contains('\0')
        && value
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    if ok {
        Ok(value.to_owned())
    } else {
        Err(UeventError::BadDevname(value.to_owned()))
    }
}

/// Parses a `dev` file (`"259:3\n"`).
pub fn parse_devnum(text: &str) -> Result<(u32, u32), UeventError> {
    let t = text.strip_suffix('\n').unwrap_or(text);
    let bad = || UeventError::BadDevnum(text.to_owned());
    let (a, b) = t.split_once(':').ok_or_else(bad)?;
    let major = number("MAJOR", a).map_err(|_| bad())?;
    let minor = number("MINOR", b).map_err(|_| bad())?;
    Ok((major, minor))
}

/// Parses a decimal sysfs counter such as `start` or `size` (one number and
/// an optional trailing newline).
pub fn parse_counter(key: &'static str, text: &str) -> Result<u64, UeventError> {
    number(key, text.strip_suffix('\n').unwrap_or(text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn partition_uevent_as_the_kernel_writes_it() {
        let u = parse_uevent(
            "MAJOR=259\nMINOR=3\nDEVNAME=loop7p2\nDEVTYPE=partition\nDISKSEQ=41\nPARTN=2\n",
        )
        .unwrap();
        assert_eq!(
            u,
            Uevent {
                major: 259,
                minor: 3,
                devname: "loop7p2".into(),
                devtype: Some("partition".into()),
                partn: Some(2),
            }
        );
    }

    #[test]
    fn whole_disk_uevent_has_no_partn() {
        let u = parse_uevent("MAJOR=43\nMINOR=0\nDEVNAME=nbd0\nDEVTYPE=disk\nDISKSEQ=9\n").unwrap();
        assert_eq!(u.partn, None);
        assert_eq!(u.devname, "nbd0");
        assert_eq!(u.devtype.as_deref(), Some("disk"));
    }

    #[test]
    fn devname_in_a_subdirectory_is_kept() {
        let u = parse_uevent("MAJOR=8\nMINOR=1\nDEVNAME=mapper/x\n").unwrap();
        assert_eq!(u.devname, "mapper/x");
    }

    #[test]
    fn devname_that_leaves_dev_is_rejected() {
        for bad in ["", "/etc/passwd", "../sda", "a/../b", "a//b", "./x", "x\0y"] {
            let text = format!("MAJOR=8\nMINOR=1\nDEVNAME={bad}\n");
            assert_eq!(
                parse_uevent(&text),
                Err(UeventError::BadDevname(bad.into())),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn missing_required_keys_are_named() {
        assert_eq!(
            parse_uevent("MINOR=1\nDEVNAME=x\n"),
            Err(UeventError::Missing("MAJOR"))
        );
        assert_eq!(
            parse_uevent("MAJOR=1\nDEVNAME=x\n"),
            Err(UeventError::Missing("MINOR"))
        );
        assert_eq!(
            parse_uevent("MAJOR=1\nMINOR=1\n"),
            Err(UeventError::Missing("DEVNAME"))
        );
    }

    #[test]
    fn duplicate_key_is_rejected() {
        assert_eq!(
            parse_uevent("MAJOR=1\nMINOR=1\nDEVNAME=a\nDEVNAME=b\n"),
            Err(UeventError::Duplicate("DEVNAME"))
        );
    }

    #[test]
    fn numbers_out_of_range_or_signed_are_rejected() {
        for bad in ["4294967296", "+1", "-1", "", " 1", "0x10"] {
            let text = format!("MAJOR={bad}\nMINOR=1\nDEVNAME=a\n");
            assert!(
                matches!(
                    parse_uevent(&text),
                    Err(UeventError::BadNumber { key: "MAJOR", .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn devnum_and_counters() {
        assert_eq!(parse_devnum("259:12\n"), Ok((259, 12)));
        assert_eq!(parse_devnum("7:0"), Ok((7, 0)));
        for bad in ["", "7", "7:", ":0", "7:0:1", "7:-1", "a:b", "7:0\n\n"] {
            assert!(parse_devnum(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_counter("size", "2048\n"), Ok(2048));
        assert_eq!(parse_counter("start", "18446744073709551615"), Ok(u64::MAX));
        assert!(parse_counter("size", "18446744073709551616").is_err());
        assert!(parse_counter("size", "12 \n").is_err());
    }

    fn arb_devname() -> impl Strategy<Value = String> {
        proptest::collection::vec("[a-z0-9!:_-]{1,8}", 1..3).prop_map(|c| c.join("/"))
    }

    proptest! {
        #[test]
        fn parse_uevent_never_panics(text in "\\PC*") {
            let _ = parse_uevent(&text);
        }

        #[test]
        fn parse_devnum_never_panics(text in "[0-9:\n+-]{0,24}") {
            let _ = parse_devnum(&text);
        }

        /// Whatever order the kernel writes the keys in, and whatever other
        /// keys it adds, the parse returns exactly what was written.
        #[test]
        fn rendered_uevent_parses_back(
            major in any::<u32>(),
            minor in any::<u32>(),
            devname in arb_devname(),
            devtype in proptest::option::of("disk|partition"),
            partn in proptest::option::of(any::<u32>()),
            extra in proptest::collection::vec(("[A-Z_]{1,10}", "[ -~]{0,12}"), 0..4),
            seed in any::<u64>(),
        ) {
            let mut lines = vec![
                format!("MAJOR={major}"),
                format!("MINOR={minor}"),
                format!("DEVNAME={devname}"),
            ];
            if let Some(t) = &devtype {
                lines.push(format!("DEVTYPE={t}"));
            }
            if let Some(p) = partn {
                lines.push(format!("PARTN={p}"));
            }
            for (k, v) in &extra {
                if !["MAJOR", "MINOR", "DEVNAME", "DEVTYPE", "PARTN"].contains(&k.as_str()) {
                    lines.push(format!("{k}={v}"));
                }
            }
            // A deterministic shuffle from the seed.
            let n = lines.len();
            for i in (1..n).rev() {
                let j = usize::try_from((seed >> (i % 32)) % (i as u64 + 1)).unwrap_or(0);
                lines.swap(i, j);
            }
            let text = lines.join("\n") + "\n";
            let u = parse_uevent(&text).unwrap();
            prop_assert_eq!(u, Uevent { major, minor, devname, devtype, partn });
        }

        #[test]
        fn devnum_round_trips(major in any::<u32>(), minor in any::<u32>()) {
            prop_assert_eq!(parse_devnum(&format!("{major}:{minor}\n")), Ok((major, minor)));
        }
    }
}

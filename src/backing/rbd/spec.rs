//! The `rbd:` image spelling: `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]`. A pure
//! parser ([`RbdSpec::parse`]) of a string a user (or a config file, or the
//! state file) gives; it never panics, whatever the bytes.
//!
//! The spelling follows what Ceph users already type: `rbd-nbd map
//! pool/[namespace/]image[@snap]` and `rbd map`, behind QEMU's `rbd:` prefix
//! (`qemu-img info rbd:pool/image@snap`). Choices where those differ:
//! - the pool is always given (QEMU's rule; `rbd-nbd`'s default pool `rbd`
//!   would make `rbd:a/b` mean two things): `rbd:IMAGE` is refused;
//! - QEMU's trailing options (`:conf=FILE:id=USER`) are refused with a pointer
//!   to `--ceph-conf` / `--ceph-id`: a key or a monitor address in the image
//!   string would end up in the state file, logs and `list`; so is anything
//!   with a `:` or a `\` (QEMU's escape), which no other tool needs;
//! - every part is non-empty, valid UTF-8 without control characters (they
//!   would reach logs and terminals), at most [`MAX_PART`] bytes; a snapshot
//!   needs an image before it (`pool/@snap` is refused).

use std::fmt;
use thiserror::Error;

/// The prefix that selects the RBD backend.
pub const PREFIX: &str = "rbd:";

/// Longest pool, namespace, image or snapshot name taken.
pub const MAX_PART: usize = 512;

/// Where an RBD image lives: pool, optional namespace, image, optional snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RbdSpec {
    pub pool: String,
    pub namespace: Option<String>,
    pub image: String,
    pub snap: Option<String>,
}

/// Why a string is not an `rbd:` spec.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SpecError {
    #[error("an RBD image is named rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]")]
    NoPrefix,
    #[error("give the pool: rbd:POOL/IMAGE (no default pool)")]
    NoPool,
    #[error("too many '/': rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]")]
    TooManyParts,
    #[error("the {0} name is empty")]
    Empty(&'static str),
    #[error("the {0} name holds a control character")]
    Control(&'static str),
    #[error("the {0} name is longer than {MAX_PART} bytes")]
    TooLong(&'static str),
    #[error("the {0} name holds '@' (only IMAGE@SNAP takes one)")]
    At(&'static str),
    #[error(
        "options in the image string (QEMU's ':conf=...:id=...') are not taken: \
         use --ceph-conf and --ceph-id"
    )]
    Options,
    #[error("'\\' is not taken in an rbd: spec")]
    Backslash,
}

/// Whether `s` asks for the RBD backend (starts with [`PREFIX`]).
pub fn is_rbd(s: &str) -> bool {
    s.starts_with(PREFIX)
}

fn part(what: &'static str, s: &str, at_ok: bool) -> Result<String, SpecError> {
    if s.is_empty() {
        return Err(SpecError::Empty(what));
    }
    if s.len() > MAX_PART {
        return Err(SpecError::TooLong(what));
    }
    if s.chars().any(char::is_control) {
        return Err(SpecError::Control(what));
    }
    if !at_ok && s.contains('@') {
        return Err(SpecError::At(what));
    }
    Ok(s.to_owned())
}

impl RbdSpec {
    /// Parse `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]` (see the module documentation).
    pub fn parse(s: &str) -> Result<RbdSpec, SpecError> {
        let rest = s.strip_prefix(PREFIX).ok_or(SpecError::NoPrefix)?;
        if rest.contains(':') {
            return Err(SpecError::Options);
        }
        if rest.contains('\\') {
            return Err(SpecError::Backslash);
        }
        let parts: Vec<&str> = rest.split('/').collect();
        let (pool, namespace, last) = match parts.as_slice() {
            [_] => return Err(SpecError::NoPool),
            [p, i] => (*p, None, *i),
            [p, n, i] => (*p, Some(*n), *i),
            _ => return Err(SpecError::TooManyParts),
        };
        let (image, snap) = match last.split_once('@') {
            Some((i, s)) => (i, Some(s)),
            None => (last, None),
        };
        Ok(RbdSpec {
            pool: part("pool", pool, false)?,
            namespace: namespace.map(|n| part("namespace", n, false)).transpose()?,
            image: part("image", image, false)?,
            snap: snap.map(|s| part("snapshot", s, false)).transpose()?,
        })
    }

    /// A short name for the export when none is given: the image name
    /// (`IMAGE@SNAP` for a snapshot).
    pub fn export_name(&self) -> String {
        match &self.snap {
            Some(s) => format!("{}@{s}", self.image),
            None => self.image.clone(),
        }
    }
}

impl fmt::Display for RbdSpec {
    /// The spec as parsed: `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PREFIX}{}/", self.pool)?;
        if let Some(n) = &self.namespace {
            write!(f, "{n}/")?;
        }
        f.write_str(&self.image)?;
        if let Some(s) = &self.snap {
            write!(f, "@{s}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(pool: &str, ns: Option<&str>, image: &str, snap: Option<&str>) -> RbdSpec {
        RbdSpec {
            pool: pool.into(),
            namespace: ns.map(Into::into),
            image: image.into(),
            snap: snap.map(Into::into),
        }
    }

    #[test]
    fn the_spellings_rbd_nbd_and_qemu_share_parse() {
        assert_eq!(
            RbdSpec::parse("rbd:rbd/disk").unwrap(),
            spec("rbd", None, "disk", None)
        );
        assert_eq!(
            RbdSpec::parse("rbd:pool/ns/disk@snap1").unwrap(),
            spec("pool", Some("ns"), "disk", Some("snap1"))
        );
        assert_eq!(
            RbdSpec::parse("rbd:p/d-1.img@s").unwrap().export_name(),
            "d-1.img@s"
        );
    }

    #[test]
    fn malformed_specs_are_refused_by_reason() {
        let e = |s: &str| RbdSpec::parse(s).unwrap_err();
        assert_eq!(e("/rbd/disk"), SpecError::NoPrefix);
        assert_eq!(e("rbd:disk"), SpecError::NoPool);
        assert_eq!(e("rbd:a/b/c/d"), SpecError::TooManyParts);
        assert_eq!(e("rbd:/disk"), SpecError::Empty("pool"));
        assert_eq!(e("rbd:p/"), SpecError::Empty("image"));
        assert_eq!(e("rbd:p//i"), SpecError::Empty("namespace"));
        assert_eq!(e("rbd:p/i@"), SpecError::Empty("snapshot"));
        assert_eq!(e("rbd:p/@s"), SpecError::Empty("image"));
        assert_eq!(e("rbd:p/i@s@t"), SpecError::At("snapshot"));
        assert_eq!(e("rbd:p@x/i"), SpecError::At("pool"));
        assert_eq!(e("rbd:p/i\n"), SpecError::Control("image"));
        assert_eq!(e("rbd:p/i\0"), SpecError::Control("image"));
        assert_eq!(e("rbd:p/i:conf=/etc/ceph.conf"), SpecError::Options);
        assert_eq!(e("rbd:p/i\\:x"), SpecError::Options);
        assert_eq!(e("rbd:p/i\\x"), SpecError::Backslash);
        assert_eq!(
            e(&format!("rbd:p/{}", "i".repeat(MAX_PART + 1))),
            SpecError::TooLong("image")
        );
    }

    fn name() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9._ -][a-zA-Z0-9._é -]{0,20}"
    }

    proptest! {
        #[test]
        fn a_spec_round_trips_through_its_display(
            pool in name(), ns in proptest::option::of(name()),
            image in name(), snap in proptest::option::of(name()),
        ) {
            let s = RbdSpec { pool, namespace: ns, image, snap };
            prop_assert_eq!(RbdSpec::parse(&s.to_string()), Ok(s));
        }

        #[test]
        fn any_string_parses_or_is_refused_without_panicking(s in "\\PC*") {
            let _ = RbdSpec::parse(&s);
            let with = format!("{PREFIX}{s}");
            if let Ok(p) = RbdSpec::parse(&with) {
                // What parses prints back as it was given.
                prop_assert_eq!(p.to_string(), with);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let s = String::from_utf8_lossy(&b);
            let _ = RbdSpec::parse(&format!("{PREFIX}{s}"));
        }
    }
}

//! A device spec's name and checks, and the [`DeviceParams`] it opens with.
//!
//! Pure: what an attach checks before it opens anything ([`check_name`],
//! [`check_create`]: the reason of an invalid spec), the export name a spec asks for ([`name_of`]), and the
//! parameters of [`crate::device::Device::open`] (with the benchmark switches
//! of [`Tuning`]).

use crate::control::proto::DeviceSpec;
use crate::device::{DeviceParams, Opening};

/// Switches for benchmarks (not part of a device's configuration).
#[derive(Debug, Clone, Copy, Default)]
pub struct Tuning {
    /// One lock for the whole device instead of byte ranges (seed 001's baseline).
    pub whole_device_lock: bool,
    /// No inline page-cache reads in buffered mode (seed 004's baseline).
    pub no_inline_reads: bool,
    /// Buffered writes always through the ring (the inline-write baseline).
    pub no_inline_writes: bool,
    /// Large buffered reads copied, never spliced (the splice baseline).
    pub no_splice: bool,
}

pub(super) fn params_of(spec: &DeviceSpec, name: &str) -> DeviceParams {
    params_with(spec, name, Tuning::default())
}

pub(super) fn params_with(spec: &DeviceSpec, name: &str, tuning: Tuning) -> DeviceParams {
    DeviceParams {
        path: spec.image.clone(),
        opening: Opening::First,
        name: name.to_owned(),
        offset: spec.offset,
        size_limit: spec.size_limit,
        block_size: spec.block_size,
        strict_block_size: spec.strict_block_size,
        cache: spec.cache,
        read_only: spec.read_only,
        create: spec.create,
        preallocate: spec.preallocate,
        whole_device_lock: tuning.whole_device_lock,
        no_inline_reads: tuning.no_inline_reads,
        no_inline_writes: tuning.no_inline_writes,
        no_splice: tuning.no_splice,
        shared: spec.shared,
        format: spec.format,
        ceph_conf: spec.ceph_conf.clone(),
        ceph_id: spec.ceph_id.clone(),
        ceph_timeout: spec.ceph_timeout,
        rbd_take_back: None,
    }
}

/// The export name a spec asks for (default: the image's file stem; for an
/// RBD image, its name, `IMAGE@SNAP` for a snapshot).
pub fn name_of(spec: &DeviceSpec) -> String {
    let rbd = spec
        .image
        .to_str()
        .and_then(|s| crate::backing::rbd::RbdSpec::parse(s).ok());
    match (&spec.name, rbd) {
        (Some(n), _) => n.clone(),
        (None, Some(r)) => r.export_name(),
        // A malformed rbd: spec gets a name anyway, so its open says what is
        // wrong with it.
        (None, None) => spec
            .image
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
    }
}

/// `create`'s size must fit the file system's `off_t` and be a whole number
/// of blocks (the block size asked, else 512): a device serves whole blocks
/// only, so `create 100` would make a file the device cannot show as it is.
/// Refused rather than rounded, naming the sizes that would do.
pub(super) fn check_create(spec: &DeviceSpec) -> Result<(), String> {
    if spec.preallocate && spec.create.is_none() {
        return Err(
            "preallocate applies to an image the attach creates: give create (a size) too".into(),
        );
    }
    let block = u64::from(spec.block_size.unwrap_or(512).max(1));
    match spec.create {
        Some(n) if i64::try_from(n).is_err() => Err(format!(
            "create size {n} is out of range: at most {} bytes (2^63-1)",
            i64::MAX
        )),
        Some(n) if n % block != 0 => {
            let down = n / block * block;
            let up = down.saturating_add(block);
            let below = if down > 0 {
                format!("{down} or ")
            } else {
                String::new()
            };
            Err(format!(
                "create size {n} bytes is not a whole number of {block}-byte blocks: \
                 give {below}{up} (or a size with K/M/G/T)"
            ))
        }
        _ => Ok(()),
    }
}

pub(super) fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the export name is empty (give a name)".into());
    }
    if name.len() > 4096 || name.contains('\0') || name.contains('/') || name.contains('?') {
        return Err(format!(
            "export name {name:?} is invalid (at most 4096 bytes, no NUL, '/' or '?')"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn spec(image: &str) -> DeviceSpec {
        DeviceSpec {
            image: PathBuf::from(image),
            ..DeviceSpec::default()
        }
    }

    #[test]
    fn the_name_is_the_one_given_else_the_image_stem() {
        let mut s = spec("/images/disk.raw");
        assert_eq!(name_of(&s), "disk");
        s.name = Some("other".into());
        assert_eq!(name_of(&s), "other");
        assert_eq!(name_of(&spec("/")), "");
        assert_eq!(name_of(&spec("/images/no-ext")), "no-ext");
    }

    #[test]
    fn an_rbd_image_is_named_after_the_image_and_its_snapshot() {
        assert_eq!(name_of(&spec("rbd:rbd/vm1")), "vm1");
        assert_eq!(name_of(&spec("rbd:rbd/ns/vm1.img@s1")), "vm1.img@s1");
        // Malformed: a name anyway, so the open says what is wrong.
        assert_eq!(name_of(&spec("rbd:vm1")), "rbd:vm1");
        let p = params_of(
            &DeviceSpec {
                ceph_id: Some("loopd".into()),
                ceph_timeout: Some(3),
                ..spec("rbd:rbd/vm1")
            },
            "vm1",
        );
        assert_eq!(
            (p.ceph_id.as_deref(), p.ceph_timeout),
            (Some("loopd"), Some(3))
        );
    }

    #[test]
    fn names_are_checked_for_what_nbd_and_uris_cannot_carry() {
        assert!(check_name("disk-1").is_ok());
        assert!(check_name(&"n".repeat(4096)).is_ok());
        for bad in ["", "a/b", "a?b", "a\0b"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_name(&"n".repeat(4097)).is_err());
    }

    #[test]
    fn a_create_size_must_fit_off_t() {
        let mut s = spec("/x");
        assert!(check_create(&s).is_ok());
        s.create = Some(i64::MAX as u64 / 4096 * 4096);
        assert!(check_create(&s).is_ok());
        s.create = Some(i64::MAX as u64 + 1);
        let e = check_create(&s).expect_err("past off_t");
        assert!(e.contains("out of range"), "{e}");
    }

    #[test]
    fn a_create_size_is_whole_blocks() {
        let mut s = spec("/x");
        s.create = Some(100);
        let e = check_create(&s).expect_err("100 bytes");
        assert!(e.contains("not a whole number of 512-byte blocks"), "{e}");
        assert!(e.contains("give 512"), "{e}");
        s.create = Some(1000);
        let e = check_create(&s).expect_err("1000 bytes");
        assert!(e.contains("give 512 or 1024"), "{e}");
        s.block_size = Some(4096);
        s.create = Some(1 << 20);
        assert!(check_create(&s).is_ok());
        s.create = Some(512);
        assert!(check_create(&s).is_err());
    }

    #[test]
    fn params_carry_the_spec_and_the_tuning() {
        let mut s = spec("/images/disk.raw");
        s.offset = 4096;
        s.size_limit = Some(1 << 20);
        s.read_only = true;
        let t = Tuning {
            whole_device_lock: true,
            no_splice: true,
            ..Tuning::default()
        };
        let p = params_with(&s, "disk", t);
        assert_eq!(p.path, PathBuf::from("/images/disk.raw"));
        assert_eq!(p.name, "disk");
        assert_eq!(
            (p.offset, p.size_limit, p.read_only),
            (4096, Some(1 << 20), true)
        );
        assert!(p.whole_device_lock && p.no_splice);
        assert!(!p.no_inline_reads && !p.no_inline_writes);
        assert!(matches!(p.opening, Opening::First));
        let q = params_of(&s, "disk");
        assert!(!q.whole_device_lock && !q.no_splice);
    }
}

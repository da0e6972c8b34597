//! Opening a device on an RBD image (`rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]`,
//! see [`crate::backing::rbd`]): what a file has and an image has not is
//! refused or skipped here.
//!
//! - `--create` is refused (images are made with `rbd create`); the format
//!   probe, the image file's identity and QEMU's image locks are skipped
//!   (an RBD image is a raw block device; its exclusive lock keeps other
//!   writers out instead, unless `--shared`);
//! - a snapshot is served read-only (with a notice, like a write-protected
//!   file); a window (`--offset`, `--size-limit`) must lie inside the image,
//!   which does not grow when written past its end;
//! - `--cache direct` turns librbd's cache off (every acknowledged write is on
//!   the OSDs), `buffered` on (acknowledged from memory, durable at the next
//!   flush or FUA), `auto` leaves it to the Ceph configuration (librbd's
//!   default: on, write-through until the client's first flush);
//! - a reconfiguration (`set`, `resize`) keeps the open image and its lock
//!   ([`Opening::Rbd`]); it cannot change the cache mode or make a read-only
//!   image writable.
//!
//! Blocks (cluster round trips, bounded by the RADOS timeout): called by
//! [`crate::device::Device::open`] on a control thread, never on a reactor.

use super::params::{CacheMode, DeviceError, DeviceParams, Opening};
use crate::backing::rbd::{self, OpenParams, Options, RbdCache, RbdImage, RbdSpec};
use std::sync::Arc;
use std::time::Duration;

/// What an RBD device opens: a spec to open, or a live device's image.
pub(super) enum Wanted {
    New(Result<RbdSpec, rbd::SpecError>),
    Same(Arc<RbdImage>),
}

/// The RBD image `p` asks for, if it asks for one.
pub(super) fn wanted(p: &DeviceParams) -> Option<Wanted> {
    if let Opening::Rbd(r) = &p.opening {
        return Some(Wanted::Same(Arc::clone(r)));
    }
    let s = p.path.to_str().filter(|s| rbd::spec::is_rbd(s))?;
    Some(Wanted::New(RbdSpec::parse(s)))
}

/// librbd's cache for a cache mode (see the module documentation).
pub fn rbd_cache(c: CacheMode) -> RbdCache {
    match c {
        CacheMode::Direct => RbdCache::Off,
        CacheMode::Buffered => RbdCache::On,
        CacheMode::Auto => RbdCache::Default,
    }
}

/// The cluster `p` names.
pub fn options(p: &DeviceParams) -> Options {
    Options {
        conf: p
            .ceph_conf
            .clone()
            .unwrap_or_else(|| rbd::cluster::DEFAULT_CONF.into()),
        id: p
            .ceph_id
            .clone()
            .unwrap_or_else(|| rbd::cluster::DEFAULT_ID.to_owned()),
        cache: rbd_cache(p.cache),
        timeout: p
            .ceph_timeout
            .map_or(rbd::cluster::DEFAULT_TIMEOUT, Duration::from_secs),
    }
}

fn cache_note(c: RbdCache, timeout: Duration) -> String {
    let what = match c {
        RbdCache::Off => "librbd's cache off (direct: every acknowledged write is on the OSDs)",
        RbdCache::On => "librbd's cache on (buffered: writes durable at the next flush or FUA)",
        RbdCache::Default => "librbd's cache as the Ceph configuration says (auto)",
    };
    format!("{what}; RADOS timeout {} s", timeout.as_secs())
}

/// Whether a window of `size` bytes at `offset` lies inside an image of
/// `image_size` bytes (its ragged last block counted whole: the window is
/// whole blocks). Checked at every open — an attach, and a resize after the
/// image shrank (then the device keeps its size). Pure.
pub fn window_fits(offset: u64, size: u64, image_size: u64, block_size: u32) -> bool {
    let bs = u64::from(block_size.max(1));
    let end = image_size.div_ceil(bs).saturating_mul(bs);
    offset.checked_add(size).is_some_and(|e| e <= end)
}

/// What an RBD device's open found (the device module assembles it).
pub(super) struct Opened {
    pub img: Arc<RbdImage>,
    pub image_size: u64,
    pub read_only: bool,
    /// Read-only because it is a snapshot, not because it was asked.
    pub write_protected: bool,
    pub cache_note: String,
}

/// Open (or keep) the image of an RBD device (see the module documentation).
pub(super) fn open(p: &DeviceParams, w: Wanted) -> Result<Opened, DeviceError> {
    let opts = options(p);
    let img = match w {
        Wanted::New(spec) => {
            let spec = spec.map_err(rbd::RbdError::from)?;
            if p.create.is_some() {
                return Err(DeviceError::NotForRbd {
                    spec: spec.to_string(),
                    what: "--create does not make RBD images (make it with `rbd create`)",
                });
            }
            let op = OpenParams {
                read_only: p.read_only,
                exclusive: !p.shared,
                take_back_from: p.rbd_take_back.clone(),
            };
            rbd::open(&spec, &opts, &op)?
        }
        Wanted::Same(img) => {
            let spec = img.spec().to_string();
            if img.cluster().options().cache != opts.cache {
                return Err(DeviceError::NotForRbd {
                    spec,
                    what: "the cache mode of an RBD device is fixed (detach and attach again)",
                });
            }
            if img.read_only() && !p.read_only && img.spec().snap.is_none() {
                return Err(DeviceError::NotForRbd {
                    spec,
                    what: "a read-only RBD device stays read-only (detach and attach again)",
                });
            }
            img
        }
    };
    let image_size = img.size()?;
    let read_only = p.read_only || img.read_only();
    let write_protected = read_only && !p.read_only;
    if write_protected {
        tracing::info!("{} is a snapshot: serving it read-only", img.spec());
    }
    Ok(Opened {
        cache_note: cache_note(img.cluster().options().cache, opts.timeout),
        img,
        image_size,
        read_only,
        write_protected,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(path: &str, create: Option<u64>) -> String {
        let p = DeviceParams {
            path: path.into(),
            create,
            ..DeviceParams::default()
        };
        let w = wanted(&p).expect("an rbd: image");
        match open(&p, w) {
            Ok(_) => panic!("{path} opened"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn malformed_specs_and_create_are_refused_before_any_cluster_is_asked() {
        assert_eq!(refused("rbd:disk", None), "bad RBD image spec");
        let e = refused("rbd:rbd/disk", Some(1 << 20));
        assert!(e.contains("`rbd create`"), "{e}");
    }

    #[test]
    fn a_window_fits_while_the_image_holds_it() {
        const M: u64 = 1 << 20;
        // A whole image, grown, and shrunk under a --size-limit window.
        assert!(window_fits(0, 4 * M, 4 * M, 512));
        assert!(window_fits(0, 2 * M, 8 * M, 512));
        assert!(!window_fits(0, 2 * M, M, 512));
        // With an offset: the window's end counts.
        assert!(window_fits(M, 2 * M, 3 * M, 4096));
        assert!(!window_fits(M, 2 * M, 3 * M - 1 - 4096, 4096));
        // A ragged tail counts as a whole block (it reads as zeros).
        assert!(window_fits(0, 4096, 1000, 4096));
        assert!(window_fits(0, 8192, 4097, 4096));
        assert!(!window_fits(0, 8192, 4096, 4096));
        // No overflow at the top.
        assert!(!window_fits(u64::MAX, 4096, u64::MAX, 4096));
        assert!(!window_fits(4096, u64::MAX, u64::MAX, 512));
    }

    #[test]
    fn only_an_rbd_prefix_selects_the_backend() {
        for f in ["/images/rbd:x", "rbd", "./rbd:a/b", "RBD:a/b"] {
            let p = DeviceParams {
                path: f.into(),
                ..DeviceParams::default()
            };
            assert!(wanted(&p).is_none(), "{f}");
        }
    }

    #[test]
    fn cache_modes_map_to_librbds_cache() {
        assert_eq!(rbd_cache(CacheMode::Direct), RbdCache::Off);
        assert_eq!(rbd_cache(CacheMode::Buffered), RbdCache::On);
        assert_eq!(rbd_cache(CacheMode::Auto), RbdCache::Default);
        let o = options(&DeviceParams::default());
        assert_eq!(o.conf, std::path::Path::new("/etc/ceph/ceph.conf"));
        assert_eq!((o.id.as_str(), o.timeout.as_secs()), ("admin", 8));
    }
}

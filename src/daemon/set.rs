//! Live reconfiguration: `set` (offset, size limit, block size, cache,
//! read-only) and `resize` (the file's size read again, like
//! `LOOP_SET_CAPACITY`; an RBD device's image size, which
//! [`super::follow`] also runs on its own after an `rbd resize`).
//!
//! Contract: both run under the export's control lock, re-open the device's own
//! file (never its path: see [`crate::backing::identity`]), refuse a change
//! that would break connected clients unless forced ([`super::set_rules`]) or
//! that its kernel block device cannot follow ([`Daemon::kernel_follows`]),
//! record the new configuration durably, then swap the device under a short
//! quiesce ([`Export::quiesce_and_swap`]) and tell the kernel the new size.

use super::error::CtlError;
use super::info::SetResult;
use super::params::params_of;
use super::registry::Daemon;
use super::set_rules;
use crate::control::proto::DeviceSpec;
use crate::control::proto::SetSpec;
use crate::device::export::Export;
use crate::device::{Device, DeviceParams};
use crate::text::quoted_path;
use std::sync::Arc;

/// A reconfiguration's parameters: `spec` on the file device `cur` already has
/// (no path lookup; see [`crate::backing::identity`]).
fn same_file(spec: &DeviceSpec, name: &str, cur: &Device) -> DeviceParams {
    DeviceParams {
        opening: cur.reopening(),
        ..params_of(spec, name)
    }
}

/// After `set`/`resize`: say so when the image path no longer names the file
/// the device serves (it keeps serving that file; a restart would not).
fn warn_if_renamed(name: &str, dev: &Device) {
    if !dev.path_still_names_it() {
        tracing::warn!(
            "device {name:?}: {} no longer names the file the device serves (moved, replaced or \
             now a link); the device keeps that file, and after a restart it stays missing until \
             `loopd attach` of the path accepts the file it names then",
            quoted_path(&dev.path)
        );
    }
}

impl Daemon {
    /// Live reconfiguration. See the module and `Export` docs for what freezes.
    pub fn set(&self, s: SetSpec) -> Result<SetResult, CtlError> {
        let e = self
            .export(&s.name)
            .ok_or_else(|| CtlError::NotFound(s.name.clone()))?;
        let _g = e.control();
        let old = e.spec();
        let mut new = old.clone();
        if let Some(v) = s.size_limit {
            // 0 is no limit, as everywhere a limit is read.
            new.size_limit = v.and_then(crate::size::limit_of);
        }
        if let Some(v) = s.offset {
            new.offset = v;
        }
        if let Some(v) = s.block_size {
            new.block_size = Some(v);
        }
        if let Some(v) = s.cache {
            new.cache = v;
        }
        if let Some(v) = s.read_only {
            new.read_only = v;
        }
        let (cur, _) = e.current();
        let unchanged = new == old
            || (new.offset == cur.offset
                && match new.size_limit {
                    Some(l) => l == cur.size,
                    None => old.size_limit.is_none(),
                }
                && new.block_size.is_none_or(|b| b == cur.block_size)
                && new.read_only == cur.read_only
                && new.cache == old.cache);
        if unchanged {
            if new != old {
                self.record_put(&e, &new)?;
            }
            e.set_spec(new);
            let mut r = self.set_result(&e, false, 0);
            r.device.note = Some(why_unchanged(&s, &r));
            return Ok(r);
        }
        let clients = e.clients();
        let geometry = |d: &Device, read_only| set_rules::Geometry {
            offset: d.offset,
            size: d.size,
            block_size: d.block_size,
            read_only,
        };
        // Cheap refusals first (before opening the file again).
        let mut early = set_rules::breaking(
            geometry(&cur, cur.read_only),
            set_rules::Geometry {
                offset: new.offset,
                size: cur.size,
                block_size: new.block_size.unwrap_or(cur.block_size),
                read_only: new.read_only,
            },
        );
        if clients > 0 && !s.force && !early.is_empty() {
            return Err(CtlError::Busy(set_rules::busy_message(
                &s.name, clients, &early,
            )));
        }
        let dev = Device::open_with_stats(&same_file(&new, &e.name, &cur), Arc::clone(&e.stats))
            .map_err(|source| CtlError::Device {
                msg: format!("cannot reconfigure {:?}", s.name),
                source,
            })?;
        warn_if_renamed(&e.name, &dev);
        early = set_rules::breaking(geometry(&cur, cur.read_only), geometry(&dev, new.read_only));
        if clients > 0 && !s.force && !early.is_empty() {
            return Err(CtlError::Busy(set_rules::busy_message(
                &s.name, clients, &early,
            )));
        }
        let kernel = self.kernel_follows(&e, &cur, &dev)?;
        self.record_put(&e, &new)?;
        let held = e.quiesce_and_swap(Some(dev));
        self.kernel_resize(&e, kernel);
        e.set_spec(new);
        let quiesced_us = u64::try_from(held.as_micros()).unwrap_or(u64::MAX);
        let mut r = self.set_result(&e, true, quiesced_us);
        if s.read_only == Some(false) && r.device.write_protected {
            r.device.note = Some(stays_read_only(&r));
        }
        Ok(r)
    }

    /// A `set`/`resize` result, with the file's size as it is now (read
    /// again: the file may have grown since the device last looked) and
    /// whether the size limit caps it.
    pub(super) fn set_result(&self, e: &Export, changed: bool, quiesced_us: u64) -> SetResult {
        let (dev, _) = e.current();
        let file_size = dev.file_size_now();
        let capped = e
            .spec()
            .size_limit
            .is_some_and(|l| file_size.saturating_sub(dev.offset) > l);
        SetResult {
            device: self.info(e),
            changed,
            quiesced_us,
            file_size,
            capped_by_size_limit: capped,
        }
    }

    /// Re-read the backing file's size (like `LOOP_SET_CAPACITY`).
    pub fn resize(&self, name: &str) -> Result<SetResult, CtlError> {
        let e = self
            .export(name)
            .ok_or_else(|| CtlError::NotFound(name.to_owned()))?;
        let _g = e.control();
        let spec = e.spec();
        let (cur, _) = e.current();
        let dev = Device::open_with_stats(&same_file(&spec, &e.name, &cur), Arc::clone(&e.stats))
            .map_err(|source| CtlError::Device {
            msg: format!("cannot resize {name:?}"),
            source,
        })?;
        warn_if_renamed(name, &dev);
        if dev.size == cur.size {
            // The window did not change (a size limit), the data's length
            // may have: the device reports it (and an RBD device's follower,
            // `super::follow`, compares with it).
            cur.file_size
                .store(dev.file_size(), std::sync::atomic::Ordering::Relaxed);
            drop(dev);
            let mut r = self.set_result(&e, false, 0);
            if !r.capped_by_size_limit {
                r.device.note = Some("the device already has the size the file gives it".into());
            }
            return Ok(r);
        }
        let kernel = self.kernel_follows(&e, &cur, &dev)?;
        let held = e.quiesce_and_swap(Some(dev));
        self.kernel_resize(&e, kernel);
        let quiesced_us = u64::try_from(held.as_micros()).unwrap_or(u64::MAX);
        Ok(self.set_result(&e, true, quiesced_us))
    }
}

/// A write-protected image asked to be writable: why it is not.
fn stays_read_only(r: &SetResult) -> String {
    format!(
        "{} is write-protected (loopd cannot open it for writing: a read-only mount or file \
         mode), so the device stays read-only",
        quoted_path(&r.device.image)
    )
}

/// Why a `set` changed nothing: the device is already so, or (asked to be
/// writable) its image is write-protected.
fn why_unchanged(s: &SetSpec, r: &SetResult) -> String {
    if s.read_only == Some(false) && r.device.write_protected {
        return stays_read_only(r);
    }
    "the device already has these settings".to_owned()
}

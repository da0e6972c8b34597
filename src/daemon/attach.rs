//! Attach: a device validated, opened and probed, then published in one step.
//!
//! Contract: an attach validates everything and opens the file *before* it
//! takes the table lock; the export becomes visible to clients in one
//! insertion, after its record is durable (the state log's mutex is held from
//! the name check to the insertion: see [`super::record`]). A failed attach
//! leaves nothing behind: an image it created is removed again, and a block
//! device it asked for that cannot be made detaches it again. Racing attaches
//! that may create their image are serialised by `create_lock`, so exactly one
//! creates, opens and publishes, and a loser never removes a file another
//! attach serves.
//!
//! Which file: an attach opens the path as given and records what it finds; a
//! recorded device comes back (restart, retry: [`Source::Restored`]) only on
//! the file its record names ([`crate::backing::identity`]); an `attach` of a
//! missing device's image brings it back with its record, or is refused when
//! it asks for something else ([`super::bring_back`]).

use super::bring_back;
use super::error::CtlError;
use super::info::DeviceInfo;
use super::params::{Tuning, check_create, check_name, name_of, params_with};
use super::registry::Daemon;
use crate::backing::Backend;
use crate::control::proto::DeviceSpec;
use crate::device::export::Export;
use crate::device::{Device, DeviceParams, Opening};
use crate::text::quoted_path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Where an attach comes from (what it records, what it may replace).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// The control socket: recorded in the state file; may take a missing name.
    Control,
    /// `serve IMAGE` or `--config`: not recorded (they come back from
    /// there); an RBD image's lock owner is, in the state file's sidecar.
    Static,
    /// A state-file device coming back: already recorded; only while missing.
    Restored,
    /// As `Restored`, at start ([`Daemon::restore`]): its file as found in
    /// this boot is recorded by the compaction that ends the restore, not by
    /// a write of its own.
    Restoring,
}

impl Source {
    /// A device of the state file coming back.
    fn restored(self) -> bool {
        matches!(self, Source::Restored | Source::Restoring)
    }
}

impl Daemon {
    /// Attach a device: validate, open, probe, then publish in one step.
    ///
    /// `persist`: record the device in the state file (devices from the command
    /// line or the config file are not recorded: they come back from there).
    pub fn attach(&self, spec: DeviceSpec, persist: bool) -> Result<DeviceInfo, CtlError> {
        let source = if persist {
            Source::Control
        } else {
            Source::Static
        };
        let info = self.attach_inner(spec, source, Tuning::default(), false)?;
        if source == Source::Control {
            self.warn_if_unreachable(&info.name);
        }
        self.start_blockdev_or_undo(&info.name)?;
        Ok(self.export(&info.name).map_or(info, |e| self.info(&e)))
    }

    /// Attach the device `loopd serve IMAGE` names: it is the default export (so
    /// its name may be empty) and may carry benchmark switches.
    pub fn attach_default(&self, spec: DeviceSpec, tuning: Tuning) -> Result<DeviceInfo, CtlError> {
        let info = self.attach_inner(spec, Source::Static, tuning, true)?;
        self.set_default(&info.name);
        self.start_blockdev_or_undo(&info.name)?;
        Ok(self.export(&info.name).map_or(info, |e| self.info(&e)))
    }

    pub(super) fn attach_inner(
        &self,
        mut spec: DeviceSpec,
        source: Source,
        tuning: Tuning,
        is_default: bool,
    ) -> Result<DeviceInfo, CtlError> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(CtlError::ShuttingDown);
        }
        let name = name_of(&spec);
        // The RBD lock owner of this daemon's previous run: believed only
        // from the daemon's own records — the device's state record (a
        // restart, a retry, an attach that brings a missing device back), or
        // for a device of `--config` or `serve rbd:…` the state file's
        // sidecar, for the same name and image — never from a request or a
        // config file (see crate::backing::rbd::lock).
        let recorded_owner = spec.rbd_lock_owner.take();
        let mut dead_owner = match source {
            Source::Restored | Source::Restoring => recorded_owner,
            Source::Static => self.previous_rbd_owner(&name, &spec),
            Source::Control => None,
        };
        if !(is_default && name.is_empty()) {
            check_name(&name).map_err(CtlError::Invalid)?;
        }
        let _creating = spec
            .create
            .map(|_| self.create_lock.lock().unwrap_or_else(|p| p.into_inner()));
        if spec.image.is_relative() && !spec.is_rbd() {
            return Err(CtlError::Invalid(format!(
                "image path {} is relative; the daemon needs an absolute path",
                quoted_path(&spec.image)
            )));
        }
        if self.export(&name).is_some() {
            return Err(CtlError::NameTaken(name));
        }
        if let Some(m) = self.missing_spec(&name) {
            // The name stays taken by the recorded device; attaching its image
            // (again) brings it back now, as recorded.
            if m.spec.image != spec.image {
                return Err(CtlError::MissingTaken {
                    name,
                    image: quoted_path(&m.spec.image).to_string(),
                    reason: m.reason,
                });
            }
            if source == Source::Control {
                spec = bring_back::merge(&m.spec, &spec).map_err(|d| CtlError::MissingDiffers {
                    name: name.clone(),
                    image: quoted_path(&m.spec.image).to_string(),
                    reason: m.reason.clone(),
                    differs: bring_back::describe(&d),
                })?;
                dead_owner = spec.rbd_lock_owner.take();
            }
        }
        check_create(&spec).map_err(CtlError::Invalid)?;
        // A recorded device comes back only on its recorded file; an attach
        // opens the path as given and records what it finds.
        let recorded = spec.file.take();
        let opening = match source {
            Source::Restored | Source::Restoring => Opening::Recorded(recorded.clone()),
            Source::Control | Source::Static => Opening::First,
        };
        // An image created here is removed again by a failed open (Device::open)
        // or a lost race for the name (below): a failed attach leaves no trace.
        let params = DeviceParams {
            opening,
            rbd_take_back: dead_owner.clone(),
            ..params_with(&spec, &name, tuning)
        };
        let dev = Device::open(&params).map_err(|source| CtlError::Device {
            msg: format!("cannot attach {}", quoted_path(&spec.image)),
            source,
        })?;
        spec.file = dev.identity().cloned();
        spec.rbd_lock_owner = dev.rbd_lock_owner();
        let created = dev.created;
        // Record what was asked; `create` has done its job.
        spec.name = Some(name.clone());
        spec.create = None;
        // The image probed raw (or was declared so): a restart restores it as raw
        // whatever its clients write at byte 0 meanwhile.
        spec.format
            .get_or_insert(crate::backing::format::ImageFormat::Raw);
        let persist = source != Source::Static;
        let export = Arc::new(Export::new(dev, spec.clone(), persist));
        if let Ok(tx) = self.idle_tx.lock() {
            export.set_idle_notify(tx.clone());
        }
        // From the name check to the insertion under the log's lock: the record is
        // durable before anyone can see the device, and no other attach interleaves.
        let mut log = self.log.lock().map_err(|_| CtlError::ShuttingDown)?;
        let undo = |err: CtlError| {
            // Remove the image we made unless some export serves it.
            let in_use = self.all().iter().any(|e| e.current().0.path == spec.image);
            if created && !in_use {
                let _ = std::fs::remove_file(&spec.image);
            }
            err
        };
        if self.export(&name).is_some() {
            // Lost the name to an attach without `create` (those do not take
            // create_lock).
            return Err(undo(CtlError::NameTaken(name)));
        }
        let was_missing = self.missing_spec(&name).is_some();
        if source.restored() && !was_missing {
            // Detached, or attached by a client, while this retry opened the image.
            return Err(CtlError::NameTaken(name));
        }
        if source == Source::Control {
            self.write_record(&mut log, &format!("attach {name:?}"), |l| l.put(&spec))
                .map_err(undo)?;
        }
        if source == Source::Restoring && recorded != spec.file && dead_owner == spec.rbd_lock_owner
        {
            // Written with the others by the compaction that ends the restore
            // (a crash before it: the old record, checked as after a reboot).
            if let Some(l) = log.as_mut() {
                l.amend(&spec);
            }
        } else if source.restored() && (recorded != spec.file || dead_owner != spec.rbd_lock_owner)
        {
            // First seen in this boot (or recorded by an older loopd): from now
            // on the record names the file as found here, and the RBD lock's
            // owner of this run.
            let what = format!("record the file of {name:?}");
            if let Err(e) = self.write_record(&mut log, &what, |l| l.put(&spec)) {
                tracing::warn!("{}", e.body().message);
            }
        }
        {
            let mut t = self.exports.write().map_err(|_| CtlError::ShuttingDown)?;
            t.insert(name.clone(), Arc::clone(&export));
        }
        if was_missing {
            if let Ok(mut m) = self.missing.lock() {
                m.remove(&name);
            }
        }
        drop(log);
        if source == Source::Static && spec.is_rbd() {
            // Published: from now on a `kill -9` is taken back at the next
            // start.
            self.record_rbd_owner(&name, &spec, spec.rbd_lock_owner.clone());
        }
        self.follow_image_of(&export);
        Ok(self.info(&export))
    }

    /// A published RBD device hears when its image's header changes: the
    /// image's listener (on a librbd thread) sends the device's name to the
    /// thread that follows sizes ([`super::follow`]). That thread is also
    /// asked once now, for a resize between the open and this listener. A
    /// reconfiguration keeps the image, and with it the listener.
    fn follow_image_of(&self, export: &Export) {
        let (dev, _) = export.current();
        if let Backend::Rbd(img) = dev.backend()
            && let Ok(tx) = self.follow_tx.lock()
        {
            let (listener, name) = (tx.clone(), export.name.clone());
            let watched = img.on_update(Some(Box::new(move || {
                // The follower gone (the daemon stopping): nothing to tell.
                let _ = listener.send(name.clone());
            })));
            // Not watched (a snapshot, or librbd refused: the image said so):
            // `loopd resize` re-reads the size.
            if watched {
                let _ = tx.send(export.name.clone());
            }
        }
    }

    /// [`Daemon::start_blockdev`] for a new attach: if the block device cannot
    /// be made, the device is detached again, so an attach that asked for a
    /// block device either has one or did not happen.
    fn start_blockdev_or_undo(&self, name: &str) -> Result<(), CtlError> {
        let Some(e) = self.export(name) else {
            return Err(CtlError::NotFound(name.to_owned()));
        };
        self.start_blockdev_of(&e).inspect_err(|_| {
            if let Err(d) = self.detach_export(&e, true) {
                tracing::warn!("device {name:?}: undoing the attach failed: {d}");
            }
        })
    }
}

//! Attach: a device validated, opened and probed, then published in one step.
//!
//! Contract: an attach validates everything and opens the file *before* it
//! takes the table lock; the export becomes visible to clients in one
//! insertion, after its record is durable: under the state log's mutex it
//! checks the name, stages its record and claims the name; it waits for the
//! record's batch without any lock (group commit: concurrent attaches share
//! one write and one sync); then under the mutex again it publishes and drops
//! the claim (see [`super::record`]). A batch ([`Daemon::attach_batch`])
//! opens its devices on up to `BATCH_OPENERS` threads (scoped: joined before
//! it goes on), then stages all their records in one hold of the mutex, so
//! they share one write; once published, their block devices (if asked) are
//! made up to [`BLOCKDEV_THREADS`] at once, as at start (scoped threads of
//! [`super::pool`], joined before the reply).
//! A failed attach
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
use super::kernel::BLOCKDEV_THREADS;
use super::params::{Tuning, check_create, check_name, name_of, params_with};
use super::pool;
use super::record::Staged;
use super::registry::Daemon;
use super::state::StateLog;
use crate::backing::Backend;
use crate::backing::identity::FileIdentity;
use crate::control::proto::DeviceSpec;
use crate::device::export::Export;
use crate::device::{Device, DeviceParams, Opening};
use crate::text::quoted_path;
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Threads that open the devices of one batch at most (the control client's
/// own included).
const BATCH_OPENERS: usize = 4;

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

/// An attach opened and checked, not yet recorded nor published.
pub(super) struct Opened {
    name: String,
    spec: DeviceSpec,
    export: Arc<Export>,
    /// The attach created the image (a failed attach removes it again).
    created: bool,
    source: Source,
    /// The file identity and RBD lock owner the record named (a restore).
    recorded: Option<FileIdentity>,
    dead_owner: Option<String>,
}

/// An attach whose name is claimed and whose record is staged.
pub(super) struct Claimed {
    opened: Opened,
    staged: Staged,
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
        let asked = spec.create;
        let info = self.attach_inner(spec, source, Tuning::default(), false)?;
        let info = self.after_publish(info, source)?;
        Ok(self.create_note(asked, info))
    }

    /// Attach many devices from the control socket with one durable write:
    /// each is opened and checked on its own, the records of all that can be
    /// attached are staged together (one batch: one write, one `fdatasync`),
    /// then they are published. Each succeeds or fails on its own; the results
    /// are in the order of `specs`. A device that may create its image
    /// (`create`) is attached alone, in turn (`create_lock`).
    pub fn attach_batch(&self, specs: Vec<DeviceSpec>) -> Vec<Result<DeviceInfo, CtlError>> {
        let mut out: Vec<Option<Result<DeviceInfo, CtlError>>> =
            specs.iter().map(|_| None).collect();
        let mut todo = Vec::new();
        for (i, spec) in specs.into_iter().enumerate() {
            if spec.create.is_some() {
                out[i] = Some(self.attach(spec, true));
            } else {
                todo.push((i, spec));
            }
        }
        let mut opened = Vec::new();
        for (i, r) in self.open_many(todo) {
            match r {
                Ok(o) => opened.push((i, o)),
                Err(e) => out[i] = Some(Err(e)),
            }
        }
        // Staged in the order asked.
        opened.sort_by_key(|(i, _)| *i);
        // One hold of the log's lock: every record in one batch.
        let mut claims = Vec::new();
        {
            let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            let mut claimed = self.claimed.lock().unwrap_or_else(|p| p.into_inner());
            let mut ok = Vec::new();
            for (i, o) in opened {
                match self.check_name(&claimed, &o) {
                    Ok(()) => ok.push((i, o)),
                    Err(e) => out[i] = Some(Err(self.undo_open(&o, e))),
                }
            }
            // All records staged at once: one write, whatever else is staged.
            let specs: Vec<&DeviceSpec> = ok.iter().map(|(_, o)| &o.spec).collect();
            match self.stage_records(&log, &specs) {
                Ok(staged) => {
                    for ((i, o), staged) in ok.into_iter().zip(staged) {
                        claimed.insert(o.name.clone());
                        claims.push((i, Claimed { opened: o, staged }));
                    }
                }
                Err(()) => {
                    for (i, o) in ok {
                        out[i] = Some(Err(self.undo_open(&o, CtlError::ShuttingDown)));
                    }
                }
            }
        }
        // Block devices to make: several at once, as at start (making one
        // mostly waits for the kernel); none asked, no thread.
        let makers = claims
            .iter()
            .filter(|(_, c)| c.opened.spec.blockdev.is_some())
            .count();
        // The first wait leads the batch; the others find it durable.
        let mut published = Vec::new();
        for (i, c) in claims {
            match self.publish(c) {
                Ok(info) => published.push((i, info)),
                Err(e) => out[i] = Some(Err(e)),
            }
        }
        let threads = pool::threads_for(makers, 1, BLOCKDEV_THREADS);
        let made = pool::each(&published, threads, "loopd-blockdev", |_, (_, info)| {
            self.after_publish(info.clone(), Source::Control)
        });
        for ((i, _), r) in published.iter().zip(made) {
            out[*i] = Some(r);
        }
        out.into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(CtlError::Busy(
                        "this device of the batch could not be opened; try again".into(),
                    ))
                })
            })
            .collect()
    }

    /// Open the devices of a batch ([`Daemon::open_for_attach`]) on this
    /// thread and up to [`BATCH_OPENERS`]` - 1` scoped helpers (all joined
    /// here) taking work from one queue, as concurrent control clients would;
    /// results in any order.
    fn open_many(&self, todo: Vec<(usize, DeviceSpec)>) -> Vec<(usize, Result<Opened, CtlError>)> {
        let helpers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(BATCH_OPENERS)
            .min(todo.len() / 16)
            .saturating_sub(1);
        let queue = Mutex::new(todo);
        let done = Mutex::new(Vec::new());
        let work = || {
            loop {
                let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop();
                let Some((i, spec)) = next else { return };
                let r = self.open_for_attach(spec, Source::Control, Tuning::default(), false);
                done.lock().unwrap_or_else(|p| p.into_inner()).push((i, r));
            }
        };
        std::thread::scope(|s| {
            for _ in 0..helpers {
                // Without a helper thread this one does the work.
                let _ = std::thread::Builder::new()
                    .name("loopd-batch-open".into())
                    .spawn_scoped(s, work);
            }
            work();
        });
        done.into_inner().unwrap_or_else(|p| p.into_inner())
    }

    /// After an attach is published: the reachability warning, and the block
    /// device it asked for (or the attach is undone).
    fn after_publish(&self, info: DeviceInfo, source: Source) -> Result<DeviceInfo, CtlError> {
        if source == Source::Control {
            self.warn_if_unreachable(&info.name);
        }
        self.start_blockdev_or_undo(&info.name)?;
        Ok(self.export(&info.name).map_or(info, |e| self.info(&e)))
    }

    /// Attach the device `loopd serve IMAGE` names: it is the default export (so
    /// its name may be empty) and may carry benchmark switches.
    pub fn attach_default(&self, spec: DeviceSpec, tuning: Tuning) -> Result<DeviceInfo, CtlError> {
        let asked = spec.create;
        let info = self.attach_inner(spec, Source::Static, tuning, true)?;
        self.set_default(&info.name);
        self.start_blockdev_or_undo(&info.name)?;
        let info = self.export(&info.name).map_or(info, |e| self.info(&e));
        Ok(self.create_note(asked, info))
    }

    /// One attach: open, claim and stage, wait until durable, publish.
    pub(super) fn attach_inner(
        &self,
        spec: DeviceSpec,
        source: Source,
        tuning: Tuning,
        is_default: bool,
    ) -> Result<DeviceInfo, CtlError> {
        // Racing attaches that may create the image: one at a time, from the
        // name check to publication.
        let _creating = spec
            .create
            .map(|_| self.create_lock.lock().unwrap_or_else(|p| p.into_inner()));
        let o = self.open_for_attach(spec, source, tuning, is_default)?;
        let c = {
            let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            let mut claimed = self.claimed.lock().unwrap_or_else(|p| p.into_inner());
            self.claim(&log, &mut claimed, o)?
        };
        self.publish(c)
    }

    /// Validate `spec` and open its device (no lock held but `create_lock`).
    fn open_for_attach(
        &self,
        mut spec: DeviceSpec,
        source: Source,
        tuning: Tuning,
        is_default: bool,
    ) -> Result<Opened, CtlError> {
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
            // (again) brings it back now, as recorded. A device of --config
            // kept as missing comes back from --config only (a retry, a
            // reload), as the file says now.
            if m.from_config && source == Source::Control {
                return Err(CtlError::ConfigMissing {
                    name,
                    reason: m.reason,
                });
            }
            if !m.from_config && m.spec.image != spec.image {
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
        spec.preallocate = false;
        // The image probed raw (or was declared so): a restart restores it as raw
        // whatever its clients write at byte 0 meanwhile.
        spec.format
            .get_or_insert(crate::backing::format::ImageFormat::Raw);
        let persist = source != Source::Static;
        let export = Arc::new(Export::new(dev, spec.clone(), persist));
        if let Ok(tx) = self.idle_tx.lock() {
            export.set_idle_notify(tx.clone());
        }
        Ok(Opened {
            name,
            spec,
            export,
            created,
            source,
            recorded,
            dead_owner,
        })
    }

    /// A failed attach leaves no trace: the image it created is removed
    /// unless some export serves it.
    fn undo_open(&self, o: &Opened, err: CtlError) -> CtlError {
        let in_use = self
            .all()
            .iter()
            .any(|e| e.current().0.path == o.spec.image);
        if o.created && !in_use {
            let _ = std::fs::remove_file(&o.spec.image);
        }
        err
    }

    /// Under the log's lock (`log`, then `claimed`): check the name is free,
    /// stage the record and claim the name, so no other attach takes it and
    /// records are staged in the order of these checks.
    fn claim(
        &self,
        log: &Option<Arc<StateLog>>,
        claimed: &mut BTreeSet<String>,
        o: Opened,
    ) -> Result<Claimed, CtlError> {
        let name = o.name.clone();
        if let Err(e) = self.check_name(claimed, &o) {
            return Err(self.undo_open(&o, e));
        }
        let staged = match o.source {
            Source::Control => match self.stage_record(log, |l| l.stage_put(&o.spec)) {
                Ok(s) => s,
                Err(e) => return Err(self.undo_open(&o, e)),
            },
            // Only the file as found in this boot changed, at start: written
            // with the others by the compaction that ends the restore (a
            // crash before it: the old record, checked as after a reboot).
            Source::Restoring
                if o.recorded != o.spec.file && o.dead_owner == o.spec.rbd_lock_owner =>
            {
                if let Some(l) = log {
                    l.amend(&o.spec);
                }
                Staged::NONE
            }
            // First seen in this boot (or recorded by an older loopd): from now
            // on the record names the file as found here, and the RBD lock's
            // owner of this run.
            Source::Restored | Source::Restoring
                if o.recorded != o.spec.file || o.dead_owner != o.spec.rbd_lock_owner =>
            {
                self.stage_record(log, |l| l.stage_put(&o.spec))
                    .unwrap_or(Staged::NONE)
            }
            Source::Restored | Source::Restoring | Source::Static => Staged::NONE,
        };
        claimed.insert(name);
        Ok(Claimed { opened: o, staged })
    }

    /// Under the log's lock: whether `o` may take its name (no device, no
    /// other attach's claim; a retry only while the device is missing).
    fn check_name(&self, claimed: &BTreeSet<String>, o: &Opened) -> Result<(), CtlError> {
        if self.export(&o.name).is_some() || claimed.contains(&o.name) {
            // Lost the name to another attach.
            return Err(CtlError::NameTaken(o.name.clone()));
        }
        if o.source.restored() && self.missing_spec(&o.name).is_none() {
            // Detached, or attached by a client, while this retry opened the image.
            return Err(CtlError::NameTaken(o.name.clone()));
        }
        Ok(())
    }

    /// Wait (no lock held) until the claimed attach's record is durable, then
    /// publish the device and drop the claim in one hold of the log's lock; if
    /// the record failed, only drop the claim and undo the open.
    fn publish(&self, c: Claimed) -> Result<DeviceInfo, CtlError> {
        let Claimed { opened: o, staged } = c;
        let name = o.name.clone();
        let mut r = if o.source.restored() {
            staged.wait(&format!("record the file of {name:?}"))
        } else {
            staged.wait(&format!("attach {name:?}"))
        };
        if let (Err(e), true) = (&r, o.source.restored()) {
            // The device comes back; its record keeps the old file's name.
            tracing::warn!("{}", e.body().message);
            r = Ok(());
        }
        {
            let _log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            let mut claimed = self.claimed.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = r {
                claimed.remove(&name);
                drop(claimed);
                return Err(self.undo_open(&o, e));
            }
            {
                let mut t = self.exports.write().unwrap_or_else(|p| p.into_inner());
                t.insert(name.clone(), Arc::clone(&o.export));
            }
            claimed.remove(&name);
            if let Ok(mut m) = self.missing.lock() {
                m.remove(&name);
            }
        }
        if o.source == Source::Static && o.spec.is_rbd() {
            // Published: from now on a `kill -9` is taken back at the next
            // start.
            self.record_rbd_owner(&name, &o.spec, o.spec.rbd_lock_owner.clone());
        }
        self.follow_image_of(&o.export);
        Ok(self.info(&o.export))
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
                return;
            }
            // A failed attach leaves no trace: the image it created goes too
            // (unless another device serves that file meanwhile).
            let (dev, _) = e.current();
            let in_use = self.all().iter().any(|o| o.current().0.path == dev.path);
            if dev.created() && !in_use {
                if let Err(r) = std::fs::remove_file(&dev.path) {
                    tracing::warn!(
                        "device {name:?}: cannot remove the image {} it created: {r}",
                        quoted_path(&dev.path)
                    );
                }
            }
        })
    }

    /// The note an attach with `create` gets when the image was there
    /// already: the existing file is kept and served at its own size.
    fn create_note(&self, asked: Option<u64>, mut info: DeviceInfo) -> DeviceInfo {
        let Some(asked) = asked else { return info };
        let Some(e) = self.export(&info.name) else {
            return info;
        };
        let (dev, _) = e.current();
        if !dev.created() {
            let note = format!(
                "{} exists: kept as it is (--create {asked} creates only a missing image); \
                 the device serves its {} bytes",
                quoted_path(&dev.path),
                info.size
            );
            tracing::info!("device {:?}: {note}", info.name);
            info.note = Some(note);
        }
        info
    }
}

//! State handling: the daemon's side of its state file ([`super::state`]).
//!
//! Contract: the state log is opened and locked first thing at start
//! ([`Daemon::open_state`]: a second daemon on the same file stops there);
//! every change it records (attach, set, detach) is written durably *before*
//! it takes effect and before the reply, and if it cannot be, the request
//! fails and changes nothing. Group commit: a record is staged
//! ([`Daemon::stage_record`]) under the daemon's `log` mutex — the first lock
//! of the daemon's lock order (see [`super::registry`]), so records are
//! staged in the order of the checks made under it — and waited for
//! ([`Staged::wait`]) *without* it, so concurrent requests on their control
//! threads share one write and one `fdatasync`. An attach stages its record
//! and claims its name (`claimed`) in one hold of `log`, waits, and then,
//! under `log` again, publishes the device and drops the claim (or only drops
//! the claim if its batch failed): no client sees a device the state file
//! lacks, and no two attaches claim one name. A `set` or a detach runs under
//! its export's control lock, which orders that export's records. At stop
//! the file is compacted and closed ([`Daemon::close_state`]); nothing is
//! recorded after that, and a change asked for then fails. Its lock is let
//! go only after the devices are (the [`ClosedState`] dropped last), so no
//! daemon can start on it while this one still holds an image's lock. Waiting blocks
//! (up to two batches' `fdatasync`): these run on control threads, never on a
//! reactor.
//!
//! Devices from the command line and `--config` are not recorded (they come
//! back from there); see [`super::restore`] for what comes back at start.
//! Only their RBD lock owners are kept, in the state file's sidecar
//! ([`super::rbd_owners`]): read with the state file, written as a lock is
//! taken or a device detached, emptied at stop after the devices' locks and
//! before the state file's lock go.

use super::error::CtlError;
use super::rbd_owners::{self, RbdOwners};
use super::registry::Daemon;
use super::state;
use crate::control::proto::DeviceSpec;
use crate::device::export::Export;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// A record staged in the state log, to be waited for before its change is
/// acknowledged; `None`: nothing to record (no state file, or a device that
/// is not recorded).
pub(super) struct Staged(Option<(Arc<state::StateLog>, state::Pending)>);

impl Staged {
    pub(super) const NONE: Staged = Staged(None);

    /// Wait until the record is durable (see [`state::StateLog::wait`]). A
    /// failed write fails the request `what` (e.g. `attach "a"`).
    pub(super) fn wait(self, what: &str) -> Result<(), CtlError> {
        let Some((log, p)) = self.0 else {
            return Ok(());
        };
        log.wait(p).map_err(|source| CtlError::State {
            msg: format!("cannot {what}: the state file cannot record it"),
            source,
        })
    }
}

/// The state file after [`Daemon::close_state`]: closed to changes, still
/// locked. Dropped once the daemon has let its devices go (flushed, RBD
/// locks released): then the sidecar is emptied and the state file's lock
/// goes, so a daemon started meanwhile is refused (`in use`) instead of
/// finding the state file free while this one still holds an image's lock —
/// which it would take for its dead self's and break.
#[must_use = "dropping it releases the state file's lock: keep it until the devices are let go"]
pub struct ClosedState {
    log: Option<Arc<state::StateLog>>,
    owners: Option<RbdOwners>,
}

impl Drop for ClosedState {
    fn drop(&mut self) {
        // The locks went at stop: no owner is left to take back.
        if let Some(owners) = self.owners.as_mut()
            && let Err(e) = owners.clear()
        {
            tracing::warn!("{e}");
        }
        self.owners = None;
        // Now the lock of the state file goes (with the last holder of the
        // log: a request still waiting for its batch lets go at once).
        self.log = None;
    }
}

impl Daemon {
    /// Stage one record in the state log (the caller holds the log's lock, so
    /// records are staged in the order of its checks), to be waited for
    /// ([`Staged::wait`]) before the change it records takes effect. Once the
    /// log is closed at stop nothing may change unrecorded; a daemon without a
    /// state file records nothing.
    pub(super) fn stage_record(
        &self,
        log: &Option<Arc<state::StateLog>>,
        f: impl FnOnce(&state::StateLog) -> state::Pending,
    ) -> Result<Staged, CtlError> {
        match log {
            Some(l) => Ok(Staged(Some((Arc::clone(l), f(l))))),
            None if self.state.is_some() && self.stopping.load(Ordering::SeqCst) => {
                Err(CtlError::ShuttingDown)
            }
            None => Ok(Staged::NONE),
        }
    }

    /// [`Daemon::stage_record`] of the attach records of `specs`, all at once
    /// (so they go out in one write); `Err` once the log is closed at stop.
    pub(super) fn stage_records(
        &self,
        log: &Option<Arc<state::StateLog>>,
        specs: &[&DeviceSpec],
    ) -> Result<Vec<Staged>, ()> {
        match log {
            Some(l) => Ok(l
                .stage_puts(specs)
                .into_iter()
                .map(|p| Staged(Some((Arc::clone(l), p))))
                .collect()),
            None if self.state.is_some() && self.stopping.load(Ordering::SeqCst) => Err(()),
            None => Ok(specs.iter().map(|_| Staged::NONE).collect()),
        }
    }

    /// Stage a record under the log's lock, then wait for it without the lock
    /// (so concurrent requests share one write and one sync).
    fn record_one(
        &self,
        what: &str,
        f: impl FnOnce(&state::StateLog) -> state::Pending,
    ) -> Result<(), CtlError> {
        let staged = {
            let log = self.log.lock().map_err(|_| CtlError::ShuttingDown)?;
            self.stage_record(&log, f)?
        };
        staged.wait(what)
    }

    /// Durably record `spec` as `e`'s configuration (before it is applied; the
    /// caller holds `e`'s control lock, which orders `e`'s records).
    pub(super) fn record_put(&self, e: &Export, spec: &DeviceSpec) -> Result<(), CtlError> {
        if !e.persistent {
            return Ok(());
        }
        self.record_one(&format!("change {:?}", e.name), |l| l.stage_put(spec))
    }

    /// Durably record that `e` is gone (before it is unpublished); a failure
    /// fails the detach.
    pub(super) fn record_del(&self, e: &Export) -> Result<(), CtlError> {
        if !e.persistent {
            return Ok(());
        }
        self.record_one(&format!("detach {:?}", e.name), |l| l.stage_del(&e.name))
    }

    /// Lock and read the state file (first thing at start: a second daemon on
    /// the same file, or a file that is not a state file, stops here).
    pub fn open_state(&self) -> Result<(), state::StateError> {
        let Some(path) = &self.state else {
            return Ok(());
        };
        let log = state::StateLog::open(path)?;
        // Read under the state file's lock: its owners are of a dead run.
        let owners = RbdOwners::load(path);
        if let Ok(mut g) = self.log.lock() {
            *g = Some(Arc::new(log));
        }
        if let Ok(mut g) = self.rbd_owners.lock() {
            *g = Some(owners);
        }
        Ok(())
    }

    /// The RBD lock owner this daemon's previous run recorded for the
    /// device `name` of `--config` or `serve rbd:…`, if it was the same
    /// image, configuration and id (see [`super::rbd_owners`]).
    pub(super) fn previous_rbd_owner(&self, name: &str, spec: &DeviceSpec) -> Option<String> {
        let want = rbd_owners::owner_of(name, spec, String::new())?;
        let g = self.rbd_owners.lock().ok()?;
        g.as_ref()?.previous(&want)
    }

    /// Record (durably) the lock owner the device `name` of `--config` or
    /// `serve rbd:…` took its image's lock as; `None` (no lock taken):
    /// forget the name's owner. A failure is logged: the device serves, and
    /// a `kill -9` then costs Ceph's watch timeout at the next start.
    pub(super) fn record_rbd_owner(&self, name: &str, spec: &DeviceSpec, owner: Option<String>) {
        let Ok(mut g) = self.rbd_owners.lock() else {
            return;
        };
        let Some(owners) = g.as_mut() else { return };
        let r = match owner.and_then(|o| rbd_owners::owner_of(name, spec, o)) {
            Some(o) => owners.set(o),
            None => owners.remove(name),
        };
        if let Err(e) = r {
            tracing::warn!(
                "device {name:?}: {e}; after a kill -9 the next start waits for Ceph's watch \
                 timeout (~30 s) for its lock"
            );
        }
    }

    /// Forget the lock owner of the device `name` of `--config` or `serve
    /// rbd:…` (detached: its lock goes with it).
    pub(super) fn forget_rbd_owner(&self, name: &str) {
        let Ok(mut g) = self.rbd_owners.lock() else {
            return;
        };
        if let Some(owners) = g.as_mut()
            && let Err(e) = owners.remove(name)
        {
            tracing::warn!("device {name:?} detached: {e}");
        }
    }

    /// At stop: compact the state file and close it to changes: nothing is
    /// recorded after this. Its lock (and the sidecar) stay with the returned
    /// [`ClosedState`] until the caller drops it.
    pub fn close_state(&self) -> ClosedState {
        self.write_state();
        let owners = self.rbd_owners.lock().ok().and_then(|mut g| g.take());
        let log = self.log.lock().ok().and_then(|mut g| g.take());
        ClosedState { log, owners }
    }

    /// Compact the state file (rewrite it from its table).
    pub fn write_state(&self) {
        let Some(log) = self.log.lock().ok().and_then(|g| g.clone()) else {
            return;
        };
        if let Err(e) = log.compact() {
            tracing::error!("{e:#}");
        }
    }
}

/// The default state file for a control socket: persistent storage, not `/run`
/// (root: `/var/lib/loopd/STEM.state`; others: `$XDG_STATE_HOME/loopd/` or
/// `~/.local/state/loopd/`), where STEM is the control socket's file stem.
pub fn default_state_path(control: &Path) -> PathBuf {
    let stem = control
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "loopd".into());
    let dir = if rustix::process::geteuid().is_root() {
        PathBuf::from("/var/lib/loopd")
    } else {
        match (std::env::var_os("XDG_STATE_HOME"), std::env::var_os("HOME")) {
            (Some(d), _) if !d.is_empty() => Path::new(&d).join("loopd"),
            (_, Some(h)) if !h.is_empty() => Path::new(&h).join(".local/state/loopd"),
            _ => PathBuf::from(format!(
                "/tmp/loopd-{}",
                rustix::process::geteuid().as_raw()
            )),
        }
    };
    dir.join(format!("{stem}.state"))
}

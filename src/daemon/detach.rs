//! Detach: a device removed, its clients refused or cut off.
//!
//! Contract: without `force` a detach refuses while clients are connected or
//! its block device is in use; with it, connections are cut off (sockets shut
//! down, file I/O in flight cancelled) and the block device removed. The
//! removal is recorded durably before anything else happens; if it cannot be,
//! the device stays as it was. Once a detach returns `Ok` no connection to the
//! device exists and none can be made. Blocks: waiting up to
//! [`FORCE_TIMEOUT`] for connections to close, and the device's `fdatasync`.

use super::error::CtlError;
use super::registry::Daemon;
use crate::device::export::Export;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long detach lets a block device's openers go away before it counts
/// them as users (see [`crate::blockdev::users::settled_users`]).
const USERS_SETTLE: Duration = Duration::from_secs(2);

/// A detach without `force` refused because `n` clients are connected.
fn clients_busy(name: &str, n: u32) -> CtlError {
    CtlError::Busy(format!(
        "device {name:?} has {n} connected client(s); disconnect them or use --force"
    ))
}

/// How long a forced detach waits for its connections to close (a connection
/// closes at once unless file I/O it started does not return).
pub const FORCE_TIMEOUT: Duration = Duration::from_secs(5);

impl Daemon {
    /// Remove a device. Without `force` it refuses while clients are connected
    /// (a connection counts from the moment its handshake selected the device);
    /// with it, connections are cut off: sockets shut down, file I/O in flight
    /// cancelled. Either way, once this returns `Ok` no connection to the device
    /// exists and none can be made. A forced detach whose connections cannot be
    /// closed within [`FORCE_TIMEOUT`] (file I/O that does not return) says so.
    pub fn detach(&self, name: &str, force: bool) -> Result<(), CtlError> {
        if let Some(r) = self.detach_missing(name) {
            return r;
        }
        let e = self
            .export(name)
            .ok_or_else(|| CtlError::NotFound(name.to_owned()))?;
        if let Some(b) = self.blockdev(name) {
            let path = b.path();
            let n = e.clients().saturating_sub(b.own_clients());
            if !force && n > 0 {
                return Err(clients_busy(name, n));
            }
            if !force && let Some(who) = crate::blockdev::users::settled_users(&path, USERS_SETTLE)
            {
                return Err(CtlError::Busy(format!(
                    "device {name:?}: {} is in use ({who}); unmount or close it, or use --force",
                    path.display()
                )));
            }
            // Without --force the kernel refuses if the disk was opened since.
            self.remove_blockdev(name, !force)?;
        }
        self.detach_export(&e, force)
    }

    /// Remove export `e` (see [`Daemon::detach`]).
    pub(super) fn detach_export(&self, e: &Arc<Export>, force: bool) -> Result<(), CtlError> {
        let name = e.name.as_str();
        let _g = e.control();
        let n = e.close(force).map_err(|n| clients_busy(name, n))?;
        // The removal is durable before anything else happens; if it cannot be
        // recorded the device stays as it was.
        if let Err(err) = self.record_del(e) {
            e.reopen();
            return Err(err);
        }
        self.unpublish(e);
        e.current().0.retire();
        if !e.persistent {
            // A device of `--config` or `serve rbd:…`: its lock goes with it.
            self.forget_rbd_owner(name);
        }
        if n > 0 {
            self.kick_reactors();
            self.kick_handshakes();
            let deadline = Instant::now() + FORCE_TIMEOUT;
            while e.clients() > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        let (dev, _) = e.current();
        if !dev.read_only {
            let _ = dev.sync_data();
        }
        let left = e.clients();
        if left > 0 {
            return Err(CtlError::Busy(format!(
                "device {name:?} is detached and its clients are disconnected, but {left} \
                 connection(s) still wait for file I/O that has not returned within {}s (is the \
                 backing store hung?); they can do nothing more and close when it returns",
                FORCE_TIMEOUT.as_secs()
            )));
        }
        Ok(())
    }

    /// Detach a missing device: drop its record. `None` if `name` is not missing.
    /// An attach of the name that is being recorded (a retry bringing it back)
    /// is waited for first (bounded): then the name is a device, not missing.
    pub(super) fn detach_missing(&self, name: &str) -> Option<Result<(), CtlError>> {
        if self.missing_config(name) {
            // Not in the state file: nothing to record. The next reload
            // attaches it again while the config file lists it.
            if let Ok(mut m) = self.missing.lock() {
                m.remove(name);
            }
            tracing::info!("detached missing device {name:?} of --config");
            return Some(Ok(()));
        }
        let deadline = Instant::now() + FORCE_TIMEOUT;
        let staged = loop {
            let log = match self.log.lock() {
                Ok(l) => l,
                Err(_) => return Some(Err(CtlError::ShuttingDown)),
            };
            self.missing_spec(name)?;
            let mut claimed = self.claimed.lock().unwrap_or_else(|p| p.into_inner());
            if claimed.contains(name) {
                drop((claimed, log));
                if Instant::now() > deadline {
                    return Some(Err(CtlError::Busy(format!(
                        "device {name:?} is being attached; try again"
                    ))));
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            match self.stage_record(&log, |l| l.stage_del(name)) {
                Ok(s) => {
                    // Claimed while the removal is recorded: no attach takes
                    // the name meanwhile.
                    claimed.insert(name.to_owned());
                    break s;
                }
                Err(e) => return Some(Err(e)),
            }
        };
        let r = staged.wait(&format!("detach {name:?}"));
        let _log = self.log.lock();
        if let Ok(mut c) = self.claimed.lock() {
            c.remove(name);
        }
        if let Err(e) = r {
            return Some(Err(e));
        }
        if let Ok(mut m) = self.missing.lock() {
            m.remove(name);
        }
        tracing::info!("detached missing device {name:?}");
        Some(Ok(()))
    }
}

//! The [`Daemon`]: what it owns, and the lookups every control action shares.
//!
//! Ownership and locks. The export table and the default name are `RwLock`s
//! held only to look up, insert or remove (never across file I/O or a freeze);
//! an action on one export takes that export's own control lock
//! ([`Export::control`]), so actions on different devices never wait for each
//! other, and reactors take none of these locks. The state log's mutex
//! (`log`) orders the staging of records with the name checks and
//! publication, and `claimed` (names whose attach is staged but not yet
//! published) is only changed under it: lock order is `log`, then `claimed`,
//! then `exports`, then `missing`; neither is held while a record is waited
//! for (see [`super::record`]). `blockdevs`, `create_lock`, `rbd_owners` and
//! the rest are taken alone. A poisoned lock is taken over (its data stays
//! consistent: every critical section here is one insertion or removal).
//!
//! The fields are `pub(super)`: the daemon's other files are `impl Daemon`
//! blocks, one per kind of work (see [`super`]), that share them. This file
//! calls none of them.

use super::blockdev::KernelDev;
use super::endpoints::Endpoints;
use super::error::CtlError;
use super::info::{DeviceInfo, DeviceStatus};
use super::rbd_owners::RbdOwners;
use super::state;
use crate::control::proto::DeviceSpec;
use crate::device::Device;
use crate::device::export::{ClientRef, Export};
use crate::frontend::nbd::handshake::Exports;
use crate::reactor::ReactorHandle;
use crate::tls::TlsContext;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, RwLock};

/// The daemon: its exports (live and missing), their kernel block devices,
/// the state log, and what the server gave it (reactors, endpoints, TLS).
pub struct Daemon {
    pub(super) exports: RwLock<BTreeMap<String, Arc<Export>>>,
    /// The export the empty name selects.
    pub(super) default_name: RwLock<Option<String>>,
    pub(super) reactors: RwLock<Vec<Arc<ReactorHandle>>>,
    pub(super) endpoints: RwLock<Endpoints>,
    pub(super) state: Option<PathBuf>,
    /// The open state log (after [`Daemon::open_state`]); its mutex orders
    /// records and publication (see [`super::record`]).
    pub(super) log: Mutex<Option<Arc<state::StateLog>>>,
    /// Names an attach has claimed (its record staged, the device not yet
    /// published): changed only under `log`.
    pub(super) claimed: Mutex<BTreeSet<String>>,
    /// The RBD lock owners of the devices the state file does not hold
    /// (`serve rbd:…`, `--config`), while the state file is open (see
    /// [`super::rbd_owners`]). Taken alone.
    pub(super) rbd_owners: Mutex<Option<RbdOwners>>,
    /// Recorded devices that could not be attached (yet), by name.
    pub(super) missing: Mutex<BTreeMap<String, Missing>>,
    /// Serialises attaches that may create their image, from the name check to
    /// publication: of racing `create` attaches exactly one creates, opens and
    /// publishes, and a loser never removes a file another attach serves.
    pub(super) create_lock: Mutex<()>,
    pub(super) idle_tx: Mutex<Sender<String>>,
    pub(super) idle_rx: Mutex<Option<Receiver<String>>>,
    /// Names of devices whose RBD image's header changed (see [`super::follow`]).
    pub(super) follow_tx: Mutex<Sender<String>>,
    pub(super) follow_rx: Mutex<Option<Receiver<String>>>,
    pub(super) stopping: AtomicBool,
    /// Pokes the handshake loop (see [`Daemon::set_handshake_kick`]).
    pub(super) handshake_kick: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
    /// Block devices handed to the kernel, by device name.
    pub(super) blockdevs: Mutex<BTreeMap<String, Arc<KernelDev>>>,
    /// The NBD server's TLS certificates, when TLS is on.
    pub(super) tls: RwLock<Option<Arc<TlsContext>>>,
    /// The `--config` file and the devices last read from it (see [`super::reload`]).
    pub(super) config: Mutex<Option<(PathBuf, Vec<DeviceSpec>)>>,
}

/// A device that is not attached: its spec and why. Recorded in the state
/// file, or (`from_config`) a device of `--config` whose attach failed, at
/// start or on a reload: not in the state file, the config file is its record.
#[derive(Debug, Clone)]
pub(super) struct Missing {
    pub(super) spec: DeviceSpec,
    pub(super) reason: String,
    pub(super) from_config: bool,
}

impl Daemon {
    pub fn new(state: Option<PathBuf>) -> Arc<Daemon> {
        let (tx, rx) = channel();
        let (follow_tx, follow_rx) = channel();
        Arc::new(Daemon {
            exports: RwLock::default(),
            default_name: RwLock::default(),
            reactors: RwLock::default(),
            endpoints: RwLock::default(),
            state,
            log: Mutex::new(None),
            claimed: Mutex::new(BTreeSet::new()),
            rbd_owners: Mutex::new(None),
            missing: Mutex::default(),
            create_lock: Mutex::new(()),
            idle_tx: Mutex::new(tx),
            idle_rx: Mutex::new(Some(rx)),
            follow_tx: Mutex::new(follow_tx),
            follow_rx: Mutex::new(Some(follow_rx)),
            stopping: AtomicBool::new(false),
            handshake_kick: Mutex::new(None),
            blockdevs: Mutex::default(),
            tls: RwLock::new(None),
            config: Mutex::new(None),
        })
    }

    pub fn set_reactors(&self, r: Vec<Arc<ReactorHandle>>) {
        if let Ok(mut g) = self.reactors.write() {
            *g = r;
        }
    }

    pub fn reactors(&self) -> Vec<Arc<ReactorHandle>> {
        self.reactors.read().map(|r| r.clone()).unwrap_or_default()
    }

    /// The server's TLS certificates (reloaded by [`Daemon::reload_tls`]).
    pub fn set_tls(&self, t: Arc<TlsContext>) {
        if let Ok(mut g) = self.tls.write() {
            *g = Some(t);
        }
    }

    /// Warn when device `name` is limited to TLS identities no client can
    /// prove: without TLS, or without client certificates (`--tls-verify-peer`).
    pub fn warn_if_unreachable(&self, name: &str) {
        let Some(e) = self.export(name) else {
            return;
        };
        let allow = e.spec().tls_allow;
        if allow.is_empty() {
            return;
        }
        let why = match self.tls.read().ok().and_then(|g| g.clone()) {
            None => "the server runs without TLS",
            Some(t) if !t.files().verify_peer => {
                "the server asks no client certificate (start it with --tls-verify-peer)"
            }
            Some(_) => return,
        };
        tracing::warn!(
            "device {name:?} is limited to TLS identities {allow:?}, but {why}: no NBD client can open it"
        );
    }

    /// Re-read the TLS certificates; on error the old ones stay in use.
    pub fn reload_tls(&self) -> Result<(), CtlError> {
        let t = self.tls.read().ok().and_then(|g| g.clone());
        let Some(t) = t else {
            return Err(CtlError::TlsOff);
        };
        t.reload().map_err(|e| {
            tracing::error!(
                "TLS certificates not reloaded (the old ones stay in use): {}",
                crate::text::error_chain(&e)
            );
            CtlError::Tls(e)
        })
    }

    pub fn set_endpoints(&self, e: Endpoints) {
        if let Ok(mut g) = self.endpoints.write() {
            *g = e;
        }
    }

    pub fn endpoints(&self) -> Endpoints {
        self.endpoints.read().map(|e| e.clone()).unwrap_or_default()
    }

    pub fn set_stopping(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    pub fn export(&self, name: &str) -> Option<Arc<Export>> {
        let t = self.exports.read().ok()?;
        if name.is_empty() {
            // Only `serve IMAGE` makes a default export; otherwise the empty name
            // selects nothing (never "whichever device sorts first").
            let d = self.default_name.read().ok()?.clone()?;
            return t.get(&d).cloned();
        }
        t.get(name).cloned()
    }

    pub fn all(&self) -> Vec<Arc<Export>> {
        self.exports
            .read()
            .map(|t| t.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Make `name` the export the empty name selects.
    pub fn set_default(&self, name: &str) {
        if let Ok(mut d) = self.default_name.write() {
            *d = Some(name.to_owned());
        }
    }

    pub(super) fn info(&self, e: &Export) -> DeviceInfo {
        let mut i = DeviceInfo::of(e, &self.endpoints());
        if let Some(b) = self.blockdev(&e.name) {
            i.partitions = crate::blockdev::partitions::current(&b.path())
                .map(|ps| ps.into_iter().map(|p| p.device).collect())
                .unwrap_or_default();
            blockdev_info(&b, &mut i);
        }
        i
    }

    /// The block device of device `name`, if it has one.
    pub(super) fn blockdev(&self, name: &str) -> Option<Arc<KernelDev>> {
        let g = self.blockdevs.lock().unwrap_or_else(|p| p.into_inner());
        g.get(name).cloned()
    }

    pub(super) fn missing_spec(&self, name: &str) -> Option<Missing> {
        self.missing.lock().ok()?.get(name).cloned()
    }

    /// Whether `name` is a device of `--config` kept as missing.
    pub(super) fn missing_config(&self, name: &str) -> bool {
        self.missing_spec(name).is_some_and(|m| m.from_config)
    }

    pub(super) fn set_missing_reason(&self, name: &str, reason: String) {
        if let Ok(mut m) = self.missing.lock() {
            if let Some(x) = m.get_mut(name) {
                x.reason = reason;
            }
        }
    }

    pub(super) fn unpublish(&self, e: &Arc<Export>) {
        if let Ok(mut t) = self.exports.write() {
            if t.get(&e.name).is_some_and(|x| Arc::ptr_eq(x, e)) {
                t.remove(&e.name);
            }
        }
    }

    /// Make the handshake loop drop pending connections of closed exports.
    pub(super) fn kick_handshakes(&self) {
        if let Ok(k) = self.handshake_kick.lock() {
            if let Some(k) = k.as_ref() {
                k();
            }
        }
    }

    /// Where to poke the handshake loop (set by the server).
    pub fn set_handshake_kick(&self, k: Box<dyn Fn() + Send + Sync>) {
        if let Ok(mut g) = self.handshake_kick.lock() {
            *g = Some(k);
        }
    }

    /// Make every reactor look at its connections' exports again.
    pub(super) fn kick_reactors(&self) {
        for r in self.reactors() {
            r.kick();
        }
    }

    /// Live devices and missing ones, by name in natural order (`new2`
    /// before `new10`, [`crate::text::natural_cmp`]).
    pub fn list(&self) -> Vec<DeviceInfo> {
        let mut v: Vec<DeviceInfo> = self.all().iter().map(|e| self.info(e)).collect();
        if let Ok(m) = self.missing.lock() {
            v.extend(
                m.iter()
                    .map(|(n, x)| DeviceInfo::missing(n, &x.spec, &x.reason)),
            );
        }
        v.sort_by(|a, b| crate::text::natural_cmp(&a.name, &b.name));
        v
    }

    pub fn status(&self, name: &str) -> Result<DeviceStatus, CtlError> {
        let Some(e) = self.export(name) else {
            return match self.missing_spec(name) {
                Some(x) => Ok(DeviceStatus::missing(DeviceInfo::missing(
                    name, &x.spec, &x.reason,
                ))),
                None => Err(CtlError::NotFound(name.to_owned())),
            };
        };
        let mut st = DeviceStatus::of(&e, &self.endpoints());
        if let Some(b) = self.blockdev(name) {
            blockdev_info(&b, &mut st.info);
        }
        Ok(st)
    }

    /// Every device's status (live and missing), in [`Daemon::list`]'s order.
    pub fn status_all(&self) -> Vec<DeviceStatus> {
        let names: Vec<String> = self.list().into_iter().map(|i| i.name).collect();
        // A device detached meanwhile is left out.
        names.iter().filter_map(|n| self.status(n).ok()).collect()
    }
}

/// What a device's report says of its kernel block device `b`: its path and,
/// for ublk, the kernel's features and the fast paths the device uses.
fn blockdev_info(b: &KernelDev, i: &mut DeviceInfo) {
    i.blockdev = Some(b.path());
    if let KernelDev::Ublk(u) = b {
        i.ublk_fast_paths = Some(u.fast_paths());
        i.ublk_kernel_features = Some(u.kernel_features());
    }
}

/// Whether a client that proved `ids` may see export `e` (its `tls_allow`).
fn visible(e: &Export, ids: &[String]) -> bool {
    crate::tls::allowed(&e.spec().tls_allow, ids)
}

/// Exports as NBD clients see them: a device limited to some TLS identities
/// does not exist for anyone else (not found, not listed).
impl Exports for Daemon {
    type Client = ClientRef;
    type Export = Arc<Device>;

    fn find(&self, name: &str, ids: &[String]) -> Option<Arc<Device>> {
        self.export(name)
            .filter(|e| visible(e, ids))
            .map(|e| e.current().0)
    }

    fn join(&self, name: &str, ids: &[String]) -> Option<(Arc<Device>, ClientRef)> {
        let e = self.export(name).filter(|e| visible(e, ids))?;
        let client = e.join()?;
        Some((e.current().0, client))
    }

    fn names(&self, ids: &[String]) -> Vec<String> {
        let mut v: Vec<String> = self
            .exports
            .read()
            .map(|t| {
                t.iter()
                    .filter(|(_, e)| visible(e, ids))
                    .map(|(n, _)| n.clone())
                    .collect()
            })
            .unwrap_or_default();
        v.sort_by(|a, b| crate::text::natural_cmp(a, b));
        v
    }
}

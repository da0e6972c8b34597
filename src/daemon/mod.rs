//! The daemon's core: the table of exports and the control actions on it.
//!
//! Contract: control actions arrive as typed [`Request`]s (from the control
//! socket, the config file or the state file) and run here, on the caller's
//! thread. The export table is an `RwLock` held only to look up, insert or remove
//! (never across file I/O or a freeze); an action on one export takes that
//! export's own control lock, so actions on different devices never wait for
//! each other, and reactors never take either lock.
//!
//! An attach validates everything and opens the file *before* it takes the table
//! lock; the export becomes visible to clients in one insertion. A failed attach
//! leaves nothing behind (an image it created is removed again).
//!
//! State file: every change it records (attach, set, detach) is durable in the
//! [`state::StateLog`] *before* it takes effect and before the reply; if it
//! cannot be recorded the request fails and changes nothing. The log's mutex is
//! held from an attach's name check through its record to its insertion into the
//! table (lock order: log, then the export table, then `missing`), so no client
//! sees a device the state file lacks. A recorded device whose image cannot be
//! opened at start stays recorded and is listed as *missing* with the reason; it
//! is retried every [`RETRY_INTERVAL`] and by an attach of the same name.
//!
//! Which file: a recorded device comes back (restart, retry) only on the file
//! its record names ([`crate::backing::identity`]); an `attach` of a missing
//! device's image brings it back with its record, or is refused when it asks
//! for something else ([`bring_back`]); `set` and `resize` re-open the device's
//! own file, never its path.

pub mod audit;
pub mod blockdev;
pub mod bring_back;
pub mod config;
pub mod control_socket;
pub mod info;
pub mod reload;
pub mod set_rules;
pub mod state;
pub mod uri;

use crate::backing::format::RawError;
use crate::backing::identity::IdentityError;
use crate::backing::lock::LockError;
use crate::control::proto::{
    DeviceSpec, ErrorBody, ErrorCode, Request, SetSpec, err_reply, ok_reply,
};
use crate::device::export::{ClientRef, Export};
use crate::device::{Device, DeviceError, DeviceParams, Opening};
use crate::frontend::nbd::handshake::Exports;
use crate::frontend::ublk::ctrl::CtrlError;
use crate::kernel_nbd::KernelNbdError;
use crate::reactor::ReactorHandle;
use crate::text::quoted_path;
use crate::tls::TlsContext;
use blockdev::{BlockdevError, KernelDev};
use info::{DeviceInfo, DeviceStatus, SetResult};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use thiserror::Error;

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
/// How often a missing device's image is looked for again.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(2);

#[derive(Debug, Error)]
pub enum CtlError {
    #[error("no device named {0:?}")]
    NotFound(String),
    #[error("a device named {0:?} already exists")]
    NameTaken(String),
    #[error(
        "a device named {name:?} is recorded for {image} but missing ({reason}); attach that image, or detach {name:?} first"
    )]
    MissingTaken {
        name: String,
        image: String,
        reason: String,
    },
    #[error(
        "a device named {name:?} is recorded for {image} (missing: {reason}) with another \
         configuration than this attach asks: {differs}; attach {image} --name {name:?} without \
         these options to bring it back as recorded, or `loopd detach {name:?}` first and attach \
         it anew"
    )]
    MissingDiffers {
        name: String,
        image: String,
        reason: String,
        differs: String,
    },
    #[error("{0}")]
    Busy(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{msg}")]
    Device {
        msg: String,
        #[source]
        source: DeviceError,
    },
    #[error("the daemon is stopping")]
    ShuttingDown,
    #[error("{msg}")]
    State {
        msg: String,
        #[source]
        source: state::StateError,
    },
    #[error("cannot give device {name:?} to the kernel as a block device")]
    Blockdev {
        name: String,
        #[source]
        source: BlockdevError,
    },
    #[error("TLS is off: start the server with --tls on|require --tls-certs DIR")]
    TlsOff,
    #[error("TLS certificates not reloaded (the old ones stay in use): {0}")]
    Tls(#[source] crate::tls::TlsError),
}

impl CtlError {
    /// The wire code of an error (exhaustive: every variant maps explicitly).
    pub fn code(&self) -> ErrorCode {
        match self {
            CtlError::NotFound(_) => ErrorCode::NotFound,
            CtlError::NameTaken(_)
            | CtlError::MissingTaken { .. }
            | CtlError::MissingDiffers { .. } => ErrorCode::NameTaken,
            CtlError::Busy(_) => ErrorCode::Busy,
            CtlError::Invalid(_) => ErrorCode::Invalid,
            CtlError::ShuttingDown => ErrorCode::ShuttingDown,
            CtlError::TlsOff => ErrorCode::Invalid,
            CtlError::Tls(_) => ErrorCode::Io,
            CtlError::State { .. } => ErrorCode::Io,
            CtlError::Blockdev { source, .. } => match source {
                BlockdevError::TooManyQueues { .. }
                | BlockdevError::Depth(_)
                | BlockdevError::Connections(_) => ErrorCode::Invalid,
                BlockdevError::Nbd(
                    KernelNbdError::NoModule | KernelNbdError::NotPermitted { .. },
                )
                | BlockdevError::Nbd(KernelNbdError::NoDevice { .. }) => ErrorCode::Unavailable,
                BlockdevError::Nbd(KernelNbdError::BlockSize(_)) => ErrorCode::Invalid,
                BlockdevError::Nbd(_)
                | BlockdevError::SocketPair(_)
                | BlockdevError::Partitions(_) => ErrorCode::Io,
                BlockdevError::Unfollowable(_) => ErrorCode::Unavailable,
                BlockdevError::Ctrl(CtrlError::Params(_)) => ErrorCode::Invalid,
                BlockdevError::Ctrl(
                    CtrlError::NotAvailable { .. }
                    | CtrlError::NoAccess { .. }
                    | CtrlError::Unsupported { .. },
                ) => ErrorCode::Unavailable,
                BlockdevError::Ctrl(e) if e.errno().is_some_and(|n| n == libc::EACCES) => {
                    ErrorCode::Unavailable
                }
                BlockdevError::Ctrl(_)
                | BlockdevError::Char(_)
                | BlockdevError::Queue { .. }
                | BlockdevError::NoReactors => ErrorCode::Io,
            },
            CtlError::Device { source, .. } => match source {
                DeviceError::BadBlockSize(_)
                | DeviceError::OffsetPastEnd { .. }
                | DeviceError::UnalignedOffset { .. }
                | DeviceError::BadSizeLimit(..)
                | DeviceError::Empty
                | DeviceError::TooLarge { .. }
                | DeviceError::NotAFile { .. } => ErrorCode::Invalid,
                DeviceError::Raw(RawError::NotRaw { .. }) => ErrorCode::Invalid,
                DeviceError::Raw(RawError::Probe { .. }) => ErrorCode::Io,
                DeviceError::DirectRefused { .. } => ErrorCode::DirectRefused,
                DeviceError::Lock(l) => match l {
                    LockError::InUse { .. } => ErrorCode::Busy,
                    LockError::Open { .. }
                    | LockError::Replaced { .. }
                    | LockError::Fcntl { .. } => ErrorCode::Io,
                },
                DeviceError::Create { .. }
                | DeviceError::Open { .. }
                | DeviceError::Stat { .. } => ErrorCode::Io,
                DeviceError::Identity(i) => match i {
                    IdentityError::NotAFile { .. } => ErrorCode::Invalid,
                    IdentityError::Open { .. }
                    | IdentityError::NowSymlink { .. }
                    | IdentityError::UnrecordedSymlink { .. }
                    | IdentityError::UnrecordedDoubt { .. }
                    | IdentityError::Different { .. }
                    | IdentityError::Reopen { .. } => ErrorCode::Io,
                },
            },
        }
    }

    pub fn body(&self) -> ErrorBody {
        let mut message = self.to_string();
        let mut src = std::error::Error::source(self);
        while let Some(s) = src {
            message.push_str(": ");
            message.push_str(&s.to_string());
            src = s.source();
        }
        ErrorBody {
            code: self.code(),
            message,
        }
    }
}

/// Where clients reach the daemon's exports (for the URIs it prints).
#[derive(Debug, Clone, Default)]
pub struct Endpoints {
    pub unix: Option<PathBuf>,
    pub tcp: Vec<String>,
    /// TLS is offered (`nbds` URIs).
    pub tls: bool,
}

impl Endpoints {
    pub fn uris(&self, name: &str) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(p) = &self.unix {
            v.push(uri::unix_uri(self.tls, name, p));
        }
        for t in &self.tcp {
            v.push(uri::tcp_uri(self.tls, t, name));
        }
        v
    }
}

pub struct Daemon {
    exports: RwLock<BTreeMap<String, Arc<Export>>>,
    /// The export the empty name selects.
    default_name: RwLock<Option<String>>,
    reactors: RwLock<Vec<Arc<ReactorHandle>>>,
    endpoints: RwLock<Endpoints>,
    state: Option<PathBuf>,
    /// The open state log (after [`Daemon::open_state`]); its mutex orders
    /// records and publication (see the module docs).
    log: Mutex<Option<state::StateLog>>,
    /// Recorded devices that could not be attached (yet), by name.
    missing: Mutex<BTreeMap<String, Missing>>,
    /// Serialises attaches that may create their image, from the name check to
    /// publication: of racing `create` attaches exactly one creates, opens and
    /// publishes, and a loser never removes a file another attach serves.
    create_lock: Mutex<()>,
    idle_tx: Mutex<Sender<String>>,
    idle_rx: Mutex<Option<Receiver<String>>>,
    stopping: AtomicBool,
    /// Pokes the handshake loop (see [`Daemon::set_handshake_kick`]).
    handshake_kick: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
    /// Block devices handed to the kernel, by device name.
    blockdevs: Mutex<BTreeMap<String, Arc<KernelDev>>>,
    /// The NBD server's TLS certificates, when TLS is on.
    tls: RwLock<Option<Arc<TlsContext>>>,
    /// The `--config` file and the devices last read from it (see [`reload`]).
    config: Mutex<Option<(PathBuf, Vec<DeviceSpec>)>>,
}

/// A recorded device that is not attached: its spec and why.
#[derive(Debug, Clone)]
struct Missing {
    spec: DeviceSpec,
    reason: String,
}

/// Where an attach comes from (what it records, what it may replace).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    /// The control socket: recorded in the state file; may take a missing name.
    Control,
    /// `serve IMAGE` or `--config`: not recorded (they come back from there).
    Static,
    /// A state-file device coming back: already recorded; only while missing.
    Restored,
}

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

fn params_of(spec: &DeviceSpec, name: &str) -> DeviceParams {
    params_with(spec, name, Tuning::default())
}

fn params_with(spec: &DeviceSpec, name: &str, tuning: Tuning) -> DeviceParams {
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
        whole_device_lock: tuning.whole_device_lock,
        no_inline_reads: tuning.no_inline_reads,
        no_inline_writes: tuning.no_inline_writes,
        no_splice: tuning.no_splice,
        shared: spec.shared,
        format: spec.format,
    }
}

/// A reconfiguration's parameters: `spec` on the file device `cur` already has
/// (no path lookup; see [`crate::backing::identity`]).
fn same_file(spec: &DeviceSpec, name: &str, cur: &Device) -> DeviceParams {
    DeviceParams {
        opening: Opening::Same(Arc::clone(&cur.pinned)),
        ..params_of(spec, name)
    }
}

/// After `set`/`resize`: say so when the image path no longer names the file
/// the device serves (it keeps serving that file; a restart would not).
fn warn_if_renamed(name: &str, dev: &Device) {
    if !dev.pinned.path_still_names_it() {
        tracing::warn!(
            "device {name:?}: {} no longer names the file the device serves (moved, replaced or \
             now a link); the device keeps that file, and after a restart it stays missing until \
             `loopd attach` of the path accepts the file it names then",
            quoted_path(&dev.path)
        );
    }
}

/// The export name a spec asks for (default: the image's file stem).
pub fn name_of(spec: &DeviceSpec) -> String {
    match &spec.name {
        Some(n) => n.clone(),
        None => spec
            .image
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
    }
}

/// `create`'s size must fit the file system's `off_t`.
fn check_create(spec: &DeviceSpec) -> Result<(), CtlError> {
    match spec.create {
        Some(n) if i64::try_from(n).is_err() => Err(CtlError::Invalid(format!(
            "create size {n} is out of range: at most {} bytes (2^63-1)",
            i64::MAX
        ))),
        _ => Ok(()),
    }
}

fn check_name(name: &str) -> Result<(), CtlError> {
    if name.is_empty() {
        return Err(CtlError::Invalid(
            "the export name is empty (give a name)".into(),
        ));
    }
    if name.len() > 4096 || name.contains('\0') || name.contains('/') || name.contains('?') {
        return Err(CtlError::Invalid(format!(
            "export name {name:?} is invalid (at most 4096 bytes, no NUL, '/' or '?')"
        )));
    }
    Ok(())
}

impl Daemon {
    pub fn new(state: Option<PathBuf>) -> Arc<Daemon> {
        let (tx, rx) = channel();
        Arc::new(Daemon {
            exports: RwLock::default(),
            default_name: RwLock::default(),
            reactors: RwLock::default(),
            endpoints: RwLock::default(),
            state,
            log: Mutex::new(None),
            missing: Mutex::default(),
            create_lock: Mutex::new(()),
            idle_tx: Mutex::new(tx),
            idle_rx: Mutex::new(Some(rx)),
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
            tracing::error!("TLS certificates not reloaded (the old ones stay in use): {e}");
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

    /// Run one control request and encode its reply line.
    pub fn handle(&self, req: Request) -> String {
        let r = match req {
            Request::Attach(spec) => self.attach(spec, true).map(|i| ok_reply(&i)),
            Request::Detach { name, force } => self
                .detach(&name, force)
                .map(|()| ok_reply(&serde_json::json!({ "name": name }))),
            Request::List => Ok(ok_reply(&serde_json::json!({ "devices": self.list() }))),
            Request::Status { name: Some(name) } => self.status(&name).map(|s| ok_reply(&s)),
            Request::Status { name: None } => Ok(ok_reply(
                &serde_json::json!({ "devices": self.status_all() }),
            )),
            Request::Set(s) => self.set(s).map(|r| ok_reply(&r)),
            Request::Resize { name } => self.resize(&name).map(|r| ok_reply(&r)),
            Request::Reload => self.reload().map(|r| ok_reply(&r)),
            Request::ReloadTls => self
                .reload_tls()
                .map(|()| ok_reply(&serde_json::json!({ "reloaded": "tls" }))),
            Request::Version => Ok(ok_reply(&serde_json::json!({
                "version": env!("CARGO_PKG_VERSION"),
                "protocol": crate::control::proto::VERSION,
            }))),
        };
        r.unwrap_or_else(|e| err_reply(&e.body()))
    }

    fn info(&self, e: &Export) -> DeviceInfo {
        let mut i = DeviceInfo::of(e, &self.endpoints());
        if let Some(b) = self.blockdev(&e.name) {
            let path = b.path();
            i.partitions = crate::blockdev::partitions::current(&path)
                .map(|ps| ps.into_iter().map(|p| p.device).collect())
                .unwrap_or_default();
            i.blockdev = Some(path);
        }
        i
    }

    /// The block device of device `name`, if it has one.
    fn blockdev(&self, name: &str) -> Option<Arc<KernelDev>> {
        let g = self.blockdevs.lock().unwrap_or_else(|p| p.into_inner());
        g.get(name).cloned()
    }

    /// Give device `name` to the kernel as the block device its spec asks
    /// for. On failure, with `undo` (a new attach), the device is detached
    /// again: an attach that asked for a block device either has one or did not
    /// happen. Without it (a device coming back from the state file or a config
    /// file) the device stays, served over NBD, and keeps its record: a driver
    /// not loaded yet at boot must not erase the configuration.
    fn start_blockdev(&self, name: &str, undo: bool) -> Result<(), CtlError> {
        let Some(e) = self.export(name) else {
            return Err(CtlError::NotFound(name.to_owned()));
        };
        let spec = e.spec();
        let reactors = self.reactors();
        if reactors.is_empty() || self.blockdev(name).is_some() {
            // Made once the reactors run (start_pending_blockdevs), or made.
            return Ok(());
        }
        match blockdev::start(&e, &spec, &reactors) {
            Ok(None) => Ok(()),
            Ok(Some(k)) => {
                tracing::info!("device {name:?}: {}", k.path().display());
                let ublk_id = match &k {
                    KernelDev::Ublk(u) => Some(u.dev_id),
                    KernelDev::Nbd(_) => None,
                };
                {
                    let mut g = self.blockdevs.lock().unwrap_or_else(|p| p.into_inner());
                    g.insert(name.to_owned(), Arc::new(k));
                }
                if let Some(id) = ublk_id
                    && spec.ublk_id != Some(id)
                {
                    // Recorded so that a daemon restarted after a crash takes the
                    // same device back (user recovery).
                    let mut spec = spec;
                    spec.ublk_id = Some(id);
                    e.set_spec(spec.clone());
                    if let Err(err) = self.record_put(&e, &spec) {
                        tracing::warn!(
                            "device {name:?}: the ublk device id is not recorded ({err}); \
                             after a crash the device is made anew instead of recovered"
                        );
                    }
                }
                Ok(())
            }
            Err(source) => {
                if undo && let Err(d) = self.detach_export(&e, true) {
                    tracing::warn!("device {name:?}: undoing the attach failed: {d}");
                }
                Err(CtlError::Blockdev {
                    name: name.to_owned(),
                    source,
                })
            }
        }
    }

    /// Make the block devices of devices attached before the reactors ran
    /// (`serve IMAGE --blockdev`, `--config`, the state file). A device whose
    /// block device cannot be made is detached.
    pub fn start_pending_blockdevs(&self) -> Vec<(String, Result<PathBuf, CtlError>)> {
        let mut out = Vec::new();
        for e in self.all() {
            if e.spec().blockdev.is_none() || self.blockdev(&e.name).is_some() {
                continue;
            }
            let r = self.start_blockdev(&e.name, false).and_then(|()| {
                self.blockdev(&e.name)
                    .map(|b| b.path())
                    .ok_or(CtlError::NotFound(e.name.clone()))
            });
            out.push((e.name.clone(), r));
        }
        out
    }

    /// Whether the kernel block device of `e` (if any) can follow the change
    /// from `cur` to `new`; refused with the reason if not. `Some(bytes)`: the
    /// kernel must be told the new size once the change is made.
    fn kernel_follows(
        &self,
        e: &Export,
        cur: &Device,
        new: &Device,
    ) -> Result<Option<u64>, CtlError> {
        let Some(b) = self.blockdev(&e.name) else {
            return Ok(None);
        };
        let refuse = |why: &str| CtlError::Blockdev {
            name: e.name.clone(),
            source: BlockdevError::Unfollowable(format!(
                "{} cannot follow {why}: detach and attach the device to change it",
                b.path().display()
            )),
        };
        if new.block_size != cur.block_size {
            return Err(refuse("a change of block size"));
        }
        if new.read_only != cur.read_only {
            return Err(refuse("a change of read-only (set when the disk is made)"));
        }
        if new.offset != cur.offset {
            return Err(refuse("a change of offset under its data"));
        }
        if new.size == cur.size {
            return Ok(None);
        }
        b.can_resize().map_err(|source| CtlError::Blockdev {
            name: e.name.clone(),
            source,
        })?;
        Ok(Some(new.size))
    }

    /// Tell the kernel about a size change [`Daemon::kernel_follows`] allowed.
    fn kernel_resize(&self, e: &Export, bytes: Option<u64>) {
        if let (Some(bytes), Some(b)) = (bytes, self.blockdev(&e.name))
            && let Err(err) = b.resize(bytes)
        {
            tracing::error!(
                "device {:?}: {} was not resized: {err}",
                e.name,
                b.path().display()
            );
        }
    }

    /// Remove device `name`'s block device, if it has one.
    fn remove_blockdev(&self, name: &str) -> Result<(), CtlError> {
        let Some(u) = self.blockdev(name) else {
            return Ok(());
        };
        u.remove().map_err(|source| CtlError::Blockdev {
            name: name.to_owned(),
            source,
        })?;
        let mut g = self.blockdevs.lock().unwrap_or_else(|p| p.into_inner());
        g.remove(name);
        Ok(())
    }

    /// Remove every block device (the daemon is stopping: the reactors serving
    /// them are about to exit).
    pub fn remove_blockdevs(&self) {
        let names: Vec<String> = {
            let g = self.blockdevs.lock().unwrap_or_else(|p| p.into_inner());
            g.keys().cloned().collect()
        };
        for n in names {
            if let Err(e) = self.remove_blockdev(&n) {
                tracing::warn!("{e}");
            }
        }
    }

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
        self.start_blockdev(&info.name, true)?;
        Ok(self.export(&info.name).map_or(info, |e| self.info(&e)))
    }

    /// Attach the device `loopd serve IMAGE` names: it is the default export (so
    /// its name may be empty) and may carry benchmark switches.
    pub fn attach_default(&self, spec: DeviceSpec, tuning: Tuning) -> Result<DeviceInfo, CtlError> {
        let info = self.attach_inner(spec, Source::Static, tuning, true)?;
        self.set_default(&info.name);
        self.start_blockdev(&info.name, true)?;
        Ok(self.export(&info.name).map_or(info, |e| self.info(&e)))
    }

    fn attach_inner(
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
        if !(is_default && name.is_empty()) {
            check_name(&name)?;
        }
        let _creating = spec
            .create
            .map(|_| self.create_lock.lock().unwrap_or_else(|p| p.into_inner()));
        if spec.image.is_relative() {
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
            }
        }
        check_create(&spec)?;
        // A recorded device comes back only on its recorded file; an attach
        // opens the path as given and records what it finds.
        let recorded = spec.file.take();
        let opening = match source {
            Source::Restored => Opening::Recorded(recorded.clone()),
            Source::Control | Source::Static => Opening::First,
        };
        // An image created here is removed again by a failed open (Device::open)
        // or a lost race for the name (below): a failed attach leaves no trace.
        let params = DeviceParams {
            opening,
            ..params_with(&spec, &name, tuning)
        };
        let dev = Device::open(&params).map_err(|source| CtlError::Device {
            msg: format!("cannot attach {}", quoted_path(&spec.image)),
            source,
        })?;
        spec.file = Some(dev.pinned.identity().clone());
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
        if source == Source::Restored && !was_missing {
            // Detached, or attached by a client, while this retry opened the image.
            return Err(CtlError::NameTaken(name));
        }
        if source == Source::Control {
            self.write_record(&mut log, &format!("attach {name:?}"), |l| l.put(&spec))
                .map_err(undo)?;
        }
        if source == Source::Restored && recorded != spec.file {
            // First seen in this boot (or recorded by an older loopd): from now
            // on the record names the file as found here.
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
        Ok(self.info(&export))
    }

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
            self.remove_blockdev(name)?;
        }
        self.detach_export(&e, force)
    }

    /// Remove export `e` (see [`Daemon::detach`]).
    fn detach_export(&self, e: &Arc<Export>, force: bool) -> Result<(), CtlError> {
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
            let _ = rustix::fs::fdatasync(&dev.file);
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

    /// Durably record that `e` is gone (before it is unpublished); a failure
    /// fails the detach.
    fn record_del(&self, e: &Export) -> Result<(), CtlError> {
        if !e.persistent {
            return Ok(());
        }
        let mut log = self.log.lock().map_err(|_| CtlError::ShuttingDown)?;
        self.write_record(&mut log, &format!("detach {:?}", e.name), |l| {
            l.del(&e.name)
        })
    }

    /// Write one record to the state log (the caller holds its lock), durably,
    /// before the change it records takes effect. Once the log is closed at stop
    /// nothing may change unrecorded; a daemon without a state file records
    /// nothing. A failed write fails the request `what` (e.g. `attach "a"`).
    fn write_record(
        &self,
        log: &mut Option<state::StateLog>,
        what: &str,
        f: impl FnOnce(&mut state::StateLog) -> Result<(), state::StateError>,
    ) -> Result<(), CtlError> {
        match log.as_mut() {
            Some(l) => f(l).map_err(|source| CtlError::State {
                msg: format!("cannot {what}: the state file cannot record it"),
                source,
            }),
            None if self.state.is_some() && self.stopping.load(Ordering::SeqCst) => {
                Err(CtlError::ShuttingDown)
            }
            None => Ok(()),
        }
    }

    /// Detach a missing device: drop its record. `None` if `name` is not missing.
    fn detach_missing(&self, name: &str) -> Option<Result<(), CtlError>> {
        let mut log = match self.log.lock() {
            Ok(l) => l,
            Err(_) => return Some(Err(CtlError::ShuttingDown)),
        };
        self.missing_spec(name)?;
        if let Err(e) = self.write_record(&mut log, &format!("detach {name:?}"), |l| l.del(name)) {
            return Some(Err(e));
        }
        if let Ok(mut m) = self.missing.lock() {
            m.remove(name);
        }
        tracing::info!("detached missing device {name:?}");
        Some(Ok(()))
    }

    fn missing_spec(&self, name: &str) -> Option<Missing> {
        self.missing.lock().ok()?.get(name).cloned()
    }

    fn unpublish(&self, e: &Arc<Export>) {
        if let Ok(mut t) = self.exports.write() {
            if t.get(&e.name).is_some_and(|x| Arc::ptr_eq(x, e)) {
                t.remove(&e.name);
            }
        }
    }

    /// Make the handshake loop drop pending connections of closed exports.
    fn kick_handshakes(&self) {
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
    fn kick_reactors(&self) {
        for r in self.reactors() {
            r.kick();
        }
    }

    /// Live devices and missing ones, by name.
    pub fn list(&self) -> Vec<DeviceInfo> {
        let mut v: Vec<DeviceInfo> = self.all().iter().map(|e| self.info(e)).collect();
        if let Ok(m) = self.missing.lock() {
            v.extend(
                m.iter()
                    .map(|(n, x)| DeviceInfo::missing(n, &x.spec, &x.reason)),
            );
        }
        v.sort_by(|a, b| a.name.cmp(&b.name));
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
        st.info.blockdev = self.blockdev(name).map(|b| b.path());
        Ok(st)
    }

    /// Every device's status (live and missing), sorted by name.
    pub fn status_all(&self) -> Vec<DeviceStatus> {
        let names: Vec<String> = self.list().into_iter().map(|i| i.name).collect();
        // A device detached meanwhile is left out.
        names.iter().filter_map(|n| self.status(n).ok()).collect()
    }

    /// Live reconfiguration. See the module and `Export` docs for what freezes.
    pub fn set(&self, s: SetSpec) -> Result<SetResult, CtlError> {
        let e = self
            .export(&s.name)
            .ok_or_else(|| CtlError::NotFound(s.name.clone()))?;
        let _g = e.control();
        let old = e.spec();
        let mut new = old.clone();
        if let Some(v) = s.size_limit {
            new.size_limit = v;
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
            return Ok(self.set_result(&e, false, 0));
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
        Ok(self.set_result(&e, true, quiesced_us))
    }

    /// A `set`/`resize` result, with the file's size and whether the size
    /// limit caps it.
    fn set_result(&self, e: &Export, changed: bool, quiesced_us: u64) -> SetResult {
        let (dev, _) = e.current();
        let file_size = dev.file_size.load(std::sync::atomic::Ordering::Relaxed);
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
            drop(dev);
            return Ok(self.set_result(&e, false, 0));
        }
        let kernel = self.kernel_follows(&e, &cur, &dev)?;
        let held = e.quiesce_and_swap(Some(dev));
        self.kernel_resize(&e, kernel);
        let quiesced_us = u64::try_from(held.as_micros()).unwrap_or(u64::MAX);
        Ok(self.set_result(&e, true, quiesced_us))
    }

    /// Durably record `spec` as `e`'s configuration (before it is applied).
    fn record_put(&self, e: &Export, spec: &DeviceSpec) -> Result<(), CtlError> {
        if !e.persistent {
            return Ok(());
        }
        let mut log = self.log.lock().map_err(|_| CtlError::ShuttingDown)?;
        self.write_record(&mut log, &format!("change {:?}", e.name), |l| l.put(spec))
    }

    /// Lock and read the state file (first thing at start: a second daemon on
    /// the same file, or a file that is not a state file, stops here).
    pub fn open_state(&self) -> Result<(), state::StateError> {
        let Some(path) = &self.state else {
            return Ok(());
        };
        let log = state::StateLog::open(path)?;
        if let Ok(mut g) = self.log.lock() {
            *g = Some(log);
        }
        Ok(())
    }

    /// At stop: compact the state file and release it (and its lock): nothing is
    /// recorded after this.
    pub fn close_state(&self) {
        self.write_state();
        if let Ok(mut g) = self.log.lock() {
            *g = None;
        }
    }

    /// Compact the state file (rewrite it from its table).
    pub fn write_state(&self) {
        let Ok(mut g) = self.log.lock() else { return };
        if let Some(log) = g.as_mut() {
            if let Err(e) = log.compact() {
                tracing::error!("{e:#}");
            }
        }
    }

    /// Bring back the devices of the state file (after those of the command line
    /// and `--config`, which win a name clash). A device that cannot be attached
    /// stays recorded and is kept as missing; then the file is compacted.
    pub fn restore(&self) {
        let (specs, path) = match self.log.lock() {
            Ok(g) => match g.as_ref() {
                Some(l) => (l.table().to_vec(), l.path().display().to_string()),
                None => return,
            },
            Err(_) => return,
        };
        for spec in specs {
            let name = name_of(&spec);
            if self.export(&name).is_some() {
                tracing::warn!(
                    "device {name:?} is both in --config (or the serve IMAGE argument) and in the \
                     state file {path}: --config wins; its state record is dropped"
                );
                if let Ok(mut g) = self.log.lock() {
                    if let Some(l) = g.as_mut() {
                        l.forget(&name);
                    }
                }
                continue;
            }
            if let Ok(mut m) = self.missing.lock() {
                m.insert(
                    name.clone(),
                    Missing {
                        spec: spec.clone(),
                        reason: "not attached yet".into(),
                    },
                );
            }
            match self.attach_inner(spec, Source::Restored, Tuning::default(), false) {
                Ok(_) => tracing::info!("restored device {name:?}"),
                Err(e) => {
                    let reason = e.body().message;
                    tracing::warn!(
                        "device {name:?} is missing: {reason}; it stays in the state file and is \
                         retried every {}s and on `loopd attach` of that name",
                        RETRY_INTERVAL.as_secs()
                    );
                    self.set_missing_reason(&name, reason);
                }
            }
        }
        self.write_state();
    }

    fn set_missing_reason(&self, name: &str, reason: String) {
        if let Ok(mut m) = self.missing.lock() {
            if let Some(x) = m.get_mut(name) {
                x.reason = reason;
            }
        }
    }

    /// Retry missing devices every [`RETRY_INTERVAL`] on a thread of their own,
    /// until the daemon stops.
    pub fn run_retrier(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("loopd-retry".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(RETRY_INTERVAL);
                    let Some(d) = me.upgrade() else { return };
                    if d.stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    d.retry_missing();
                }
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start the retry thread: {e}");
        }
    }

    /// One attempt at every missing device.
    fn retry_missing(&self) {
        let all: Vec<(String, Missing)> = match self.missing.lock() {
            Ok(m) => m.iter().map(|(n, x)| (n.clone(), x.clone())).collect(),
            Err(_) => return,
        };
        for (name, x) in all {
            match self.attach_inner(x.spec.clone(), Source::Restored, Tuning::default(), false) {
                Ok(_) => {
                    tracing::info!(
                        "device {name:?} is back: {} can be opened again",
                        quoted_path(&x.spec.image)
                    );
                    if let Err(e) = self.start_blockdev(&name, false) {
                        tracing::error!("{}", e.body().message);
                    }
                }
                Err(CtlError::NameTaken(_)) => {}
                Err(e) => {
                    let reason = e.body().message;
                    if reason != x.reason {
                        tracing::warn!("device {name:?} is still missing: {reason}");
                        self.set_missing_reason(&name, reason);
                    }
                }
            }
        }
    }

    /// Remove autoclear exports whose last client left. Runs on its own thread.
    pub fn run_janitor(self: &Arc<Self>) {
        let Some(rx) = self.idle_rx.lock().ok().and_then(|mut r| r.take()) else {
            return;
        };
        let me = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("loopd-autoclear".into())
            .spawn(move || {
                for name in rx {
                    let Some(d) = me.upgrade() else { return };
                    if let Some(e) = d.export(&name) {
                        if e.spec().autoclear && e.clients() == 0 && e.had_client() {
                            match d.detach(&name, false) {
                                Ok(()) => tracing::info!("autoclear: removed device {name:?}"),
                                Err(err) => tracing::debug!("autoclear of {name:?} skipped: {err}"),
                            }
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start the autoclear thread: {e}");
        }
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
        self.exports
            .read()
            .map(|t| {
                t.iter()
                    .filter(|(_, e)| visible(e, ids))
                    .map(|(n, _)| n.clone())
                    .collect()
            })
            .unwrap_or_default()
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

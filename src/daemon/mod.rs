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

pub mod info;
pub mod state;

use crate::backing::lock::LockError;
use crate::control::proto::{
    DeviceSpec, ErrorBody, ErrorCode, Request, SetSpec, err_reply, ok_reply,
};
use crate::device::export::Export;
use crate::device::{Device, DeviceError, DeviceParams};
use crate::engine::reactor::{CONTROL_GEN, ReactorHandle};
use crate::nbd::handshake::Exports;
use info::{DeviceInfo, DeviceStatus, SetResult};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use thiserror::Error;

/// How long a forced detach waits for clients to be disconnected.
const DETACH_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Error)]
pub enum CtlError {
    #[error("no device named {0:?}")]
    NotFound(String),
    #[error("a device named {0:?} already exists")]
    NameTaken(String),
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
}

impl CtlError {
    /// The wire code of an error (exhaustive: every variant maps explicitly).
    pub fn code(&self) -> ErrorCode {
        match self {
            CtlError::NotFound(_) => ErrorCode::NotFound,
            CtlError::NameTaken(_) => ErrorCode::NameTaken,
            CtlError::Busy(_) => ErrorCode::Busy,
            CtlError::Invalid(_) => ErrorCode::Invalid,
            CtlError::ShuttingDown => ErrorCode::ShuttingDown,
            CtlError::Device { source, .. } => match source {
                DeviceError::BadBlockSize(_)
                | DeviceError::OffsetPastEnd { .. }
                | DeviceError::UnalignedOffset { .. }
                | DeviceError::BadSizeLimit(..)
                | DeviceError::Empty
                | DeviceError::TooLarge { .. }
                | DeviceError::NotAFile { .. } => ErrorCode::Invalid,
                DeviceError::NotRaw { .. } => ErrorCode::Invalid,
                DeviceError::DirectRefused { .. } => ErrorCode::DirectRefused,
                DeviceError::Lock(l) => match l {
                    LockError::InUse { .. } => ErrorCode::Busy,
                    LockError::Open { .. }
                    | LockError::Replaced { .. }
                    | LockError::Fcntl { .. } => ErrorCode::Io,
                },
                DeviceError::Create { .. }
                | DeviceError::Open { .. }
                | DeviceError::Probe { .. }
                | DeviceError::Stat { .. } => ErrorCode::Io,
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
}

impl Endpoints {
    pub fn uris(&self, name: &str) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(p) = &self.unix {
            v.push(format!("nbd+unix:///{name}?socket={}", p.display()));
        }
        for t in &self.tcp {
            v.push(format!("nbd://{t}/{name}"));
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
    /// The open state log (after [`Daemon::restore`]); its mutex orders records.
    log: Mutex<Option<state::StateLog>>,
    /// Serialises attaches that may create their image, from the name check to
    /// publication: of racing `create` attaches exactly one creates, opens and
    /// publishes, and a loser never removes a file another attach serves.
    create_lock: Mutex<()>,
    idle_tx: Mutex<Sender<String>>,
    idle_rx: Mutex<Option<Receiver<String>>>,
    stopping: AtomicBool,
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
        name: name.to_owned(),
        offset: spec.offset,
        size_limit: spec.size_limit,
        block_size: spec.block_size,
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
            create_lock: Mutex::new(()),
            idle_tx: Mutex::new(tx),
            idle_rx: Mutex::new(Some(rx)),
            stopping: AtomicBool::new(false),
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
            Request::Status { name } => self.status(&name).map(|s| ok_reply(&s)),
            Request::Set(s) => self.set(s).map(|r| ok_reply(&r)),
            Request::Resize { name } => self.resize(&name).map(|r| ok_reply(&r)),
            Request::Version => Ok(ok_reply(&serde_json::json!({
                "version": env!("CARGO_PKG_VERSION"),
                "protocol": crate::control::proto::VERSION,
            }))),
        };
        r.unwrap_or_else(|e| err_reply(&e.body()))
    }

    fn info(&self, e: &Export) -> DeviceInfo {
        DeviceInfo::of(e, &self.endpoints())
    }

    /// Attach a device: validate, open, probe, then publish in one step.
    ///
    /// `persist`: record the device in the state file (devices from the command
    /// line or the config file are not recorded: they come back from there).
    pub fn attach(&self, spec: DeviceSpec, persist: bool) -> Result<DeviceInfo, CtlError> {
        self.attach_inner(spec, persist, Tuning::default(), false)
    }

    /// Attach the device `loopd serve IMAGE` names: it is the default export (so
    /// its name may be empty) and may carry benchmark switches.
    pub fn attach_default(&self, spec: DeviceSpec, tuning: Tuning) -> Result<DeviceInfo, CtlError> {
        let info = self.attach_inner(spec, false, tuning, true)?;
        self.set_default(&info.name);
        Ok(info)
    }

    fn attach_inner(
        &self,
        mut spec: DeviceSpec,
        persist: bool,
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
                spec.image.display()
            )));
        }
        if self.export(&name).is_some() {
            return Err(CtlError::NameTaken(name));
        }
        // An image created here is removed again by a failed open (Device::open)
        // or a lost race for the name (below): a failed attach leaves no trace.
        let dev = Device::open(&params_with(&spec, &name, tuning)).map_err(|source| {
            CtlError::Device {
                msg: format!("cannot attach {}", spec.image.display()),
                source,
            }
        })?;
        let created = dev.created;
        // Record what was asked; `create` has done its job.
        spec.name = Some(name.clone());
        spec.create = None;
        // The image probed raw (or was declared so): a restart restores it as raw
        // whatever its clients write at byte 0 meanwhile.
        spec.format
            .get_or_insert(crate::backing::format::ImageFormat::Raw);
        let export = Arc::new(Export::new(dev, spec.clone(), persist));
        if let Ok(tx) = self.idle_tx.lock() {
            export.set_idle_notify(tx.clone());
        }
        {
            let mut t = self.exports.write().map_err(|_| CtlError::ShuttingDown)?;
            if t.contains_key(&name) {
                // Lost the name to an attach without `create` (those do not take
                // create_lock). Remove the image we made unless some export serves it.
                let in_use = t.values().any(|e| e.current().0.path == spec.image);
                drop(t);
                if created && !in_use {
                    let _ = std::fs::remove_file(&spec.image);
                }
                return Err(CtlError::NameTaken(name));
            }
            t.insert(name.clone(), Arc::clone(&export));
        }
        if persist {
            self.record_put(&export);
        }
        Ok(self.info(&export))
    }

    /// Remove a device. Without `force` it refuses while clients are connected;
    /// with it, in-flight requests finish, clients are disconnected, and it goes.
    pub fn detach(&self, name: &str, force: bool) -> Result<(), CtlError> {
        let e = self
            .export(name)
            .ok_or_else(|| CtlError::NotFound(name.to_owned()))?;
        let _g = e.control();
        let n = e.clients();
        if n > 0 && !force {
            return Err(CtlError::Busy(format!(
                "device {name:?} has {n} connected client(s); disconnect them or use --force"
            )));
        }
        self.unpublish(&e);
        if n > 0 {
            e.start_closing();
            self.kick_reactors();
            let deadline = Instant::now() + DETACH_TIMEOUT;
            while e.clients() > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        let (dev, _) = e.current();
        if !dev.read_only {
            let _ = rustix::fs::fdatasync(&dev.file);
        }
        if e.persistent {
            self.record(|log| log.del(&e.name));
        }
        Ok(())
    }

    fn unpublish(&self, e: &Arc<Export>) {
        if let Ok(mut t) = self.exports.write() {
            if t.get(&e.name).is_some_and(|x| Arc::ptr_eq(x, e)) {
                t.remove(&e.name);
            }
        }
    }

    /// Make every reactor look at its connections' exports again.
    fn kick_reactors(&self) {
        CONTROL_GEN.fetch_add(1, Ordering::SeqCst);
        for r in self.reactors() {
            r.wake();
        }
    }

    pub fn list(&self) -> Vec<DeviceInfo> {
        let ep = self.endpoints();
        self.all().iter().map(|e| DeviceInfo::of(e, &ep)).collect()
    }

    pub fn status(&self, name: &str) -> Result<DeviceStatus, CtlError> {
        let e = self
            .export(name)
            .ok_or_else(|| CtlError::NotFound(name.to_owned()))?;
        Ok(DeviceStatus::of(&e, &self.endpoints()))
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
            new.size_limit = Some(v);
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
                && new.size_limit.is_none_or(|l| l == cur.size)
                && new.block_size.is_none_or(|b| b == cur.block_size)
                && new.read_only == cur.read_only
                && new.cache == old.cache);
        if unchanged {
            e.set_spec(new);
            self.record_put(&e);
            return Ok(SetResult {
                device: self.info(&e),
                changed: false,
                quiesced_us: 0,
            });
        }
        let clients = e.clients();
        let unfollowable =
            new.offset != cur.offset || new.block_size.is_some_and(|b| b != cur.block_size);
        if unfollowable && clients > 0 && !s.force {
            return Err(CtlError::Busy(format!(
                "device {:?} has {clients} connected client(s), which cannot follow a change of offset or \
                 block size; disconnect them or use --force",
                s.name
            )));
        }
        let dev = Device::open_with_stats(&params_of(&new, &e.name), Arc::clone(&e.stats))
            .map_err(|source| CtlError::Device {
                msg: format!("cannot reconfigure {:?}", s.name),
                source,
            })?;
        let held = e.quiesce_and_swap(Some(dev));
        e.set_spec(new);
        self.record_put(&e);
        let quiesced_us = u64::try_from(held.as_micros()).unwrap_or(u64::MAX);
        Ok(SetResult {
            device: self.info(&e),
            changed: true,
            quiesced_us,
        })
    }

    /// Re-read the backing file's size (like `LOOP_SET_CAPACITY`).
    pub fn resize(&self, name: &str) -> Result<SetResult, CtlError> {
        let e = self
            .export(name)
            .ok_or_else(|| CtlError::NotFound(name.to_owned()))?;
        let _g = e.control();
        let spec = e.spec();
        let (cur, _) = e.current();
        let dev = Device::open_with_stats(&params_of(&spec, &e.name), Arc::clone(&e.stats))
            .map_err(|source| CtlError::Device {
                msg: format!("cannot resize {name:?}"),
                source,
            })?;
        if dev.size == cur.size {
            return Ok(SetResult {
                device: self.info(&e),
                changed: false,
                quiesced_us: 0,
            });
        }
        let held = e.quiesce_and_swap(Some(dev));
        let quiesced_us = u64::try_from(held.as_micros()).unwrap_or(u64::MAX);
        Ok(SetResult {
            device: self.info(&e),
            changed: true,
            quiesced_us,
        })
    }

    /// Append a record to the state log (before the control reply goes out).
    fn record(&self, f: impl FnOnce(&mut state::StateLog) -> Result<(), state::StateError>) {
        let Ok(mut g) = self.log.lock() else { return };
        let Some(log) = g.as_mut() else {
            // No log yet (nothing was ever recorded): start one holding the
            // whole table, which already includes this change.
            drop(g);
            self.write_state();
            return;
        };
        if let Err(e) = f(log) {
            tracing::error!("state file: {e:#}");
        }
        let live = self.all().iter().filter(|e| e.persistent).count();
        if log.bloated(live) {
            drop(g);
            self.write_state();
        }
    }

    fn record_put(&self, e: &Export) {
        if e.persistent {
            self.record(|log| log.put(&e.spec()));
        }
    }

    /// Rewrite the state file from the live table (compaction) and keep it open.
    pub fn write_state(&self) {
        let Some(path) = &self.state else { return };
        let Ok(mut g) = self.log.lock() else { return };
        let specs: Vec<DeviceSpec> = self
            .all()
            .iter()
            .filter(|e| e.persistent)
            .map(|e| e.spec())
            .collect();
        match state::StateLog::create(path, &specs) {
            Ok(log) => *g = Some(log),
            Err(e) => tracing::error!("cannot write state file {}: {e:#}", path.display()),
        }
    }

    /// Re-attach the devices of the state file that are not attached yet.
    pub fn restore(&self) {
        let Some(path) = &self.state else { return };
        let specs = match state::read(path) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("cannot read state file {}: {e:#}", path.display());
                return;
            }
        };
        for spec in specs {
            let name = name_of(&spec);
            if self.export(&name).is_some() {
                continue;
            }
            match self.attach(spec, true) {
                Ok(_) => tracing::info!("restored device {name:?}"),
                Err(e) => tracing::error!("cannot restore device {name:?}: {}", e.body().message),
            }
        }
        // Start a fresh log holding exactly what is attached now (once there is
        // anything to keep).
        if path.exists() {
            self.write_state();
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

impl Exports for Daemon {
    fn find(&self, name: &str) -> Option<Arc<Device>> {
        self.export(name).map(|e| e.current().0)
    }

    fn names(&self) -> Vec<String> {
        self.exports
            .read()
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default()
    }
}

/// The default state file beside a control socket.
pub fn default_state_path(control: &Path) -> PathBuf {
    control.with_extension("state")
}

//! An export: a named device whose configuration can change while it serves.
//!
//! Contract:
//! - The configuration is an immutable [`Device`] behind an `Arc`, swapped whole
//!   with [`Export::quiesce_and_swap`] and announced by bumping `epoch`. Connections
//!   keep their own `Arc<Device>` and compare epochs before each request (one
//!   atomic load), reloading only when it changed.
//! - Freezing (the loop driver's "freeze queue", but per device and only when
//!   needed): `frozen` is set, new requests park (their reactor registers a
//!   [`Wake`]), and the control thread waits until `in_flight` — requests between
//!   [`Export::enter`] and [`Export::leave`], i.e. with file I/O pending on the old
//!   configuration — drains to zero. Only this export's requests wait; nothing
//!   else is touched. A `set` that changes nothing the data path sees never
//!   freezes (see `Daemon::set`).
//! - `closing` marks a detach in progress: connections stop reading and close
//!   once their requests are answered.
//! - Locks: `current` (RwLock, read on connect and on epoch change only),
//!   `waiters` (held to register or wake), `control` (serialises control
//!   operations on this one export; never taken by reactors).

use super::Device;
use super::range_lock::Wake;
use super::stats::Stats;
use crate::control::proto::DeviceSpec;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

pub struct Export {
    pub name: String,
    /// Recorded in the state file (attached over the control socket).
    pub persistent: bool,
    current: RwLock<Arc<Device>>,
    epoch: AtomicU64,
    in_flight: AtomicU64,
    frozen: AtomicBool,
    closing: AtomicBool,
    clients: AtomicU32,
    /// Whether any client ever connected (autoclear fires only after one did).
    had_client: AtomicBool,
    waiters: Mutex<Vec<Arc<dyn Wake>>>,
    control: Mutex<()>,
    /// The configuration as the user gave it (for `list` and the state file).
    spec: Mutex<DeviceSpec>,
    /// Where to report that an autoclear export lost its last client.
    idle_tx: Mutex<Option<std::sync::mpsc::Sender<String>>>,
    pub stats: Arc<Stats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Export {
    pub fn new(dev: Device, spec: DeviceSpec, persistent: bool) -> Export {
        Export {
            name: dev.name.clone(),
            persistent,
            stats: Arc::clone(&dev.stats),
            current: RwLock::new(Arc::new(dev)),
            epoch: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            frozen: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            clients: AtomicU32::new(0),
            had_client: AtomicBool::new(false),
            waiters: Mutex::new(Vec::new()),
            control: Mutex::new(()),
            spec: Mutex::new(spec),
            idle_tx: Mutex::new(None),
        }
    }

    /// The current configuration and its epoch.
    pub fn current(&self) -> (Arc<Device>, u64) {
        let d = self.current.read().unwrap_or_else(|p| p.into_inner());
        (Arc::clone(&d), self.epoch.load(SeqCst))
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(SeqCst)
    }

    pub fn spec(&self) -> DeviceSpec {
        lock(&self.spec).clone()
    }

    pub fn set_spec(&self, spec: DeviceSpec) {
        *lock(&self.spec) = spec;
    }

    /// Serialise control operations on this export.
    pub fn control(&self) -> MutexGuard<'_, ()> {
        lock(&self.control)
    }

    /// Data path: a request is about to use the configuration. `false` means the
    /// export is frozen: the caller parks and is woken through `waker`.
    pub fn enter(&self, waker: &Arc<dyn Wake>) -> bool {
        self.in_flight.fetch_add(1, SeqCst);
        if !self.frozen.load(SeqCst) {
            return true;
        }
        self.in_flight.fetch_sub(1, SeqCst);
        let mut w = lock(&self.waiters);
        // Re-check under the lock: an unfreeze wakes waiters under it, so either
        // it has already happened (go on) or it will see this registration.
        if !self.frozen.load(SeqCst) {
            drop(w);
            self.in_flight.fetch_add(1, SeqCst);
            return true;
        }
        if !w.iter().any(|x| Arc::ptr_eq(x, waker)) {
            w.push(Arc::clone(waker));
        }
        false
    }

    /// Data path: the request's file I/O is over.
    pub fn leave(&self) {
        self.in_flight.fetch_sub(1, SeqCst);
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(SeqCst)
    }

    /// Freeze, wait for in-flight requests to drain, install `next` (if any),
    /// unfreeze and wake parked requests. Returns how long requests were held.
    pub fn quiesce_and_swap(&self, next: Option<Device>) -> Duration {
        let start = Instant::now();
        self.frozen.store(true, SeqCst);
        let mut spins = 0u32;
        while self.in_flight.load(SeqCst) != 0 {
            spins += 1;
            if spins < 100 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        if let Some(dev) = next {
            *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(dev);
            self.epoch.fetch_add(1, SeqCst);
        }
        let held = start.elapsed();
        let waiters = {
            let mut w = lock(&self.waiters);
            self.frozen.store(false, SeqCst);
            std::mem::take(&mut *w)
        };
        for w in waiters {
            w.wake();
        }
        held
    }

    pub fn clients(&self) -> u32 {
        self.clients.load(SeqCst)
    }

    pub fn client_connected(&self) {
        self.had_client.store(true, SeqCst);
        self.clients.fetch_add(1, SeqCst);
    }

    /// A client went away; returns `true` if it was the last one.
    pub fn client_disconnected(&self) -> bool {
        self.clients.fetch_sub(1, SeqCst) == 1
    }

    pub fn had_client(&self) -> bool {
        self.had_client.load(SeqCst)
    }

    /// Where [`Export::last_client_gone`] reports for autoclear exports.
    pub fn set_idle_notify(&self, tx: std::sync::mpsc::Sender<String>) {
        *lock(&self.idle_tx) = Some(tx);
    }

    /// Called by a reactor when the last client disconnected: an autoclear export
    /// asks the daemon to remove it (the daemon re-checks, a client may be back).
    pub fn last_client_gone(&self) {
        if lock(&self.spec).autoclear {
            if let Some(tx) = lock(&self.idle_tx).as_ref() {
                let _ = tx.send(self.name.clone());
            }
        }
    }

    /// Start a detach: connections stop reading and close when answered.
    pub fn start_closing(&self) {
        self.closing.store(true, SeqCst);
    }

    pub fn closing(&self) -> bool {
        self.closing.load(SeqCst)
    }
}

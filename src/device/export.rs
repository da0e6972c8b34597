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
//! - Clients: a connection counts as a client from the moment its handshake
//!   selects the export ([`Export::join`], which hands out a [`ClientRef`]) until
//!   that reference is dropped with the connection. [`Export::close`] shuts the
//!   door in the same atomic word: once it succeeds no connection can join, so a
//!   detach that finds no clients knows none can appear later. A forced close
//!   also sets `forced`: connections shut their sockets down, cancel their file
//!   I/O and go.
//! - Memory budget: `budget_held` counts the request buffers its connections
//!   hold, so one device's clients can be refused past their share
//!   ([`Export::hold`], one compare-and-swap per request with data) and
//!   `status` can say who holds the budget. A reactor whose request was
//!   refused registers in `share_waiters` ([`Export::wait_share`]) and tries
//!   again; [`Export::unhold`] wakes the registered reactors once this
//!   device's requests gave some back (one subtraction and one load per
//!   request when nobody waits). The counter and the flag saying someone
//!   waits are `SeqCst`, both sides, so the waiter's second try and the
//!   releaser's look cannot both miss each other (see
//!   the engine's budget module, whose orderings these follow).
//! - Holding for the next daemon ([`Export::freeze_for_exit`]): a daemon
//!   leaving a ublk disk to its successor on a kernel that cannot quiesce it
//!   freezes the export for good: requests that arrive from then on park and
//!   are never served (the next daemon gets them again), and the ublk queues
//!   count them ([`Export::note_held`]) so the daemon can wait until they
//!   stop coming before its queues' commands are cancelled.
//! - Locks: `current` (RwLock, read on connect and on epoch change only),
//!   `waiters` and `share_waiters` (held to register or wake), `control`
//!   (serialises control operations on this one export; never taken by
//!   reactors).

use super::live::Device;
use super::range_lock::Wake;
use super::spec::DeviceSpec;
use super::stats::Stats;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

pub struct Export {
    pub name: String,
    /// Recorded in the state file (attached over the control socket).
    pub persistent: bool,
    current: RwLock<Arc<Device>>,
    epoch: AtomicU64,
    in_flight: AtomicU64,
    /// Bytes of the memory budget its requests hold (see [`Export::hold`]).
    budget_held: AtomicUsize,
    /// Kept out of the budget's reserve until then, in [`millis`] (0: not).
    shunned_until: AtomicU64,
    /// Reactors with a request refused by this device's share, woken by
    /// [`Export::unhold`]; `share_wanted` says the list is not empty.
    share_waiters: Mutex<Vec<Arc<dyn Wake>>>,
    share_wanted: AtomicBool,
    frozen: AtomicBool,
    /// Requests that arrived while frozen for good (see [`Export::note_held`]).
    held: AtomicU64,
    /// Client count, with [`CLOSED`] set once no client may join any more.
    clients: AtomicU32,
    /// A forced detach: connections are cut off, not drained.
    forced: AtomicBool,
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

/// Milliseconds since the first call (a monotonic clock for deadlines).
fn millis() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let ms = START.get_or_init(Instant::now).elapsed().as_millis();
    u64::try_from(ms).unwrap_or(u64::MAX)
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
            budget_held: AtomicUsize::new(0),
            shunned_until: AtomicU64::new(0),
            share_waiters: Mutex::new(Vec::new()),
            share_wanted: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            held: AtomicU64::new(0),
            clients: AtomicU32::new(0),
            forced: AtomicBool::new(false),
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

    /// Data path: count `n` bytes of request buffers against this device's
    /// share of the memory budget. `None`: refused (nothing counted), because
    /// its requests already hold some and `n` more would pass `share`. A
    /// device holding nothing may always take one request: `Some(true)` says
    /// it held nothing (it may use the budget's reserve, unless shunned).
    pub fn hold(&self, n: usize, share: usize) -> Option<bool> {
        // SeqCst: a waiter's second try, against `unhold` (module doc).
        self.budget_held
            .fetch_update(SeqCst, SeqCst, |h| {
                (h == 0 || h.saturating_add(n) <= share).then(|| h.saturating_add(n))
            })
            .ok()
            .map(|h| h == 0)
    }

    /// Count `n` bytes whatever the share: a request already taken takes a
    /// buffer back (a spliced read that falls back to copying).
    pub fn hold_taken(&self, n: usize) {
        self.budget_held.fetch_add(n, SeqCst);
    }

    /// One of its connections was cut off for holding budget without reading
    /// its replies: keep the device out of the budget's reserve for `d`, so
    /// that what the cut freed goes to others first.
    pub fn shun(&self, d: Duration) {
        let until = millis().saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.shunned_until.store(until.max(1), Relaxed);
    }

    /// Data path (only for a device that held nothing): whether it is kept out
    /// of the budget's reserve. One load; the clock is read only while a
    /// shunning is recorded.
    pub fn shunned(&self) -> bool {
        let until = self.shunned_until.load(Relaxed);
        if until == 0 {
            return false;
        }
        if millis() < until {
            return true;
        }
        self.shunned_until.store(0, Relaxed);
        false
    }

    /// A request of the reactor `waker` wakes was refused by this device's
    /// share: wake it at the next [`Export::unhold`]. Call before trying
    /// again, so a release between the two is not missed.
    pub fn wait_share(&self, waker: &Arc<dyn Wake>) {
        let mut w = lock(&self.share_waiters);
        if !w.iter().any(|x| Arc::ptr_eq(x, waker)) {
            w.push(Arc::clone(waker));
        }
        self.share_wanted.store(true, SeqCst);
    }

    /// Data path: `n` bytes counted by [`Export::hold`] were freed; a reactor
    /// waiting for this device's share is woken.
    pub fn unhold(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.budget_held.fetch_sub(n, SeqCst);
        if self.share_wanted.load(SeqCst) {
            let waiters = {
                let mut w = lock(&self.share_waiters);
                self.share_wanted.store(false, SeqCst);
                std::mem::take(&mut *w)
            };
            for w in waiters {
                w.wake();
            }
        }
    }

    /// Bytes of the memory budget this device's requests hold now.
    pub fn budget_held(&self) -> usize {
        self.budget_held.load(Relaxed)
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

    /// Freeze for good (the daemon is stopping and leaves the export's block
    /// device to the next daemon): requests arriving from now on park and
    /// are never served. Returns at once; [`Export::in_flight`] says when
    /// those already running are done, [`Export::held`] how many arrived
    /// since.
    pub fn freeze_for_exit(&self) {
        self.frozen.store(true, SeqCst);
    }

    /// A ublk queue parked a newly arrived request on the frozen export (not
    /// a retry of one parked before). Cold path: only while frozen.
    pub fn note_held(&self) {
        self.held.fetch_add(1, Relaxed);
    }

    /// Requests that arrived and were parked since the export was frozen
    /// for good (counted by ublk queues).
    pub fn held(&self) -> u64 {
        self.held.load(Relaxed)
    }

    /// Connections counted as clients (handshakes that selected this export
    /// included).
    pub fn clients(&self) -> u32 {
        self.clients.load(SeqCst) & !CLOSED
    }

    /// A handshake selects this export: count the connection as a client until
    /// the returned reference is dropped. `None` once the export is closed (a
    /// detach has begun or finished): the client is refused as if the export
    /// did not exist.
    pub fn join(self: &Arc<Self>) -> Option<ClientRef> {
        let mut cur = self.clients.load(SeqCst);
        loop {
            if cur & CLOSED != 0 || cur & !CLOSED == !CLOSED {
                return None;
            }
            match self
                .clients
                .compare_exchange_weak(cur, cur + 1, SeqCst, SeqCst)
            {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        self.had_client.store(true, SeqCst);
        Some(ClientRef {
            export: Arc::clone(self),
        })
    }

    /// Close the export to new clients. Without `force` this succeeds only
    /// while it has no client (`Err(n)`: it has `n` and stays open); with it,
    /// connections are told to go. Returns the clients at the moment it closed.
    pub fn close(&self, force: bool) -> Result<u32, u32> {
        if force {
            self.forced.store(true, SeqCst);
            return Ok(self.clients.fetch_or(CLOSED, SeqCst) & !CLOSED);
        }
        match self.clients.compare_exchange(0, CLOSED, SeqCst, SeqCst) {
            Ok(_) => Ok(0),
            Err(n) if n & CLOSED != 0 => Ok(n & !CLOSED),
            Err(n) => Err(n),
        }
    }

    /// Undo a [`Export::close`] that could not be completed (the detach failed
    /// before the export was unpublished).
    pub fn reopen(&self) {
        self.forced.store(false, SeqCst);
        self.clients.fetch_and(!CLOSED, SeqCst);
    }

    /// Whether the export is closed to new clients (a detach has begun).
    pub fn closing(&self) -> bool {
        self.clients.load(SeqCst) & CLOSED != 0
    }

    /// Whether connections must be cut off now (a forced detach).
    pub fn forced(&self) -> bool {
        self.forced.load(SeqCst)
    }

    pub fn had_client(&self) -> bool {
        self.had_client.load(SeqCst)
    }

    /// Where [`Export::last_client_gone`] reports for autoclear exports.
    pub fn set_idle_notify(&self, tx: std::sync::mpsc::Sender<String>) {
        *lock(&self.idle_tx) = Some(tx);
    }

    /// The last client disconnected: an autoclear export asks the daemon to
    /// remove it (the daemon re-checks, a client may be back).
    fn last_client_gone(&self) {
        if lock(&self.spec).autoclear {
            if let Some(tx) = lock(&self.idle_tx).as_ref() {
                let _ = tx.send(self.name.clone());
            }
        }
    }
}

/// The high bit of [`Export::clients`]: the export takes no new clients.
const CLOSED: u32 = 1 << 31;

/// A connection counted as a client of an export (see [`Export::join`]); the
/// count drops when this is dropped, and an autoclear export whose last client
/// left asks to be removed.
pub struct ClientRef {
    export: Arc<Export>,
}

impl ClientRef {
    pub fn export(&self) -> &Arc<Export> {
        &self.export
    }
}

impl Drop for ClientRef {
    fn drop(&mut self) {
        let before = self.export.clients.fetch_sub(1, SeqCst);
        if before & !CLOSED == 1 {
            self.export.last_client_gone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CacheMode, DeviceParams};

    fn export() -> (Arc<Export>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let p = DeviceParams {
            path: dir.path().join("x.img"),
            name: "x".into(),
            cache: CacheMode::Buffered,
            create: Some(1 << 20),
            ..DeviceParams::default()
        };
        let dev = Device::open(&p).unwrap();
        let spec = DeviceSpec {
            image: p.path.clone(),
            name: Some("x".into()),
            offset: 0,
            size_limit: None,
            block_size: None,
            cache: CacheMode::Buffered,
            read_only: false,
            autoclear: false,
            create: None,
            shared: false,
            format: None,
            ..Default::default()
        };
        (Arc::new(Export::new(dev, spec, false)), dir)
    }

    #[test]
    fn close_without_force_refuses_while_a_client_is_joined() {
        let (e, _d) = export();
        let c = e.join().expect("open export takes clients");
        assert_eq!(e.clients(), 1);
        assert_eq!(e.close(false), Err(1));
        assert!(!e.closing());
        drop(c);
        assert_eq!(e.clients(), 0);
        assert_eq!(e.close(false), Ok(0));
        assert!(e.closing());
    }

    #[test]
    fn closed_export_refuses_late_joins_until_reopened() {
        let (e, _d) = export();
        assert_eq!(e.close(false), Ok(0));
        assert!(e.join().is_none(), "a late connection must be refused");
        assert_eq!(e.clients(), 0);
        e.reopen();
        let c = e.join().expect("reopened");
        assert_eq!(e.clients(), 1);
        drop(c);
    }

    #[test]
    fn forced_close_counts_clients_and_marks_forced() {
        let (e, _d) = export();
        let a = e.join().unwrap();
        let b = e.join().unwrap();
        assert_eq!(e.close(true), Ok(2));
        assert!(e.forced() && e.closing());
        assert!(e.join().is_none());
        drop(a);
        drop(b);
        assert_eq!(e.clients(), 0);
    }

    struct Count(std::sync::atomic::AtomicUsize);
    impl Wake for Count {
        fn wake(&self) {
            self.0.fetch_add(1, SeqCst);
        }
    }

    /// A request refused by its device's share is woken when that device's
    /// requests give theirs back — also when no buffer is freed then (a
    /// spliced read), which a wake-up on freed buffers alone would miss.
    #[test]
    fn unhold_wakes_a_reactor_waiting_for_the_share_once() {
        let (e, _d) = export();
        let c = Arc::new(Count(std::sync::atomic::AtomicUsize::new(0)));
        let w: Arc<dyn Wake> = c.clone();
        let share = 8 << 20;
        assert_eq!(e.hold(6 << 20, share), Some(true));
        assert_eq!(e.hold(4 << 20, share), None, "past the share");
        e.unhold(1 << 20);
        assert_eq!(c.0.load(SeqCst), 0, "nobody registered: no wake-up");
        e.wait_share(&w);
        e.wait_share(&w); // registered once
        assert_eq!(e.hold(4 << 20, share), None);
        e.unhold(1 << 20);
        assert_eq!(c.0.load(SeqCst), 1);
        e.unhold(1 << 20);
        assert_eq!(c.0.load(SeqCst), 1, "woken once per registration");
        assert_eq!(e.hold(4 << 20, share), Some(false));
        assert_eq!(e.budget_held(), 7 << 20);
    }

    #[test]
    fn join_and_close_race_never_lose_a_client() {
        // Many joiners against one closer: every join that succeeded is counted
        // in what close saw or made close refuse.
        for _ in 0..200 {
            let (e, _d) = export();
            let joiners: Vec<_> = (0..4)
                .map(|_| {
                    let e = Arc::clone(&e);
                    std::thread::spawn(move || e.join())
                })
                .collect();
            let closed = e.close(false);
            let refs: Vec<ClientRef> = joiners
                .into_iter()
                .filter_map(|j| j.join().unwrap())
                .collect();
            let joined = u32::try_from(refs.len()).unwrap();
            match closed {
                Ok(0) => assert!(
                    e.clients() == joined && joined == 0,
                    "closed with no clients, yet {joined} joined"
                ),
                Ok(n) => panic!("non-forced close returned {n} clients"),
                Err(n) => assert!(n >= 1 && n <= joined),
            }
            drop(refs);
        }
    }
}

//! How other threads reach a reactor: hand it a session, wake or kick it,
//! tell it its peers, ask it to stop. ([`super::spawn`] starts one.)

use super::session::Session;
use crate::device::export::Export;
use crate::device::range_lock::Wake;
use crate::engine::admit::Ticket;
use crate::frontend::ublk::chardev::UblkChar;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ReactorError {
    #[error(
        "cannot create io_uring (is io_uring disabled? see /proc/sys/kernel/io_uring_disabled)"
    )]
    Ring(#[source] std::io::Error),
    #[error("cannot create eventfd")]
    EventFd(#[source] std::io::Error),
    #[error("cannot start reactor thread")]
    Spawn(#[source] std::io::Error),
    #[error("io_uring_enter failed")]
    Enter(#[source] std::io::Error),
}

pub(super) enum Msg {
    /// A session to adopt: a new connection, or one moving here from another
    /// reactor with nothing of it in flight.
    Adopt(Session),
    /// This connection's place went to a newcomer: close it if it is here.
    GiveUp(Arc<Ticket>),
    /// Every reactor of the server (for moving connections), sent once at start,
    /// and whether to follow clients on an idle machine too.
    Peers(Vec<Arc<ReactorHandle>>, bool),
    /// A ublk queue to build and serve here.
    Ublk(UblkQueueSetup),
    /// Stop; `leave_ublk`: see [`ReactorHandle::shutdown_leaving_ublk`].
    Shutdown { leave_ublk: bool },
}

/// How a zero-copy queue's refusal begins when its reactor's fixed-buffer
/// table has no room for it (the daemon then makes the device in copy mode).
pub const NO_FIXED_SLOTS: &str = "no room in this reactor's fixed-buffer table";

/// What a reactor needs to build and serve one ublk queue.
pub struct UblkQueueSetup {
    pub export: Arc<Export>,
    pub char: Arc<UblkChar>,
    pub q_id: u16,
    pub depth: u16,
    pub max_io: u32,
    /// The device was made with `UBLK_F_AUTO_BUF_REG`: the queue takes `depth`
    /// slots of this reactor's fixed-buffer table and works without copies.
    pub zero_copy: bool,
    /// Answered once every tag's fetch is submitted (or with why the queue
    /// could not be built).
    pub ready: Sender<Result<(), String>>,
    /// Dropped when the queue is gone (its commands all completed).
    pub done: Sender<()>,
}

/// Wakes a reactor through its eventfd.
pub struct EventWaker {
    pub(super) fd: OwnedFd,
}

impl Wake for EventWaker {
    fn wake(&self) {
        // Only a counter at its maximum could fail (or block) here, and then a
        // wake-up is pending anyway, so the result does not matter.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }
}

/// How other threads reach a reactor.
pub struct ReactorHandle {
    tx: Mutex<Sender<Msg>>,
    waker: Arc<EventWaker>,
    pub(super) thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Connections living on this reactor (for picking the least loaded).
    pub load: std::sync::atomic::AtomicUsize,
    /// The CPU the reactor thread ran on at its last look (`usize::MAX`: none yet).
    pub(super) cpu: AtomicUsize,
    /// Takes connections moving in: false once the reactor is stopping.
    pub(super) open: AtomicBool,
    /// When (coarse monotonic milliseconds, [`now_ms`]) the thread began its
    /// current turn; zero while it waits on the ring.
    pub(super) turn_since: AtomicU64,
    /// Every session must look at its export again (a detach started): set
    /// by [`ReactorHandle::kick`], taken by the reactor when it wakes.
    pub(super) kicked: AtomicBool,
}

/// A reactor in one turn for longer than this is not making progress.
pub const STUCK_AFTER_MS: u64 = 1000;

/// Coarse monotonic clock in milliseconds (a few ns to read; never zero).
pub(super) fn now_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec to write; CLOCK_MONOTONIC_COARSE exists on
    // every Linux loopd runs on.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    let ms = u64::try_from(ts.tv_sec).unwrap_or(0) * 1000
        + u64::try_from(ts.tv_nsec).unwrap_or(0) / 1_000_000;
    ms.max(1)
}

impl ReactorHandle {
    /// A handle for the reactor reading `tx`'s channel and woken by `waker`
    /// (its thread is set once it runs).
    pub(super) fn new(tx: Sender<Msg>, waker: Arc<EventWaker>) -> ReactorHandle {
        ReactorHandle {
            tx: Mutex::new(tx),
            waker,
            thread: Mutex::new(None),
            load: Default::default(),
            cpu: AtomicUsize::new(usize::MAX),
            open: AtomicBool::new(true),
            turn_since: AtomicU64::new(0),
            kicked: AtomicBool::new(false),
        }
    }

    /// Hand a session (a negotiated connection, [`Session::nbd`]) to this
    /// reactor.
    pub fn adopt(&self, s: Session) {
        self.load.fetch_add(1, Ordering::Relaxed);
        let _ = self.post(Msg::Adopt(s));
    }

    /// Build and serve a ublk queue on this reactor; `q.ready` answers. False
    /// if the reactor is gone.
    pub fn add_ublk_queue(&self, q: UblkQueueSetup) -> bool {
        self.post(Msg::Ublk(q)).is_ok()
    }

    /// Queue `m` for the reactor and wake it; the message comes back if the
    /// reactor is gone (or its channel's lock poisoned).
    fn post(&self, m: Msg) -> Result<(), Msg> {
        let sent = match self.tx.lock() {
            Ok(tx) => tx.send(m).map_err(|e| e.0),
            Err(_) => Err(m),
        };
        self.waker.wake();
        sent
    }

    /// Tell the reactor about every reactor of the server, itself included: its
    /// connections may move to the others (`always`: even on an idle machine).
    pub fn set_peers(&self, all: Vec<Arc<ReactorHandle>>, always: bool) {
        let _ = self.post(Msg::Peers(all, always));
    }

    /// Hand over a session moving from another reactor; it comes back if
    /// this reactor is stopping (or gone).
    pub(super) fn take_moved(&self, s: Session) -> Result<(), Session> {
        if !self.open.load(Ordering::SeqCst) {
            return Err(s);
        }
        self.load.fetch_add(1, Ordering::Relaxed);
        self.post(Msg::Adopt(s)).or_else(|m| {
            self.load.fetch_sub(1, Ordering::Relaxed);
            match m {
                Msg::Adopt(s) => Err(s),
                _ => Ok(()),
            }
        })
    }

    /// The place of the connection holding `t` went to a newcomer: if it
    /// lives here, it is closed (its socket shut down). The accept loop tells
    /// every reactor; one moving meanwhile is closed where it arrives.
    pub fn close_given_up(&self, t: Arc<Ticket>) {
        let _ = self.post(Msg::GiveUp(t));
    }

    /// Whether the reactor is waiting for work or turned within the last
    /// [`STUCK_AFTER_MS`]: false means its thread is held up inside a turn, and
    /// new connections should go elsewhere.
    pub fn making_progress(&self) -> bool {
        let t = self.turn_since.load(Ordering::Relaxed);
        t == 0 || now_ms().saturating_sub(t) <= STUCK_AFTER_MS
    }

    /// Wake the reactor (it re-checks parked requests).
    pub fn wake(&self) {
        self.waker.wake();
    }

    /// Wake the reactor and have every session look at its export again (a
    /// detach started, or the export's configuration changed).
    pub fn kick(&self) {
        self.kicked.store(true, Ordering::SeqCst);
        self.waker.wake();
    }

    /// Ask the reactor to stop: no new requests are read, in-flight requests
    /// finish and are answered, then the thread exits. Returns after it has.
    pub fn shutdown(&self) {
        self.stop(false);
    }

    /// [`ReactorHandle::shutdown`], but ublk queues whose device was left to
    /// the next daemon (not stopped, so their commands never end) do not hold
    /// it up: once only such queues are left, they are let go without freeing
    /// anything the kernel may still write (the process is about to exit,
    /// which ends their commands).
    pub fn shutdown_leaving_ublk(&self) {
        self.stop(true);
    }

    fn stop(&self, leave_ublk: bool) {
        let _ = self.post(Msg::Shutdown { leave_ublk });
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

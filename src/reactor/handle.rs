//! How other threads reach a reactor: hand it a negotiated connection, wake it,
//! tell it its peers, ask it to stop; and [`spawn`], which starts one.

use super::event_loop::Reactor;
use crate::device::export::{ClientRef, Export};
use crate::device::range_lock::Wake;
use crate::engine::admit::{Permit, Ticket};
use crate::engine::budget;
use crate::frontend::nbd::affinity::Peer;
use crate::frontend::nbd::conn::Conn;
use crate::frontend::nbd::tls::TlsIo;
use crate::frontend::ublk::chardev::UblkChar;
use crate::ring::new_ring;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;

/// Kernel worker threads a reactor's ring may run file operations on at once.
const IOWQ_BOUNDED: u32 = 512;

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

/// A negotiated connection, ready for the transmission phase.
pub struct NewConn {
    pub sock: OwnedFd,
    /// Its registration as a client of the export its handshake selected.
    pub client: ClientRef,
    /// Its place among the server's connections.
    pub permit: Permit,
    pub structured: bool,
    /// Extended headers were negotiated (32-byte headers, 64-bit lengths).
    pub extended: bool,
    pub meta_context: bool,
    /// How to find where the client runs.
    pub peer: Peer,
    /// The userspace TLS record layer of an encrypted session the kernel does
    /// not carry (see [`crate::frontend::nbd::tls`]).
    pub tls: Option<Box<TlsIo>>,
    /// TLS was negotiated (kernel or userspace records).
    pub encrypted: bool,
}

pub(super) enum Msg {
    Conn(NewConn),
    /// A connection moving here from another reactor, nothing of it in flight,
    /// with its place's ticket.
    Moved(Box<Conn>, Option<Arc<Ticket>>),
    /// This connection's place went to a newcomer: close it if it is here.
    GiveUp(Arc<Ticket>),
    /// Every reactor of the server (for moving connections), sent once at start,
    /// and whether to follow clients on an idle machine too.
    Peers(Vec<Arc<ReactorHandle>>, bool),
    /// A ublk queue to build and serve here.
    Ublk(UblkQueueSetup),
    Shutdown,
}

/// What a reactor needs to build and serve one ublk queue.
pub struct UblkQueueSetup {
    pub export: Arc<Export>,
    pub char: Arc<UblkChar>,
    pub q_id: u16,
    pub depth: u16,
    pub max_io: u32,
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
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Connections living on this reactor (for picking the least loaded).
    pub load: std::sync::atomic::AtomicUsize,
    /// The CPU the reactor thread ran on at its last look (`usize::MAX`: none yet).
    pub(super) cpu: AtomicUsize,
    /// Takes connections moving in: false once the reactor is stopping.
    pub(super) open: AtomicBool,
    /// When (coarse monotonic milliseconds, [`now_ms`]) the thread began its
    /// current turn; zero while it waits on the ring.
    pub(super) turn_since: AtomicU64,
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
    /// Hand a negotiated connection to this reactor.
    pub fn add(&self, c: NewConn) {
        self.load.fetch_add(1, Ordering::Relaxed);
        let _ = self.post(Msg::Conn(c));
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

    /// Hand over a connection moving from another reactor (with its place's
    /// ticket); it comes back if this reactor is stopping (or gone).
    pub(super) fn take_moved(
        &self,
        c: Box<Conn>,
        t: Option<Arc<Ticket>>,
    ) -> Result<(), (Box<Conn>, Option<Arc<Ticket>>)> {
        if !self.open.load(Ordering::SeqCst) {
            return Err((c, t));
        }
        self.load.fetch_add(1, Ordering::Relaxed);
        self.post(Msg::Moved(c, t)).or_else(|m| {
            self.load.fetch_sub(1, Ordering::Relaxed);
            match m {
                Msg::Moved(c, t) => Err((c, t)),
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

    /// Wake the reactor (it re-checks parked requests and, if the control
    /// generation moved, every connection's export).
    pub fn wake(&self) {
        self.waker.wake();
    }

    /// Ask the reactor to stop: no new requests are read, in-flight requests
    /// finish and are answered, then the thread exits. Returns after it has.
    pub fn shutdown(&self) {
        let _ = self.post(Msg::Shutdown);
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

/// Start a reactor thread. `memory_budget` (bytes; 0 = the default) sets the
/// daemon-wide [`budget`] shared by every reactor.
pub fn spawn(
    id: usize,
    poll_max: Duration,
    memory_budget: usize,
) -> Result<Arc<ReactorHandle>, ReactorError> {
    if memory_budget > 0 {
        budget::global().set_limit(memory_budget);
    }
    // Blocking: io_uring polls it; a non-blocking eventfd could complete the
    // wake-up read with EAGAIN instead of waiting.
    let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
        .map_err(|e| ReactorError::EventFd(e.into()))?;
    let waker = Arc::new(EventWaker { fd: efd });
    let (tx, rx) = channel();
    let handle = Arc::new(ReactorHandle {
        tx: Mutex::new(tx),
        waker: Arc::clone(&waker),
        thread: Mutex::new(None),
        load: Default::default(),
        cpu: AtomicUsize::new(usize::MAX),
        open: AtomicBool::new(true),
        turn_since: AtomicU64::new(0),
    });
    let h2 = Arc::clone(&handle);
    // The ring is created on the reactor thread: it is that thread's alone
    // (IORING_SETUP_SINGLE_ISSUER), and its completions' task work runs only when
    // the thread asks for events (DEFER_TASKRUN), so completions are reaped in
    // batches instead of interrupting the thread one by one.
    let (ready_tx, ready_rx) = channel::<Result<(), std::io::Error>>();
    let thread = std::thread::Builder::new()
        .name(format!("loopd-reactor-{id}"))
        .spawn(move || {
            let ring = match new_ring() {
                Ok(r) => {
                    let _ = ready_tx.send(Ok(()));
                    r
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            // Operations on a hung backing file hold a kernel worker each (reads
            // are not serialised per file as writes are); with the default cap (4
            // per CPU) a few of them would hold every worker, and other devices'
            // syncs and large writes would queue behind them. Workers start only
            // when needed, so a higher cap costs nothing until then.
            let mut max = [IOWQ_BOUNDED, 0];
            if let Err(e) = ring.submitter().register_iowq_max_workers(&mut max) {
                tracing::debug!("reactor {id}: io_uring worker cap unchanged: {e}");
            }
            let mut r = Reactor::new(ring, rx, waker, h2, poll_max);
            if let Err(e) = r.run() {
                tracing::error!("reactor {id} stopped: {e:#}");
            }
        })
        .map_err(ReactorError::Spawn)?;
    match ready_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(ReactorError::Ring(e)),
        Err(_) => {
            return Err(ReactorError::Ring(std::io::Error::other(
                "reactor thread died",
            )));
        }
    }
    if let Ok(mut t) = handle.thread.lock() {
        *t = Some(thread);
    }
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_idle_reactor_makes_progress_and_one_held_in_a_turn_does_not() {
        let r = spawn(0, Duration::ZERO, 0).expect("reactor");
        std::thread::sleep(Duration::from_millis(50));
        assert!(r.making_progress(), "idle, waiting on its ring");
        // As if its thread had begun a turn two seconds ago and not come back.
        r.turn_since
            .store(now_ms() - 2 * STUCK_AFTER_MS, Ordering::Relaxed);
        assert!(!r.making_progress());
        r.turn_since.store(now_ms(), Ordering::Relaxed);
        assert!(r.making_progress(), "a turn that just began");
        r.shutdown();
    }
}
